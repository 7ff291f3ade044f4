// MapOnDemand's mappings (sharding/memory_tracker.h): a page takes memory only when written, a
// write commits its own page and no more, and the CPU's counts include what is resident.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>

#include "gtest/gtest.h"
#include "sharding/memory_tracker.h"

namespace fsdp {
namespace {

constexpr int64_t kMiB = int64_t{1} << 20;

// The VmFlags line of the mapping that starts at `data` in /proc/self/smaps; "" when the file
// cannot be read or has no such mapping.
std::string VmFlagsOf(const void* data) {
  std::ifstream smaps("/proc/self/smaps");
  char start[32];
  std::snprintf(start, sizeof(start), "%lx-", reinterpret_cast<unsigned long>(data));
  std::string line;
  bool inside = false;
  while (std::getline(smaps, line)) {
    if (line.rfind(start, 0) == 0) {
      inside = true;
    } else if (inside && line.rfind("VmFlags:", 0) == 0) {
      return line.substr(8) + " ";
    }
  }
  return "";
}

TEST(OnDemandMappingTest, AWriteCommitsItsOwnPageOnly) {
  const int64_t page = sysconf(_SC_PAGESIZE);
  ASSERT_GT(page, 0);
  // 8 MiB spans whole 2 MiB ranges, which a transparent huge page would commit at once.
  const int64_t bytes = 8 * kMiB;
  const int64_t allocated = DeviceAllocatedBytes(c10::Device(c10::kCPU));
  auto* data = static_cast<unsigned char*>(MapOnDemand(static_cast<size_t>(bytes)));
  ASSERT_NE(data, nullptr);
  EXPECT_EQ(ResidentBytes(data, bytes), 0);
  EXPECT_EQ(DeviceAllocatedBytes(c10::Device(c10::kCPU)), allocated);

  data[4 * kMiB + 100] = 7;  // inside an aligned 2 MiB range
  EXPECT_EQ(ResidentBytes(data, bytes), page);
  EXPECT_EQ(DeviceAllocatedBytes(c10::Device(c10::kCPU)), allocated + page);
  data[4 * kMiB + page + 1] = 7;  // the next page
  EXPECT_EQ(ResidentBytes(data, bytes), 2 * page);
  EXPECT_EQ(ResidentBytes(data + 4 * kMiB, page), page);  // a range of the mapping
  EXPECT_EQ(ResidentBytes(data, 4 * kMiB), 0);

  UnmapOnDemand(data);
  EXPECT_EQ(DeviceAllocatedBytes(c10::Device(c10::kCPU)), allocated);
}

TEST(OnDemandMappingTest, TakesNoTransparentHugePages) {
  const int64_t bytes = 8 * kMiB;
  void* data = MapOnDemand(static_cast<size_t>(bytes));
  ASSERT_NE(data, nullptr);
  const std::string flags = VmFlagsOf(data);
  UnmapOnDemand(data);
  if (flags.empty()) GTEST_SKIP() << "/proc/self/smaps has no VmFlags for the mapping here";
  // "nh": MADV_NOHUGEPAGE; "nr": MAP_NORESERVE (see proc(5)).
  EXPECT_NE(flags.find(" nh "), std::string::npos) << "VmFlags:" << flags;
  EXPECT_NE(flags.find(" nr "), std::string::npos) << "VmFlags:" << flags;
}

TEST(OnDemandMappingTest, UnmapIgnoresWhatItDidNotMap) {
  int local = 0;
  UnmapOnDemand(nullptr);
  UnmapOnDemand(&local);  // not MapOnDemand's: left alone
  local = 1;
  EXPECT_EQ(local, 1);
  // Sizes round up to whole pages.
  void* data = MapOnDemand(1);
  ASSERT_NE(data, nullptr);
  static_cast<char*>(data)[sysconf(_SC_PAGESIZE) - 1] = 1;
  EXPECT_EQ(ResidentBytes(data, sysconf(_SC_PAGESIZE)), sysconf(_SC_PAGESIZE));
  UnmapOnDemand(data);
}

}  // namespace
}  // namespace fsdp
