// The activation memory and recompute of a micro-batch under activation checkpointing.
#include <algorithm>
#include <string>

#include "common/strings.h"
#include "planner/search.h"

namespace fsdp::plan {

// Note [Checkpointed activations]
// Per micro-batch and token, block i keeps kept(i) from its forward to its backward: everything
// autograd saves (BlockActivationBytes::none) when it is not checkpointed; when it is
// (ActivationCheckpointing::Applies), its input (full, every:k) or its input and matmul outputs
// (selective). The peak is the largest of these moments:
//   start of backward: sum_i kept(i) + the head's activations (logits, fp32 loss copies and
//     their gradients, freed once the head's backward is done);
//   backward of block j (the blocks after j and the head freed by then): sum_{i < j} kept(i) +
//     none + T, plus X when j is checkpointed (Note [Recompute and backward bytes] in
//     models/gpt/gpt_counts.cc); without
//     accumulation the gradient shards of the blocks after j are written by then too.
// A block moment grows with j by the kept bytes and shrinks by a block's gradient shard, the
// same amounts in every period of k blocks, so for every:k the largest lies at an end of the
// first period, of the last full period or of the tail, or at the first or last checkpointed
// block: BlockPeak evaluates those (eight at most), whatever the number of blocks.
// Recompute per micro-batch: full re-runs each checkpointed block's forward (a third of its
// training FLOPs); selective re-runs the attention core's forward (a third of
// block_attention_flops_per_token) and the elementwise ops, no projection.
//
Activations CheckpointedActivations(const ModelArgs& model, const ModelFamily& family,
                                    const ModelCounts& counts, const ActivationCheckpointing& ac,
                                    int num_blocks, double cb, double tokens,
                                    double grad_per_block) {
  // Note [Recompute and backward bytes] (models/gpt/gpt_counts.cc): T and X.
  const BlockActivationBytes block = family.block_activation_bytes(model, cb);
  const bool selective = ac.mode == ActivationCheckpointing::Mode::kSelective;
  BlockBytes bytes;
  bytes.none = block.none;
  bytes.kept = selective ? block.selective : block.full;
  bytes.transient = block.backward_transient;
  bytes.recompute_extra = block.recompute_output + block.recompute_input_unkept +
                          (selective ? block.selective_unkept : 0);
  bytes.head = family.head_bytes_per_token(model, cb);
  const BlockPeak peak = PeakOfBlocks(bytes, ac, num_blocks, tokens, grad_per_block);
  Activations a;
  a.peak = peak.activations;
  a.peak_with_grads = peak.with_grads;
  a.none_total = num_blocks * block.none + bytes.head;
  const double checkpointed = static_cast<double>(peak.checkpointed);
  a.recompute_flops = checkpointed * (selective ? counts.block_attention_flops_per_token / 3
                                                : counts.block_flops_per_token / 3);
  a.recompute_bytes = checkpointed * std::max(0.0, block.none - bytes.kept);
  return a;
}


BlockPeak PeakOfBlocks(const BlockBytes& b, const ActivationCheckpointing& ac, int64_t num_blocks,
                       double tokens, double grad_per_block, bool every_block) {
  using Mode = ActivationCheckpointing::Mode;
  // Checkpointed: the blocks with index % k == k - 1 (k = 1: all of them; k = 0: none).
  const int64_t k = ac.mode == Mode::kNone ? 0 : ac.mode == Mode::kSelective ? 1 : ac.every;
  BlockPeak peak;
  peak.checkpointed = k > 0 ? num_blocks / k : 0;
  auto checkpointed = [&](int64_t j) { return k > 0 && j % k == k - 1; };
  auto kept_before = [&](int64_t j) {
    const double n = k > 0 ? static_cast<double>(j / k) : 0;  // checkpointed blocks before j
    return static_cast<double>(j) * b.none - n * (b.none - b.kept);
  };
  auto consider = [&](double activations, double grads) {
    peak.activations = std::max(peak.activations, activations);
    peak.with_grads = std::max(peak.with_grads, tokens * activations + grads);
  };
  consider(kept_before(num_blocks) + b.head, 0);  // the start of backward
  auto block_moment = [&](int64_t j) {
    if (j < 0 || j >= num_blocks) return;
    consider(kept_before(j) + b.none + b.transient + (checkpointed(j) ? b.recompute_extra : 0),
             static_cast<double>(num_blocks - 1 - j) * grad_per_block);
  };
  if (every_block) {
    for (int64_t j = 0; j < num_blocks; ++j) block_moment(j);
    return peak;
  }
  block_moment(0);
  block_moment(num_blocks - 1);
  if (k > 1 && peak.checkpointed > 0) {
    const int64_t last = peak.checkpointed * k - 1;
    for (int64_t j : {k - 2, k - 1, last - k + 1, last - 1, last, last + 1}) block_moment(j);
  }
  return peak;
}

std::string CheckpointingName(const ActivationCheckpointing& ac) {
  switch (ac.mode) {
    case ActivationCheckpointing::Mode::kNone: return "none";
    case ActivationCheckpointing::Mode::kSelective: return "selective";
    case ActivationCheckpointing::Mode::kFull: break;
  }
  return ac.every == 1 ? std::string("full") : StrCat("every:", ac.every);
}

}  // namespace fsdp::plan
