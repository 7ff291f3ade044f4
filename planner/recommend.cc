// The recommendation of `fsdp plan`: the fastest layout x activation checkpointing x offload
// that fits, how it differs from the configuration, and, when nothing fits, only the changes
// that would make it fit.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "common/status.h"
#include "common/strings.h"
#include "planner/cost_model.h"
#include "planner/search.h"

namespace fsdp::plan {
namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
constexpr Offload kOffloads[] = {Offload::kNone, Offload::kOptimizer, Offload::kParams};
// Up to 64 times the ranks when asking whether more GPUs would help.
constexpr int kMaxWorldGrowth = 64;

// Predictions closer than this share of tokens/s are a tie: the model is not that precise
// (docs/cost_model.md), so the simpler run wins (Simplicity).
constexpr double kSpeedTie = 0.03;

// A step time for a message, in ms: whole milliseconds from 100 on, three significant digits
// below (a small model's step on a GPU profile is a fraction of one).
std::string Milliseconds(double seconds) {
  const double ms = 1e3 * seconds;
  return ms >= 100 ? fmt::format("{:.0f}", ms) : fmt::format("{:.3g}", ms);
}

// GiB for a message: `decimals` places, or three significant digits below 0.1.
std::string Gib(double bytes, int decimals) {
  const double gib = bytes / kGiB;
  return gib >= 0.1 || gib == 0 ? fmt::format("{:.{}f}", gib, decimals)
                                : fmt::format("{:.3g}", gib);
}

// Fitting first, then the most tokens/s, then the least device memory.
bool Better(const Prediction& a, const Prediction& b) {
  if (a.fits != b.fits) return a.fits;
  if (a.time.tokens_per_s != b.time.tokens_per_s) return a.time.tokens_per_s > b.time.tokens_per_s;
  return a.memory.total < b.memory.total;
}

// Lower is simpler: no offload before optimizer before params, then no checkpointing before
// every:k (larger k: fewer blocks recomputed) before selective before full.
std::pair<int, int64_t> Simplicity(const Prediction& p) {
  const ActivationCheckpointing& ac = p.activation_checkpointing;
  int64_t recompute = 0;
  if (ac.mode == ActivationCheckpointing::Mode::kSelective) recompute = int64_t{1} << 40;
  if (ac.mode == ActivationCheckpointing::Mode::kFull) recompute = (int64_t{1} << 41) - ac.every;
  return {static_cast<int>(p.offload), recompute};
}

PlanRequest WithModes(PlanRequest r, const ActivationCheckpointing& ac, Offload offload) {
  r.config.training.activation_checkpointing = ac;
  r.config.parallelism.offload = offload;
  return r;
}

// What runs: every:k with k above the number of blocks checkpoints none of them.
ActivationCheckpointing Effective(const ActivationCheckpointing& ac, int num_blocks) {
  if (ac.mode == ActivationCheckpointing::Mode::kNone || num_blocks == 0 ||
      (ac.mode == ActivationCheckpointing::Mode::kFull && ac.every > num_blocks)) {
    return {};
  }
  return ac;
}

// Every layout x checkpointing candidate x offload, best first. every:k is tried per layout and
// offload only with the fewest checkpointed blocks that fit (the least recompute, so the fastest
// every:k there, and the largest k), found by bisection: memory falls as more blocks are
// checkpointed. So a search costs O(layouts x log(blocks)) predictions, not layouts x blocks.
absl::StatusOr<std::vector<Prediction>> SearchAll(const PlanRequest& request,
                                                  const CountedModel& model) {
  const std::vector<ActivationCheckpointing> candidates = CheckpointingCandidates(model.num_blocks);
  // none, selective, full; then every:k with 1, 2, ... blocks checkpointed.
  const std::vector<ActivationCheckpointing> main(candidates.begin(), candidates.begin() + 3);
  const std::vector<ActivationCheckpointing> every(candidates.begin() + 3, candidates.end());
  std::vector<Layout> layouts;
  for (const Layout& layout : LayoutsFor(request.world_size)) {
    if (ShardingPlanFor(request.config, layout.strategy, layout.shard).ok())
      layouts.push_back(layout);
  }
  std::vector<Prediction> all;
  for (Offload offload : kOffloads) {
    for (const ActivationCheckpointing& ac : main) {
      FSDP_ASSIGN_OR_RETURN(std::vector<Prediction> predicted,
                            EnumerateCounted(WithModes(request, ac, offload), model));
      all.insert(all.end(), predicted.begin(), predicted.end());
    }
    if (every.empty()) continue;
    for (const Layout& layout : layouts) {
      auto predict = [&](size_t i) {
        return PredictCounted(WithModes(request, every[i], offload), layout, model);
      };
      size_t lo = 0, hi = every.size() - 1;
      FSDP_ASSIGN_OR_RETURN(Prediction fitting, predict(hi));
      if (!fitting.fits) continue;  // full, already listed, keeps less
      while (lo < hi) {
        const size_t mid = lo + (hi - lo) / 2;
        FSDP_ASSIGN_OR_RETURN(Prediction p, predict(mid));
        if (p.fits) {
          hi = mid;
          fitting = std::move(p);
        } else {
          lo = mid + 1;
        }
      }
      all.push_back(std::move(fitting));
    }
  }
  std::stable_sort(all.begin(), all.end(), Better);
  return all;
}

absl::StatusOr<bool> AnyFits(const PlanRequest& request) {
  FSDP_ASSIGN_OR_RETURN(std::vector<Prediction> all,
                        SearchAll(request, CountedModel::Of(request.config.model)));
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

// The divisors of n below `below`, ascending (trial division up to 2e6: every divisor of any
// n < 4e12, and 1 always).
std::vector<int64_t> DivisorsBelow(int64_t n, int64_t below) {
  std::vector<int64_t> out;
  for (int64_t d = 1; d <= 2'000'000 && d * d <= n; ++d) {
    if (n % d != 0) continue;
    if (d < below) out.push_back(d);
    if (n / d != d && n / d < below) out.push_back(n / d);
  }
  std::sort(out.begin(), out.end());
  return out;
}

// Note [No-fit advice]
// When no layout x checkpointing x offload fits, the message names only changes that the model
// predicts to fit, each tried on the whole search: a smaller micro-batch with more accumulation
// steps for exactly the same batch (the largest divisor of micro-batch x accumulation steps
// below the micro-batch that fits), bf16 (only for an fp32 configuration), more ranks (up to
// kMaxWorldGrowth x, whole nodes), one unit gathered at a time (parallelism.max_unsharded_units 1),
// a shorter model.seq_len (halving). When none of them alone fits it tries micro-batch 1 with bf16,
// and otherwise names the largest part of the smallest run (activations, gathered units, model
// state or host memory) and what shrinks it: a smaller model, a device with at least the memory the
// smallest run needs. So it never tells a bf16 run to use bf16, asks for
// more GPUs when the activations alone do not fit, or for a shorter sequence when the
// gathered units are what is too large.
absl::StatusOr<std::string> NoFitAdvice(const PlanRequest& request, const Prediction& smallest) {
  const TrainingSection& t = request.config.training;
  const MemoryBreakdown& m = smallest.memory;
  const double usable = UsablePerRank(request);
  std::string message = fmt::format(
      "recommended: none: no layout fits in {:.1f} GiB per rank with any activation "
      "checkpointing or offload (smallest: {:.1f} GiB, {} {}x{} with {}: activations {:.1f} "
      "GiB, gathered units {:.1f} GiB{})",
      usable / kGiB, m.total / kGiB, smallest.runs_as, smallest.layout.replicate,
      smallest.layout.shard, Modes(smallest.activation_checkpointing, smallest.offload),
      m.activations / kGiB, m.unsharded_units / kGiB,
      smallest.host_fits ? "" : "; " + smallest.note);
  std::vector<std::string> helps;
  // The same sequences per rank and step in smaller micro-batches.
  const int64_t micro = t.micro_batch_size;
  if (micro > 1 && t.grad_accum_steps <= std::numeric_limits<int64_t>::max() / micro) {
    const int64_t per_step = micro * t.grad_accum_steps;
    const std::vector<int64_t> smaller = DivisorsBelow(per_step, micro);
    auto fits_with = [&](int64_t size) {
      PlanRequest r = request;
      r.config.training.micro_batch_size = size;
      r.config.training.grad_accum_steps = per_step / size;
      return AnyFits(r);
    };
    FSDP_ASSIGN_OR_RETURN(bool any, fits_with(smaller.front()));
    if (any) {
      size_t lo = 0, hi = smaller.size() - 1;  // smaller[lo] fits: the largest that does
      while (lo < hi) {
        const size_t mid = hi - (hi - lo) / 2;
        FSDP_ASSIGN_OR_RETURN(bool fits, fits_with(smaller[mid]));
        if (fits) {
          lo = mid;
        } else {
          hi = mid - 1;
        }
      }
      helps.push_back(StrCat("--set training.micro_batch_size=", smaller[lo],
                             " --set training.grad_accum_steps=", per_step / smaller[lo],
                             " (the same batch)"));
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
    if (request.world_size > std::numeric_limits<int>::max() / growth) break;
    PlanRequest r = request;
    r.world_size = request.world_size * growth;
    FSDP_ASSIGN_OR_RETURN(bool fits, AnyFits(r));
    if (fits) {
      helps.push_back(
          StrCat("--world-size ", r.world_size, " (", r.world_size / r.gpus_per_node,
                 r.world_size / r.gpus_per_node == 1 ? " node)" : " nodes)"));
      break;
    }
  }
  if (request.config.parallelism.max_unsharded_units > 1) {
    PlanRequest r = request;
    r.config.parallelism.max_unsharded_units = 1;
    FSDP_ASSIGN_OR_RETURN(bool fits, AnyFits(r));
    if (fits) {
      helps.push_back(
          "--set parallelism.max_unsharded_units=1 (one unit gathered at a time: no "
          "prefetch, slower)");
    }
  }
  // A shorter sequence shrinks only the activations: worth trying when the rest fits.
  if (m.activations > 0 && m.total - m.activations < usable) {
    for (int64_t seq = request.config.model.seq_len / 2; seq >= 1; seq /= 2) {
      PlanRequest r = request;
      r.config.model.seq_len = seq;
      FSDP_ASSIGN_OR_RETURN(bool fits, AnyFits(r));
      if (fits) {
        helps.push_back(StrCat("--set model.seq_len=", seq, " (shorter sequences)"));
        break;
      }
    }
  }
  if (helps.empty() && fp32 && micro > 1 &&
      t.grad_accum_steps <= std::numeric_limits<int64_t>::max() / micro) {
    PlanRequest r = request;
    r.config.training.micro_batch_size = 1;
    r.config.training.grad_accum_steps = t.grad_accum_steps * micro;
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

  // Nothing tried fits: what is too large, and what can shrink it.
  std::string what;
  if (!smallest.host_fits && m.total <= usable) {
    what = fmt::format(
        "what does not fit is host memory ({}): a host with more memory per rank (fewer ranks "
        "per node), or parallelism.offload none on a device with at least {:.1f} GiB",
        smallest.note, (m.total + m.host) / request.hw.usable_memory_fraction / kGiB);
  } else {
    const double state = m.params + m.padding + m.grads + m.optimizer + m.partial_grads;
    std::string part, cure;
    if (m.activations >= m.unsharded_units && m.activations >= state) {
      part = fmt::format("the activations of one micro-batch, {:.1f} GiB", m.activations / kGiB);
      cure = "do not shrink with more GPUs: a smaller model (model.dim, model.n_layers)";
    } else if (m.unsharded_units >= state) {
      part = fmt::format(
          "the gathered units, {:.1f} GiB (the root unit, unsharded all step, the blocks "
          "unsharded at once and one block's gradient)",
          m.unsharded_units / kGiB);
      cure = "do not shrink with more GPUs: a smaller model (model.dim, model.vocab_size)";
    } else {
      part = fmt::format("the model state, {:.1f} GiB per rank", state / kGiB);
      cure = StrCat("shrinks only with more than ", kMaxWorldGrowth, "x the GPUs: a smaller model");
    }
    const double device_needed = (m.total + (request.hw.cores_per_node > 0 ? m.host : 0)) /
                                 request.hw.usable_memory_fraction;
    what = fmt::format(
        "the largest part of the smallest run ({:.1f} GiB) is {}, which {}, or {} "
        "with at least {:.1f} GiB of memory per rank",
        m.total / kGiB, part, cure, request.hw.cores_per_node > 0 ? "a machine" : "a device",
        device_needed / kGiB);
  }
  return StrCat(message,
                "\nno smaller micro-batch, precision, more GPUs, fewer gathered units or shorter "
                "sequence fits: ",
                what);
}

}  // namespace

std::vector<ActivationCheckpointing> CheckpointingCandidates(int num_blocks) {
  using Mode = ActivationCheckpointing::Mode;
  std::vector<ActivationCheckpointing> modes = {
      {Mode::kNone, 1}, {Mode::kSelective, 1}, {Mode::kFull, 1}};
  // c blocks checkpointed, c = 1 .. num_blocks / 2: the largest k with num_blocks / k == c.
  for (int c = 1; c <= num_blocks / 2; ++c) {
    const int k = num_blocks / c;
    if (num_blocks / k == c) modes.push_back({Mode::kFull, k});
  }
  return modes;
}

namespace {

// Note [Offload hint]
// With offload and gradient accumulation, most of the step's host<->device traffic is repeated
// per micro-batch: each unit's shard loaded for every gather (params) and each micro-batch's
// gradients sent (params; optimizer offload sums them on the device already). Two settings cut
// that to once per step at a cost in device memory: parallelism.reshard_between_micro_batches:
// false keeps every unit's compute-dtype parameters from the first forward to the last backward
// (Note [Keeping parameters across micro-batches]), and training.grad_sync: last sums the
// micro-batches' unsharded gradients on the device in the compute dtype and reduces and sends
// them once (Note [No-sync accumulation]: other roundings). And with any offload the opt-in
// delayed update (parallelism.offload_delayed_update: on; parameters one step stale; Note [Delayed
// parameter update] in sharding/offload/host_step.h) takes the host's step out of the step's
// critical path. The search does not vary them (they are not layouts, and they change the
// arithmetic), so when best offloads the recommendation says what they would give on its layout,
// when that fits and is faster beyond the planner's precision: the fastest of both settings, the
// first or the second alone, and then the delayed update on top of that.
std::string OffloadHint(const PlanRequest& request, const Prediction& best,
                        const CountedModel& model) {
  const RunConfig& config = request.config;
  if (best.offload == Offload::kNone) return "";
  std::string hint;
  const PlanRequest base = WithModes(request, best.activation_checkpointing, best.offload);
  Prediction fastest = best;
  struct Candidate {
    bool keep, last;
  };
  const Candidate* chosen = nullptr;
  PlanRequest chosen_request = base;
  std::vector<std::string> chosen_sets;
  static constexpr Candidate kCandidates[] = {{true, true}, {true, false}, {false, true}};
  for (const Candidate& c : kCandidates) {
    if (config.training.grad_accum_steps < 2) break;  // nothing to copy less often
    PlanRequest r = base;
    std::vector<std::string> sets;
    if (c.keep && config.parallelism.reshard_between_micro_batches) {
      r.config.parallelism.reshard_between_micro_batches = false;
      sets.push_back("parallelism.reshard_between_micro_batches=false");
    }
    if (c.last && config.training.grad_sync != GradSync::kLast) {
      r.config.training.grad_sync = GradSync::kLast;
      sets.push_back("training.grad_sync=last");
    }
    if (sets.empty()) continue;  // configured already
    absl::StatusOr<Prediction> p = PredictCounted(r, best.layout, model);
    if (!p.ok() || !p->fits || p->time.step_s >= (1 - kSpeedTie) * best.time.step_s ||
        p->time.step_s >= fastest.time.step_s) {
      continue;
    }
    fastest = *p;
    chosen = &c;
    chosen_request = r;
    chosen_sets = sets;
  }
  if (chosen != nullptr) {
    const char* what = chosen->keep && chosen->last
                           ? "parameters and gradients, summed on the device in the compute dtype,"
                       : chosen->keep ? "parameters"
                                      : "gradients, summed on the device in the compute dtype,";
    hint += fmt::format(
        "\n(with offload {}: --set {} predicts {} ms per step instead of {}, {} GiB "
        "on the device instead of {}: one host<->device copy of each unit's {} per step; "
        "see docs/offload.md)",
        OffloadName(best.offload), StrJoin(chosen_sets, " --set "),
        Milliseconds(fastest.time.step_s), Milliseconds(best.time.step_s),
        Gib(fastest.memory.total, 2), Gib(best.memory.total, 2), what);
  }
  if (!config.parallelism.offload_delayed_update.enabled) {
    PlanRequest r = chosen_request;
    r.config.parallelism.offload_delayed_update = {.enabled = true};
    // Not ok where a debugging knob rules the delayed update out (ShardingPlanFor says why).
    absl::StatusOr<Prediction> p = PredictCounted(r, best.layout, model);
    if (p.ok() && p->fits && p->time.step_s < (1 - kSpeedTie) * fastest.time.step_s) {
      hint += fmt::format(
          "\n(opt in, with offload {}{}: --set parallelism.offload_delayed_update=on predicts "
          "{} ms per step instead of {}, {} GiB of host memory per rank "
          "instead of {}: each step uses the parameters from before the previous step's "
          "update, one step stale, while the host runs it; see docs/offload.md)",
          OffloadName(best.offload), chosen != nullptr ? " and the settings above" : "",
          Milliseconds(p->time.step_s), Milliseconds(fastest.time.step_s),
          Gib(p->memory.host, 1), Gib(fastest.memory.host, 1));
    }
  }
  return hint;
}

}  // namespace

absl::StatusOr<Recommendation> Recommend(const PlanRequest& request) {
  Recommendation rec;
  const CountedModel model = CountedModel::Of(request.config.model);
  FSDP_ASSIGN_OR_RETURN(rec.configured, EnumerateCounted(request, model));
  FSDP_ASSIGN_OR_RETURN(std::vector<Prediction> all, SearchAll(request, model));
  if (all.empty()) all = rec.configured;  // not expected: the configured modes are searched
  if (all.front().fits) {
    // The fastest, or a simpler run within kSpeedTie of it (a more complex run predicted a
    // hair faster, e.g. offload on a host as fast as the device, is not worth its settings).
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
      FSDP_ASSIGN_OR_RETURN(Prediction p,
                            PredictCounted(WithModes(request, ac, offload), anchor.layout, model));
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
  rec.message += OffloadHint(request, best, model);  // Note [Offload hint]
  if (Effective(best.activation_checkpointing, model.num_blocks) ==
          Effective(ac, model.num_blocks) &&
      best.offload == offload) {
    return rec;
  }
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
    return rec;
  }
  // Faster; or, within kSpeedTie, simpler or smaller.
  const long percent =
      std::lround(100 * (best.time.tokens_per_s / configured.time.tokens_per_s - 1));
  std::string speed, why;
  if (percent > 0) {
    speed = StrCat(percent, "% more tokens/s than");
  } else if (percent < 0) {
    speed = StrCat(-percent, "% fewer tokens/s than");
  } else {
    speed = "about the same tokens/s as";
  }
  if (percent <= 0) {
    if (Simplicity(best) < Simplicity(configured)) {
      why = fmt::format(": a simpler run, within the model's {:.0f}% precision", 100 * kSpeedTie);
    } else if (best.memory.total < configured.memory.total) {
      why = fmt::format(": less memory, {:.2f} GiB against {:.2f} GiB", best.memory.total / kGiB,
                        configured.memory.total / kGiB);
    }
  }
  rec.message += fmt::format(
      "\n(differs from the configuration, {}: {} its best layout, {} {}x{}{})", Modes(ac, offload),
      speed, configured.runs_as, configured.layout.replicate, configured.layout.shard, why);
  return rec;
}

}  // namespace fsdp::plan
