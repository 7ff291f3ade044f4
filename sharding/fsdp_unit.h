// Internal to sharding/: one FSDP unit (a module whose parameters move together) and its
// parameters. Users see FsdpModel (fsdp_model.h); this header is for the engine and its tests.
//
// Note [Unit lifecycle]
//   kSharded --Unshard()--> kGathering --WaitForUnshard()--> kUnsharded
//   kUnsharded --Reshard(after_forward, full)--> kSharded
//   kUnsharded --Reshard(after_forward, sub-group k)--> kShardedPostForward --Unshard()--> ...
// Buffers alive per state (and counted by MemoryStats):
//   kSharded              padded shards (always) only
//   kGathering            + gather_input_ (1-D, chunk) and gather_output_ (1-D, group x chunk)
//                         (direct gather, Note [Gathering into the parameters]: every
//                         parameter's unsharded storage, and gather_input_ only for a cast)
//   kUnsharded            + every parameter's unsharded storage (padded_numel, compute dtype)
//   kShardedPostForward   + post_forward_shard_ (1-D, chunk of the sub-group layout)
// After backward (PostBackward) the unit holds reduce_input_ (1-D, shards x grad chunk) and
// reduce_output_ until FinishGradients writes each sharded parameter's .grad. Note
// [Reduce-scattering from the gradients]: with the p2p collectives (CPU) there is no
// reduce_input_: the reduce-scatter holds the unsharded gradients themselves until it is done.
//
// Note [Gathering into the parameters]: on CPU with the p2p collectives (device_mesh/
// p2p_collectives.h), the all-gather over the whole shard axis receives each rank's piece of
// each parameter straight into the parameter's storage (which is laid out as the padded shards
// of all ranks in rank order) and sends straight from the padded shards, so there is no
// gather buffer, no copy-in and no copy-out; the unsharded storage is allocated when the
// gather is issued. When the compute dtype differs from the shards' (mixed precision) the
// shards are first cast into gather_input_ and sent from there.
//
// Note [Freeing unsharded storage]
// The module keeps its own handle to each parameter tensor (P), and autograd saves P (or views
// of it) for backward. So P's TensorImpl never changes: only the bytes of its StorageImpl are
// released (nbytes 0) after forward and allocated again before backward, and writes into it go
// through an alias tensor with its own version counter, so autograd's saved-tensor version
// check never sees them.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "device_mesh/process_group.h"
#include "sharding/comm_stats.h"
#include "sharding/options.h"
#include "sharding/shard_layout.h"
#include "sharding/streams.h"

namespace torch::nn {
class Module;
}

namespace fsdp {

// What every unit of one model shares.
struct EngineContext {
  ProcessGroup* shard_group = nullptr;      // size num_shards
  ProcessGroup* replicate_group = nullptr;  // null when the replicate degree is 1
  std::shared_ptr<ProcessGroup> reshard_group;  // sub-group for reshard_group_size, or null
  int shard_rank = 0;
  int num_shards = 1;
  int dp_size = 1;  // replicate x shard: gradients are averaged over these ranks
  c10::Device device{c10::kCPU};
  FsdpOptions options;
  CommStats stats;
  bool requires_gradient_sync = true;
  bool requires_all_reduce = true;
  std::unique_ptr<DeviceStreams> streams;  // copy-in stream on CUDA; no-op on CPU
};

struct FsdpParam {
  std::vector<std::string> names;  // every name of this tensor (tied parameters have several)
  at::Tensor param;                // P: the module's tensor; full shape, compute dtype
  ParamSharding sharding;
  at::Tensor padded_shard;  // [rows_per_shard, ...] original dtype; padding rows stay zero
  at::Tensor sharded;       // leaf aliasing padded_shard's real rows: the optimizer's tensor
  bool requires_grad = false;
  c10::ScalarType compute_dtype = c10::kFloat;

  int64_t unsharded_nbytes() const;
  bool unsharded_allocated() const;
  void AllocateUnsharded();
  // P's storage is padded_shard's memory (Note [One shard]: one shard, same dtype).
  void AliasShard();
  void FreeUnsharded();
  // 1-D alias of P's whole (padded) storage in the compute dtype, outside autograd.
  at::Tensor UnshardedFlat() const;
};

class FsdpUnit {
 public:
  enum class State { kSharded, kGathering, kUnsharded, kShardedPostForward };

  FsdpUnit(std::string name, torch::nn::Module* module, std::vector<FsdpParam> params,
           EngineContext* ctx, bool is_root);

  const std::string& name() const { return name_; }
  torch::nn::Module* module() const { return module_; }
  bool is_root() const { return is_root_; }
  State state() const { return state_; }
  std::vector<FsdpParam>& params() { return params_; }
  const std::vector<FsdpParam>& params() const { return params_; }
  int num_trainable() const { return static_cast<int>(grad_params_.size()); }
  // Bytes of unsharded parameters and gather buffers this unit holds right now.
  int64_t UnshardedBytes() const;
  bool HoldsUnsharded() const { return UnshardedBytes() > 0; }

  // Issues the all-gather (asynchronously) unless already unsharded or gathering.
  void Unshard();
  // Waits for the all-gather and copies it out into the parameters' storage.
  void WaitForUnshard();
  // Frees the unsharded parameters; after forward with a sub-group, keeps this rank's piece.
  void Reshard(bool after_forward);
  // After the unit's backward: reshard, and (with gradient sync) reduce-scatter the gradients.
  void PostBackward();
  // Waits for the reduce-scatter and frees its input; starts the replicas' all-reduce (HSDP).
  void WaitForReduceScatter();
  // Waits for all of the unit's gradient communication, averages, and accumulates into each
  // sharded parameter's .grad.
  void FinishGradients();

  // Per-iteration flags, driven by FsdpModel.
  int pending_grads = 0;
  bool backward_prepared = false;
  bool post_backward_done = false;

 private:
  void CopyInShards(at::Tensor& input) const;
  void AfterReduceScatter();
  // Unshard's direct path: see Note [Gathering into the parameters].
  void GatherIntoParams(const at::TensorOptions& opts);
  // Unshard with a shard axis of size 1: see Note [One shard] (fsdp_unit.cc).
  void UnshardOneShard();
  void CopyOut(const at::Tensor& output, const UnitLayout& layout, int group_size);

  std::string name_;
  torch::nn::Module* module_;
  std::vector<FsdpParam> params_;
  std::vector<int> grad_params_;  // indices of trainable parameters
  EngineContext* ctx_;
  bool is_root_;
  State state_ = State::kSharded;
  c10::ScalarType compute_dtype_;
  c10::ScalarType reduce_dtype_;

  UnitLayout layout_;          // all parameters, whole shard group
  UnitLayout sub_layout_;      // all parameters, reshard sub-group
  UnitLayout grad_layout_;     // trainable parameters, whole shard group
  at::Tensor gather_input_;    // 1-D, chunk
  at::Tensor gather_output_;   // 1-D, group_size x chunk
  int gather_group_size_ = 1;
  bool gather_direct_ = false;  // Note [Gathering into the parameters]
  c10::intrusive_ptr<c10d::Work> gather_work_;
  at::Tensor post_forward_shard_;  // 1-D, sub_layout_.chunk_numel
  at::Tensor reduce_input_;        // 1-D, num_shards x grad chunk
  at::Tensor reduce_output_;       // 1-D, grad chunk
  c10::intrusive_ptr<c10d::Work> reduce_work_;      // reduce-scatter over the shard axis
  c10::intrusive_ptr<c10d::Work> all_reduce_work_;  // all-reduce over the replicate axis
  at::Tensor unreduced_partial_;   // HSDP: reduce-scattered, not yet all-reduced sums
};

}  // namespace fsdp
