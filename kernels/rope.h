// Rotary position embedding (RoPE) on q and k together: one kernel forward, one backward.
//
// Our layout rotates ADJACENT pairs (x[2i], x[2i+1]) of each head's head_dim by the angle of
// (position t, pair i), with fp32 tables cos/sin [seq_max, head_dim / 2] (the model's
// rope_cos/rope_sin buffers; the first `seq` rows are used):
//   out[2i] = x[2i] * c - x[2i+1] * s,   out[2i+1] = x[2i] * s + x[2i+1] * c
// The backward applies the transpose (the inverse rotation) to the incoming gradient. fp32
// arithmetic whatever the dtype, one rounding to it.
//
//   at::Tensor q = Linear(x, wq).view({b, t, n_heads, head_dim});
//   at::Tensor k = Linear(x, wk).view({b, t, n_kv_heads, head_dim});
//   fsdp::kernels::RopeInPlace(q, k, rope_cos, rope_sin);  // q, k now rotated, same memory
//
// CUDA tensors run kernels/cuda/rope.cu; others the CPU reference (kernels/rope.cc).
// Tolerances against the composite: tests/kernels_rope_test.cc.
//
// Note [RoPE in place under autograd]
// A custom autograd Function that modifies its inputs in place declares it with mark_dirty,
// and autograd then rewrites the history of the input; for an input that is a view (q and k
// above are views of the projections' outputs) PyTorch allows that only for a Function with a
// single output ("If your Function modifies inplace an input that is a view of another Tensor,
// your Function cannot return more than one Tensor"). One kernel for q and k together needs
// two outputs, so RopeInPlace does not use mark_dirty: its Function rotates q's and k's memory,
// bumps their version counters itself (as an in-place op would), and returns aliases of that
// memory whose grad_fn is the rotation's backward; RopeInPlace replaces the caller's q and k
// with them. Consequences:
//  - the old handles see rotated values but not the rotation in their history: only use the
//    tensors RopeInPlace leaves in q and k (it replaces them for that reason);
//  - anything that saved the projection's output (or a view of it) for backward before the
//    rotation fails in backward with autograd's "modified by an inplace operation", as for
//    any in-place op: so does selective activation checkpointing, which records fsdp::Linear
//    outputs and checks their version on replay. Use Rope (out of place) there;
//  - the outputs are views from a multi-output Function: autograd refuses later in-place ops
//    on them (attention only reads them);
//  - a leaf that requires grad is refused, as for any in-place op under grad mode.
// The backward rotates the incoming gradient in place when nothing else can see it (its
// TensorImpl and storage have no other owner and it is dense), else into a new tensor: a
// gradient the caller passed to backward(), or one shared with another branch, is never
// modified.
#pragma once

#include <utility>

#include <ATen/core/Tensor.h>

namespace fsdp::kernels {

// q [batch, seq, heads, head_dim], k [batch, seq, kv_heads, head_dim] (same batch, seq and
// head_dim, even; same dtype: float32, bfloat16 or float16; any strides), cos/sin
// [>= seq, head_dim / 2] (converted to float32 if not). Rotates q and k in place and replaces
// both with differentiable aliases of the rotated memory: see Note [RoPE in place under
// autograd].
void RopeInPlace(at::Tensor& q, at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin);

// The same rotation out of place: returns new contiguous {rotated q, rotated k}; q and k are
// untouched. Differentiable; the backward as RopeInPlace's.
std::pair<at::Tensor, at::Tensor> Rope(const at::Tensor& q, const at::Tensor& k,
                                       const at::Tensor& cos, const at::Tensor& sin);

// The composite reference, the model's arithmetic (models/gpt/gpt.cc Rotate()): cos and sin
// cast to x's dtype, then the rotation in ATen ops (stack of the two halves, flatten).
at::Tensor RopeComposite(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

}  // namespace fsdp::kernels
