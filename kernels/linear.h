// Linear layers whose backward needs no add kernels: several projections of one input as one
// autograd node (MultiLinear), and a projection added onto a residual by its GEMM (LinearAdd).
// ATen's GEMMs only: no CUDA file of ours, the same code on every device.
//
// MultiLinear: y_i = x W_i^T (+ b_i) for weights sharing the input x, e.g. attention's q, k
// and v of the normed x, or the SwiGLU's w1 and w3. The forward runs the GEMMs at::linear
// runs. The backward differs: separate linears each return a gradient of x and autograd's
// engine sums them, one add kernel per extra consumer (q, k, v: two adds of x's size; w1, w3:
// one). Here grad_x = grad_0 W_0 (at::mm), then grad_x += grad_i W_i (in-place addmm_, beta = 1:
// the GEMM reads grad_x and adds it in its epilogue, no copy), so there is no add kernel and one
// gradient buffer of x's size instead of one per weight: per extra weight, an add's 3 passes
// over x's size become the GEMM's read of grad_x. The weight and bias gradients are
// at::linear's: grad_i^T x and the sum of grad_i over rows. x is saved once (separate linears
// share their saved x too), and the weights. Gradients are computed only for the inputs that
// need them, from the outputs that received one.
//
//   auto qkv = fsdp::kernels::MultiLinear(x, {wq, wk, wv}, {bq, bk, bv});  // 3 outputs
//   auto gate_up = fsdp::kernels::MultiLinear(x, {w1, w3});               // no biases
//   at::Tensor out = fsdp::kernels::LinearAdd(h, act, w2);                // h + act W2^T
//
// Arithmetic. The forward is at::linear's (bitwise on the CPU: the same mm / addmm). grad_x in
// a 16-bit dtype is rounded once per GEMM: with weights 0..n-1 the composite rounds each
// grad_i W_i and each sum of two (2n - 1 roundings), MultiLinear rounds n times (each GEMM adds
// the previous bf16 grad_x to its fp32 product and rounds once). In fp32 the two agree to
// rounding. Weight and bias gradients are bitwise at::linear's on the CPU. Tolerances against
// the composite in fp32 on the same values (tests/kernels_linear_test.cc): 1e-5 (fp32) and
// 1e-2 (bf16) relative, sums scaled by their largest magnitude.
//
// LinearAdd: residual + x W^T as at::addmm(residual, x, W^T) with beta = 1, differentiable
// through ATen (AddmmBackward0 hands the residual the incoming gradient itself, no kernel). No
// bias (addmm takes one addend).
//
// Note [Residual addmm]
// ATen's out-of-place addmm with a 2-D addend first copies the addend into the output
// (at::native::copy_: a device-to-device memcpy for a contiguous tensor of the same dtype),
// then runs the GEMM with beta = 1 on the output (addmm_out_cuda_impl as read in recent
// sources; cuBLASLt's separate C and D serve only a 1-D bias). So against `residual +
// linear(x, W)`, which writes the product and runs an add kernel (4 passes over the output's
// size in all), LinearAdd runs a copy and the GEMM's read and write of its output: the same
// bytes, a memcpy instead of an add kernel, no product tensor, and one rounding instead of two
// (the product is not rounded before the sum). What it gains beyond: its output is the sum, so
// selective activation checkpointing keeps the block's output as w2's (models/gpt/gpt_counts.cc).
// Saving the copy needs a GEMM accumulating in place into a buffer that already holds the
// residual and that nothing saved for backward: AddRmsNorm's h is saved (its backward reads it).
#pragma once

#include <vector>

#include <ATen/core/Tensor.h>

namespace fsdp::kernels {

// x: [..., K]; weights: n >= 1 tensors [N_i, K]; biases: empty, or n tensors [N_i] each defined
// or undefined (no bias). All of x's dtype and device. -> n tensors [..., N_i], x's dtype.
// Differentiable in x, each weight and each defined bias, through one autograd node.
std::vector<at::Tensor> MultiLinear(const at::Tensor& x, at::TensorList weights,
                                    at::TensorList biases = {});

// Gives `outputs`, computed earlier without autograd as MultiLinear(x, weights, biases) computes
// them (e.g. kept by selective activation checkpointing and replayed), MultiLinear's backward
// node with edges to x, weights and biases: as if MultiLinear had just returned them. The
// outputs must have no autograd history and not be views (a detached alias is fine).
void SetMultiLinearBackward(at::TensorList outputs, const at::Tensor& x, at::TensorList weights,
                            at::TensorList biases = {});

// residual: [..., N], x: [..., K] with the same leading sizes, w: [N, K] -> residual + x W^T,
// residual's shape (not a view). See Note [Residual addmm] above.
at::Tensor LinearAdd(const at::Tensor& residual, const at::Tensor& x, const at::Tensor& w);

// The composite references: at::linear per weight; residual + at::linear(x, w).
std::vector<at::Tensor> MultiLinearComposite(const at::Tensor& x, at::TensorList weights,
                                             at::TensorList biases = {});
at::Tensor LinearAddComposite(const at::Tensor& residual, const at::Tensor& x, const at::Tensor& w);

}  // namespace fsdp::kernels
