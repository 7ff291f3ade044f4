// One loop per element for offload's host step: a bf16 (or fp32) gradient converted and
// clipped, the Adam or AdamW update, and the updated master cast to its bf16 copy, rounded as
// ATen's fused CPU kernel rounds (Note [Host Adam pass] in host_adam.cc).
//
//   if (HostAdamPassAvailable()) {
//     HostAdamPass(hyper, clip_scale, master.numel(), master_ptr, exp_avg_ptr, exp_avg_sq_ptr,
//                  grad, copy_bf16_ptr);   // grad: bf16 or fp32; copy_bf16_ptr may be null
//   }
#pragma once

#include <cstdint>

namespace at {
class Tensor;
}  // namespace at

namespace fsdp {

struct HostAdamHyper {
  double lr = 0, beta1 = 0, beta2 = 0, eps = 0, weight_decay = 0;
  bool decoupled = true;  // AdamW's decay (p *= 1 - lr * wd); false: Adam's L2 (g += wd * p)
  double step = 1;        // the step count after this update
};

// Whether HostAdamPass gives ATen's _fused_adam(w)_ values bit for bit on this machine: an
// x86-64 CPU with AVX2 and FMA, ATen running its AVX2 or AVX-512 kernels, and a check against
// ATen's ops at the first call that found the same bits.
bool HostAdamPassAvailable();

// Whether the pass computes these hyper-parameters' update: AdamW, and Adam without weight
// decay (Adam's L2 decay is left to ATen).
bool HostAdamPassCovers(const HostAdamHyper& hyper);

// Steps `n` fp32 elements in place (param, exp_avg, exp_avg_sq) with the gradient
// float(grad[i]) * scale, on threads of its own, and writes the updated param rounded to bf16
// into copy_bf16 when it is not null. `grad`: bf16 (offload params' deferred gradient) or fp32
// (gradients that reach the host in fp32: several shards, sums on the host, fp32 compute,
// offload optimizer), on the CPU, contiguous, at least n elements. Bit for bit what copying the
// gradient into fp32, multiplying it by `scale` (skipped when scale is 1), ATen's fused kernel
// on the whole tensor and copy_ to bf16 give. Requires HostAdamPassAvailable() and
// HostAdamPassCovers(hyper).
void HostAdamPass(const HostAdamHyper& hyper, float scale, int64_t n, float* param, float* exp_avg,
                  float* exp_avg_sq, const at::Tensor& grad, uint16_t* copy_bf16);

}  // namespace fsdp
