#include "sharding/comm_stats.h"

#include <fmt/format.h>

namespace fsdp {

const char* CommKindName(CommKind kind) {
  switch (kind) {
    case CommKind::kAllGather: return "all_gather";
    case CommKind::kReduceScatter: return "reduce_scatter";
    case CommKind::kAllReduce: return "all_reduce";
  }
  return "?";
}

void CommStats::RecordIssue(CommKind kind, int64_t bytes) {
  CommCounter& c = counters_[static_cast<int>(kind)];
  ++c.calls;
  c.bytes += bytes;
}

void CommStats::RecordWait(CommKind kind, double seconds) {
  counters_[static_cast<int>(kind)].wait_seconds += seconds;
}

std::string CommStats::ToString() const {
  std::string out;
  for (int k = 0; k < kNumCommKinds; ++k) {
    const CommCounter& c = counters_[k];
    out += fmt::format("{}{}: {} calls, {} bytes, waited {:.6f} s", k ? "; " : "",
                       CommKindName(static_cast<CommKind>(k)), c.calls, c.bytes, c.wait_seconds);
  }
  return out;
}

}  // namespace fsdp
