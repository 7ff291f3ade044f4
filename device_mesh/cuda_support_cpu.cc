// CPU-only build of cuda_support.h: no GPU is ever reported, NCCL is refused with the reason.
#include "device_mesh/cuda_support.h"

#include <torch/csrc/distributed/c10d/Backend.hpp>

namespace fsdp {

bool IsCudaBuild() { return false; }
int CudaDeviceCount() { return 0; }
std::string CudaDeviceDescription(int) { return ""; }
std::string CudaRuntimeVersion() { return "none"; }
std::string NcclVersion() { return "none"; }

void CudaSynchronize() {}
std::function<bool()> MarkCurrentCudaStream() { return nullptr; }
int64_t CudaPeakAllocatedBytes(int) { return 0; }
int64_t CudaAllocatedBytes(int) { return 0; }
void CudaResetPeakMemory(int) {}

absl::Status SetCudaDevice(int index) {
  return absl::UnimplementedError(
      "this fsdp.cpp build is CPU-only (the CUDA toolkit did not match the torch wheel at "
      "configure time); CUDA devices cannot be used");
}

absl::StatusOr<c10::DataPtr> AllocatePinnedHost(size_t) {
  return absl::UnimplementedError("pinned host memory needs CUDA: this fsdp.cpp build is CPU-only");
}

absl::StatusOr<c10::intrusive_ptr<c10d::Backend>> CreateNcclBackend(
    const c10::intrusive_ptr<c10d::Store>&, int, int, std::chrono::milliseconds, int) {
  return absl::UnimplementedError(
      "backend 'nccl' is not available: this fsdp.cpp build is CPU-only; use backend 'gloo'");
}

}  // namespace fsdp
