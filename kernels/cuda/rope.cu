#include "kernels/cuda/rope.h"

#include <climits>

#include "kernels/cuda/common.cuh"

namespace fsdp::kernels::cuda {
namespace {

constexpr int kMaxThreads = 256;

// Two adjacent elements, loaded and stored as one access when both tensors allow it.
template <typename T>
struct alignas(2 * sizeof(T)) PairOf {
  T first, second;
};

// One block per token (grid-stride over batch * seq), its threads over the token's pairs: q's
// heads first, then k's. Each thread reads its pair, then writes it: no other thread touches
// that pair, so in place (in == out) needs no barrier. `sign` is +1 (forward) or -1 (inverse).
template <typename T, bool kPairAccess>
__global__ void RopeKernel(RopeOperand q, RopeOperand k, const float* __restrict__ cos,
                           const float* __restrict__ sin, int64_t tokens, int64_t seq, int64_t half,
                           float sign) {
  const int64_t q_pairs = q.heads * half;
  const int64_t pairs = q_pairs + k.heads * half;
  for (int64_t token = blockIdx.x; token < tokens; token += gridDim.x) {
    const int64_t b = token / seq, t = token - b * seq;
    const float* cos_row = cos + t * half;
    const float* sin_row = sin + t * half;
    for (int64_t j = threadIdx.x; j < pairs; j += blockDim.x) {
      const bool is_q = j < q_pairs;
      const int64_t jj = is_q ? j : j - q_pairs;
      const int64_t head = jj / half, i = jj - head * half;
      // Selected field by field: indexing the parameter structs through a pointer would copy
      // them to local memory.
      const int64_t in_off = b * (is_q ? q.in_stride[0] : k.in_stride[0]) +
                             t * (is_q ? q.in_stride[1] : k.in_stride[1]) +
                             head * (is_q ? q.in_stride[2] : k.in_stride[2]);
      const int64_t out_off = b * (is_q ? q.out_stride[0] : k.out_stride[0]) +
                              t * (is_q ? q.out_stride[1] : k.out_stride[1]) +
                              head * (is_q ? q.out_stride[2] : k.out_stride[2]);
      const int64_t in_step = is_q ? q.in_stride[3] : k.in_stride[3];
      const int64_t out_step = is_q ? q.out_stride[3] : k.out_stride[3];
      const T* in = static_cast<const T*>(is_q ? q.in : k.in) + in_off + 2 * i * in_step;
      T* out = static_cast<T*>(is_q ? q.out : k.out) + out_off + 2 * i * out_step;
      float x0, x1;
      if constexpr (kPairAccess) {
        PairOf<T> p = *reinterpret_cast<const PairOf<T>*>(in);
        x0 = ToFloat(p.first);
        x1 = ToFloat(p.second);
      } else {
        x0 = ToFloat(in[0]);
        x1 = ToFloat(in[in_step]);
      }
      const float c = cos_row[i], s = sign * sin_row[i];
      // Each product rounded, then the sum (the _rn intrinsics are never contracted into an
      // FMA): the composite's arithmetic, so fp32 results equal it and the CPU reference
      // bitwise, forward and backward.
      const float y0 = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s));
      const float y1 = __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c));
      if constexpr (kPairAccess) {
        *reinterpret_cast<PairOf<T>*>(out) = PairOf<T>{FromFloat<T>(y0), FromFloat<T>(y1)};
      } else {
        out[0] = FromFloat<T>(y0);
        out[out_step] = FromFloat<T>(y1);
      }
    }
  }
}

// Whether every pair of `op` starts on a 2-element boundary in both tensors, dim stride 1.
bool PairAccessible(const RopeOperand& op, size_t element_size) {
  if (op.heads == 0) return true;
  if (op.in_stride[3] != 1 || op.out_stride[3] != 1) return false;
  for (int d = 0; d < 3; ++d) {
    if (op.in_stride[d] % 2 != 0 || op.out_stride[d] % 2 != 0) return false;
  }
  const uintptr_t align = 2 * element_size;
  return reinterpret_cast<uintptr_t>(op.in) % align == 0 &&
         reinterpret_cast<uintptr_t>(op.out) % align == 0;
}

}  // namespace

LaunchStatus Rope(const RopeOperand& q, const RopeOperand& k, const float* cos, const float* sin,
                  int64_t batch, int64_t seq, int64_t head_dim, bool inverse, DType dtype,
                  Stream stream) {
  const int64_t tokens = batch * seq, half = head_dim / 2;
  const int64_t pairs = (q.heads + k.heads) * half;
  if (tokens == 0 || pairs == 0) return 0;
  const int threads = static_cast<int>(pairs >= kMaxThreads ? kMaxThreads : (pairs + 31) / 32 * 32);
  const int blocks = static_cast<int>(tokens < INT_MAX ? tokens : INT_MAX);
  const float sign = inverse ? -1.0f : 1.0f;
  return FSDP_KERNELS_DISPATCH(dtype, T, [&] {
    if (PairAccessible(q, sizeof(T)) && PairAccessible(k, sizeof(T))) {
      RopeKernel<T, true>
          <<<blocks, threads, 0, AsCudaStream(stream)>>>(q, k, cos, sin, tokens, seq, half, sign);
    } else {
      RopeKernel<T, false>
          <<<blocks, threads, 0, AsCudaStream(stream)>>>(q, k, cos, sin, tokens, seq, half, sign);
    }
    return LastLaunchStatus();
  });
}

}  // namespace fsdp::kernels::cuda
