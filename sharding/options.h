// What the user chooses: a strategy (or the raw options behind it) and mixed precision.
//
// As in PyTorch FSDP2, the strategy follows from the mesh and one option:
//   full_shard          mesh (shard=N),               reshard after forward    (ZeRO-3)
//   shard_grad_op       mesh (shard=N),               keep unsharded until bwd (ZeRO-2)
//   hybrid_shard        mesh (replicate=R, shard=S),  reshard after forward
//   hybrid_shard_zero2  mesh (replicate=R, shard=S),  keep unsharded until bwd
//   no_shard            mesh (replicate=N, shard=1),  DDP
// and reshard_after_forward = k (1 < k < S) keeps the parameters sharded over sub-groups of k
// consecutive shard ranks after forward, so the backward all-gather stays among k ranks.
//
//   absl::StatusOr<Strategy> s = ParseStrategy("hybrid_shard");
//   absl::StatusOr<MeshShape> shape = MeshShapeForStrategy(*s, /*world=*/8, /*replicate=*/2);
//   FsdpOptions options = OptionsForStrategy(*s);
//   options.mixed_precision.param_dtype = at::kBFloat16;
#pragma once

#include <optional>
#include <string>
#include <string_view>

#include <c10/core/ScalarType.h>

#include "absl/status/statusor.h"
#include "sharding/deferred_init.h"
#include "device_mesh/mesh_shape.h"

namespace fsdp {

enum class Strategy { kFullShard, kShardGradOp, kHybridShard, kHybridShardZero2, kNoShard };

absl::StatusOr<Strategy> ParseStrategy(std::string_view name);
const char* StrategyName(Strategy strategy);

struct MixedPrecision {
  // dtype of the unsharded parameters that forward and backward compute with (e.g. bf16);
  // unset: the parameters' own dtype. The sharded parameters stay in their own dtype (fp32).
  std::optional<c10::ScalarType> param_dtype;
  // dtype gradients are reduced in (e.g. fp32); unset: param_dtype.
  std::optional<c10::ScalarType> reduce_dtype;
  // dtype the root unit's output is cast to; unset: left as computed.
  std::optional<c10::ScalarType> output_dtype;
};

// training.activation_checkpointing (Note [Activation checkpointing] in
// sharding/checkpoint_unit.h):
//   none       autograd keeps every unit's activations until its backward;
//   full       a unit keeps only its input; its backward re-runs its forward first;
//   every:k    full, for every k-th non-root unit in forward order (k = 1 is full);
//   selective  as full, but the outputs of the unit's matmuls (fsdp::Linear) are kept and the
//              recompute runs only the cheap ops between them (norms, activations, RoPE,
//              attention's softmax core).
struct ActivationCheckpointing {
  enum class Mode { kNone, kFull, kSelective };
  Mode mode = Mode::kNone;
  int every = 1;  // kFull: checkpoint the units whose forward index % every == every - 1
  bool operator==(const ActivationCheckpointing&) const = default;
  bool enabled() const { return mode != Mode::kNone; }
  // Whether the `index`-th non-root unit (forward order, from 0) is checkpointed.
  bool Applies(int index) const {
    return mode != Mode::kNone && (mode == Mode::kSelective || index % every == every - 1);
  }
};

// parallelism.offload (Note [CPU offload] in sharding/offload/host_offload.h):
//   none       shards, gradients and optimizer state live on the device;
//   optimizer  the fp32 shards' optimizer state and the optimizer step live in host memory
//              (the gradient shards are copied to the host after the reduce-scatter, the
//              updated shards back before the next all-gather);
//   params     the fp32 shards and their gradients also live in host memory: each unit's shard
//              is copied to the device just before its all-gather and its gradient shard back
//              after its reduce-scatter.
enum class Offload { kNone, kOptimizer, kParams };
const char* OffloadName(Offload offload);

// Offload params' compute-dtype copy of each shard on the host (Note [Compute copy] in
// sharding/offload/offload_plan.h): chosen from host memory (kAuto), or forced.
enum class ComputeCopy { kAuto, kKeep, kDrop };

struct FsdpOptions {
  // After a unit's forward: true frees its unsharded parameters (FULL_SHARD); false keeps them
  // until after its backward (SHARD_GRAD_OP). The root unit never reshards after forward.
  bool reshard_after_forward = true;
  // With reshard_after_forward: > 0 keeps shards over sub-groups of this many consecutive shard
  // ranks instead (Note [Reshard to a sub-group]); 0 means the whole shard axis.
  int reshard_group_size = 0;
  MixedPrecision mixed_precision;
  // Most non-root units that may hold (or be gathering) unsharded parameters at once, the
  // current one included: 1 disables prefetching, k gathers up to k - 1 units ahead.
  // See Note [Prefetch limit] in fsdp_model.cc.
  int max_unsharded_units = 2;
  // Broadcast parameters and buffers from rank 0 when wrapping, so that ranks that built their
  // model differently (another seed) still start identical.
  bool sync_module_states = true;
  // Fills this rank's rows of deferred parameters (DeferredTensor: full shape, no memory), so
  // that no rank materialises the whole model. Required when the model has any.
  ParamInitFn param_init;
  ActivationCheckpointing activation_checkpointing;
  Offload offload = Offload::kNone;
  // With offload, the trainer's host optimizer step runs a unit at a time on HostOffload's
  // thread while the next forward starts (Note [Overlapped host step], engine/trainable.cc):
  // the same values, bit for bit; false steps on the training thread before the next forward.
  bool offload_overlap_step = true;
  // With offload and the overlapped step: the host's update of step i may run through step i+1,
  // whose forward and backward use the parameters from before it (one step stale; DeepSpeed's
  // ZeRO-Offload "delayed parameter update"). A change of the arithmetic: the trainer uses it
  // only for the steps the config asks (parallelism.offload_delayed_update); this allocates its
  // second host buffers. See Note [Delayed parameter update] in offload/host_step.h.
  bool offload_delayed_update = false;
  // Offload params with a compute dtype narrower than the shards' (mixed precision): whether
  // the host keeps each padded shard cast to it (host_compute_shard), refreshed after each step,
  // for the loads to copy. Note [Compute copy] in offload/offload_plan.h; a delayed update needs
  // it.
  ComputeCopy offload_compute_copy = ComputeCopy::kAuto;
  // false: a unit's unsharded parameters, once gathered (cast, with one shard) in a training
  // forward, stay until a backward that the caller marks as its step's last
  // (FsdpModel::set_reshard_after_backward): under gradient accumulation every unit is gathered
  // once per step instead of once (shard_grad_op) or twice (full_shard) per micro-batch, at the
  // cost of holding the whole model's unsharded parameters (compute dtype) through the step.
  // See Note [Keeping parameters across micro-batches] in fsdp_model.h.
  bool reshard_between_micro_batches = true;
};

FsdpOptions OptionsForStrategy(Strategy strategy);

// The mesh a strategy needs on `world_size` ranks. `replicate` is the replicate degree for the
// hybrid strategies (-1: infer with shard = ranks per node is not known here, so it is an
// error). kInvalidArgument when the degrees do not fit.
absl::StatusOr<MeshShape> MeshShapeForStrategy(Strategy strategy, int world_size, int replicate,
                                               int shard = -1);

}  // namespace fsdp
