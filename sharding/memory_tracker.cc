#include "sharding/memory_tracker.h"

#include "device_mesh/cuda_support.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <vector>

#include <c10/core/CPUAllocator.h>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <climits>

namespace fsdp {
namespace {

// Each allocation carries its size in a header in front of the data (kHeader keeps the data
// 64-byte aligned, as the default CPU allocator does), so freeing needs no lock or lookup.
// DataPtrs keep data == context: kernels use raw_allocate / raw_deallocate.
constexpr size_t kHeader = 64;
CpuMemoryTracker* g_tracker = nullptr;
c10::Allocator* g_base = nullptr;

int64_t PageBytes() {
  static const int64_t page = [] {
    const long size = sysconf(_SC_PAGESIZE);
    return size > 0 ? static_cast<int64_t>(size) : int64_t{4096};
  }();
  return page;
}

// MapOnDemand's mappings: start -> bytes.
std::mutex g_on_demand_mutex;
std::map<const void*, int64_t>& OnDemandRegions() {
  static auto* regions = new std::map<const void*, int64_t>();
  return *regions;
}

// What is resident of MapOnDemand's mappings now.
int64_t OnDemandResidentBytes() {
  std::lock_guard<std::mutex> lock(g_on_demand_mutex);
  int64_t total = 0;
  for (const auto& [data, bytes] : OnDemandRegions()) total += ResidentBytes(data, bytes);
  return total;
}

}  // namespace

void* MapOnDemand(size_t bytes) {
  const auto page = static_cast<size_t>(PageBytes());
  bytes = (bytes + page - 1) / page * page;
  void* data = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                    MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (data == MAP_FAILED) return nullptr;
#if defined(MADV_NOHUGEPAGE)
  // Base pages only: with transparent huge pages on "always", one write would commit the 2 MiB
  // around it (a neighbouring gradient never written with it) and ResidentBytes would count
  // that as written. Advice only: a kernel without THP refuses it and nothing changes.
  madvise(data, bytes, MADV_NOHUGEPAGE);
#endif
  std::lock_guard<std::mutex> lock(g_on_demand_mutex);
  OnDemandRegions()[data] = static_cast<int64_t>(bytes);
  return data;
}

void UnmapOnDemand(void* data) {
  if (data == nullptr) return;
  int64_t bytes = 0;
  {
    std::lock_guard<std::mutex> lock(g_on_demand_mutex);
    auto it = OnDemandRegions().find(data);
    if (it == OnDemandRegions().end()) return;  // not MapOnDemand's
    bytes = it->second;
    OnDemandRegions().erase(it);
  }
  munmap(data, static_cast<size_t>(bytes));
}

int64_t ResidentBytes(const void* data, int64_t bytes) {
  if (bytes <= 0) return 0;
  const int64_t page = PageBytes();
  const int64_t pages = (bytes + page - 1) / page;
  std::vector<unsigned char> resident(static_cast<size_t>(pages));
  if (mincore(const_cast<void*>(data), static_cast<size_t>(bytes), resident.data()) != 0) {
    return bytes;
  }
  int64_t count = 0;
  for (unsigned char r : resident) count += r & 1;
  return std::min(bytes, count * page);
}

CpuMemoryTracker& CpuMemoryTracker::Install() {
  static CpuMemoryTracker* tracker = [] {
    g_base = c10::GetCPUAllocator();
    g_tracker = new CpuMemoryTracker(g_base);
    c10::SetCPUAllocator(g_tracker, /*priority=*/100);
    return g_tracker;
  }();
  return *tracker;
}

c10::DataPtr CpuMemoryTracker::allocate(size_t n) {
  auto* base = static_cast<char*>(base_->raw_allocate(n + kHeader));
  *reinterpret_cast<size_t*>(base) = n;
  void* data = base + kHeader;
  allocations_.fetch_add(1, std::memory_order_relaxed);
  int64_t now = current_.fetch_add(static_cast<int64_t>(n)) + static_cast<int64_t>(n);
  int64_t peak = peak_.load();
  while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
  }
  return c10::DataPtr(data, data, &CpuMemoryTracker::Free, c10::Device(c10::kCPU));
}

void CpuMemoryTracker::Free(void* data) {
  if (data == nullptr) return;
  char* base = static_cast<char*>(data) - kHeader;
  g_tracker->current_.fetch_sub(static_cast<int64_t>(*reinterpret_cast<size_t*>(base)));
  g_base->raw_deallocate(base);
}

c10::DeleterFnPtr CpuMemoryTracker::raw_deleter() const { return &CpuMemoryTracker::Free; }

void CpuMemoryTracker::copy_data(void* dest, const void* src, std::size_t count) const {
  std::memcpy(dest, src, count);
}

void ConfigureHostAllocator(bool caching) {
#if defined(__GLIBC__)
  if (caching) {
    // See Note [Host caching]. Both also turn off glibc's dynamic threshold adjustment.
    mallopt(M_MMAP_THRESHOLD, INT_MAX);
    mallopt(M_TRIM_THRESHOLD, INT_MAX);
  }
#endif
}

int64_t DeviceAllocatedBytes(c10::Device device) {
  return device.is_cuda() ? CudaAllocatedBytes(device.index())
                          : CpuMemoryTracker::Install().current_bytes() + OnDemandResidentBytes();
}

int64_t DevicePeakBytes(c10::Device device) {
  return device.is_cuda() ? CudaPeakAllocatedBytes(device.index())
                          : CpuMemoryTracker::Install().peak_bytes() + OnDemandResidentBytes();
}

void ResetDevicePeak(c10::Device device) {
  CpuMemoryTracker::Install().ResetPeak();
  if (device.is_cuda()) CudaResetPeakMemory(device.index());
}

HostHeapStats GetHostHeapStats() {
  HostHeapStats stats;
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 33))
  struct mallinfo2 info = mallinfo2();
  stats.held_bytes = static_cast<int64_t>(info.arena + info.hblkhd);
  stats.free_bytes = static_cast<int64_t>(info.fordblks);
#endif
  return stats;
}

int64_t ProcessPeakRssBytes() {
  std::FILE* f = std::fopen("/proc/self/status", "r");
  if (f == nullptr) return 0;
  char line[256];
  long long kib = 0;
  while (std::fgets(line, sizeof(line), f) != nullptr) {
    if (std::sscanf(line, "VmHWM: %lld kB", &kib) == 1) break;
  }
  std::fclose(f);
  return static_cast<int64_t>(kib) * 1024;
}

}  // namespace fsdp
