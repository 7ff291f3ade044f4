// The run configuration: what `fsdp train CONFIG.yaml [--set section.key=value ...]` reads.
//
// Sections a torchtitan user recognises: run, model, data, training, optimizer, lr_scheduler,
// parallelism, metrics. Parsing is strict: an unknown key, a wrong type or an invalid value is
// kInvalidArgument naming the key path, the file and line, and what would be valid, with a
// did-you-mean for misspelt keys, e.g.
//   configs/x.yaml:12: training.stpes: unknown key; did you mean 'steps'? (valid: steps, ...)
//   configs/x.yaml:7: model.dim: expected an integer, got 'big'
//   --set training.steps=-3: training.steps: must be >= 1, got -3
//
//   absl::StatusOr<RunConfig> config = LoadRunConfig("configs/default.yaml", {"training.steps=50"});
//   FSDP_RETURN_IF_ERROR(config->ValidateForWorld(world_size));   // degrees vs ranks
//   std::string yaml = config->ToYaml();                           // the resolved config
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <optional>

#include <c10/core/ScalarType.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/attention.h"
#include "engine/optimizer.h"
#include "engine/profiler.h"
#include "models/model.h"
#include "sharding/options.h"

namespace fsdp {

// Past the parser every choice is typed: the names below appear only in config.cc, which maps
// them to these enums and back (ToYaml).
enum class Precision { kFp32, kBf16 };
c10::ScalarType ScalarTypeOf(Precision precision);
int BytesOf(Precision precision);
const char* PrecisionName(Precision precision);  // "fp32" | "bf16" (MFU tables, logs)

enum class DeviceKind { kAuto, kCpu, kCuda };
enum class HostAllocator { kCaching, kDefault };
enum class OnNonFinite { kStop, kSkip };
// training.grad_sync: every micro-batch's gradients are reduced (every), or only the last one's,
// the others accumulating unsharded on each rank (last: Note [No-sync accumulation] in
// engine/trainable.h).
enum class GradSync { kEvery, kLast };
enum class LrDecay { kCosine, kLinear, kConstant };
enum class DataSource { kSynthetic, kTokens, kText };
enum class TokenDtype { kUint16, kUint32 };
// data.header of a tokens file: auto (llm.c's header when the file starts with its magic),
// llmc (required), none (raw ids from the first byte).
enum class TokenHeader { kAuto, kLlmc, kNone };
enum class CudaBackend { kAuto, kNccl, kGloo };
enum class CpuCollectives { kP2p, kGloo };
enum class ProgressBarMode { kAuto, kOn, kOff };

// parallelism.reshard_after_forward: default (the strategy's), true, false, or an integer k
// with 1 < k < shard degree dividing it (keep shards over groups of k ranks after forward).
struct ReshardPolicy {
  enum class Kind { kDefault, kAlways, kNever, kGroup };
  Kind kind = Kind::kDefault;
  int group_size = 0;  // kGroup only
  bool operator==(const ReshardPolicy&) const = default;
};

// parallelism.wrap_policy: block (the model's own units) or params:N (children with >= N
// parameters).
struct UnitPolicy {
  enum class Kind { kBlock, kMinParams };
  Kind kind = Kind::kBlock;
  int64_t min_params = 0;  // kMinParams only
  bool operator==(const UnitPolicy&) const = default;
};

// parallelism.offload_delayed_update: off, on (from the first step) or after:N (the first N
// steps undelayed).
struct DelayedUpdate {
  bool enabled = false;
  int64_t after = 0;  // the first delayed step (0-based); enabled only
  // Whether the update of 0-based `step` may run through the next step.
  bool At(int64_t step) const { return enabled && step >= after; }
  bool operator==(const DelayedUpdate&) const = default;
};

struct RunSection {
  std::string name = "default";
  std::string dir = "runs/default";  // output folder: resolved config, metrics.jsonl
  int64_t seed = 1234;
};

// The model's own options (models/model.h: arch, vocab_size, dim, n_layers, n_heads, seq_len,
// ffn_hidden, norm, activation, positions, tie_embeddings, norm_eps, rope_theta, init_std,
// kernels, loss_chunk_tokens), its attention backend and how it is initialised.
struct ModelSection : ModelArgs {
  // The scaled-dot-product attention backend, chosen at start (engine/attention.h).
  AttentionBackend attention = AttentionBackend::kAuto;
  bool deferred_init = true;  // each rank creates only its shards (no full model anywhere)
  // A safetensors file to start from, read shard by shard, or a Hugging Face Llama folder (its
  // config.json sets the model keys left unset: engine/hf_llama.h).
  std::string init_from;
  // Glob patterns ('*', '?', '[...]') over parameter names, e.g. "tok_embeddings.*": matching
  // parameters are frozen (engine/freeze.h). Each pattern must match some parameter.
  std::vector<std::string> freeze;
};

struct DataSection {
  DataSource source = DataSource::kSynthetic;  // synthetic | tokens | text
  std::string path;                  // tokens: flat uint16/uint32 file; text: any file (bytes)
  TokenDtype token_dtype = TokenDtype::kUint16;  // uint16 | uint32 (tokens; no header)
  TokenHeader header = TokenHeader::kAuto;       // auto | llmc | none (tokens)
  double val_fraction = 0.05;        // held-out share of the data, at its end
  int64_t synthetic_tokens = 1 << 20;  // length of the synthetic stream
};

struct TrainingSection {
  int64_t steps = 200;
  int64_t micro_batch_size = 8;      // sequences per rank per micro-batch
  int64_t grad_accum_steps = 1;
  GradSync grad_sync = GradSync::kEvery;  // every | last
  double max_grad_norm = 1.0;        // <= 0: no clipping
  Precision mixed_precision = Precision::kFp32;  // fp32 | bf16 (compute dtype)
  Precision reduce_dtype = Precision::kFp32;     // fp32 | bf16 (gradient reduction)
  DeviceKind device = DeviceKind::kAuto;         // auto | cpu | cuda
  // Host tensor memory: caching (freed large blocks are reused, Note [Host caching]) | default
  // (libtorch's CPU allocator: glibc, so every large block is a fresh mmap).
  HostAllocator cpu_allocator = HostAllocator::kCaching;
  OnNonFinite on_nonfinite = OnNonFinite::kStop;  // stop | skip
  int64_t eval_interval = 50;        // steps; 0: never
  int64_t eval_batches = 4;
  int64_t log_interval = 10;
  // none | full | every:k | selective (sharding/options.h: ActivationCheckpointing).
  ActivationCheckpointing activation_checkpointing;
  // none | START:STEPS: a Kineto trace of STEPS steps from the 0-based step START
  // (engine/profiler.h), written to profile_dir ("": <run.dir>/profile) as rank<R>.json.
  ProfileWindow profile;
  std::string profile_dir;
  // Same bits when a run is repeated, on CUDA too (engine/trainer.cc, Note [Deterministic mode]).
  bool deterministic = false;
};

// name (adamw | adam | sgd), lr, weight_decay, beta1, beta2, eps, momentum, implementation
// (fused | foreach | per_tensor) (engine/optimizer.h).
using OptimizerSection = OptimizerOptions;

struct LrSchedulerSection {
  int64_t warmup_steps = 10;
  LrDecay decay = LrDecay::kCosine;  // cosine | linear | constant
  double min_lr = 3e-4;
};

struct ParallelismSection {
  int64_t nproc = 0;  // ranks when `fsdp train` starts its own; 0: GPUs, or 2 CPU ranks
  // Either degree may be -1 (inferred from the world size), not both.
  int64_t data_parallel_replicate_degree = 1;
  int64_t data_parallel_shard_degree = -1;
  // full_shard | shard_grad_op | hybrid_shard | hybrid_shard_zero2 | no_shard, or none
  // (nullopt): the plain model on one rank, no wrapper (the benchmarks' baseline,
  // engine/unwrapped.h).
  std::optional<Strategy> strategy = Strategy::kFullShard;
  ReshardPolicy reshard_after_forward;
  UnitPolicy wrap_policy;
  int64_t max_unsharded_units = 2;
  // false: each unit's unsharded (compute-dtype) parameters are gathered once per step and
  // kept until the last micro-batch's backward (sharding/fsdp_model.h: Note [Keeping parameters
  // across micro-batches]); costs the whole model's unsharded parameters per rank.
  bool reshard_between_micro_batches = true;
  CudaBackend backend = CudaBackend::kAuto;  // auto | nccl | gloo (CUDA tensors; CPU: gloo)
  // CPU all-gather / reduce-scatter: p2p (ring / direct exchange over Gloo's send/recv) | gloo
  // (c10d's Gloo collectives; its reduce-scatter is an all-reduce underneath).
  CpuCollectives cpu_collectives = CpuCollectives::kP2p;
  // none | optimizer | params: what lives in host memory (sharding/options.h: Offload).
  Offload offload = Offload::kNone;
  // off | on | after:N: with offload, the host's update of each step runs through the next step,
  // which uses the parameters from before it (one step stale; DeepSpeed's delayed parameter
  // update), from step N on (on: N = 0). Checkpoints, evaluations and the end of training see
  // every update (sharding/offload/host_step.h: Note [Delayed parameter update]).
  DelayedUpdate offload_delayed_update;
  // Seconds a collective may be waited on before the watchdog ends the rank naming it and the
  // ranks that did not arrive (device_mesh/watchdog.h); FSDP_COLLECTIVE_TIMEOUT_S overrides.
  int64_t collective_timeout_s = 600;

  // (replicate, shard) on `world_size` ranks, the -1 degree inferred (after ValidateForWorld).
  std::pair<int, int> MeshDegrees(int world_size) const;
  // strategy none: no FSDP wrapper.
  bool Unwrapped() const { return !strategy.has_value(); }
};

struct MetricsSection {
  bool jsonl = true;              // <run.dir>/metrics.jsonl
  // Per rank FLOP/s of a CPU, for MFU on CPU (there is no table for CPUs); 0: unset, no MFU.
  double cpu_peak_flops = 0;
  bool print_config = true;  // rank 0 prints the resolved configuration at start
  ProgressBarMode progress_bar = ProgressBarMode::kAuto;  // auto (on a terminal) | on | off
};

struct CheckpointSection {
  bool enabled = false;
  std::string dir;            // "": <run.dir>/checkpoints
  // Steps between saves; 0: only at the end. SIGTERM also saves, after the step that follows
  // the signal's (Note [SIGTERM at every step], engine/term_watch.h).
  int64_t interval = 0;
  int64_t keep_latest_k = 3;  // older committed checkpoints are removed; the newest never
  std::string load;           // "": start fresh; "latest": newest in dir (none: fresh); a path
  bool async = true;          // write shards in the background after a copy to host memory
  // Loading: false tolerates tensors in the checkpoint that the model does not have (e.g. a
  // deeper model's layers); true (default) refuses them, naming them.
  bool strict = true;
  // Loading: false loads the model's tensors only and starts the optimizer afresh (a different
  // optimizer, or fine-tuning); true requires the saved optimizer to be the configured one.
  bool load_optimizer = true;
};

struct RunConfig {
  std::string source_file;  // where it was read from
  // Where each key was set, by "section.key": "configs/x.yaml:12" or "--set model.attention=x".
  std::map<std::string, std::string, std::less<>> locations;
  RunSection run;
  ModelSection model;
  DataSection data;
  TrainingSection training;
  OptimizerSection optimizer;
  LrSchedulerSection lr_scheduler;
  ParallelismSection parallelism;
  MetricsSection metrics;
  CheckpointSection checkpoint;

  // Checks that need the world size: the degrees multiply to it (-1 inferred), and agree with
  // the strategy (full_shard / shard_grad_op: replicate 1; no_shard: shard 1; hybrid:
  // replicate >= 2).
  absl::Status ValidateForWorld(int world_size) const;
  // The resolved configuration as YAML (every key, defaults included).
  std::string ToYaml() const;
  // Where `key` was set, for errors found after loading (a check that needs the device or
  // the wrapped model): its location, or the source file when the key kept its default.
  std::string Where(std::string_view key) const;
  // One key's value as its YAML text ("training.mixed_precision" -> "bf16"), for what leaves
  // the process (the benchmark reference's spec, records); empty for an unknown key.
  std::string Value(std::string_view key) const;
};

// The one mapping from a run configuration to the engine's options, used by the trainer, the
// planner and the benchmarks: the strategy's defaults (OptionsForStrategy), the
// reshard_after_forward override, mixed precision and the prefetch limit. `strategy` is the
// configured one (trainer) or a candidate layout's (planner); kInvalidArgument when the reshard
// group size does not divide `shard_degree` strictly between 1 and it. `effective` names what
// runs when an override changes the strategy's behaviour ("shard_grad_op (full_shard with
// reshard_after_forward: false)"): checkpoints and plans record it.
struct ShardingPlan {
  FsdpOptions options;  // param_init left empty: the model's, set by the trainer
  std::string effective;
};
absl::StatusOr<ShardingPlan> ShardingPlanFor(const RunConfig& config, Strategy strategy,
                                             int shard_degree);

// Names for messages and records (the YAML spellings).
const char* StrategyLabel(const std::optional<Strategy>& strategy);  // "none" for nullopt
const char* DeviceKindName(DeviceKind device);
const char* CudaBackendName(CudaBackend backend);
const char* CpuCollectivesName(CpuCollectives collectives);

// Reads `path`, applies `overrides` ("section.key=value", YAML scalars), checks every key,
// type and value. kInvalidArgument with file:line (or the --set item) on any error; kNotFound
// if the file does not exist.
absl::StatusOr<RunConfig> LoadRunConfig(const std::string& path,
                                        const std::vector<std::string>& overrides);
// The same from YAML text (name is used in messages).
absl::StatusOr<RunConfig> ParseRunConfig(const std::string& yaml_text, const std::string& name,
                                         const std::vector<std::string>& overrides);

}  // namespace fsdp
