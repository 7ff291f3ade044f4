// Internal to sharding/: one FSDP unit (a module whose parameters move together) as an explicit
// state machine. Users see FsdpModel (fsdp_model.h); this header is for the engine and its
// tests. FsdpUnit says *when* parameters and gradients move; collectives.h says *how*.
//
// Cross-rank contract: every transition that issues a collective (Unshard, PostBackward,
// WaitForReduceScatter with HSDP) is called by every rank of the unit's groups in the same
// order; FsdpModel guarantees it (Note [Rank-identical prefetch] in fsdp_model.h).
//
// Note [Unit lifecycle]
// Two independent state variables, as FSDP2's FSDPParamGroup:
//
// ShardedState: where the parameters are. Each transition is one method that checks the
// from-state; calling it in any other state is an error naming the unit, the state and the
// call (TORCH_CHECK), never a silent no-op: a caller for which "already there" is fine says
// so at the call site (e.g. `if (unit.state() == kSharded) unit.Unshard();`).
//
//   kSharded            --Unshard()-------------> kGathering   (whole shard axis)
//   kSharded            --Unshard()-------------> kUnsharded   (no collective: one shard,
//                                                               Note [One shard]; or a unit
//                                                               without parameters)
//   kShardedPostForward --Unshard()-------------> kGathering   (reshard sub-group)
//   kGathering          --WaitForUnshard()------> kUnsharded
//   kUnsharded          --Reshard()-------------> kSharded
//   kUnsharded          --ReshardAfterForward()-> kShardedPostForward  (sub-group of k ranks)
//   kShardedPostForward --DropPostForwardShard()> kSharded     (no backward will follow)
//
// Buffers alive per state, on top of the padded shards (always alive, never counted), and what
// UnshardedBytes() / MemoryStats count:
//   kSharded              nothing
//   kGathering            every parameter's unsharded storage once issued (direct gather, Note
//                         [Gathering into the parameters]; gather input only for a cast), or
//                         the flat gather input (1-D, chunk) and output (1-D, group x chunk)
//   kUnsharded            every parameter's unsharded storage (padded_numel, compute dtype;
//                         with one shard and no cast it is the shard's own memory, counted)
//   kShardedPostForward   post_forward_shard_ (1-D, chunk of the sub-group layout), counted in
//                         UnshardedBytes but not by HoldsUnsharded (no full parameter is held)
// With parallelism.offload=params the padded shards themselves are on the device only from
// their load (in Unshard, or earlier by prefetch) until the unit leaves kUnsharded (Note [CPU
// offload] in offload/host_offload.h).
//
// TrainingState: where the unit is in the iteration (driven by FsdpModel).
//   kIdle --BeginForward()--> kForward --EndForward()--> kIdle
//   kIdle --BeginPreBackward()--> kPreBackward --PostBackward()--> kPostBackward
//   kIdle --PostBackward()--> kPostBackward   (end of backward: a unit whose output's gradient
//                                               hook never ran, e.g. unused by the loss)
//   any --ResetIteration()--> kIdle            (start of the root's forward, end of backward:
//                                               a forward need not be followed by a backward)
// After PostBackward the unit may hold the reduce-scatter's flat input (1-D, shards x grad
// chunk; none on the p2p path, Note [Reduce-scattering from the gradients]) until
// WaitForReduceScatter, and its output (1-D, grad chunk) until FinishGradients writes each
// sharded parameter's .grad.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "device_mesh/process_group.h"
#include "sharding/collectives.h"
#include "sharding/comm_stats.h"
#include "sharding/fsdp_param.h"
#include "sharding/offload/host_offload.h"
#include "sharding/options.h"
#include "sharding/shard_layout.h"
#include "sharding/streams.h"

namespace torch::nn {
class Module;
}

namespace fsdp {

// What every unit of one model shares.
struct EngineContext {
  ProcessGroup* shard_group = nullptr;          // size num_shards
  ProcessGroup* replicate_group = nullptr;      // null when the replicate degree is 1
  std::shared_ptr<ProcessGroup> reshard_group;  // sub-group for reshard_group_size, or null
  int shard_rank = 0;
  int num_shards = 1;
  int dp_size = 1;  // replicate x shard: gradients are averaged over these ranks
  c10::Device device{c10::kCPU};
  FsdpOptions options;
  CommStats stats;
  bool requires_gradient_sync = true;
  bool requires_all_reduce = true;
  // false: backward leaves the units unsharded (Note [Keeping parameters across micro-batches]
  // in fsdp_model.h).
  bool reshard_after_backward = true;
  // Unshard() calls on units with parameters since wrapping: each is an all-gather, or with one
  // shard under mixed precision a cast of the unit's shards.
  int64_t unshards = 0;
  std::unique_ptr<DeviceStreams> streams;  // copy-in stream on CUDA; no-op on CPU
  std::unique_ptr<HostOffload> offload;    // Note [CPU offload] (offload/); null without
};

class FsdpUnit {
 public:
  // See Note [Unit lifecycle].
  enum class ShardedState { kSharded, kGathering, kUnsharded, kShardedPostForward };
  enum class TrainingState { kIdle, kForward, kPreBackward, kPostBackward };

  FsdpUnit(std::string name, torch::nn::Module* module, std::vector<FsdpParam> params,
           EngineContext* ctx, bool is_root);

  const std::string& name() const { return name_; }
  torch::nn::Module* module() const { return module_; }
  bool is_root() const { return is_root_; }
  ShardedState state() const { return state_; }
  TrainingState training_state() const { return training_state_; }
  std::vector<FsdpParam>& params() { return params_; }
  const std::vector<FsdpParam>& params() const { return params_; }
  int num_trainable() const { return static_cast<int>(grad_params_.size()); }
  // Whether BeginForward ran since the last ResetIteration (Note [Parameters used while sharded]
  // in fsdp_model.h).
  bool forwarded() const { return forwarded_; }
  // Trainable parameters whose gradient has not been accumulated yet in this iteration.
  int pending_grads() const { return pending_grads_; }
  // One trainable parameter got its gradient; returns how many are still pending.
  int CountGradAccumulated() { return --pending_grads_; }
  // Bytes this unit holds beyond its shards right now: unsharded parameters, gather buffers,
  // the post-forward shard (Note [Unit lifecycle]).
  int64_t UnshardedBytes() const;
  // True while any parameter's unsharded storage or a gather buffer is allocated.
  bool HoldsUnsharded() const;

  // ---- ShardedState transitions (each checks its from-state) ----
  // kSharded | kShardedPostForward -> kGathering: issues the all-gather (asynchronously).
  // With nothing to gather (one shard, or no parameters) -> kUnsharded at once.
  void Unshard();
  // kGathering -> kUnsharded: waits for the all-gather and copies it out into the parameters.
  void WaitForUnshard();
  // kUnsharded -> kSharded: frees the unsharded parameters.
  void Reshard();
  // kUnsharded -> kShardedPostForward: keeps this rank's piece for the reshard sub-group (Note
  // [Reshard to a sub-group]) and frees the unsharded parameters.
  void ReshardAfterForward();
  // kShardedPostForward -> kSharded: frees the post-forward shard (no backward will use it).
  void DropPostForwardShard();
  // Offload params (Note [CPU offload]): in kSharded, starts the host->device copy of the
  // shards ahead of the all-gather (prefetch); ReleaseDeviceShards frees them. No-ops otherwise.
  // While the host still steps this unit's masters (Note [Overlapped host step]) it waits for
  // that, or with `wait` false (a prefetch) leaves the copy to the unit's own unshard.
  void LoadDeviceShards(bool wait = true);
  void ReleaseDeviceShards();

  // ---- TrainingState transitions ----
  // Any -> kIdle, every trainable parameter pending again.
  void ResetIteration();
  // kIdle -> kForward.
  void BeginForward();
  // kForward -> kIdle.
  void EndForward();
  // kIdle -> kPreBackward.
  void BeginPreBackward();
  // kIdle | kPreBackward -> kPostBackward; the unit must be kSharded, or kUnsharded when its
  // parameters are kept for the next micro-batch (EngineContext::reshard_after_backward false:
  // Note [Keeping parameters across micro-batches] in fsdp_model.h). With gradient sync,
  // issues the reduce-scatter of the unit's gradients (or, with one rank, writes them).
  void PostBackward();
  // Waits for the reduce-scatter, if one is in flight, and frees its input; starts the
  // replicas' all-reduce (HSDP).
  void WaitForReduceScatter();
  // Waits for all of the unit's gradient communication, averages, and accumulates into each
  // sharded parameter's .grad.
  void FinishGradients();

 private:
  // Fails, naming the unit, its state and `call`, unless state_ is `from` (or `or_from`).
  void CheckState(const char* call, ShardedState from) const;
  void CheckState(const char* call, ShardedState from, ShardedState or_from) const;
  void CheckTraining(const char* call, TrainingState from) const;
  void AfterReduceScatter();

  std::string name_;
  torch::nn::Module* module_;
  std::vector<FsdpParam> params_;
  std::vector<int> grad_params_;  // indices of trainable parameters
  EngineContext* ctx_;
  bool is_root_;
  ShardedState state_ = ShardedState::kSharded;
  TrainingState training_state_ = TrainingState::kIdle;
  bool forwarded_ = false;
  int pending_grads_ = 0;
  c10::ScalarType compute_dtype_;
  c10::ScalarType reduce_dtype_;

  UnitLayout layout_;              // all parameters, whole shard group
  UnitLayout sub_layout_;          // all parameters, reshard sub-group
  UnitLayout grad_layout_;         // trainable parameters, whole shard group
  Gather gather_;                  // kGathering only
  at::Tensor post_forward_shard_;  // 1-D, sub_layout_.chunk_numel; kShardedPostForward only
  Reduce reduce_;                  // from PostBackward until FinishGradients
  c10::intrusive_ptr<c10d::Work> all_reduce_work_;  // all-reduce over the replicate axis
  at::Tensor unreduced_partial_;  // HSDP: reduce-scattered, not yet all-reduced sums
};

const char* StateName(FsdpUnit::ShardedState state);
const char* StateName(FsdpUnit::TrainingState state);

// Brings `unit` to kSharded from whichever state it is in (waiting for a gather in flight,
// dropping a post-forward shard): for the points where no later step of this iteration needs
// the parameters (end of an evaluation forward, end of backward).
void ReshardFully(FsdpUnit& unit);

}  // namespace fsdp
