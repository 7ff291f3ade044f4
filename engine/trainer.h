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

absl::Status Train(const RunConfig& config);

}  // namespace fsdp
