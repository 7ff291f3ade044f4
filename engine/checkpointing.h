// Saving and restoring a training run through checkpoint/: model shards, optimizer state, step
// and data position, written by each rank without gathering (replicas write once), committed
// atomically by rank 0, loadable at any world size, mesh or strategy.
//
// Collective: every rank calls Save / Load at the same step. With async saves Save stages the
// shards in host buffers kept across saves (device tensors: non_blocking copies into pinned
// memory on a side stream, Note [Checkpoint staging]; the loop is blocked only while they are
// issued) and a background thread writes them once the copies are done; the ranks report to rank 0 through the rendezvous store (not the process groups,
// whose collectives must stay in the training loop's order), and rank 0's thread merges the
// manifests, writes metadata.json last and renames the folder into place.
//
//   Checkpointer ckpt(config, ctx, mesh, sharded, optimizer);
//   absl::StatusOr<std::optional<ResumePoint>> resume = ckpt.Load();
//   after each step: FSDP_ASSIGN_OR_RETURN(bool saved, ckpt.MaybeSave(step, last, position));
//   (or by hand: ckpt.Save(step, position) ... ckpt.Finish(), which waits for the last write)
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include <torch/optim/optimizer.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "device_mesh/device_mesh.h"
#include "engine/checkpoint_staging.h"
#include "engine/config.h"
#include "engine/data.h"
#include "sharding/fsdp_model.h"

namespace fsdp {

struct ResumePoint {
  int64_t step = 0;  // steps completed
  DataPosition data;
  std::string dir;   // the checkpoint loaded
};

// The folder a run's checkpoints go to: checkpoint.dir, or <run.dir>/checkpoints when unset.
std::string CheckpointRoot(const RunConfig& config);

class Checkpointer {
 public:
  Checkpointer(const RunConfig& config, std::shared_ptr<DistContext> ctx, const DeviceMesh& mesh,
               FsdpModel& model, torch::optim::Optimizer& optimizer);
  ~Checkpointer();

  // Loads checkpoint.load ("latest": the newest committed in the folder, none: nullopt; a
  // path; empty: nullopt) into the shards and the optimizer. Errors name the file and tensor.
  absl::StatusOr<std::optional<ResumePoint>> Load();
  // Saves the state after `step` completed steps. Returns when the copies to host memory are
  // issued (async: the device's current stream waits for them, the host does not) or when the
  // state is written and committed (sync). A step already saved or being saved by this
  // checkpointer is not saved again: Save waits for it instead (Note [One save per step]).
  absl::Status Save(int64_t step, const DataPosition& data);
  // Allocates the staging buffers every save copies into (Note [Checkpoint staging]) now,
  // shaped after this rank's shards and the optimizer state each trainable one will have
  // (created by the first step when not resumed), so that the first save does not page-lock
  // memory inside the training loop. Returns the bytes allocated; 0 when checkpoints are off,
  // this rank writes no shards (a replica), or nothing needs staging (synchronous saves of
  // host tensors write them in place). Not collective.
  int64_t ReserveStaging();
  int64_t staging_held_pinned_bytes() const { return staging_.held_pinned_bytes(); }
  // Waits for a background save to finish and reports its error.
  absl::Status Finish();
  // The error of a background save that has ended with one, or OK; never waits (a save still
  // writing is left alone). Called every step, so that a failed async save stops the run at
  // the next step rather than at the next save, an interval of training later.
  absl::Status PollBackgroundSave();
  // The cadence (checkpoint.interval): saves after `step` completed steps when the interval
  // divides it, or when `last` (the end of the run, or SIGTERM), which also waits for the write
  // to commit. Rank 0 prints what it did. Returns whether it saved; never saves when
  // checkpoint.enabled is false.
  absl::StatusOr<bool> MaybeSave(int64_t step, bool last, const DataPosition& data);
  // Whether MaybeSave(step, last) would save.
  bool Due(int64_t step, bool last) const;

  // Seconds the last Save kept the caller (the training loop) waiting, and how many of them it
  // waited for the previous save to finish (one save in flight).
  double last_blocking_seconds() const { return last_blocking_seconds_; }
  double last_waiting_seconds() const { return last_waiting_seconds_; }
  // Host bytes the last Save allocated for staging (0 when it reused every buffer), and the
  // bytes the staging holds between saves.
  int64_t last_staging_allocated_bytes() const { return staging_.last_allocated_bytes(); }
  int64_t staging_held_bytes() const { return staging_.held_bytes(); }
  bool enabled() const { return config_.checkpoint.enabled; }
  std::string root() const { return root_; }

 private:
  struct Pending;
  absl::Status WriteAndCommit(const Pending& pending);
  // Whether a save writes `t` as it is rather than from a staging buffer.
  bool WritesInPlace(const at::Tensor& t) const;

  const RunConfig& config_;
  std::shared_ptr<DistContext> ctx_;
  const DeviceMesh& mesh_;
  FsdpModel& model_;
  torch::optim::Optimizer& optimizer_;
  std::string root_;
  bool writes_shards_;  // false on replicas other than replicate coordinate 0
  std::thread worker_;
  int64_t saves_ = 0;                   // Save calls that wrote: the store keys' sequence
  std::optional<int64_t> saved_step_;  // the step of the last of them
  std::shared_ptr<absl::Status> worker_status_;
  // Set by the worker once worker_status_ holds its result.
  std::shared_ptr<std::atomic<bool>> worker_done_;
  double last_blocking_seconds_ = 0;
  double last_waiting_seconds_ = 0;
  // The host buffers saves write from (Note [Checkpoint staging]); ~Checkpointer joins the
  // worker, which waited for the copies into them, before they are freed.
  CheckpointStaging staging_;
};

// "N MiB of [pinned |partly pinned ]host staging": what the start-up reservation and a save's
// allocation print (`pinned_bytes` of the `bytes` page-locked).
std::string StagingLabel(int64_t bytes, int64_t pinned_bytes);

// Fills tensors from a safetensors file (model.init_from): for each target, the rows
// [first_row, first_row + dst.size(0)) of the file's tensor `name`, which must have `shape`.
// Errors name the file and the tensor. A folder is a Hugging Face Llama checkpoint
// (FillFromHfLlama, engine/hf_llama.h: its names, its RoPE layout).
struct InitTarget {
  std::string name;
  std::vector<int64_t> shape;  // the full tensor's
  int64_t first_row = 0;
  at::Tensor dst;
};
absl::Status FillFromSafetensors(const std::string& path, const std::vector<InitTarget>& targets);

// Fills the model's shards from a safetensors file whose tensor names are the model's
// parameter names (model.init_from); each rank reads only its own rows.
absl::Status InitFromSafetensors(const std::string& path, FsdpModel& model);

}  // namespace fsdp
