// Internal to planner/: what EnumerateLayouts and Recommend share so that one search (thousands
// of predictions: layouts x checkpointing x offload, again for each no-fit change it tries)
// counts the model once. CountModel walks every unit, so a 100,000-block model would otherwise
// cost a millisecond per prediction; a CountedModel keeps the units as runs of identical ones,
// and a prediction from it costs the same for any number of blocks.
//
//   CountedModel model = CountedModel::Of(request.config.model);
//   for (const Layout& layout : LayoutsFor(request.world_size))
//     absl::StatusOr<Prediction> p = PredictCounted(request, layout, model);
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "planner/cost_model.h"

namespace fsdp::plan {

struct CountedModel {
  ModelCounts counts;
  const ModelFamily* family = nullptr;
  // The units in forward order as runs of units with the same shapes (the root first): one run
  // of blocks for the GPT family, however many layers.
  struct Run {
    size_t first_unit;  // index into counts.unit_shapes
    int64_t count;
  };
  std::vector<Run> runs;
  int num_blocks = 0;

  static CountedModel Of(const ModelArgs& model);
};

// Every layout of `world` ranks as EnumerateLayouts lists them: full_shard, shard_grad_op,
// no_shard, then hybrid_shard / hybrid_shard_zero2 for every divisor 1 < S < world (found in
// O(sqrt(world))).
std::vector<Layout> LayoutsFor(int world);

// Note [Checkpointed activations] in activations.cc, per token of a micro-batch: what a block
// keeps until its backward (none: not checkpointed; kept: checkpointed), what its backward adds
// (transient: every block; recompute_extra: a checkpointed one) and the head's activations.
struct BlockBytes {
  double none = 0, kept = 0, transient = 0, recompute_extra = 0, head = 0;
};
struct BlockPeak {
  double activations = 0;  // per token, the most at any moment of the backward
  double with_grads = 0;   // tokens x activations + the gradient shards written, at its largest
  int64_t checkpointed = 0;
};
// The peak over the start of backward and each block's backward, with `grad_per_block` bytes of
// gradient shard written per block already through (0 when they are all alive anyway). Only
// the few blocks where a largest moment can lie, unless `every_block` (the tests' reference).
BlockPeak PeakOfBlocks(const BlockBytes& bytes, const ActivationCheckpointing& ac,
                       int64_t num_blocks, double tokens, double grad_per_block,
                       bool every_block = false);

// Activations per token (Note [Checkpointed activations] in activations.cc) of a micro-batch of
// `tokens` tokens, with `grad_per_block` bytes of gradient shard written per block through the
// backward.
struct Activations {
  double peak = 0;             // bytes per token at the moment with the most activations
  double peak_with_grads = 0;  // bytes: the largest activations + gradient shards written
  double none_total = 0;       // bytes per token without checkpointing (the traffic model)
  double recompute_flops = 0;  // per token
  double recompute_bytes = 0;  // per token materialised again
};
Activations CheckpointedActivations(const ModelArgs& model, const ModelFamily& family,
                                    const ModelCounts& counts, const ActivationCheckpointing& ac,
                                    int num_blocks, double cb, double tokens,
                                    double grad_per_block);

// Predict and EnumerateLayouts with the model counted already (`model` must be the request's).
absl::StatusOr<Prediction> PredictCounted(const PlanRequest& request, const Layout& layout,
                                          const CountedModel& model);
absl::StatusOr<std::vector<Prediction>> EnumerateCounted(const PlanRequest& request,
                                                         const CountedModel& model);

}  // namespace fsdp::plan
