// The argument checks shared by the multi-tensor functions (kernels/accumulate.cc,
// kernels/cast.cc, over kernels/cuda/multi_tensor.cuh's launches): two lists of one length,
// each pair of one numel, every tensor on one device. Internal to kernels/.
//
//   CheckPairs(dsts, srcs, "cast", "=");
//   // cast: 2 destinations but 1 sources
//   // cast: pair 0 ([4] on cpu = [5] on cpu) must have one numel, on cpu
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

namespace fsdp::kernels {

// As many dsts as srcs; otherwise an error naming `kernel`.
inline void CheckPairCount(at::TensorList dsts, at::TensorList srcs, const char* kernel) {
  TORCH_CHECK(dsts.size() == srcs.size(), kernel, ": ", dsts.size(), " destinations but ",
              srcs.size(), " sources");
}

// CheckPairCount, then each pair of one numel and every tensor on dsts[0]'s device; the error
// names `kernel` and the pair, written "dst <op> src".
inline void CheckPairs(at::TensorList dsts, at::TensorList srcs, const char* kernel,
                       const char* op) {
  CheckPairCount(dsts, srcs, kernel);
  if (dsts.empty()) return;
  const at::Tensor& like = dsts[0];
  for (size_t i = 0; i < dsts.size(); ++i) {
    TORCH_CHECK(dsts[i].numel() == srcs[i].numel() && dsts[i].device() == like.device() &&
                    srcs[i].device() == like.device(),
                kernel, ": pair ", i, " (", dsts[i].sizes(), " on ", dsts[i].device(), " ", op, " ",
                srcs[i].sizes(), " on ", srcs[i].device(), ") must have one numel, on ",
                like.device());
  }
}

}  // namespace fsdp::kernels
