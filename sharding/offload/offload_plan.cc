#include "sharding/offload/offload_plan.h"

#include <algorithm>
#include <fstream>
#include <sstream>

#include <fmt/format.h>

namespace fsdp {

ComputeCopyChoice ChooseComputeCopy(const ComputeCopyInputs& in) {
  constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
  switch (in.requested) {
    case ComputeCopy::kKeep: return {true, "FSDP_OFFLOAD_COMPUTE_COPY=1"};
    case ComputeCopy::kDrop: return {false, "FSDP_OFFLOAD_COMPUTE_COPY=0"};
    case ComputeCopy::kAuto: break;
  }
  if (in.delayed_update) return {true, "the delayed update loads it"};
  if (in.host_available <= 0) return {true, "host memory unknown"};
  const double with = in.host_bytes_without + in.copy_bytes;
  if (with <= in.host_available) {
    return {true, fmt::format("{:.2f} GiB of host memory with it, {:.2f} GiB available per rank",
                              with / kGiB, in.host_available / kGiB)};
  }
  if (in.host_bytes_without <= in.host_available) {
    return {false,
            fmt::format("{:.2f} GiB of host memory with it, {:.2f} GiB without, {:.2f} GiB "
                        "available per rank: twice the host->device bytes instead",
                        with / kGiB, in.host_bytes_without / kGiB, in.host_available / kGiB)};
  }
  return {true, fmt::format("{:.2f} GiB of host memory even without it, {:.2f} GiB available "
                            "per rank",
                            in.host_bytes_without / kGiB, in.host_available / kGiB)};
}

double HostMemoryAvailablePerRank(int ranks_on_node) {
  std::ifstream meminfo("/proc/meminfo");
  std::string line;
  while (std::getline(meminfo, line)) {
    std::istringstream in(line);
    std::string name;
    double kib = 0;
    if (in >> name >> kib && name == "MemAvailable:") {
      return kib * 1024.0 / std::max(1, ranks_on_node);
    }
  }
  return 0;
}

}  // namespace fsdp
