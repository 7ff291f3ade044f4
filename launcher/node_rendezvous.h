// NodeRendezvous: the launchers of a job meeting across nodes in node 0's store. Node 0's
// launcher hosts the TCPStore (torchrun's "agent store", which its ranks and every other node's
// ranks use too); the other nodes' launchers are its clients. With one node there is only the
// store: Meet, Report, CollectReports and Leave touch nothing.
//
// Every node's launcher makes the same calls in the same order: Connect and Meet before any
// rank starts; for each attempt, FailureWatch while its ranks run, Report once they stopped,
// then CollectReports (the attempt failed) and Leave (the job ends here).
//
// Note [Launchers across nodes]
// The launchers of a job meet in node 0's store before any rank starts: each claims its
// --node-rank (a second launcher for a taken node rank is refused, and the running job is left
// alone: its ranks would otherwise fail the job's rendezvous as "two processes claim RANK"),
// publishes its --nnodes, --nproc-per-node and --max-restarts, and waits up to --rdzv-timeout
// for every node; options that disagree are refused on both nodes, naming both, before anything
// starts (they used to surface as a rank collision blaming an innocent rank, or as 300 s of
// waiting). When an attempt ends badly, every node writes one report under the attempt's key
// (its own headline, whether its first failure was its own or only followed a lost peer, and
// when) and reads the others' for a bounded time: every node prints the job's first failure,
// whichever node it was on (node 0's ranks only see "peer lost" when a rank of node 1 is
// killed), and a node that never reports is named (its launcher was killed). Every node makes
// the same restart decision from the same reports. Node 0 hosts the store, so it leaves last:
// it waits, bounded, until the other launchers have signed out (torchrun's exit barrier), so
// that they can read the reports and their ranks can still reach the store while they finish.
//
// The launchers' keys in the store (the ranks' own are under /worker/attempt_<restart>):
//   fsdp/launch/claim/<node>               launchers that claimed --node-rank <node>
//   fsdp/launch/node/<node>                its card: "<nnodes> <nproc> <max_restarts> <host> <pid>"
//   fsdp/launch/refused                    launchers that refused the others' options
//   fsdp/launch/attempt_<a>/failed         set once a node's attempt <a> ended badly
//   fsdp/launch/attempt_<a>/report/<node>  its NodeReport of attempt <a>
//   fsdp/launch/left                       launchers other than node 0's that signed out
//
//   absl::StatusOr<std::unique_ptr<NodeRendezvous>> nodes = NodeRendezvous::Connect(options);
//   absl::Status met = (*nodes)->Meet();     // every node is here, with the same options
//   std::function<bool()> other_node_failed = (*nodes)->FailureWatch(attempt);
//   ... start the ranks with MASTER_PORT=(*nodes)->port(); stop them once other_node_failed() ...
//   (*nodes)->Report(attempt, mine, /*failed=*/true);
//   JobOutcome job = (*nodes)->CollectReports(attempt, mine, bound);   // the job's first failure
//   (*nodes)->Leave(attempt, mine, bound, /*watch_failures=*/false, job.silent_nodes);
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <optional>

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "launcher/failure_summary.h"
#include "launcher/launch.h"

namespace fsdp {

class NodeRendezvous {
 public:
  // Node 0 hosts the store on --master-port (0: a free one); the other nodes reach it at
  // --master-addr. The error's message is the launcher's line (with a hint when the port is
  // taken).
  static absl::StatusOr<std::unique_ptr<NodeRendezvous>> Connect(const LaunchOptions& o);

  // The store's port: the ranks' MASTER_PORT.
  int port() const { return port_; }

  // With --nnodes > 1: the launchers meet (Note [Launchers across nodes]). kAlreadyExists: the
  // node rank is taken; kInvalidArgument: options that disagree; kDeadlineExceeded: a node did
  // not join in time; otherwise CallTorch's code for a failed store call (kInternal,
  // kUnavailable, ...).
  absl::Status Meet();

  // For WaitOptions::stop_requested: whether another node's launcher reported `attempt` failed
  // (never with one node). Once the store cannot be read, it is polled no more: each failed
  // call logs a c10d stack trace.
  std::function<bool()> FailureWatch(int attempt);

  // Publishes this node's report of `attempt` and, when `failed`, that the attempt failed. The
  // store may be gone: errors are ignored.
  void Report(int attempt, const NodeReport& mine, bool failed);

  // Reads every node's report for `attempt`, waiting up to `bound` for those not in yet (not
  // past the store's end), and names the job's first failure. One node: its own report.
  JobOutcome CollectReports(int attempt, const NodeReport& mine, std::chrono::milliseconds bound);

  // Signs this launcher out of the job; node 0 (the store's host) waits, up to `bound`, until
  // every other node has. While it waits, a failure of the attempt on another node is collected
  // and returned (node 0's own ranks had finished). Nothing with one node.
  std::optional<JobOutcome> Leave(int attempt, const NodeReport& mine,
                                  std::chrono::milliseconds bound, bool watch_failures,
                                  int silent_nodes = 0);

 private:
  NodeRendezvous(const LaunchOptions& o, c10::intrusive_ptr<c10d::TCPStore> store);

  const LaunchOptions& o_;
  c10::intrusive_ptr<c10d::TCPStore> store_;
  int port_;
};

}  // namespace fsdp
