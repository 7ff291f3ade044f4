// SwiGLU in one kernel each way: silu(gate) * up and its two gradients, instead of silu, mul
// and their backward ops (five elementwise kernels and two saved intermediates). fp32
// arithmetic whatever the dtype, one rounding.
//
// The Llama feed-forward computes silu(x W1^T) * (x W3^T). The kernel reads either the two
// projections as two tensors, or the fused projection: one matmul against W1 and W3 stacked
// ([2F, dim]) gives gate_up [..., 2F], gate in the first F columns and up in the last, and the
// backward writes the gradient of the whole gate_up (so the matmul's backward stays one GEMM).
// The model uses two tensors (Note [SwiGLU projections] in models/gpt/gpt.cc: its w1 and w3
// are separate parameters, and stacking them per call would keep a [2F, dim] copy per block
// alive from forward to backward).
//
//   at::Tensor h = fsdp::kernels::SwiGlu(Linear(x, w1), Linear(x, w3));  // [b, t, F]
//   at::Tensor h2 = fsdp::kernels::SwiGlu(gate_up);                      // fused projection
//
// CUDA tensors run kernels/cuda/swiglu.cu; others the CPU reference (kernels/swiglu.cc).
// Tolerances against the composite silu(g) * u: tests/kernels_swiglu_test.cc.
#pragma once

#include <ATen/core/Tensor.h>

namespace fsdp::kernels {

// gate, up: [..., F], one shape, float32 / bfloat16 / float16 -> [..., F], same dtype.
// Differentiable in both.
at::Tensor SwiGlu(const at::Tensor& gate, const at::Tensor& up);
// gate_up: [..., 2F] (the fused projection) -> [..., F]. Differentiable.
at::Tensor SwiGlu(const at::Tensor& gate_up);

// The composite references: silu(gate) * up in ATen ops; the same on the halves of gate_up.
at::Tensor SwiGluComposite(const at::Tensor& gate, const at::Tensor& up);
at::Tensor SwiGluComposite(const at::Tensor& gate_up);

}  // namespace fsdp::kernels
