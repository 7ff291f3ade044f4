// RMSNorm in one kernel each way, and the residual add + RMSNorm of a decoder block in one pass.
// ForkRmsNorm passes its input through beside the norm, for the decoder block's input, which
// feeds both the attention norm and the residual stream: autograd would sum its two gradients
// with an add kernel; the norm's backward kernel adds the residual's instead, in the pass that
// writes the input gradient (AddRmsNorm's backward does the same for h's two gradients).
//
// RmsNorm normalises x over its last dimension D and scales by weight [D]; AddRmsNorm first
// adds the residual stream and returns both the sum (the next residual) and its norm, so the
// block's `h = input + attn_out; normed = ffn_norm(h)` reads input and attn_out once and
// writes h and normed, instead of an add, casts, pow, mean, rsqrt, two muls and a cast (and
// their backward ops). fp32 arithmetic and statistics whatever the dtype.
//
//   at::Tensor normed = fsdp::kernels::RmsNorm(x, norm_weight, eps);               // [b, t, D]
//   // A decoder block: its input x feeds the attention norm and the residual stream.
//   auto [residual, attn_in] = fsdp::kernels::ForkRmsNorm(x, attn_norm_weight, eps);
//   auto [h, ffn_in] = fsdp::kernels::AddRmsNorm(attention(attn_in), residual, ffn_norm_w, eps);
//   at::Tensor out = h + feed_forward(ffn_in);
//
// Arithmetic. The composite (RmsNormComposite, the model's NormImpl):
//   xf = float(x); y = dtype(xf * rsqrt(mean(xf^2) + eps)) * weight
// rounds the normalised x to x's dtype and then multiplies by weight (one more rounding, in
// the promoted dtype). The kernels compute y = float(x) * rstd * float(weight) in fp32 and round
// once, to x's dtype, as at::_fused_rms_norm does. AddRmsNorm's h is x + residual rounded once,
// exactly ATen's add, and y is the norm of that rounded h, so forward and backward see the same
// h. Tolerances against the composite run in fp32 on the same inputs (in
// tests/kernels_rms_norm_test.cc, |diff| <= atol + rtol * |expected|):
//   fp32: rtol = atol = 1e-5 (the CPU reference's worst: about 3e-6);
//   bf16: rtol = atol = 1e-2 for y and the input gradients (a bf16 rounding is at most 2^-8
//         relative and AddRmsNorm's y carries two, h's and its own: CPU worst 6.5e-3);
//         for the weight's gradient, a sum over rows, atol = 1e-2 x its largest magnitude
//         (CPU worst 4.5e-3). Against the composite run in bf16 itself, y is within 1e-2 too.
//
// Dtypes. x and residual: float32, bfloat16 or float16, the same; weight: x's dtype or float32.
// Outputs are in x's dtype (so is the gradient of x and residual), the weight's gradient in
// the weight's dtype. Note the one difference in dtype: with a bf16/fp16 x and an fp32 weight
// the composite promotes y to fp32 (type promotion of `* weight`); the kernels keep x's dtype.
//
// Autograd saves x (AddRmsNorm: h) and rstd (fp32, one per row), not the normalised output.
// The weight gradient is reduced over rows in fp32, deterministically (no atomics): see Note
// [RMSNorm weight gradient] in kernels/cuda/rms_norm.cu. AddRmsNorm's backward accepts a
// gradient for h, for y, both or neither (an undefined one counts as zero) and returns the same
// tensor, dh + d(norm)/dh, as the gradient of x and of residual; ForkRmsNorm's likewise takes
// gradients for the passed-through x and for y and returns dx + d(norm)/dx as x's. The kernel
// adds the extra gradient (dh, dx) to the norm's in fp32 and rounds the sum once, where
// autograd's add would round the norm's gradient, then the sum: in bf16 one rounding instead
// of two (in fp32 the same to rounding).
//
// Why not at::_fused_rms_norm (torch 2.11, ATen/ops/_fused_rms_norm.h; it returns (y, rstd)
// and rounds once as ours): (1) it has no residual-add fusion, which saves the reread of h
// forward (4 row-sized passes instead of 5) and, backward, autograd's separate sum of the two
// gradients of h (dh + d(norm)/dh: 3 passes and a launch); (2) its fused kernel is
// CUDA-only (its other registration is CompositeImplicitAutograd, the ATen composite), while we
// want one function, with the same saved tensors and the same rounding, on CPU and CUDA.
//
// CUDA tensors run kernels/cuda/rms_norm.cu; others the CPU reference (kernels/rms_norm.cc).
// Tolerances against the composite: tests/kernels_rms_norm_test.cc.
#pragma once

#include <utility>

#include <ATen/core/Tensor.h>

namespace fsdp::kernels {

// x: [..., D]; weight: [D] -> y: x's shape and dtype. Differentiable in x and weight.
at::Tensor RmsNorm(const at::Tensor& x, const at::Tensor& weight, double eps);

// x, residual: [..., D], same shape and dtype; weight: [D] -> (h = x + residual, y =
// RmsNorm(h, weight, eps)), both x's shape and dtype. Differentiable in x, residual and weight.
std::pair<at::Tensor, at::Tensor> AddRmsNorm(const at::Tensor& x, const at::Tensor& residual,
                                             const at::Tensor& weight, double eps);

// x: [..., D], weight: [D] -> (x, RmsNorm(x, weight, eps)): the first output has x's values and
// memory (autograd's view of x), a distinct autograd output whose gradient the norm's backward
// kernel adds to x's. Differentiable in x and weight. The composite is {x, RmsNormComposite}.
std::pair<at::Tensor, at::Tensor> ForkRmsNorm(const at::Tensor& x, const at::Tensor& weight,
                                              double eps);

// The composite references in ATen ops, the model's arithmetic (see above).
at::Tensor RmsNormComposite(const at::Tensor& x, const at::Tensor& weight, double eps);
std::pair<at::Tensor, at::Tensor> AddRmsNormComposite(const at::Tensor& x,
                                                      const at::Tensor& residual,
                                                      const at::Tensor& weight, double eps);

}  // namespace fsdp::kernels
