#include "tests/multirank.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <mutex>

#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "common/strings.h"

namespace fsdp::testing {
namespace {

constexpr const char* kChildCallVar = "FSDP_TEST_CHILD_CALL";
constexpr const char* kChildRankVar = "FSDP_TEST_RANK";

// Every variable a launcher might have left in our own environment: children start clean.
const char* kLauncherVars[] = {
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
    "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_RUN_ID", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NODEID",
    "SLURM_JOB_NODELIST", "SLURM_NODELIST", "SLURM_JOB_ID", "SLURM_NTASKS_PER_NODE",
    "SLURM_TASKS_PER_NODE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", "PMI_RANK", "PMI_SIZE",
    "MPI_LOCALRANKID", "MPI_LOCALNRANKS"};

// Index of the RunOnRanks call within the current test (the child runs only its own).
int g_call_index = 0;
std::string g_last_test;

std::string CurrentTestName() {
  const ::testing::TestInfo* info = ::testing::UnitTest::GetInstance()->current_test_info();
  return StrCat(info->test_suite_name(), ".", info->name());
}

void Assign(std::map<std::string, std::string>& env,
            std::initializer_list<std::pair<const char*, std::string>> values) {
  for (const auto& [k, v] : values) env[k] = v;
}

std::map<std::string, std::string> StyleEnv(EnvStyle style, int rank, int world, int port) {
  std::map<std::string, std::string> env;
  for (const char* var : kLauncherVars) env[var] = "";
  std::string r = StrCat(rank), w = StrCat(world), p = StrCat(port);
  switch (style) {
    case EnvStyle::kTorchrunAgent:
      Assign(env, {
          {"RANK", r}, {"WORLD_SIZE", w}, {"LOCAL_RANK", r}, {"LOCAL_WORLD_SIZE", w},
          {"GROUP_RANK", "0"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", p},
          {"TORCHELASTIC_USE_AGENT_STORE", "True"}, {"TORCHELASTIC_RESTART_COUNT", "0"},
          {"TORCHELASTIC_RUN_ID", "test"}});
      break;
    case EnvStyle::kPlain:
      Assign(env, {
          {"RANK", r}, {"WORLD_SIZE", w}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", p}});
      break;
    case EnvStyle::kSlurm:
      Assign(env, {
          {"SLURM_PROCID", r}, {"SLURM_NTASKS", w}, {"SLURM_LOCALID", r}, {"SLURM_NODEID", "0"},
          {"SLURM_TASKS_PER_NODE", StrCat(world, "(x1)")}, {"SLURM_JOB_NODELIST", "localhost"},
          {"MASTER_PORT", p}});
      break;
    case EnvStyle::kOpenMpi:
      Assign(env, {
          {"OMPI_COMM_WORLD_RANK", r}, {"OMPI_COMM_WORLD_SIZE", w},
          {"OMPI_COMM_WORLD_LOCAL_RANK", r}, {"OMPI_COMM_WORLD_LOCAL_SIZE", w},
          {"MASTER_PORT", p}});
      break;
    case EnvStyle::kMpich:
      Assign(env, {
          {"PMI_RANK", r}, {"PMI_SIZE", w}, {"MPI_LOCALRANKID", r}, {"MPI_LOCALNRANKS", w},
          {"MASTER_PORT", p}});
      break;
  }
  return env;
}

// The last `max_lines` lines of a rank's output (all kept lines by default).
std::string Tail(const WorkerExit& exit, size_t max_lines = SIZE_MAX) {
  std::vector<const std::string*> lines;
  // libtorch's exceptions carry a backtrace of "frame #N" lines: the message is what matters.
  for (const std::string& line : exit.tail) {
    if (!StartsWith(line, "frame #")) lines.push_back(&line);
  }
  std::string out;
  for (size_t i = lines.size() > max_lines ? lines.size() - max_lines : 0; i < lines.size(); ++i) {
    out += "    | " + *lines[i] + "\n";
  }
  return out;
}

}  // namespace

bool InRankProcess() { return std::getenv(kChildCallVar) != nullptr; }

DistOptions TestDistOptions() {
  DistOptions options;
  options.rendezvous_timeout = std::chrono::seconds(30);
  options.collective_timeout = std::chrono::seconds(30);
  return options;
}

std::shared_ptr<DistContext> InitCudaDist(int world_size) {
  DistOptions options = TestDistOptions();
  options.device = "cuda";
  options.cuda_backend = world_size == 1 ? "nccl" : "gloo";
  return InitDist(options);
}

std::shared_ptr<DistContext> InitDist(DistOptions options) {
  absl::StatusOr<std::shared_ptr<DistContext>> ctx = DistContext::InitFromEnvironment(options);
  if (!ctx.ok()) {
    ADD_FAILURE() << "rendezvous failed: " << ctx.status();
    throw std::runtime_error("rendezvous failed");
  }
  return *ctx;
}

void RunOnRanks(int world_size, const std::function<void(int rank)>& body,
                const MultiRankOptions& options) {
  std::string test = CurrentTestName();
  if (test != g_last_test) {
    g_last_test = test;
    g_call_index = 0;
  }
  const int call = g_call_index++;

  if (const char* child_call = std::getenv(kChildCallVar)) {
    // A rank process: run our own call's body, skip the others.
    if (std::atoi(child_call) != call) return;
    body(std::atoi(std::getenv(kChildRankVar)));
    return;
  }

  // The parent: host the agent store (for the torchrun style) or reserve a port, start ranks.
  c10::intrusive_ptr<c10d::TCPStore> agent_store;
  int port = 0;
  if (options.style == EnvStyle::kTorchrunAgent) {
    c10d::TCPStoreOptions store_opts;
    store_opts.port = 0;
    store_opts.isServer = true;
    store_opts.waitWorkers = false;
    agent_store = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", store_opts);
    port = agent_store->getPort();
  } else {
    port = FreePort();
  }
  std::vector<WorkerSpec> specs;
  for (int rank = 0; rank < world_size; ++rank) {
    WorkerSpec spec;
    spec.rank = rank;
    spec.argv = {"/proc/self/exe", "--gtest_filter=" + test, "--gtest_color=no",
                 "--gtest_also_run_disabled_tests"};
    spec.env = StyleEnv(options.style, rank, world_size, port);
    spec.env[kChildCallVar] = StrCat(call);
    spec.env[kChildRankVar] = StrCat(rank);
    spec.env["OMP_NUM_THREADS"] = "1";
    if (options.rank_env) {
      for (auto& [k, v] : options.rank_env(rank)) spec.env[k] = v;
    }
    specs.push_back(std::move(spec));
  }
  bool verbose = std::getenv("FSDP_TEST_VERBOSE") != nullptr;
  std::mutex mu;
  WorkerGroup group([&](const OutputLine& line) {
    if (!verbose) return;
    std::lock_guard<std::mutex> lock(mu);
    fprintf(stderr, "[rank%d]: %.*s\n", line.rank, static_cast<int>(line.text.size()),
            line.text.data());
  });
  absl::Status started = group.Start(specs);
  ASSERT_TRUE(started.ok()) << started;
  WaitOptions wait;
  wait.deadline = std::chrono::steady_clock::now() + options.timeout;
  wait.grace = std::chrono::seconds(2);
  wait.tail_lines = 200;
  GroupResult result = group.Wait(wait);
  switch (result.outcome) {
    case GroupResult::Outcome::kSucceeded:
      return;
    case GroupResult::Outcome::kWorkerFailed: {
      const WorkerExit& f = *result.first_failure;
      // The other ranks' last lines too: a rank that fails because a peer went away (Gloo's
      // "Connection closed by peer") is not always the one whose error explains it.
      std::string others;
      for (const WorkerExit& e : result.exits) {
        if (e.rank == f.rank) continue;
        others += StrCat("  rank ", e.rank, " ", e.killed_by_us ? "was stopped" : e.Describe(),
                         "; its last lines:\n", Tail(e, 12));
      }
      ADD_FAILURE() << "rank " << f.rank << " of " << world_size << " " << f.Describe()
                    << "; its output ends with:\n"
                    << Tail(f) << "the other ranks:\n"
                    << others;
      return;
    }
    case GroupResult::Outcome::kTimedOut:
    case GroupResult::Outcome::kStopped: {
      std::string report;
      for (const WorkerExit& e : result.exits) {
        report += StrCat("  rank ", e.rank, (e.killed_by_us ? " was still running" : " finished"),
                         "; output ends with:\n", Tail(e));
      }
      ADD_FAILURE() << "timed out after " << options.timeout.count() << " s on " << world_size
                    << " ranks:\n"
                    << report;
      return;
    }
  }
}

std::string CommandResult::Output() const {
  std::string out;
  for (const auto& l : stdout_lines) out += "  out| " + l + "\n";
  for (const auto& l : stderr_lines) out += "  err| " + l + "\n";
  return out;
}

bool CommandResult::StdoutHas(std::string_view text) const {
  for (const auto& l : stdout_lines) {
    if (l.find(text) != std::string::npos) return true;
  }
  return false;
}

bool CommandResult::StderrHas(std::string_view text) const {
  for (const auto& l : stderr_lines) {
    if (l.find(text) != std::string::npos) return true;
  }
  return false;
}

std::map<std::string, std::string> WithGpus(std::map<std::string, std::string> env) {
  const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
  env["CUDA_VISIBLE_DEVICES"] = visible != nullptr ? visible : "";  // "": unset, all GPUs
  return env;
}

CommandResult RunCommand(const std::vector<std::string>& argv,
                         const std::map<std::string, std::string>& env,
                         std::chrono::seconds timeout) {
  CommandResult result;
  WorkerSpec spec;
  spec.argv = argv;
  for (const char* var : kLauncherVars) spec.env[var] = "";
  spec.env["CUDA_VISIBLE_DEVICES"] = "-1";  // no GPU, unless WithGpus
  for (const auto& [k, v] : env) spec.env[k] = v;
  std::mutex mu;
  WorkerGroup group([&](const OutputLine& line) {
    std::lock_guard<std::mutex> lock(mu);
    (line.is_stderr ? result.stderr_lines : result.stdout_lines).emplace_back(line.text);
  });
  absl::Status started = group.Start({spec});
  if (!started.ok()) {
    ADD_FAILURE() << started;
    return result;
  }
  WaitOptions wait;
  wait.deadline = std::chrono::steady_clock::now() + timeout;
  wait.grace = std::chrono::seconds(10);
  GroupResult r = group.Wait(wait);
  result.exit = r.exits.at(0);
  result.timed_out = r.outcome == GroupResult::Outcome::kTimedOut;
  return result;
}

int FreePort() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  close(fd);
  return ntohs(addr.sin_port);
}

std::string FsdpBinary() { return FSDP_BINARY_PATH; }
std::string SourceDir() { return FSDP_SOURCE_DIR; }

std::string FreshTempDir(const std::string& tag) {
  std::string dir = "/tmp/fsdp-test-" + std::to_string(::getpid()) + "-" + tag;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

}  // namespace fsdp::testing
