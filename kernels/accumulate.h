// Gradient accumulation over many tensors at once: dsts[i] += srcs[i], an fp32 sum and a
// gradient of fp32, bf16 or fp16, for a whole list of pairs in one launch (or one per
// kernels/cuda/accumulate.h's table of pairs) instead of one ATen kernel per pair, which for a
// mixed-dtype add is ATen's unrolled, unvectorised path. Bit for bit at::add_: the sum is
// dst + float(src) in fp32, rounded once.
//
//   std::vector<at::Tensor> sums, grads;  // fp32 [rows, cols]; bf16, any shape of that numel
//   ...
//   fsdp::kernels::AccumulateInto(sums, grads);  // sums[i].view(-1) += grads[i].view(-1)
//
// CUDA tensors run kernels/cuda/accumulate.cu; others the CPU reference (kernels/accumulate.cc):
// dst.add_(src) per pair. Not differentiable (gradient bookkeeping runs under no-grad).
#pragma once

#include <ATen/core/Tensor.h>

namespace fsdp::kernels {

// dsts[i] += srcs[i] (as flat tensors: each pair has one numel, shapes may differ), all on one
// device. Pairs the kernel takes: dst float32 and contiguous, src float32 / bfloat16 / float16
// and contiguous, grouped by src dtype, one launch per group; any other pair (strided, another
// dtype) runs at::add_. No dst may overlap another pair's dst or any src.
void AccumulateInto(at::TensorList dsts, at::TensorList srcs);

// The reference: dsts[i].add_(srcs[i] reshaped to dsts[i]'s shape), pair by pair.
void AccumulateIntoComposite(at::TensorList dsts, at::TensorList srcs);

}  // namespace fsdp::kernels
