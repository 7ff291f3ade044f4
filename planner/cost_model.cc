#include "planner/cost_model.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "common/status.h"
#include "common/strings.h"
#include "sharding/options.h"

namespace fsdp::plan {
namespace {

// Bytes the elementwise (non-matmul) ops move per activation byte kept: written in forward,
// read in backward, its gradient written and read. Used for the memory-bound share of compute.
constexpr double kActivationTrafficPasses = 4;
// Bytes per parameter (of the local shard) the optimizer step moves: libtorch's AdamW is
// unfused, about eight elementwise passes over 4-byte tensors, plus clipping's read of the
// gradient and FinishGradients' copy.
constexpr double kOptimizerBytesPerParam = 64;
// The same on the host with offload (Note [Offload]): ATen's fused CPU AdamW reads the fp32
// parameter, gradient and both moments and writes three of them back (28 bytes), clipping
// reads the gradient (4).
constexpr double kHostOptimizerBytesPerParam = 32;
// Bytes a recomputed activation byte moves (written again, its inputs read again).
constexpr double kRecomputeTrafficPasses = 2;
// Usable share of host memory for pinned offload buffers: the OS, the page cache and the
// data loader keep the rest.
constexpr double kUsableHostFraction = 0.8;

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Padded numel of a unit sharded n ways (Note [Dim-0 sharding with padding]).
int64_t PaddedNumel(const std::vector<std::pair<int64_t, int64_t>>& shapes, int n) {
  int64_t total = 0;
  for (const auto& [rows, row_numel] : shapes) total += CeilDiv(rows, n) * n * row_numel;
  return total;
}

// Note [Collective time]
// Ring collectives over a group of n ranks, m of them on each of k = n / m nodes. Bus bandwidth
// (nccl-tests' definition, so a measured busbw plugs in directly): the NVLink figure inside a
// node; across nodes each of the m ranks drives its own NIC, so min(intra, m x inter). Latency:
// one step per ring hop, (m - 1) inside and (k - 1) across nodes.
//   all-gather, reduce-scatter: lat + (n-1)/n x buffer / busbw
//   all-reduce:                 2 lat + 2 (n-1)/n x buffer / busbw
struct Group {
  int n = 1, per_node = 1;
  double busbw = 0, latency = 0;
  double Ring(double buffer_bytes) const {
    if (n <= 1) return 0;
    return latency + (n - 1.0) / n * buffer_bytes / busbw;
  }
  double AllReduce(double buffer_bytes) const {
    if (n <= 1) return 0;
    return 2 * latency + 2 * (n - 1.0) / n * buffer_bytes / busbw;
  }
};

Group MakeGroup(int n, int per_node, const Hardware& hw) {
  Group g;
  g.n = n;
  g.per_node = std::max(1, per_node);
  int nodes = std::max(1, n / g.per_node);
  g.busbw = nodes == 1 ? hw.intra_node_bw : std::min(hw.intra_node_bw, g.per_node * hw.inter_node_bw);
  g.latency = (g.per_node - 1) * hw.intra_node_latency_s + (nodes - 1) * hw.inter_node_latency_s;
  return g;
}

bool IsHybrid(Strategy s) { return s == Strategy::kHybridShard || s == Strategy::kHybridShardZero2; }
bool ReshardsAfterForward(Strategy s) { return OptionsForStrategy(s).reshard_after_forward; }

double OptimizerStateBytesPerParam(const OptimizerSection& o) {
  if (o.kind == OptimizerKind::kSgd) return o.momentum != 0 ? 4 : 0;
  return 8;  // adam, adamw: two fp32 moments
}

// Note [Checkpointed activations]
// Per micro-batch and token, block i keeps kept(i): everything (BlockActivationBytes::none)
// when it is not checkpointed, its input (full, every:k) or its input and matmul outputs
// (selective) when it is (ActivationCheckpointing::Applies). Two moments compete for the peak:
//   start of backward: sum_i kept(i) + the head's activations (logits, fp32 loss copies and
//     their gradients, freed once the head's backward is done);
//   recompute of a checkpointed block j (its backward, blocks after j already freed):
//     sum_{i <= j} kept(i) + none, one block's whole set materialised again. kept(j) and the
//     recomputed set overlap (selective keeps q, k, v, w1, w3 outputs that `none` holds too):
//     counting both errs on the safe side by one block's matmul outputs.
// Recompute per micro-batch: full re-runs each checkpointed block's forward (a third of its
// training FLOPs); selective re-runs the attention core's forward (a third of
// block_attention_flops_per_token) and the elementwise ops, no projection.
struct Activations {
  double peak = 0;            // bytes per token alive at the peak
  double none_total = 0;      // bytes per token without checkpointing (the traffic model)
  double recompute_flops = 0;  // per token
  double recompute_bytes = 0;  // per token materialised again
};

Activations CheckpointedActivations(const ModelArgs& model, const ModelFamily& family,
                                    const ModelCounts& counts, const ActivationCheckpointing& ac,
                                    int num_blocks, double cb) {
  const BlockActivationBytes block = family.block_activation_bytes(model, cb);
  const double head = family.head_bytes_per_token(model, cb);
  Activations a;
  a.none_total = num_blocks * block.none + head;
  double kept_before = 0, recompute_peak = 0;
  for (int i = 0; i < num_blocks; ++i) {
    double kept = block.none;
    if (ac.Applies(i)) {
      const bool selective = ac.mode == ActivationCheckpointing::Mode::kSelective;
      kept = selective ? block.selective : block.full;
      recompute_peak = std::max(recompute_peak, kept_before + kept + block.none);
      a.recompute_flops += selective ? counts.block_attention_flops_per_token / 3
                                     : counts.block_flops_per_token / 3;
      a.recompute_bytes += std::max(0.0, block.none - kept);
    }
    kept_before += kept;
  }
  a.peak = std::max(kept_before + head, recompute_peak);
  return a;
}

}  // namespace

std::string CheckpointingName(const ActivationCheckpointing& ac) {
  switch (ac.mode) {
    case ActivationCheckpointing::Mode::kNone: return "none";
    case ActivationCheckpointing::Mode::kSelective: return "selective";
    case ActivationCheckpointing::Mode::kFull: break;
  }
  return ac.every == 1 ? std::string("full") : StrCat("every:", ac.every);
}

ModelCounts CountModel(const ModelArgs& model) {
  const ModelFamily* family = FindModelFamily(model.arch);
  TORCH_CHECK(family != nullptr, "unknown model.arch '", model.arch, "'");
  return family->count(model);
}

double ZeroModelStateBytes(int64_t params, Strategy strategy, int replicate, int shard) {
  const double p = static_cast<double>(params);
  if (strategy == Strategy::kNoShard) return 16 * p;
  if (strategy == Strategy::kShardGradOp) return 4 * p + 12 * p / shard;
  return 16 * p / shard;  // full_shard (shard = N), hybrid (shard = S)
}

double TheoryWireBytesPerStep(int64_t params, int bytes_per_element, Strategy strategy,
                              int replicate, int shard, int grad_accum_steps) {
  const double buffer = static_cast<double>(params) * bytes_per_element;
  const double k = grad_accum_steps;
  if (strategy == Strategy::kNoShard) {
    const double n = static_cast<double>(replicate) * shard;
    return k * 2 * (n - 1) / n * buffer;
  }
  const double s = shard, r = replicate;
  const double gathers = ReshardsAfterForward(strategy) ? 2 : 1;
  double bytes = k * (gathers + 1) * (s - 1) / s * buffer;      // all-gathers + reduce-scatter
  if (r > 1) bytes += 2 * (r - 1) / r * buffer / s;             // HSDP: once per step
  return bytes;
}

// Note [Peak memory phases]
// Per rank, always alive: the padded fp32 parameter shards and the optimizer state (after the
// first step). On top, the larger of two phases:
//   start of backward: every activation of the micro-batch (Note [Activation bytes]), the root
//     unit unsharded and its gradient (the head's gradient is computed first and kept until the
//     root's reduce-scatter at the very end), the blocks unsharded at once (max_unsharded_units
//     with reshard after forward, all of them without: ZeRO-2, DDP), the gradient of the block
//     in backward and one reduce buffer; the fp32 gradient shards when accumulating (they live
//     across micro-batches), and HSDP's unreduced partial sums;
//   end of backward: the gradient shards, with one unit's reduced buffer still to be copied.
// MemoryBreakdown::total is this peak; grads is shown even when (one micro-batch) the gradient
// shards are not alive at the peak, so the components may add up to more than the total.
// Activations with checkpointing: Note [Checkpointed activations]; what offload moves off the
// device: Note [Offload].
//
// Note [Offload]
// parallelism.offload (sharding/options.h), per rank with S the shard degree:
//   optimizer: the optimizer state, an fp32 master copy and its gradient live in pinned host
//     memory (16 P / S with AdamW); the device keeps the fp32 parameter shard (the all-gathers'
//     source) and a transient gradient shard: each reduced shard is copied to the host after
//     its reduce-scatter (every micro-batch: the host accumulates; HSDP after the replicate
//     all-reduce of the last one), the step runs on the host, and each updated shard is copied
//     back before the unit's next all-gather;
//   params: the shards live only on the host too; each unit's shard is copied to the device
//     just before each of its all-gathers (one unit ahead, as the gathers are prefetched) and
//     freed after it, so the device holds the shards of the units in flight only.
// Host memory is per node, shared by its ranks; on a CPU profile device and host are one pool,
// so offload there saves nothing. Time: every copy at host_link_bw per direction (the two
// directions overlap); a unit's copy hides behind the previous unit's compute like a prefetched
// all-gather (exposed: the first unit's, and what a copy takes beyond its unit's compute); the
// host step at kHostOptimizerBytesPerParam per parameter over the node's host memory bandwidth
// shared by its ranks, not overlapped (the next forward needs its result).
absl::StatusOr<Prediction> Predict(const PlanRequest& request, const Layout& layout) {
  const RunConfig& config = request.config;
  const Hardware& hw = request.hw;
  const int world = request.world_size;
  const int per_node = request.gpus_per_node;
  if (world < 1 || per_node < 1 || world % per_node != 0) {
    return absl::InvalidArgumentError(StrCat("--world-size ", world,
                                             " is not a multiple of --gpus-per-node ", per_node));
  }
  const int r = layout.replicate, s = layout.shard;
  if (r < 1 || s < 1 || r * s != world) {
    return absl::InvalidArgumentError(StrCat("layout ", StrategyName(layout.strategy), " ", r, "x", s,
                                             " does not multiply to the world size ", world));
  }
  const bool hybrid = IsHybrid(layout.strategy);
  if ((layout.strategy == Strategy::kNoShard && s != 1) ||
      ((layout.strategy == Strategy::kFullShard || layout.strategy == Strategy::kShardGradOp) &&
       r != 1) ||
      (hybrid && r < 2)) {
    return absl::InvalidArgumentError(StrCat("layout ", r, "x", s, " does not fit strategy '",
                                             StrategyName(layout.strategy), "'"));
  }
  // The engine's options for this layout, from the one mapping the trainer uses (so a
  // reshard_after_forward override is planned as it will run).
  FSDP_ASSIGN_OR_RETURN(const ShardingPlan sharding, ShardingPlanFor(config, layout.strategy, s));

  const ModelArgs& model = config.model;
  const ModelFamily& family = *FindModelFamily(model.arch);
  const ModelCounts counts = CountModel(model);
  const TrainingSection& t = config.training;
  const double cb = BytesOf(t.mixed_precision);  // compute (unsharded) dtype
  const double rb = BytesOf(t.reduce_dtype);     // gradient collectives
  const double n = s;
  // parallelism.reshard_between_micro_batches false (Note [Keeping parameters across
  // micro-batches] in sharding/fsdp_model.h): every unit gathered once per step and kept
  // unsharded until the last backward, as if never resharded after forward.
  const bool keep = !sharding.options.reshard_between_micro_batches;
  const bool reshard = sharding.options.reshard_after_forward && !keep;
  const int num_units = static_cast<int>(counts.unit_shapes.size());
  const int num_blocks = num_units - 1;
  const double tokens_micro = static_cast<double>(t.micro_batch_size) * model.seq_len;
  const double accum = static_cast<double>(t.grad_accum_steps);
  // training.grad_sync: last (Note [No-sync accumulation] in engine/trainable.h): only the last
  // micro-batch reduces; every unit keeps its unsharded gradients until then.
  const bool no_sync = t.grad_sync == GradSync::kLast && t.grad_accum_steps > 1;
  const double reductions = no_sync ? 1 : accum;  // gradient reductions per step

  std::vector<double> padded(num_units);
  double padded_total = 0;
  for (int u = 0; u < num_units; ++u) {
    padded[u] = static_cast<double>(PaddedNumel(counts.unit_shapes[u], s));
    padded_total += padded[u];
  }
  const double root = padded[0];
  const double block = num_blocks > 0 ? padded[1] : 0;
  const double real = static_cast<double>(counts.params);

  // --- memory (See Note [Peak memory phases]) ---------------------------------------------------
  Prediction p;
  p.layout = layout;
  p.runs_as = sharding.effective;
  const ActivationCheckpointing& ac = sharding.options.activation_checkpointing;
  const Offload offload = sharding.options.offload;
  p.activation_checkpointing = ac;
  p.offload = offload;
  MemoryBreakdown& mem = p.memory;
  const double state_bytes = OptimizerStateBytesPerParam(config.optimizer);
  const double largest_unit = *std::max_element(padded.begin(), padded.end());
  const int max_units = std::max<int>(1, static_cast<int>(config.parallelism.max_unsharded_units));
  const int blocks_unsharded = reshard ? std::min(num_blocks, max_units) : num_blocks;
  // Gradient shards live on the device across micro-batches unless offload copies each one
  // to the host after its reduce-scatter; HSDP's partial sums wait for the last micro-batch's
  // replicate all-reduce either way (Note [Offload]).
  const bool grads_on_device = offload == Offload::kNone;
  switch (offload) {
    case Offload::kNone:
      mem.params = real / n * 4;
      mem.padding = (padded_total - real) / n * 4;
      mem.grads = real / n * 4;
      mem.optimizer = real / n * state_bytes;
      break;
    case Offload::kOptimizer:
      mem.params = real / n * 4;
      mem.padding = (padded_total - real) / n * 4;
      mem.grads = largest_unit / n * 4;  // one unit's shard on its way to the host
      mem.host = padded_total / n * 4 + real / n * (4 + state_bytes);
      break;
    case Offload::kParams:
      // The shards of the units being gathered: the root's at the start of forward (it stays
      // unsharded), the prefetched blocks' in backward.
      mem.params = keep ? padded_total / n * 4 : std::max(root, blocks_unsharded * block) / n * 4;
      mem.grads = largest_unit / n * 4;
      mem.host = padded_total / n * 4 + real / n * (4 + state_bytes);
      break;
  }
  mem.unsharded_units = root * cb * 2 + blocks_unsharded * block * cb +
                        (num_blocks > 0 ? block * cb + block * rb : 0);
  // model.kernels as it resolves on this hardware (a profile with CPU cores per node is a CPU
  // machine): the fused kernels keep less per token (Note [Activation bytes] in gpt_counts.cc).
  ModelArgs resolved = model;
  resolved.kernels = ResolveKernelMode(model.kernels, /*on_cuda=*/hw.cores_per_node == 0);
  const Activations acts =
      CheckpointedActivations(resolved, family, counts, ac, num_blocks, cb);
  mem.activations = tokens_micro * acts.peak;
  double backward_start = mem.unsharded_units + mem.activations;
  const double backward_end = (grads_on_device ? mem.grads : 0) + largest_unit / n * rb;
  if (no_sync) {
    // Every unit's unsharded gradients (compute dtype, not divided by the shard degree), alive
    // from the first micro-batch's backward to the last one's; the gradient shards are written
    // only by the last one.
    mem.grads += real * cb;
    backward_start += real * cb;
  } else if (t.grad_accum_steps > 1) {
    if (grads_on_device) backward_start += mem.grads;
    if (hybrid) backward_start += real / n * rb;  // unreduced partial sums
  }
  mem.total = mem.params + mem.padding + mem.optimizer + std::max(backward_start, backward_end);

  double memory = hw.memory_bytes;
  const int ranks_on_node = per_node;
  const bool cpu_profile = hw.cores_per_node > 0;
  if (cpu_profile) memory /= ranks_on_node;  // CPU: the node's memory, shared
  const double usable = memory * hw.usable_memory_fraction;
  // Note [Checkpoint staging] (engine/checkpoint_staging.cc): with checkpoints on, every save
  // copies the rank's fp32 shards and optimizer state into host buffers reserved at start-up
  // and held for the run (pinned for device tensors); a synchronous save writes host tensors
  // (a CPU run's, offloaded masters and state) in place instead. Replicas other than the
  // first save nothing, but a node's ranks usually all belong to it: counted for every rank.
  const bool saved_on_device = offload == Offload::kNone && !cpu_profile;
  if (config.checkpoint.enabled && (saved_on_device || config.checkpoint.async)) {
    mem.checkpoint_staging = real / n * (4 + state_bytes);
  }
  const double host_total = mem.host + mem.checkpoint_staging;
  // A CPU profile's host memory is the same pool as its "device" memory.
  const double host_usable =
      cpu_profile ? 0 : hw.host_memory_bytes / ranks_on_node * kUsableHostFraction;
  const bool device_fits = mem.total + (cpu_profile ? host_total : 0) <= usable;
  const bool host_fits = cpu_profile || host_total <= host_usable;
  p.fits = device_fits && host_fits;
  p.host_fits = host_fits;

  // --- time ---------------------------------------------------------------------------------
  TimeBreakdown& time = p.time;
  double rate = t.mixed_precision == Precision::kBf16 && hw.peak_flops_bf16 > 0 ? hw.peak_flops_bf16
                                                                       : hw.peak_flops_fp32;
  if (cpu_profile) rate /= ranks_on_node;  // CPU: the node's cores, shared
  const double achieved = rate * hw.compute_efficiency;
  double mem_bw = hw.memory_bw;
  if (cpu_profile) mem_bw /= ranks_on_node;
  auto seconds = [&](double flops, double traffic_bytes) {
    return flops / achieved + (mem_bw > 0 ? traffic_bytes / mem_bw : 0);
  };
  const double flops_micro = counts.flops_per_token * tokens_micro;
  // The elementwise traffic of forward and backward is that of every activation, checkpointed
  // or not; the recompute adds its own.
  const double traffic_micro = kActivationTrafficPasses * acts.none_total * tokens_micro;
  const double recompute_micro =
      seconds(acts.recompute_flops * tokens_micro,
              kRecomputeTrafficPasses * acts.recompute_bytes * tokens_micro);
  const double compute_micro = seconds(flops_micro, traffic_micro) + recompute_micro;
  time.compute_s = accum * compute_micro;
  time.recompute_s = accum * recompute_micro;
  double host_bw = cpu_profile ? hw.memory_bw : hw.host_memory_bw;
  host_bw /= ranks_on_node;
  if (offload == Offload::kNone) {
    time.optimizer_s = mem_bw > 0 ? real / n * kOptimizerBytesPerParam / mem_bw : 0;
  } else {
    // The step, plus one read and one write per parameter for each extra micro-batch's
    // gradient accumulated on the host (HSDP accumulates on the device).
    const double accumulate = hybrid || no_sync ? 0 : (accum - 1) * 8;
    time.optimizer_s = host_bw > 0 ? real / n * (kHostOptimizerBytesPerParam + accumulate) / host_bw
                                   : 0;
  }

  // Block compute, forward one third of the step's FLOPs and backward two thirds (plus the
  // recompute, which runs at the start of each checkpointed block's backward).
  const double block_share =
      num_blocks > 0 ? counts.block_flops_per_token / counts.flops_per_token : 0;
  const double block_fwd = (compute_micro - recompute_micro) * block_share / 3;
  const double block_bwd = (compute_micro - recompute_micro) * block_share * 2 / 3 +
                           (num_blocks > 0 ? recompute_micro / num_blocks : 0);

  // Groups: shard ranks are consecutive (inner axis), replicas stride by s.
  const Group shard_group = MakeGroup(s, std::gcd(s, per_node), hw);
  const int replicas_per_node = s >= per_node ? 1 : per_node / s;
  const Group replicate_group = MakeGroup(r, std::max(1, std::min(r, replicas_per_node)), hw);

  const double ag_root = shard_group.Ring(root * cb), ag_block = shard_group.Ring(block * cb);
  const double rs_root = shard_group.Ring(root * rb), rs_block = shard_group.Ring(block * rb);
  // DDP all-reduces every unit every micro-batch; HSDP the shards once per step.
  const bool ddp = s == 1 && r > 1;
  const double ar_root = replicate_group.AllReduce(root / n * rb);
  const double ar_block = replicate_group.AllReduce(block / n * rb);
  const double ar_micro = ddp ? ar_root + num_blocks * ar_block : 0;
  const double ar_step = hybrid ? ar_root + num_blocks * ar_block : 0;

  const double gathers_per_block = reshard ? 2 : 1;
  const double ag_micro = ag_root + num_blocks * gathers_per_block * ag_block;
  const double rs_micro = rs_root + num_blocks * rs_block;
  time.all_gather_s = (keep ? 1 : accum) * ag_micro;
  time.reduce_scatter_s = reductions * rs_micro;
  time.all_reduce_s = reductions * ar_micro + ar_step;
  // Clipping: one scalar all-reduce over the shard axis per step.
  const double clip = shard_group.AllReduce(4);
  time.comm_s = time.all_gather_s + time.reduce_scatter_s + time.all_reduce_s + clip;

  // Overlap: a block's gather hides behind the previous block's compute (prefetch), a block's
  // backward collectives behind the next block's backward; the first gathers and the last
  // reductions have nothing to hide behind.
  auto exposed_micro = [&](bool last_micro, bool gathers) {
    const bool reduces = last_micro || !no_sync;
    double ar_b = ddp && reduces ? ar_block : (hybrid && last_micro ? ar_block : 0);
    double ar_r = ddp && reduces ? ar_root : (hybrid && last_micro ? ar_root : 0);
    double rs_b = reduces ? rs_block : 0, rs_r = reduces ? rs_root : 0;
    if (num_blocks == 0) return (gathers ? ag_root : 0) + rs_r + ar_r;
    double fwd =
        gathers ? ag_root + ag_block + (num_blocks - 1) * std::max(0.0, ag_block - block_fwd) : 0;
    double bwd_comm = (reshard ? ag_block : 0) + rs_b + ar_b;
    double bwd = (num_blocks - 1) * std::max(0.0, bwd_comm - block_bwd) + rs_b + ar_b + rs_r + ar_r;
    return fwd + bwd;
  };
  // Kept units gather in the first micro-batch only.
  double exposed = accum > 1
                       ? exposed_micro(false, true) + (accum - 2) * exposed_micro(false, !keep) +
                             exposed_micro(true, !keep)
                       : exposed_micro(true, true);
  exposed += clip;
  exposed = std::min(exposed, time.comm_s);
  time.exposed_comm_s = hw.comm_overlap * exposed + (1 - hw.comm_overlap) * time.comm_s;

  // Host <-> device copies (See Note [Offload]); the same rules of overlap as the gathers.
  if (offload != Offload::kNone) {
    double link = cpu_profile ? hw.memory_bw / 2 / ranks_on_node : hw.host_link_bw;
    if (link <= 0) link = 1;  // a profile without a host link: offload is hopeless, not free
    const double later_blocks = std::max(0, num_blocks - 1);
    const bool params = offload == Offload::kParams;
    // Host to device, fp32 shards: offload params before each of a unit's gathers (every
    // micro-batch), offload optimizer each updated shard once per step.
    const double h2d_root = root / n * 4 / link;
    const double h2d_block = block / n * 4 / link;
    const double h2d_passes = params && !keep ? accum : 1;
    const double h2d_blocks = params ? gathers_per_block : 1;
    // Device to host, the reduced gradient shards: every micro-batch (HSDP: the last one).
    const double d2h_root = counts.unit_params[0] / n * rb / link;
    const double d2h_block = num_blocks > 0 ? counts.unit_params[1] / n * rb / link : 0;
    const double d2h_passes = hybrid || no_sync ? 1 : accum;
    time.host_copy_s = h2d_passes * (h2d_root + num_blocks * h2d_blocks * h2d_block) +
                       d2h_passes * (d2h_root + num_blocks * d2h_block);
    auto beyond = [](double copy, double behind) { return std::max(0.0, copy - behind); };
    const double h2d_exposed =
        h2d_root + h2d_block + later_blocks * beyond(h2d_block, block_fwd) +
        (params && reshard ? later_blocks * beyond(h2d_block, block_bwd) : 0);
    const double d2h_exposed = later_blocks * beyond(d2h_block, block_bwd) + d2h_block + d2h_root;
    const double exposed_copy =
        std::min(time.host_copy_s, h2d_passes * h2d_exposed + d2h_passes * d2h_exposed);
    time.exposed_copy_s =
        hw.comm_overlap * exposed_copy + (1 - hw.comm_overlap) * time.host_copy_s;
  }

  time.step_s = time.compute_s + time.optimizer_s + time.exposed_comm_s + time.exposed_copy_s;
  const double tokens_rank = tokens_micro * accum;
  time.tokens_per_s = tokens_rank * world / time.step_s;
  time.mfu = rate > 0 ? counts.flops_per_token * tokens_rank / time.step_s / rate : 0;

  if (!device_fits) {
    p.note = fmt::format("needs {:.1f} GiB of {:.1f} GiB usable",
                         (mem.total + (cpu_profile ? host_total : 0)) / kGiB, usable / kGiB);
  } else if (!host_fits) {
    p.note = fmt::format("host: needs {:.1f} GiB of {:.1f} GiB per rank", host_total / kGiB,
                         host_usable / kGiB);
    if (mem.checkpoint_staging > 0) {
      p.note += fmt::format(" ({:.1f} GiB of it checkpoint staging{})",
                            mem.checkpoint_staging / kGiB,
                            offload != Offload::kNone ? "; checkpoint.async: false needs none"
                                                      : "");
    }
  } else if (time.exposed_comm_s > 0.2 * time.step_s) {
    p.note = "communication-bound";
  } else if (time.exposed_copy_s > 0.2 * time.step_s) {
    p.note = "host-copy-bound";
  }
  return p;
}

absl::StatusOr<std::vector<Prediction>> EnumerateLayouts(const PlanRequest& request) {
  const int world = request.world_size;
  if (request.gpus_per_node < 1 || world < 1 || world % request.gpus_per_node != 0) {
    return absl::InvalidArgumentError(StrCat("--world-size ", world,
                                             " is not a multiple of --gpus-per-node ",
                                             request.gpus_per_node));
  }
  std::vector<Layout> layouts;
  layouts.push_back({Strategy::kFullShard, 1, world});
  if (world > 1) {
    layouts.push_back({Strategy::kShardGradOp, 1, world});
    layouts.push_back({Strategy::kNoShard, world, 1});
  }
  for (int s = 2; s < world; ++s) {
    if (world % s != 0) continue;
    layouts.push_back({Strategy::kHybridShard, world / s, s});
    layouts.push_back({Strategy::kHybridShardZero2, world / s, s});
  }
  std::vector<Prediction> out;
  for (const Layout& layout : layouts) {
    // A layout the configuration's options do not fit (a reshard_after_forward group size k
    // must divide its shard degree) is not a candidate; any other error is the request's.
    if (!ShardingPlanFor(request.config, layout.strategy, layout.shard).ok()) continue;
    absl::StatusOr<Prediction> p = Predict(request, layout);
    if (!p.ok()) return p.status();
    out.push_back(*std::move(p));
  }
  std::stable_sort(out.begin(), out.end(), [](const Prediction& a, const Prediction& b) {
    if (a.fits != b.fits) return a.fits;
    return a.time.tokens_per_s > b.time.tokens_per_s;
  });
  return out;
}

}  // namespace fsdp::plan

namespace fsdp::plan {

absl::StatusOr<PlanRequest> MakePlanRequest(const std::string& config_path,
                                            const std::vector<std::string>& overrides,
                                            int world_size, int gpus_per_node,
                                            const std::string& gpu,
                                            const std::string& hardware_file) {
  PlanRequest request;
  if (world_size < 1) {
    return absl::InvalidArgumentError(StrCat("--world-size must be >= 1, got ", world_size));
  }
  if (gpus_per_node == 0) gpus_per_node = world_size <= 8 ? world_size : 8;
  if (gpus_per_node < 1) {
    return absl::InvalidArgumentError(StrCat("--gpus-per-node must be >= 1, got ", gpus_per_node));
  }
  if (world_size % gpus_per_node != 0) {
    return absl::InvalidArgumentError(
        StrCat("--world-size ", world_size, " is not a multiple of --gpus-per-node ",
               gpus_per_node, " (nodes must be full; e.g. --world-size ",
               (world_size / gpus_per_node + 1) * gpus_per_node, ")"));
  }
  request.world_size = world_size;
  request.gpus_per_node = gpus_per_node;
  if (!hardware_file.empty()) {
    absl::StatusOr<Hardware> hw = LoadHardwareJson(hardware_file);
    if (!hw.ok()) return hw.status();
    request.hw = *hw;
  } else {
    absl::StatusOr<Hardware> hw = HardwareByName(gpu);
    if (!hw.ok()) return hw.status();
    request.hw = *hw;
  }
  absl::StatusOr<RunConfig> config = LoadRunConfig(config_path, overrides);
  if (!config.ok()) return config.status();
  request.config = *config;
  return request;
}

}  // namespace fsdp::plan
