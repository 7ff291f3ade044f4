#include "engine/run_schema.h"

#include <climits>
#include <cstdint>
#include <string>

#include "common/strings.h"
#include "sharding/options.h"

namespace fsdp {
namespace {

// The spellings of the choices that appear only in the YAML, in the order "valid: ..." lists
// them (the others are in run_schema.h).
const EnumNames<NormKind>& NormNames() {
  static const EnumNames<NormKind> names = {{NormKind::kLayerNorm, "layernorm"},
                                            {NormKind::kRmsNorm, "rmsnorm"}};
  return names;
}
const EnumNames<Activation>& ActivationNames() {
  static const EnumNames<Activation> names = {{Activation::kGelu, "gelu"},
                                              {Activation::kSwiglu, "swiglu"}};
  return names;
}
const EnumNames<Positions>& PositionsNames() {
  static const EnumNames<Positions> names = {{Positions::kLearned, "learned"},
                                             {Positions::kRope, "rope"}};
  return names;
}
const EnumNames<KernelMode>& KernelModeNames() {
  static const EnumNames<KernelMode> names = {{KernelMode::kAuto, "auto"},
                                              {KernelMode::kFused, "fused"},
                                              {KernelMode::kComposite, "composite"}};
  return names;
}
const EnumNames<AttentionBackend>& AttentionNames() {
  static const EnumNames<AttentionBackend> names =
      EnumNames<AttentionBackend>::Of(AttentionBackends(), AttentionBackendName);
  return names;
}
const EnumNames<DataSource>& DataSourceNames() {
  static const EnumNames<DataSource> names = {{DataSource::kSynthetic, "synthetic"},
                                              {DataSource::kTokens, "tokens"},
                                              {DataSource::kText, "text"}};
  return names;
}
const EnumNames<TokenDtype>& TokenDtypeNames() {
  static const EnumNames<TokenDtype> names = {{TokenDtype::kUint16, "uint16"},
                                              {TokenDtype::kUint32, "uint32"}};
  return names;
}
const EnumNames<TokenHeader>& TokenHeaderNames() {
  static const EnumNames<TokenHeader> names = {
      {TokenHeader::kAuto, "auto"}, {TokenHeader::kLlmc, "llmc"}, {TokenHeader::kNone, "none"}};
  return names;
}
const EnumNames<GradSync>& GradSyncNames() {
  static const EnumNames<GradSync> names = {{GradSync::kEvery, "every"}, {GradSync::kLast, "last"}};
  return names;
}
const EnumNames<HostAllocator>& HostAllocatorNames() {
  static const EnumNames<HostAllocator> names = {{HostAllocator::kCaching, "caching"},
                                                 {HostAllocator::kDefault, "default"}};
  return names;
}
const EnumNames<OnNonFinite>& OnNonFiniteNames() {
  static const EnumNames<OnNonFinite> names = {{OnNonFinite::kStop, "stop"},
                                               {OnNonFinite::kSkip, "skip"}};
  return names;
}
const EnumNames<OptimizerKind>& OptimizerKindTable() {
  // The names are literals (engine/optimizer.cc), so their data() ends in a NUL.
  static const EnumNames<OptimizerKind> names = EnumNames<OptimizerKind>::Of(
      {OptimizerKind::kAdamW, OptimizerKind::kAdam, OptimizerKind::kSgd},
      [](OptimizerKind kind) { return OptimizerKindName(kind).data(); });
  return names;
}
const EnumNames<OptimizerImplementation>& OptimizerImplementationTable() {
  static const EnumNames<OptimizerImplementation> names = EnumNames<OptimizerImplementation>::Of(
      {OptimizerImplementation::kFused, OptimizerImplementation::kForeach,
       OptimizerImplementation::kPerTensor},
      [](OptimizerImplementation i) { return OptimizerImplementationName(i).data(); });
  return names;
}
const EnumNames<LrDecay>& LrDecayNames() {
  static const EnumNames<LrDecay> names = {
      {LrDecay::kCosine, "cosine"}, {LrDecay::kLinear, "linear"}, {LrDecay::kConstant, "constant"}};
  return names;
}
const EnumNames<Offload>& OffloadNames() {
  // sharding/options.cc holds the names.
  static const EnumNames<Offload> names =
      EnumNames<Offload>::Of({Offload::kNone, Offload::kOptimizer, Offload::kParams}, OffloadName);
  return names;
}
const EnumNames<ProgressBarMode>& ProgressBarNames() {
  static const EnumNames<ProgressBarMode> names = {{ProgressBarMode::kAuto, "auto"},
                                                   {ProgressBarMode::kOn, "on"},
                                                   {ProgressBarMode::kOff, "off"}};
  return names;
}

constexpr std::string_view kReshardValid =
    "default, true, false, or an integer k with 1 < k < the shard degree, dividing it "
    "(reshard to groups of k ranks)";

ChoiceField ReshardField(ReshardPolicy* field) {
  using Kind = ReshardPolicy::Kind;
  return {[field](const std::string& text) -> std::optional<std::string> {
            if (text == "default" || text == "true" || text == "false") {
              field->kind = text == "default" ? Kind::kDefault
                            : text == "true"  ? Kind::kAlways
                                              : Kind::kNever;
              field->group_size = 0;
              return std::nullopt;
            }
            std::optional<int64_t> k = ParseInt<int64_t>(text);
            if (!k || *k < 2 || *k > INT_MAX) {
              return NotValid(text, {"default", "true", "false"}, kReshardValid);
            }
            *field = {Kind::kGroup, static_cast<int>(*k)};
            return std::nullopt;
          },
          [field]() -> std::string {
            switch (field->kind) {
              case Kind::kDefault:
                return "default";
              case Kind::kAlways:
                return "true";
              case Kind::kNever:
                return "false";
              case Kind::kGroup:
                break;
            }
            return StrCat(field->group_size);
          }};
}

ChoiceField UnitPolicyField(UnitPolicy* field) {
  return {[field](const std::string& text) -> std::optional<std::string> {
            if (text == "block") {
              *field = {};
              return std::nullopt;
            }
            std::optional<int64_t> n;
            if (StartsWith(text, "params:"))
              n = ParseInt<int64_t>(std::string_view(text).substr(7));
            if (!n || *n < 1) {
              return NotValid(text, {"block"},
                              "block, params:N (children with >= N parameters, N >= 1)");
            }
            *field = {UnitPolicy::Kind::kMinParams, *n};
            return std::nullopt;
          },
          [field] {
            return field->kind == UnitPolicy::Kind::kBlock ? std::string("block")
                                                           : StrCat("params:", field->min_params);
          }};
}

ChoiceField CheckpointingField(ActivationCheckpointing* field) {
  using Mode = ActivationCheckpointing::Mode;
  return {[field](const std::string& text) -> std::optional<std::string> {
            if (text == "none" || text == "full" || text == "selective") {
              *field = {text == "none"   ? Mode::kNone
                        : text == "full" ? Mode::kFull
                                         : Mode::kSelective,
                        1};
              return std::nullopt;
            }
            std::optional<int64_t> k;
            if (StartsWith(text, "every:")) k = ParseInt<int64_t>(std::string_view(text).substr(6));
            if (!k || *k < 1 || *k > INT_MAX) {
              return NotValid(text, {"none", "full", "selective"},
                              "none, full, selective, every:k (every k-th block, k >= 1)");
            }
            *field = {Mode::kFull, static_cast<int>(*k)};
            return std::nullopt;
          },
          [field]() -> std::string {
            switch (field->mode) {
              case Mode::kNone:
                return "none";
              case Mode::kSelective:
                return "selective";
              case Mode::kFull:
                break;
            }
            return field->every == 1 ? std::string("full") : StrCat("every:", field->every);
          }};
}

ChoiceField ProfileField(ProfileWindow* field) {
  return {[field](const std::string& text) -> std::optional<std::string> {
            std::optional<ProfileWindow> window = ParseProfileWindow(text);
            if (!window) {
              return NotValid(text, {"none"},
                              "none, or START:STEPS (profile STEPS >= 1 steps from the 0-based "
                              "step START, e.g. 10:3)");
            }
            *field = *window;
            return std::nullopt;
          },
          [field]() { return field->ToString(); }};
}

ChoiceField DelayedUpdateField(DelayedUpdate* field) {
  return {[field](const std::string& text) -> std::optional<std::string> {
            if (text == "off" || text == "on") {
              *field = {.enabled = text == "on", .after = 0};
              return std::nullopt;
            }
            std::optional<int64_t> n;
            if (StartsWith(text, "after:")) n = ParseInt<int64_t>(std::string_view(text).substr(6));
            if (!n || *n < 0) {
              const bool boolean = text == "true" || text == "false";
              return StrCat(NotValid(text, {"off", "on"},
                                     "off, on, after:N (the first N >= 0 steps undelayed)"),
                            boolean ? StrCat(" (write ", text == "true" ? "on" : "off", ")") : "");
            }
            *field = {.enabled = true, .after = *n};
            return std::nullopt;
          },
          [field]() -> std::string {
            if (!field->enabled) return "off";
            return field->after == 0 ? std::string("on") : StrCat("after:", field->after);
          }};
}

constexpr RemovedKey kRemovedKeys[] = {
    {"parallelism.offload_overlap_step",
     "was removed: the overlapped host step is always on (the same values bit for bit); "
     "FSDP_OFFLOAD_OVERLAP_STEP=0 turns it off for debugging"},
    {"parallelism.offload_compute_copy",
     "was removed: offload params keeps the compute-dtype copy on the host unless host memory "
     "only fits without it (the start line prints the choice); FSDP_OFFLOAD_COMPUTE_COPY=0|1 "
     "forces it for debugging"},
    {"parallelism.offload_delayed_update_warmup",
     "was removed: write parallelism.offload_delayed_update: after:N"},
};

}  // namespace

const EnumNames<Precision>& PrecisionNames() {
  static const EnumNames<Precision> names = {{Precision::kFp32, "fp32"},
                                             {Precision::kBf16, "bf16"}};
  return names;
}
const EnumNames<DeviceKind>& DeviceKindNames() {
  static const EnumNames<DeviceKind> names = {
      {DeviceKind::kAuto, "auto"}, {DeviceKind::kCpu, "cpu"}, {DeviceKind::kCuda, "cuda"}};
  return names;
}
const EnumNames<CudaBackend>& CudaBackendNames() {
  static const EnumNames<CudaBackend> names = {
      {CudaBackend::kAuto, "auto"}, {CudaBackend::kNccl, "nccl"}, {CudaBackend::kGloo, "gloo"}};
  return names;
}
const EnumNames<CpuCollectives>& CpuCollectivesNames() {
  static const EnumNames<CpuCollectives> names = {{CpuCollectives::kP2p, "p2p"},
                                                  {CpuCollectives::kGloo, "gloo"}};
  return names;
}
const EnumNames<std::optional<Strategy>>& StrategyNames() {
  // sharding/options.cc holds the strategies' names; "none" is the run's (no wrapper).
  static const EnumNames<std::optional<Strategy>> names = EnumNames<std::optional<Strategy>>::Of(
      {Strategy::kFullShard, Strategy::kShardGradOp, Strategy::kHybridShard,
       Strategy::kHybridShardZero2, Strategy::kNoShard, std::nullopt},
      [](const std::optional<Strategy>& s) { return s ? StrategyName(*s) : "none"; });
  return names;
}

std::span<const RemovedKey> RemovedRunKeys() { return kRemovedKeys; }

std::vector<Section> RunSections(RunConfig& c) {
  return {
      {"run", {{"name", &c.run.name}, {"dir", &c.run.dir}, {"seed", &c.run.seed}}},
      {"model",
       {{"arch", &c.model.arch},
        {"vocab_size", &c.model.vocab_size},
        {"dim", &c.model.dim},
        {"n_layers", &c.model.n_layers},
        {"n_heads", &c.model.n_heads},
        {"n_kv_heads", &c.model.n_kv_heads},
        {"seq_len", &c.model.seq_len},
        {"ffn_hidden", &c.model.ffn_hidden},
        {"norm", Enum(&c.model.norm, NormNames())},
        {"activation", Enum(&c.model.activation, ActivationNames())},
        {"positions", Enum(&c.model.positions, PositionsNames())},
        {"tie_embeddings", &c.model.tie_embeddings},
        {"norm_eps", &c.model.norm_eps},
        {"rope_theta", &c.model.rope_theta},
        {"init_std", &c.model.init_std},
        {"kernels", Enum(&c.model.kernels, KernelModeNames())},
        {"loss_chunk_tokens", &c.model.loss_chunk_tokens},
        {"attention", Enum(&c.model.attention, AttentionNames())},
        {"deferred_init", &c.model.deferred_init},
        {"init_from", &c.model.init_from},
        {"freeze", &c.model.freeze}}},
      {"data",
       {{"source", Enum(&c.data.source, DataSourceNames())},
        {"path", &c.data.path},
        {"token_dtype", Enum(&c.data.token_dtype, TokenDtypeNames())},
        {"header", Enum(&c.data.header, TokenHeaderNames())},
        {"val_fraction", &c.data.val_fraction},
        {"synthetic_tokens", &c.data.synthetic_tokens}}},
      {"training",
       {{"steps", &c.training.steps},
        {"micro_batch_size", &c.training.micro_batch_size},
        {"grad_accum_steps", &c.training.grad_accum_steps},
        {"grad_sync", Enum(&c.training.grad_sync, GradSyncNames())},
        {"max_grad_norm", &c.training.max_grad_norm},
        {"mixed_precision", Enum(&c.training.mixed_precision, PrecisionNames())},
        {"reduce_dtype", Enum(&c.training.reduce_dtype, PrecisionNames())},
        {"device", Enum(&c.training.device, DeviceKindNames())},
        {"cpu_allocator", Enum(&c.training.cpu_allocator, HostAllocatorNames())},
        {"on_nonfinite", Enum(&c.training.on_nonfinite, OnNonFiniteNames())},
        {"eval_interval", &c.training.eval_interval},
        {"eval_batches", &c.training.eval_batches},
        {"log_interval", &c.training.log_interval},
        {"activation_checkpointing", CheckpointingField(&c.training.activation_checkpointing)},
        {"profile", ProfileField(&c.training.profile)},
        {"profile_dir", &c.training.profile_dir},
        {"deterministic", &c.training.deterministic}}},
      {"optimizer",
       {{"name", Enum(&c.optimizer.kind, OptimizerKindTable())},
        {"lr", &c.optimizer.lr},
        {"weight_decay", &c.optimizer.weight_decay},
        {"beta1", &c.optimizer.beta1},
        {"beta2", &c.optimizer.beta2},
        {"eps", &c.optimizer.eps},
        {"momentum", &c.optimizer.momentum},
        {"implementation", Enum(&c.optimizer.implementation, OptimizerImplementationTable())}}},
      {"lr_scheduler",
       {{"warmup_steps", &c.lr_scheduler.warmup_steps},
        {"decay", Enum(&c.lr_scheduler.decay, LrDecayNames())},
        {"min_lr", &c.lr_scheduler.min_lr}}},
      {"parallelism",
       {{"nproc", &c.parallelism.nproc},
        {"data_parallel_replicate_degree", &c.parallelism.data_parallel_replicate_degree},
        {"data_parallel_shard_degree", &c.parallelism.data_parallel_shard_degree},
        {"strategy", Enum(&c.parallelism.strategy, StrategyNames())},
        {"reshard_after_forward", ReshardField(&c.parallelism.reshard_after_forward)},
        {"wrap_policy", UnitPolicyField(&c.parallelism.wrap_policy)},
        {"max_unsharded_units", &c.parallelism.max_unsharded_units},
        {"reshard_between_micro_batches", &c.parallelism.reshard_between_micro_batches},
        {"backend", Enum(&c.parallelism.backend, CudaBackendNames())},
        {"cpu_collectives", Enum(&c.parallelism.cpu_collectives, CpuCollectivesNames())},
        {"offload", Enum(&c.parallelism.offload, OffloadNames())},
        {"offload_delayed_update", DelayedUpdateField(&c.parallelism.offload_delayed_update)},
        {"collective_timeout_s", &c.parallelism.collective_timeout_s}}},
      {"metrics",
       {{"jsonl", &c.metrics.jsonl},
        {"cpu_peak_flops", &c.metrics.cpu_peak_flops},
        {"print_config", &c.metrics.print_config},
        {"progress_bar", Enum(&c.metrics.progress_bar, ProgressBarNames())}}},
      {"checkpoint",
       {{"enabled", &c.checkpoint.enabled},
        {"dir", &c.checkpoint.dir},
        {"interval", &c.checkpoint.interval},
        {"keep_latest_k", &c.checkpoint.keep_latest_k},
        {"load", &c.checkpoint.load},
        {"async", &c.checkpoint.async},
        {"strict", &c.checkpoint.strict},
        {"load_optimizer", &c.checkpoint.load_optimizer}}},
  };
}

}  // namespace fsdp
