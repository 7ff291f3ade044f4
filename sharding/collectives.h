// Internal to sharding/: how one FSDP unit's parameters are all-gathered and its gradients
// reduced. FsdpUnit (fsdp_unit.h) decides *when*; these functions are the *how*: which buffers,
// which collective, which copies. Every function that issues a collective records it in
// CommStats (bytes of the full buffer, as the tests compare them with theory) and every wait
// records the time waited.
//
// Cross-rank contract: each issuing function is a collective over the group it is given;
// every rank of that group calls the same function, with the same layout, in the same order.
//
//   // FULL_SHARD forward, shard axis of 4 ranks, Gloo with the p2p collectives (CPU):
//   Gather g = GatherIntoParams(params, layout, group, opts, stats);  // P's storage allocated
//   FinishGather(g, params, layout, stats, streams);                  // wait; P holds the full
//   ...forward...
//   for (FsdpParam& p : params) p.FreeUnsharded();
//   // backward: the gradients of P become this rank's summed gradient shard
//   Reduce r = ReduceScatterPieces(params, grad_params, grad_layout, group, opts, stats);
//   WaitFor(r.work, CommKind::kReduceScatter, stats);
//   AccumulateShardGrads(params, grad_params, grad_layout, r.output.div_(dp), shard_rank,
//                        /*offload=*/nullptr);
//
// Note [Gathering into the parameters]: on CPU with the p2p collectives (device_mesh/
// p2p_collectives.h), the all-gather over the whole shard axis receives each rank's piece of
// each parameter straight into the parameter's storage (which is laid out as the padded shards
// of all ranks in rank order) and sends straight from the padded shards, so there is no
// gather buffer, no copy-in and no copy-out; the unsharded storage is allocated when the
// gather is issued. When the compute dtype differs from the shards' (mixed precision) the
// shards are first cast into the gather input and sent from there.
//
// Note [Reduce-scattering from the gradients]: with the p2p collectives (CPU) the ring reads
// each unsharded gradient where it is; only a gradient with padding rows, in another dtype or
// missing gets a padded copy. There is no flat reduce input: the reduce-scatter holds the
// unsharded gradients themselves until it is done.
//
// Note [One shard]: with a shard axis of size 1 (world size 1, or DDP) there is nothing to
// gather: each parameter's storage points at its shard (no copy, no allocation), or under
// mixed precision receives one cast of it, on the compute stream. With one rank in all there
// is nothing to reduce either: each gradient becomes the shard's gradient.
//
// Note [Reshard to a sub-group]: with reshard_after_forward = k, a unit keeps after forward
// the piece this rank contributes to an all-gather over its sub-group of k consecutive shard
// ranks (cut from the parameters just gathered over the whole shard axis), and its backward
// gathers from that piece over the sub-group only: less traffic, more memory.
#pragma once

#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "device_mesh/process_group.h"
#include "sharding/comm_stats.h"
#include "sharding/fsdp_param.h"
#include "sharding/offload/host_offload.h"
#include "sharding/shard_layout.h"
#include "sharding/streams.h"

namespace fsdp {

// Waits for `work` and records the time in `stats` under `kind`.
void WaitFor(const c10::intrusive_ptr<c10d::Work>& work, CommKind kind, CommStats& stats);

// Bytes of a tensor's elements (0 when undefined).
int64_t TensorBytes(const at::Tensor& t);

// ---- All-gather ------------------------------------------------------------------------------

// An all-gather in flight (or, for a group of one, already done).
struct Gather {
  at::Tensor input;   // 1-D, chunk_numel, compute dtype; undefined on the direct path w/o cast
  at::Tensor output;  // 1-D, group_size x chunk_numel; undefined on the direct path
  int group_size = 1;
  bool direct = false;                  // Note [Gathering into the parameters]
  c10::intrusive_ptr<c10d::Work> work;  // null when nothing was issued

  // Bytes of the gather buffers (the parameters' storage is counted by the caller).
  int64_t BufferBytes() const;
};

// The padded shards of every parameter, cast to `opts`' dtype, as one chunk (1-D,
// layout.chunk_numel): this rank's input to a flat all-gather.
at::Tensor CopyInShards(const std::vector<FsdpParam>& params, const UnitLayout& layout,
                        const at::TensorOptions& opts);

// Note [Gathering into the parameters]. Allocates every parameter's unsharded storage and issues
// the all-gather over `group` (its whole shard axis; group.SupportsPieces must hold).
Gather GatherIntoParams(std::vector<FsdpParam>& params, const UnitLayout& layout,
                        ProcessGroup& group, c10::ScalarType compute_dtype,
                        const at::TensorOptions& opts, CommStats& stats);

// Issues the all-gather of `input` (one chunk) over `group` into a flat output buffer; a group
// of one "gathers" by aliasing.
Gather GatherFlat(at::Tensor input, ProcessGroup& group, CommStats& stats);

// Waits for `gather` and, unless it was direct, copies the flat output out into each
// parameter's (newly allocated) storage using `layout` (the layout of gather.group_size ranks);
// the flat buffers go to `streams`' stash (Note [Copy-in stream]). Leaves `gather` empty.
void FinishGather(Gather& gather, std::vector<FsdpParam>& params, const UnitLayout& layout,
                  CommStats& stats, DeviceStreams& streams);

// Note [One shard]: points (or casts) each parameter's storage at its own shard.
void UnshardOneShard(std::vector<FsdpParam>& params, c10::ScalarType compute_dtype);

// Note [Reshard to a sub-group]: this rank's chunk (1-D, sub_layout.chunk_numel) of the
// sub-group layout, cut from the unsharded parameters. `sub_rank` of `sub_layout.group_size`.
at::Tensor CutSubGroupShard(const std::vector<FsdpParam>& params, const UnitLayout& sub_layout,
                            int sub_rank, const at::TensorOptions& opts);

// ---- Reduce-scatter and all-reduce ----------------------------------------------------------

// A reduce-scatter in flight (or, for one shard, already done).
struct Reduce {
  at::Tensor input;                     // 1-D, num_shards x grad chunk_numel; flat path only
  at::Tensor output;                    // 1-D, grad chunk_numel: this rank's summed gradient chunk
  c10::intrusive_ptr<c10d::Work> work;  // null when nothing was issued
};

// Note [Reduce-scattering from the gradients]. Takes (and resets) the unsharded gradient of
// every trainable parameter (`grad_params`: indices into params) and issues the reduce-scatter
// over `group` (group.SupportsPieces must hold). `opts`: the reduce dtype and device.
Reduce ReduceScatterPieces(std::vector<FsdpParam>& params, const std::vector<int>& grad_params,
                           const UnitLayout& grad_layout, ProcessGroup& group,
                           const at::TensorOptions& opts, CommStats& stats);

// Copies the unsharded gradients into one padded flat buffer (resetting them) and issues the
// reduce-scatter over `group`; with one shard (DDP) the buffer is the output, nothing issued.
Reduce ReduceScatterFlat(std::vector<FsdpParam>& params, const std::vector<int>& grad_params,
                         const UnitLayout& grad_layout, ProcessGroup& group,
                         const at::TensorOptions& opts, CommStats& stats);

// Note [One shard], one rank: each gradient (in `reduce_dtype`, then the shard's dtype, as the
// collective path rounds it) is added into the sharded parameter's .grad; no communication.
// With `offload` the gradient goes to the host master's .grad instead (Note [CPU offload]).
void ReduceOneShard(std::vector<FsdpParam>& params, const std::vector<int>& grad_params,
                    c10::ScalarType reduce_dtype, HostOffload* offload);

// HSDP / DDP: issues the all-reduce (sum) of a gradient chunk over the replicate axis.
c10::intrusive_ptr<c10d::Work> AllReduceReplicas(at::Tensor& sums, ProcessGroup& group,
                                                 CommStats& stats);

// Adds this rank's rows of `grads` (1-D, grad chunk, already averaged) into each trainable
// sharded parameter's .grad (on the host through `offload` when given: Note [CPU offload]).
void AccumulateShardGrads(std::vector<FsdpParam>& params, const std::vector<int>& grad_params,
                          const UnitLayout& grad_layout, const at::Tensor& grads, int shard_rank,
                          HostOffload* offload);

}  // namespace fsdp
