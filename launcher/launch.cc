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
namespace {

std::string RandomRunId() {
  std::random_device rd;
  return fmt::format("{:08x}", rd());
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

}  // namespace

namespace {

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

}  // namespace

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

int RunLaunch(const LaunchOptions& o) {
  if (absl::Status valid = o.Validate(); !valid.ok()) {
    std::cerr << "fsdp launch: " << valid.message() << "\n";
    return 2;
  }
  std::string run_id = o.run_id.empty() ? RandomRunId() : o.run_id;
  std::unique_ptr<WorkerLogs> logs;
  if (!o.log_dir.empty()) {
    absl::StatusOr<std::unique_ptr<WorkerLogs>> made =
        WorkerLogs::Create(o.log_dir, run_id, o.node_rank, o.nnodes,
                           *ParseConsoleStreams(o.redirects, o.tee, o.nproc_per_node));
    if (!made.ok()) {
      std::cerr << "fsdp launch: " << made.status().message() << "\n";
      return 2;
    }
    logs = std::move(*made);
  }

  // Node 0 hosts the agent store for the workers of every node; the other nodes' launchers are
  // clients of it.
  absl::StatusOr<std::unique_ptr<NodeRendezvous>> nodes = NodeRendezvous::Connect(o);
  if (!nodes.ok()) {
    std::cerr << "fsdp launch: " << nodes.status().message() << "\n";
    return 1;
  }
  int port = (*nodes)->port();
  if (absl::Status met = (*nodes)->Meet(); !met.ok()) {  // Note [Launchers across nodes]
    std::cerr << "fsdp launch: node " << o.node_rank << ": " << met.message() << "\n";
    return met.code() == absl::StatusCode::kDeadlineExceeded ||
                   met.code() == absl::StatusCode::kInternal ||
                   met.code() == absl::StatusCode::kUnavailable
               ? 1
               : 2;
  }

  InstallStopSignalHandlers();
  std::mutex out_mu;
  std::string status;  // shown on the last line of stderr, below the workers' output
  auto sink = [&](const OutputLine& line) {
    std::lock_guard<std::mutex> lock(out_mu);
    const int local_rank = line.rank - o.node_rank * o.nproc_per_node;
    if (logs) logs->Write(local_rank, line.is_stderr, line.text);
    if ((logs && !logs->OnConsole(local_rank, line.is_stderr)) ||
        (o.echo && !o.echo(line.rank, line.is_stderr, line.text))) {
      if (o.status_line) status = o.status_line(line.rank, line.text);
      return;
    }
    if (!status.empty()) std::cerr << "\r\033[K" << std::flush;
    std::ostream& os = line.is_stderr ? std::cerr : std::cout;
    if (o.prefix_output) os << "[rank" << line.rank << "]: ";
    os << line.text << '\n';
    os.flush();
    if (o.status_line) status = o.status_line(line.rank, line.text);
    if (!status.empty()) std::cerr << status << std::flush;
  };

  const FailureDir failure_dir;
  // The first failed rank's stderr file ends its headline when logs are kept.
  auto with_log = [&](FailureHeadline h) {
    if (logs) {
      h.text += StrCat("; rank ", h.rank, "'s stderr: ",
                       logs->Path(h.rank - o.node_rank * o.nproc_per_node, /*is_stderr=*/true));
    }
    return h;
  };
  // Other nodes may still be stopping their ranks when this one has stopped its own.
  const std::chrono::milliseconds report_wait = o.grace + std::chrono::seconds(10);
  for (int attempt = 0;; ++attempt) {
    std::vector<WorkerSpec> specs;
    for (int lr = 0; lr < o.nproc_per_node; ++lr) {
      specs.push_back({o.node_rank * o.nproc_per_node + lr, o.program,
                       WorkerEnv(o, lr, port, attempt, run_id, failure_dir.path())});
    }
    failure_dir.Clear();  // an earlier attempt's records are not this one's
    if (attempt == 0 && o.announce) {
      std::cerr << "fsdp launch: starting " << o.nproc_per_node << " rank(s) on node "
                << o.node_rank << " of " << o.nnodes << ", world size "
                << o.nnodes * o.nproc_per_node << ", store " << o.master_addr << ":" << port
                << (logs ? StrCat(", logs in ", logs->run_dir()) : "") << "\n";
    }
    if (logs) {
      if (absl::Status made = logs->StartAttempt(attempt); !made.ok()) {
        std::cerr << "fsdp launch: --log-dir: " << made.message() << "\n";
        return 1;
      }
    }
    WorkerGroup group(sink);
    if (absl::Status started = group.Start(specs); !started.ok()) {
      std::cerr << "fsdp launch: " << started.message() << "\n";
      return 1;
    }
    WaitOptions wait;
    wait.grace = o.grace;
    wait.failure_grace = std::min(o.grace, o.failure_grace);
    std::function<bool()> other_node_failed = (*nodes)->FailureWatch(attempt);
    wait.stop_requested = [&] { return ReceivedStopSignal() != 0 || other_node_failed(); };
    GroupResult result = group.Wait(wait);
    if (!status.empty()) {
      std::cerr << "\n";
      status.clear();
    }
    const int sig = ReceivedStopSignal();
    // This node's account of the attempt.
    NodeReport mine;
    if (result.ok()) {
      mine.text = "ranks finished";
    } else if (sig != 0) {
      mine = {128 + sig, true, false, NowNs(),
              StrCat("its launcher was interrupted by signal ", sig, " and stopped its ranks")};
    } else if (result.outcome == GroupResult::Outcome::kWorkerFailed) {
      FailureHeadline headline = with_log(
          SummarizeFailures(result, failure_dir.Read()));
      mine = {headline.code, headline.primary,
              FailureClassOfExitCode(headline.code) != FailureClass::kPreempted, headline.time_ns,
              headline.text};
    } else {  // stopped: another node failed
      mine = {-1, false, true, NowNs(), "stopped its ranks after another node failed"};
      // A rank that had failed on its own before the stop still counts as such.
      std::vector<FailureRecord> records = failure_dir.Read();
      for (const WorkerExit& e : result.exits) {
        bool recorded = false;
        for (const FailureRecord& r : records) recorded |= r.rank == e.rank;
        if (!e.ok() && (recorded || !e.killed_by_us)) result.first_failure = e;
      }
      if (result.first_failure) {
        FailureHeadline headline = with_log(SummarizeFailures(result, records));
        if (headline.primary) {
          mine = {headline.code, true,
                  FailureClassOfExitCode(headline.code) != FailureClass::kPreempted,
                  headline.time_ns, headline.text};
        }
      }
    }
    (*nodes)->Report(attempt, mine, /*failed=*/!result.ok());
    if (result.ok()) {
      std::cerr << "fsdp launch: " << result.Summary() << "\n";
      std::optional<JobOutcome> later =
          (*nodes)->Leave(attempt, mine, o.rendezvous_timeout, /*watch_failures=*/true);
      if (!later) return 0;
      std::cerr << "fsdp launch: " << later->text << "\n";
      return later->code;
    }
    if (sig != 0) {
      // Ranks still running after --grace were killed: a SIGTERM checkpoint did not finish.
      std::vector<int> killed;
      for (const WorkerExit& e : result.exits) {
        if (!e.exited && e.code == SIGKILL && e.killed_by_us) killed.push_back(e.rank);
      }
      std::cerr << "fsdp launch: interrupted by signal " << sig << "; workers stopped";
      if (!killed.empty()) {
        std::cerr << "; rank" << (killed.size() > 1 ? "s " : " ") << StrJoin(killed, ",")
                  << " did not stop within --grace "
                  << std::chrono::duration<double>(o.grace).count()
                  << " s and were killed (a SIGTERM checkpoint needs a longer --grace)";
      }
      std::cerr << "\n";
      (*nodes)->Leave(attempt, mine, report_wait, /*watch_failures=*/false);
      return 128 + sig;
    }
    JobOutcome job = (*nodes)->CollectReports(attempt, mine, report_wait);
    if (FailureClassOfExitCode(job.code) == FailureClass::kPreempted) {
      std::cerr << "fsdp launch: " << job.text << "\n";  // not restarted: the node is going away
      (*nodes)->Leave(attempt, mine, report_wait, /*watch_failures=*/false, job.silent_nodes);
      return job.code;
    }
    if (attempt < o.max_restarts && job.restartable) {
      std::cerr << "fsdp launch: " << job.text << "; restarting the local group (restart "
                << attempt + 1 << " of " << o.max_restarts << ")\n";
      continue;
    }
    std::cerr << "fsdp launch: " << job.text
              << (attempt < o.max_restarts && !job.not_restarted.empty()
                      ? StrCat(" (not restarted: ", job.not_restarted, ")")
                      : "")
              << (o.max_restarts > 0 && attempt >= o.max_restarts
                      ? StrCat(" (", o.max_restarts, " restarts used)")
                      : "")
              << "\n";
    (*nodes)->Leave(attempt, mine, report_wait, /*watch_failures=*/false, job.silent_nodes);
    return job.code;
  }
}

}  // namespace fsdp
