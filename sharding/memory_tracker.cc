#include "sharding/memory_tracker.h"

#include <cstring>
#include <mutex>
#include <unordered_map>

#include <c10/core/CPUAllocator.h>

namespace fsdp {
namespace {

// DataPtrs keep data == context (kernels use raw_allocate / raw_deallocate), so sizes are
// looked up by address.
std::mutex g_mu;
std::unordered_map<void*, size_t>* g_sizes = nullptr;
CpuMemoryTracker* g_tracker = nullptr;
c10::Allocator* g_base = nullptr;

}  // namespace

CpuMemoryTracker& CpuMemoryTracker::Install() {
  static CpuMemoryTracker* tracker = [] {
    g_sizes = new std::unordered_map<void*, size_t>();
    g_base = c10::GetCPUAllocator();
    g_tracker = new CpuMemoryTracker(g_base);
    c10::SetCPUAllocator(g_tracker, /*priority=*/100);
    return g_tracker;
  }();
  return *tracker;
}

c10::DataPtr CpuMemoryTracker::allocate(size_t n) {
  void* data = base_->raw_allocate(n);
  {
    std::lock_guard<std::mutex> lock(g_mu);
    (*g_sizes)[data] = n;
  }
  int64_t now = current_.fetch_add(static_cast<int64_t>(n)) + static_cast<int64_t>(n);
  int64_t peak = peak_.load();
  while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
  }
  return c10::DataPtr(data, data, &CpuMemoryTracker::Free, c10::Device(c10::kCPU));
}

void CpuMemoryTracker::Free(void* data) {
  if (data == nullptr) return;
  size_t n = 0;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    auto it = g_sizes->find(data);
    if (it != g_sizes->end()) {
      n = it->second;
      g_sizes->erase(it);
    }
  }
  g_tracker->current_.fetch_sub(static_cast<int64_t>(n));
  g_base->raw_deallocate(data);
}

c10::DeleterFnPtr CpuMemoryTracker::raw_deleter() const { return &CpuMemoryTracker::Free; }

void CpuMemoryTracker::copy_data(void* dest, const void* src, std::size_t count) const {
  std::memcpy(dest, src, count);
}

}  // namespace fsdp
