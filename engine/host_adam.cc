#include "engine/host_adam.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <string>

#if defined(__x86_64__)
#include <immintrin.h>
#define FSDP_AVX2_FMA __attribute__((target("avx2,fma")))
#else
#define FSDP_AVX2_FMA
#endif

#include <ATen/ATen.h>
#include <ATen/Version.h>
#include <ATen/core/grad_mode.h>

#include "sharding/host_loops.h"
#include "sharding/host_simd.h"

namespace fsdp {

// Note [Host Adam pass]
// Offload params with bf16 compute steps each parameter on the host from its bf16 gradient (Note
// [Deferred gradient conversion], sharding/offload/deferred_grads.h). Done with ATen's ops that is
// four passes over the parameter's bytes: the gradient's conversion into fp32, clipping's
// multiplication, the fused AdamW, the cast of the updated master to bf16, ~48 bytes per parameter,
// and on the H100 machine the host step, not the GPU, was the step's bound (docs/offload.md). Here
// one loop per element reads the bf16 gradient and the fp32 master and moments and writes those and
// the bf16 copy: 28 bytes.
//
// The values are ATen's, bit for bit (HostAdamPassTest checks it against _fused_adamw_ and
// _fused_adam_ over sizes with and without a tail, and HostAdamPassAvailable checks it once on
// the machine at hand). Its CPU kernel (FusedAdamKernel.cpp) is built with floating-point
// contraction, so its arithmetic is, per element in float (found by comparing candidates with
// torch 2.11's AVX-512 kernel, all of whose outputs they then matched):
//   g = grad; AdamW: p = p * float(1 - lr * wd) (Adam's L2 decay, g + wd * p, rounds in a way
//       this does not reproduce on the scalar tail: not covered, HostAdamPassCovers)
//   m = fma(w, g - m, m) when |w| < 0.5, else fma(w - 1, g - m, g); w = float(1 - beta1)
//   v = fma(float(1 - beta2) * g, g, v * float(beta2)); on the scalar tail (the last
//       numel % vector-width elements of the tensor, less the 8-float blocks its compiler
//       vectorised there on the AVX-512 build) fma(v, float(beta2), (float(1 - beta2) * g) * g)
//   p = p + (float(-step_size) * m) / (sqrt(v) / float(sqrt(bias_correction2)) + float(eps))
// with step_size = lr / (1 - beta1^step) and the bias corrections in double. The loop runs 8
// floats at a time with AVX2 intrinsics, the rest in scalar code; this file is compiled without
// contraction (CMakeLists.txt) so that only these fused multiply-adds fuse. The bf16 copy is
// round-to-nearest-even, as copy_ (NaN: 0x7fc0). Measured on the 2-core CI machine (48e6
// parameters, AVX-512 ATen kernels): 27.4 ms against 52.4 ms for the four ATen ops (47.5 against
// 114 with a build beside it); on the H100 machine's 16 cores, not yet (gpu_check's offload rows:
// rank_stats `host_passes`).

namespace {

// ATen's float vector width on this machine when it runs kernels the pass can match (AVX2 or
// AVX-512 on a CPU with FMA), else 0.
int CandidateLanes() {
#if defined(__x86_64__)
  if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) return 0;
  const std::string capability = at::get_cpu_capability();
  if (capability == "AVX512") return 16;
  if (capability == "AVX2") return 8;
#endif
  return 0;
}

struct Args {
  float scale, decay, w, w_minus_1, beta2, c2, neg_step_size, bc2_sqrt, eps;
  float* param;
  float* exp_avg;
  float* exp_avg_sq;
  const void* grad;  // bf16 (uint16_t) or fp32, as Loop's G
  uint16_t* copy;
};

[[gnu::always_inline]] inline uint16_t FloatToBf16(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t nan = 0u - static_cast<uint32_t>(f != f);  // all ones for a NaN (no branch)
  return static_cast<uint16_t>((rounded & ~nan) | (0x7fc0u & nan));
}

// The gradient as a float (a bf16's widening is exact).
[[gnu::always_inline]] inline float GradAt(const uint16_t* g, int64_t i) {
  return Bf16ToFloat(g[i]);
}
[[gnu::always_inline]] inline float GradAt(const float* g, int64_t i) { return g[i]; }

#if defined(__x86_64__)
FSDP_AVX2_FMA [[gnu::always_inline]] inline __m256 GradsAt(const uint16_t* g, int64_t i) {
  return Bf16x8ToFloats(g + i);
}
FSDP_AVX2_FMA [[gnu::always_inline]] inline __m256 GradsAt(const float* g, int64_t i) {
  return _mm256_loadu_ps(g + i);
}
#endif

// kTail: the elements ATen's scalar loop steps (the last numel % vector-width of the tensor).
// Elements [begin, end) with one formula, kTail or not; the loop 8 floats at a time with AVX2
// intrinsics (the compiler would not vectorise the plain loop), the rest one at a time. Both
// round the same: each op is IEEE single precision, std::fma and _mm256_fmadd_ps are one
// rounding. G: the gradient's element type, uint16_t (bf16) or float.
template <typename G, bool kTail, bool kSmallWeight, bool kCopy>
FSDP_AVX2_FMA void Loop(const Args& a, int64_t begin, int64_t end) {
  const float scale = a.scale, decay = a.decay, w = a.w, w_minus_1 = a.w_minus_1;
  const float beta2 = a.beta2, c2 = a.c2, neg_step_size = a.neg_step_size;
  const float bc2_sqrt = a.bc2_sqrt, eps = a.eps;
  float* param = a.param;
  float* exp_avg = a.exp_avg;
  float* exp_avg_sq = a.exp_avg_sq;
  const G* grad = static_cast<const G*>(a.grad);
  uint16_t* copy = a.copy;
  int64_t i = begin;
#if defined(__x86_64__)
  const __m256 v_scale = _mm256_set1_ps(scale), v_decay = _mm256_set1_ps(decay);
  const __m256 v_w = _mm256_set1_ps(kSmallWeight ? w : w_minus_1);
  const __m256 v_beta2 = _mm256_set1_ps(beta2), v_c2 = _mm256_set1_ps(c2);
  const __m256 v_neg_step = _mm256_set1_ps(neg_step_size), v_bc2 = _mm256_set1_ps(bc2_sqrt);
  const __m256 v_eps = _mm256_set1_ps(eps);
  for (; i + 8 <= end; i += 8) {
    const __m256 g = _mm256_mul_ps(GradsAt(grad, i), v_scale);
    __m256 p = _mm256_mul_ps(_mm256_loadu_ps(param + i), v_decay);
    __m256 m = _mm256_loadu_ps(exp_avg + i);
    m = _mm256_fmadd_ps(v_w, _mm256_sub_ps(g, m), kSmallWeight ? m : g);
    __m256 v = _mm256_loadu_ps(exp_avg_sq + i);
    const __m256 c2g = _mm256_mul_ps(v_c2, g);
    v = kTail ? _mm256_fmadd_ps(v, v_beta2, _mm256_mul_ps(c2g, g))
              : _mm256_fmadd_ps(c2g, g, _mm256_mul_ps(v, v_beta2));
    const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v), v_bc2), v_eps);
    p = _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(v_neg_step, m), denom));
    _mm256_storeu_ps(param + i, p);
    _mm256_storeu_ps(exp_avg + i, m);
    _mm256_storeu_ps(exp_avg_sq + i, v);
    if constexpr (kCopy) {  // round to nearest even, as FloatToBf16
      const __m256i u = _mm256_castps_si256(p);
      const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
      __m256i r = _mm256_srli_epi32(
          _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
      const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(p, p, _CMP_UNORD_Q));
      r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
      const __m128i packed =
          _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(copy + i), packed);
    }
  }
#endif
  for (; i < end; ++i) {
    const float g = GradAt(grad, i) * scale;
    float p = param[i] * decay;
    float m = exp_avg[i];
    m = kSmallWeight ? std::fma(w, g - m, m) : std::fma(w_minus_1, g - m, g);
    float v = exp_avg_sq[i];
    v = kTail ? std::fma(v, beta2, (c2 * g) * g) : std::fma(c2 * g, g, v * beta2);
    p = p + (neg_step_size * m) / (std::sqrt(v) / bc2_sqrt + eps);
    param[i] = p;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    if constexpr (kCopy) copy[i] = FloatToBf16(p);
  }
}

template <typename G, bool kSmallWeight, bool kCopy>
void Range(const Args& a, int64_t begin, int64_t end, int64_t vector_end) {
  const int64_t split = std::clamp(vector_end, begin, end);
  Loop<G, false, kSmallWeight, kCopy>(a, begin, split);
  Loop<G, true, kSmallWeight, kCopy>(a, split, end);
}

template <typename G>
void RunPass(int lanes, const HostAdamHyper& h, float scale, int64_t n, float* param,
             float* exp_avg, float* exp_avg_sq, const G* grad, uint16_t* copy_bf16) {
  TORCH_INTERNAL_ASSERT(lanes > 0 && HostAdamPassCovers(h), "HostAdamPass: not available here");
  if (n <= 0) return;
  // ATen reads the count as a float (state_step.item<float>()).
  const double step = static_cast<float>(h.step);
  const double bias_correction1 = 1 - std::pow(h.beta1, step);
  const double bias_correction2 = 1 - std::pow(h.beta2, step);
  Args a;
  a.scale = scale;
  a.decay =
      h.decoupled && h.weight_decay != 0 ? static_cast<float>(1 - h.lr * h.weight_decay) : 1.0f;
  a.w = static_cast<float>(1 - h.beta1);
  a.w_minus_1 = a.w - 1.0f;
  a.beta2 = static_cast<float>(h.beta2);
  a.c2 = static_cast<float>(1 - h.beta2);
  a.neg_step_size = static_cast<float>(-(h.lr / bias_correction1));
  a.bc2_sqrt = static_cast<float>(std::sqrt(bias_correction2));
  a.eps = static_cast<float>(h.eps);
  a.param = param;
  a.exp_avg = exp_avg;
  a.exp_avg_sq = exp_avg_sq;
  a.grad = grad;
  a.copy = copy_bf16;
  const bool small_weight = std::abs(a.w) < 0.5f;
  // ATen's scalar tail is itself vectorised by its compiler, 8 floats at a time on the AVX-512
  // build, with the vector loop's rounding: only what is left after that rounds as scalar code.
  const int64_t tail = n % lanes;
  const int64_t vector_end = n - tail + (lanes == 16 ? tail / 8 * 8 : 0);
  auto range = [&](int64_t begin, int64_t end) {
    if (a.copy != nullptr) {
      small_weight ? Range<G, true, true>(a, begin, end, vector_end)
                   : Range<G, false, true>(a, begin, end, vector_end);
    } else {
      small_weight ? Range<G, true, false>(a, begin, end, vector_end)
                   : Range<G, false, false>(a, begin, end, vector_end);
    }
  };
  // Parts of at least 2^16 elements (1.75 MiB of the pass's bytes) on the host loops' threads
  // (Note [Host loops]); they start at multiples of 16, so only the tensor's own tail is a tail.
  HostParallelFor(n, int64_t{1} << 16, range);
}

// RunPass on `grad`'s elements, by its dtype (HostAdamPass's requirements).
void RunPassOn(int lanes, const HostAdamHyper& h, float scale, int64_t n, float* param,
               float* exp_avg, float* exp_avg_sq, const at::Tensor& grad, uint16_t* copy_bf16) {
  TORCH_CHECK(grad.is_cpu() && grad.is_contiguous() && grad.numel() >= n,
              "HostAdamPass: the gradient must be a contiguous CPU tensor of at least ", n,
              " elements");
  if (grad.scalar_type() == at::kBFloat16) {
    RunPass(lanes, h, scale, n, param, exp_avg, exp_avg_sq,
            static_cast<const uint16_t*>(grad.const_data_ptr()), copy_bf16);
  } else {
    TORCH_CHECK(grad.scalar_type() == at::kFloat, "HostAdamPass: a ", grad.scalar_type(),
                " gradient; valid: BFloat16, Float");
    RunPass(lanes, h, scale, n, param, exp_avg, exp_avg_sq, grad.const_data_ptr<float>(),
            copy_bf16);
  }
}

// One small pass per arithmetic branch against ATen's ops (Note [Host Adam pass]), so that a
// torch built with other rounding turns the pass off instead of changing the values.
bool MatchesAten() {
  const int64_t n = 16 * 40 + 13;  // with a tail at either vector width
  uint32_t state = 12345;
  auto next = [&] {  // deterministic values, without touching ATen's generators
    state = state * 1664525u + 1013904223u;
    return static_cast<float>(state >> 8) / static_cast<float>(1 << 24) - 0.5f;
  };
  at::Tensor param = at::empty({n}), exp_avg = at::empty({n}), exp_avg_sq = at::empty({n});
  at::Tensor grad = at::empty({n});
  for (int64_t i = 0; i < n; ++i) {
    param.data_ptr<float>()[i] = next();
    exp_avg.data_ptr<float>()[i] = 0.1f * next();
    exp_avg_sq.data_ptr<float>()[i] = 0.01f * (next() + 0.5f);
    grad.data_ptr<float>()[i] = next();
  }
  const at::Tensor grad_bf16 = grad.to(at::kBFloat16);
  for (const bool wide : {false, true}) {  // the bf16 gradient, then an fp32 one
    for (const auto& [beta1, decoupled] : {std::pair{0.9, true}, std::pair{0.3, true}}) {
      at::Tensor p1 = param.clone(), m1 = exp_avg.clone(), v1 = exp_avg_sq.clone();
      at::Tensor g1 = wide ? grad.clone() : grad_bf16.to(at::kFloat);
      g1.mul_(at::scalar_tensor(0.75f));
      const at::Tensor step = at::full({}, 3.0, at::kFloat);
      if (decoupled) {
        at::_fused_adamw_({p1}, {g1}, {m1}, {v1}, {}, {step}, 1e-3, beta1, 0.95, 0.1, 1e-8, false,
                          false);
      } else {
        at::_fused_adam_({p1}, {g1}, {m1}, {v1}, {}, {step}, 1e-3, beta1, 0.95, 0.1, 1e-8, false,
                         false);
      }
      at::Tensor p2 = param.clone(), m2 = exp_avg.clone(), v2 = exp_avg_sq.clone();
      at::Tensor copy = at::empty({n}, at::kBFloat16);
      HostAdamHyper hyper{1e-3, beta1, 0.95, 1e-8, 0.1, decoupled, 3};
      RunPassOn(CandidateLanes(), hyper, 0.75f, n, p2.data_ptr<float>(), m2.data_ptr<float>(),
                v2.data_ptr<float>(), wide ? grad : grad_bf16,
                static_cast<uint16_t*>(copy.data_ptr()));
      if (!at::equal(p1, p2) || !at::equal(m1, m2) || !at::equal(v1, v2) ||
          !at::equal(p1.to(at::kBFloat16), copy)) {
        return false;
      }
    }
  }
  return true;
}

int AtenFloatLanes() {
  static const int lanes = [] {
    at::NoGradGuard no_grad;
    return CandidateLanes() > 0 && MatchesAten() ? CandidateLanes() : 0;
  }();
  return lanes;
}

}  // namespace

bool HostAdamPassAvailable() { return AtenFloatLanes() > 0; }

bool HostAdamPassCovers(const HostAdamHyper& hyper) {
  return hyper.decoupled || hyper.weight_decay == 0;
}

void HostAdamPass(const HostAdamHyper& hyper, float scale, int64_t n, float* param, float* exp_avg,
                  float* exp_avg_sq, const at::Tensor& grad, uint16_t* copy_bf16) {
  RunPassOn(AtenFloatLanes(), hyper, scale, n, param, exp_avg, exp_avg_sq, grad, copy_bf16);
}

}  // namespace fsdp
