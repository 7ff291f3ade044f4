// CUDA build of cuda_support.h: libtorch_cuda's device queries and ProcessGroupNCCL.
#include "device_mesh/cuda_support.h"

#include <cuda_runtime_api.h>

#include <c10/cuda/CUDACachingAllocator.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include <fmt/format.h>

namespace fsdp {

bool IsCudaBuild() { return true; }

int CudaDeviceCount() {
  // c10's count is 0 (not an error) when there is no driver or no device.
  return static_cast<int>(c10::cuda::device_count());
}

std::string CudaDeviceDescription(int index) {
  if (index < 0 || index >= CudaDeviceCount()) return "";
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, index) != cudaSuccess) return "";
  return fmt::format("{} ({:.1f} GiB, sm_{}{})", prop.name,
                         static_cast<double>(prop.totalGlobalMem) / (1 << 30), prop.major,
                         prop.minor);
}

std::string CudaRuntimeVersion() {
  int version = 0;
  if (cudaRuntimeGetVersion(&version) != cudaSuccess) return "none";
  return fmt::format("{}.{}", version / 1000, (version % 1000) / 10);
}

std::string NcclVersion() { return c10d::getNcclVersion(); }

void CudaSynchronize() {
  if (CudaDeviceCount() > 0) c10::cuda::device_synchronize();
}

std::function<bool()> MarkCurrentCudaStream() {
  if (CudaDeviceCount() == 0) return nullptr;
  auto event = std::make_shared<at::cuda::CUDAEvent>(cudaEventDisableTiming);
  const c10::cuda::CUDAStream stream = at::cuda::getCurrentCUDAStream();
  event->record(stream);
  // A CUDA error here (a kernel that faulted) is the training thread's to report: the query
  // then says "passed" rather than throwing out of the watchdog's thread.
  // The query runs on the watchdog's thread, whose current device is 0 unless set: a runtime
  // call there would create a context on GPU 0 (~0.5 GiB) for every rank of a node. Under the
  // event's own device the thread touches only that one (and CUDAGuard restores device 0
  // without creating its context; CUDAEvent's destructor guards itself the same way).
  return [event, device = stream.device_index()]() noexcept {
    try {
      c10::cuda::CUDAGuard on_device(device);
      return event->query();
    } catch (const std::exception&) {
      return true;
    }
  };
}

int64_t CudaPeakAllocatedBytes(int index) {
  if (index < 0 || index >= CudaDeviceCount()) return 0;
  auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(index));
  return stats.allocated_bytes[0].peak;  // aggregate over pools
}

int64_t CudaAllocatedBytes(int index) {
  if (index < 0 || index >= CudaDeviceCount()) return 0;
  auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(index));
  return stats.allocated_bytes[0].current;
}

void CudaResetPeakMemory(int index) {
  if (index < 0 || index >= CudaDeviceCount()) return;
  c10::cuda::CUDACachingAllocator::resetPeakStats(static_cast<c10::DeviceIndex>(index));
}

absl::StatusOr<c10::DataPtr> AllocatePinnedHost(size_t bytes) {
  void* ptr = nullptr;
  cudaError_t err = cudaHostAlloc(&ptr, std::max<size_t>(bytes, 1), cudaHostAllocDefault);
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear it: the failure is reported here, not by a later call
    return absl::ResourceExhaustedError(
        fmt::format("cudaHostAlloc of {} bytes failed: {}", bytes, cudaGetErrorString(err)));
  }
  return c10::DataPtr(
      ptr, ptr, [](void* p) { cudaFreeHost(p); }, c10::Device(c10::kCPU));
}

absl::Status SetCudaDevice(int index) {
  int count = CudaDeviceCount();
  if (index < 0 || index >= count) {
    return absl::FailedPreconditionError(fmt::format(
        "CUDA device {} does not exist: {} device(s) visible (CUDA_VISIBLE_DEVICES?)", index,
        count));
  }
  c10::cuda::set_device(static_cast<c10::DeviceIndex>(index));
  return absl::OkStatus();
}

absl::StatusOr<c10::intrusive_ptr<c10d::Backend>> CreateNcclBackend(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
    std::chrono::milliseconds timeout, int device_index) {
  if (CudaDeviceCount() == 0) {
    return absl::FailedPreconditionError(
        "backend 'nccl' needs a CUDA device, and none is visible on this machine");
  }
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  try {
    auto backend = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, options);
    // The rank's device, as init_process_group(device_id=...) binds it: without it libtorch
    // guesses rank % device count wherever no tensor names the device (and warns).
    backend->setBoundDeviceId(
        at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(device_index)));
    return c10::intrusive_ptr<c10d::Backend>(std::move(backend));
  } catch (const std::exception& e) {
    return absl::InternalError(fmt::format(
        "creating the NCCL process group (rank {} of {}, cuda:{}) failed: {}", rank, size,
        device_index, e.what()));
  }
}

}  // namespace fsdp
