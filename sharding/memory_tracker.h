// Counts the bytes of every CPU tensor allocation, current and peak, by wrapping libtorch's
// CPU allocator. Used by tests and benchmarks to measure memory per rank from the real
// allocations (RSS is dominated by libtorch's own code and data).
//
// Install it before creating the tensors to be counted (allocations made before are freed
// through their own deleters and never counted):
//
//   CpuMemoryTracker& tracker = CpuMemoryTracker::Install();
//   tracker.ResetPeak();
//   ... train ...
//   int64_t peak = tracker.peak_bytes();
#pragma once

#include <atomic>
#include <cstdint>
#include <string>

#include <c10/core/Allocator.h>
#include <c10/core/Device.h>

#include "absl/status/status.h"

namespace fsdp {

class CpuMemoryTracker final : public c10::Allocator {
 public:
  // Installs the process-wide tracker on first use and returns it.
  static CpuMemoryTracker& Install();

  int64_t current_bytes() const { return current_.load(); }
  int64_t peak_bytes() const { return peak_.load(); }
  void ResetPeak() { peak_.store(current_.load()); }
  // Allocations made through the tracker so far (tests count a steady-state step's).
  int64_t allocations() const { return allocations_.load(); }

  c10::DataPtr allocate(size_t n) override;
  void copy_data(void* dest, const void* src, std::size_t count) const override;
  c10::DeleterFnPtr raw_deleter() const override;

 private:
  explicit CpuMemoryTracker(c10::Allocator* base) : base_(base) {}
  static void Free(void* context);

  c10::Allocator* base_;
  std::atomic<int64_t> current_{0};
  std::atomic<int64_t> peak_{0};
  std::atomic<int64_t> allocations_{0};
};

// Host memory reserved without being committed: an anonymous private mapping (MAP_NORESERVE)
// whose pages take memory when first written and read as zero until then (offload's fp32
// gradients: Note [Gradients committed on demand] in offload/host_buffers.cc). Base pages only (no
// transparent huge pages), so a write commits its own page and no more. `bytes` is rounded up
// to whole pages; nullptr (errno set) when the mapping fails. Freed by UnmapOnDemand. While
// mapped, its resident pages count in the CPU's DeviceAllocatedBytes and DevicePeakBytes
// below, as the tracker's allocations do.
void* MapOnDemand(size_t bytes);
void UnmapOnDemand(void* data);
// Bytes of [data, data + bytes) in resident pages, at most `bytes`; `data` on a page boundary.
// When the kernel cannot say (mincore fails), all of them. A page of MapOnDemand's that was
// read but never written maps the kernel's shared zero page: it takes no memory, yet counts
// here (mincore cannot tell them apart), so code that keeps such pages unwritten reads them
// neither.
int64_t ResidentBytes(const void* data, int64_t bytes);

// Tensor bytes on `device`: the CUDA caching allocator's for a GPU, the CPU tracker's (once
// installed) for the host, with what is resident of MapOnDemand's mappings. Allocated now /
// the peak since the last reset (those pages stay resident until unmapped, so at most the
// pages written after the peak are counted in it too).
int64_t DeviceAllocatedBytes(c10::Device device);
int64_t DevicePeakBytes(c10::Device device);
void ResetDevicePeak(c10::Device device);

// Note [Host caching]: a training step frees and allocates the same large host buffers every
// step (unsharded parameters, gradients, activations, collective buffers). With glibc's
// defaults each one above the mmap threshold (128 KiB, rising to at most 32 MiB) is a fresh
// mmap and each free an munmap, and the heap is trimmed whenever its free top passes twice the
// threshold, so the kernel faults in and zeroes the same pages again every step: measured on
// the 125M config at 4 ranks, a third of the run's CPU time was system time. "caching" sets
// M_MMAP_THRESHOLD and M_TRIM_THRESHOLD out of reach (mallopt), so freed blocks stay in the
// heap, where glibc coalesces and reuses them, as PyTorch's CUDA caching allocator keeps freed
// device memory: the resident set stays at the high-water mark of the live bytes plus the
// heap's fragmentation instead of shrinking between steps. "default" (caching = false) leaves
// glibc as it is. Process-wide. Without glibc, caching does nothing.
void ConfigureHostAllocator(bool caching);

struct HostHeapStats {
  int64_t held_bytes = 0;  // obtained from the kernel: heap arenas + mmapped blocks
  int64_t free_bytes = 0;  // of which free for reuse
};
// glibc's view of the host heap (mallinfo2); zeros without glibc.
HostHeapStats GetHostHeapStats();

// The process's peak resident set size in bytes (VmHWM of /proc/self/status): everything the
// process ever touched at once, libtorch's code and the allocator's caches included; 0 when
// it cannot be read.
int64_t ProcessPeakRssBytes();

}  // namespace fsdp
