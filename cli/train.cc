#include "cli/train.h"

#include <iostream>

#include "common/env.h"
#include "device_mesh/cuda_support.h"
#include "device_mesh/launch_env.h"
#include "engine/config.h"
#include "engine/trainer.h"
#include "launcher/launch.h"

namespace fsdp {

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
