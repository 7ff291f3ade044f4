// The search's shared parts: the model counted once, the layouts of a world size, every layout
// predicted, and the request `fsdp plan` checks before predicting.
#include <algorithm>
#include <limits>
#include <string>
#include <vector>

#include "common/strings.h"
#include "planner/search.h"

namespace fsdp::plan {

CountedModel CountedModel::Of(const ModelArgs& model) {
  CountedModel m;
  m.counts = CountModel(model);
  m.family = FindModelFamily(model.arch);
  const auto& units = m.counts.unit_shapes;
  m.num_blocks = static_cast<int>(units.size()) - 1;
  for (size_t u = 0; u < units.size(); ++u) {
    // The root is a run of its own, even if a block had its shapes.
    if (u > 1 && units[u] == units[m.runs.back().first_unit]) {
      ++m.runs.back().count;
    } else {
      m.runs.push_back({u, 1});
    }
  }
  return m;
}

std::vector<Layout> LayoutsFor(int world) {
  std::vector<Layout> layouts;
  layouts.push_back({Strategy::kFullShard, 1, world});
  if (world > 1) {
    layouts.push_back({Strategy::kShardGradOp, 1, world});
    layouts.push_back({Strategy::kNoShard, world, 1});
  }
  std::vector<int> shards;  // 1 < S < world dividing world, ascending
  for (int64_t d = 2; d * d <= world; ++d) {
    if (world % d != 0) continue;
    shards.push_back(static_cast<int>(d));
    if (d * d != world) shards.push_back(static_cast<int>(world / d));
  }
  std::sort(shards.begin(), shards.end());
  for (int s : shards) {
    layouts.push_back({Strategy::kHybridShard, world / s, s});
    layouts.push_back({Strategy::kHybridShardZero2, world / s, s});
  }
  return layouts;
}

absl::StatusOr<std::vector<Prediction>> EnumerateLayouts(const PlanRequest& request) {
  return EnumerateCounted(request, CountedModel::Of(request.config.model));
}

absl::StatusOr<std::vector<Prediction>> EnumerateCounted(const PlanRequest& request,
                                                         const CountedModel& model) {
  const int world = request.world_size;
  if (request.gpus_per_node < 1 || world < 1 || world % request.gpus_per_node != 0) {
    return absl::InvalidArgumentError(StrCat(
        "--world-size ", world, " is not a multiple of --gpus-per-node ", request.gpus_per_node));
  }
  std::vector<Prediction> out;
  absl::Status rejected;
  for (const Layout& layout : LayoutsFor(world)) {
    // A layout the configuration's options do not fit (a reshard_after_forward group size k
    // must divide its shard degree) is not a candidate; any other error is the request's.
    if (absl::Status fits = ShardingPlanFor(request.config, layout.strategy, layout.shard).status();
        !fits.ok()) {
      if (rejected.ok()) rejected = fits;
      continue;
    }
    absl::StatusOr<Prediction> p = PredictCounted(request, layout, model);
    if (!p.ok()) return p.status();
    out.push_back(*std::move(p));
  }
  if (out.empty()) {
    // As `fsdp train` would refuse it on these ranks, whatever the layout.
    return absl::InvalidArgumentError(StrCat(
        std::string(rejected.message()), " (", StrategyName(Strategy::kFullShard), " 1x", world,
        "), and no other layout of ", world, world == 1 ? " rank" : " ranks", " allows it"));
  }
  std::stable_sort(out.begin(), out.end(), [](const Prediction& a, const Prediction& b) {
    if (a.fits != b.fits) return a.fits;
    return a.time.tokens_per_s > b.time.tokens_per_s;
  });
  return out;
}

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
    const int64_t nodes = world_size / gpus_per_node;
    int64_t full = (nodes + 1) * gpus_per_node;
    if (full > std::numeric_limits<int>::max()) full = nodes * gpus_per_node;
    return absl::InvalidArgumentError(
        StrCat("--world-size ", world_size, " is not a multiple of --gpus-per-node ", gpus_per_node,
               " (nodes must be full",
               full > 0 ? StrCat("; e.g. --world-size ", full) : std::string(), ")"));
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
  // As `fsdp train` refuses it (engine/trainer.cc): checkpointing that applies to no block.
  const ActivationCheckpointing& ac = request.config.training.activation_checkpointing;
  const int64_t blocks =
      static_cast<int64_t>(CountModel(request.config.model).unit_params.size()) - 1;
  if (ac.enabled() && blocks == 0) {
    return absl::InvalidArgumentError(
        StrCat("training.activation_checkpointing: ", CheckpointingName(ac),
               " has no unit to checkpoint: the model has no blocks"));
  }
  if (ac.mode == ActivationCheckpointing::Mode::kFull && ac.every > blocks) {
    return absl::InvalidArgumentError(
        StrCat("training.activation_checkpointing: every:", ac.every,
               " checkpoints none of the model's ", blocks,
               " unit(s) (every:k checkpoints units k, 2k, ...); valid here: full, selective, "
               "every:1 to every:",
               blocks, ", or none"));
  }
  const Precision precision = request.config.training.mixed_precision;
  if (!(PeakRate(request.hw, precision) > 0)) {
    return absl::InvalidArgumentError(StrCat(
        hardware_file.empty() ? StrCat("--gpu ", gpu) : StrCat("--hardware ", hardware_file),
        ": peak_flops_fp32 must be > 0 for training.mixed_precision ", PrecisionName(precision),
        precision == Precision::kBf16 ? " (peak_flops_bf16 is 0 too)"
                                      : " (peak_flops_bf16 counts for bf16 runs only)"));
  }
  return request;
}

}  // namespace fsdp::plan
