#include "sharding/host_loops.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>

#if defined(__x86_64__)
#include <immintrin.h>
#define FSDP_AVX2_F16C __attribute__((target("avx2,f16c")))
#else
#define FSDP_AVX2_F16C
#endif

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include "sharding/host_simd.h"

namespace fsdp {

// Note [Host loops]
// Offload's host work (the deferred gradients' additions and the AdamW update, sharding/
// offload/) is a few passes over hundreds of MiB of pinned memory per step, and its speed is
// the host's memory bandwidth on all of its cores. ATen's ops get there on whole tensors but not
// on the slices offload works in: every op forks and joins ATen's OpenMP threads (~200 us on the
// H100 machine's 16 cores), and at::parallel_for in our code runs on the calling thread only
// (docs/architecture.md). So these loops run on a pool of our own, made at first use with
// at::get_num_threads() - 1 threads (the caller is the last), woken once per call;
// FSDP_OFFLOAD_HOST_THREADS (read when offload is set up) changes how many take part.
//
// A call's range is cut into parts of at least min_part elements, up to kPartsPerThread per
// thread, that the threads claim one at a time: a thread that shares its core with the training
// thread (a delayed update runs beside the next step's forward) or with another process does
// fewer parts instead of holding up the call. `fsdp bench host` (bench/host.cc) times the loops
// against ATen's ops with threads spinning beside them; docs/offload.md has the 2-core CI
// machine's figures (the step's loop 0.47-0.54x of ATen's ops idle, 0.36-0.55x beside spinning
// threads). Whether fewer threads than cores (FSDP_OFFLOAD_HOST_THREADS) is better beside a
// spinning training thread is for a machine with many cores to show.

namespace {

constexpr int kPartsPerThread = 4;
// HostAddConverted's smallest part, 640 KiB of its bytes: tens of microseconds of a core's
// bandwidth, against the microsecond a claim costs.
constexpr int64_t kMinPart = int64_t{1} << 16;

class Workers {
 public:
  static Workers& Get() {
    static Workers* workers = new Workers(std::max(1, at::get_num_threads()));  // kept
    return *workers;
  }

  // The threads a Run uses, the caller included.
  int size() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return active_;
  }

  int Resize(int threads) {
    std::lock_guard<std::mutex> one_at_a_time(run_mutex_);
    std::lock_guard<std::mutex> lock(mutex_);
    const int before = active_;
    active_ = std::max(1, threads);
    while (started_ + 1 < active_) StartWorker();
    return before;
  }

  // fn(part) for every part in [0, parts), on the first size() - 1 workers and the calling
  // thread. Each Run is a job of its own that the workers take a reference to, so a worker still
  // finishing one job never claims a part of the next.
  void Run(int parts, const std::function<void(int)>& fn) {
    std::lock_guard<std::mutex> one_at_a_time(run_mutex_);
    std::shared_ptr<Job> job;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      job = std::make_shared<Job>(fn, parts, active_ - 1);
      job_ = job;
    }
    wake_.notify_all();
    Finish(*job, job->Work());
    std::unique_lock<std::mutex> lock(mutex_);
    finished_.wait(lock, [&] { return job->done == parts; });
  }

 private:
  struct Job {
    Job(const std::function<void(int)>& fn, int parts, int workers)
        : fn(fn), parts(parts), workers(workers) {}
    // The parts this thread claimed and ran.
    int Work() {
      int count = 0;
      for (int part = next.fetch_add(1); part < parts; part = next.fetch_add(1)) {
        fn(part);
        ++count;
      }
      return count;
    }
    const std::function<void(int)>& fn;  // Run's, alive until every part is done
    const int parts;
    const int workers;  // the workers with a lower index take part
    std::atomic<int> next{0};
    int done = 0;  // under mutex_
  };

  explicit Workers(int threads) : active_(threads) {
    std::lock_guard<std::mutex> lock(mutex_);
    while (started_ + 1 < active_) StartWorker();
  }

  void StartWorker() {  // under mutex_
    const int index = started_++;
    std::thread([this, index] { Loop(index); }).detach();
  }

  void Finish(Job& job, int count) {
    std::lock_guard<std::mutex> lock(mutex_);
    job.done += count;
    if (job.done == job.parts) finished_.notify_one();
  }

  void Loop(int index) {
    std::shared_ptr<Job> seen;
    while (true) {
      std::shared_ptr<Job> job;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return job_ != seen; });
        job = seen = job_;
      }
      if (index < job->workers) Finish(*job, job->Work());
    }
  }

  mutable std::mutex mutex_;
  std::mutex run_mutex_;
  std::condition_variable wake_, finished_;
  int active_;                // under mutex_
  int started_ = 0;           // workers started, under mutex_
  std::shared_ptr<Job> job_;  // the newest Run's, under mutex_
};

template <HostNarrow kType>
FSDP_AVX2_F16C void AddLoop(float* dst, const uint16_t* src, int64_t begin, int64_t end) {
  int64_t i = begin;
#if defined(__x86_64__)
  for (; i + 8 <= end; i += 8) {
    __m256 s;
    if constexpr (kType == HostNarrow::kBFloat16) {
      s = Bf16x8ToFloats(src + i);
    } else {
      s = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
    }
    _mm256_storeu_ps(dst + i, _mm256_add_ps(_mm256_loadu_ps(dst + i), s));
  }
  for (; i < end; ++i) {
    if constexpr (kType == HostNarrow::kBFloat16) {
      dst[i] += Bf16ToFloat(src[i]);
    } else {
      dst[i] += _cvtsh_ss(src[i]);
    }
  }
#else
  TORCH_INTERNAL_ASSERT(false, "HostAddConverted: not available here");
#endif
}

}  // namespace

// dst (fp32, host) += src (a narrower float dtype, same numel), each element dst + float(src)
// rounded once: what dst.add_(src.to(dst's dtype)) gives, without ATen's mixed-dtype add_ (not
// vectorised, ~9x slower per byte: docs/offload.md) or a full-size temporary. A chunk at a time
// (scratch's numel: offload's step slice, FSDP_OFFLOAD_STEP_SLICE, 16 MiB by default) is
// converted into `scratch` (fp32, reused across calls) and added, both with ATen's vectorised
// kernels on all of its threads: one chunk after the other, each op's fork and join amortised
// over the chunk (the sliced step's reason, kDefaultStepSlice in offload/host_step.h).
void AddConvertedInChunks(const at::Tensor& dst, const at::Tensor& src, const at::Tensor& scratch) {
  at::Tensor d = dst.view(-1);
  at::Tensor s = src.view(-1);
  TORCH_INTERNAL_ASSERT(d.numel() == s.numel() && scratch.dtype() == d.dtype());
  const int64_t chunk = scratch.numel();
  for (int64_t i = 0; i < d.numel(); i += chunk) {
    const int64_t n = std::min(chunk, d.numel() - i);
    at::Tensor part = scratch.narrow(0, 0, n);
    part.copy_(s.narrow(0, i, n));  // exact: fp32 holds every bf16 / fp16 value
    d.narrow(0, i, n).add_(part);
  }
}

int HostLoopThreads() { return Workers::Get().size(); }

int SetHostLoopThreads(int threads) { return Workers::Get().Resize(threads); }

void HostParallelFor(int64_t n, int64_t min_part, const std::function<void(int64_t, int64_t)>& fn) {
  TORCH_INTERNAL_ASSERT(min_part > 0 && min_part % 16 == 0);
  if (n <= 0) return;
  Workers& workers = Workers::Get();
  const int threads = workers.size();
  const int64_t most = static_cast<int64_t>(kPartsPerThread) * threads;
  const int64_t wanted = std::clamp<int64_t>((n + min_part - 1) / min_part, 1, most);
  if (wanted == 1 || threads == 1) {
    fn(0, n);
    return;
  }
  const int64_t per = ((n + wanted - 1) / wanted + 15) / 16 * 16;
  const int parts = static_cast<int>((n + per - 1) / per);
  workers.Run(parts, [&](int part) {
    const int64_t begin = part * per;
    fn(begin, std::min(n, begin + per));
  });
}

bool HostAddConvertedAvailable(HostNarrow type) {
#if defined(__x86_64__)
  if (!__builtin_cpu_supports("avx2")) return false;
  return type == HostNarrow::kBFloat16 || __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

void HostAddConverted(float* dst, const uint16_t* src, HostNarrow type, int64_t n) {
  TORCH_INTERNAL_ASSERT(HostAddConvertedAvailable(type), "HostAddConverted: not available here");
  HostParallelFor(n, kMinPart, [&](int64_t begin, int64_t end) {
    if (type == HostNarrow::kBFloat16) {
      AddLoop<HostNarrow::kBFloat16>(dst, src, begin, end);
    } else {
      AddLoop<HostNarrow::kHalf>(dst, src, begin, end);
    }
  });
}

}  // namespace fsdp
