#include "kernels/dispatch.h"

#include <c10/util/Exception.h>

#ifdef FSDP_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <cuda_runtime.h>
#endif

namespace fsdp::kernels {

bool CudaKernelsBuilt() {
#ifdef FSDP_WITH_CUDA
  return true;
#else
  return false;
#endif
}

bool OnCuda(const at::Tensor& t, const char* kernel) {
  if (!t.is_cuda()) return false;
  TORCH_CHECK(CudaKernelsBuilt(), "fsdp kernel ", kernel,
              ": a CUDA tensor, but this build of fsdp.cpp has no CUDA kernels (configured with "
              "a CPU torch wheel or FSDP_CUDA_MODE=off)");
  return true;
}

cuda::Stream CurrentStream(const at::Tensor& t) {
#ifdef FSDP_WITH_CUDA
  return static_cast<cuda::Stream>(at::cuda::getCurrentCUDAStream(t.device().index()).stream());
#else
  TORCH_CHECK(false, "CurrentStream: this build has no CUDA");
#endif
}

void CheckLaunch(cuda::LaunchStatus status, const char* kernel) {
#ifdef FSDP_WITH_CUDA
  TORCH_CHECK(status == 0, "fsdp kernel ", kernel, ": CUDA launch failed: ",
              cudaGetErrorString(static_cast<cudaError_t>(status)));
#else
  TORCH_CHECK(status == 0, "fsdp kernel ", kernel, ": launch failed (", status, ")");
#endif
}

}  // namespace fsdp::kernels
