#include "cli/train.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <thread>

#include <fmt/format.h>

#include "common/env.h"
#include "common/env_knobs.h"
#include "common/failure.h"
#include "common/strings.h"
#include "device_mesh/cuda_support.h"
#include "device_mesh/launch_env.h"
#include "device_mesh/torch_status.h"
#include "engine/config.h"
#include "engine/metrics.h"
#include "engine/train_metrics.h"
#include "engine/trainer.h"
#include "launcher/launch.h"

namespace fsdp {

namespace {

bool ProgressBarWanted(ProgressBarMode mode) {
  return mode == ProgressBarMode::kOn || (mode == ProgressBarMode::kAuto && isatty(STDERR_FILENO));
}

}  // namespace

int RunTrainCommand(const TrainCommand& command, int argc, char** argv) {
  absl::StatusOr<RunConfig> config = LoadRunConfig(command.config_path, command.overrides);
  if (!config.ok()) {
    std::cerr << "fsdp train: " << config.status().message() << "\n";
    return 2;
  }
  // Before nproc 0 (one rank per GPU) could become "world size 0 is not positive".
  if (absl::Status device = CheckDeviceAvailable(*config); !device.ok()) {
    std::cerr << "fsdp train: " << device.message() << "\n";
    return 2;
  }
  absl::StatusOr<LaunchEnv> env = ParseLaunchEnv(ProcessEnv());
  if (!env.ok()) {
    std::cerr << "fsdp train: " << env.status().message() << "\n";
    return 2;
  }
  if (env->source == "single-process") {
    int64_t nproc = config->parallelism.nproc;
    bool cpu = config->training.device == DeviceKind::kCpu ||
               (config->training.device == DeviceKind::kAuto && CudaDeviceCount() == 0);
    if (nproc == 0) nproc = cpu ? 2 : CudaDeviceCount();
    // Each local rank is a process with its own copy of libtorch (and a GPU on CUDA): far more
    // than the node can run is a typo, not a plan, and would fork until memory runs out.
    const int64_t cores = std::max<unsigned>(1, std::thread::hardware_concurrency());
    // Gloo ranks may share a GPU (a one-GPU workstation); NCCL needs one GPU per rank.
    const bool nccl = !cpu && config->parallelism.backend != CudaBackend::kGloo;
    const int64_t limit = nccl ? CudaDeviceCount() : 4 * cores;
    if (nproc > limit && !command.oversubscribe) {
      std::cerr << (nccl ? fmt::format(
                               "fsdp train: parallelism.nproc={} is more ranks than this node's "
                               "{} GPU(s), and NCCL needs one GPU per rank: set "
                               "parallelism.nproc={} or fewer, or parallelism.backend=gloo (ranks "
                               "share the GPUs)\n",
                               nproc, limit, limit)
                         : fmt::format(
                               "fsdp train: parallelism.nproc={} is more local ranks than this "
                               "node can run (4 x {} cores, {} ranks); lower it, or pass "
                               "--oversubscribe\n",
                               nproc, cores, cpu ? "CPU" : "Gloo"));
      return 2;
    }
    if (absl::Status fits = config->ValidateForWorld(static_cast<int>(nproc)); !fits.ok()) {
      std::cerr << "fsdp train: " << fits.message() << " (parallelism.nproc=" << nproc << ")\n";
      return 2;
    }
    if (nproc > 1) {
      // Start the ranks like torchrun --standalone: this same command, once per rank.
      LaunchOptions launch;
      launch.nproc_per_node = static_cast<int>(nproc);
      launch.grace = std::chrono::seconds(120);  // time for a SIGTERM checkpoint
      launch.announce = !command.quiet;
      std::string progress_file;
      if (ProgressBarWanted(config->metrics.progress_bar)) {
        // Rank 0's output reaches the terminal through this process: draw the bar here, from
        // the structured record rank 0 publishes at each log (engine/train_metrics.h).
        progress_file = fmt::format("/tmp/fsdp-progress-{}.json", getpid());
        setenv(std::string(kProgressFile.name).c_str(), progress_file.c_str(), 1);
        launch.status_line = [progress_file, last = std::string()](int rank, std::string_view) mutable {
          if (rank != 0) return last;
          absl::StatusOr<StepRecord> record = ReadProgressFile(progress_file);
          if (record.ok() && record->step > 0) {
            last = ProgressBar(record->step, record->total_steps,
                               record->elapsed_s / static_cast<double>(record->step));
          }
          return last;
        };
      }
      launch.program.push_back("/proc/self/exe");
      for (int i = 1; i < argc; ++i) launch.program.push_back(argv[i]);
      int code = RunLaunch(launch);
      if (!progress_file.empty()) std::remove(progress_file.c_str());
      return code;
    }
  }
  // Every failure of a rank ends here as one line and its class's exit code (Note [Exit
  // codes]); an exception from below (a backend error libtorch threw through autograd) too.
  absl::Status status;
  try {
    status = Train(*config, {.quiet = command.quiet});
  } catch (const std::exception& e) {
    status = StatusFromException("a collective or tensor operation failed", e);
  }
  if (!status.ok()) {
    const FailureClass failure = ClassifyFailure(status);
    if (failure == FailureClass::kOutOfMemory) {
      status = absl::Status(
          status.code(),
          StrCat(std::string(status.message()), " (`fsdp plan ", command.config_path,
                 "` with the same --set options predicts each rank's peak: lower "
                 "training.micro_batch_size, turn on training.activation_checkpointing or "
                 "parallelism.offload, or use more ranks)"));
    }
    std::cout.flush();
    // _Exit: no exit-time destructors racing a thread left blocked (Note [Rendezvous deadline]).
    FailAndExit(env->rank, failure, StrCat(FailureClassName(failure), ": ", std::string(status.message())));
  }
  return 0;
}

}  // namespace fsdp
