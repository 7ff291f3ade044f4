#include "launcher/launch.h"

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <functional>
#include <iostream>
#include <map>
#include <mutex>
#include <optional>
#include <random>

#include "common/env_knobs.h"
#include "common/failure.h"
#include "common/logging.h"
#include "common/strings.h"
#include "launcher/failure_summary.h"
#include "launcher/node_rendezvous.h"
#include "launcher/worker_group.h"
#include "launcher/worker_logs.h"

namespace fsdp {

absl::Status LaunchOptions::Validate() const {
  if (nproc_per_node < 1) {
    return absl::InvalidArgumentError(
        StrCat("--nproc-per-node=", nproc_per_node, " is invalid; it must be at least 1"));
  }
  if (nnodes < 1) {
    return absl::InvalidArgumentError(StrCat("--nnodes=", nnodes, " must be at least 1"));
  }
  if (node_rank < 0 || node_rank >= nnodes) {
    return absl::InvalidArgumentError(StrCat("--node-rank=", node_rank, " must be in 0..",
                                             nnodes - 1, " (--nnodes=", nnodes, ")"));
  }
  if (master_port < 0 || master_port > 65535) {
    return absl::InvalidArgumentError(
        StrCat("--master-port=", master_port, " must be in 1..65535 (0: pick a free port)"));
  }
  if (nnodes > 1 && master_port == 0) {
    return absl::InvalidArgumentError(
        "--master-port is required with --nnodes > 1: every node must use the same port");
  }
  if (max_restarts < 0) {
    return absl::InvalidArgumentError(StrCat("--max-restarts=", max_restarts, " must be >= 0"));
  }
  if (master_addr.empty()) {
    return absl::InvalidArgumentError(
        "--master-addr is empty: give node 0's host name or address (default 127.0.0.1)");
  }
  // A zero or negative timeout makes the store fail at once (c10d prints a stack trace).
  if (rendezvous_timeout.count() < 1) {
    return absl::InvalidArgumentError(
        StrCat("--rdzv-timeout=", rendezvous_timeout.count(), " must be at least 1 (seconds)"));
  }
  if (grace.count() < 0) {
    return absl::InvalidArgumentError(StrCat(
        "--grace=", std::chrono::duration<double>(grace).count(), " must be >= 0 (seconds)"));
  }
  if (program.empty()) {
    return absl::InvalidArgumentError(
        "no program given: fsdp launch [OPTIONS] -- PROGRAM [ARGS...]");
  }
  if (absl::Status streams = ParseConsoleStreams(redirects, tee, nproc_per_node).status();
      !streams.ok()) {
    return streams;
  }
  for (const auto& [option, value] : {std::pair("--redirects", &redirects), {"--tee", &tee}}) {
    if (log_dir.empty() && !value->empty()) {
      return absl::InvalidArgumentError(
          StrCat(option, " ", *value,
                 " needs --log-dir DIR: it chooses which of the ranks' lines, kept in files "
                 "under DIR, the console shows too"));
    }
  }
  return absl::OkStatus();
}

namespace {

std::string RandomRunId() {
  std::random_device rd;
  return fmt::format("{:08x}", rd());
}

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::map<std::string, std::string> WorkerEnv(const LaunchOptions& o, int local_rank, int port,
                                             int attempt, const std::string& run_id,
                                             const std::string& failure_dir) {
  int world = o.nnodes * o.nproc_per_node;
  int rank = o.node_rank * o.nproc_per_node + local_rank;
  std::map<std::string, std::string> env = {
      {"RANK", StrCat(rank)},
      {"LOCAL_RANK", StrCat(local_rank)},
      {"WORLD_SIZE", StrCat(world)},
      {"LOCAL_WORLD_SIZE", StrCat(o.nproc_per_node)},
      {"GROUP_RANK", StrCat(o.node_rank)},
      {"GROUP_WORLD_SIZE", StrCat(o.nnodes)},
      {"ROLE_RANK", StrCat(rank)},
      {"ROLE_WORLD_SIZE", StrCat(world)},
      {"ROLE_NAME", "default"},
      {"MASTER_ADDR", o.master_addr},
      {"MASTER_PORT", StrCat(port)},
      {"TORCHELASTIC_RESTART_COUNT", StrCat(attempt)},
      {"TORCHELASTIC_MAX_RESTARTS", StrCat(o.max_restarts)},
      {"TORCHELASTIC_RUN_ID", run_id},
      {"TORCHELASTIC_USE_AGENT_STORE", "True"},
      {std::string(kFailureDir.name), failure_dir},
  };
  // As torchrun: several ranks per node would oversubscribe the cores with one OpenMP thread
  // pool each; the user can still say otherwise.
  if (o.nproc_per_node > 1 && !GetEnvKnob(kOmpNumThreads)) {
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    env[std::string(kOmpNumThreads.name)] = StrCat(std::max(1L, cores / o.nproc_per_node));
  }
  return env;
}

// The ranks' log files under --log-dir; null without one.
absl::StatusOr<std::unique_ptr<WorkerLogs>> OpenLogs(const LaunchOptions& o,
                                                     const std::string& run_id) {
  if (o.log_dir.empty()) return std::unique_ptr<WorkerLogs>();
  return WorkerLogs::Create(o.log_dir, run_id, o.node_rank, o.nnodes,
                            *ParseConsoleStreams(o.redirects, o.tee, o.nproc_per_node));
}

// The exit code when the launchers could not meet: 1 when a node did not join or the store
// failed, 2 for options the nodes disagree on or a --node-rank another launcher holds.
int MeetingExitCode(const absl::Status& met) {
  return met.code() == absl::StatusCode::kDeadlineExceeded ||
                 met.code() == absl::StatusCode::kInternal ||
                 met.code() == absl::StatusCode::kUnavailable
             ? 1
             : 2;
}

// This node's ranks, one attempt after another: their environment, their lines on the console
// and in the log files, their failure records, and what the launcher does when an attempt
// ends. What the other nodes' launchers say comes through `nodes` (node_rendezvous.h).
class LocalGroup {
 public:
  LocalGroup(const LaunchOptions& o, const std::string& run_id, WorkerLogs* logs,
             NodeRendezvous& nodes)
      : o_(o), run_id_(run_id), logs_(logs), nodes_(nodes) {}

  // Runs attempt `attempt` (0 first, then each restart): the launcher's exit code, or nullopt
  // to restart the local group.
  std::optional<int> Run(int attempt);

 private:
  std::vector<WorkerSpec> Specs(int attempt) const;
  absl::Status Prepare(int attempt);
  void Print(const OutputLine& line);
  GroupResult Wait(int attempt, WorkerGroup& group);
  FailureHeadline WithLog(FailureHeadline h) const;
  NodeReport Summarize(const GroupResult& result, int sig) const;
  int Finished(int attempt, const GroupResult& result, const NodeReport& mine);
  int Interrupted(int attempt, const GroupResult& result, const NodeReport& mine, int sig);
  std::optional<int> Decide(int attempt, const NodeReport& mine);

  const LaunchOptions& o_;
  const std::string& run_id_;
  WorkerLogs* const logs_;  // null without --log-dir
  NodeRendezvous& nodes_;
  std::mutex out_mu_;
  std::string status_;  // shown on the last line of stderr, below the workers' output
  const FailureDir failure_dir_;
  // Other nodes may still be stopping their ranks when this one has stopped its own.
  const std::chrono::milliseconds report_wait_ = o_.grace + std::chrono::seconds(10);
};

std::optional<int> LocalGroup::Run(int attempt) {
  const std::vector<WorkerSpec> specs = Specs(attempt);
  if (absl::Status ready = Prepare(attempt); !ready.ok()) {
    std::cerr << "fsdp launch: --log-dir: " << ready.message() << "\n";
    return 1;
  }
  WorkerGroup group([this](const OutputLine& line) { Print(line); });
  if (absl::Status started = group.Start(specs); !started.ok()) {
    std::cerr << "fsdp launch: " << started.message() << "\n";
    return 1;
  }
  const GroupResult result = Wait(attempt, group);
  const int sig = ReceivedStopSignal();
  const NodeReport mine = Summarize(result, sig);
  nodes_.Report(attempt, mine, /*failed=*/!result.ok());
  if (result.ok()) return Finished(attempt, result, mine);
  if (sig != 0) return Interrupted(attempt, result, mine, sig);
  return Decide(attempt, mine);
}

std::vector<WorkerSpec> LocalGroup::Specs(int attempt) const {
  std::vector<WorkerSpec> specs;
  for (int lr = 0; lr < o_.nproc_per_node; ++lr) {
    specs.push_back({o_.node_rank * o_.nproc_per_node + lr, o_.program,
                     WorkerEnv(o_, lr, nodes_.port(), attempt, run_id_, failure_dir_.path())});
  }
  return specs;
}

// Before the attempt's ranks start: the failure folder emptied, the first attempt announced,
// the attempt's log folder made (an error is --log-dir's).
absl::Status LocalGroup::Prepare(int attempt) {
  failure_dir_.Clear();  // an earlier attempt's records are not this one's
  if (attempt == 0 && o_.announce) {
    std::cerr << "fsdp launch: starting " << o_.nproc_per_node << " rank(s) on node "
              << o_.node_rank << " of " << o_.nnodes << ", world size "
              << o_.nnodes * o_.nproc_per_node << ", store " << o_.master_addr << ":"
              << nodes_.port() << (logs_ ? StrCat(", logs in ", logs_->run_dir()) : "") << "\n";
  }
  if (logs_) return logs_->StartAttempt(attempt);
  return absl::OkStatus();
}

// One line of a rank's output: into its log file, onto the console (with its rank) unless the
// options leave it off, and below it the status line again.
void LocalGroup::Print(const OutputLine& line) {
  std::lock_guard<std::mutex> lock(out_mu_);
  const int local_rank = line.rank - o_.node_rank * o_.nproc_per_node;
  if (logs_) logs_->Write(local_rank, line.is_stderr, line.text);
  if ((logs_ && !logs_->OnConsole(local_rank, line.is_stderr)) ||
      (o_.echo && !o_.echo(line.rank, line.is_stderr, line.text))) {
    if (o_.status_line) status_ = o_.status_line(line.rank, line.text);
    return;
  }
  if (!status_.empty()) std::cerr << "\r\033[K" << std::flush;
  std::ostream& os = line.is_stderr ? std::cerr : std::cout;
  if (o_.prefix_output) os << "[rank" << line.rank << "]: ";
  os << line.text << '\n';
  os.flush();
  if (o_.status_line) status_ = o_.status_line(line.rank, line.text);
  if (!status_.empty()) std::cerr << status_ << std::flush;
}

// Until the ranks have ended, or were stopped: by a signal to the launcher, or because another
// node's attempt failed.
GroupResult LocalGroup::Wait(int attempt, WorkerGroup& group) {
  WaitOptions wait;
  wait.grace = o_.grace;
  wait.failure_grace = std::min(o_.grace, o_.failure_grace);
  std::function<bool()> other_node_failed = nodes_.FailureWatch(attempt);
  wait.stop_requested = [&] { return ReceivedStopSignal() != 0 || other_node_failed(); };
  GroupResult result = group.Wait(wait);
  if (!status_.empty()) {
    std::cerr << "\n";
    status_.clear();
  }
  return result;
}

// The first failed rank's stderr file ends its headline when logs are kept.
FailureHeadline LocalGroup::WithLog(FailureHeadline h) const {
  if (logs_) {
    h.text += StrCat("; rank ", h.rank, "'s stderr: ",
                     logs_->Path(h.rank - o_.node_rank * o_.nproc_per_node, /*is_stderr=*/true));
  }
  return h;
}

// This node's account of the attempt (`sig`: the signal that stopped the launcher, or 0).
NodeReport LocalGroup::Summarize(const GroupResult& result, int sig) const {
  NodeReport mine;
  if (result.ok()) {
    mine.text = "ranks finished";
  } else if (sig != 0) {
    mine = {128 + sig, true, false, NowNs(),
            StrCat("its launcher was interrupted by signal ", sig, " and stopped its ranks")};
  } else if (result.outcome == GroupResult::Outcome::kWorkerFailed) {
    FailureHeadline headline = WithLog(SummarizeFailures(result, failure_dir_.Read()));
    mine = {headline.code, headline.primary,
            FailureClassOfExitCode(headline.code) != FailureClass::kPreempted, headline.time_ns,
            headline.text};
  } else {  // stopped: another node failed
    mine = {-1, false, true, NowNs(), "stopped its ranks after another node failed"};
    // A rank that had failed on its own before the stop still counts as such.
    std::vector<FailureRecord> records = failure_dir_.Read();
    GroupResult stopped = result;
    for (const WorkerExit& e : stopped.exits) {
      bool recorded = false;
      for (const FailureRecord& r : records) recorded |= r.rank == e.rank;
      if (!e.ok() && (recorded || !e.killed_by_us)) stopped.first_failure = e;
    }
    if (stopped.first_failure) {
      FailureHeadline headline = WithLog(SummarizeFailures(stopped, records));
      if (headline.primary) {
        mine = {headline.code, true,
                FailureClassOfExitCode(headline.code) != FailureClass::kPreempted, headline.time_ns,
                headline.text};
      }
    }
  }
  return mine;
}

// Every local rank finished; node 0 still learns, while the others sign out, whether the
// attempt failed on another node.
int LocalGroup::Finished(int attempt, const GroupResult& result, const NodeReport& mine) {
  std::cerr << "fsdp launch: " << result.Summary() << "\n";
  std::optional<JobOutcome> later =
      nodes_.Leave(attempt, mine, o_.rendezvous_timeout, /*watch_failures=*/true);
  if (!later) return 0;
  std::cerr << "fsdp launch: " << later->text << "\n";
  return later->code;
}

// The launcher was interrupted by `sig` and stopped its ranks.
int LocalGroup::Interrupted(int attempt, const GroupResult& result, const NodeReport& mine,
                            int sig) {
  // Ranks still running after --grace were killed: a SIGTERM checkpoint did not finish.
  std::vector<int> killed;
  for (const WorkerExit& e : result.exits) {
    if (!e.exited && e.code == SIGKILL && e.killed_by_us) killed.push_back(e.rank);
  }
  std::cerr << "fsdp launch: interrupted by signal " << sig << "; workers stopped";
  if (!killed.empty()) {
    std::cerr << "; rank" << (killed.size() > 1 ? "s " : " ") << StrJoin(killed, ",")
              << " did not stop within --grace " << std::chrono::duration<double>(o_.grace).count()
              << " s and were killed (a SIGTERM checkpoint needs a longer --grace)";
  }
  std::cerr << "\n";
  nodes_.Leave(attempt, mine, report_wait_, /*watch_failures=*/false);
  return 128 + sig;
}

// The attempt failed: the job's first failure, and whether every node restarts its group
// (nullopt) or the launcher ends with that failure's code.
std::optional<int> LocalGroup::Decide(int attempt, const NodeReport& mine) {
  JobOutcome job = nodes_.CollectReports(attempt, mine, report_wait_);
  if (FailureClassOfExitCode(job.code) == FailureClass::kPreempted) {
    std::cerr << "fsdp launch: " << job.text << "\n";  // not restarted: the node is going away
    nodes_.Leave(attempt, mine, report_wait_, /*watch_failures=*/false, job.silent_nodes);
    return job.code;
  }
  if (attempt < o_.max_restarts && job.restartable) {
    std::cerr << "fsdp launch: " << job.text << "; restarting the local group (restart "
              << attempt + 1 << " of " << o_.max_restarts << ")\n";
    return std::nullopt;
  }
  std::cerr << "fsdp launch: " << job.text
            << (attempt < o_.max_restarts && !job.not_restarted.empty()
                    ? StrCat(" (not restarted: ", job.not_restarted, ")")
                    : "")
            << (o_.max_restarts > 0 && attempt >= o_.max_restarts
                    ? StrCat(" (", o_.max_restarts, " restarts used)")
                    : "")
            << "\n";
  nodes_.Leave(attempt, mine, report_wait_, /*watch_failures=*/false, job.silent_nodes);
  return job.code;
}

}  // namespace

int RunLaunch(const LaunchOptions& o) {
  if (absl::Status valid = o.Validate(); !valid.ok()) {
    std::cerr << "fsdp launch: " << valid.message() << "\n";
    return 2;
  }
  const std::string run_id = o.run_id.empty() ? RandomRunId() : o.run_id;
  absl::StatusOr<std::unique_ptr<WorkerLogs>> logs = OpenLogs(o, run_id);
  if (!logs.ok()) {
    std::cerr << "fsdp launch: " << logs.status().message() << "\n";
    return 2;
  }
  // Node 0 hosts the agent store for the workers of every node; the other nodes' launchers are
  // clients of it.
  absl::StatusOr<std::unique_ptr<NodeRendezvous>> nodes = NodeRendezvous::Connect(o);
  if (!nodes.ok()) {
    std::cerr << "fsdp launch: " << nodes.status().message() << "\n";
    return 1;
  }
  if (absl::Status met = (*nodes)->Meet(); !met.ok()) {  // Note [Launchers across nodes]
    std::cerr << "fsdp launch: node " << o.node_rank << ": " << met.message() << "\n";
    return MeetingExitCode(met);
  }
  InstallStopSignalHandlers();
  LocalGroup local(o, run_id, logs->get(), **nodes);
  for (int attempt = 0;; ++attempt) {
    if (std::optional<int> code = local.Run(attempt)) return *code;
  }
}

}  // namespace fsdp
