#include "sharding/fsdp_unit.h"

#include <chrono>

#include <ATen/ATen.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/StorageImpl.h>

namespace fsdp {
namespace {

using Clock = std::chrono::steady_clock;

void Wait(const c10::intrusive_ptr<c10d::Work>& work, CommKind kind, CommStats& stats) {
  auto start = Clock::now();
  work->wait();
  stats.RecordWait(kind, std::chrono::duration<double>(Clock::now() - start).count());
}

int64_t Bytes(const at::Tensor& t) { return t.defined() ? t.numel() * t.element_size() : 0; }

}  // namespace

// ---- FsdpParam -------------------------------------------------------------------------------

int64_t FsdpParam::unsharded_nbytes() const {
  return sharding.padded_numel() * c10::elementSize(compute_dtype);
}

bool FsdpParam::unsharded_allocated() const {
  return param.storage().unsafeGetStorageImpl()->nbytes() > 0;
}

// See Note [Freeing unsharded storage].
void FsdpParam::AllocateUnsharded() {
  c10::StorageImpl* storage = param.storage().unsafeGetStorageImpl();
  if (storage->nbytes() > 0) return;
  size_t nbytes = static_cast<size_t>(unsharded_nbytes());
  storage->set_data_ptr_noswap(storage->allocator()->allocate(nbytes));
  storage->set_nbytes(nbytes);
}

void FsdpParam::AliasShard() {
  c10::StorageImpl* storage = param.storage().unsafeGetStorageImpl();
  // Non-owning: padded_shard lives as long as this FsdpParam.
  storage->set_data_ptr_noswap(c10::DataPtr(padded_shard.data_ptr(), padded_shard.device()));
  storage->set_nbytes(static_cast<size_t>(unsharded_nbytes()));
}

void FsdpParam::FreeUnsharded() {
  c10::StorageImpl* storage = param.storage().unsafeGetStorageImpl();
  storage->set_data_ptr_noswap(c10::DataPtr(nullptr, storage->device()));
  storage->set_nbytes(0);
}

at::Tensor FsdpParam::UnshardedFlat() const {
  // A fresh TensorImpl on P's storage: its own version counter and no autograd meta.
  at::Tensor alias = at::empty({0}, param.options().requires_grad(false));
  alias.set_(param.storage(), 0, {sharding.padded_numel()}, {1});
  return alias;
}

// ---- FsdpUnit --------------------------------------------------------------------------------

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
  compute_dtype_ = params_.empty() ? c10::kFloat : params_[0].compute_dtype;
  const MixedPrecision& mp = ctx_->options.mixed_precision;
  reduce_dtype_ = mp.reduce_dtype.value_or(compute_dtype_);
  layout_ = LayoutUnit(all, ctx_->num_shards);
  if (ctx_->reshard_group) sub_layout_ = LayoutUnit(all, ctx_->reshard_group->size());
  grad_layout_ = LayoutUnit(trainable, ctx_->num_shards);
}

int64_t FsdpUnit::UnshardedBytes() const {
  int64_t bytes = Bytes(gather_input_) + Bytes(gather_output_);
  for (const FsdpParam& p : params_) {
    bytes += static_cast<int64_t>(p.param.storage().unsafeGetStorageImpl()->nbytes());
  }
  return bytes;
}

void FsdpUnit::CopyInShards(at::Tensor& input) const {
  for (size_t i = 0; i < params_.size(); ++i) {
    input.narrow(0, layout_.offsets[i], layout_.pieces[i]).copy_(params_[i].padded_shard.view(-1));
  }
}

void FsdpUnit::CopyOut(const at::Tensor& output, const UnitLayout& layout, int group_size) {
  at::Tensor rows = output.view({group_size, layout.chunk_numel});
  for (size_t i = 0; i < params_.size(); ++i) {
    FsdpParam& p = params_[i];
    p.AllocateUnsharded();
    p.UnshardedFlat()
        .view({group_size, layout.pieces[i]})
        .copy_(rows.narrow(1, layout.offsets[i], layout.pieces[i]));
  }
}

void FsdpUnit::Unshard() {
  if (state_ == State::kUnsharded || state_ == State::kGathering || params_.empty()) return;
  at::NoGradGuard no_grad;
  if (state_ == State::kSharded && ctx_->num_shards == 1) {
    UnshardOneShard();
    return;
  }
  // See Note [Copy-in stream]: on CUDA the copy-in and the all-gather's issue happen on the
  // copy-in stream; on CPU this is all on the caller's thread.
  DeviceStreams& streams = *ctx_->streams;
  streams.BeginCopyIn();
  std::optional<c10::StreamGuard> on_copy_in;
  if (streams.enabled()) on_copy_in.emplace(*streams.copy_in());
  at::TensorOptions opts = at::TensorOptions().dtype(compute_dtype_).device(ctx_->device);
  ProcessGroup* group = ctx_->shard_group;
  if (state_ == State::kSharded && group->size() > 1 && group->SupportsPieces(ctx_->device)) {
    GatherIntoParams(opts);
    return;
  }
  if (state_ == State::kShardedPostForward) {
    group = ctx_->reshard_group.get();
    gather_input_ = std::move(post_forward_shard_);
  } else {
    gather_input_ = at::empty({layout_.chunk_numel}, opts);
    CopyInShards(gather_input_);
  }
  gather_group_size_ = group->size();
  if (gather_group_size_ == 1) {
    gather_output_ = gather_input_;
  } else {
    gather_output_ = at::empty({gather_input_.numel() * gather_group_size_}, opts);
    gather_work_ = group->AllGatherInto(gather_output_, gather_input_);
    ctx_->stats.RecordIssue(CommKind::kAllGather, Bytes(gather_output_));
  }
  state_ = State::kGathering;
}

// Note [One shard]: with a shard axis of size 1 (world size 1, or DDP) there is nothing to
// gather: each parameter's storage points at its shard (no copy, no allocation), or under
// mixed precision receives one cast of it, on the compute stream.
void FsdpUnit::UnshardOneShard() {
  for (FsdpParam& p : params_) {
    if (p.padded_shard.scalar_type() == compute_dtype_) {
      p.AliasShard();
    } else {
      p.AllocateUnsharded();
      p.UnshardedFlat().copy_(p.padded_shard.view(-1));
    }
  }
  state_ = State::kUnsharded;
}

void FsdpUnit::GatherIntoParams(const at::TensorOptions& opts) {
  ProcessGroup* group = ctx_->shard_group;
  bool cast = false;
  for (const FsdpParam& p : params_) cast |= p.padded_shard.scalar_type() != compute_dtype_;
  if (cast) {
    gather_input_ = at::empty({layout_.chunk_numel}, opts);
    CopyInShards(gather_input_);
  }
  std::vector<at::Tensor> outputs, inputs;
  int64_t bytes = 0;
  for (size_t i = 0; i < params_.size(); ++i) {
    FsdpParam& p = params_[i];
    p.AllocateUnsharded();
    outputs.push_back(p.UnshardedFlat());
    inputs.push_back(cast ? gather_input_.narrow(0, layout_.offsets[i], layout_.pieces[i])
                          : p.padded_shard.view(-1));
    bytes += outputs.back().numel() * outputs.back().element_size();
  }
  gather_group_size_ = group->size();
  gather_direct_ = true;
  gather_work_ = group->AllGatherPieces(std::move(outputs), std::move(inputs));
  ctx_->stats.RecordIssue(CommKind::kAllGather, bytes);
  state_ = State::kGathering;
}

void FsdpUnit::WaitForUnshard() {
  if (state_ == State::kUnsharded || params_.empty()) return;
  if (state_ != State::kGathering) Unshard();
  if (state_ == State::kUnsharded) return;  // Note [One shard]: nothing was gathered
  at::NoGradGuard no_grad;
  if (gather_work_) {
    Wait(gather_work_, CommKind::kAllGather, ctx_->stats);
    gather_work_.reset();
  }
  if (gather_direct_) {
    gather_direct_ = false;
    gather_input_.reset();
    state_ = State::kUnsharded;
    return;
  }
  CopyOut(gather_output_, gather_group_size_ == ctx_->num_shards ? layout_ : sub_layout_,
          gather_group_size_);
  ctx_->streams->Stash({std::move(gather_input_), std::move(gather_output_)});
  gather_input_.reset();
  gather_output_.reset();
  state_ = State::kUnsharded;
}

void FsdpUnit::Reshard(bool after_forward) {
  if (state_ == State::kGathering) WaitForUnshard();
  if (state_ != State::kUnsharded) return;
  at::NoGradGuard no_grad;
  state_ = State::kSharded;
  if (after_forward && ctx_->reshard_group) {
    // Note [Reshard to a sub-group]: keep the piece this rank contributes to the sub-group's
    // all-gather in backward, cut from the parameters just gathered over the whole shard axis.
    const int k = ctx_->reshard_group->size();
    const int sub_rank = ctx_->reshard_group->rank();
    post_forward_shard_ = at::empty({sub_layout_.chunk_numel},
                                    at::TensorOptions().dtype(compute_dtype_).device(ctx_->device));
    for (size_t i = 0; i < params_.size(); ++i) {
      post_forward_shard_.narrow(0, sub_layout_.offsets[i], sub_layout_.pieces[i])
          .copy_(params_[i].UnshardedFlat().view({k, sub_layout_.pieces[i]})[sub_rank]);
    }
    state_ = State::kShardedPostForward;
  }
  for (FsdpParam& p : params_) p.FreeUnsharded();
}

namespace {

// Adds `g` (the shard's shape and dtype) into the sharded parameter's .grad. Without a .grad
// yet, `g` becomes it: as is when the caller owns it and it is a plain contiguous tensor (a
// view cannot be an optimizer's .grad: zero_grad detaches it in place), else a copy.
void AccumulateShardGrad(FsdpParam& p, const at::Tensor& g, bool owned) {
  at::Tensor& dst = p.sharded.mutable_grad();
  if (dst.defined()) {
    dst.add_(g);
  } else if (owned && g.is_contiguous() && !g.is_view()) {
    dst = g;
  } else {
    dst = g.clone(at::MemoryFormat::Contiguous);
  }
}

// dst: [shards, rows_per_shard, row_numel]; shard k's rows of the gradient, padding rows zero,
// nothing but zeros for a parameter unused in this forward (undefined grad).
void CopyGradRows(const at::Tensor& grad, const ParamSharding& s, int n, at::Tensor dst) {
  if (!grad.defined()) {
    dst.zero_();
    return;
  }
  at::Tensor g = grad.reshape({s.dim0, s.row_numel});
  if (s.padded_rows() != s.dim0) {
    // Padding rows reduce to zero; real rows are copied shard by shard (dst is strided).
    dst.zero_();
    for (int k = 0; k < n; ++k) {
      int64_t local = s.LocalRows(k);
      if (local > 0) dst[k].narrow(0, 0, local).copy_(g.narrow(0, s.FirstRow(k), local));
    }
  } else {
    dst.copy_(g.view({n, s.rows_per_shard, s.row_numel}));
  }
}

}  // namespace

void FsdpUnit::PostBackward() {
  post_backward_done = true;
  Reshard(/*after_forward=*/false);
  if (!ctx_->requires_gradient_sync || grad_params_.empty()) return;
  at::NoGradGuard no_grad;
  const int n = ctx_->num_shards;
  at::TensorOptions opts = at::TensorOptions().dtype(reduce_dtype_).device(ctx_->device);
  ProcessGroup* group = ctx_->shard_group;
  if (n > 1 && group->SupportsPieces(ctx_->device)) {
    // Note [Reduce-scattering from the gradients]: the ring reads each gradient where it is;
    // only a gradient with padding rows, in another dtype or missing gets a padded copy.
    std::vector<at::Tensor> inputs;
    int64_t bytes = 0;
    for (size_t j = 0; j < grad_params_.size(); ++j) {
      FsdpParam& p = params_[grad_params_[j]];
      const ParamSharding& s = p.sharding;
      at::Tensor& grad = p.param.mutable_grad();
      if (grad.defined() && s.padded_rows() == s.dim0 && grad.scalar_type() == reduce_dtype_ &&
          grad.is_contiguous()) {
        inputs.push_back(grad.view(-1));
      } else {
        at::Tensor padded = at::empty({n * grad_layout_.pieces[j]}, opts);
        CopyGradRows(grad, s, n, padded.view({n, s.rows_per_shard, s.row_numel}));
        inputs.push_back(std::move(padded));
      }
      bytes += inputs.back().numel() * inputs.back().element_size();
      grad.reset();  // the collective holds the unsharded gradient until it is done
    }
    reduce_output_ = at::empty({grad_layout_.chunk_numel}, opts);
    reduce_work_ = group->ReduceScatterPieces(reduce_output_, std::move(inputs));
    ctx_->stats.RecordIssue(CommKind::kReduceScatter, bytes);
    return;
  }
  if (n == 1 && !ctx_->replicate_group) {
    // Note [One shard], one rank: nothing to reduce. Each gradient (in reduce_dtype, then the
    // shard's dtype, as the collective path rounds it) becomes the shard's gradient, moved
    // rather than copied when nothing needs converting.
    for (int index : grad_params_) {
      FsdpParam& p = params_[index];
      at::Tensor& grad = p.param.mutable_grad();
      at::Tensor g = grad.defined() ? grad.to(reduce_dtype_).to(p.sharded.scalar_type())
                                    : at::zeros_like(p.sharded);
      grad.reset();
      if (g.sizes() != p.sharded.sizes()) g = g.reshape(p.sharded.sizes());  // e.g. a 0-dim P
      AccumulateShardGrad(p, g, /*owned=*/true);
    }
    return;
  }
  reduce_input_ = at::empty({grad_layout_.total_numel()}, opts);
  at::Tensor rows = reduce_input_.view({n, grad_layout_.chunk_numel});
  for (size_t j = 0; j < grad_params_.size(); ++j) {
    FsdpParam& p = params_[grad_params_[j]];
    const ParamSharding& s = p.sharding;
    at::Tensor& grad = p.param.mutable_grad();
    CopyGradRows(grad, s, n,
                 rows.narrow(1, grad_layout_.offsets[j], grad_layout_.pieces[j])
                     .view({n, s.rows_per_shard, s.row_numel}));
    grad.reset();  // the unsharded gradient is not needed any more
  }
  if (n == 1) {
    reduce_output_ = std::move(reduce_input_);  // DDP: nothing to scatter
    AfterReduceScatter();
  } else {
    reduce_output_ = at::empty({grad_layout_.chunk_numel}, opts);
    reduce_work_ = group->ReduceScatter(reduce_output_, reduce_input_);
    ctx_->stats.RecordIssue(CommKind::kReduceScatter, Bytes(reduce_input_));
  }
}

void FsdpUnit::AfterReduceScatter() {
  if (!ctx_->replicate_group) return;
  if (unreduced_partial_.defined()) {
    reduce_output_.add_(unreduced_partial_);
    unreduced_partial_.reset();
  }
  if (!ctx_->requires_all_reduce) {
    // HSDP accumulation: keep the sum of this replica's micro-batches for the last one.
    unreduced_partial_ = std::move(reduce_output_);
    reduce_output_.reset();
    return;
  }
  // Issued now, it overlaps the rest of backward (for DDP each unit is one bucket).
  all_reduce_work_ = ctx_->replicate_group->AllReduce(reduce_output_);
  ctx_->stats.RecordIssue(CommKind::kAllReduce, Bytes(reduce_output_));
}

void FsdpUnit::WaitForReduceScatter() {
  if (!reduce_work_) return;
  at::NoGradGuard no_grad;
  Wait(reduce_work_, CommKind::kReduceScatter, ctx_->stats);
  reduce_work_.reset();
  reduce_input_.reset();  // the unit's full-size gradient buffer goes as soon as possible
  AfterReduceScatter();
}

void FsdpUnit::FinishGradients() {
  WaitForReduceScatter();
  if (all_reduce_work_) {
    Wait(all_reduce_work_, CommKind::kAllReduce, ctx_->stats);
    all_reduce_work_.reset();
  }
  if (!reduce_output_.defined()) return;
  at::NoGradGuard no_grad;
  at::Tensor sums = std::move(reduce_output_);
  reduce_output_.reset();
  sums.div_(ctx_->dp_size);
  for (size_t j = 0; j < grad_params_.size(); ++j) {
    FsdpParam& p = params_[grad_params_[j]];
    const ParamSharding& s = p.sharding;
    int64_t local = s.LocalRows(ctx_->shard_rank) * s.row_numel;
    at::Tensor g = sums.narrow(0, grad_layout_.offsets[j], local)
                       .view(p.sharded.sizes())
                       .to(p.sharded.scalar_type());
    AccumulateShardGrad(p, g, /*owned=*/false);
  }
}

}  // namespace fsdp
