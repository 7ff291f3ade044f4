#include "sharding/collectives.h"

#include <chrono>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/record_function.h>

#include "kernels/accumulate.h"
#include "kernels/cast.h"

namespace fsdp {

using Clock = std::chrono::steady_clock;

void WaitFor(const c10::intrusive_ptr<c10d::Work>& work, CommKind kind, CommStats& stats) {
  RECORD_FUNCTION("fsdp::comm_wait", std::vector<c10::IValue>());  // exposed communication
  auto start = Clock::now();
  work->wait();
  stats.RecordWait(kind, std::chrono::duration<double>(Clock::now() - start).count());
}

int64_t TensorBytes(const at::Tensor& t) { return t.defined() ? t.numel() * t.element_size() : 0; }

// ---- All-gather ------------------------------------------------------------------------------

int64_t Gather::BufferBytes() const {
  // A group of one aliases output to input: count the memory once.
  if (output.defined() && input.defined() && output.is_same(input)) return TensorBytes(input);
  return TensorBytes(input) + TensorBytes(output);
}

at::Tensor CopyInShards(const std::vector<FsdpParam>& params, const UnitLayout& layout,
                        const at::TensorOptions& opts) {
  at::Tensor input = at::empty({layout.chunk_numel}, opts);
  // On CUDA the pieces that change dtype are cast in one multi-tensor launch (kernels/cast.h,
  // bit for bit copy_), not one ATen copy kernel per parameter; the CPU copies as before.
  std::vector<at::Tensor> pieces, shards;
  for (size_t i = 0; i < params.size(); ++i) {
    at::Tensor piece = input.narrow(0, layout.offsets[i], layout.pieces[i]);
    const at::Tensor& shard = params[i].padded_shard;
    if (input.is_cuda() && shard.scalar_type() != input.scalar_type()) {
      pieces.push_back(std::move(piece));
      shards.push_back(shard.view(-1));
    } else {
      piece.copy_(shard.view(-1));
    }
  }
  kernels::CastInto(pieces, shards);
  return input;
}

// See Note [Gathering into the parameters].
Gather GatherIntoParams(std::vector<FsdpParam>& params, const UnitLayout& layout,
                        ProcessGroup& group, c10::ScalarType compute_dtype,
                        const at::TensorOptions& opts, CommStats& stats) {
  Gather gather;
  bool cast = false;
  for (const FsdpParam& p : params) cast |= p.padded_shard.scalar_type() != compute_dtype;
  if (cast) gather.input = CopyInShards(params, layout, opts);
  std::vector<at::Tensor> outputs, inputs;
  int64_t bytes = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    FsdpParam& p = params[i];
    p.AllocateUnsharded();
    outputs.push_back(p.UnshardedFlat());
    inputs.push_back(cast ? gather.input.narrow(0, layout.offsets[i], layout.pieces[i])
                          : p.padded_shard.view(-1));
    bytes += TensorBytes(outputs.back());
  }
  gather.group_size = group.size();
  gather.direct = true;
  gather.work = group.AllGatherPieces(std::move(outputs), std::move(inputs));
  stats.RecordIssue(CommKind::kAllGather, bytes);
  return gather;
}

Gather GatherFlat(at::Tensor input, ProcessGroup& group, CommStats& stats) {
  Gather gather;
  gather.group_size = group.size();
  gather.input = std::move(input);
  if (gather.group_size == 1) {
    gather.output = gather.input;
    return gather;
  }
  gather.output = at::empty({gather.input.numel() * gather.group_size}, gather.input.options());
  gather.work = group.AllGatherInto(gather.output, gather.input);
  stats.RecordIssue(CommKind::kAllGather, TensorBytes(gather.output));
  return gather;
}

void FinishGather(Gather& gather, std::vector<FsdpParam>& params, const UnitLayout& layout,
                  CommStats& stats, DeviceStreams& streams) {
  if (gather.work) WaitFor(gather.work, CommKind::kAllGather, stats);
  if (!gather.direct) {
    // Every parameter's [group_size, piece] column block, copied out in one op: on CUDA one
    // kernel for the whole unit (FSDP2's copy-out), not one strided copy per parameter.
    at::Tensor rows = gather.output.view({gather.group_size, layout.chunk_numel});
    std::vector<at::Tensor> outs;
    outs.reserve(params.size());
    for (size_t i = 0; i < params.size(); ++i) {
      FsdpParam& p = params[i];
      p.AllocateUnsharded();
      outs.push_back(p.UnshardedFlat().view({gather.group_size, layout.pieces[i]}));
    }
    at::split_with_sizes_copy_out(outs, rows, layout.pieces, /*dim=*/1);
    // See Note [Copy-in stream]: the copy-out may still read these on the compute stream.
    streams.Stash({std::move(gather.input), std::move(gather.output)});
  }
  gather = Gather{};
}

// See Note [One shard].
void UnshardOneShard(std::vector<FsdpParam>& params, c10::ScalarType compute_dtype) {
  // On CUDA the unit's casts run as one multi-tensor launch (kernels/cast.h, bit for bit
  // copy_), not one ATen copy kernel per parameter; the CPU copies as before.
  std::vector<at::Tensor> flats, shards;
  for (FsdpParam& p : params) {
    if (p.padded_shard.scalar_type() == compute_dtype) {
      p.AliasShard();
    } else {
      p.AllocateUnsharded();
      if (p.padded_shard.is_cuda()) {
        flats.push_back(p.UnshardedFlat());
        shards.push_back(p.padded_shard.view(-1));
      } else {
        p.UnshardedFlat().copy_(p.padded_shard.view(-1));
      }
    }
  }
  kernels::CastInto(flats, shards);
}

// See Note [Reshard to a sub-group].
at::Tensor CutSubGroupShard(const std::vector<FsdpParam>& params, const UnitLayout& sub_layout,
                            int sub_rank, const at::TensorOptions& opts) {
  const int k = sub_layout.group_size;
  at::Tensor shard = at::empty({sub_layout.chunk_numel}, opts);
  for (size_t i = 0; i < params.size(); ++i) {
    shard.narrow(0, sub_layout.offsets[i], sub_layout.pieces[i])
        .copy_(params[i].UnshardedFlat().view({k, sub_layout.pieces[i]})[sub_rank]);
  }
  return shard;
}

// ---- Reduce-scatter and all-reduce ----------------------------------------------------------

namespace {

// Adds `g` (the shard's shape and dtype) into the sharded parameter's .grad. Without a .grad
// yet, `g` becomes it: as is when the caller owns it and it is a plain contiguous tensor (a
// view cannot be an optimizer's .grad: zero_grad detaches it in place), else a copy.
void AccumulateShardGrad(FsdpParam& p, const at::Tensor& g, bool owned, HostOffload* offload) {
  if (offload != nullptr) {
    offload->AccumulateGrad(p, g, owned);  // See Note [CPU offload]
    return;
  }
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

// Fills `rows` ([n, chunk_numel], Note [Unit flat buffer]) with the unit's gradients as FSDP2
// packs them: one _chunk_cat over the gradients seen as [dim0, row_numel] pads each to a
// multiple of n rows and lays chunk k of every one into row k (on CUDA one kernel for the
// unit, casting bf16 to fp32 as it copies, instead of a padded copy per parameter). That is
// the flat layout when each rank's chunk holds one shard per parameter (n == num_shards: no
// sub-group reshard) and every gradient exists, in one dtype; else returns false and leaves
// `rows` to CopyGradRows.
bool PackGradRows(const std::vector<FsdpParam>& params, const std::vector<int>& grad_params,
                  const UnitLayout& layout, at::Tensor rows) {
  if (layout.shards_per_rank != 1 || grad_params.empty()) return false;
  std::vector<at::Tensor> grads;
  grads.reserve(grad_params.size());
  for (int index : grad_params) {
    const FsdpParam& p = params[index];
    const at::Tensor& grad = p.param.grad();
    if (!grad.defined() || grad.numel() == 0 ||
        (!grads.empty() && grad.scalar_type() != grads[0].scalar_type())) {
      return false;
    }
    grads.push_back(grad.reshape({p.sharding.dim0, p.sharding.row_numel}));
  }
  at::_chunk_cat_out(rows, grads, /*dim=*/0, /*num_chunks=*/layout.group_size);
  return true;
}

}  // namespace

// See Note [Reduce-scattering from the gradients].
Reduce ReduceScatterPieces(std::vector<FsdpParam>& params, const std::vector<int>& grad_params,
                           const UnitLayout& grad_layout, ProcessGroup& group,
                           const at::TensorOptions& opts, CommStats& stats) {
  const int n = group.size();
  const c10::ScalarType reduce_dtype = opts.dtype().toScalarType();
  std::vector<at::Tensor> inputs;
  int64_t bytes = 0;
  for (size_t j = 0; j < grad_params.size(); ++j) {
    FsdpParam& p = params[grad_params[j]];
    const ParamSharding& s = p.sharding;
    at::Tensor& grad = p.param.mutable_grad();
    if (grad.defined() && s.padded_rows() == s.dim0 && grad.scalar_type() == reduce_dtype &&
        grad.is_contiguous()) {
      inputs.push_back(grad.view(-1));
    } else {
      at::Tensor padded = at::empty({n * grad_layout.pieces[j]}, opts);
      CopyGradRows(grad, s, n, padded.view({n, s.rows_per_shard, s.row_numel}));
      inputs.push_back(std::move(padded));
    }
    bytes += TensorBytes(inputs.back());
    grad.reset();  // the collective holds the unsharded gradient until it is done
  }
  Reduce reduce;
  reduce.output = at::empty({grad_layout.chunk_numel}, opts);
  reduce.work = group.ReduceScatterPieces(reduce.output, std::move(inputs));
  stats.RecordIssue(CommKind::kReduceScatter, bytes);
  return reduce;
}

Reduce ReduceScatterFlat(std::vector<FsdpParam>& params, const std::vector<int>& grad_params,
                         const UnitLayout& grad_layout, ProcessGroup& group,
                         const at::TensorOptions& opts, CommStats& stats) {
  const int n = grad_layout.group_size;
  Reduce reduce;
  reduce.input = at::empty({grad_layout.total_numel()}, opts);
  at::Tensor rows = reduce.input.view({n, grad_layout.chunk_numel});
  const bool packed = PackGradRows(params, grad_params, grad_layout, rows);
  for (size_t j = 0; j < grad_params.size(); ++j) {
    FsdpParam& p = params[grad_params[j]];
    const ParamSharding& s = p.sharding;
    at::Tensor& grad = p.param.mutable_grad();
    if (!packed) {
      CopyGradRows(grad, s, n,
                   rows.narrow(1, grad_layout.offsets[j], grad_layout.pieces[j])
                       .view({n, s.rows_per_shard, s.row_numel}));
    }
    grad.reset();  // the unsharded gradient is not needed any more
  }
  if (n == 1) {
    reduce.output = std::move(reduce.input);  // DDP: nothing to scatter
    reduce.input.reset();
    return reduce;
  }
  reduce.output = at::empty({grad_layout.chunk_numel}, opts);
  reduce.work = group.ReduceScatter(reduce.output, reduce.input);
  stats.RecordIssue(CommKind::kReduceScatter, TensorBytes(reduce.input));
  return reduce;
}

// See Note [One shard].
void ReduceOneShard(std::vector<FsdpParam>& params, const std::vector<int>& grad_params,
                    c10::ScalarType reduce_dtype, HostOffload* offload) {
  // On CUDA the in-place additions below wait for the end of the loop and run as one
  // multi-tensor launch (kernels/accumulate.h), bit for bit the same: ATen adds a bf16
  // gradient into an fp32 sum with one unvectorised kernel per parameter. So do the exact
  // conversions of gradients that have no sum yet (kernels/cast.h: ATen converts each with one
  // unvectorised copy kernel); the .grads they become follow the launch, in order.
  std::vector<at::Tensor> sums, grads;
  std::vector<FsdpParam*> summed;
  std::vector<at::Tensor> converted, to_convert;
  std::vector<std::pair<FsdpParam*, at::Tensor>> after_cast;  // AccumulateShardGrad's arguments
  // Moved rather than copied when nothing needs converting.
  for (int index : grad_params) {
    FsdpParam& p = params[index];
    at::Tensor& grad = p.param.mutable_grad();
    // With offload the sum to add into is the one kept on the device, if any (Note [CPU
    // offload]: "Accumulating on the device").
    at::Tensor* dst = offload != nullptr ? offload->DeviceGrad(p) : &p.sharded.mutable_grad();
    // The rounding to reduce_dtype below is exact or none.
    const bool exact = grad.defined() && (reduce_dtype == grad.scalar_type() ||
                                          reduce_dtype == p.sharded.scalar_type());
    if (dst != nullptr && exact && dst->defined()) {
      // Accumulation (the second micro-batch on): the rounding to reduce_dtype is exact or
      // none, so adding the gradient in place, promoted as it is read, gives the values of
      // the casts below without their temporary (a full-size fp32 copy per micro-batch).
      if (grad.is_cuda()) {
        sums.push_back(*dst);
        grads.push_back(grad);
        summed.push_back(&p);  // the rest after the launch, below
        continue;
      }
      dst->add_(grad.reshape(dst->sizes()));
      grad.reset();
      if (offload != nullptr) offload->DeviceGradUpdated(p);
      continue;
    }
    // Offload params: the gradient goes to the host in its own dtype when the rounding below
    // is exact (Note [CPU offload], "params").
    if (offload != nullptr && exact && offload->SendComputeGrad(p, grad)) {
      grad.reset();
      continue;
    }
    at::Tensor g;
    if (exact && grad.is_cuda() && grad.scalar_type() != p.sharded.scalar_type()) {
      // The first micro-batch's conversion, after the loop (with offload the shard is on the
      // host: g stays on the gradient's device, as grad.to(dtype) would).
      g = at::empty(p.sharded.sizes(), grad.options().dtype(p.sharded.scalar_type()));
      converted.push_back(g);
      to_convert.push_back(grad);
    } else {
      g = grad.defined() ? grad.to(reduce_dtype).to(p.sharded.scalar_type())
                         : at::zeros_like(p.sharded);
      if (g.sizes() != p.sharded.sizes()) g = g.reshape(p.sharded.sizes());  // e.g. a 0-dim P
    }
    grad.reset();
    if (converted.empty()) {
      AccumulateShardGrad(p, g, /*owned=*/true, offload);
    } else {
      after_cast.emplace_back(&p, std::move(g));  // the same order, after the cast
    }
  }
  if (!converted.empty()) {
    kernels::CastInto(converted, to_convert);
    to_convert.clear();  // the compute-dtype gradients go back to the allocator
    for (auto& [p, g] : after_cast) AccumulateShardGrad(*p, g, /*owned=*/true, offload);
  }
  if (sums.empty()) return;
  kernels::AccumulateInto(sums, grads);
  for (FsdpParam* p : summed) {
    p->param.mutable_grad().reset();
    if (offload != nullptr) offload->DeviceGradUpdated(*p);  // sends the sum: after the add
  }
}

c10::intrusive_ptr<c10d::Work> AllReduceReplicas(at::Tensor& sums, ProcessGroup& group,
                                                 CommStats& stats) {
  c10::intrusive_ptr<c10d::Work> work = group.AllReduce(sums);
  stats.RecordIssue(CommKind::kAllReduce, TensorBytes(sums));
  return work;
}

void AccumulateShardGrads(std::vector<FsdpParam>& params, const std::vector<int>& grad_params,
                          const UnitLayout& grad_layout, const at::Tensor& grads, int shard_rank,
                          HostOffload* offload) {
  for (size_t j = 0; j < grad_params.size(); ++j) {
    FsdpParam& p = params[grad_params[j]];
    const ParamSharding& s = p.sharding;
    int64_t local = s.LocalRows(shard_rank) * s.row_numel;
    at::Tensor g = grads.narrow(0, grad_layout.offsets[j], local)
                       .view(p.sharded.sizes())
                       .to(p.sharded.scalar_type());
    AccumulateShardGrad(p, g, /*owned=*/false, offload);
  }
}

}  // namespace fsdp
