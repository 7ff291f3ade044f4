#include "launcher/launch.h"

#include <unistd.h>

#include <filesystem>
#include <iostream>
#include <mutex>
#include <random>
#include <thread>

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "common/env_knobs.h"
#include "common/failure.h"
#include "common/logging.h"
#include "common/strings.h"
#include "device_mesh/torch_status.h"
#include "launcher/worker_group.h"

namespace fsdp {
namespace {

std::string RandomRunId() {
  std::random_device rd;
  return fmt::format("{:08x}", rd());
}

std::string AttemptKey(int attempt, std::string_view what) {
  return StrCat("fsdp/launch/attempt_", attempt, "/", what);
}

// A failing rank's own "<class>: <what>" from its record line ("rank R: <what>"), cut to a
// length that keeps the headline one readable line.
std::string OwnFailure(const FailureRecord& r) {
  constexpr size_t kMaxChars = 120;
  std::string what = r.line;
  const std::string prefix = StrCat("rank ", r.rank, ": ");
  if (StartsWith(what, prefix)) what = what.substr(prefix.size());
  if (what.size() > kMaxChars) what = what.substr(0, kMaxChars) + "...";
  return what;
}

}  // namespace

// Note [The first failure]
// When one rank fails, the others fail soon after (a collective with a peer gone, a timeout
// naming it) or are stopped by the launcher; the first exit the launcher reaps is often one
// of those. So each failing rank leaves its one line with the time it failed in
// FSDP_FAILURE_DIR (common/failure.h), and the headline names the earliest failure that was
// not caused by another rank: a record with another code than 7 (peer lost), or a rank that
// died by a signal the launcher did not send (its time: when it was reaped). Every other rank
// that failed on its own account (its record's class is not peer lost, or a signal nobody
// sent) is named with its own class and what ("rank 2 also failed: collective timeout: ...":
// two ranks timing out in one collective both say so); ranks that only followed (peer lost,
// or stopped by the launcher) are summarised ("ranks 0,1,3 stopped after rank 2 failed").
FailureHeadline SummarizeFailures(const GroupResult& result,
                                  const std::vector<FailureRecord>& records) {
  struct Candidate {
    int rank;
    int64_t time_ns;
    bool primary;
    std::string line;
    int code;
  };
  std::vector<Candidate> candidates;
  for (const FailureRecord& r : records) {
    candidates.push_back({r.rank, r.time_ns,
                          FailureClassOfExitCode(r.exit_code) != FailureClass::kPeerLost, r.line,
                          r.exit_code});
  }
  for (const WorkerExit& e : result.exits) {
    bool recorded = false;
    for (const FailureRecord& r : records) recorded |= r.rank == e.rank;
    if (recorded || e.exited || e.killed_by_us) continue;  // a signal nobody recorded
    candidates.push_back({e.rank, e.exit_time_ns, true, StrCat("rank ", e.rank, " ", e.Describe()),
                          e.exited ? e.code : 128 + e.code});
  }
  FailureHeadline h;
  const Candidate* first = nullptr;
  for (bool want_primary : {true, false}) {
    for (const Candidate& c : candidates) {
      if (c.primary == want_primary && (first == nullptr || c.time_ns < first->time_ns)) first = &c;
    }
    if (first != nullptr) break;
  }
  if (first == nullptr) {  // no record and no signal: the first exit reaped
    const WorkerExit& f = *result.first_failure;
    h.rank = f.rank;
    h.code = f.exited ? f.code : 128 + f.code;
    h.text = StrCat("rank ", f.rank, " ", f.Describe(), "; stopped the other local ranks");
    return h;
  }
  h.rank = first->rank;
  h.code = first->code;
  // Preempted ranks (exit 143 after a SIGTERM save, Note [Exit codes]) did not fail: they all
  // stopped at the same step, and one line says so.
  const bool preempted = FailureClassOfExitCode(h.code) == FailureClass::kPreempted;
  h.text = StrCat("rank ", first->rank, preempted ? " stopped first: " : " failed first: ",
                  first->line);
  std::vector<std::string> own;  // "rank 2 also failed: timeout: ..."
  std::vector<int> followers;
  for (const WorkerExit& e : result.exits) {
    if (e.rank == h.rank || e.ok()) continue;
    const FailureRecord* record = nullptr;
    for (const FailureRecord& r : records) {
      if (r.rank == e.rank) record = &r;
    }
    if (record != nullptr) {
      const FailureClass c = FailureClassOfExitCode(record->exit_code);
      if (c == FailureClass::kPeerLost || (preempted && c == FailureClass::kPreempted)) {
        followers.push_back(e.rank);
      } else {
        own.push_back(StrCat("rank ", e.rank, " also failed: ", OwnFailure(*record)));
      }
    } else if (e.killed_by_us) {
      followers.push_back(e.rank);
    } else {  // a signal nobody sent, or an exit without a record
      own.push_back(StrCat("rank ", e.rank, " ", e.Describe()));
    }
  }
  for (const std::string& o : own) h.text += "; " + o;
  if (!followers.empty()) {
    h.text += StrCat("; rank", followers.size() > 1 ? "s " : " ", StrJoin(followers, ","),
                     preempted ? " stopped too" : StrCat(" stopped after rank ", h.rank, " failed"));
  }
  return h;
}

namespace {

// A fresh folder for the ranks' failure records; empty when none could be made.
std::string MakeFailureDir() {
  std::string templ = "/tmp/fsdp-failures-XXXXXX";
  if (mkdtemp(templ.data()) == nullptr) return "";
  return templ;
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
  return absl::OkStatus();
}

int RunLaunch(const LaunchOptions& o) {
  if (absl::Status valid = o.Validate(); !valid.ok()) {
    std::cerr << "fsdp launch: " << valid.message() << "\n";
    return 2;
  }
  std::string run_id = o.run_id.empty() ? RandomRunId() : o.run_id;
  bool host_store = o.node_rank == 0;

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

  InstallStopSignalHandlers();
  std::mutex out_mu;
  std::string status;  // shown on the last line of stderr, below the workers' output
  auto sink = [&](const OutputLine& line) {
    std::lock_guard<std::mutex> lock(out_mu);
    if (o.echo && !o.echo(line.rank, line.is_stderr, line.text)) {
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

  const std::string failure_dir = MakeFailureDir();
  struct RemoveDir {
    std::string dir;
    ~RemoveDir() {
      std::error_code ec;
      if (!dir.empty()) std::filesystem::remove_all(dir, ec);
    }
  } remove_failure_dir{failure_dir};
  for (int attempt = 0;; ++attempt) {
    std::vector<WorkerSpec> specs;
    for (int lr = 0; lr < o.nproc_per_node; ++lr) {
      specs.push_back({o.node_rank * o.nproc_per_node + lr, o.program,
                       WorkerEnv(o, lr, port, attempt, run_id, failure_dir)});
    }
    if (!failure_dir.empty()) {  // an earlier attempt's records are not this one's
      std::error_code ec;
      for (const auto& entry : std::filesystem::directory_iterator(failure_dir, ec)) {
        std::filesystem::remove(entry.path(), ec);
      }
    }
    if (attempt == 0 && o.announce) {
      std::cerr << "fsdp launch: starting " << o.nproc_per_node << " rank(s) on node "
                << o.node_rank << " of " << o.nnodes << ", world size "
                << o.nnodes * o.nproc_per_node << ", store " << o.master_addr << ":" << port
                << "\n";
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
    const std::string failed_code_key = AttemptKey(attempt, "failed_code");
    wait.stop_requested = [&] {
      if (ReceivedStopSignal() != 0) return true;
      if (o.nnodes == 1) return false;
      bool other_failed = false;
      (void)CallTorch("", [&] { other_failed = store->check({failed_key}); });
      return other_failed;
    };
    GroupResult result = group.Wait(wait);
    if (!status.empty()) {
      std::cerr << "\n";
      status.clear();
    }
    if (result.ok()) {
      std::cerr << "fsdp launch: " << result.Summary() << "\n";
      return 0;
    }
    if (int sig = ReceivedStopSignal(); sig != 0) {
      std::cerr << "fsdp launch: interrupted by signal " << sig << "; workers stopped\n";
      return 128 + sig;
    }
    std::string why;
    int code = 1;
    if (result.outcome == GroupResult::Outcome::kWorkerFailed) {
      FailureHeadline headline =
          SummarizeFailures(result, failure_dir.empty() ? std::vector<FailureRecord>()
                                                        : ReadFailureRecords(failure_dir));
      why = headline.text;
      code = headline.code;
      std::string value = StrCat("node ", o.node_rank, ": ", why);
      std::string code_text = StrCat(code);
      (void)CallTorch("", [&] {
        // The code first: a node that reads failed_key finds its code too (preempted: 143).
        store->set(failed_code_key, std::vector<uint8_t>(code_text.begin(), code_text.end()));
        store->set(failed_key, std::vector<uint8_t>(value.begin(), value.end()));
      });
    } else {
      why = "a rank on another node failed";
      (void)CallTorch("", [&] {
        auto v = store->get(failed_key);
        why = std::string(v.begin(), v.end());
        auto c = store->get(failed_code_key);
        code = ParseInt<int>(std::string(c.begin(), c.end())).value_or(1);
      });
    }
    if (FailureClassOfExitCode(code) == FailureClass::kPreempted) {
      std::cerr << "fsdp launch: " << why << "\n";  // not restarted: the node is going away
      return code;
    }
    if (attempt < o.max_restarts) {
      std::cerr << "fsdp launch: " << why << "; restarting the local group (restart "
                << attempt + 1 << " of " << o.max_restarts << ")\n";
      continue;
    }
    std::cerr << "fsdp launch: " << why
              << (o.max_restarts > 0 ? StrCat(" (", o.max_restarts, " restarts used)") : "")
              << "\n";
    return code;
  }
}

}  // namespace fsdp
