// The cost model behind `fsdp plan`: per-rank memory and step time of a training run for every
// data-parallel layout (full_shard, shard_grad_op, hybrid_shard R x S, no_shard), from the run
// configuration and a hardware profile alone. Pure arithmetic (no tensors, no processes), so it
// answers for thousands of GPUs in microseconds.
//
// What it models is what the engine does (sharding/, engine/trainer.cc; docs/cost_model.md has
// the formulas and the measured errors):
//   - one unit per transformer block plus the root (embeddings, final norm, head), each sharded
//     on dim 0 with padding to a multiple of the shard count (Note [Dim-0 sharding with padding]);
//   - per micro-batch: one all-gather per unit in forward, again per block in backward when
//     resharded after forward; one reduce-scatter per unit; HSDP all-reduces the gradient shard
//     over the replicate axis on the last micro-batch; DDP all-reduces every unit every
//     micro-batch;
//   - at most parallelism.max_unsharded_units blocks unsharded at once with reshard after
//     forward (all of them without), the root unsharded for the whole step;
//   - parallelism.reshard_between_micro_batches: false: every unit gathered once per step and
//     all of them unsharded through the step (offload params: every shard on the device);
//   - activation checkpointing (none, full, every:k, selective: what each block keeps, the
//     recompute's FLOPs) and CPU offload (optimizer: states, master copy and step on the host;
//     params: the shards too, copied over PCIe around each collective).
// See Note [Peak memory phases], Note [Checkpointed activations], Note [Offload] and
// Note [Collective time] in cost_model.cc.
//
//   PlanRequest request{.config = *LoadRunConfig("configs/llama_1b.yaml", {}),
//                       .world_size = 64, .gpus_per_node = 8,
//                       .hw = *HardwareByName("h100")};
//   absl::StatusOr<Prediction> p = Predict(request, {Strategy::kHybridShard, 8, 8});
//   p->memory.total;        // bytes per rank at the step's peak
//   p->time.tokens_per_s;   // global
//   auto all = EnumerateLayouts(request);   // fitting first, then fastest first
//   auto r = Recommend(request);           // also over checkpointing x offload; r->message
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/config.h"
#include "models/model.h"
#include "sharding/offload/offload_plan.h"

namespace fsdp::plan {

struct Hardware {
  std::string name;  // "h100"
  // Dense, per device (fp32 = TF32 on GPUs). CPU profiles (cores_per_node > 0): per node, shared
  // by the ranks on it.
  double peak_flops_bf16 = 0, peak_flops_fp32 = 0;
  double memory_bytes = 0;   // per device (CPU profiles: per node)
  // bytes/s of device memory (the optimizer step is bound by it; on a CPU profile the copy's
  // rate, and the step runs at host_memory_bw's)
  double memory_bw = 0;
  double intra_node_bw = 0;  // bytes/s, bus bandwidth as nccl-tests defines it
  double intra_node_latency_s = 0;  // per ring step
  double inter_node_bw = 0;  // bytes/s per GPU (its own NIC)
  double inter_node_latency_s = 0;  // per ring step across nodes
  double compute_efficiency = 0.5;  // achieved / peak for the model's training step
  // Share of the communication that can run behind compute: 1 with CUDA streams (NCCL),
  // 0 on CPU where Gloo's threads compete with compute for the same cores.
  double comm_overlap = 1.0;
  // Usable share of memory_bytes (CUDA context, allocator fragmentation).
  double usable_memory_fraction = 0.92;
  int cores_per_node = 0;  // CPU profile only: ranks on a node share these cores
  // Host side, for CPU offload. Per node, shared by its ranks (a CPU profile's host memory is
  // memory_bytes itself: one pool).
  double host_memory_bytes = 0;
  // bytes/s (the host optimizer step is bound by it; on a CPU profile every optimizer step,
  // offloaded or not: ATen's fused AdamW's rate over the node)
  double host_memory_bw = 0;
  // bytes/s one rank's host work reaches at most, however idle the node (its threads' share of
  // cores and memory channels); 0: no such limit, only host_memory_bw shared by the ranks.
  double host_rank_bw = 0;
  double host_link_bw = 0;    // bytes/s per device and direction (PCIe), effective
  // Time per byte of the host optimizer's one loop (Note [Host Adam pass]) and of the bf16
  // gradients' addition loop against ATen's fused AdamW, the pass host_rank_bw is the speed
  // of (`fsdp bench host`'s cost column); 0: the built-in 1.2 and 1.1 (measured on the CI
  // machine). `fsdp plan --calibrate-host` measures all three on the machine it runs on.
  double host_loop_cost = 0;
  double host_add_loop_cost = 0;
  std::string source;         // where the numbers come from (data sheet, calibration)
};
// The costs the model uses: the profile's, else the built-in ones.
double HostLoopCost(const Hardware& hw);
double HostAddLoopCost(const Hardware& hw);

// h100, h200, a100-80gb, a100-40gb, cpu. kInvalidArgument naming the valid ones otherwise.
absl::StatusOr<Hardware> HardwareByName(const std::string& name);
std::vector<std::string> HardwareNames();
// A profile from a JSON object with Hardware's field names (missing fields keep the defaults of
// `base`, e.g. a built-in profile named by "base": "h100"). kNotFound / kInvalidArgument.
absl::StatusOr<Hardware> LoadHardwareJson(const std::string& path);
absl::StatusOr<Hardware> ParseHardwareJson(const std::string& text, const std::string& name);
std::string HardwareToJson(const Hardware& hw);
// The dense FLOP/s a rank computes at in `precision`: peak_flops_bf16 for bf16 where the
// profile has one (a CPU's bf16 is no faster: 0 there), else peak_flops_fp32 (TF32 on GPUs).
double PeakRate(const Hardware& hw, Precision precision);

// Measures this machine: a GEMM with the threads a rank would get under `nproc` local ranks
// (OMP_NUM_THREADS = cores / nproc, as the launcher sets it), a copy and ATen's fused AdamW
// (memory_bw, host_memory_bw) on every core, and a Gloo all-gather on loopback,
// by running `fsdp_binary launch --nproc-per-node 2 -- fsdp_binary doctor` as a child. `log`
// receives progress lines.
absl::StatusOr<Hardware> CalibrateCpu(const std::string& fsdp_binary, std::string* log);
// `base` with this machine's host figures, for planning offload on a GPU node from the node
// itself: host_rank_bw (ATen's fused AdamW over `elements` fp32 elements on all cores, one
// thread spinning beside it as a training thread waiting for its GPU does), host_loop_cost and
// host_add_loop_cost (the loops' time per byte against it), host_memory_bytes (this machine's
// memory), by running `fsdp_binary bench host` as a child. host_memory_bw (the node's, shared
// by its ranks) stays the base's, raised to host_rank_bw if lower.
absl::StatusOr<Hardware> CalibrateHost(const std::string& fsdp_binary, Hardware base,
                                       double elements, std::string* log);

using fsdp::ModelCounts;
// The registered family's analytic counts; equal to the built model's NumParameters() and
// FlopsPerToken() (models/model.h).
ModelCounts CountModel(const ModelArgs& model);

struct Layout {
  Strategy strategy = Strategy::kFullShard;
  int replicate = 1;
  int shard = 1;
};

// Bytes per rank. params / grads / optimizer are the device's share of the real (unpadded)
// shards (with offload: what stays or is in flight there); padding is the extra of the padded
// parameter shards on the device; unsharded_units the gathered units, their gradients and
// collective buffers in flight at the peak; activations those alive at the peak (Note
// [Checkpointed activations]); partial_grads HSDP's unreduced partial gradient sums when
// accumulating micro-batches (reduce dtype, over the shard degree: summed over the shard axis,
// waiting for the replicate all-reduce of the last micro-batch); total the modelled device peak
// of the step (Note [Peak memory phases]: the sum of the other device fields when accumulating,
// at most that otherwise); host the rank's share of host memory with offload (shards,
// gradients, optimizer state; what the engine pins: docs/offload.md);
// checkpoint_staging the host buffers checkpoint saves copy the rank's state into (Note
// [Checkpoint staging]: with checkpoint.enabled, for device tensors and for async saves), on
// top of host (both count for `fits`). With training.grad_sync last and several micro-batches,
// grads also holds every unit's unsharded gradients (compute dtype), alive across the
// micro-batches.
struct MemoryBreakdown {
  double params = 0, grads = 0, optimizer = 0, unsharded_units = 0, activations = 0, padding = 0,
         partial_grads = 0, total = 0, host = 0, checkpoint_staging = 0;
};
// Seconds per optimizer step; tokens_per_s is global (all ranks). compute_s includes
// recompute_s (activation checkpointing); optimizer_s is on the host with offload; host_copy_s
// is every PCIe copy of offload, exposed_copy_s what of it compute does not hide.
struct TimeBreakdown {
  double compute_s = 0, recompute_s = 0, all_gather_s = 0, reduce_scatter_s = 0,
         all_reduce_s = 0, comm_s = 0, exposed_comm_s = 0, host_copy_s = 0, exposed_copy_s = 0,
         optimizer_s = 0, step_s = 0, tokens_per_s = 0, mfu = 0;
};
struct Prediction {
  Layout layout;
  // What runs on this layout: the strategy's name, or what a reshard_after_forward override
  // makes of it (ShardingPlanFor's `effective`, e.g. "shard_grad_op (full_shard with ...)").
  std::string runs_as;
  // As predicted: the configuration's, or a candidate's of the recommendation.
  ActivationCheckpointing activation_checkpointing;
  Offload offload = Offload::kNone;
  MemoryBreakdown memory;
  TimeBreakdown time;
  bool fits = false;       // on the device and, with offload, in host memory
  bool host_fits = true;   // memory.host within the rank's share of host memory
  // Offload params with a narrower compute dtype: whether the engine keeps the host's compute
  // copy, from the host memory predicted (Note [Compute copy] in sharding/offload/offload_plan.h).
  std::optional<ComputeCopyChoice> compute_copy;
  std::string note;
};

// The YAML spelling: none, full, every:k, selective.
std::string CheckpointingName(const ActivationCheckpointing& ac);

struct PlanRequest {
  RunConfig config;
  int world_size = 1;
  int gpus_per_node = 1;  // ranks per node
  Hardware hw;
};

// What `fsdp plan` checks before predicting: the configuration (LoadRunConfig with the --set
// overrides), the world size, the ranks per node (0: the world size up to 8, else 8), and the
// hardware (`hardware_file`, a JSON profile, wins over `gpu`; it needs a peak rate for the
// configuration's precision). kInvalidArgument names the option and what would be valid;
// kNotFound for a missing file.
absl::StatusOr<PlanRequest> MakePlanRequest(const std::string& config_path,
                                            const std::vector<std::string>& overrides,
                                            int world_size, int gpus_per_node,
                                            const std::string& gpu,
                                            const std::string& hardware_file);

// kInvalidArgument for a layout that does not fit the world size or the strategy, a request
// whose world size is not a multiple of gpus_per_node, or hardware without a peak rate for the
// configuration's precision.
absl::StatusOr<Prediction> Predict(const PlanRequest& request, const Layout& layout);
// Every layout for the world size: full_shard, shard_grad_op, no_shard, and hybrid_shard /
// hybrid_shard_zero2 for every shard degree 1 < S < N dividing N. Fitting first, then by
// tokens/s (fastest first). kInvalidArgument when the configuration fits none of them (a
// parallelism.reshard_after_forward group size that divides no shard degree of N), with the
// error `fsdp train` gives.
absl::StatusOr<std::vector<Prediction>> EnumerateLayouts(const PlanRequest& request);

// The activation checkpointing modes the recommendation tries for a model of `num_blocks`
// blocks: none, selective, full, and every:k (a 1/k share of the blocks checkpointed: less
// recompute than full, less memory than none) once per number of checkpointed blocks c,
// 1 <= c <= num_blocks / 2, with the largest k that checkpoints c (k = num_blocks / c): the same
// recompute, so the same time, and the simplest spelling. About 2 sqrt(num_blocks) of them.
std::vector<ActivationCheckpointing> CheckpointingCandidates(int num_blocks);

struct Recommendation {
  // The configured run (its activation checkpointing and offload) on every layout, as
  // EnumerateLayouts orders them.
  std::vector<Prediction> configured;
  // The fastest that fits over layouts x checkpointing x offload; unset when nothing fits.
  std::optional<Prediction> best;
  // best's layout (else the configured run's first) with none / selective / full (and best's
  // every:k) x each offload: the trade-offs `fsdp plan` prints.
  std::vector<Prediction> alternatives;
  // What to run and how it differs from the configuration; or, when nothing fits, only the
  // changes that make it fit (Note [No-fit advice] in cost_model.cc).
  std::string message;
  // --set overrides for best (empty when nothing fits).
  std::vector<std::string> overrides;
};
// kInvalidArgument as EnumerateLayouts.
absl::StatusOr<Recommendation> Recommend(const PlanRequest& request);

// The textbook figures the benchmark plots draw as lines (no padding, no activations):
// model-state bytes per rank with AdamW in fp32 (DDP 16 bytes/param; shard_grad_op 4 + 12/N;
// full_shard 16/N; hybrid 16/shard).
double ZeroModelStateBytes(int64_t params, Strategy strategy, int replicate, int shard);
// Bytes each rank sends per optimizer step with ring algorithms (all-gather and reduce-scatter
// (n-1)/n x buffer, all-reduce 2(n-1)/n x buffer); full_shard = 1.5 x no_shard's.
double TheoryWireBytesPerStep(int64_t params, int bytes_per_element, Strategy strategy,
                              int replicate, int shard, int grad_accum_steps);

}  // namespace fsdp::plan
