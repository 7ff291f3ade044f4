// SwiGLU in one kernel each way: silu(gate) * up, reading the fused w1/w3 projection.
//
// The Llama feed-forward computes silu(x W1^T) * (x W3^T). With W1 and W3 stacked into one
// [2F, dim] weight, one matmul gives gate_up [..., 2F] (gate in the first F columns, up in
// the last), and this function reads both halves in one pass: one kernel forward, one backward
// (which writes the gradient of the whole gate_up, so the matmul's backward stays one GEMM),
// instead of silu, mul and their backward ops. fp32 arithmetic whatever the dtype.
//
//   at::Tensor gate_up = at::linear(x, at::cat({w1, w3}));   // [b, t, 2F]
//   at::Tensor h = fsdp::kernels::SwiGlu(gate_up);           // [b, t, F] = silu(g) * u
//
// CUDA tensors run kernels/cuda/swiglu.cu; others the CPU reference (kernels/swiglu.cc).
// Tolerances against the composite silu(g) * u: tests/kernels_swiglu_test.cc.
#pragma once

#include <ATen/core/Tensor.h>

namespace fsdp::kernels {

// gate_up: [..., 2F], float32 / bfloat16 / float16 -> [..., F], same dtype. Differentiable.
at::Tensor SwiGlu(const at::Tensor& gate_up);

// The composite reference: silu(gate_up[..., :F]) * gate_up[..., F:] in ATen ops.
at::Tensor SwiGluComposite(const at::Tensor& gate_up);

}  // namespace fsdp::kernels
