#include "tests/cuda_emulation/emulator.h"

#include <ucontext.h>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/common_interface_defs.h>
#define FSDP_EMU_ASAN 1
#else
#define FSDP_EMU_ASAN 0
#endif

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <numeric>
#include <set>
#include <vector>

namespace fsdp_emu {
namespace {

// Note [Fibers for CUDA threads]
// A block's threads are fibers (ucontext) on the calling thread, run by a scheduler loop: it
// resumes every ready fiber, in the order the Schedule gives, until each one returns or waits
// at a barrier (__syncthreads, or one of the two warp barriers of a shuffle). When no fiber is
// ready, the barriers are checked: the block barrier completes once every thread that has not
// returned waits at it, a warp's barrier once every lane of that warp that has not returned
// waits at it. A waiting fiber whose barrier can never complete (nothing ready, nothing
// released) is a deadlock: on a GPU a hang or undefined behaviour, here an error naming where
// each thread waits. Blocks run one after another, so only one block's fibers exist at a time.

// Note [Emulated kernels under ASan]
// The test binary is built with AddressSanitizer (tests/CMakeLists.txt), so a kernel that
// reads or writes outside the tensors it was given (an illegal memory access on a GPU, which
// kills the CUDA context) stops the test with ASan's report, naming the kernel's source line:
// the tests allocate every operand at its exact size, and ATen's CPU allocator goes through
// the malloc that ASan intercepts. The fiber switches are announced to ASan (StartSwitch /
// FinishSwitch) so that it knows which stack is live.

constexpr size_t kStackBytes = 64 * 1024;  // device printf and the kernels' locals fit
constexpr int kWarp = 32;
constexpr size_t kMaxDynamicShared = 48 * 1024;  // without cudaFuncSetAttribute's opt-in

enum class State { kReady, kBlockBarrier, kWarpBarrier, kDone };

// AddressSanitizer's fiber API (no-ops without ASan): every stack switch is announced before
// it (start: the stack switched to; a null save for a fiber that ends) and completed after it
// (finish), so that ASan tracks which stack is live. See Note [Emulated kernels under ASan].
void StartSwitch(void** fake_stack_save, const void* bottom, size_t size) {
#if FSDP_EMU_ASAN
  __sanitizer_start_switch_fiber(fake_stack_save, bottom, size);
#else
  (void)fake_stack_save, (void)bottom, (void)size;
#endif
}
void FinishSwitch(void* fake_stack_save, const void** old_bottom, size_t* old_size) {
#if FSDP_EMU_ASAN
  __sanitizer_finish_switch_fiber(fake_stack_save, old_bottom, old_size);
#else
  (void)fake_stack_save, (void)old_bottom, (void)old_size;
#endif
}

struct Fiber {
  ucontext_t context;
  State state = State::kReady;
  ThreadContext thread;
  int linear = 0;
};

struct BlockRun {
  ucontext_t scheduler;
  std::vector<Fiber> fibers;
  Fiber* current = nullptr;
  const std::function<void()>* body = nullptr;
  std::vector<uint64_t> exchange;  // one shuffle slot per thread
  std::vector<unsigned char> dynamic_shared;
  std::set<void*> poisoned;  // static shared arrays filled in this block
  bool trapped = false;
  int trap_error = kLaunchFailure;
  std::string trap_message = "a thread trapped (device-side assert or __trap)";
};

Schedule g_schedule = Schedule::kForward;
BlockRun* g_run = nullptr;
int g_last_error = kSuccess;
std::string g_last_message;
std::vector<std::unique_ptr<char[]>> g_stacks;  // reused by every launch
const void* g_scheduler_stack = nullptr;  // the scheduler's stack, as ASan reports it
size_t g_scheduler_stack_size = 0;

void Fail(int error, std::string message) {
  g_last_error = error;
  g_last_message = std::move(message);
}

void Switch() {  // from the running fiber back to the scheduler
  Fiber* self = g_run->current;
  void* fake_stack = nullptr;
  StartSwitch(&fake_stack, g_scheduler_stack, g_scheduler_stack_size);
  swapcontext(&self->context, &g_run->scheduler);
  FinishSwitch(fake_stack, &g_scheduler_stack, &g_scheduler_stack_size);
}

void Entry() {
  FinishSwitch(nullptr, &g_scheduler_stack, &g_scheduler_stack_size);
  (*g_run->body)();
  g_run->current->state = State::kDone;
  StartSwitch(nullptr, g_scheduler_stack, g_scheduler_stack_size);  // this fiber ends
  // Returning resumes uc_link: the scheduler.
}

uint64_t NextRandom(uint64_t& state) {
  state = state * 6364136223846793005ull + 1442695040888963407ull;
  return state >> 33;
}

uint3 Uint3(unsigned x, unsigned y, unsigned z) {
  uint3 u;
  u.x = x;
  u.y = y;
  u.z = z;
  return u;
}

std::string Dim(const dim3& d) {
  return "(" + std::to_string(d.x) + ", " + std::to_string(d.y) + ", " + std::to_string(d.z) + ")";
}

std::string CheckConfig(const LaunchConfig& c) {
  const dim3& b = c.block;
  const dim3& g = c.grid;
  if (b.x == 0 || b.y == 0 || b.z == 0 || g.x == 0 || g.y == 0 || g.z == 0) {
    return "a grid or block dimension is 0: grid " + Dim(g) + ", block " + Dim(b);
  }
  if (b.x > 1024 || b.y > 1024 || b.z > 64 ||
      static_cast<uint64_t>(b.x) * b.y * b.z > 1024) {
    return "block " + Dim(b) + " exceeds 1024 threads (x, y <= 1024, z <= 64)";
  }
  if (g.x > 0x7fffffffu || g.y > 65535 || g.z > 65535) {
    return "grid " + Dim(g) + " exceeds (2^31 - 1, 65535, 65535)";
  }
  if (c.shared_bytes > kMaxDynamicShared) {
    return std::to_string(c.shared_bytes) + " bytes of dynamic shared memory exceed 48 KiB";
  }
  return "";
}

std::string DescribeDeadlock(const BlockRun& run) {
  int block_waits = 0, warp_waits = 0, done = 0;
  std::string warps;
  for (const Fiber& f : run.fibers) {
    if (f.state == State::kBlockBarrier) ++block_waits;
    if (f.state == State::kDone) ++done;
    if (f.state == State::kWarpBarrier) {
      if (warp_waits++ < 4) warps += " " + std::to_string(f.linear);
    }
  }
  const ThreadContext& t = run.fibers.front().thread;
  return "deadlock in block " + Dim(dim3(t.block_idx.x, t.block_idx.y, t.block_idx.z)) + ": " +
         std::to_string(block_waits) + " thread(s) wait at __syncthreads, " +
         std::to_string(warp_waits) + " at a warp shuffle (threads" + warps +
         (warp_waits > 4 ? " ..." : "") + "), " + std::to_string(done) +
         " returned; a barrier some threads of the block (or warp) never reach";
}

// Releases the warp barrier of the warp starting at thread `base` if all its lanes that have
// not returned wait at it.
bool ReleaseWarp(BlockRun& run, int base) {
  const int end = std::min(static_cast<int>(run.fibers.size()), base + kWarp);
  bool waiting = false, complete = true;
  for (int i = base; i < end; ++i) {
    const State s = run.fibers[i].state;
    if (s == State::kDone) continue;
    waiting |= s == State::kWarpBarrier;
    complete &= s == State::kWarpBarrier;
  }
  if (!waiting || !complete) return false;
  for (int i = base; i < end; ++i) {
    if (run.fibers[i].state == State::kWarpBarrier) run.fibers[i].state = State::kReady;
  }
  return true;
}

// Releases the barriers that are complete; false when none is.
bool ReleaseBarriers(BlockRun& run) {
  bool any_live = false, all_at_block = true;
  for (const Fiber& f : run.fibers) {
    if (f.state == State::kDone) continue;
    any_live = true;
    all_at_block &= f.state == State::kBlockBarrier;
  }
  if (any_live && all_at_block) {
    for (Fiber& f : run.fibers) {
      if (f.state == State::kBlockBarrier) f.state = State::kReady;
    }
    return true;
  }
  bool released = false;
  for (int base = 0; base < static_cast<int>(run.fibers.size()); base += kWarp) {
    released |= ReleaseWarp(run, base);
  }
  return released;
}

// Runs fiber i until it waits or returns, if it is ready. Not inlined: swapcontext returns
// twice, so the callers' loop variables are kept out of its frame (-Wclobbered).
[[gnu::noinline]] void Resume(BlockRun& run, int i) {
  Fiber& f = run.fibers[i];
  if (f.state != State::kReady) return;
  run.current = &f;
  void* fake_stack = nullptr;
  StartSwitch(&fake_stack, g_stacks[i].get(), kStackBytes);
  swapcontext(&run.scheduler, &f.context);
  FinishSwitch(fake_stack, nullptr, nullptr);
  run.current = nullptr;
}

// Thread i of block `block_idx`, ready to start the kernel (not inlined: getcontext returns
// twice, as Resume's swapcontext).
[[gnu::noinline]] void InitFiber(BlockRun& run, const LaunchConfig& c, uint3 block_idx, int i) {
  Fiber& f = run.fibers[i];
  f.state = State::kReady;
  f.linear = i;
  f.thread.thread_idx =
      Uint3(i % c.block.x, (i / c.block.x) % c.block.y, i / (c.block.x * c.block.y));
  f.thread.block_idx = block_idx;
  f.thread.block_dim = c.block;
  f.thread.grid_dim = c.grid;
  getcontext(&f.context);
  f.context.uc_stack.ss_sp = g_stacks[i].get();
  f.context.uc_stack.ss_size = kStackBytes;
  f.context.uc_link = &run.scheduler;
  makecontext(&f.context, Entry, 0);
}

// Runs one block to completion; false (with the error set) on a trap or deadlock.
bool RunBlock(BlockRun& run, const LaunchConfig& c, uint3 block_idx, uint64_t& random) {
  const int n = static_cast<int>(run.fibers.size());
  for (int i = 0; i < n; ++i) InitFiber(run, c, block_idx, i);
  std::fill(run.dynamic_shared.begin(), run.dynamic_shared.end(), 0xff);
  run.poisoned.clear();
  std::vector<int> order(n);
  std::iota(order.begin(), order.end(), 0);
  if (g_schedule == Schedule::kReverse) std::reverse(order.begin(), order.end());
  for (;;) {
    if (g_schedule == Schedule::kWarpByWarp) {
      // Each warp as far as its own barriers let it, before the next warp starts.
      for (int base = 0; base < n; base += kWarp) {
        do {
          for (int i = base; i < std::min(n, base + kWarp) && !run.trapped; ++i) Resume(run, i);
          if (run.trapped) return false;
        } while (ReleaseWarp(run, base));
      }
    } else {
      if (g_schedule == Schedule::kShuffled) {
        for (int i = n - 1; i > 0; --i) std::swap(order[i], order[NextRandom(random) % (i + 1)]);
      }
      for (int i : order) {
        Resume(run, i);
        if (run.trapped) return false;  // the grid stops, as at a device-side trap
      }
    }
    if (std::all_of(run.fibers.begin(), run.fibers.end(),
                    [](const Fiber& f) { return f.state == State::kDone; })) {
      return true;
    }
    if (!ReleaseBarriers(run)) {
      Fail(kDeadlock, DescribeDeadlock(run));
      return false;
    }
  }
}

}  // namespace

#if FSDP_EMU_ASAN
// libtorch keeps static allocations until exit, which LeakSanitizer would report as leaks
// and fail every test with; the emulator is here for memory errors, not leaks. On a machine
// with a GPU, ATen's seeding queries the CUDA driver, whose address-space reservations need
// the shadow gap unprotected (the CUDA + ASan setting).
extern "C" const char* __asan_default_options() {
  return "detect_leaks=0:protect_shadow_gap=0";
}
#endif

void SetSchedule(Schedule schedule) { g_schedule = schedule; }

const ThreadContext& Current() {
  if (g_run == nullptr || g_run->current == nullptr) {
    std::fprintf(stderr, "fsdp_emu: a CUDA built-in (threadIdx, ...) read outside a kernel\n");
    std::abort();
  }
  return g_run->current->thread;
}

void Run(const LaunchConfig& config, const std::function<void()>& body) {
  if (g_run != nullptr) {
    Fail(kInvalidValue, "a kernel launched from inside a kernel (dynamic parallelism)");
    return;
  }
  std::string invalid = CheckConfig(config);
  if (!invalid.empty()) {
    Fail(kInvalidConfiguration, "invalid launch configuration: " + invalid);
    return;
  }
  const int threads = static_cast<int>(config.block.x * config.block.y * config.block.z);
  while (static_cast<int>(g_stacks.size()) < threads) {
    g_stacks.push_back(std::make_unique<char[]>(kStackBytes));
  }
  BlockRun run;
  run.fibers.resize(threads);
  run.body = &body;
  run.exchange.assign(threads, 0);
  run.dynamic_shared.resize(config.shared_bytes);
  g_run = &run;
  uint64_t random = 0x9e3779b97f4a7c15ull;
  bool ok = true;
  for (unsigned z = 0; ok && z < config.grid.z; ++z) {
    for (unsigned y = 0; ok && y < config.grid.y; ++y) {
      for (unsigned x = 0; ok && x < config.grid.x; ++x) {
        ok = RunBlock(run, config, Uint3(x, y, z), random);
      }
    }
  }
  if (run.trapped) Fail(run.trap_error, run.trap_message);
  g_run = nullptr;
}

int GetLastError() {
  int error = g_last_error;
  g_last_error = kSuccess;
  return error;
}

std::string LastErrorMessage() { return g_last_message; }

void SyncThreads() {
  g_run->current->state = State::kBlockBarrier;
  Switch();
}

uint64_t ShuffleXorBits(uint64_t bits, int lane_mask) {
  Fiber* self = g_run->current;
  const int lane = self->linear % kWarp, base = self->linear - lane;
  g_run->exchange[self->linear] = bits;
  self->state = State::kWarpBarrier;  // every lane has written its value
  Switch();
  const int partner = base + (lane ^ lane_mask);
  // A partner outside the block (a partial last warp) or one that returned: undefined on a
  // GPU; the lane keeps its own value.
  uint64_t out = bits;
  if (partner < static_cast<int>(g_run->fibers.size()) &&
      g_run->fibers[partner].state != State::kDone) {
    out = g_run->exchange[partner];
  }
  self->state = State::kWarpBarrier;  // every lane has read before any writes again
  Switch();
  return out;
}

void* DynamicShared() { return g_run->dynamic_shared.data(); }

void PoisonShared(void* data, size_t bytes) {
  if (g_run->poisoned.insert(data).second) std::memset(data, 0xff, bytes);
}

void Misaligned(uintptr_t address, size_t alignment) {
  if (g_run == nullptr || g_run->current == nullptr) {
    std::fprintf(stderr, "fsdp_emu: CheckedCast of a misaligned pointer outside a kernel\n");
    std::abort();
  }
  const ThreadContext& t = Current();
  g_run->trap_error = kMisalignedAddress;
  char message[256];
  std::snprintf(message, sizeof(message),
                "misaligned address: 0x%lx cast to a type aligned to %zu bytes, in block "
                "(%u, %u, %u), thread (%u, %u, %u)",
                static_cast<unsigned long>(address), alignment, t.block_idx.x, t.block_idx.y,
                t.block_idx.z, t.thread_idx.x, t.thread_idx.y, t.thread_idx.z);
  g_run->trap_message = message;
  Trap();
}

void Trap() {
  g_run->trapped = true;
  g_run->current->state = State::kDone;
  StartSwitch(nullptr, g_scheduler_stack, g_scheduler_stack_size);  // this fiber ends
  swapcontext(&g_run->current->context, &g_run->scheduler);  // never resumed
  std::abort();
}

void AssertFail(const char* assertion, const char* file, unsigned line, const char* function) {
  const ThreadContext& t = Current();
  std::fprintf(stderr, "%s:%u: %s: block [%u,%u,%u], thread [%u,%u,%u] Assertion `%s` failed.\n",
               file, line, function, t.block_idx.x, t.block_idx.y, t.block_idx.z,
               t.thread_idx.x, t.thread_idx.y, t.thread_idx.z, assertion);
  Trap();
}

}  // namespace fsdp_emu
