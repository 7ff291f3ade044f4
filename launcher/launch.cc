#include "launcher/launch.h"

#include <signal.h>
#include <unistd.h>

#include <filesystem>
#include <iostream>
#include <mutex>
#include <random>
#include <thread>

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "common/env.h"
#include "common/env_knobs.h"
#include "common/failure.h"
#include "common/logging.h"
#include "common/strings.h"
#include "device_mesh/torch_status.h"
#include "launcher/failure_summary.h"
#include "launcher/worker_group.h"
#include "launcher/worker_logs.h"

namespace fsdp {
namespace {

std::string RandomRunId() {
  std::random_device rd;
  return fmt::format("{:08x}", rd());
}

std::string AttemptKey(int attempt, std::string_view what) {
  return StrCat("fsdp/launch/attempt_", attempt, "/", what);
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

// Note [Launchers across nodes]
// The launchers of a job meet in node 0's store before any rank starts: each claims its
// --node-rank (a second launcher for a taken node rank is refused, and the running job is left
// alone: its ranks would otherwise fail the job's rendezvous as "two processes claim RANK"),
// publishes its --nnodes, --nproc-per-node and --max-restarts, and waits up to --rdzv-timeout for every node;
// options that disagree are refused on both nodes, naming both, before anything starts (they
// used to surface as a rank collision blaming an innocent rank, or as 300 s of waiting).
// When an attempt ends badly, every node writes one report under the attempt's key (its own
// headline, whether its first failure was its own or only followed a lost peer, and when) and
// reads the others' for a bounded time: every node prints the job's first failure, whichever
// node it was on (node 0's ranks only see "peer lost" when a rank of node 1 is killed), and a
// node that never reports is named (its launcher was killed). Every node makes the same
// restart decision from the same reports. Node 0 hosts the store, so it leaves last: it waits,
// bounded, until the other launchers have signed out (torchrun's exit barrier), so that they
// can read the reports and their ranks can still reach the store while they finish.
namespace {

using Clock = std::chrono::steady_clock;

std::string NodeKey(std::string_view what, int node) {
  return StrCat("fsdp/launch/", what, "/", node);
}
constexpr char kLeftKey[] = "fsdp/launch/left";

std::string GetString(c10d::Store& store, const std::string& key) {
  std::vector<uint8_t> v = store.get(key);
  return std::string(v.begin(), v.end());
}
void SetString(c10d::Store& store, const std::string& key, std::string_view value) {
  store.set(key, std::vector<uint8_t>(value.begin(), value.end()));
}

// What the other nodes must agree with: "<nnodes> <nproc_per_node> <max_restarts> <host> <pid>"
// (nodes with other --max-restarts: one restarted its ranks while node 0 had stopped).
std::string NodeCard(const LaunchOptions& o) {
  return StrCat(o.nnodes, " ", o.nproc_per_node, " ", o.max_restarts, " ", HostName(), " ",
                getpid());
}
std::string DescribeNode(int node, const std::string& card) {
  std::vector<std::string_view> f = Split(card, " ");
  if (f.size() != 5) return StrCat("node ", node);
  return StrCat("node ", node, " (pid ", f[4], " on ", f[3], ")");
}

// A launcher that refused to start leaves; node 0 first gives the others (bounded) the time to
// read its card and refuse too, instead of finding the store gone.
void LeaveRefused(c10d::Store& store, const LaunchOptions& o) {
  constexpr char kRefusedKey[] = "fsdp/launch/refused";
  if (o.node_rank != 0) {
    store.add(kRefusedKey, 1);
    return;
  }
  const Clock::time_point deadline = Clock::now() + std::chrono::seconds(5);
  while (Clock::now() < deadline) {
    int others = 0;
    for (int n = 1; n < o.nnodes; ++n) others += store.check({NodeKey("node", n)}) ? 1 : 0;
    if (store.add(kRefusedKey, 0) >= others) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

// See Note [Launchers across nodes]. kAlreadyExists: the node rank is taken; kInvalidArgument:
// options that disagree; kDeadlineExceeded: a node did not join in time.
absl::Status MeetOtherNodes(c10d::Store& store, const LaunchOptions& o, int port) {
  const std::string claim = NodeKey("claim", o.node_rank);
  const std::string mine = NodeKey("node", o.node_rank);
  if (store.add(claim, 1) > 1) {
    std::string holder = StrCat("node ", o.node_rank);
    if (store.check({mine})) holder = DescribeNode(o.node_rank, GetString(store, mine));
    return absl::AlreadyExistsError(
        StrCat("--node-rank ", o.node_rank, " is already taken in the job at ", o.master_addr, ":",
               port, " by ", holder, "; each node needs its own --node-rank in 0..", o.nnodes - 1,
               ". Nothing was started; the running job was left alone"));
  }
  SetString(store, mine, NodeCard(o));
  const Clock::time_point deadline = Clock::now() + o.rendezvous_timeout;
  std::vector<int> missing;
  while (true) {
    missing.clear();
    for (int n = 0; n < o.nnodes; ++n) {
      if (!store.check({NodeKey("node", n)})) {
        missing.push_back(n);
        continue;
      }
      const std::string card = GetString(store, NodeKey("node", n));
      std::vector<std::string_view> f = Split(card, " ");
      if (f.size() == 5 && (f[0] != StrCat(o.nnodes) || f[1] != StrCat(o.nproc_per_node) ||
                            f[2] != StrCat(o.max_restarts))) {
        store.add(claim, -1);  // a corrected launcher may take this node rank
        LeaveRefused(store, o);
        return absl::InvalidArgumentError(StrCat(
            DescribeNode(n, card), " has --nnodes ", f[0], " --nproc-per-node ", f[1],
            " --max-restarts ", f[2], ", this launcher (node ", o.node_rank, ") has --nnodes ",
            o.nnodes, " --nproc-per-node ", o.nproc_per_node, " --max-restarts ",
            o.max_restarts,
            ": every node must be started with the same --nnodes, --nproc-per-node and "
            "--max-restarts. Nothing was started"));
      }
    }
    if (missing.empty()) return absl::OkStatus();
    if (Clock::now() >= deadline) {
      store.add(claim, -1);
      return absl::DeadlineExceededError(
          StrCat("node", missing.size() > 1 ? "s " : " ", StrJoin(missing, ", "), " of ", o.nnodes,
                 " did not join within ", o.rendezvous_timeout.count(),
                 " s (--rdzv-timeout): start `fsdp launch --nnodes ", o.nnodes,
                 " --node-rank <N> "
                 "--master-addr <node 0's host> --master-port ",
                 port, " ...` on every node. Nothing was started"));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

// One node's account of an attempt (Note [Launchers across nodes]).
struct NodeReport {
  int code = 0;          // 0: its ranks finished; -1: stopped after another node failed
  bool primary = false;  // its first failure was its own (not a lost peer, not a stop)
  bool restartable = false;
  int64_t time_ns = 0;
  std::string text;  // its headline
};

std::string EncodeReport(const NodeReport& r) {
  return StrCat(r.code, " ", r.primary ? 1 : 0, " ", r.restartable ? 1 : 0, " ", r.time_ns, "\n",
                r.text);
}
std::optional<NodeReport> DecodeReport(std::string_view s) {
  const size_t nl = s.find('\n');
  if (nl == std::string_view::npos) return std::nullopt;
  std::vector<std::string_view> f = Split(s.substr(0, nl), " ");
  if (f.size() != 4) return std::nullopt;
  std::optional<int> code = ParseInt<int>(f[0]), primary = ParseInt<int>(f[1]),
                     restartable = ParseInt<int>(f[2]);
  std::optional<int64_t> time_ns = ParseInt<int64_t>(f[3]);
  if (!code || !primary || !restartable || !time_ns) return std::nullopt;
  return NodeReport{*code, *primary != 0, *restartable != 0, *time_ns,
                    std::string(s.substr(nl + 1))};
}

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

struct JobOutcome {
  std::string text;
  int code = 1;
  bool restartable = false;
  std::string not_restarted;  // why not, when a restart was possible by count
  int silent_nodes = 0;       // nodes that sent no report: they will not sign out either
};

// Reads every node's report for `attempt`, waiting up to `bound` for those not in yet (not
// past the store's end), and names the job's first failure.
JobOutcome CollectReports(c10d::Store& store, const LaunchOptions& o, int attempt,
                          const NodeReport& mine, std::chrono::milliseconds bound) {
  std::vector<std::optional<NodeReport>> reports(o.nnodes);
  reports[o.node_rank] = mine;  // known here even when the store is gone
  const Clock::time_point deadline = Clock::now() + bound;
  bool store_lost = false;
  while (true) {
    absl::Status read = CallTorch("", [&] {
      for (int n = 0; n < o.nnodes; ++n) {
        const std::string key = AttemptKey(attempt, StrCat("report/", n));
        if (!reports[n] && store.check({key})) reports[n] = DecodeReport(GetString(store, key));
      }
    });
    if (!read.ok()) {
      store_lost = true;
      break;
    }
    bool all = true;
    for (const auto& r : reports) all = all && r.has_value();
    if (all || Clock::now() >= deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  int first = -1;
  for (bool want_primary : {true, false}) {
    for (int n = 0; n < o.nnodes; ++n) {
      const auto& r = reports[n];
      if (!r || r->code <= 0 || r->primary != want_primary) continue;
      if (first < 0 || r->time_ns < reports[first]->time_ns) first = n;
    }
    if (first >= 0) break;
  }
  std::vector<int> missing, finished;
  std::vector<std::string> also;
  for (int n = 0; n < o.nnodes; ++n) {
    if (!reports[n]) {
      missing.push_back(n);
    } else if (reports[n]->code == 0) {
      finished.push_back(n);
    } else if (n != first && reports[n]->primary) {
      std::string t = reports[n]->text;
      if (t.size() > 160) t = t.substr(0, 160) + "...";
      also.push_back(StrCat("node ", n, " also failed: ", t));
    }
  }
  JobOutcome out;
  std::string headline = first >= 0 ? StrCat("node ", first, ": ", reports[first]->text) : "";
  std::string silent;
  if (!missing.empty()) {
    silent =
        StrCat("node", missing.size() > 1 ? "s " : " ", StrJoin(missing, ","), " sent no report",
               store_lost ? " (node 0's launcher, which holds the store, is gone)"
                          : StrCat(" within ", std::chrono::duration<double>(bound).count(),
                                   " s (was its launcher killed, or did it lose node 0?)"));
  }
  if (first < 0) {
    out.text = silent.empty() ? "a rank on another node failed" : silent;
  } else if (!silent.empty() && !reports[first]->primary) {
    out.text = StrCat(silent, "; ", headline);  // the silent node is the likelier cause
  } else {
    out.text = silent.empty() ? headline : StrCat(headline, "; ", silent);
  }
  for (const std::string& a : also) out.text += "; " + a;
  out.code = first >= 0 ? reports[first]->code : 1;
  out.silent_nodes = static_cast<int>(missing.size());
  out.restartable = missing.empty() && finished.empty();
  for (const auto& r : reports) out.restartable = out.restartable && r && r->restartable;
  if (!missing.empty()) {
    out.not_restarted = "a node is missing";
  } else if (!finished.empty()) {
    out.not_restarted = StrCat("the ranks of node", finished.size() > 1 ? "s " : " ",
                               StrJoin(finished, ","), " had already finished");
  }
  return out;
}

// Signs this launcher out of the job; node 0 (the store's host) waits, up to `bound`, until
// every other node has. While it waits, a failure of the attempt on another node is collected
// and returned (node 0's own ranks had finished).
std::optional<JobOutcome> LeaveJob(c10d::Store& store, const LaunchOptions& o, int attempt,
                                   const NodeReport& mine, std::chrono::milliseconds bound,
                                   bool watch_failures, int silent_nodes = 0) {
  if (o.node_rank != 0) {
    (void)CallTorch("", [&] { store.add(kLeftKey, 1); });
    return std::nullopt;
  }
  const Clock::time_point deadline = Clock::now() + bound;
  std::optional<JobOutcome> outcome;
  while (Clock::now() < deadline) {
    int64_t left = 0;
    bool failed = false;
    absl::Status read = CallTorch("", [&] {
      left = store.add(kLeftKey, 0);
      failed = watch_failures && !outcome && store.check({AttemptKey(attempt, "failed")});
    });
    if (!read.ok() || left >= o.nnodes - 1 - silent_nodes) break;
    if (failed) {
      outcome = CollectReports(store, o, attempt, mine, o.grace + std::chrono::seconds(10));
      silent_nodes = outcome->silent_nodes;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return outcome;
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
  bool host_store = o.node_rank == 0;
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
  c10::intrusive_ptr<c10d::TCPStore> store;
  c10d::TCPStoreOptions store_opts;
  store_opts.port = static_cast<uint16_t>(o.master_port);
  store_opts.isServer = host_store;
  store_opts.waitWorkers = false;
  store_opts.timeout = o.rendezvous_timeout;
  absl::Status made = CallTorch(
      host_store ? StrCat("cannot host the rendezvous store on port ", o.master_port)
                 : StrCat("cannot reach node 0's launcher at ", o.master_addr, ":", o.master_port),
      [&] { store = c10::make_intrusive<c10d::TCPStore>(o.master_addr, store_opts); });
  if (!made.ok()) {
    // The hint only where the port is taken: c10d says "EADDRINUSE" / "address already in use".
    const std::string message(made.message());
    const bool in_use = ContainsIgnoreCase(message, "EADDRINUSE") ||
                        ContainsIgnoreCase(message, "address already in use");
    std::cerr << "fsdp launch: " << message
              << (host_store && in_use ? " (port already in use? choose another --master-port)"
                                       : "")
              << "\n";
    return 1;
  }
  int port = store->getPort();
  if (o.nnodes > 1) {  // Note [Launchers across nodes]
    absl::Status met = absl::OkStatus();
    absl::Status call = CallTorch("meeting the other nodes' launchers",
                                  [&] { met = MeetOtherNodes(*store, o, port); });
    if (!call.ok()) met = call;
    if (!met.ok()) {
      std::cerr << "fsdp launch: node " << o.node_rank << ": " << met.message() << "\n";
      return met.code() == absl::StatusCode::kDeadlineExceeded ||
                     met.code() == absl::StatusCode::kInternal ||
                     met.code() == absl::StatusCode::kUnavailable
                 ? 1
                 : 2;
    }
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
    const std::string failed_key = AttemptKey(attempt, "failed");
    bool store_lost = false;  // polled no more: each failed call logs a c10d stack trace
    wait.stop_requested = [&] {
      if (ReceivedStopSignal() != 0) return true;
      if (o.nnodes == 1 || store_lost) return false;
      bool other_failed = false;
      store_lost = !CallTorch("", [&] { other_failed = store->check({failed_key}); }).ok();
      return other_failed;
    };
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
    if (o.nnodes > 1) {
      (void)CallTorch("", [&] {
        SetString(*store, AttemptKey(attempt, StrCat("report/", o.node_rank)), EncodeReport(mine));
        if (!result.ok()) SetString(*store, failed_key, "1");
      });
    }
    if (result.ok()) {
      std::cerr << "fsdp launch: " << result.Summary() << "\n";
      if (o.nnodes == 1) return 0;
      std::optional<JobOutcome> later =
          LeaveJob(*store, o, attempt, mine, o.rendezvous_timeout, /*watch_failures=*/true);
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
      if (o.nnodes > 1) LeaveJob(*store, o, attempt, mine, report_wait, /*watch_failures=*/false);
      return 128 + sig;
    }
    JobOutcome job;
    if (o.nnodes == 1) {
      job = {mine.text, mine.code, mine.restartable, ""};
    } else {
      job = CollectReports(*store, o, attempt, mine, report_wait);
    }
    if (FailureClassOfExitCode(job.code) == FailureClass::kPreempted) {
      std::cerr << "fsdp launch: " << job.text << "\n";  // not restarted: the node is going away
      if (o.nnodes > 1) LeaveJob(*store, o, attempt, mine, report_wait, false, job.silent_nodes);
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
    if (o.nnodes > 1) LeaveJob(*store, o, attempt, mine, report_wait, false, job.silent_nodes);
    return job.code;
  }
}

}  // namespace fsdp
