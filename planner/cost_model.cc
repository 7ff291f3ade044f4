#include "planner/cost_model.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "common/status.h"
#include "common/strings.h"
#include "engine/host_adam.h"
#include "models/gpt/gpt.h"
#include "planner/calibration.h"
#include "planner/search.h"
#include "sharding/options.h"

namespace fsdp::plan {
namespace {

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

double DeviceStepBytesPerParam(const OptimizerSection& o, bool clips, bool on_cpu) {
  const bool fused = o.implementation == OptimizerImplementation::kFused;
  const bool decays = o.weight_decay != 0;
  double update = 0;
  if (o.kind == OptimizerKind::kSgd) {
    const bool momentum = o.momentum != 0;
    update = fused ? (momentum ? 20 : 12) : (momentum ? 32 : 12) + (decays ? 12 : 0);
  } else if (fused) {
    update = kFusedAdamBytesPerParam;
  } else {
    update = kForeachAdamBytesPerParam +
             (decays ? (o.kind == OptimizerKind::kAdamW ? 8 : 12) : 0);
  }
  return (on_cpu ? kCpuNormBytesPerParam : kDeviceNormBytesPerParam) +
         (clips ? kClipMultiplyBytesPerParam : 0) + update;
}

}  // namespace

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
// first step). On top, the largest of these moments:
//   backward (its start, and each block's backward: Note [Checkpointed activations]): the
//     activations alive then, the root unit unsharded and its gradient (the head's gradient is
//     computed first and kept until the root's reduce-scatter at the very end), the blocks
//     unsharded at once (max_unsharded_units with reshard after forward, all of them without:
//     ZeRO-2, DDP), the gradient of the block in backward and one reduce buffer; the fp32
//     gradient shards when accumulating (they live across micro-batches; with one micro-batch
//     those of the blocks already through backward), and HSDP's unreduced partial sums
//     (partial_grads: each micro-batch's reduce-scatter output, summed over the shard axis,
//     waits for the replicate all-reduce of the last one);
//   end of backward: the gradient shards, with one unit's reduced buffer still to be copied.
// MemoryBreakdown::total is this peak. activations is the most any moment holds and grads all
// the gradient shards, shown even when (one micro-batch, offload) they are not all on the device
// at the peak: the components add up to the total when accumulating without offload (every
// term alive at the start of backward), and to more otherwise.
// Activations with checkpointing: Note [Checkpointed activations]; what offload moves off the
// device: Note [Offload].
//
// Note [Offload]
// parallelism.offload (sharding/options.h), per rank with S the shard degree:
//   optimizer: the optimizer state, an fp32 master copy and its gradient live in host memory
//     (16 P / S with AdamW; the master and gradient pinned, the optimizer state not); the
//     device keeps the fp32 parameter shard (the all-gathers' source) and, accumulating, the
//     sum of the micro-batches' gradient shards (4 P / S, the trainer's
//     set_offload_accumulate_on_device: Note [CPU offload] in sharding/offload/host_offload.h),
//     copied to the host once per step, shard by shard after the last micro-batch's
//     reduce-scatters (HSDP: after the replicate all-reduce; grad_sync last: the last
//     micro-batch's only); with one micro-batch a transient gradient shard. The step runs on
//     the host, and each updated shard is copied back before the unit's next all-gather;
//   params: the shards live only on the host too; each unit's shard is copied to the device
//     just before each of its all-gathers (one unit ahead, as the gathers are prefetched) and
//     freed after it, so the device holds the shards of the units in flight only. With a
//     compute dtype narrower than fp32 (bf16) the host also keeps each shard cast to it
//     (cb bytes per parameter of padded shard, pinned), cast afresh after every step (4 + cb
//     bytes of host memory traffic; the overlapped step's slices cost the same, measured),
//     and that copy is what moves and what the device holds: cb bytes per parameter instead
//     of 4 (without the copy, Note [Compute copy]: 4 move, the device casts).
//     Gradient shards go to the host every micro-batch that reduces (fp32; with one shard and
//     an exact cast to the reduce dtype, in the compute dtype: cb bytes, landing in cb more
//     bytes per parameter of pinned host memory), and a host thread adds them
//     (kHostAccumulate*BytesPerParam) while the next micro-batch computes: only what the
//     additions take beyond that compute is exposed. Their fp32 gradients (4 bytes per
//     parameter) take host memory only when written: not when each lands alone and the one
//     loop steps from it (host_grads_unwritten below).
// Host memory is per node, shared by its ranks; on a CPU profile device and host are one pool,
// so offload there saves nothing. Time: every copy at host_link_bw per direction (the two
// directions overlap); a unit's copy hides behind the previous unit's compute like a prefetched
// all-gather (exposed: the first unit's, and what a copy takes beyond its unit's compute); the
// host step at its bytes per parameter (the optimizer's one loop's or ATen's passes', below)
// over the node's host memory bandwidth shared by its ranks. With the overlapped step (the
// default; FSDP_OFFLOAD_OVERLAP_STEP=0 turns it off; Note [Overlapped host step] in
// engine/trainable.cc) the host steps the units in forward order while the next
// forward runs, each unit's forward waiting for its own step: exposed are the root's and the
// first block's steps and what each later block's step takes beyond that block's forward;
// without it, and on a CPU profile (one pool of cores for both), all of the step. With
// parallelism.offload_delayed_update on the step and the next step's gradient conversions run
// behind the whole next step (exposed: beyond the device's compute, communication and copies),
// for a second loaded copy (cb bytes per parameter of padded shard; fp32 compute: 8) and landing
// buffer (cb) of pinned host memory with offload params.
double HostLoopCost(const Hardware& hw) {
  return hw.host_loop_cost > 0 ? hw.host_loop_cost : kHostLoopCost;
}
double HostAddLoopCost(const Hardware& hw) {
  return hw.host_add_loop_cost > 0 ? hw.host_add_loop_cost : kHostAddLoopCost;
}

absl::StatusOr<Prediction> Predict(const PlanRequest& request, const Layout& layout) {
  return PredictCounted(request, layout, CountedModel::Of(request.config.model));
}

namespace {

// The prediction with or without offload params' compute copy on the host; with it, also the
// engine's choice from the host memory predicted (Note [Compute copy],
// sharding/offload/offload_plan.h).
absl::StatusOr<Prediction> PredictWithCopy(const PlanRequest& request, const Layout& layout,
                                           const CountedModel& counted, bool keep_copy) {
  const RunConfig& config = request.config;
  const Hardware& hw = request.hw;
  const int world = request.world_size;
  const int per_node = request.gpus_per_node;
  if (world < 1 || per_node < 1 || world % per_node != 0) {
    return absl::InvalidArgumentError(StrCat("--world-size ", world,
                                             " is not a multiple of --gpus-per-node ", per_node));
  }
  const int r = layout.replicate, s = layout.shard;
  if (r < 1 || s < 1 || static_cast<int64_t>(r) * s != world) {
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
  const TrainingSection& t = config.training;
  const double peak_rate = PeakRate(hw, t.mixed_precision);
  if (!(peak_rate > 0) || !(hw.compute_efficiency > 0)) {
    return absl::InvalidArgumentError(
        StrCat("hardware '", hw.name, "': no ", PrecisionName(t.mixed_precision),
               " compute rate (peak_flops_", PrecisionName(t.mixed_precision), " ",
               t.mixed_precision == Precision::kBf16 ? hw.peak_flops_bf16 : hw.peak_flops_fp32,
               ", compute_efficiency ", hw.compute_efficiency, "): both must be > 0"));
  }

  const ModelArgs& model = config.model;
  const ModelFamily& family = *counted.family;
  const ModelCounts& counts = counted.counts;
  const double cb = BytesOf(t.mixed_precision);  // compute (unsharded) dtype
  const double rb = BytesOf(t.reduce_dtype);     // gradient collectives
  // Offload params: bytes per parameter of each shard loaded to the device (Note [Offload]):
  // the compute dtype's copy, or without one (Note [Compute copy]) the fp32 master.
  const double loaded_bytes = keep_copy ? std::min(4.0, cb) : 4.0;
  const double n = s;
  // parallelism.reshard_between_micro_batches false (Note [Keeping parameters across
  // micro-batches] in sharding/fsdp_model.h): every unit gathered once per step and kept
  // unsharded until the last backward, as if never resharded after forward.
  const bool keep = !sharding.options.reshard_between_micro_batches;
  const bool reshard = sharding.options.reshard_after_forward && !keep;
  const int num_blocks = counted.num_blocks;
  const double tokens_micro = static_cast<double>(t.micro_batch_size) * model.seq_len;
  const double accum = static_cast<double>(t.grad_accum_steps);
  // training.grad_sync: last (Note [No-sync accumulation] in engine/trainable.h): only the last
  // micro-batch reduces; every unit keeps its unsharded gradients until then.
  const bool no_sync = t.grad_sync == GradSync::kLast && t.grad_accum_steps > 1;
  const double reductions = no_sync ? 1 : accum;  // gradient reductions per step

  // Padded numels: the root, the first block (the cost model's block: the GPT family's are all
  // alike), every unit, the largest unit.
  double padded_total = 0, largest_unit = 0;
  for (const CountedModel::Run& run : counted.runs) {
    const double padded = static_cast<double>(PaddedNumel(counts.unit_shapes[run.first_unit], s));
    padded_total += padded * static_cast<double>(run.count);
    largest_unit = std::max(largest_unit, padded);
  }
  const double root = static_cast<double>(PaddedNumel(counts.unit_shapes[0], s));
  const double block =
      num_blocks > 0 ? static_cast<double>(PaddedNumel(counts.unit_shapes[1], s)) : 0;
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
  const int max_units = std::max<int>(1, static_cast<int>(config.parallelism.max_unsharded_units));
  const int blocks_unsharded = reshard ? std::min(num_blocks, max_units) : num_blocks;
  // Gradient shards live on the device across micro-batches unless offload copies each one
  // to the host after its reduce-scatter; HSDP's partial sums wait for the last micro-batch's
  // replicate all-reduce either way (Note [Offload]).
  // Offload optimizer sums the micro-batches' gradient shards on the device (Note [Offload]).
  const bool sums_on_device =
      offload == Offload::kOptimizer && accum > 1 && !hybrid && !no_sync;
  // Offload params, one shard: gradients go to the host in the compute dtype when narrower and
  // their cast to the reduce dtype is exact (Note [Offload]).
  const bool narrow_grads_to_host =
      offload == Offload::kParams && s == 1 && r == 1 && cb < 4 && (rb == cb || rb == 4);
  // Note [Gradients committed on demand] (sharding/offload/host_buffers.cc): those gradients' fp32
  // .grads are reserved but never written when each lands alone (one micro-batch, or grad_sync
  // last) and the overlapped step's one loop updates the master from it: a fused Adam(W) whose
  // update the loop covers (HostAdamPassCovers), on a CPU with AVX2 (assumed: every GPU host in the
  // profiles).
  const OptimizerSection& o = config.optimizer;
  HostAdamHyper hyper;
  hyper.decoupled = o.kind == OptimizerKind::kAdamW;
  hyper.weight_decay = o.weight_decay;
  const bool one_loop_optimizer = o.implementation == OptimizerImplementation::kFused &&
                                  o.kind != OptimizerKind::kSgd && HostAdamPassCovers(hyper);
  // A bf16 gradient that lands on the host alone: no sum with an earlier micro-batch's.
  const bool lands_narrow_alone = narrow_grads_to_host && (accum == 1 || no_sync);
  // The overlapped step steps every parameter in the optimizer's one loop (Note [Host Adam
  // pass] in engine/host_adam.cc).
  const bool one_loop = sharding.options.offload_overlap_step && one_loop_optimizer;
  const bool host_grads_unwritten = lands_narrow_alone && one_loop;
  const bool grads_on_device = offload == Offload::kNone || sums_on_device;
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
      // The micro-batches' sums, or one unit's shard on its way to the host.
      mem.grads = sums_on_device ? real / n * 4 : largest_unit / n * 4;
      mem.host = padded_total / n * 4 + real / n * (4 + state_bytes);
      break;
    case Offload::kParams:
      // The shards of the units being gathered: the root's at the start of forward (it stays
      // unsharded), the prefetched blocks' in backward; loaded in the compute dtype when it is
      // narrower (Note [Offload]), whose copies the host keeps as well.
      mem.params = keep ? padded_total / n * loaded_bytes
                        : std::max(root, blocks_unsharded * block) / n * loaded_bytes;
      mem.grads = largest_unit / n * 4;
      mem.host = padded_total / n * 4 +
                 real / n * ((host_grads_unwritten ? 0 : 4) + state_bytes) +
                 (loaded_bytes < 4 ? padded_total / n * loaded_bytes : 0) +
                 (narrow_grads_to_host ? real / n * cb : 0);
      // A delayed update's second buffers: the loaded copy (fp32 compute too) and the landing.
      if (sharding.options.offload_delayed_update) {
        mem.host += padded_total / n * (loaded_bytes < 4 ? loaded_bytes : 8) +
                    (narrow_grads_to_host ? real / n * cb : 0);
      }
      break;
  }
  // Note [One shard] (sharding/collectives.h): one rank in all gathers and reduces nothing; fp32
  // parameters alias their shards, and an fp32 gradient becomes its shard's gradient (counted
  // in the gradients), so neither has a copy, and there is no reduce buffer.
  const bool one_shard = s == 1 && r == 1;
  // A shard axis of 1 (DDP too) gathers nothing: fp32 parameters are their shards' storage.
  const bool params_aliased = s == 1 && cb == 4;
  const bool aliased = params_aliased && r == 1;
  // Offload params with one shard loads each shard in the compute dtype, and the unsharded
  // parameters alias it (Note [CPU offload] in sharding/offload/host_offload.h): counted in
  // mem.params.
  const bool loaded_is_gathered = one_shard && offload == Offload::kParams && loaded_bytes == cb;
  const double gathered = params_aliased || loaded_is_gathered ? 0 : cb;  // a gathered value's
  // Accumulating, the shard's gradient exists already and the block's new one is added to it.
  const double unit_grad = aliased && rb == 4 && t.grad_accum_steps == 1 ? 0 : block * cb;
  mem.unsharded_units = root * (gathered + cb) + blocks_unsharded * block * gathered +
                        (num_blocks > 0 ? unit_grad + (one_shard ? 0 : block * rb) : 0);
  // model.kernels as it resolves on this hardware (a profile with CPU cores per node is a CPU
  // machine): the fused kernels keep less per token (Note [Activation bytes] in gpt_counts.cc).
  ModelArgs resolved = model;
  resolved.kernels = ResolveKernelMode(model.kernels, /*on_cuda=*/hw.cores_per_node == 0);
  // With one micro-batch the gradient shards are written block by block through the backward;
  // accumulating, they are all alive from the start (or, grad_sync last, the unsharded ones).
  const bool progressive_grads = grads_on_device && t.grad_accum_steps == 1;
  const double grad_per_block =
      progressive_grads && num_blocks > 0 ? static_cast<double>(counts.unit_params[1]) / n * 4 : 0;
  const Activations acts = CheckpointedActivations(resolved, family, counts, ac, num_blocks, cb,
                                                   tokens_micro, grad_per_block);
  mem.activations = tokens_micro * acts.peak;
  double backward = mem.unsharded_units + acts.peak_with_grads;
  const double backward_end = (grads_on_device ? mem.grads : 0) + largest_unit / n * rb;
  if (no_sync) {
    // Every unit's unsharded gradients (compute dtype, not divided by the shard degree), alive
    // from the first micro-batch's backward to the last one's; the gradient shards are written
    // only by the last one.
    mem.grads += real * cb;
    backward += real * cb;
  } else if (t.grad_accum_steps > 1) {
    if (grads_on_device) backward += mem.grads;
    if (hybrid) mem.partial_grads = real / n * rb;  // unreduced partial sums
    backward += mem.partial_grads;
  }
  mem.total = mem.params + mem.padding + mem.optimizer + std::max(backward, backward_end);

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
  if (offload == Offload::kParams && cb < 4 && keep_copy) {
    const double copy_bytes = padded_total / n * loaded_bytes;
    p.compute_copy = ChooseComputeCopy({.requested = sharding.options.offload_compute_copy,
                                        .delayed_update = sharding.options.offload_delayed_update,
                                        .host_bytes_without = host_total - copy_bytes,
                                        .copy_bytes = copy_bytes,
                                        .host_available = cpu_profile ? 0 : host_usable});
  }

  // --- time ---------------------------------------------------------------------------------
  TimeBreakdown& time = p.time;
  double rate = peak_rate;
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
  // The host's rate for the optimizer's passes, per rank. On a CPU profile the "device" is the
  // host: its step runs there at the same rate (host_memory_bw, the fused AdamW's speed over
  // the node, is faster per byte than the copy that memory_bw times).
  double host_bw = hw.host_memory_bw / ranks_on_node;
  if (hw.host_rank_bw > 0) host_bw = std::min(host_bw, hw.host_rank_bw);
  const double step_bw = cpu_profile ? host_bw : mem_bw;
  // FsdpUnit::FinishGradients after each reduction, on the device: the division, and without
  // offload (or offload optimizer summing on the device) the gradient shard written from it.
  double finish_bytes = 0;
  if (!one_shard) {
    finish_bytes = reductions * kFinishDivisionPasses * rb;
    if (grads_on_device) finish_bytes += reductions * (rb + 4) + (reductions - 1) * 4;
  }
  const double finish_s = step_bw > 0 ? real / n * finish_bytes / step_bw : 0;
  double host_step_s = 0;  // offload: the optimizer step (and refresh) on the host
  double accumulate_s = 0;  // offload: the host's additions and conversions of gradients
  const bool clips = config.training.max_grad_norm > 0;
  if (offload == Offload::kNone) {
    const double step_bytes = DeviceStepBytesPerParam(config.optimizer, clips, cpu_profile);
    time.optimizer_s = finish_s + (step_bw > 0 ? real / n * step_bytes / step_bw : 0);
  } else {
    // The step, plus each extra micro-batch's gradient accumulated on the host (HSDP and
    // offload optimizer accumulate on the device), on a host thread behind the following
    // micro-batches' compute: only what it takes beyond that is exposed (Note [Offload]).
    const double adds = hybrid || no_sync || sums_on_device ? 0 : accum - 1;
    // Note [Host Adam pass] (engine/host_adam.cc): with the overlapped step and a fused Adam(W)
    // the loop covers, every parameter's step is one loop over its elements, which clips the
    // gradient, updates the master and moments and writes the loaded copy; a gradient that
    // lands alone in the compute dtype is read as it landed (Note [Deferred gradient
    // conversion] in sharding/offload/deferred_grads.h): no conversion, and clipping's norm on the
    // device. Without the loop (another optimizer, the step in place) ATen's passes: the
    // conversion, clipping's read and the fused step (kHostOptimizerBytesPerParam), the refresh's
    // cast; the overlapped step's slices of those moved what the separate passes did on the H100
    // machine (416 ms for llama_1b's host step against ~440), so the same bytes are counted either
    // way.
    const double loaded_copy = offload == Offload::kParams && loaded_bytes < 4 ? loaded_bytes : 0;
    // The bf16 additions are one loop too (HostAddConverted, sharding/host_loops.h), whatever
    // the optimizer; the first gradient's conversion stays ATen's cast.
    const bool converts = !(one_loop && lands_narrow_alone);
    const double loop_cost = HostLoopCost(hw);
    const double add_loop_cost = HostAddLoopCost(hw);
    const double accumulate =
        narrow_grads_to_host
            ? adds * kHostAccumulateNarrowBytesPerParam * add_loop_cost +
                  (converts ? kHostConvertNarrowBytesPerParam * kHostCastCost : 0)
            : adds * kHostAccumulateBytesPerParam;
    accumulate_s = host_bw > 0 ? real / n * accumulate / host_bw : 0;
    double step_bytes = 0;
    if (one_loop) {
      // Reads the master, the moments and the gradient (its landed dtype or fp32), writes the
      // three and the loaded copy; clipping's norm of an fp32 gradient reads it once more, on
      // the host's thread during the backward (Note [Deferred clipping multiplication]). A
      // delayed update's fp32 copy (fp32 compute) is copied from the master after the loop.
      const double grad_bytes = lands_narrow_alone ? cb : 4;
      step_bytes = real / n * ((kHostLoopBytesPerParam + grad_bytes) * loop_cost +
                               (lands_narrow_alone || !clips ? 0 : 4));
      if (offload == Offload::kParams && sharding.options.offload_delayed_update &&
          loaded_bytes >= 4) {
        step_bytes += padded_total / n * 8;
      }
      step_bytes += padded_total / n * loaded_copy * loop_cost;
    } else {
      // Offload params with a narrower compute dtype: the cast of the shards after the step;
      // an fp32 gradient's clipping multiplication, a pass of its own.
      const double multiply = lands_narrow_alone || !clips ? 0 : kClipMultiplyBytesPerParam;
      step_bytes = real / n * (kHostOptimizerBytesPerParam + multiply) +
                   (loaded_copy > 0 ? padded_total / n * (4 + loaded_copy) * kHostCastCost : 0);
    }
    host_step_s = host_bw > 0 ? step_bytes / host_bw : 0;
    time.optimizer_s =
        finish_s + host_step_s + std::max(0.0, accumulate_s - adds * compute_micro);
  }

  // Block compute, forward one third of the step's FLOPs and backward two thirds (plus the
  // recompute, which runs at the start of each checkpointed block's backward).
  const double block_share =
      num_blocks > 0 ? counts.block_flops_per_token / counts.flops_per_token : 0;
  const double block_fwd = (compute_micro - recompute_micro) * block_share / 3;
  const double block_bwd = (compute_micro - recompute_micro) * block_share * 2 / 3 +
                           (num_blocks > 0 ? recompute_micro / num_blocks : 0);

  // The overlapped host step (Note [Offload]): unit by unit behind the next forward; not on a
  // CPU profile, whose forward runs on the cores the host step needs.
  if (host_step_s > 0 && sharding.options.offload_overlap_step && num_blocks > 0 && !cpu_profile) {
    double params_total = 0;
    for (int64_t u : counts.unit_params) params_total += static_cast<double>(u);
    const double h_root = host_step_s * counts.unit_params[0] / params_total;
    const double h_block = host_step_s * counts.unit_params[1] / params_total;
    const double exposed_step =
        h_root + h_block + (num_blocks - 1) * std::max(0.0, h_block - block_fwd);
    time.optimizer_s -= host_step_s - std::min(host_step_s, exposed_step);
  }

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
    // Host to device: offload params the shards in the compute dtype (fp32 at most) before
    // each of a unit's gathers (every micro-batch), offload optimizer each updated fp32 shard
    // once per step.
    const double h2d_width = params ? loaded_bytes : 4;
    const double h2d_root = root / n * h2d_width / link;
    const double h2d_block = block / n * h2d_width / link;
    const double h2d_passes = params && !keep ? accum : 1;
    const double h2d_blocks = params ? gathers_per_block : 1;
    // Device to host, the reduced gradient shards: every micro-batch (HSDP, grad_sync last and
    // offload optimizer: the last one), in fp32 (the shards' dtype) or, offload params with
    // one shard, in the compute dtype (Note [Offload]).
    const double d2h_width = narrow_grads_to_host ? cb : 4;
    const double d2h_root = counts.unit_params[0] / n * d2h_width / link;
    const double d2h_block = num_blocks > 0 ? counts.unit_params[1] / n * d2h_width / link : 0;
    const double d2h_passes = hybrid || no_sync || sums_on_device ? 1 : accum;
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

  // A delayed update (Note [Delayed parameter update] in sharding/offload/host_step.h) runs through
  // the whole next step, and the host's thread converts that step's gradients after it; the next
  // update waits for both: exposed is what they take beyond the device's step, at the slowdown
  // measured beside it (kHostBesideStepCost). Not on a CPU profile (one pool of cores, as above).
  if (host_step_s > 0 && sharding.options.offload_delayed_update &&
      sharding.options.offload_overlap_step && !cpu_profile) {
    const double device_s =
        time.compute_s + time.exposed_comm_s + time.exposed_copy_s + finish_s;
    time.optimizer_s =
        finish_s + std::max(0.0, kHostBesideStepCost * (host_step_s + accumulate_s) - device_s);
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

}  // namespace

absl::StatusOr<Prediction> PredictCounted(const PlanRequest& request, const Layout& layout,
                                          const CountedModel& counted) {
  FSDP_ASSIGN_OR_RETURN(Prediction p,
                        PredictWithCopy(request, layout, counted, /*keep_copy=*/true));
  if (!p.compute_copy || p.compute_copy->keep) return p;
  const ComputeCopyChoice choice = *p.compute_copy;
  FSDP_ASSIGN_OR_RETURN(p, PredictWithCopy(request, layout, counted, /*keep_copy=*/false));
  p.compute_copy = choice;
  return p;
}

}  // namespace fsdp::plan
