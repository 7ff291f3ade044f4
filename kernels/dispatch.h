// How a kernel's .cc side picks its implementation and calls a CUDA launcher: CUDA tensors go
// to kernels/cuda/ (an error naming the kernel in a build without CUDA), everything else to the
// CPU reference in the same .cc. Internal to kernels/.
//
//   if (OnCuda(x, "rms_norm")) {
//     CheckLaunch(cuda::RmsNormForward(..., ToKernelDType(x), CurrentStream(x)), "rms_norm");
//   } else {
//     RmsNormForwardCpu(...);
//   }
#pragma once

#include <ATen/core/Tensor.h>

#include "kernels/cuda/types.h"

namespace fsdp::kernels {

// Whether this build compiled the CUDA kernels.
bool CudaKernelsBuilt();

// True for a CUDA tensor (the CUDA kernels must be built: otherwise an error naming `kernel`),
// false for any other device (the CPU reference runs).
bool OnCuda(const at::Tensor& t, const char* kernel);

// float32, bfloat16, float16; anything else is an error naming `kernel` and the dtype.
cuda::DType ToKernelDType(const at::Tensor& t, const char* kernel);

// The current CUDA stream of `t`'s device (ATen's), for a launcher.
cuda::Stream CurrentStream(const at::Tensor& t);

// Throws naming `kernel` and CUDA's error string when `status` is not success.
void CheckLaunch(cuda::LaunchStatus status, const char* kernel);

}  // namespace fsdp::kernels
