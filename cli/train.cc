#include "cli/train.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <iostream>

#include "common/env.h"
#include "device_mesh/cuda_support.h"
#include "device_mesh/launch_env.h"
#include "engine/config.h"
#include "engine/metrics.h"
#include "engine/trainer.h"
#include "launcher/launch.h"

namespace fsdp {

namespace {

bool ProgressBarWanted(const std::string& setting) {
  return setting == "on" || (setting == "auto" && isatty(STDERR_FILENO));
}

}  // namespace

int RunTrainCommand(const TrainCommand& command, int argc, char** argv) {
  absl::StatusOr<RunConfig> config = LoadRunConfig(command.config_path, command.overrides);
  if (!config.ok()) {
    std::cerr << "fsdp train: " << config.status().message() << "\n";
    return 2;
  }
  absl::StatusOr<LaunchEnv> env = ParseLaunchEnv(ProcessEnv());
  if (!env.ok()) {
    std::cerr << "fsdp train: " << env.status().message() << "\n";
    return 2;
  }
  if (env->source == "single-process") {
    int64_t nproc = config->parallelism.nproc;
    bool cpu = config->training.device == "cpu" ||
               (config->training.device == "auto" && CudaDeviceCount() == 0);
    if (nproc == 0) nproc = cpu ? 2 : CudaDeviceCount();
    if (absl::Status fits = config->ValidateForWorld(static_cast<int>(nproc)); !fits.ok()) {
      std::cerr << "fsdp train: " << fits.message() << " (parallelism.nproc=" << nproc << ")\n";
      return 2;
    }
    if (nproc > 1) {
      // Start the ranks like torchrun --standalone: this same command, once per rank.
      LaunchOptions launch;
      launch.nproc_per_node = static_cast<int>(nproc);
      launch.grace = std::chrono::seconds(120);  // time for a SIGTERM checkpoint
      if (ProgressBarWanted(config->metrics.progress_bar)) {
        // Rank 0's output reaches the terminal through this process: draw the bar here.
        launch.status_line = [steps = config->training.steps, start = std::chrono::steady_clock::now(),
                              last = std::string()](int rank, std::string_view line) mutable {
          int64_t done = 0, total = 0;
          if (rank == 0 && std::sscanf(std::string(line).c_str(), "step %ld/%ld", &done, &total) == 2) {
            double per_step =
                std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / done;
            last = ProgressBar(done, total > 0 ? total : steps, per_step);
          }
          return last;
        };
      }
      launch.program.push_back("/proc/self/exe");
      for (int i = 1; i < argc; ++i) launch.program.push_back(argv[i]);
      return RunLaunch(launch);
    }
  }
  absl::Status status = Train(*config);
  if (!status.ok()) {
    std::cerr << "fsdp train: rank " << env->rank << ": " << status.message() << "\n";
    return status.code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
  }
  return 0;
}

}  // namespace fsdp
