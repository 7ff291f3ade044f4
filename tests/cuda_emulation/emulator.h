// A CUDA execution model on the CPU, for testing the logic of our CUDA kernels
// (kernels/cuda/*.cu) on machines without a GPU. The kernel sources are compiled by the host
// compiler after a few textual rewrites (translate.cmake: the launches, __shared__,
// reinterpret_cast) and with the built-ins mapped (prelude.h); each launch runs every thread of
// every block as a fiber on the calling thread, so the code paths a GPU would take (indexing, strides,
// grid-stride loops, barriers, warp shuffles, shared memory, launch limits) run and can be
// compared with the CPU references.
//
// What it checks, beyond the arithmetic:
//  - launch limits: more than 1024 threads per block, a grid or block dimension out of range,
//    more than 48 KiB of dynamic shared memory: the launch fails as on a GPU (cudaGetLastError);
//  - barriers: __syncthreads waits for every thread of the block that has not returned, a warp
//    shuffle for every lane of the warp; threads stuck at barriers that can never complete (a
//    barrier in a branch some threads skip) end the launch with kDeadlock;
//  - races that a barrier should have ordered: the schedule (which thread runs first, whether
//    a warp runs ahead of the others) is a parameter, so a test can run a kernel under several
//    orders and expect identical results; shared memory starts each block filled with NaN
//    bytes (0xff);
//  - misaligned vector accesses: reinterpret_cast becomes CheckedCast, which fails the launch
//    as the GPU's "misaligned address" would.
// What it cannot check: the memory model across blocks (blocks run one after another),
// timing, and the device's own math library (host expf / rsqrt stand in for __expf / rsqrtf:
// compare with tolerances).
//
//   fsdp_emu::SetSchedule(fsdp_emu::Schedule::kReverse);
//   MyKernel<<<blocks, threads>>>(...);  // after translate.cmake: runs here, now
//   ASSERT_EQ(cudaGetLastError(), 0);    // fsdp_emu::GetLastError()
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include <vector_types.h>  // dim3, uint3 (host-usable, no CUDA runtime needed)

namespace fsdp_emu {

// Launch results, numbered as the CUDA runtime's cudaError_t.
enum Error : int {
  kSuccess = 0,
  kInvalidValue = 1,
  kInvalidConfiguration = 9,
  kMisalignedAddress = 716,  // a vector access not aligned to its size (CheckedCast)
  kLaunchFailure = 719,      // a trap or assert in a kernel
  kDeadlock = 10000,     // the emulator's own: threads stuck at barriers that cannot complete
};

// Which of the threads ready to run goes first, at the start and after each barrier.
enum class Schedule {
  kForward,   // thread 0, 1, 2, ...
  kReverse,   // the last thread first
  kShuffled,  // a fixed pseudo-random order, new at each barrier
  // Warp 0 runs as far as it can (through its own shuffles, up to a __syncthreads or the
  // end) before warp 1 starts, and so on: a warp racing ahead of the others, e.g. into the
  // next use of a shared scratch array that slower warps are still reading.
  kWarpByWarp,
};
void SetSchedule(Schedule schedule);

struct LaunchConfig {
  dim3 grid;
  dim3 block;
  size_t shared_bytes = 0;
};

// The thread running now (valid inside a kernel only).
struct ThreadContext {
  uint3 thread_idx;
  uint3 block_idx;
  dim3 block_dim;
  dim3 grid_dim;
};
const ThreadContext& Current();

// Runs `body` once per thread of the grid (fibers, block after block). Sets the last error.
void Run(const LaunchConfig& config, const std::function<void()>& body);

// The launch error since the last call, then kSuccess (cudaGetLastError's contract). A trap
// or deadlock is reported by the launch that hit it, as a sticky error is on a GPU.
int GetLastError();
// What went wrong in the last failed launch (deadlock: which threads wait where).
std::string LastErrorMessage();

// __syncthreads.
void SyncThreads();
// A warp-wide exchange of 4- or 8-byte values: lane l receives lane (l ^ lane_mask)'s value.
uint64_t ShuffleXorBits(uint64_t bits, int lane_mask);
template <typename T>
T ShflXor(unsigned /*mask*/, T value, int lane_mask) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= 8, "shuffle of 4 or 8 bytes");
  uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof(T));
  bits = ShuffleXorBits(bits, lane_mask);
  T out;
  std::memcpy(&out, &bits, sizeof(T));
  return out;
}
// The block's dynamic shared memory (extern __shared__), LaunchConfig::shared_bytes long.
void* DynamicShared();
// A static __shared__ array: filled with 0xff bytes by the first thread of each block that
// reaches its declaration.
void PoisonShared(void* data, size_t bytes);
// __trap / a failed device assert: this thread stops, the launch fails with kLaunchFailure.
[[noreturn]] void Trap();
[[noreturn]] void AssertFail(const char* assertion, const char* file, unsigned line,
                             const char* function);
// A misaligned pointer cast inside a kernel: the launch fails with kMisalignedAddress.
[[noreturn]] void Misaligned(uintptr_t address, size_t alignment);

// reinterpret_cast in the kernels (translate.cmake rewrites it to this): a pointer cast to a
// type whose alignment the address lacks is, inside a kernel, the GPU's "misaligned address"
// fault (vector loads and stores need their natural alignment); the host does not fault, so
// the cast checks. Other casts (to uintptr_t, on the host side of a launcher) pass through.
template <typename To, typename From>
To CheckedCast(From from) {
  if constexpr (std::is_pointer_v<To> && std::is_pointer_v<From>) {
    using Pointee = std::remove_cv_t<std::remove_pointer_t<To>>;
    if constexpr (!std::is_void_v<Pointee>) {
      const uintptr_t address = reinterpret_cast<uintptr_t>(from);
      if (address % alignof(Pointee) != 0) Misaligned(address, alignof(Pointee));
    }
  }
  return reinterpret_cast<To>(from);
}

// `kernel<<<grid, block, shared, stream>>>(args...)` after translation:
// Launch(kernel, Config(grid, block, shared, stream))(args...). Arguments are converted to the
// kernel's parameter types once, as a launch copies them, and each thread gets its own copy.
inline LaunchConfig Config(dim3 grid, dim3 block, size_t shared_bytes = 0,
                           const void* /*stream*/ = nullptr) {
  return {grid, block, shared_bytes};
}

template <typename... Params>
struct Launcher {
  void (*kernel)(Params...);
  LaunchConfig config;
  template <typename... Args>
  void operator()(Args&&... args) const {
    std::tuple<std::decay_t<Params>...> copied(static_cast<Params>(std::forward<Args>(args))...);
    auto* k = kernel;
    Run(config, [&] { std::apply(k, copied); });
  }
};

template <typename... Params>
Launcher<Params...> Launch(void (*kernel)(Params...), const LaunchConfig& config) {
  return {kernel, config};
}

}  // namespace fsdp_emu
