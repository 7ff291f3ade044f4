// How a kernel's .cc side picks its implementation and calls a CUDA launcher: CUDA tensors go
// to kernels/cuda/ (an error naming the kernel in a build without CUDA), everything else to the
// CPU reference in the same .cc. Internal to kernels/.
//
//   if (OnCuda(x, "rms_norm")) {
//     FSDP_CUDA_LAUNCH(x, "rms_norm", cuda::RmsNormForward(..., ToKernelDType(x), CurrentStream(x)));
//   } else {
//     RmsNormForwardCpu(...);
//   }
//
// Note [CUDA launchers in a CPU build]
// kernels/cuda/*.cu are compiled only in a CUDA build (FSDP_WITH_CUDA), so the calls to the
// cuda:: launchers are compiled only there too: otherwise fsdp_kernels would not link. Without
// them the CUDA branch is empty, and never taken: OnCuda throws for a CUDA tensor.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/DeviceGuard.h>
#include <c10/util/Exception.h>

#include "kernels/cuda/types.h"

namespace fsdp::kernels {

// Whether this build compiled the CUDA kernels.
bool CudaKernelsBuilt();

// True for a CUDA tensor (the CUDA kernels must be built: otherwise an error naming `kernel`),
// false for any other device (the CPU reference runs).
bool OnCuda(const at::Tensor& t, const char* kernel);

// float32, bfloat16, float16; anything else is an error naming `kernel` and the dtype. Inline:
// the CUDA emulator's copy of this library (tests/cuda_emulation) shares it.
inline cuda::DType ToKernelDType(const at::Tensor& t, const char* kernel) {
  switch (t.scalar_type()) {
    case at::kFloat: return cuda::DType::kFloat;
    case at::kBFloat16: return cuda::DType::kBFloat16;
    case at::kHalf: return cuda::DType::kHalf;
    default:
      TORCH_CHECK(false, "fsdp kernel ", kernel, ": dtype ", t.scalar_type(),
                  " is not supported (float32, bfloat16, float16)");
  }
}

// The current CUDA stream of `t`'s device (ATen's), for a launcher.
cuda::Stream CurrentStream(const at::Tensor& t);

// Throws naming `kernel` and CUDA's error string when `status` is not success.
void CheckLaunch(cuda::LaunchStatus status, const char* kernel);

}  // namespace fsdp::kernels

// Runs `launch` (a cuda:: launcher call) on the device of `like` and checks its status, naming
// `kernel`; compiled to nothing in a build without CUDA (Note [CUDA launchers in a CPU build]).
#ifdef FSDP_WITH_CUDA
#define FSDP_CUDA_LAUNCH(like, kernel, launch)                        \
  do {                                                                \
    c10::DeviceGuard fsdp_device_guard((like).device());              \
    ::fsdp::kernels::CheckLaunch((launch), (kernel));                 \
  } while (0)
#else
#define FSDP_CUDA_LAUNCH(like, kernel, launch) \
  do {                                         \
  } while (0)
#endif
