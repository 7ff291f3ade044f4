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

#include <c10/core/Allocator.h>

namespace fsdp {

class CpuMemoryTracker final : public c10::Allocator {
 public:
  // Installs the process-wide tracker on first use and returns it.
  static CpuMemoryTracker& Install();

  int64_t current_bytes() const { return current_.load(); }
  int64_t peak_bytes() const { return peak_.load(); }
  void ResetPeak() { peak_.store(current_.load()); }

  c10::DataPtr allocate(size_t n) override;
  void copy_data(void* dest, const void* src, std::size_t count) const override;
  c10::DeleterFnPtr raw_deleter() const override;

 private:
  explicit CpuMemoryTracker(c10::Allocator* base) : base_(base) {}
  static void Free(void* context);

  c10::Allocator* base_;
  std::atomic<int64_t> current_{0};
  std::atomic<int64_t> peak_{0};
};

// The process's peak resident set size in bytes (VmHWM of /proc/self/status): everything the
// process ever touched at once, libtorch's code and the allocator's caches included; 0 when
// it cannot be read.
int64_t ProcessPeakRssBytes();

}  // namespace fsdp
