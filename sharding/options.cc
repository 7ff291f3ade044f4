#include "sharding/options.h"

#include "common/strings.h"

namespace fsdp {

absl::StatusOr<Strategy> ParseStrategy(std::string_view name) {
  static const std::pair<const char*, Strategy> kNames[] = {
      {"full_shard", Strategy::kFullShard},
      {"shard_grad_op", Strategy::kShardGradOp},
      {"hybrid_shard", Strategy::kHybridShard},
      {"hybrid_shard_zero2", Strategy::kHybridShardZero2},
      {"no_shard", Strategy::kNoShard},
  };
  for (const auto& [n, s] : kNames) {
    if (name == n) return s;
  }
  return absl::InvalidArgumentError(StrCat(
      "strategy '", name,
      "' is not valid; valid: full_shard, shard_grad_op, hybrid_shard, hybrid_shard_zero2, "
      "no_shard"));
}

const char* StrategyName(Strategy strategy) {
  switch (strategy) {
    case Strategy::kFullShard: return "full_shard";
    case Strategy::kShardGradOp: return "shard_grad_op";
    case Strategy::kHybridShard: return "hybrid_shard";
    case Strategy::kHybridShardZero2: return "hybrid_shard_zero2";
    case Strategy::kNoShard: return "no_shard";
  }
  return "?";
}

const char* OffloadName(Offload offload) {
  switch (offload) {
    case Offload::kNone: return "none";
    case Offload::kOptimizer: return "optimizer";
    case Offload::kParams: return "params";
  }
  return "?";
}

FsdpOptions OptionsForStrategy(Strategy strategy) {
  FsdpOptions options;
  options.reshard_after_forward =
      strategy == Strategy::kFullShard || strategy == Strategy::kHybridShard;
  return options;
}

absl::StatusOr<MeshShape> MeshShapeForStrategy(Strategy strategy, int world_size, int replicate,
                                               int shard) {
  switch (strategy) {
    case Strategy::kFullShard:
    case Strategy::kShardGradOp:
      return ResolveMeshShape({"replicate", "shard"}, {1, world_size}, world_size);
    case Strategy::kNoShard:
      return ResolveMeshShape({"replicate", "shard"}, {world_size, 1}, world_size);
    case Strategy::kHybridShard:
    case Strategy::kHybridShardZero2:
      if (replicate == -1 && shard == -1) {
        return absl::InvalidArgumentError(StrCat(
            StrategyName(strategy),
            " needs the replicate or the shard degree (e.g. shard = GPUs per node)"));
      }
      return ResolveMeshShape({"replicate", "shard"}, {replicate, shard}, world_size);
  }
  return absl::InvalidArgumentError("unknown strategy");
}

}  // namespace fsdp
