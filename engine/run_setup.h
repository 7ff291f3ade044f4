// What `fsdp train` sets up before its first step, in order: the process group and mesh, the
// run folder (rank 0 writes config.yaml and holds its lock), the model from the registry,
// wrapped, and its optimizer, the data, and where training starts (a checkpoint, a safetensors
// file, or step 0).
//
//   FSDP_ASSIGN_OR_RETURN(std::unique_ptr<TrainingRun> run, SetUpRun(config, options));
//   for (int64_t step = run->start_step; step < config.training.steps; ++step) ...
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include <c10/core/Device.h>
#include <torch/optim/optimizer.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "device_mesh/device_mesh.h"
#include "device_mesh/dist_context.h"
#include "engine/checkpointing.h"
#include "engine/config.h"
#include "engine/data.h"
#include "engine/run_lock.h"
#include "engine/trainable.h"
#include "engine/trainer.h"
#include "models/model.h"

namespace fsdp {

// Everything one run holds, created in this order and destroyed in the reverse one (the
// checkpointer refers to the mesh, the model and the optimizer). Held by pointer: it never
// moves.
struct TrainingRun {
  std::shared_ptr<DistContext> ctx;
  std::optional<DeviceMesh> mesh;
  c10::Device device{c10::kCPU};
  std::unique_ptr<RunDirLock> run_lock;  // rank 0's
  std::string attention;                 // model.attention as chosen ("none": no attention)
  std::unique_ptr<Model> model;
  std::unique_ptr<TrainableModel> trained;
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  std::unique_ptr<TokenDataset> dataset;
  std::optional<DataLoader> loader;
  std::optional<Checkpointer> checkpointer;  // the sharded model's; none when unwrapped
  std::optional<ResumePoint> resume;
  int64_t start_step = 0;

  int rank() const { return ctx->rank(); }
  int world() const { return ctx->world_size(); }
  // The checkpoint loaded is at training.steps: nothing left to train.
  bool complete(const RunConfig& config) const {
    return resume.has_value() && start_step == config.training.steps;
  }
};

// The whole setup; every rank learns of an error only rank 0 could see (a bad run.dir, a
// checkpoint folder it cannot write) instead of waiting in the first collective.
absl::StatusOr<std::unique_ptr<TrainingRun>> SetUpRun(const RunConfig& config,
                                                       const TrainOptions& options);

// A data error (a file named by data.path, or a loader that cannot be built from the config)
// is a configuration error (exit 2), not a checkpoint's (kDataLoss's default class), except
// where the file could not be read at all (permissions: io; mmap: internal).
absl::Status AsDataFailure(absl::Status s);

// A save's or load's error, of class checkpoint unless it has a more specific one (a timeout
// waiting for a rank's shard, a write error's I/O class).
absl::Status AsCheckpointFailure(absl::Status s);

}  // namespace fsdp
