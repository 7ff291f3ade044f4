#include "device_mesh/dist_context.h"
#include "common/strings.h"

#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <condition_variable>
#include <map>
#include <mutex>
#include <thread>

#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "absl/strings/str_format.h"
#include "common/env_knobs.h"
#include "common/env.h"
#include "common/failure.h"
#include "common/logging.h"
#include "common/status.h"
#include "device_mesh/cuda_support.h"
#include "device_mesh/torch_status.h"

namespace fsdp {
namespace {

using Clock = std::chrono::steady_clock;

std::string Seconds(std::chrono::milliseconds ms) {
  return fmt::format("{:g} s", static_cast<double>(ms.count()) / 1000.0);
}

bool IsLoopback(const std::string& addr) {
  return addr == "localhost" || StartsWith(addr, "127.") || addr == "::1";
}

std::vector<uint8_t> Bytes(std::string_view s) { return {s.begin(), s.end()}; }
std::string String(const std::vector<uint8_t>& v) { return {v.begin(), v.end()}; }

absl::StatusOr<c10::intrusive_ptr<c10d::Store>> ConnectStore(const LaunchEnv& env,
                                                             std::chrono::milliseconds timeout) {
  if (env.master_addr.empty()) {
    // A single process without a launcher: nobody to meet.
    return c10::intrusive_ptr<c10d::Store>(c10::make_intrusive<c10d::HashStore>());
  }
  c10d::TCPStoreOptions opts;
  opts.port = static_cast<uint16_t>(env.master_port);
  opts.isServer = !env.use_agent_store && env.rank == 0;
  opts.numWorkers = env.world_size;
  opts.waitWorkers = false;  // our own arrival check below says who is missing
  opts.timeout = timeout;
  c10::intrusive_ptr<c10d::Store> store;
  std::string address = StrCat(env.master_addr, ":", env.master_port);
  absl::Status status = CallTorch(
      // The messages do not name this rank: the failure line does ("rank 1: timeout: ...",
      // common/failure.h), and so does the rank prefix of the logs.
      opts.isServer ? StrCat("could not host the rendezvous store on port ", env.master_port)
                    : StrCat("could not connect to the rendezvous store at ", address),
      [&] { store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, opts); });
  if (!status.ok()) {
    std::string hint;
    std::string message(status.message());
    if (ContainsIgnoreCase(message, "EADDRINUSE") ||
        ContainsIgnoreCase(message, "address already in use")) {
      hint = StrCat(" (MASTER_PORT ", env.master_port,
                          " is already in use, probably by another run: choose another "
                          "MASTER_PORT, or let `fsdp launch` pick a free one)");
    } else if (!opts.isServer) {
      hint = StrCat(" within ", Seconds(timeout),
                          ". Is the store's host running (",
                          env.use_agent_store ? "the launcher agent" : "rank 0",
                          "), and do all ranks use the same MASTER_ADDR/MASTER_PORT?");
    }
    return absl::Status(status.code(), StrCat(message, hint));
  }
  if (env.use_agent_store) {
    store = c10::make_intrusive<c10d::PrefixStore>(
        StrCat("/worker/attempt_", env.restart_count), store);
  }
  return store;
}

// Every rank announces itself, then waits until all WORLD_SIZE ranks have. Catches ranks that
// never start, two processes claiming one RANK, and ranks disagreeing on WORLD_SIZE.
absl::Status WaitForPeers(c10d::Store& store, const LaunchEnv& env,
                          std::chrono::milliseconds timeout, int generation) {
  const std::string prefix = StrCat("fsdp/rdzv/", generation, "/");
  std::string me = StrCat(env.world_size, "|", HostName(), "|", getpid());
  std::vector<std::string> keys;
  for (int r = 0; r < env.world_size; ++r) keys.push_back(StrCat(prefix, "rank/", r));

  int64_t claims = store.add(StrCat(prefix, "claim/", env.rank), 1);
  if (claims > 1) {
    return absl::InvalidArgumentError(StrCat(
        "two processes claim RANK=", env.rank, " (this one is pid ", getpid(), " on ",
        HostName(), "); every rank needs its own RANK in 0..WORLD_SIZE-1"));
  }
  store.set(keys[env.rank], Bytes(me));

  Clock::time_point deadline = Clock::now() + timeout;
  Clock::time_point next_report = Clock::now() + std::chrono::seconds(30);
  std::vector<int> missing;
  while (true) {
    missing.clear();
    for (int r = 0; r < env.world_size; ++r) {
      if (!store.check({keys[r]})) missing.push_back(r);
    }
    if (missing.empty() || Clock::now() >= deadline) break;
    if (Clock::now() >= next_report) {
      FSDP_LOG_INFO("rendezvous: still waiting for rank(s) {}", StrJoin(missing, ", "));
      next_report += std::chrono::seconds(30);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  // Everyone who did arrive must agree on WORLD_SIZE; a disagreement explains a timeout too.
  for (int r = 0; r < env.world_size; ++r) {
    if (std::find(missing.begin(), missing.end(), r) != missing.end()) continue;
    std::string value = String(store.get(keys[r]));
    std::vector<std::string_view> parts = Split(value, "|");
    std::optional<int> their_world = ParseInt(parts[0]);
    if (parts.size() == 3 && their_world && *their_world != env.world_size) {
      return absl::InvalidArgumentError(StrCat(
          "ranks disagree on WORLD_SIZE: rank ", r, " (pid ", parts[2], " on ", parts[1],
          ") has WORLD_SIZE=", *their_world, ", rank ", env.rank, " has WORLD_SIZE=",
          env.world_size));
    }
  }
  if (!missing.empty()) {
    return absl::DeadlineExceededError(
        StrCat("rendezvous timed out after ", Seconds(timeout), ": ",
               env.world_size - static_cast<int>(missing.size()), " of ", env.world_size,
               " ranks arrived; still waiting for rank(s) ", StrJoin(missing, ", "), " (store at ",
               env.master_addr, ":", env.master_port, ", launched via ", env.source, "). Were all ",
               env.world_size, " ranks started with the same MASTER_ADDR/MASTER_PORT?"));
  }
  return absl::OkStatus();
}

// NCCL refuses two ranks on one GPU; say which ranks collide instead.
absl::Status CheckDistinctDevices(c10d::Store& store, const LaunchEnv& env, int device_index,
                                  std::chrono::milliseconds timeout, int generation) {
  const std::string prefix = StrCat("fsdp/rdzv/", generation, "/device/");
  std::string mine = StrCat(HostName(), ":cuda:", device_index);
  store.set(StrCat(prefix, env.rank), Bytes(mine));
  std::vector<std::string> keys;
  for (int r = 0; r < env.world_size; ++r) keys.push_back(StrCat(prefix, r));
  absl::Status waited = CallTorch("exchanging device ids", [&] { store.wait(keys, timeout); });
  FSDP_RETURN_IF_ERROR(waited);
  for (int r = 0; r < env.world_size; ++r) {
    if (r != env.rank && String(store.get(keys[r])) == mine) {
      return absl::FailedPreconditionError(StrCat(
          "ranks ", std::min(r, env.rank), " and ", std::max(r, env.rank), " both use ", mine,
          "; NCCL needs one GPU per rank. Check LOCAL_RANK / CUDA_VISIBLE_DEVICES, or use "
          "cuda_backend 'gloo' to share a GPU"));
    }
  }
  return absl::OkStatus();
}

// Note [Rendezvous deadline]
// c10d's TCPStore bounds its connect and its waits, but not every read: a listener that
// accepts the connection and never answers (a wrong MASTER_PORT pointing at another service,
// a hung store host) blocks the first request forever. So the whole rendezvous (connect,
// announce, wait for peers) runs on a helper thread, and the rank gives up at
// rendezvous_timeout (plus two seconds for the inner timeouts to report first), naming the
// address. The helper is left behind, blocked; the rank is about to exit with the error.
// What a TCP connect to host:port does within `timeout`, for the message of a rendezvous that
// ran out of time: the store's host may be unknown, nobody may listen there, the connect may
// hang (a firewall, a host that is down), or the listener accepts (and, the rendezvous having
// timed out, never answered).
std::string DescribeStoreAddress(const std::string& host, int port,
                                 std::chrono::milliseconds timeout) {
  const std::string address = StrCat(host, ":", port);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (int rc = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found);
      rc != 0) {
    return StrCat("MASTER_ADDR '", host, "' does not resolve (", ::gai_strerror(rc), ")");
  }
  std::string outcome = StrCat("nothing answered a connection to ", address, " within ",
                               Seconds(timeout), " (host down or unreachable?)");
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    int rc = ::connect(fd, a->ai_addr, a->ai_addrlen);
    int err = rc == 0 ? 0 : errno;
    if (err == EINPROGRESS) {
      pollfd p{fd, POLLOUT, 0};
      if (::poll(&p, 1, static_cast<int>(timeout.count())) == 1) {
        socklen_t len = sizeof(err);
        ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
      } else {
        err = ETIMEDOUT;
      }
    }
    ::close(fd);
    if (err == 0) {
      outcome = StrCat("the store at ", address,
                       " accepted the connection but did not answer (is MASTER_ADDR/MASTER_PORT "
                       "the rendezvous store of this job?)");
      break;
    }
    if (err == ECONNREFUSED) {
      outcome = StrCat("nothing listens at ", address,
                       " (is the store's host running, and do all ranks use the same "
                       "MASTER_ADDR/MASTER_PORT?)");
    }
  }
  ::freeaddrinfo(found);
  return outcome;
}

absl::StatusOr<c10::intrusive_ptr<c10d::Store>> RendezvousWithDeadline(
    const LaunchEnv& env, std::chrono::milliseconds timeout, int generation) {
  struct Shared {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    absl::StatusOr<c10::intrusive_ptr<c10d::Store>> result = absl::UnknownError("not run");
  };
  auto shared = std::make_shared<Shared>();
  std::thread([shared, env, timeout, generation] {
    absl::StatusOr<c10::intrusive_ptr<c10d::Store>> store = ConnectStore(env, timeout);
    if (store.ok()) {
      absl::Status arrived = absl::OkStatus();
      absl::Status call = CallTorch("rendezvous through the store", [&] {
        arrived = WaitForPeers(**store, env, timeout, generation);
      });
      if (!call.ok()) store = call;
      else if (!arrived.ok()) store = arrived;
    }
    std::lock_guard<std::mutex> lock(shared->mu);
    shared->result = std::move(store);
    shared->done = true;
    shared->cv.notify_all();
  }).detach();
  std::unique_lock<std::mutex> lock(shared->mu);
  if (!shared->cv.wait_for(lock, timeout + std::chrono::seconds(2), [&] { return shared->done; })) {
    return absl::DeadlineExceededError(
        StrCat("rendezvous timed out after ", Seconds(timeout), ": ",
               DescribeStoreAddress(env.master_addr, env.master_port,
                                    std::chrono::milliseconds(500)),
               "; launched via ", env.source));
  }
  return std::move(shared->result);
}

}  // namespace

// Note [A rank outlives its launcher]
// A rank started by `fsdp launch` or torchrun dies with its launcher (PR_SET_PDEATHSIG) only
// when it is the launcher's own child. Behind a wrapper (`sh -c 'fsdp train ... > log'`) it is
// orphaned when the launcher is killed, and its collectives do not use the store, so nothing
// stopped it: it trained on for as long as it was let (and the watchdog's heartbeat failed
// quietly). So a rank on a launcher's store (TORCHELASTIC_USE_AGENT_STORE) watches it: when the
// store fails three times in a row, a second apart, its launcher is gone, and the rank ends as
// peer lost, naming the store. A store that is slow to answer is not gone: only errors count.
class LauncherWatch {
 public:
  LauncherWatch(c10::intrusive_ptr<c10d::Store> store, int rank, std::string address)
      : state_(std::make_shared<State>()) {
    // The thread owns the state: a destructor that finds it in a slow store call leaves it
    // behind (it ends with the process) instead of waiting for the store's timeout.
    std::thread([state = state_, store = std::move(store), rank, address = std::move(address)] {
      constexpr int kFailuresToGiveUp = 3;
      int failures = 0;
      std::unique_lock<std::mutex> lock(state->mu);
      while (!state->cv.wait_for(lock, std::chrono::seconds(1), [&] { return state->stop; })) {
        lock.unlock();
        bool failed = false;
        try {
          store->check({"fsdp/launcher_watch"});
        } catch (const std::exception&) {
          failed = true;
        }
        lock.lock();
        failures = failed ? failures + 1 : 0;
        if (failures >= kFailuresToGiveUp && !state->stop) {
          FailAndExit(rank, FailureClass::kPeerLost,
                      StrCat("peer lost: the launcher's store at ", address,
                             " is gone: its launcher (fsdp launch, torchrun) ended or was "
                             "killed, so this rank stops instead of training on alone"));
        }
      }
    }).detach();
  }
  ~LauncherWatch() {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->stop = true;
    state_->cv.notify_all();
  }

 private:
  struct State {
    std::mutex mu;
    std::condition_variable cv;
    bool stop = false;
  };
  std::shared_ptr<State> state_;
};

namespace {

int NextGeneration() {
  static int generation = 0;
  return generation++;
}

}  // namespace

absl::Status DistOptions::Validate() const {
  if (device != "cpu" && device != "cuda" && device != "auto") {
    return absl::InvalidArgumentError(
        StrCat("device '", device, "' is not valid; valid: cpu, cuda, auto"));
  }
  if (cuda_backend != "nccl" && cuda_backend != "gloo") {
    return absl::InvalidArgumentError(
        StrCat("backend '", cuda_backend, "' is not valid; valid: nccl, gloo"));
  }
  if (cpu_collectives != "p2p" && cpu_collectives != "gloo") {
    return absl::InvalidArgumentError(
        StrCat("cpu_collectives '", cpu_collectives, "' is not valid; valid: p2p, gloo"));
  }
  if (rendezvous_timeout.count() <= 0 || collective_timeout.count() <= 0) {
    return absl::InvalidArgumentError("timeouts must be positive");
  }
  return absl::OkStatus();
}

absl::Status ApplyTimeoutEnv(const EnvLookup& env, DistOptions& options) {
  const int kMaxSeconds = 7 * 24 * 3600;
  FSDP_ASSIGN_OR_RETURN(std::optional<int> rdzv,
                        GetOptionalIntEnv(env, kRendezvousTimeoutS.name, 1, kMaxSeconds));
  FSDP_ASSIGN_OR_RETURN(std::optional<int> coll,
                        GetOptionalIntEnv(env, kCollectiveTimeoutS.name, 1, kMaxSeconds));
  if (rdzv) options.rendezvous_timeout = std::chrono::seconds(*rdzv);
  if (coll) options.collective_timeout = std::chrono::seconds(*coll);
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<DistContext>> DistContext::InitFromEnvironment(
    DistOptions options) {
  EnvLookup env = ProcessEnv();
  FSDP_ASSIGN_OR_RETURN(LaunchEnv launch, ParseLaunchEnv(env));
  FSDP_RETURN_IF_ERROR(ApplyTimeoutEnv(env, options));
  return Init(launch, options);
}

absl::StatusOr<std::shared_ptr<DistContext>> DistContext::Init(const LaunchEnv& env,
                                                               const DistOptions& options) {
  FSDP_RETURN_IF_ERROR(options.Validate());
  SetLogRank(env.rank);
  std::shared_ptr<DistContext> ctx(new DistContext());
  ctx->env_ = env;
  ctx->options_ = options;
  int generation = NextGeneration();
  ctx->generation_ = generation;

  SetFailureRank(env.rank);
  FSDP_ASSIGN_OR_RETURN(ctx->store_,
                        RendezvousWithDeadline(env, options.rendezvous_timeout, generation));

  bool want_cuda = options.device == "cuda" || (options.device == "auto" && CudaDeviceCount() > 0);
  ctx->group_options_.timeout = options.collective_timeout;
  if (options.watchdog) {
    // The watchdog names a hung collective; the backend's own timeout comes later, as a
    // backstop (Note [Exiting from a watchdog]).
    ctx->group_options_.timeout +=
        std::max<std::chrono::milliseconds>(std::chrono::seconds(15), options.collective_timeout / 10);
  }
  ctx->group_options_.cuda_backend = options.cuda_backend;
  ctx->group_options_.cpu_collectives = options.cpu_collectives;
  if (want_cuda) {
    int count = CudaDeviceCount();
    if (count == 0) {
      return absl::FailedPreconditionError(StrCat(
          "rank ", env.rank, ": device 'cuda' was asked for but ",
          IsCudaBuild() ? "no CUDA device is visible" : "this build is CPU-only"));
    }
    int index = env.local_rank % count;
    FSDP_RETURN_IF_ERROR(SetCudaDevice(index));
    if (options.cuda_backend == "nccl") {
      absl::Status distinct = absl::OkStatus();
      FSDP_RETURN_IF_ERROR(CallTorch("checking devices", [&] {
        distinct = CheckDistinctDevices(*ctx->store_, env, index, options.rendezvous_timeout,
                                        generation);
      }));
      FSDP_RETURN_IF_ERROR(distinct);
    }
    ctx->device_ = c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(index));
    ctx->group_options_.cuda_device = index;
  }
  if (std::optional<std::string> ifname = GetEnvKnob(kGlooSocketIfname);
      ifname && !ifname->empty()) {
    ctx->group_options_.gloo_interface = *ifname;
  } else if (env.master_addr.empty() || IsLoopback(env.master_addr)) {
    ctx->group_options_.gloo_hostname = "127.0.0.1";
  }

  std::vector<int> all(env.world_size);
  for (int r = 0; r < env.world_size; ++r) all[r] = r;
  FSDP_ASSIGN_OR_RETURN(ctx->world_, ctx->NewGroup(all, "world"));
  if (env.use_agent_store) {
    absl::Status watched = CallTorch("watching the launcher's store", [&] {
      ctx->launcher_watch_ = std::make_unique<LauncherWatch>(
          ctx->store_->clone(), env.rank, StrCat(env.master_addr, ":", env.master_port));
    });
    FSDP_RETURN_IF_ERROR(watched);
  }
  if (options.watchdog) {
    WatchdogOptions watch;
    watch.timeout = options.collective_timeout;
    watch.key_prefix = StrCat("fsdp/", generation, "/progress/");
    watch.flight_dir = options.flight_dir;
    absl::Status started = CallTorch("starting the collective watchdog", [&] {
      ctx->watchdog_ = Watchdog::Start(ctx->store_, env.rank, env.world_size, watch);
    });
    FSDP_RETURN_IF_ERROR(started);
  }
  return ctx;
}

DistContext::DistContext() = default;
DistContext::~DistContext() = default;

absl::StatusOr<std::shared_ptr<ProcessGroup>> DistContext::NewGroup(std::vector<int> ranks,
                                                                    std::string_view tag) {
  for (int r : ranks) {
    if (r < 0 || r >= world_size()) {
      return absl::InvalidArgumentError(StrCat("group '", tag, "' names rank ", r,
                                                     ", outside 0..", world_size() - 1));
    }
  }
  // The context's generation keeps groups of an earlier context in this process (same store,
  // same ranks) apart from ours.
  std::string name = StrCat("fsdp/", generation_, "/group/", tag, "/", StrJoin(ranks, "-"));
  return ProcessGroup::Create(store_, std::move(name), std::move(ranks), rank(), group_options_);
}

std::string DistContext::NextTag(std::string_view kind) {
  return StrCat(kind, next_tag_++);
}

}  // namespace fsdp
