// `fsdp launch`: torchrun's job for our programs. Starts --nproc-per-node local ranks with
// torchrun's environment, prefixes their output with the rank (and keeps it in files with
// --log-dir), stops all of them when one fails, and restarts the local group up to
// --max-restarts times.
//
// Rendezvous: the launcher on node 0 hosts the TCPStore (torchrun's "agent store"), so the
// port is held before any worker starts; workers see TORCHELASTIC_USE_AGENT_STORE=True and use
// the key prefix /worker/attempt_<TORCHELASTIC_RESTART_COUNT>. Launchers on other nodes connect
// to it and learn through it when another node's group failed, so all nodes restart together.
//
// Inside: launch.cc runs the local group attempt after attempt; node_rendezvous.h is the
// launchers' meeting in the store; failure_summary.h names the first rank and node to fail.
//
//   LaunchOptions opts;
//   opts.nproc_per_node = 4;
//   opts.program = {"build/bin/fsdp", "doctor", "--mesh", "2,2"};
//   int exit_code = RunLaunch(opts);   // 0, or the failed worker's code (128 + signal)
#pragma once

#include <chrono>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "launcher/failure_summary.h"  // FailureHeadline, SummarizeFailures
#include "launcher/worker_group.h"

namespace fsdp {

struct LaunchOptions {
  int nproc_per_node = 1;
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;  // 0: pick a free port (single node only)
  int max_restarts = 0;
  std::chrono::seconds rendezvous_timeout{300};
  std::chrono::milliseconds grace{std::chrono::seconds(5)};  // SIGTERM -> SIGKILL on a stop
  // SIGTERM -> SIGKILL for the others once a rank failed (they cannot finish a collective, or
  // a checkpoint, without it; capped by `grace`).
  std::chrono::milliseconds failure_grace{std::chrono::seconds(5)};
  bool prefix_output = true;
  // Each local rank's stdout and stderr in files under log_dir, torchrun's layout (empty: no
  // files); redirects / tee: torchrun's values, which streams the console leaves out / shows
  // anyway (launcher/worker_logs.h, Note [Log files and the console]).
  std::string log_dir;
  std::string redirects;
  std::string tee;
  bool announce = true;              // the "fsdp launch: starting N rank(s) ..." line
  std::string run_id;                // TORCHELASTIC_RUN_ID; random when empty
  std::vector<std::string> program;  // PROGRAM ARGS...
  // Optional: sees every output line of the workers and returns a status text (e.g. a
  // progress bar) that the launcher keeps on the last line of its stderr; empty for none.
  std::function<std::string(int rank, std::string_view line)> status_line;
  // Optional: which worker lines are printed (all when unset); status_line still sees all.
  std::function<bool(int rank, bool is_stderr, std::string_view line)> echo;

  // kInvalidArgument naming the option and what would be valid.
  absl::Status Validate() const;
};

// Runs the job; returns the process exit code: 0 when every local rank succeeded, otherwise the
// failed rank's exit code (128 + signal if it was killed; across nodes, the code of the job's
// first failure, whichever node it was on), 1 for launcher errors, 2 for options the other
// nodes' launchers disagree with (or a --node-rank another launcher holds), 128 + signal when
// the launcher itself was interrupted.
int RunLaunch(const LaunchOptions& options);

}  // namespace fsdp
