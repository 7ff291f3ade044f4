// The recommendation of `fsdp plan`: the fastest layout x activation checkpointing x offload
// that fits, how it differs from the configuration, and, when nothing fits, only the changes
// that would make it fit.
#include <algorithm>
#include <cmath>

#include "common/status.h"
#include "common/strings.h"
#include "planner/cost_model.h"

namespace fsdp::plan {
namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
constexpr Offload kOffloads[] = {Offload::kNone, Offload::kOptimizer, Offload::kParams};
// Up to 64 times the ranks when asking whether more GPUs would help.
constexpr int kMaxWorldGrowth = 64;

// Predictions closer than this share of tokens/s are a tie: the model is not that precise
// (docs/cost_model.md), so the simpler run wins (Simplicity).
constexpr double kSpeedTie = 0.03;

// Fitting first, then the most tokens/s, then the least device memory.
bool Better(const Prediction& a, const Prediction& b) {
  if (a.fits != b.fits) return a.fits;
  if (a.time.tokens_per_s != b.time.tokens_per_s) return a.time.tokens_per_s > b.time.tokens_per_s;
  return a.memory.total < b.memory.total;
}

// Lower is simpler: no offload before optimizer before params, then no checkpointing before
// every:k (larger k: fewer blocks recomputed) before selective before full.
std::pair<int, int> Simplicity(const Prediction& p) {
  const ActivationCheckpointing& ac = p.activation_checkpointing;
  int recompute = 0;
  if (ac.mode == ActivationCheckpointing::Mode::kSelective) recompute = 1 << 20;
  if (ac.mode == ActivationCheckpointing::Mode::kFull) recompute = (1 << 21) - ac.every;
  return {static_cast<int>(p.offload), recompute};
}

PlanRequest WithModes(PlanRequest r, const ActivationCheckpointing& ac, Offload offload) {
  r.config.training.activation_checkpointing = ac;
  r.config.parallelism.offload = offload;
  return r;
}

int NumBlocks(const PlanRequest& r) {
  return static_cast<int>(CountModel(r.config.model).unit_shapes.size()) - 1;
}

// Every layout x checkpointing candidate x offload, best first.
absl::StatusOr<std::vector<Prediction>> SearchAll(const PlanRequest& request) {
  std::vector<Prediction> all;
  for (Offload offload : kOffloads) {
    for (const ActivationCheckpointing& ac : CheckpointingCandidates(NumBlocks(request))) {
      FSDP_ASSIGN_OR_RETURN(std::vector<Prediction> layouts,
                            EnumerateLayouts(WithModes(request, ac, offload)));
      all.insert(all.end(), layouts.begin(), layouts.end());
    }
  }
  std::stable_sort(all.begin(), all.end(), Better);
  return all;
}

absl::StatusOr<bool> AnyFits(const PlanRequest& request) {
  FSDP_ASSIGN_OR_RETURN(std::vector<Prediction> all, SearchAll(request));
  return !all.empty() && all.front().fits;
}

std::string Modes(const ActivationCheckpointing& ac, Offload offload) {
  return StrCat("activation_checkpointing ", CheckpointingName(ac), ", offload ",
                OffloadName(offload));
}

std::vector<std::string> OverridesFor(const Prediction& p) {
  return {
      StrCat("parallelism.strategy=", StrategyName(p.layout.strategy)),
      StrCat("parallelism.data_parallel_replicate_degree=", p.layout.replicate),
      StrCat("parallelism.data_parallel_shard_degree=", p.layout.shard),
      StrCat("training.activation_checkpointing=", CheckpointingName(p.activation_checkpointing)),
      StrCat("parallelism.offload=", OffloadName(p.offload))};
}

double UsablePerRank(const PlanRequest& r) {
  return r.hw.memory_bytes * r.hw.usable_memory_fraction /
         (r.hw.cores_per_node > 0 ? r.gpus_per_node : 1);
}

// Note [No-fit advice]
// When no layout x checkpointing x offload fits, the message names only changes that the model
// predicts to fit, each tried on the whole search: a smaller micro-batch (halving down to 1,
// with more accumulation steps for the same batch), bf16 (only for an fp32 configuration),
// more ranks (up to kMaxWorldGrowth x, whole nodes). When none of them alone fits it tries
// micro-batch 1 with bf16, and otherwise names what does not shrink with any of them (the
// activations of one sequence, the gathered units): a shorter model.seq_len or a GPU with
// more memory. So it never tells a bf16 run to use bf16, or asks for more GPUs when the
// activations alone do not fit.
absl::StatusOr<std::string> NoFitAdvice(const PlanRequest& request, const Prediction& smallest) {
  const TrainingSection& t = request.config.training;
  std::string message = fmt::format(
      "recommended: none: no layout fits in {:.1f} GiB per rank with any activation "
      "checkpointing or offload (smallest: {:.1f} GiB, {} {}x{} with {}: activations {:.1f} "
      "GiB, gathered units {:.1f} GiB{})",
      UsablePerRank(request) / kGiB, smallest.memory.total / kGiB, smallest.runs_as,
      smallest.layout.replicate, smallest.layout.shard,
      Modes(smallest.activation_checkpointing, smallest.offload),
      smallest.memory.activations / kGiB, smallest.memory.unsharded_units / kGiB,
      smallest.host_fits ? "" : "; " + smallest.note);
  std::vector<std::string> helps;
  for (int64_t m = t.micro_batch_size / 2; m >= 1; m /= 2) {
    PlanRequest r = request;
    r.config.training.micro_batch_size = m;
    r.config.training.grad_accum_steps = (t.grad_accum_steps * t.micro_batch_size + m - 1) / m;
    FSDP_ASSIGN_OR_RETURN(bool fits, AnyFits(r));
    if (fits) {
      helps.push_back(StrCat("--set training.micro_batch_size=", m,
                             " --set training.grad_accum_steps=",
                             r.config.training.grad_accum_steps, " (the same batch)"));
      break;
    }
  }
  const bool fp32 = t.mixed_precision == Precision::kFp32;
  if (fp32) {
    PlanRequest r = request;
    r.config.training.mixed_precision = Precision::kBf16;
    FSDP_ASSIGN_OR_RETURN(bool fits, AnyFits(r));
    if (fits) helps.push_back("--set training.mixed_precision=bf16");
  }
  for (int growth = 2; growth <= kMaxWorldGrowth; growth *= 2) {
    PlanRequest r = request;
    r.world_size = request.world_size * growth;
    FSDP_ASSIGN_OR_RETURN(bool fits, AnyFits(r));
    if (fits) {
      helps.push_back(
          StrCat("--world-size ", r.world_size, " (", r.world_size / r.gpus_per_node, " nodes)"));
      break;
    }
  }
  if (helps.empty() && fp32 && t.micro_batch_size > 1) {
    PlanRequest r = request;
    r.config.training.micro_batch_size = 1;
    r.config.training.grad_accum_steps = t.grad_accum_steps * t.micro_batch_size;
    r.config.training.mixed_precision = Precision::kBf16;
    FSDP_ASSIGN_OR_RETURN(bool fits, AnyFits(r));
    if (fits) {
      helps.push_back(StrCat("--set training.micro_batch_size=1 --set training.grad_accum_steps=",
                             r.config.training.grad_accum_steps,
                             " --set training.mixed_precision=bf16 (together)"));
    }
  }
  if (!helps.empty())
    return StrCat(message, "\nwould fit (then run `fsdp plan` again): ", StrJoin(helps, "; or "));
  return StrCat(message,
                "\nno smaller micro-batch, precision or more GPUs fits: the activations of one "
                "micro-batch and the gathered units do not shrink with the world size; shorten "
                "model.seq_len or use a GPU with more memory");
}

}  // namespace

std::vector<ActivationCheckpointing> CheckpointingCandidates(int num_blocks) {
  using Mode = ActivationCheckpointing::Mode;
  std::vector<ActivationCheckpointing> modes = {
      {Mode::kNone, 1}, {Mode::kSelective, 1}, {Mode::kFull, 1}};
  for (int k = 2; k <= num_blocks; ++k) modes.push_back({Mode::kFull, k});
  return modes;
}

absl::StatusOr<Recommendation> Recommend(const PlanRequest& request) {
  Recommendation rec;
  FSDP_ASSIGN_OR_RETURN(rec.configured, EnumerateLayouts(request));
  FSDP_ASSIGN_OR_RETURN(std::vector<Prediction> all, SearchAll(request));
  if (!all.empty() && all.front().fits) {
    // The fastest, or a simpler run within kSpeedTie of it (e.g. on a CPU profile the host's
    // fused AdamW makes offload a hair faster than no offload).
    const Prediction* best = &all.front();
    for (const Prediction& p : all) {
      if (!p.fits || p.time.tokens_per_s < (1 - kSpeedTie) * all.front().time.tokens_per_s) break;
      if (Simplicity(p) < Simplicity(*best)) best = &p;
    }
    rec.best = *best;
  }

  // The trade-offs on one layout: the three main modes (and best's every:k) x each offload.
  const Prediction& anchor = rec.best ? *rec.best : rec.configured.front();
  std::vector<ActivationCheckpointing> shown = CheckpointingCandidates(0);  // none, selective, full
  if (rec.best && rec.best->activation_checkpointing.mode == ActivationCheckpointing::Mode::kFull &&
      rec.best->activation_checkpointing.every > 1) {
    shown.push_back(rec.best->activation_checkpointing);
  }
  for (const ActivationCheckpointing& ac : shown) {
    for (Offload offload : kOffloads) {
      FSDP_ASSIGN_OR_RETURN(Prediction p, Predict(WithModes(request, ac, offload), anchor.layout));
      rec.alternatives.push_back(std::move(p));
    }
  }

  const ActivationCheckpointing& ac = request.config.training.activation_checkpointing;
  const Offload offload = request.config.parallelism.offload;
  if (!rec.best) {
    // The least device memory, among those whose host memory fits if any does.
    const Prediction& smallest =
        *std::min_element(all.begin(), all.end(), [](const Prediction& a, const Prediction& b) {
          if (a.host_fits != b.host_fits) return a.host_fits;
          return a.memory.total < b.memory.total;
        });
    FSDP_ASSIGN_OR_RETURN(rec.message, NoFitAdvice(request, smallest));
    return rec;
  }
  const Prediction& best = *rec.best;
  rec.overrides = OverridesFor(best);
  rec.message =
      fmt::format("recommended: {} {}x{} with {}: --set {}", best.runs_as, best.layout.replicate,
                  best.layout.shard, Modes(best.activation_checkpointing, best.offload),
                  StrJoin(rec.overrides, " --set "));
  if (best.activation_checkpointing == ac && best.offload == offload) return rec;
  const Prediction& configured = rec.configured.front();
  if (!configured.fits) {
    const Prediction& smallest = *std::min_element(
        rec.configured.begin(), rec.configured.end(),
        [](const Prediction& a, const Prediction& b) { return a.memory.total < b.memory.total; });
    rec.message += fmt::format(
        "\n(differs from the configuration: with {} no layout fits; the smallest, {} {}x{}, "
        "needs {:.1f} GiB of {:.1f} GiB usable, activations {:.1f} GiB)",
        Modes(ac, offload), smallest.runs_as, smallest.layout.replicate, smallest.layout.shard,
        smallest.memory.total / kGiB, UsablePerRank(request) / kGiB,
        smallest.memory.activations / kGiB);
  } else {
    rec.message += fmt::format(
        "\n(differs from the configuration, {}: {:.0f}% more tokens/s than its best layout, {} "
        "{}x{})",
        Modes(ac, offload), 100 * (best.time.tokens_per_s / configured.time.tokens_per_s - 1),
        configured.runs_as, configured.layout.replicate, configured.layout.shard);
  }
  return rec;
}

}  // namespace fsdp::plan
