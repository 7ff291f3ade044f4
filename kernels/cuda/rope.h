// Rotary position embedding launcher (kernels/cuda/rope.cu): q and k in one launch, in place
// or into separate outputs, forward or inverse rotation. Adjacent pairs (x[2i], x[2i+1]) of each
// head's head_dim rotate by the angle of (token position, i):
//   forward  out0 = x0 * c - x1 * s,  out1 = x0 * s + x1 * c
//   inverse  out0 = x0 * c + x1 * s,  out1 = -x0 * s + x1 * c   (the transpose: the backward)
// with c = cos[t, i], s = sin[t, i] from fp32 tables [>= seq, head_dim / 2] (row stride
// head_dim / 2). Element strides are arbitrary (views of a fused projection, transposed
// gradients); `in` may equal `out` (in place). fp32 arithmetic, one rounding to the dtype.
#pragma once

#include <cstdint>

#include "kernels/cuda/types.h"

namespace fsdp::kernels::cuda {

// One tensor [batch, seq, heads, head_dim] to rotate: where it is read and where it is written.
struct RopeOperand {
  const void* in = nullptr;
  void* out = nullptr;
  int64_t heads = 0;
  int64_t in_stride[4] = {0, 0, 0, 0};  // batch, seq, head, dim; in elements
  int64_t out_stride[4] = {0, 0, 0, 0};
};

// q and k share batch, seq, head_dim and dtype; their head counts may differ (grouped-query).
LaunchStatus Rope(const RopeOperand& q, const RopeOperand& k, const float* cos, const float* sin,
                  int64_t batch, int64_t seq, int64_t head_dim, bool inverse, DType dtype,
                  Stream stream);

}  // namespace fsdp::kernels::cuda
