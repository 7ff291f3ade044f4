// The launcher's account of a failed attempt: which local rank failed first (Note [The first
// failure], failure_summary.cc), the folder where the ranks leave their failure records, and
// which node failed first in the job (Note [Launchers across nodes], node_rendezvous.h).
//
// Each failing rank writes its one line with the time it failed into FSDP_FAILURE_DIR
// (common/failure.h); once the local group has stopped, the launcher reads those records and
// names the rank that failed first on its own account, not the first exit it reaped. With
// several nodes, each node's launcher turns its headline into a NodeReport, and every launcher
// names the job's first failure from all of them (SummarizeNodeReports).
//
//   FailureDir failures;    // a fresh /tmp/fsdp-failures-XXXXXX, removed with the object
//   failures.Clear();       // before each attempt: an earlier attempt's records are not its own
//   ... start the ranks with FSDP_FAILURE_DIR=failures.path(), wait for them ...
//   FailureHeadline h = SummarizeFailures(result, failures.Read());
//   std::cerr << "fsdp launch: " << h.text << "\n";   // "rank 2 failed first: rank 2: ..."
//   return h.code;
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "common/failure.h"
#include "launcher/worker_group.h"

namespace fsdp {

// The launcher's line when a local rank failed (Note [The first failure], failure_summary.cc):
// the first rank to fail on its own account with its line, every other rank that failed on its
// own with its class and what, then the ranks that only followed. `code`: the exit code to
// return (the first failure's).
struct FailureHeadline {
  int rank = -1;
  std::string text;  // "rank 2 failed first: rank 2: checkpoint: ...; ranks 0,1 stopped after ..."
  int code = 1;
  // The first rank failed on its own account (not "peer lost", not stopped by us), and when:
  // what another node's launcher weighs this node's failure by (Note [Launchers across nodes]).
  bool primary = true;
  int64_t time_ns = 0;
};
FailureHeadline SummarizeFailures(const GroupResult& result,
                                  const std::vector<FailureRecord>& records);

// A fresh folder for the ranks' failure records (FSDP_FAILURE_DIR), removed with everything in
// it when the object goes; path() is empty when none could be made.
class FailureDir {
 public:
  FailureDir();
  ~FailureDir();
  FailureDir(const FailureDir&) = delete;
  FailureDir& operator=(const FailureDir&) = delete;

  const std::string& path() const { return path_; }
  // Removes the records left in the folder: an earlier attempt's records are not this one's.
  void Clear() const;
  // The ranks' records (common/failure.h); none without a folder.
  std::vector<FailureRecord> Read() const;

 private:
  std::string path_;
};

// One node's account of an attempt (Note [Launchers across nodes]).
struct NodeReport {
  int code = 0;          // 0: its ranks finished; -1: stopped after another node failed
  bool primary = false;  // its first failure was its own (not a lost peer, not a stop)
  bool restartable = false;
  int64_t time_ns = 0;
  std::string text;  // its headline
};

// The job's account of an attempt, from every node's report.
struct JobOutcome {
  std::string text;
  int code = 1;
  bool restartable = false;
  std::string not_restarted;  // why not, when a restart was possible by count
  int silent_nodes = 0;       // nodes that sent no report: they will not sign out either
};

// Names the job's first failure from every node's report, by node rank; nullopt: the node sent
// none within `bound` (or before the store was lost, `store_lost`).
JobOutcome SummarizeNodeReports(const std::vector<std::optional<NodeReport>>& reports,
                                bool store_lost, std::chrono::milliseconds bound);

}  // namespace fsdp
