#include "engine/config_validate.h"

#include <algorithm>
#include <climits>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <utility>

#include "common/status.h"
#include "common/strings.h"
#include "device_mesh/mesh_shape.h"
#include "engine/data.h"
#include "sharding/options.h"

namespace fsdp {
namespace {

absl::Status ValidateModel(const ModelSection& m, const Validator& v) {
  FSDP_RETURN_IF_ERROR(v.OneOf("model.arch", m.arch, ModelArchs()));
  FSDP_RETURN_IF_ERROR(v.AtLeast<int64_t>("model.vocab_size", m.vocab_size, 2));
  FSDP_RETURN_IF_ERROR(v.AtLeast<int64_t>("model.dim", m.dim, 1));
  FSDP_RETURN_IF_ERROR(v.AtLeast<int64_t>("model.n_layers", m.n_layers, 1));
  FSDP_RETURN_IF_ERROR(v.AtLeast<int64_t>("model.n_heads", m.n_heads, 1));
  FSDP_RETURN_IF_ERROR(
      v.Check(m.dim % m.n_heads == 0, "model.dim",
              StrCat("must be a multiple of model.n_heads = ", m.n_heads, ", got ", m.dim),
              {"model.n_heads"}));
  FSDP_RETURN_IF_ERROR(v.AtLeast<int64_t>("model.n_kv_heads", m.n_kv_heads, 0));
  FSDP_RETURN_IF_ERROR(v.Check(
      m.n_heads % m.kv_heads() == 0, "model.n_kv_heads",
      StrCat("must divide model.n_heads = ", m.n_heads, " (0: n_heads), got ", m.n_kv_heads),
      {"model.n_heads"}));
  FSDP_RETURN_IF_ERROR(v.AtLeast<int64_t>("model.seq_len", m.seq_len, 1));
  FSDP_RETURN_IF_ERROR(v.AtLeast<int64_t>("model.ffn_hidden", m.ffn_hidden, 0));
  int64_t head_dim = m.dim / m.n_heads;
  FSDP_RETURN_IF_ERROR(
      v.Check(m.positions != Positions::kRope || head_dim % 2 == 0, "model.positions",
              StrCat("rope needs an even head dimension, got model.dim / model.n_heads = ", m.dim,
                     " / ", m.n_heads, " = ", head_dim),
              {"model.dim", "model.n_heads"}));
  FSDP_RETURN_IF_ERROR(v.Positive("model.norm_eps", m.norm_eps));
  FSDP_RETURN_IF_ERROR(v.Positive("model.rope_theta", m.rope_theta));
  FSDP_RETURN_IF_ERROR(v.AtLeast<int64_t>("model.loss_chunk_tokens", m.loss_chunk_tokens, 0));
  for (const std::string& pattern : m.freeze) {
    FSDP_RETURN_IF_ERROR(v.Check(!pattern.empty(), "model.freeze",
                                 "a pattern is empty (patterns are globs over parameter names, "
                                 "e.g. \"tok_embeddings.*\", \"layers.0.*\")"));
  }
  return v.Positive("model.init_std", m.init_std);
}
absl::Status ValidateData(const DataSection& d, const Validator& v) {
  FSDP_RETURN_IF_ERROR(v.Check(d.source == DataSource::kSynthetic || !d.path.empty(), "data.path",
                               StrCat("required for data.source '",
                                      d.source == DataSource::kTokens ? "tokens" : "text", "'"),
                               {"data.source"}));
  FSDP_RETURN_IF_ERROR(v.Fraction("data.val_fraction", d.val_fraction));
  FSDP_RETURN_IF_ERROR(v.AtLeast<int64_t>("data.synthetic_tokens", d.synthetic_tokens, 1024));
  // kMaxSyntheticTokens (engine/data.h): 2^63 failed inside std::vector as an internal error.
  return v.Check(d.synthetic_tokens <= kMaxSyntheticTokens, "data.synthetic_tokens",
                 StrCat("must be <= 2^32 = ", kMaxSyntheticTokens,
                        " (the synthetic stream is generated in memory at start, 4 bytes a "
                        "token; data.source tokens reads a file of any size), got ",
                        d.synthetic_tokens));
}

absl::Status ValidateTraining(const TrainingSection& t, const Validator& v) {
  FSDP_RETURN_IF_ERROR(v.AtLeast<int64_t>("training.steps", t.steps, 1));
  FSDP_RETURN_IF_ERROR(v.FitsFloat("training.max_grad_norm", t.max_grad_norm));
  FSDP_RETURN_IF_ERROR(v.AtLeast<int64_t>("training.micro_batch_size", t.micro_batch_size, 1));
  FSDP_RETURN_IF_ERROR(v.AtLeast<int64_t>("training.grad_accum_steps", t.grad_accum_steps, 1));
  FSDP_RETURN_IF_ERROR(v.AtLeast<int64_t>("training.eval_interval", t.eval_interval, 0));
  FSDP_RETURN_IF_ERROR(v.AtLeast<int64_t>("training.eval_batches", t.eval_batches, 1));
  // start + steps would overflow for huge values (and pass): compared without the sum.
  const bool profile_fits = !t.profile.enabled() || (t.profile.start <= t.steps &&
                                                     t.profile.steps <= t.steps - t.profile.start);
  FSDP_RETURN_IF_ERROR(
      v.Check(profile_fits, "training.profile",
              StrCat("'", t.profile.ToString(), "' ends after step ",
                     t.profile.start > std::numeric_limits<int64_t>::max() - t.profile.steps
                         ? std::string("2^63")
                         : StrCat(t.profile.start + t.profile.steps),
                     " of a run of ", t.steps, " steps"),
              {"training.steps"}));
  return v.AtLeast<int64_t>("training.log_interval", t.log_interval, 1);
}

absl::Status ValidateOptimizer(const OptimizerSection& o, const LrSchedulerSection& s,
                               const Validator& v) {
  FSDP_RETURN_IF_ERROR(v.Positive("optimizer.lr", o.lr));
  FSDP_RETURN_IF_ERROR(v.AtLeast<double>("optimizer.weight_decay", o.weight_decay, 0));
  FSDP_RETURN_IF_ERROR(v.FitsFloat("optimizer.weight_decay", o.weight_decay));
  FSDP_RETURN_IF_ERROR(v.FitsFloat("optimizer.momentum", o.momentum));
  FSDP_RETURN_IF_ERROR(v.Fraction("optimizer.beta1", o.beta1));
  FSDP_RETURN_IF_ERROR(v.Fraction("optimizer.beta2", o.beta2));
  FSDP_RETURN_IF_ERROR(v.Positive("optimizer.eps", o.eps));
  FSDP_RETURN_IF_ERROR(v.AtLeast<double>("optimizer.momentum", o.momentum, 0));
  FSDP_RETURN_IF_ERROR(v.AtLeast<int64_t>("lr_scheduler.warmup_steps", s.warmup_steps, 0));
  FSDP_RETURN_IF_ERROR(v.AtLeast<double>("lr_scheduler.min_lr", s.min_lr, 0));
  return v.Check(s.min_lr <= o.lr, "lr_scheduler.min_lr",
                 StrCat("must be <= optimizer.lr = ", o.lr, ", got ", s.min_lr), {"optimizer.lr"});
}

absl::Status ValidateParallelism(const ParallelismSection& p, const Validator& v) {
  FSDP_RETURN_IF_ERROR(v.AtLeast<int64_t>("parallelism.nproc", p.nproc, 0));
  FSDP_RETURN_IF_ERROR(
      v.Check(p.collective_timeout_s >= 1 && p.collective_timeout_s <= 604800,
              "parallelism.collective_timeout_s",
              StrCat("must be in 1..604800 seconds, got ", p.collective_timeout_s)));
  for (auto [key, degree] :
       {std::pair<std::string_view, int64_t>{"parallelism.data_parallel_replicate_degree",
                                             p.data_parallel_replicate_degree},
        {"parallelism.data_parallel_shard_degree", p.data_parallel_shard_degree}}) {
    FSDP_RETURN_IF_ERROR(
        v.Check(degree >= 1 || degree == -1, key,
                StrCat("must be >= 1, or -1 to infer it from the world size, got ", degree)));
  }
  FSDP_RETURN_IF_ERROR(v.Check(
      p.data_parallel_replicate_degree != -1 || p.data_parallel_shard_degree != -1,
      "parallelism.data_parallel_replicate_degree",
      "-1 needs a fixed parallelism.data_parallel_shard_degree; at most one of the two degrees "
      "may be -1 (inferred from the world size)",
      {"parallelism.data_parallel_shard_degree"}));
  FSDP_RETURN_IF_ERROR(
      v.AtLeast<int64_t>("parallelism.max_unsharded_units", p.max_unsharded_units, 1));
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateRunConfig(const RunConfig& c, const Locations& where) {
  Validator v(where, c.source_file);
  FSDP_RETURN_IF_ERROR(v.Check(!c.run.name.empty(), "run.name", "must not be empty"));
  FSDP_RETURN_IF_ERROR(ValidateModel(c.model, v));
  FSDP_RETURN_IF_ERROR(ValidateData(c.data, v));
  FSDP_RETURN_IF_ERROR(ValidateTraining(c.training, v));
  // Every evaluation was NaN (no held-out windows), and the run exited 0.
  FSDP_RETURN_IF_ERROR(v.Check(
      c.training.eval_interval == 0 || c.data.val_fraction > 0, "training.eval_interval",
      StrCat(c.training.eval_interval,
             " evaluates on the held-out part of the data, but data.val_fraction is 0 (nothing "
             "held out); set data.val_fraction (e.g. 0.05), or training.eval_interval: 0"),
      {"data.val_fraction"}));
  FSDP_RETURN_IF_ERROR(ValidateOptimizer(c.optimizer, c.lr_scheduler, v));
  FSDP_RETURN_IF_ERROR(ValidateParallelism(c.parallelism, v));
  FSDP_RETURN_IF_ERROR(v.Check(c.metrics.cpu_peak_flops >= 0, "metrics.cpu_peak_flops",
                               StrCat("must be > 0 (FLOP/s per rank), or 0 for unset (no MFU on "
                                      "CPU), got ",
                                      c.metrics.cpu_peak_flops)));
  FSDP_RETURN_IF_ERROR(v.Check(
      !(c.parallelism.Unwrapped() && c.checkpoint.enabled), "checkpoint.enabled",
      "must be false with parallelism.strategy none (the unwrapped baseline saves no checkpoints); "
      "use full_shard or no_shard to checkpoint a one-rank run",
      {"parallelism.strategy"}));
  FSDP_RETURN_IF_ERROR(
      v.Check(!(c.parallelism.Unwrapped() && c.training.activation_checkpointing.enabled()),
              "training.activation_checkpointing",
              "must be none with parallelism.strategy none (checkpointing runs at the FSDP units' "
              "seam); use full_shard or no_shard on one rank",
              {"parallelism.strategy"}));
  FSDP_RETURN_IF_ERROR(v.Check(
      !(c.parallelism.Unwrapped() && c.parallelism.offload != Offload::kNone),
      "parallelism.offload",
      "must be none with parallelism.strategy none (offload moves FSDP shards); use full_shard "
      "or no_shard on one rank",
      {"parallelism.strategy"}));
  FSDP_RETURN_IF_ERROR(v.Check(
      !c.parallelism.offload_delayed_update.enabled || c.parallelism.offload != Offload::kNone,
      "parallelism.offload_delayed_update",
      "needs parallelism.offload: optimizer or params (it delays the host's update); set it "
      "off, or offload",
      {"parallelism.offload"}));
  FSDP_RETURN_IF_ERROR(v.AtLeast<int64_t>("checkpoint.interval", c.checkpoint.interval, 0));
  return v.AtLeast<int64_t>("checkpoint.keep_latest_k", c.checkpoint.keep_latest_k, 1);
}

// See Note [Reshard group size] (engine/config_validate.h).
absl::Status CheckReshardGroup(const ReshardPolicy& reshard, int shard_degree,
                               std::string_view shard_degree_text) {
  if (reshard.kind != ReshardPolicy::Kind::kGroup) return absl::OkStatus();
  if (reshard.group_size < shard_degree && shard_degree % reshard.group_size == 0) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(StrCat("parallelism.reshard_after_forward=", reshard.group_size,
                                           " must divide the shard degree and be smaller than it, ",
                                           shard_degree_text));
}

namespace {

int ClampToInt(int64_t value) {
  return static_cast<int>(std::clamp<int64_t>(value, INT_MIN, INT_MAX));
}

// "4", or "4 (inferred from world size 8)" for a degree given as -1.
std::string Inferred(int64_t given, int resolved, int world_size) {
  return given == -1 ? StrCat(resolved, " (inferred from world size ", world_size, ")")
                     : StrCat(resolved);
}

// The resolved degrees against what the strategy shards over.
absl::Status CheckStrategyFits(const ParallelismSection& p, Strategy strategy, int replicate,
                               int shard, int world_size) {
  const std::string name = StrategyName(strategy);
  switch (strategy) {
    case Strategy::kFullShard:
    case Strategy::kShardGradOp:
      if (replicate != 1) {
        return absl::InvalidArgumentError(
            StrCat("parallelism.data_parallel_replicate_degree=",
                   Inferred(p.data_parallel_replicate_degree, replicate, world_size),
                   " does not fit strategy '", name, "' (it shards over all ranks); use ",
                   strategy == Strategy::kFullShard ? "hybrid_shard" : "hybrid_shard_zero2",
                   ", or set the replicate degree to 1"));
      }
      break;
    case Strategy::kNoShard:
      if (shard != 1) {
        return absl::InvalidArgumentError(
            StrCat("parallelism.data_parallel_shard_degree=",
                   Inferred(p.data_parallel_shard_degree, shard, world_size),
                   " does not fit strategy '", name,
                   "' (it replicates over all ranks, like DDP); use hybrid_shard, or set the shard "
                   "degree to 1 and the replicate degree to -1"));
      }
      break;
    case Strategy::kHybridShard:
    case Strategy::kHybridShardZero2:
      if (replicate < 2) {
        return absl::InvalidArgumentError(
            StrCat("parallelism.data_parallel_replicate_degree=",
                   Inferred(p.data_parallel_replicate_degree, replicate, world_size),
                   " does not fit strategy '", name,
                   "' (it replicates over groups of shards); set the replicate degree to 2 or "
                   "more, or use ",
                   strategy == Strategy::kHybridShard ? "full_shard" : "shard_grad_op"));
      }
      break;
  }
  return absl::OkStatus();
}

}  // namespace

// Either degree may be -1 (not both): it is inferred so that replicate x shard = world size.
// DDP (no_shard) configs thus say shard 1, replicate -1, and fit any world size; FSDP configs
// say replicate 1, shard -1.
absl::Status RunConfig::ValidateForWorld(int world_size) const {
  const ParallelismSection& p = parallelism;
  if (p.Unwrapped()) {
    if (world_size == 1) return absl::OkStatus();
    return absl::InvalidArgumentError(
        StrCat("parallelism.strategy none trains the plain model on one rank, not ", world_size,
               "; use --nproc 1, or a sharding strategy (full_shard, no_shard, ...) for ",
               world_size, " ranks"));
  }
  std::string degrees =
      StrCat("parallelism.data_parallel_replicate_degree=", p.data_parallel_replicate_degree,
             ", parallelism.data_parallel_shard_degree=", p.data_parallel_shard_degree);
  absl::StatusOr<MeshShape> mesh = ResolveMeshShape(
      {"replicate", "shard"},
      {ClampToInt(p.data_parallel_replicate_degree), ClampToInt(p.data_parallel_shard_degree)},
      world_size);
  if (!mesh.ok()) {
    return absl::InvalidArgumentError(StrCat(degrees, ": ", std::string(mesh.status().message())));
  }
  const int replicate = mesh->degrees[0];
  const int shard = mesh->degrees[1];
  FSDP_RETURN_IF_ERROR(CheckStrategyFits(p, *p.strategy, replicate, shard, world_size));
  return CheckReshardGroup(
      p.reshard_after_forward, shard,
      StrCat("parallelism.data_parallel_shard_degree=",
             Inferred(p.data_parallel_shard_degree, shard, world_size),
             " (true or false to reshard to the whole shard axis or not at all)"));
}

}  // namespace fsdp
