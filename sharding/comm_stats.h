// Counters of every collective the FSDP engine issues: kind, calls, bytes, and the time the
// calling thread spent blocked waiting for them. Tests and benchmarks read them to check
// communication volume against the theory (bytes are the full collective buffer: all-gather
// output, reduce-scatter input, all-reduce tensor; a collective over a group of one rank is
// skipped and not counted).
//
//   const CommStats& stats = model.comm_stats();
//   stats.Get(CommKind::kAllGather).bytes;   // e.g. 2 x sum of unit sizes per FULL_SHARD step
#pragma once

#include <array>
#include <cstdint>
#include <string>

namespace fsdp {

enum class CommKind { kAllGather = 0, kReduceScatter = 1, kAllReduce = 2 };
constexpr int kNumCommKinds = 3;
const char* CommKindName(CommKind kind);

struct CommCounter {
  int64_t calls = 0;
  int64_t bytes = 0;
  double wait_seconds = 0;
};

class CommStats {
 public:
  void RecordIssue(CommKind kind, int64_t bytes);
  void RecordWait(CommKind kind, double seconds);
  const CommCounter& Get(CommKind kind) const { return counters_[static_cast<int>(kind)]; }
  void Reset() { counters_ = {}; }
  // "all_gather: 12 calls, 1.5 MB, waited 0.003 s; reduce_scatter: ..."
  std::string ToString() const;

 private:
  std::array<CommCounter, kNumCommKinds> counters_{};
};

}  // namespace fsdp
