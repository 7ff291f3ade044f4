#include "sharding/fsdp_unit.h"

#include <optional>

#include <ATen/ATen.h>
#include <c10/core/StorageImpl.h>
#include <c10/core/StreamGuard.h>

#include "device_mesh/watchdog.h"

namespace fsdp {

// Names in enum order.
const char* StateName(FsdpUnit::ShardedState state) {
  static constexpr const char* kNames[] = {"kSharded", "kGathering", "kUnsharded",
                                           "kShardedPostForward"};
  return kNames[static_cast<int>(state)];
}

const char* StateName(FsdpUnit::TrainingState state) {
  static constexpr const char* kNames[] = {"kIdle", "kForward", "kPreBackward", "kPostBackward"};
  return kNames[static_cast<int>(state)];
}

FsdpUnit::FsdpUnit(std::string name, torch::nn::Module* module, std::vector<FsdpParam> params,
                   EngineContext* ctx, bool is_root)
    : name_(std::move(name)),
      module_(module),
      params_(std::move(params)),
      ctx_(ctx),
      is_root_(is_root) {
  std::vector<ParamSharding> all, trainable;
  for (size_t i = 0; i < params_.size(); ++i) {
    all.push_back(params_[i].sharding);
    if (params_[i].requires_grad) {
      grad_params_.push_back(static_cast<int>(i));
      trainable.push_back(params_[i].sharding);
    }
  }
  pending_grads_ = num_trainable();
  compute_dtype_ = params_.empty() ? c10::kFloat : params_[0].compute_dtype;
  const MixedPrecision& mp = ctx_->options.mixed_precision;
  reduce_dtype_ = mp.reduce_dtype.value_or(compute_dtype_);
  layout_ = LayoutUnit(all, ctx_->num_shards);
  if (ctx_->reshard_group) sub_layout_ = LayoutUnit(all, ctx_->reshard_group->size());
  grad_layout_ = LayoutUnit(trainable, ctx_->num_shards);
}

void FsdpUnit::CheckState(const char* call, ShardedState from) const {
  TORCH_CHECK(state_ == from, "FSDP unit '", name_, "': ", call, " called in state ",
              StateName(state_), " (needs ", StateName(from), ")");
}

void FsdpUnit::CheckState(const char* call, ShardedState from, ShardedState or_from) const {
  TORCH_CHECK(state_ == from || state_ == or_from, "FSDP unit '", name_, "': ", call,
              " called in state ", StateName(state_), " (needs ", StateName(from), " or ",
              StateName(or_from), ")");
}

void FsdpUnit::CheckTraining(const char* call, TrainingState from) const {
  TORCH_CHECK(training_state_ == from, "FSDP unit '", name_, "': ", call,
              " called in training state ", StateName(training_state_), " (needs ", StateName(from),
              ")");
}

int64_t FsdpUnit::UnshardedBytes() const {
  int64_t bytes = gather_.BufferBytes() + TensorBytes(post_forward_shard_);
  for (const FsdpParam& p : params_) {
    bytes += static_cast<int64_t>(p.param.storage().unsafeGetStorageImpl()->nbytes());
  }
  return bytes;
}

bool FsdpUnit::HoldsUnsharded() const {
  if (gather_.BufferBytes() > 0) return true;
  for (const FsdpParam& p : params_) {
    if (p.unsharded_allocated()) return true;
  }
  return false;
}

// ---- ShardedState transitions ------------------------------------------------------------------

void FsdpUnit::Unshard() {
  CheckState("Unshard", ShardedState::kSharded, ShardedState::kShardedPostForward);
  CollectiveTag tag(name_);  // names the unit of a hung collective (device_mesh/watchdog.h)
  at::NoGradGuard no_grad;
  if (params_.empty()) {
    state_ = ShardedState::kUnsharded;  // nothing to gather
    return;
  }
  ++ctx_->unshards;
  if (ctx_->num_shards == 1) {
    // See Note [One shard]: no collective, so no kGathering either.
    if (ctx_->offload) {
      // See Note [Copy-in stream]: no all-gather calls BeginCopyIn here, so this does. It
      // frees the device shards that earlier reshards stashed (with kParams, every unit's
      // would otherwise stay allocated until the end of backward); a no-op on CPU.
      ctx_->streams->BeginCopyIn();
      LoadDeviceShards();  // See Note [CPU offload]: in the compute dtype, aliased as is
      ctx_->offload->WaitForShardsOnCurrentStream();
    }
    UnshardOneShard(params_, compute_dtype_);
    state_ = ShardedState::kUnsharded;
    return;
  }
  // See Note [Copy-in stream]: on CUDA the copy-in and the all-gather's issue happen on the
  // copy-in stream; on CPU this is all on the caller's thread.
  DeviceStreams& streams = *ctx_->streams;
  streams.BeginCopyIn();
  std::optional<c10::StreamGuard> on_copy_in;
  if (streams.enabled()) on_copy_in.emplace(*streams.copy_in());
  at::TensorOptions opts = at::TensorOptions().dtype(compute_dtype_).device(ctx_->device);
  ProcessGroup& shard_group = *ctx_->shard_group;
  if (state_ == ShardedState::kShardedPostForward) {
    // See Note [Reshard to a sub-group]: gather the kept pieces over the sub-group only.
    gather_ = GatherFlat(std::move(post_forward_shard_), *ctx_->reshard_group, ctx_->stats);
    post_forward_shard_.reset();
  } else {
    // See Note [CPU offload]: with offloaded shards their copy precedes the gather here (in
    // the compute dtype when the host keeps a copy in it: then the gather's input as is).
    if (ctx_->offload) ctx_->offload->LoadShards(params_);
    if (shard_group.SupportsPieces(ctx_->device)) {
      // See Note [Gathering into the parameters].
      gather_ = GatherIntoParams(params_, layout_, shard_group, compute_dtype_, opts, ctx_->stats);
    } else {
      gather_ = GatherFlat(CopyInShards(params_, layout_, opts), shard_group, ctx_->stats);
    }
  }
  state_ = ShardedState::kGathering;
}

void FsdpUnit::WaitForUnshard() {
  CheckState("WaitForUnshard", ShardedState::kGathering);
  at::NoGradGuard no_grad;
  const UnitLayout& layout = gather_.group_size == ctx_->num_shards ? layout_ : sub_layout_;
  FinishGather(gather_, params_, layout, ctx_->stats, *ctx_->streams);
  state_ = ShardedState::kUnsharded;
}

void FsdpUnit::Reshard() {
  CheckState("Reshard", ShardedState::kUnsharded);
  for (FsdpParam& p : params_) p.FreeUnsharded();
  ReleaseDeviceShards();
  state_ = ShardedState::kSharded;
}

void FsdpUnit::ReshardAfterForward() {
  CheckState("ReshardAfterForward", ShardedState::kUnsharded);
  TORCH_INTERNAL_ASSERT(ctx_->reshard_group, "unit '", name_, "': no reshard sub-group");
  at::NoGradGuard no_grad;
  // See Note [Reshard to a sub-group].
  post_forward_shard_ =
      CutSubGroupShard(params_, sub_layout_, ctx_->reshard_group->rank(),
                       at::TensorOptions().dtype(compute_dtype_).device(ctx_->device));
  for (FsdpParam& p : params_) p.FreeUnsharded();
  ReleaseDeviceShards();
  state_ = ShardedState::kShardedPostForward;
}

void FsdpUnit::DropPostForwardShard() {
  CheckState("DropPostForwardShard", ShardedState::kShardedPostForward);
  post_forward_shard_.reset();
  state_ = ShardedState::kSharded;
}

void FsdpUnit::LoadDeviceShards(bool wait) {
  if (!ctx_->offload || state_ != ShardedState::kSharded) return;
  DeviceStreams& streams = *ctx_->streams;
  std::optional<c10::StreamGuard> on_copy_in;
  if (streams.enabled()) on_copy_in.emplace(*streams.copy_in());
  ctx_->offload->LoadShards(params_, wait);
}

void FsdpUnit::ReleaseDeviceShards() {
  if (ctx_->offload) ctx_->offload->ReleaseShards(params_, *ctx_->streams);
}

void ReshardFully(FsdpUnit& unit) {
  using S = FsdpUnit::ShardedState;
  switch (unit.state()) {
    case S::kSharded:
      unit.ReleaseDeviceShards();  // loaded ahead for an all-gather that will not come
      return;
    case S::kGathering:
      unit.WaitForUnshard();
      unit.Reshard();
      return;
    case S::kUnsharded:
      unit.Reshard();
      return;
    case S::kShardedPostForward:
      unit.DropPostForwardShard();
      return;
  }
}

// ---- TrainingState transitions -----------------------------------------------------------------

void FsdpUnit::ResetIteration() {
  training_state_ = TrainingState::kIdle;
  forwarded_ = false;
  pending_grads_ = num_trainable();
}

void FsdpUnit::BeginForward() {
  CheckTraining("BeginForward", TrainingState::kIdle);
  training_state_ = TrainingState::kForward;
  forwarded_ = true;
}

void FsdpUnit::EndForward() {
  CheckTraining("EndForward", TrainingState::kForward);
  training_state_ = TrainingState::kIdle;
}

void FsdpUnit::BeginPreBackward() {
  CheckTraining("BeginPreBackward", TrainingState::kIdle);
  training_state_ = TrainingState::kPreBackward;
}

void FsdpUnit::PostBackward() {
  TORCH_CHECK(
      training_state_ == TrainingState::kIdle || training_state_ == TrainingState::kPreBackward,
      "FSDP unit '", name_, "': PostBackward called in training state ", StateName(training_state_),
      " (needs kIdle or kPreBackward)");
  if (ctx_->reshard_after_backward) {
    CheckState("PostBackward", ShardedState::kSharded);
  } else {
    CheckState("PostBackward", ShardedState::kSharded, ShardedState::kUnsharded);
  }
  training_state_ = TrainingState::kPostBackward;
  if (!ctx_->requires_gradient_sync || grad_params_.empty()) return;
  CollectiveTag tag(name_);
  at::NoGradGuard no_grad;
  const int n = ctx_->num_shards;
  at::TensorOptions opts = at::TensorOptions().dtype(reduce_dtype_).device(ctx_->device);
  ProcessGroup& group = *ctx_->shard_group;
  if (n > 1 && group.SupportsPieces(ctx_->device)) {
    // See Note [Reduce-scattering from the gradients].
    reduce_ = ReduceScatterPieces(params_, grad_params_, grad_layout_, group, opts, ctx_->stats);
    return;
  }
  if (n == 1 && !ctx_->replicate_group) {
    ReduceOneShard(params_, grad_params_, reduce_dtype_, ctx_->offload.get());  // Note [One shard]
    return;
  }
  reduce_ = ReduceScatterFlat(params_, grad_params_, grad_layout_, group, opts, ctx_->stats);
  if (n == 1) AfterReduceScatter();  // DDP: the flat buffer is the sum already
}

void FsdpUnit::AfterReduceScatter() {
  if (!ctx_->replicate_group) return;
  CollectiveTag tag(name_);
  if (unreduced_partial_.defined()) {
    reduce_.output.add_(unreduced_partial_);
    unreduced_partial_.reset();
  }
  if (!ctx_->requires_all_reduce) {
    // HSDP accumulation: keep the sum of this replica's micro-batches for the last one.
    unreduced_partial_ = std::move(reduce_.output);
    reduce_.output.reset();
    return;
  }
  // Issued now, it overlaps the rest of backward (for DDP each unit is one bucket).
  all_reduce_work_ = AllReduceReplicas(reduce_.output, *ctx_->replicate_group, ctx_->stats);
}

void FsdpUnit::WaitForReduceScatter() {
  if (!reduce_.work) return;  // none in flight (already waited for, or nothing issued)
  at::NoGradGuard no_grad;
  WaitFor(reduce_.work, CommKind::kReduceScatter, ctx_->stats);
  reduce_.work.reset();
  reduce_.input.reset();  // the unit's full-size gradient buffer goes as soon as possible
  AfterReduceScatter();
}

void FsdpUnit::FinishGradients() {
  WaitForReduceScatter();
  if (all_reduce_work_) {
    WaitFor(all_reduce_work_, CommKind::kAllReduce, ctx_->stats);
    all_reduce_work_.reset();
  }
  if (!reduce_.output.defined()) return;  // nothing reduced in this backward
  at::NoGradGuard no_grad;
  at::Tensor sums = std::move(reduce_.output);
  reduce_ = Reduce{};
  sums.div_(ctx_->dp_size);
  AccumulateShardGrads(params_, grad_params_, grad_layout_, sums, ctx_->shard_rank,
                       ctx_->offload.get());
}

}  // namespace fsdp
