// Dtype casts over many tensors at once: dsts[i] = srcs[i], each of fp32, bf16 or fp16 in any
// combination, for a whole list of pairs in one launch per (dst dtype, src dtype) (and per
// kernels/cuda/cast.h's table of pairs) instead of one ATen copy kernel per pair. Bit for bit
// at::Tensor::copy_ on the same device, NaN, inf, denormals and fp16 overflow included.
//
//   std::vector<at::Tensor> flats, shards;  // bf16 [n_i]; fp32, any shape of n_i elements
//   ...
//   fsdp::kernels::CastInto(flats, shards);  // flats[i].view(-1).copy_(shards[i].view(-1))
//
// CUDA tensors run kernels/cuda/cast.cu; others the CPU reference (kernels/cast.cc): dst.copy_
// per pair. Not differentiable (parameter and gradient bookkeeping runs under no-grad).
#pragma once

#include <ATen/core/Tensor.h>

namespace fsdp::kernels {

// dsts[i] = srcs[i] (as flat tensors: each pair has one numel, shapes may differ), all on one
// device. Pairs the kernel takes: dst and src contiguous, each float32 / bfloat16 / float16,
// grouped by (dst dtype, src dtype), one launch per group; any other pair (strided, a negated
// view, another dtype) runs dst.copy_. Each dst's version counter moves as copy_'s would. No dst
// may overlap another pair's dst or any src.
void CastInto(at::TensorList dsts, at::TensorList srcs);

// The reference: dsts[i].copy_(srcs[i] reshaped to dsts[i]'s shape), pair by pair.
void CastIntoComposite(at::TensorList dsts, at::TensorList srcs);

}  // namespace fsdp::kernels
