#include "sharding/deferred_init.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

namespace fsdp {
namespace {

uint64_t SplitMix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

uint64_t HashName(const std::string& name) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (unsigned char c : name) h = (h ^ c) * 1099511628211ull;
  return h;
}

// Uniform in (0, 1) from a 64-bit hash: 53 bits, never exactly 0.
double Unit(uint64_t bits) { return (static_cast<double>(bits >> 11) + 0.5) / 9007199254740992.0; }

double Value(const InitSpec& spec, uint64_t key, int64_t index) {
  switch (spec.kind) {
    case InitSpec::Kind::kConstant:
      return spec.a;
    case InitSpec::Kind::kUniform:
      return spec.a + (spec.b - spec.a) * Unit(SplitMix64(key ^ static_cast<uint64_t>(index)));
    case InitSpec::Kind::kNormal: {
      uint64_t h = SplitMix64(key ^ static_cast<uint64_t>(index));
      double u1 = Unit(h), u2 = Unit(SplitMix64(h));
      return spec.a + spec.b * std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2);
    }
  }
  return 0;
}

// Runs fn(lo, hi) over [0, n) split across the rank's intra-op thread count (at::
// get_num_threads: OMP_NUM_THREADS, which the launcher sets to cores / ranks). Plain threads:
// at::parallel_for is sequential in code built without -fopenmp (its OpenMP body is inline in
// ATen's headers), and the project must not add -fopenmp (../shared/LIBTORCH-NOTES.md).
void ParallelRange(int64_t n, const std::function<void(int64_t, int64_t)>& fn) {
  constexpr int64_t kMinPerThread = int64_t{1} << 16;
  const int64_t threads =
      std::clamp<int64_t>(n / kMinPerThread, 1, std::max(1, at::get_num_threads()));
  const int64_t per = (n + threads - 1) / threads;
  std::vector<std::thread> pool;
  for (int64_t t = 1; t < threads; ++t) {
    pool.emplace_back([&fn, t, per, n] { fn(t * per, std::min(n, (t + 1) * per)); });
  }
  fn(0, std::min(n, per));
  for (std::thread& th : pool) th.join();
}

// Each value in double, rounded once to out's dtype by copy_. Values are a pure function of
// the element's index, so the elements are computed on the rank's threads (ParallelRange) with
// results independent of their number, in chunks that bound the double temporary (a
// vocabulary x dim embedding would need GBs at once) and, for a CUDA `out`, let each chunk's
// copy follow its computation. ~30 ns per normal value on one core: minutes for billions of
// parameters on one thread.
void Fill(const InitSpec& spec, uint64_t key, int64_t first_element, at::Tensor& out) {
  const int64_t n = out.numel();
  constexpr int64_t kChunk = int64_t{1} << 22;  // 32 MiB of doubles
  const bool contiguous = out.is_contiguous();
  at::Tensor values = at::empty({contiguous ? std::min(n, kChunk) : n}, at::kDouble);
  at::Tensor flat = contiguous ? out.view({-1}) : at::Tensor();
  for (int64_t begin = 0; begin < n; begin += values.numel()) {
    const int64_t len = std::min(values.numel(), n - begin);
    double* data = values.data_ptr<double>();
    ParallelRange(len, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) data[i] = Value(spec, key, first_element + begin + i);
    });
    if (contiguous) {
      flat.narrow(0, begin, len).copy_(values.narrow(0, 0, len));
    } else {
      out.copy_(values.view(out.sizes()));  // one chunk: the whole tensor
    }
  }
}

}  // namespace

at::Tensor DeferredTensor(const std::vector<int64_t>& shape, c10::TensorOptions options) {
  // Metadata only: the sizes are set on a tensor whose storage stays empty (no bounds check).
  at::Tensor t = at::empty({0}, options);
  t.unsafeGetTensorImpl()->set_sizes_contiguous(shape);
  return t;
}

bool IsDeferred(const at::Tensor& t) {
  return t.numel() > 0 &&
         t.storage().nbytes() < static_cast<size_t>(t.numel()) * t.element_size();
}

ParamInitFn SeededInit(uint64_t seed, std::function<InitSpec(const std::string& name)> spec_of) {
  return [seed, spec_of](const std::string& name, int64_t first_row, int64_t row_numel,
                         at::Tensor& rows) {
    Fill(spec_of(name), SplitMix64(seed ^ HashName(name)), first_row * row_numel, rows);
  };
}

at::Tensor SeededFull(uint64_t seed, const std::string& name, const std::vector<int64_t>& shape,
                      const InitSpec& spec) {
  at::Tensor full = at::empty(shape, at::kFloat);
  Fill(spec, SplitMix64(seed ^ HashName(name)), 0, full);
  return full;
}

}  // namespace fsdp
