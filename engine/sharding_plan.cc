// ShardingPlanFor (engine/config.h): a run configuration and a strategy to the engine's options.
#include <optional>
#include <string>

#include "common/env_knobs.h"
#include "common/status.h"
#include "common/strings.h"
#include "engine/config.h"
#include "engine/config_validate.h"
#include "sharding/options.h"

namespace fsdp {
namespace {

// A 0/1 debugging knob: nullopt when unset.
absl::StatusOr<std::optional<bool>> BinaryKnob(const EnvKnob& knob) {
  std::optional<std::string> value = GetEnvKnob(knob);
  if (!value) return std::optional<bool>();
  if (*value != "0" && *value != "1") {
    return absl::InvalidArgumentError(
        StrCat(knob.name, "=", *value, " is not valid; valid: ", knob.valid));
  }
  return std::optional<bool>(*value == "1");
}

// The reshard_after_forward override on the strategy's default. See Note [Reshard group size]
// (engine/config_validate.h).
absl::Status ApplyReshard(const ReshardPolicy& reshard, int shard_degree, FsdpOptions& options) {
  switch (reshard.kind) {
    case ReshardPolicy::Kind::kDefault:
      break;
    case ReshardPolicy::Kind::kAlways:
      options.reshard_after_forward = true;
      break;
    case ReshardPolicy::Kind::kNever:
      options.reshard_after_forward = false;
      break;
    case ReshardPolicy::Kind::kGroup:
      FSDP_RETURN_IF_ERROR(
          CheckReshardGroup(reshard, shard_degree, StrCat("got shard degree ", shard_degree)));
      options.reshard_after_forward = true;
      options.reshard_group_size = reshard.group_size;
      break;
  }
  return absl::OkStatus();
}

// The offload options, with the debugging knobs (FSDP_OFFLOAD_OVERLAP_STEP,
// FSDP_OFFLOAD_COMPUTE_COPY) that the delayed update cannot go with.
absl::Status ApplyOffload(const ParallelismSection& p, FsdpOptions& options) {
  options.offload = p.offload;
  options.offload_delayed_update = p.offload_delayed_update.enabled;
  FSDP_ASSIGN_OR_RETURN(std::optional<bool> overlap, BinaryKnob(kOffloadOverlapStep));
  options.offload_overlap_step = overlap.value_or(true);
  FSDP_ASSIGN_OR_RETURN(std::optional<bool> copy, BinaryKnob(kOffloadComputeCopy));
  options.offload_compute_copy = !copy   ? ComputeCopy::kAuto
                                 : *copy ? ComputeCopy::kKeep
                                         : ComputeCopy::kDrop;
  if (options.offload_delayed_update && (!options.offload_overlap_step || copy == false)) {
    return absl::InvalidArgumentError(StrCat(
        "parallelism.offload_delayed_update cannot go with ",
        !options.offload_overlap_step
            ? StrCat(kOffloadOverlapStep.name, "=0 (the delayed update is an overlapped step)")
            : StrCat(kOffloadComputeCopy.name,
                     "=0 (the next step loads the copies while the delayed update writes the "
                     "masters)"),
        "; unset the variable or set the key off"));
  }
  return absl::OkStatus();
}

// What runs, named by the strategy that means it: an override that flips resharding turns
// full_shard into shard_grad_op (and back), hybrid_shard into hybrid_shard_zero2.
std::string EffectiveName(Strategy strategy, const FsdpOptions& options) {
  std::string effective = StrategyName(strategy);
  const bool strategy_reshards = OptionsForStrategy(strategy).reshard_after_forward;
  const bool ddp = strategy == Strategy::kNoShard;
  if (!ddp && options.reshard_after_forward != strategy_reshards) {
    const bool hybrid =
        strategy == Strategy::kHybridShard || strategy == Strategy::kHybridShardZero2;
    Strategy ran = options.reshard_after_forward
                       ? (hybrid ? Strategy::kHybridShard : Strategy::kFullShard)
                       : (hybrid ? Strategy::kHybridShardZero2 : Strategy::kShardGradOp);
    effective = StrCat(StrategyName(ran), " (", StrategyName(strategy),
                       " with parallelism.reshard_after_forward: ",
                       options.reshard_after_forward ? "true" : "false", ")");
  }
  if (!ddp && options.reshard_group_size > 0) {
    effective += StrCat(", resharded to groups of ", options.reshard_group_size, " after forward");
  }
  if (!options.reshard_between_micro_batches) {
    effective += ", unsharded parameters kept through the step";
  }
  return effective;
}

}  // namespace

absl::StatusOr<ShardingPlan> ShardingPlanFor(const RunConfig& config, Strategy strategy,
                                             int shard_degree) {
  ShardingPlan plan;
  FsdpOptions& options = plan.options;
  options = OptionsForStrategy(strategy);
  FSDP_RETURN_IF_ERROR(
      ApplyReshard(config.parallelism.reshard_after_forward, shard_degree, options));
  options.max_unsharded_units = static_cast<int>(config.parallelism.max_unsharded_units);
  options.activation_checkpointing = config.training.activation_checkpointing;
  FSDP_RETURN_IF_ERROR(ApplyOffload(config.parallelism, options));
  options.reshard_between_micro_batches = config.parallelism.reshard_between_micro_batches;
  const TrainingSection& t = config.training;
  if (t.mixed_precision == Precision::kBf16) {
    options.mixed_precision.param_dtype = c10::kBFloat16;
    options.mixed_precision.output_dtype = c10::kFloat;
  }
  options.mixed_precision.reduce_dtype = ScalarTypeOf(t.reduce_dtype);
  plan.effective = EffectiveName(strategy, options);
  return plan;
}

}  // namespace fsdp
