// The training run behind `fsdp train`, as one readable mainline:
// rendezvous -> mesh -> model -> shard -> optimizer -> data -> loop (step, log, evaluate).
//
// Collective over all ranks: every rank calls Train with the same configuration (the launcher
// environment tells each which rank it is). Rank 0 prints the resolved configuration and the
// step lines and writes <run.dir>/config.yaml and <run.dir>/metrics.jsonl.
//
//   absl::StatusOr<RunConfig> config = LoadRunConfig("configs/default.yaml", {});
//   absl::Status status = Train(*config);
#pragma once

#include "absl/status/status.h"
#include "engine/config.h"

namespace fsdp {

struct TrainOptions {
  // `fsdp train --quiet`: no start-up summary (the configuration dump is metrics.print_config);
  // errors, warnings, step, eval and checkpoint lines are printed as always.
  bool quiet = false;
};

absl::Status Train(const RunConfig& config, const TrainOptions& options = {});

// kFailedPrecondition when training.device is cuda and no GPU is visible, saying what to set
// to train on the CPU instead (device, and the backend when it is nccl). `fsdp train` and
// `fsdp bench compare` check this before they start ranks or write inputs.
absl::Status CheckDeviceAvailable(const RunConfig& config);

}  // namespace fsdp
