// The CUDA / NCCL side of device_mesh, behind a header with no CUDA includes.
//
// In a CUDA build (FSDP_WITH_CUDA, see cmake/Libtorch.cmake) this wraps libtorch_cuda's device
// queries and c10d::ProcessGroupNCCL; in a CPU-only build every query reports no CUDA and
// CreateNcclBackend returns kUnimplemented naming the build, so callers need no #ifdefs.
//
//   if (CudaDeviceCount() > 0) FSDP_RETURN_IF_ERROR(SetCudaDevice(local_rank % CudaDeviceCount()));
#pragma once

#include <chrono>
#include <functional>
#include <string>

#include <c10/core/Allocator.h>
#include <c10/util/intrusive_ptr.h>

#include "absl/status/statusor.h"

namespace c10d {
class Backend;
class Store;
}  // namespace c10d

namespace fsdp {

// True when the CUDA/NCCL code paths were compiled in.
bool IsCudaBuild();
// Number of visible GPUs; 0 in a CPU-only build or on a machine without GPUs.
int CudaDeviceCount();
// "NVIDIA H100 80GB HBM3 (79.1 GiB, sm_90)"; empty if the index is not a device.
std::string CudaDeviceDescription(int index);
// CUDA runtime version as "13.0", or "none".
std::string CudaRuntimeVersion();
// NCCL version as "2.28.9", or "none".
std::string NcclVersion();
// Blocks until all work on the current CUDA device is done (no-op without CUDA).
void CudaSynchronize();
// Peak bytes allocated by libtorch's CUDA caching allocator on `index` since the last reset
// (0 without CUDA), and the reset.
int64_t CudaPeakAllocatedBytes(int index);
int64_t CudaAllocatedBytes(int index);  // currently allocated
void CudaResetPeakMemory(int index);
// Makes `index` this thread's current CUDA device.
absl::Status SetCudaDevice(int index);
// An event recorded now on the current CUDA stream of the current device, as a query of whether
// the stream has passed it (callable from any thread). nullptr in a CPU-only build or without a
// GPU. Holds no tensor.
std::function<bool()> MarkCurrentCudaStream();

// `bytes` of page-locked host memory (cudaHostAlloc), which non_blocking copies to and from a
// GPU move by DMA, freed with the returned DataPtr. Exactly the size asked: libtorch's pinned
// allocator (TensorOptions::pinned_memory) rounds every block up to a power of two, up to
// twice the host memory for the large buffers CPU offload keeps. kResourceExhausted with
// CUDA's reason; kUnimplemented in a CPU-only build.
absl::StatusOr<c10::DataPtr> AllocatePinnedHost(size_t bytes);

// A ProcessGroupNCCL over `store` for CUDA tensors on device `device_index`. Communicators are
// created lazily by libtorch on the first collective.
absl::StatusOr<c10::intrusive_ptr<c10d::Backend>> CreateNcclBackend(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
    std::chrono::milliseconds timeout, int device_index);

}  // namespace fsdp
