#include "launcher/node_rendezvous.h"

#include <unistd.h>

#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "common/env.h"
#include "common/strings.h"
#include "device_mesh/torch_status.h"

namespace fsdp {
namespace {

using Clock = std::chrono::steady_clock;

// The store keys (node_rendezvous.h).
std::string AttemptKey(int attempt, std::string_view what) {
  return StrCat("fsdp/launch/attempt_", attempt, "/", what);
}
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
            o.nnodes, " --nproc-per-node ", o.nproc_per_node, " --max-restarts ", o.max_restarts,
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

// A NodeReport in the store: "<code> <primary> <restartable> <time_ns>\n<text>".
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

}  // namespace

NodeRendezvous::NodeRendezvous(const LaunchOptions& o, c10::intrusive_ptr<c10d::TCPStore> store)
    : o_(o), store_(std::move(store)), port_(store_->getPort()) {}

absl::StatusOr<std::unique_ptr<NodeRendezvous>> NodeRendezvous::Connect(const LaunchOptions& o) {
  const bool host_store = o.node_rank == 0;
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
    return absl::Status(
        made.code(),
        StrCat(message,
               host_store && in_use ? " (port already in use? choose another --master-port)" : ""));
  }
  return std::unique_ptr<NodeRendezvous>(new NodeRendezvous(o, std::move(store)));
}

absl::Status NodeRendezvous::Meet() {
  if (o_.nnodes == 1) return absl::OkStatus();
  absl::Status met = absl::OkStatus();
  absl::Status call = CallTorch("meeting the other nodes' launchers",
                                [&] { met = MeetOtherNodes(*store_, o_, port_); });
  if (!call.ok()) met = call;
  return met;
}

std::function<bool()> NodeRendezvous::FailureWatch(int attempt) {
  if (o_.nnodes == 1) return [] { return false; };
  return [this, failed_key = AttemptKey(attempt, "failed"), store_lost = false]() mutable {
    if (store_lost) return false;
    bool other_failed = false;
    store_lost = !CallTorch("", [&] { other_failed = store_->check({failed_key}); }).ok();
    return other_failed;
  };
}

void NodeRendezvous::Report(int attempt, const NodeReport& mine, bool failed) {
  if (o_.nnodes == 1) return;
  (void)CallTorch("", [&] {
    SetString(*store_, AttemptKey(attempt, StrCat("report/", o_.node_rank)), EncodeReport(mine));
    if (failed) SetString(*store_, AttemptKey(attempt, "failed"), "1");
  });
}

JobOutcome NodeRendezvous::CollectReports(int attempt, const NodeReport& mine,
                                          std::chrono::milliseconds bound) {
  if (o_.nnodes == 1) return {mine.text, mine.code, mine.restartable, ""};
  std::vector<std::optional<NodeReport>> reports(o_.nnodes);
  reports[o_.node_rank] = mine;  // known here even when the store is gone
  const Clock::time_point deadline = Clock::now() + bound;
  bool store_lost = false;
  while (true) {
    absl::Status read = CallTorch("", [&] {
      for (int n = 0; n < o_.nnodes; ++n) {
        const std::string key = AttemptKey(attempt, StrCat("report/", n));
        if (!reports[n] && store_->check({key})) reports[n] = DecodeReport(GetString(*store_, key));
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
  return SummarizeNodeReports(reports, store_lost, bound);
}

std::optional<JobOutcome> NodeRendezvous::Leave(int attempt, const NodeReport& mine,
                                                std::chrono::milliseconds bound,
                                                bool watch_failures, int silent_nodes) {
  if (o_.nnodes == 1) return std::nullopt;
  if (o_.node_rank != 0) {
    (void)CallTorch("", [&] { store_->add(kLeftKey, 1); });
    return std::nullopt;
  }
  const Clock::time_point deadline = Clock::now() + bound;
  std::optional<JobOutcome> outcome;
  while (Clock::now() < deadline) {
    int64_t left = 0;
    bool failed = false;
    absl::Status read = CallTorch("", [&] {
      left = store_->add(kLeftKey, 0);
      failed = watch_failures && !outcome && store_->check({AttemptKey(attempt, "failed")});
    });
    if (!read.ok() || left >= o_.nnodes - 1 - silent_nodes) break;
    if (failed) {
      outcome = CollectReports(attempt, mine, o_.grace + std::chrono::seconds(10));
      silent_nodes = outcome->silent_nodes;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return outcome;
}

}  // namespace fsdp
