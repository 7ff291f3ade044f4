#include "kernels/cuda/rope.h"

#include <climits>

#include "kernels/cuda/common.cuh"

namespace fsdp::kernels::cuda {
namespace {

// Note [RoPE kernel layout]
// One block per token (grid-stride over batch * seq), 2-D: threadIdx.x walks the units of one
// head (a unit is kPairs adjacent pairs: 2 * kPairs elements), threadIdx.y the heads, q's then
// k's, two heads per step with both loads in flight. A thread loads the cos and sin of its
// unit once per token and reuses them for every head it visits; the position (b, t) is one
// division per token, and no index is divided per element. Units are, by what the operands
// allow (See Note [Vector accesses]):
//  - 16 bytes (kPairs = 4 for bf16/fp16, 2 for fp32): every head of q and k starts 16-byte
//    aligned (aligned bases, strides and head_dim multiples of the vector width), dim stride 1,
//    and cos and sin 4 * kPairs-byte aligned (their rows: half floats, a multiple of kPairs);
//  - one pair (kPairs = 1) in one 2-element access: dim stride 1, 2-element aligned;
//  - one pair in two element accesses through the dim stride: anything else.
// Each thread reads its unit, then writes it: no other thread touches that unit, so in place
// (in == out) needs no barrier; in and out are not __restrict__ (they may be one tensor).

constexpr int kThreads = 256;
// At most 64 registers a thread (65536 / (256 * 4)): a full SM of threads, each with two units
// in flight (without the bound nvcc takes 80 for the 16-byte kernel, and an SM holds 768).
constexpr int kMinBlocksPerSm = 4;

// One unit's 2 * kPairs elements as floats: contiguous at `in`, or a pair at in[0], in[step].
template <typename T, int kPairs, bool kContiguous>
__device__ __forceinline__ void LoadUnit(const T* in, int64_t step, float (&x)[2 * kPairs]) {
  if constexpr (kContiguous) {
    LoadFloats<2 * kPairs>(in, x);
  } else {
    x[0] = ToFloat(in[0]);
    x[1] = ToFloat(in[step]);
  }
}

// Rotates the unit x by c and s (the pairs' cos and sign * sin) and writes it at `out`.
template <typename T, int kPairs, bool kContiguous>
__device__ __forceinline__ void RotateStoreUnit(T* out, int64_t step, const float (&x)[2 * kPairs],
                                                const float (&c)[kPairs],
                                                const float (&s)[kPairs]) {
  float y[2 * kPairs];
#pragma unroll
  for (int i = 0; i < kPairs; ++i) {
    // Each product rounded, then the sum (the _rn intrinsics are never contracted into an
    // FMA): the composite's arithmetic, so fp32 results equal it and the CPU reference
    // bitwise, forward and backward.
    y[2 * i] = __fsub_rn(__fmul_rn(x[2 * i], c[i]), __fmul_rn(x[2 * i + 1], s[i]));
    y[2 * i + 1] = __fadd_rn(__fmul_rn(x[2 * i], s[i]), __fmul_rn(x[2 * i + 1], c[i]));
  }
  if constexpr (kContiguous) {
    StoreFloats<2 * kPairs>(out, y);
  } else {
    out[0] = FromFloat<T>(y[0]);
    out[step] = FromFloat<T>(y[1]);
  }
}

// The unit starting at pair i0 of every head of `op` that this thread's threadIdx.y visits,
// two heads at a time: both loads are issued before either store (in and out may be one
// tensor, so the compiler could not reorder them itself; the two heads are distinct memory).
// (op is a kernel parameter; after inlining, its fields are read directly.)
template <typename T, int kPairs, bool kContiguous>
__device__ __forceinline__ void RotateHeads(const RopeOperand& op, int64_t b, int64_t t, int i0,
                                            const float (&c)[kPairs], const float (&s)[kPairs]) {
  const T* in = static_cast<const T*>(op.in) + b * op.in_stride[0] + t * op.in_stride[1] +
                2 * i0 * op.in_stride[3];
  T* out = static_cast<T*>(op.out) + b * op.out_stride[0] + t * op.out_stride[1] +
           2 * i0 * op.out_stride[3];
  for (int64_t head = threadIdx.y; head < op.heads; head += 2 * int64_t{blockDim.y}) {
    const int64_t second = head + blockDim.y;
    float x0[2 * kPairs], x1[2 * kPairs];
    LoadUnit<T, kPairs, kContiguous>(in + head * op.in_stride[2], op.in_stride[3], x0);
    if (second < op.heads) {
      LoadUnit<T, kPairs, kContiguous>(in + second * op.in_stride[2], op.in_stride[3], x1);
    }
    RotateStoreUnit<T, kPairs, kContiguous>(out + head * op.out_stride[2], op.out_stride[3], x0,
                                            c, s);
    if (second < op.heads) {
      RotateStoreUnit<T, kPairs, kContiguous>(out + second * op.out_stride[2], op.out_stride[3],
                                              x1, c, s);
    }
  }
}

// See Note [RoPE kernel layout]. `sign` is +1 (forward) or -1 (inverse).
template <typename T, int kPairs, bool kContiguous>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm)
    RopeKernel(RopeOperand q, RopeOperand k, const float* __restrict__ cos,
               const float* __restrict__ sin, int64_t tokens, int64_t seq, int half, float sign) {
  const int units = half / kPairs;
  for (int64_t token = blockIdx.x; token < tokens; token += gridDim.x) {
    const int64_t b = token / seq, t = token - b * seq;
    for (int u = threadIdx.x; u < units; u += blockDim.x) {
      const int i0 = u * kPairs;
      float c[kPairs], s[kPairs];
      LoadFloats<kPairs>(cos + t * half + i0, c);
      LoadFloats<kPairs>(sin + t * half + i0, s);
#pragma unroll
      for (int i = 0; i < kPairs; ++i) s[i] *= sign;
      RotateHeads<T, kPairs, kContiguous>(q, b, t, i0, c, s);
      RotateHeads<T, kPairs, kContiguous>(k, b, t, i0, c, s);
    }
  }
}

// Whether every unit of `op` (2 * pairs elements, dim stride 1) starts on a boundary of its
// size in both tensors.
bool UnitAccessible(const RopeOperand& op, int64_t head_dim, int64_t pairs, size_t element_size) {
  if (op.heads == 0) return true;
  const int64_t width = 2 * pairs;
  if (op.in_stride[3] != 1 || op.out_stride[3] != 1 || head_dim % width != 0) return false;
  for (int d = 0; d < 3; ++d) {
    if (op.in_stride[d] % width != 0 || op.out_stride[d] % width != 0) return false;
  }
  return AlignedTo(op.in, width * element_size) && AlignedTo(op.out, width * element_size);
}

template <typename T, int kPairs, bool kContiguous>
LaunchStatus Launch(const RopeOperand& q, const RopeOperand& k, const float* cos,
                    const float* sin, int64_t tokens, int64_t seq, int half, float sign,
                    cudaStream_t stream) {
  // threadIdx.x over a head's units (at most a warp's worth per row of threads), threadIdx.y
  // over heads: no more rows of threads than half the larger head count (RotateHeads takes two
  // heads per step), so a thread has two loads in flight where there are heads enough.
  const int units = half / kPairs;
  const int bx = units < 32 ? units : 32;
  const int64_t max_heads = q.heads > k.heads ? q.heads : k.heads;
  const int64_t head_rows = (max_heads + 1) / 2;
  int by = kThreads / bx;
  if (by > head_rows) by = static_cast<int>(head_rows);
  const int blocks = static_cast<int>(tokens < INT_MAX ? tokens : INT_MAX);
  RopeKernel<T, kPairs, kContiguous>
      <<<blocks, dim3(bx, by), 0, stream>>>(q, k, cos, sin, tokens, seq, half, sign);
  return LastLaunchStatus();
}

}  // namespace

LaunchStatus Rope(const RopeOperand& q, const RopeOperand& k, const float* cos, const float* sin,
                  int64_t batch, int64_t seq, int64_t head_dim, bool inverse, DType dtype,
                  Stream stream) {
  const int64_t tokens = batch * seq, half = head_dim / 2;
  if (tokens == 0 || half == 0 || q.heads + k.heads == 0) return 0;
  const float sign = inverse ? -1.0f : 1.0f;
  const cudaStream_t s = AsCudaStream(stream);
  const int h = static_cast<int>(half);
  return FSDP_KERNELS_DISPATCH(dtype, T, [&] {
    constexpr int kVectorPairs = Vec16<T>::kSize / 2;
    if (UnitAccessible(q, head_dim, kVectorPairs, sizeof(T)) &&
        UnitAccessible(k, head_dim, kVectorPairs, sizeof(T)) &&
        AlignedTo(cos, 4 * kVectorPairs) && AlignedTo(sin, 4 * kVectorPairs)) {
      return Launch<T, kVectorPairs, true>(q, k, cos, sin, tokens, seq, h, sign, s);
    }
    if (UnitAccessible(q, head_dim, 1, sizeof(T)) && UnitAccessible(k, head_dim, 1, sizeof(T))) {
      return Launch<T, 1, true>(q, k, cos, sin, tokens, seq, h, sign, s);
    }
    return Launch<T, 1, false>(q, k, cos, sin, tokens, seq, h, sign, s);
  });
}

}  // namespace fsdp::kernels::cuda
