// Multi-rank test harness: runs a test body on N ranks, each a separate process (this test
// binary re-executed with a gtest filter naming the current test), talking over Gloo on
// loopback. The parent waits with a per-test timeout; a failing rank fails the test with its
// rank, how it ended and the tail of its output; no rank process outlives the test.
//
//   TEST(DeviceMeshTest, AllReduce) {
//     RunOnRanks(4, [](int rank) {
//       std::shared_ptr<DistContext> ctx = InitDist();   // from the environment we set
//       at::Tensor t = at::full({2}, rank + 1.0);
//       ctx->world().AllReduce(t)->wait();
//       EXPECT_EQ(t[0].item<float>(), 10);
//     });
//   }
//
// A body may call RunOnRanks only once per call site; a test may call it several times.
#pragma once

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "device_mesh/cuda_support.h"
#include "device_mesh/dist_context.h"
#include "launcher/worker_group.h"
#include "tests/gpu_skip.h"

namespace fsdp::testing {

// How the harness tells each rank who it is.
enum class EnvStyle {
  kTorchrunAgent,  // torchrun with the agent store (hosted by the test process)
  kPlain,          // RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT; rank 0 hosts the store
  kSlurm,          // SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID / SLURM_JOB_NODELIST
  kOpenMpi,        // OMPI_COMM_WORLD_*
  kMpich,          // PMI_RANK / PMI_SIZE / MPI_LOCALRANKID / MPI_LOCALNRANKS
};

struct MultiRankOptions {
  std::chrono::seconds timeout{90};
  EnvStyle style = EnvStyle::kTorchrunAgent;
  // Extra variables per rank (applied last; an empty value unsets a variable).
  std::function<std::map<std::string, std::string>(int rank)> rank_env;
};

void RunOnRanks(int world_size, const std::function<void(int rank)>& body,
                const MultiRankOptions& options = {});
// True in a rank process started by RunOnRanks: code after RunOnRanks in a test body runs in
// rank processes too, so checks meant for the parent test process must test this.
bool InRankProcess();

// DistContext from this rank's environment with test-sized timeouts; fails the test (and
// throws to end the body) if the rendezvous fails.
DistOptions TestDistOptions();
std::shared_ptr<DistContext> InitDist(DistOptions options = TestDistOptions());
// The same on the GPU, for `world_size` ranks sharing one: NCCL with one rank, Gloo on CUDA
// tensors with more (NCCL needs a GPU per rank).
std::shared_ptr<DistContext> InitCudaDist(int world_size);

// Runs a command to completion (for launcher and CLI tests): exit, output lines, timeout.
struct CommandResult {
  WorkerExit exit;
  bool timed_out = false;
  std::vector<std::string> stdout_lines;
  std::vector<std::string> stderr_lines;
  std::string Output() const;  // everything, stdout then stderr, for failure messages
  bool StdoutHas(std::string_view text) const;
  bool StderrHas(std::string_view text) const;
};
// The command sees no GPU (CUDA_VISIBLE_DEVICES=-1) unless `env` names CUDA_VISIBLE_DEVICES
// (WithGpus): the suite's end-to-end tests mean the CPU, and with training.device auto they
// would otherwise start 2-4 NCCL ranks on a workstation's one GPU.
CommandResult RunCommand(const std::vector<std::string>& argv,
                         const std::map<std::string, std::string>& env = {},
                         std::chrono::seconds timeout = std::chrono::seconds(60));
// `env` plus this process's CUDA_VISIBLE_DEVICES (none: every GPU), for RunCommand in the tests
// labelled gpu.
std::map<std::string, std::string> WithGpus(std::map<std::string, std::string> env = {});

// A TCP port nobody listens on right now (bind to port 0, read it back, close).
int FreePort();

// Paths of the built executables (set by CMake).
std::string FsdpBinary();
// The source tree the tests were built from (configs/, bench/ live there).
std::string SourceDir();
// An empty folder /tmp/fsdp-test-<pid>-<tag>, whatever an earlier run left there removed.
std::string FreshTempDir(const std::string& tag);

}  // namespace fsdp::testing
