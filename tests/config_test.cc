#include "engine/config.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <yaml-cpp/yaml.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/strings.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/status_matchers.h"

namespace fsdp {
namespace {

using ::testing::HasSubstr;
using testing::InvalidArgumentWith;
using ::testing::StartsWith;
using ::testing::StrEq;

constexpr char kSections[] =
    "run, model, data, training, optimizer, lr_scheduler, parallelism, metrics, checkpoint";
constexpr char kModelKeys[] =
    "arch, vocab_size, dim, n_layers, n_heads, n_kv_heads, seq_len, ffn_hidden, norm, activation, "
    "positions, tie_embeddings, norm_eps, rope_theta, init_std, kernels, loss_chunk_tokens, "
    "attention, deferred_init, init_from, freeze";
constexpr char kTrainingKeys[] =
    "steps, micro_batch_size, grad_accum_steps, grad_sync, max_grad_norm, mixed_precision, "
    "reduce_dtype, "
    "device, cpu_allocator, on_nonfinite, eval_interval, eval_batches, log_interval, "
    "activation_checkpointing, profile, profile_dir, deterministic";
constexpr char kStrategies[] =
    "full_shard, shard_grad_op, hybrid_shard, hybrid_shard_zero2, no_shard, none";

absl::StatusOr<RunConfig> Parse(const std::string& yaml, std::vector<std::string> overrides = {}) {
  return ParseRunConfig(yaml, "t.yaml", overrides);
}

absl::Status ParseError(const std::string& yaml, std::vector<std::string> overrides = {}) {
  return Parse(yaml, std::move(overrides)).status();
}

// Every field, so that a round trip that drops or changes one fails.
void ExpectSameConfig(const RunConfig& a, const RunConfig& b) {
  EXPECT_EQ(a.run.name, b.run.name);
  EXPECT_EQ(a.run.dir, b.run.dir);
  EXPECT_EQ(a.run.seed, b.run.seed);
  EXPECT_EQ(a.model.arch, b.model.arch);
  EXPECT_EQ(a.model.vocab_size, b.model.vocab_size);
  EXPECT_EQ(a.model.dim, b.model.dim);
  EXPECT_EQ(a.model.n_layers, b.model.n_layers);
  EXPECT_EQ(a.model.n_heads, b.model.n_heads);
  EXPECT_EQ(a.model.n_kv_heads, b.model.n_kv_heads);
  EXPECT_EQ(a.model.seq_len, b.model.seq_len);
  EXPECT_EQ(a.model.ffn_hidden, b.model.ffn_hidden);
  EXPECT_EQ(a.model.norm, b.model.norm);
  EXPECT_EQ(a.model.activation, b.model.activation);
  EXPECT_EQ(a.model.positions, b.model.positions);
  EXPECT_EQ(a.model.tie_embeddings, b.model.tie_embeddings);
  EXPECT_EQ(a.model.norm_eps, b.model.norm_eps);
  EXPECT_EQ(a.model.rope_theta, b.model.rope_theta);
  EXPECT_EQ(a.model.init_std, b.model.init_std);
  EXPECT_EQ(a.model.deferred_init, b.model.deferred_init);
  EXPECT_EQ(a.model.init_from, b.model.init_from);
  EXPECT_EQ(a.checkpoint.enabled, b.checkpoint.enabled);
  EXPECT_EQ(a.checkpoint.dir, b.checkpoint.dir);
  EXPECT_EQ(a.checkpoint.interval, b.checkpoint.interval);
  EXPECT_EQ(a.checkpoint.keep_latest_k, b.checkpoint.keep_latest_k);
  EXPECT_EQ(a.checkpoint.load, b.checkpoint.load);
  EXPECT_EQ(a.checkpoint.async, b.checkpoint.async);
  EXPECT_EQ(a.data.source, b.data.source);
  EXPECT_EQ(a.data.path, b.data.path);
  EXPECT_EQ(a.data.token_dtype, b.data.token_dtype);
  EXPECT_EQ(a.data.header, b.data.header);
  EXPECT_EQ(a.data.val_fraction, b.data.val_fraction);
  EXPECT_EQ(a.data.synthetic_tokens, b.data.synthetic_tokens);
  EXPECT_EQ(a.training.steps, b.training.steps);
  EXPECT_EQ(a.training.micro_batch_size, b.training.micro_batch_size);
  EXPECT_EQ(a.training.grad_accum_steps, b.training.grad_accum_steps);
  EXPECT_EQ(a.training.max_grad_norm, b.training.max_grad_norm);
  EXPECT_EQ(a.training.mixed_precision, b.training.mixed_precision);
  EXPECT_EQ(a.training.reduce_dtype, b.training.reduce_dtype);
  EXPECT_EQ(a.training.device, b.training.device);
  EXPECT_EQ(a.training.on_nonfinite, b.training.on_nonfinite);
  EXPECT_EQ(a.training.eval_interval, b.training.eval_interval);
  EXPECT_EQ(a.training.eval_batches, b.training.eval_batches);
  EXPECT_EQ(a.training.log_interval, b.training.log_interval);
  EXPECT_EQ(a.training.profile.start, b.training.profile.start);
  EXPECT_EQ(a.training.profile.steps, b.training.profile.steps);
  EXPECT_EQ(a.training.profile_dir, b.training.profile_dir);
  EXPECT_EQ(a.training.deterministic, b.training.deterministic);
  EXPECT_EQ(a.optimizer.kind, b.optimizer.kind);
  EXPECT_EQ(a.optimizer.implementation, b.optimizer.implementation);
  EXPECT_EQ(a.optimizer.lr, b.optimizer.lr);
  EXPECT_EQ(a.optimizer.weight_decay, b.optimizer.weight_decay);
  EXPECT_EQ(a.optimizer.beta1, b.optimizer.beta1);
  EXPECT_EQ(a.optimizer.beta2, b.optimizer.beta2);
  EXPECT_EQ(a.optimizer.eps, b.optimizer.eps);
  EXPECT_EQ(a.optimizer.momentum, b.optimizer.momentum);
  EXPECT_EQ(a.lr_scheduler.warmup_steps, b.lr_scheduler.warmup_steps);
  EXPECT_EQ(a.lr_scheduler.decay, b.lr_scheduler.decay);
  EXPECT_EQ(a.lr_scheduler.min_lr, b.lr_scheduler.min_lr);
  EXPECT_EQ(a.parallelism.nproc, b.parallelism.nproc);
  EXPECT_EQ(a.parallelism.data_parallel_replicate_degree,
            b.parallelism.data_parallel_replicate_degree);
  EXPECT_EQ(a.parallelism.data_parallel_shard_degree, b.parallelism.data_parallel_shard_degree);
  EXPECT_EQ(a.parallelism.strategy, b.parallelism.strategy);
  EXPECT_EQ(a.parallelism.reshard_after_forward, b.parallelism.reshard_after_forward);
  EXPECT_EQ(a.parallelism.wrap_policy, b.parallelism.wrap_policy);
  EXPECT_EQ(a.parallelism.max_unsharded_units, b.parallelism.max_unsharded_units);
  EXPECT_EQ(a.parallelism.backend, b.parallelism.backend);
  EXPECT_EQ(a.metrics.jsonl, b.metrics.jsonl);
  EXPECT_EQ(a.metrics.cpu_peak_flops, b.metrics.cpu_peak_flops);
  EXPECT_EQ(a.metrics.print_config, b.metrics.print_config);
  EXPECT_EQ(a.metrics.progress_bar, b.metrics.progress_bar);
}

// --- parsing -------------------------------------------------------------------------------

TEST(RunConfigParseTest, EmptyDocumentGivesTheDefaults) {
  for (const char* text : {"", "# only a comment\n", "model:\n"}) {
    absl::StatusOr<RunConfig> config = Parse(text);
    ASSERT_TRUE(config.ok()) << config.status();
    EXPECT_EQ(config->source_file, "t.yaml");
    ExpectSameConfig(*config, RunConfig{});
  }
}

TEST(RunConfigParseTest, ReadsEveryType) {
  absl::StatusOr<RunConfig> config = Parse(
      "run:\n  name: 42\n  seed: -7\n"
      "model:\n  dim: 256\n  tie_embeddings: false\n  norm_eps: 1e-6\n  rope_theta: 500000\n"
      "optimizer:\n  lr: 1e-3\n  weight_decay: 0\n  beta2: .99\n"
      "parallelism:\n  reshard_after_forward: false\n  wrap_policy: params:1000\n");
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->run.name, "42");
  EXPECT_EQ(config->run.seed, -7);
  EXPECT_EQ(config->model.dim, 256);
  EXPECT_FALSE(config->model.tie_embeddings);
  EXPECT_EQ(config->model.norm_eps, 1e-6);
  EXPECT_EQ(config->model.rope_theta, 500000.0);
  EXPECT_EQ(config->optimizer.lr, 1e-3);
  EXPECT_EQ(config->optimizer.weight_decay, 0.0);
  EXPECT_EQ(config->optimizer.beta2, 0.99);
  EXPECT_EQ(config->Value("parallelism.reshard_after_forward"), "false");
  EXPECT_EQ(config->Value("parallelism.wrap_policy"), "params:1000");
  EXPECT_EQ(config->model.n_heads, 4);  // untouched keys keep their defaults
  EXPECT_EQ(config->model.n_kv_heads, 0);
  EXPECT_EQ(config->model.kv_dim(), 256);
}

TEST(RunConfigParseTest, GroupedQueryAttention) {
  absl::StatusOr<RunConfig> config = Parse("model:\n  dim: 256\n  n_heads: 8\n  n_kv_heads: 2\n");
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->model.kv_heads(), 2);
  EXPECT_EQ(config->model.kv_dim(), 64);  // 2 heads of 256 / 8
  EXPECT_EQ(config->Value("model.n_kv_heads"), "2");
}

TEST(RunConfigParseTest, UnknownKeyWithSuggestion) {
  EXPECT_THAT(ParseError("run:\n  name: x\ntraining:\n  stpes: 5\n"),
              InvalidArgumentWith(
                  StrCat("t.yaml:4: training.stpes: unknown key; did you mean 'steps'? (valid: ",
                         kTrainingKeys, ")")));
  EXPECT_THAT(
      ParseError("model:\n  N_Heads: 2\n"),
      InvalidArgumentWith(HasSubstr("model.N_Heads: unknown key; did you mean 'n_heads'?")));
}

TEST(RunConfigParseTest, UnknownKeyWithoutSuggestion) {
  EXPECT_THAT(ParseError("model:\n  dim: 64\n  hidden_size: 3\n"),
              InvalidArgumentWith(
                  StrCat("t.yaml:3: model.hidden_size: unknown key (valid: ", kModelKeys, ")")));
}

TEST(RunConfigParseTest, UnknownSection) {
  EXPECT_THAT(
      ParseError("modle:\n  dim: 3\n"),
      InvalidArgumentWith(StrCat(
          "t.yaml:1: modle: unknown section; did you mean 'model'? (valid: ", kSections, ")")));
  EXPECT_THAT(ParseError("run:\n  seed: 1\nlogging:\n  interval: 5\n"),
              InvalidArgumentWith(
                  StrCat("t.yaml:3: logging: unknown section (valid: ", kSections, ")")));
  EXPECT_THAT(ParseError("checkpoint:\n  keep_latest_k: 0\n"),
              InvalidArgumentWith("t.yaml:2: checkpoint.keep_latest_k: must be >= 1, got 0"));
}

TEST(RunConfigParseTest, WrongTypes) {
  EXPECT_THAT(ParseError("model:\n  dim: big\n"),
              InvalidArgumentWith("t.yaml:2: model.dim: expected an integer, got 'big'"));
  EXPECT_THAT(ParseError("model:\n  dim: 1.5\n"),
              InvalidArgumentWith("t.yaml:2: model.dim: expected an integer, got '1.5'"));
  EXPECT_THAT(ParseError("model:\n  dim: [1, 2]\n"),
              InvalidArgumentWith("t.yaml:2: model.dim: expected an integer, got a list"));
  EXPECT_THAT(ParseError("model:\n  dim:\n"),
              InvalidArgumentWith("t.yaml:2: model.dim: expected an integer, got an empty value"));
  EXPECT_THAT(ParseError("optimizer:\n  lr: abc\n"),
              InvalidArgumentWith("t.yaml:2: optimizer.lr: expected a number, got 'abc'"));
  EXPECT_THAT(ParseError("optimizer:\n  lr: .inf\n"),
              InvalidArgumentWith("t.yaml:2: optimizer.lr: expected a number, got '.inf'"));
  EXPECT_THAT(
      ParseError("model:\n  tie_embeddings: yes\n"),
      InvalidArgumentWith("t.yaml:2: model.tie_embeddings: expected true or false, got 'yes'"));
  EXPECT_THAT(ParseError("metrics:\n  jsonl: 1\n"),
              InvalidArgumentWith("t.yaml:2: metrics.jsonl: expected true or false, got '1'"));
  EXPECT_THAT(ParseError("run:\n  name:\n    first: a\n"),
              InvalidArgumentWith("t.yaml:2: run.name: expected a string, got a map"));
  // A choice says what is valid, and why a natural typo became a map.
  EXPECT_THAT(ParseError("training:\n  activation_checkpointing: {every: 2}\n"),
              InvalidArgumentWith(HasSubstr("training.activation_checkpointing: expected a string, "
                                            "got a map (YAML reads 'a: b' with a space after the "
                                            "colon as a map: write a:b); valid: none, full, "
                                            "selective, every:k")));
  EXPECT_THAT(ParseError("parallelism:\n  offload: [params]\n"),
              InvalidArgumentWith(HasSubstr(
                  "parallelism.offload: expected a string, got a list; valid: none, optimizer")));
}

TEST(RunConfigParseTest, ProfileWindowPastTheRunDoesNotOverflow) {
  EXPECT_THAT(ParseError("training:\n  steps: 10\n  profile: '9223372036854775807:1'\n"),
              InvalidArgumentWith(HasSubstr("ends after step 2^63 of a run of 10 steps")));
  EXPECT_THAT(ParseError("training:\n  steps: 10\n  profile: '1:9223372036854775807'\n"),
              InvalidArgumentWith(HasSubstr("ends after step 2^63 of a run of 10 steps")));
  EXPECT_THAT(ParseError("training:\n  steps: 10\n  profile: '8:3'\n"),
              InvalidArgumentWith(HasSubstr("'8:3' ends after step 11 of a run of 10 steps")));
}

TEST(RunConfigParseTest, SectionsAndTopLevelMustBeMaps) {
  EXPECT_THAT(ParseError("- run\n- model\n"),
              InvalidArgumentWith(
                  StrCat("t.yaml:1: expected a map of sections (", kSections, "), got a list")));
  EXPECT_THAT(ParseError("run:\n  seed: 3\nmodel: 3\n"),
              InvalidArgumentWith(StrCat(
                  "t.yaml:3: model: expected a map of keys, got '3' (valid: ", kModelKeys, ")")));
}

TEST(RunConfigParseTest, DuplicateKeysAndSections) {
  EXPECT_THAT(ParseError("training:\n  steps: 5\n  steps: 6\n"),
              InvalidArgumentWith("t.yaml:3: training.steps: duplicate key (first at t.yaml:2)"));
  EXPECT_THAT(ParseError("model:\n  dim: 64\nrun:\n  seed: 1\nmodel:\n  n_layers: 2\n"),
              InvalidArgumentWith("t.yaml:5: model: duplicate section (first at t.yaml:1)"));
}

TEST(RunConfigParseTest, OutOfRangeValue) {
  EXPECT_THAT(ParseError("run:\n  name: x\ntraining:\n  steps: -3\n"),
              InvalidArgumentWith("t.yaml:4: training.steps: must be >= 1, got -3"));
}

TEST(RunConfigParseTest, InvalidEnumeration) {
  EXPECT_THAT(ParseError("parallelism:\n  strategy: fully_shard\n"),
              InvalidArgumentWith(StrCat("t.yaml:2: parallelism.strategy: 'fully_shard' is not "
                                         "valid; did you mean 'full_shard'? valid: ",
                                         kStrategies)));
  EXPECT_THAT(ParseError("parallelism:\n  strategy: zero3\n"),
              InvalidArgumentWith(StrCat(
                  "t.yaml:2: parallelism.strategy: 'zero3' is not valid; valid: ", kStrategies)));
  EXPECT_THAT(ParseError("training:\n  device: gpu\n"),
              InvalidArgumentWith("t.yaml:2: training.device: 'gpu' is not valid; did you mean "
                                  "'cpu'? valid: auto, cpu, cuda"));
}

TEST(RunConfigParseTest, YamlSyntaxError) {
  EXPECT_THAT(ParseError("model:\n  dim: [1, 2\n"),
              InvalidArgumentWith("t.yaml:3: YAML syntax error: end of sequence flow not found"));
  EXPECT_THAT(ParseError("model:\n  dim: 1\n  n_heads: 2: 3\n"),
              InvalidArgumentWith("t.yaml:3: YAML syntax error: illegal map value"));
}

// Every value rule, through --set so that each message is exact and independent.
TEST(RunConfigParseTest, EveryValueRule) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"run.name=", "run.name: must not be empty"},
      {"model.arch=bert", "model.arch: 'bert' is not valid; valid: gpt, llama, mlp"},
      {"model.vocab_size=1", "model.vocab_size: must be >= 2, got 1"},
      {"model.dim=0", "model.dim: must be >= 1, got 0"},
      {"model.n_layers=0", "model.n_layers: must be >= 1, got 0"},
      {"model.n_heads=0", "model.n_heads: must be >= 1, got 0"},
      {"model.dim=130", "model.dim: must be a multiple of model.n_heads = 4, got 130"},
      {"model.n_kv_heads=-1", "model.n_kv_heads: must be >= 0, got -1"},
      {"model.n_kv_heads=3", "model.n_kv_heads: must divide model.n_heads = 4 (0: n_heads), got 3"},
      {"model.n_kv_heads=8", "model.n_kv_heads: must divide model.n_heads = 4 (0: n_heads), got 8"},
      {"model.seq_len=0", "model.seq_len: must be >= 1, got 0"},
      {"model.ffn_hidden=-1", "model.ffn_hidden: must be >= 0, got -1"},
      {"model.norm=batchnorm", "model.norm: 'batchnorm' is not valid; valid: layernorm, rmsnorm"},
      {"model.activation=relu",
       "model.activation: 'relu' is not valid; did you mean 'gelu'? valid: gelu, swiglu"},
      {"model.positions=alibi", "model.positions: 'alibi' is not valid; valid: learned, rope"},
      {"model.norm_eps=0", "model.norm_eps: must be > 0, got 0"},
      {"model.rope_theta=-1", "model.rope_theta: must be > 0, got -1"},
      {"model.init_std=0", "model.init_std: must be > 0, got 0"},
      {"model.init_std=1e300",
       "model.init_std: must be at most float32's largest value (3.4e38), got 1e+300"},
      {"training.max_grad_norm=1e300",
       "training.max_grad_norm: must be at most float32's largest value (3.4e38), got 1e+300"},
      {"data.source=web", "data.source: 'web' is not valid; valid: synthetic, tokens, text"},
      {"data.source=text", "data.path: required for data.source 'text'"},
      {"data.token_dtype=int8", "data.token_dtype: 'int8' is not valid; valid: uint16, uint32"},
      {"data.val_fraction=1", "data.val_fraction: must be in [0, 1), got 1"},
      {"data.val_fraction=-0.1", "data.val_fraction: must be in [0, 1), got -0.1"},
      {"data.synthetic_tokens=1000", "data.synthetic_tokens: must be >= 1024, got 1000"},
      // Generated in memory: 2^63 failed inside std::vector as an internal error.
      {"data.synthetic_tokens=9223372036854775807",
       "data.synthetic_tokens: must be <= 2^32 = 4294967296 (the synthetic stream is generated "
       "in memory at start, 4 bytes a token; data.source tokens reads a file of any size), got "
       "9223372036854775807"},
      // Every evaluation was NaN, exit 0 (the default eval_interval is 50).
      {"data.val_fraction=0",
       "training.eval_interval: 50 evaluates on the held-out part of the data, but "
       "data.val_fraction is 0 (nothing held out); set data.val_fraction (e.g. 0.05), or "
       "training.eval_interval: 0"},
      {"training.steps=0", "training.steps: must be >= 1, got 0"},
      {"training.micro_batch_size=0", "training.micro_batch_size: must be >= 1, got 0"},
      {"training.grad_accum_steps=0", "training.grad_accum_steps: must be >= 1, got 0"},
      {"training.mixed_precision=fp16",
       "training.mixed_precision: 'fp16' is not valid; did you mean 'fp32'? valid: fp32, bf16"},
      {"training.reduce_dtype=float",
       "training.reduce_dtype: 'float' is not valid; valid: fp32, bf16"},
      {"training.device=tpu",
       "training.device: 'tpu' is not valid; did you mean 'cpu'? valid: auto, cpu, cuda"},
      {"training.on_nonfinite=abort",
       "training.on_nonfinite: 'abort' is not valid; valid: stop, skip"},
      {"training.eval_interval=-1", "training.eval_interval: must be >= 0, got -1"},
      {"training.eval_batches=0", "training.eval_batches: must be >= 1, got 0"},
      {"training.log_interval=0", "training.log_interval: must be >= 1, got 0"},
      {"optimizer.name=lion", "optimizer.name: 'lion' is not valid; valid: adamw, adam, sgd"},
      {"optimizer.lr=0", "optimizer.lr: must be > 0, got 0"},
      {"optimizer.weight_decay=-0.5", "optimizer.weight_decay: must be >= 0, got -0.5"},
      {"optimizer.beta1=1", "optimizer.beta1: must be in [0, 1), got 1"},
      {"optimizer.beta2=-0.9", "optimizer.beta2: must be in [0, 1), got -0.9"},
      {"optimizer.eps=0", "optimizer.eps: must be > 0, got 0"},
      {"optimizer.momentum=-1", "optimizer.momentum: must be >= 0, got -1"},
      {"lr_scheduler.warmup_steps=-1", "lr_scheduler.warmup_steps: must be >= 0, got -1"},
      {"lr_scheduler.decay=step",
       "lr_scheduler.decay: 'step' is not valid; valid: cosine, linear, constant"},
      {"lr_scheduler.min_lr=-1", "lr_scheduler.min_lr: must be >= 0, got -1"},
      {"lr_scheduler.min_lr=0.01",
       "lr_scheduler.min_lr: must be <= optimizer.lr = 0.003, got 0.01"},
      {"parallelism.nproc=-1", "parallelism.nproc: must be >= 0, got -1"},
      {"parallelism.data_parallel_replicate_degree=0",
       "parallelism.data_parallel_replicate_degree: must be >= 1, or -1 to infer it from the "
       "world size, got 0"},
      {"parallelism.data_parallel_shard_degree=-2",
       "parallelism.data_parallel_shard_degree: must be >= 1, or -1 to infer it from the world "
       "size, got -2"},
      {"parallelism.data_parallel_replicate_degree=-1",
       "parallelism.data_parallel_replicate_degree: -1 needs a fixed "
       "parallelism.data_parallel_shard_degree; at most one of the two degrees may be -1 "
       "(inferred from the world size)"},
      {"parallelism.reshard_after_forward=True",
       "parallelism.reshard_after_forward: 'True' is not valid; did you mean 'true'? valid: "
       "default, true, false, or an integer k with 1 < k < the shard degree, dividing it (reshard "
       "to groups of k ranks)"},
      {"parallelism.reshard_after_forward=0",
       "parallelism.reshard_after_forward: '0' is not valid; valid: default, true, false, or an "
       "integer k with 1 < k < the shard degree, dividing it (reshard to groups of k ranks)"},
      {"parallelism.wrap_policy=params:0",
       "parallelism.wrap_policy: 'params:0' is not valid; valid: block, params:N (children with "
       ">= N parameters, N >= 1)"},
      {"parallelism.wrap_policy=blocks",
       "parallelism.wrap_policy: 'blocks' is not valid; did you mean 'block'? valid: block, "
       "params:N (children with >= N parameters, N >= 1)"},
      {"parallelism.max_unsharded_units=0", "parallelism.max_unsharded_units: must be >= 1, got 0"},
      {"parallelism.backend=mpi",
       "parallelism.backend: 'mpi' is not valid; valid: auto, nccl, gloo"},
      {"parallelism.cpu_collectives=ring",
       "parallelism.cpu_collectives: 'ring' is not valid; valid: p2p, gloo"},
      {"training.cpu_allocator=jemalloc",
       "training.cpu_allocator: 'jemalloc' is not valid; valid: caching, default"},
      {"metrics.cpu_peak_flops=-1",
       "metrics.cpu_peak_flops: must be > 0 (FLOP/s per rank), or 0 for unset (no MFU on CPU), "
       "got -1"},
      {"metrics.progress_bar=yes",
       "metrics.progress_bar: 'yes' is not valid; valid: auto, on, off"},
  };
  for (const auto& [item, message] : cases) {
    EXPECT_THAT(ParseError("", {item}), InvalidArgumentWith(StrCat("--set ", item, ": ", message)));
  }
}

TEST(RunConfigParseTest, CrossKeyErrorsPointAtWhereEitherKeyWasSet) {
  EXPECT_THAT(ParseError("model:\n  n_heads: 3\n"),
              InvalidArgumentWith("t.yaml:2: model.dim: must be a multiple of model.n_heads = 3, "
                                  "got 128"));
  EXPECT_THAT(ParseError("model:\n  dim: 12\n  positions: rope\n"),
              InvalidArgumentWith("t.yaml:3: model.positions: rope needs an even head dimension, "
                                  "got model.dim / model.n_heads = 12 / 4 = 3"));
  EXPECT_THAT(ParseError("model:\n  positions: rope\n", {"model.dim=12"}),
              InvalidArgumentWith("t.yaml:2: model.positions: rope needs an even head dimension, "
                                  "got model.dim / model.n_heads = 12 / 4 = 3"));
  // n_kv_heads set in the file, n_heads changed by --set: the error points at the file's line.
  EXPECT_THAT(ParseError("model:\n  n_heads: 8\n  n_kv_heads: 4\n", {"model.n_heads=2"}),
              InvalidArgumentWith("t.yaml:3: model.n_kv_heads: must divide model.n_heads = 2 "
                                  "(0: n_heads), got 4"));
  EXPECT_THAT(ParseError("", {"optimizer.lr=1e-4"}),
              InvalidArgumentWith("--set optimizer.lr=1e-4: lr_scheduler.min_lr: must be <= "
                                  "optimizer.lr = 0.0001, got 0.0003"));
  EXPECT_THAT(ParseError("run:\n  seed: 1\ndata:\n  source: tokens\n"),
              InvalidArgumentWith("t.yaml:4: data.path: required for data.source 'tokens'"));
  // Note [Delayed parameter update]: only with offload.
  EXPECT_THAT(ParseError("parallelism:\n  offload_delayed_update: on\n"),
              InvalidArgumentWith(HasSubstr("t.yaml:2: parallelism.offload_delayed_update: needs "
                                            "parallelism.offload: optimizer or params")));
}

TEST(RunConfigParseTest, DelayedUpdateIsOffOnOrAfterN) {
  for (const auto& [text, enabled, after] :
       std::vector<std::tuple<std::string, bool, int64_t>>{
           {"off", false, 0}, {"on", true, 0}, {"after:40", true, 40}, {"after:0", true, 0}}) {
    SCOPED_TRACE(text);
    absl::StatusOr<RunConfig> config =
        Parse("parallelism:\n  offload: optimizer\n  offload_delayed_update: " + text + "\n");
    ASSERT_TRUE(config.ok()) << config.status();
    const DelayedUpdate& d = config->parallelism.offload_delayed_update;
    EXPECT_EQ(d.enabled, enabled);
    EXPECT_EQ(d.after, after);
    EXPECT_EQ(d.At(after), enabled);
    EXPECT_FALSE(d.At(after - 1));
  }
  EXPECT_THAT(ParseError("", {"parallelism.offload=params",
                              "parallelism.offload_delayed_update=after:-1"}),
              InvalidArgumentWith(HasSubstr("'after:-1' is not valid")));
  // The old boolean spelling names the new one.
  EXPECT_THAT(ParseError("parallelism:\n  offload: params\n  offload_delayed_update: true\n"),
              InvalidArgumentWith(HasSubstr("'true' is not valid; valid: off, on, after:N")));
  EXPECT_THAT(ParseError("parallelism:\n  offload: params\n  offload_delayed_update: true\n"),
              InvalidArgumentWith(HasSubstr("(write on)")));
  absl::StatusOr<RunConfig> round = Parse("parallelism:\n  offload: params\n"
                                          "  offload_delayed_update: after:3\n");
  ASSERT_TRUE(round.ok());
  EXPECT_THAT(round->ToYaml(), HasSubstr("offload_delayed_update: after:3"));
}

// The offload keys that became automatic or were folded in: each error names the replacement,
// in a file and on the command line.
TEST(RunConfigParseTest, RemovedOffloadKeysNameTheirReplacement) {
  EXPECT_THAT(ParseError("parallelism:\n  offload: params\n  offload_overlap_step: false\n"),
              InvalidArgumentWith(HasSubstr("t.yaml:3: parallelism.offload_overlap_step: was "
                                            "removed: the overlapped host step is always on")));
  EXPECT_THAT(ParseError("", {"parallelism.offload_overlap_step=false"}),
              InvalidArgumentWith(HasSubstr("FSDP_OFFLOAD_OVERLAP_STEP=0")));
  EXPECT_THAT(ParseError("", {"parallelism.offload_compute_copy=false"}),
              InvalidArgumentWith(HasSubstr("parallelism.offload_compute_copy: was removed: "
                                            "offload params keeps the compute-dtype copy")));
  EXPECT_THAT(ParseError("parallelism:\n  offload_delayed_update_warmup: 40\n"),
              InvalidArgumentWith(HasSubstr("write parallelism.offload_delayed_update: after:N")));
}

// The debugging knobs reach the engine's options through ShardingPlanFor, where the trainer and
// the planner read them; the delayed update cannot go without the overlap or the copies.
TEST(ShardingPlanForTest, OffloadKnobsSetTheOptions) {
  absl::StatusOr<RunConfig> config = Parse("parallelism:\n  offload: params\n");
  ASSERT_TRUE(config.ok());
  auto options = [&](const RunConfig& c) { return ShardingPlanFor(c, Strategy::kFullShard, 2); };
  struct Knob {
    const char* name;
    const char* value;
  };
  auto with = [&](std::vector<Knob> knobs, const RunConfig& c) {
    for (const Knob& k : knobs) ::setenv(k.name, k.value, 1);
    absl::StatusOr<ShardingPlan> plan = options(c);
    for (const Knob& k : knobs) ::unsetenv(k.name);
    return plan;
  };
  absl::StatusOr<ShardingPlan> plain = with({}, *config);
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_TRUE(plain->options.offload_overlap_step);
  EXPECT_EQ(plain->options.offload_compute_copy, ComputeCopy::kAuto);
  absl::StatusOr<ShardingPlan> knobs =
      with({{"FSDP_OFFLOAD_OVERLAP_STEP", "0"}, {"FSDP_OFFLOAD_COMPUTE_COPY", "0"}}, *config);
  ASSERT_TRUE(knobs.ok()) << knobs.status();
  EXPECT_FALSE(knobs->options.offload_overlap_step);
  EXPECT_EQ(knobs->options.offload_compute_copy, ComputeCopy::kDrop);
  EXPECT_EQ(with({{"FSDP_OFFLOAD_COMPUTE_COPY", "1"}}, *config)->options.offload_compute_copy,
            ComputeCopy::kKeep);
  EXPECT_THAT(with({{"FSDP_OFFLOAD_COMPUTE_COPY", "yes"}}, *config).status(),
              InvalidArgumentWith(HasSubstr("FSDP_OFFLOAD_COMPUTE_COPY=yes is not valid")));

  RunConfig delayed = *config;
  delayed.parallelism.offload_delayed_update = {.enabled = true};
  ASSERT_TRUE(with({}, delayed).ok());
  EXPECT_TRUE(with({}, delayed)->options.offload_delayed_update);
  EXPECT_THAT(with({{"FSDP_OFFLOAD_OVERLAP_STEP", "0"}}, delayed).status(),
              InvalidArgumentWith(HasSubstr("parallelism.offload_delayed_update cannot go with "
                                            "FSDP_OFFLOAD_OVERLAP_STEP=0")));
  EXPECT_THAT(with({{"FSDP_OFFLOAD_COMPUTE_COPY", "0"}}, delayed).status(),
              InvalidArgumentWith(HasSubstr("cannot go with FSDP_OFFLOAD_COMPUTE_COPY=0")));
}

// configs/default.yaml is the reference a user copies: it names every key of the schema.
TEST(RunConfigToYamlTest, DefaultConfigNamesEveryKey) {
  std::ifstream in(std::string(FSDP_SOURCE_DIR) + "/configs/default.yaml");
  std::stringstream text;
  text << in.rdbuf();
  const YAML::Node shipped = YAML::Load(text.str());
  const YAML::Node all = YAML::Load(RunConfig().ToYaml());
  std::vector<std::string> missing;
  for (const auto& section : all) {
    const std::string name = section.first.Scalar();
    for (const auto& key : section.second) {
      if (!shipped[name] || !shipped[name][key.first.Scalar()]) {
        missing.push_back(name + "." + key.first.Scalar());
      }
    }
  }
  EXPECT_TRUE(missing.empty()) << "configs/default.yaml lacks: " << StrJoin(missing, ", ");
}

TEST(RunConfigParseTest, ValidRopeAndTokenConfigs) {
  absl::StatusOr<RunConfig> config = Parse(
      "model:\n  arch: llama\n  positions: rope\n  norm: rmsnorm\n  activation: swiglu\n"
      "data:\n  source: tokens\n  path: data/train.bin\n  token_dtype: uint32\n");
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->data.path, "data/train.bin");
}

// --- overrides -----------------------------------------------------------------------------

TEST(RunConfigOverrideTest, MalformedItems) {
  for (const char* item : {"training.steps", "steps=5", "=5", ".steps=5", "training.=5", ""}) {
    EXPECT_THAT(ParseError("", {item}),
                InvalidArgumentWith(StrCat(
                    "--set ", item, ": expected section.key=value (e.g. training.steps=100)")));
  }
}

TEST(RunConfigOverrideTest, UnknownSectionOrKey) {
  EXPECT_THAT(ParseError("", {"training.stpes=5"}),
              InvalidArgumentWith(StrCat("--set training.stpes=5: training.stpes: unknown key; "
                                         "did you mean 'steps'? (valid: ",
                                         kTrainingKeys, ")")));
  EXPECT_THAT(ParseError("", {"model.layers=5"}),
              InvalidArgumentWith(StrCat("--set model.layers=5: model.layers: unknown key; did "
                                         "you mean 'n_layers'? (valid: ",
                                         kModelKeys, ")")));
  EXPECT_THAT(ParseError("", {"trainig.steps=5"}),
              InvalidArgumentWith(StrCat("--set trainig.steps=5: trainig: unknown section; did "
                                         "you mean 'training'? (valid: ",
                                         kSections, ")")));
  EXPECT_THAT(ParseError("", {"logging.interval=5"}),
              InvalidArgumentWith(StrCat("--set logging.interval=5: logging: unknown "
                                         "section (valid: ",
                                         kSections, ")")));
}

TEST(RunConfigOverrideTest, OverridesChangeAndAddValues) {
  absl::StatusOr<RunConfig> config =
      Parse("training:\n  steps: 100\n",
            {"training.steps=50", "optimizer.lr=1e-3", "model.tie_embeddings=false",
             "run.name = my run", "parallelism.strategy=shard_grad_op", "training.steps=60"});
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->training.steps, 60);  // the last one wins
  EXPECT_EQ(config->optimizer.lr, 1e-3);
  EXPECT_FALSE(config->model.tie_embeddings);
  EXPECT_EQ(config->run.name, "my run");
  EXPECT_EQ(config->Value("parallelism.strategy"), "shard_grad_op");
}

TEST(RunConfigOverrideTest, OverridesAreCheckedLikeTheFile) {
  EXPECT_THAT(ParseError("", {"training.steps=-3"}),
              InvalidArgumentWith("--set training.steps=-3: training.steps: must be >= 1, got -3"));
  EXPECT_THAT(ParseError("", {"training.steps=abc"}),
              InvalidArgumentWith(
                  "--set training.steps=abc: training.steps: expected an integer, got 'abc'"));
  EXPECT_THAT(
      ParseError("", {"run.name=[a, b]"}),
      InvalidArgumentWith("--set run.name=[a, b]: run.name: expected a string, got a list"));
  EXPECT_THAT(ParseError("", {"run.name=[a, b"}),
              InvalidArgumentWith("--set run.name=[a, b: run.name: cannot parse the value as "
                                  "YAML: end of sequence flow not found"));
  // An override that fixes the file's bad value is applied before validation.
  EXPECT_TRUE(Parse("training:\n  steps: 0\n", {"training.steps=10"}).ok());
}

// --- files ---------------------------------------------------------------------------------

class TempFile {
 public:
  explicit TempFile(const std::string& text) {
    static int count = 0;
    path_ = std::filesystem::temp_directory_path() /
            StrCat("fsdp_config_test_", getpid(), "_", count++, ".yaml");
    std::ofstream(path_) << text;
  }
  ~TempFile() { std::filesystem::remove(path_); }
  std::string path() const { return path_.string(); }

 private:
  std::filesystem::path path_;
};

TEST(RunConfigLoadTest, ReadsTheFileAndNamesItInMessages) {
  TempFile file("run:\n  name: loaded\n\ntraining:\n  stps: 3\n");
  EXPECT_THAT(LoadRunConfig(file.path(), {}),
              InvalidArgumentWith(StartsWith(
                  StrCat(file.path(), ":5: training.stps: unknown key; did you mean 'steps'?"))));
  absl::StatusOr<RunConfig> config = LoadRunConfig(file.path(), {"training.stps=1"});
  EXPECT_THAT(config, InvalidArgumentWith(StartsWith(StrCat(file.path(), ":5:"))));
  TempFile good("run:\n  name: loaded\n");
  config = LoadRunConfig(good.path(), {"training.steps=7"});
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->source_file, good.path());
  EXPECT_EQ(config->run.name, "loaded");
  EXPECT_EQ(config->training.steps, 7);
}

TEST(RunConfigLoadTest, MissingFileIsNotFound) {
  absl::StatusOr<RunConfig> config = LoadRunConfig("/nonexistent/configs/x.yaml", {});
  EXPECT_EQ(config.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(std::string(config.status().message()),
            "/nonexistent/configs/x.yaml: no such config file");
  EXPECT_THAT(LoadRunConfig(std::filesystem::temp_directory_path().string(), {}),
              InvalidArgumentWith(HasSubstr("is a directory")));
}

// A FIFO used to block the command until something wrote to it (every subcommand that takes a
// config hung); /dev/zero would never end. Only a regular file is opened.
TEST(RunConfigLoadTest, OnlyARegularFileIsRead) {
  const std::string fifo =
      (std::filesystem::temp_directory_path() / StrCat("fsdp_config_test_fifo_", getpid(), ".yaml"))
          .string();
  std::filesystem::remove(fifo);
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0) << std::strerror(errno);
  absl::StatusOr<RunConfig> config = LoadRunConfig(fifo, {});
  std::filesystem::remove(fifo);
  EXPECT_THAT(config, InvalidArgumentWith(
                          StrEq(StrCat(fifo, ": is a FIFO (named pipe), not a YAML file"))));
  EXPECT_THAT(LoadRunConfig("/dev/zero", {}),
              InvalidArgumentWith(StrEq("/dev/zero: is a character device, not a YAML file")));
  EXPECT_THAT(LoadRunConfig("/dev/null", {}), InvalidArgumentWith(HasSubstr("character device")));
  // A symbolic link to a regular file is that file.
  TempFile target("run:\n  name: linked\n");
  const std::string link = target.path() + ".link.yaml";
  std::filesystem::remove(link);
  std::filesystem::create_symlink(target.path(), link);
  config = LoadRunConfig(link, {});
  std::filesystem::remove(link);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->run.name, "linked");
}

// --- world size ----------------------------------------------------------------------------

RunConfig WithDegrees(const std::string& strategy, int64_t replicate, int64_t shard) {
  RunConfig config;
  config.parallelism.strategy = *ParseStrategy(strategy);
  config.parallelism.data_parallel_replicate_degree = replicate;
  config.parallelism.data_parallel_shard_degree = shard;
  return config;
}

TEST(RunConfigWorldTest, DefaultsFitAnyWorld) {
  for (int world : {1, 2, 3, 8}) EXPECT_TRUE(RunConfig{}.ValidateForWorld(world).ok());
}

TEST(RunConfigWorldTest, DegreesMustMultiplyToTheWorldSize) {
  EXPECT_THAT(WithDegrees("hybrid_shard", 2, 3).ValidateForWorld(4),
              InvalidArgumentWith(
                  "parallelism.data_parallel_replicate_degree=2, "
                  "parallelism.data_parallel_shard_degree=3: mesh (replicate=2, shard=3) needs "
                  "2 x 3 = 6 ranks but the world size is 4; the degrees must multiply to the "
                  "world size (use -1 for one degree to infer it)"));
  EXPECT_THAT(WithDegrees("hybrid_shard", 3, -1).ValidateForWorld(4),
              InvalidArgumentWith(
                  "parallelism.data_parallel_replicate_degree=3, "
                  "parallelism.data_parallel_shard_degree=-1: cannot infer mesh degree 'shard' "
                  "in (replicate=3, shard=-1): the world size 4 is not divisible by the other "
                  "degrees 3 = 3"));
  EXPECT_THAT(RunConfig{}.ValidateForWorld(0), InvalidArgumentWith(HasSubstr("world size 0")));
}

TEST(RunConfigWorldTest, InfersEitherDegree) {
  EXPECT_TRUE(WithDegrees("full_shard", 1, -1).ValidateForWorld(5).ok());
  EXPECT_TRUE(WithDegrees("no_shard", -1, 1).ValidateForWorld(3).ok());
  EXPECT_TRUE(WithDegrees("hybrid_shard", 2, -1).ValidateForWorld(8).ok());
  EXPECT_TRUE(WithDegrees("hybrid_shard_zero2", -1, 4).ValidateForWorld(8).ok());
  EXPECT_TRUE(WithDegrees("hybrid_shard", -1, 1).ValidateForWorld(2).ok());
}

TEST(RunConfigWorldTest, TwoInferredDegreesAreRejected) {
  EXPECT_THAT(WithDegrees("hybrid_shard", -1, -1).ValidateForWorld(4),
              InvalidArgumentWith(
                  "parallelism.data_parallel_replicate_degree=-1, "
                  "parallelism.data_parallel_shard_degree=-1: mesh (replicate=-1, shard=-1) has "
                  "more than one -1 degree ('replicate' and 'shard'); at most one may be "
                  "inferred"));
  EXPECT_THAT(ParseError("parallelism:\n  data_parallel_replicate_degree: -1\n"),
              InvalidArgumentWith(StartsWith(
                  "t.yaml:2: parallelism.data_parallel_replicate_degree: -1 needs a fixed")));
}

TEST(RunConfigWorldTest, DegreesMustAgreeWithTheStrategy) {
  EXPECT_THAT(WithDegrees("full_shard", 2, -1).ValidateForWorld(4),
              InvalidArgumentWith("parallelism.data_parallel_replicate_degree=2 does not fit "
                                  "strategy 'full_shard' (it shards over all ranks); use "
                                  "hybrid_shard, or set the replicate degree to 1"));
  EXPECT_THAT(WithDegrees("shard_grad_op", -1, 2).ValidateForWorld(4),
              InvalidArgumentWith("parallelism.data_parallel_replicate_degree=2 (inferred from "
                                  "world size 4) does not fit strategy 'shard_grad_op' (it shards "
                                  "over all ranks); use hybrid_shard_zero2, or set the replicate "
                                  "degree to 1"));
  EXPECT_THAT(WithDegrees("no_shard", 1, -1).ValidateForWorld(2),
              InvalidArgumentWith("parallelism.data_parallel_shard_degree=2 (inferred from world "
                                  "size 2) does not fit strategy 'no_shard' (it replicates over "
                                  "all ranks, like DDP); use hybrid_shard, or set the shard "
                                  "degree to 1 and the replicate degree to -1"));
  EXPECT_THAT(WithDegrees("hybrid_shard", 1, -1).ValidateForWorld(4),
              InvalidArgumentWith("parallelism.data_parallel_replicate_degree=1 does not fit "
                                  "strategy 'hybrid_shard' (it replicates over groups of shards); "
                                  "set the replicate degree to 2 or more, or use full_shard"));
  EXPECT_TRUE(WithDegrees("no_shard", 1, 1).ValidateForWorld(1).ok());
}

TEST(RunConfigWorldTest, ReshardGroupMustDivideTheShardDegree) {
  RunConfig config = WithDegrees("full_shard", 1, -1);
  config.parallelism.reshard_after_forward = {ReshardPolicy::Kind::kGroup, 3};
  EXPECT_THAT(config.ValidateForWorld(4),
              InvalidArgumentWith(HasSubstr("parallelism.reshard_after_forward=3 must divide the "
                                            "shard degree and be smaller than it, "
                                            "parallelism.data_parallel_shard_degree=4 (inferred "
                                            "from world size 4)")));
  config.parallelism.reshard_after_forward = {ReshardPolicy::Kind::kGroup, 2};
  EXPECT_TRUE(config.ValidateForWorld(4).ok());
  EXPECT_TRUE(config.ValidateForWorld(6).ok());
  // k equal to the shard degree is the whole axis (true), not a sub-group: an error.
  EXPECT_THAT(config.ValidateForWorld(2),
              InvalidArgumentWith(HasSubstr("must divide the shard degree and be smaller")));
}

TEST(RunConfigWorldTest, ReshardGroupOfOneIsRejectedAtParse) {
  // 1 used to pass validation and behave as true.
  for (const char* k : {"1", "0", "-2"}) {
    EXPECT_THAT(ParseRunConfig("", "t.yaml", {StrCat("parallelism.reshard_after_forward=", k)}),
                InvalidArgumentWith(HasSubstr("an integer k with 1 < k < the shard degree")))
        << k;
  }
}

TEST(ShardingPlanTest, OneMappingForTrainerAndPlanner) {
  RunConfig config;
  absl::StatusOr<ShardingPlan> plan = ShardingPlanFor(config, Strategy::kFullShard, 4);
  ASSERT_TRUE(plan.ok());
  EXPECT_TRUE(plan->options.reshard_after_forward);
  EXPECT_EQ(plan->options.reshard_group_size, 0);
  EXPECT_EQ(plan->effective, "full_shard");
  EXPECT_FALSE(plan->options.mixed_precision.param_dtype.has_value());

  // An override that contradicts the strategy: what runs is named.
  config.parallelism.reshard_after_forward = {ReshardPolicy::Kind::kNever, 0};
  plan = ShardingPlanFor(config, Strategy::kFullShard, 4);
  ASSERT_TRUE(plan.ok());
  EXPECT_FALSE(plan->options.reshard_after_forward);
  EXPECT_EQ(plan->effective,
            "shard_grad_op (full_shard with parallelism.reshard_after_forward: false)");
  plan = ShardingPlanFor(config, Strategy::kHybridShard, 2);
  EXPECT_EQ(plan->effective,
            "hybrid_shard_zero2 (hybrid_shard with parallelism.reshard_after_forward: false)");

  config.parallelism.reshard_after_forward = {ReshardPolicy::Kind::kGroup, 2};
  config.training.mixed_precision = Precision::kBf16;
  plan = ShardingPlanFor(config, Strategy::kShardGradOp, 4);
  ASSERT_TRUE(plan.ok());
  EXPECT_TRUE(plan->options.reshard_after_forward);
  EXPECT_EQ(plan->options.reshard_group_size, 2);
  EXPECT_EQ(plan->options.mixed_precision.param_dtype, c10::kBFloat16);
  EXPECT_EQ(plan->options.mixed_precision.reduce_dtype, c10::kFloat);
  EXPECT_THAT(plan->effective, HasSubstr("resharded to groups of 2"));
  EXPECT_FALSE(ShardingPlanFor(config, Strategy::kShardGradOp, 3).ok());
  EXPECT_FALSE(ShardingPlanFor(config, Strategy::kShardGradOp, 2).ok());
}

TEST(ShardingPlanTest, KeepingUnitsAcrossMicroBatchesIsAnOption) {
  absl::StatusOr<RunConfig> config =
      ParseRunConfig("", "t.yaml", {"parallelism.reshard_between_micro_batches=false"});
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_FALSE(config->parallelism.reshard_between_micro_batches);
  EXPECT_THAT(config->ToYaml(), HasSubstr("reshard_between_micro_batches: false"));
  absl::StatusOr<ShardingPlan> plan = ShardingPlanFor(*config, Strategy::kFullShard, 4);
  ASSERT_TRUE(plan.ok());
  EXPECT_FALSE(plan->options.reshard_between_micro_batches);
  EXPECT_EQ(plan->effective, "full_shard, unsharded parameters kept through the step");
  EXPECT_TRUE(
      ShardingPlanFor(RunConfig{}, Strategy::kFullShard, 4)->options.reshard_between_micro_batches);
}

// --- ToYaml ----------------------------------------------------------------------------------

TEST(RunConfigToYamlTest, DefaultsRoundTrip) {
  RunConfig defaults;
  defaults.source_file = "t.yaml";
  std::string yaml = defaults.ToYaml();
  EXPECT_THAT(yaml, HasSubstr("\nmodel:\n  arch: gpt\n  vocab_size: 256\n"));
  EXPECT_THAT(yaml, HasSubstr("\nparallelism:\n  nproc: 0\n"));
  EXPECT_THAT(yaml, HasSubstr("\n  norm_eps: 1.0e-05\n  rope_theta: 10000.0\n  init_std: 0.02\n"));
  absl::StatusOr<RunConfig> parsed = Parse(yaml);
  ASSERT_TRUE(parsed.ok()) << parsed.status() << "\n" << yaml;
  ExpectSameConfig(*parsed, defaults);
  EXPECT_EQ(parsed->ToYaml(), yaml);
}

TEST(RunConfigToYamlTest, EveryNonDefaultValueRoundTrips) {
  absl::StatusOr<RunConfig> config = Parse(
      "run: {name: 'true', dir: 'out dir/#1: x', seed: -5}\n"
      "model: {arch: llama, vocab_size: 32000, dim: 96, n_layers: 3, n_heads: 6, seq_len: 17,"
      " ffn_hidden: 300, norm: rmsnorm, activation: swiglu, positions: rope,"
      " tie_embeddings: false, norm_eps: 1.5e-7, rope_theta: 123456.789, init_std: 0.1,"
      " deferred_init: false}\n"
      "data: {source: tokens, path: '', token_dtype: uint32, val_fraction: 0, "
      "synthetic_tokens: 4096}\n"
      "training: {steps: 3, micro_batch_size: 5, grad_accum_steps: 7, max_grad_norm: -1,"
      " mixed_precision: bf16, reduce_dtype: bf16, device: cuda, on_nonfinite: skip,"
      " eval_interval: 0, eval_batches: 9, log_interval: 11, profile: '1:2',"
      " profile_dir: prof, deterministic: true}\n"
      "optimizer: {name: sgd, lr: 0.1, weight_decay: 0.333, beta1: 0, beta2: 0.999999,"
      " eps: 1e-12, momentum: 0.5, implementation: foreach}\n"
      "lr_scheduler: {warmup_steps: 0, decay: linear, min_lr: 0}\n"
      "parallelism: {nproc: 8, data_parallel_replicate_degree: -1, data_parallel_shard_degree: 2,"
      " strategy: hybrid_shard_zero2, reshard_after_forward: 2, wrap_policy: 'params:5000',"
      " max_unsharded_units: 3, backend: gloo}\n"
      "metrics: {jsonl: false, cpu_peak_flops: 3.5e12, progress_bar: off}\n",
      {"data.path=tokens.bin"});
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->run.name, "true");
  EXPECT_EQ(config->run.dir, "out dir/#1: x");
  EXPECT_EQ(config->data.path, "tokens.bin");
  EXPECT_EQ(config->training.profile.steps, 2);
  EXPECT_TRUE(config->training.deterministic);
  EXPECT_EQ(config->optimizer.implementation, OptimizerImplementation::kForeach);
  std::string yaml = config->ToYaml();
  absl::StatusOr<RunConfig> parsed = Parse(yaml);
  ASSERT_TRUE(parsed.ok()) << parsed.status() << "\n" << yaml;
  ExpectSameConfig(*parsed, *config);
  EXPECT_EQ(parsed->ToYaml(), yaml);
  EXPECT_THAT(yaml, StartsWith("# Resolved run configuration (from t.yaml)\n"));
}

// --- configs/ ------------------------------------------------------------------------------

std::filesystem::path ConfigsDir() {
  std::filesystem::path from_source =
      std::filesystem::path(__FILE__).parent_path().parent_path() / "configs";
  if (std::filesystem::is_directory(from_source)) return from_source;
  return std::filesystem::read_symlink("/proc/self/exe").parent_path() / "../../configs";
}

TEST(RunConfigFilesTest, EveryConfigParsesAndFitsItsWorld) {
  std::filesystem::path dir = ConfigsDir();
  ASSERT_TRUE(std::filesystem::is_directory(dir)) << dir;
  std::vector<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    if (entry.path().extension() != ".yaml") continue;
    std::string name = entry.path().stem().string();
    names.push_back(name);
    SCOPED_TRACE(entry.path().string());
    absl::StatusOr<RunConfig> config = LoadRunConfig(entry.path().string(), {});
    ASSERT_TRUE(config.ok()) << config.status();
    int64_t nproc = config->parallelism.nproc;
    EXPECT_TRUE(config->ValidateForWorld(nproc > 0 ? static_cast<int>(nproc) : 2).ok())
        << config->ValidateForWorld(nproc > 0 ? static_cast<int>(nproc) : 2);
    std::ifstream file(entry.path());
    std::string text((std::istreambuf_iterator<char>(file)), {});
    EXPECT_THAT(text, HasSubstr(StrCat("build/bin/fsdp train configs/", name, ".yaml")));
    absl::StatusOr<RunConfig> round_trip = Parse(config->ToYaml());
    ASSERT_TRUE(round_trip.ok()) << round_trip.status();
    ExpectSameConfig(*round_trip, *config);
  }
  EXPECT_THAT(names, ::testing::IsSupersetOf({"default", "full_shard", "shard_grad_op",
                                              "hybrid_shard", "ddp", "gpt_125m", "llama_1b"}));
}

TEST(RunConfigFilesTest, NamedConfigsSayWhatTheyAre) {
  std::filesystem::path dir = ConfigsDir();
  absl::StatusOr<RunConfig> ddp = LoadRunConfig((dir / "ddp.yaml").string(), {});
  ASSERT_TRUE(ddp.ok()) << ddp.status();
  EXPECT_EQ(ddp->Value("parallelism.strategy"), "no_shard");
  for (int world : {1, 2, 3, 4}) EXPECT_TRUE(ddp->ValidateForWorld(world).ok()) << world;

  absl::StatusOr<RunConfig> hybrid = LoadRunConfig((dir / "hybrid_shard.yaml").string(), {});
  ASSERT_TRUE(hybrid.ok()) << hybrid.status();
  EXPECT_EQ(hybrid->parallelism.nproc, 4);
  EXPECT_EQ(hybrid->parallelism.data_parallel_replicate_degree, 2);
  EXPECT_EQ(hybrid->parallelism.data_parallel_shard_degree, 2);

  absl::StatusOr<RunConfig> gpt = LoadRunConfig((dir / "gpt_125m.yaml").string(), {});
  ASSERT_TRUE(gpt.ok()) << gpt.status();
  EXPECT_EQ(gpt->model.vocab_size, 50304);
  EXPECT_EQ(gpt->model.dim, 768);
  EXPECT_EQ(gpt->model.n_layers, 12);
  EXPECT_EQ(gpt->model.seq_len, 1024);
  EXPECT_TRUE(gpt->model.tie_embeddings);

  absl::StatusOr<RunConfig> llama = LoadRunConfig((dir / "llama_1b.yaml").string(), {});
  ASSERT_TRUE(llama.ok()) << llama.status();
  EXPECT_EQ(llama->model.arch, "llama");
  EXPECT_EQ(llama->model.ffn_hidden, 5632);
  EXPECT_EQ(llama->model.dim / llama->model.n_heads % 2, 0);
  EXPECT_FALSE(llama->model.tie_embeddings);
  EXPECT_EQ(llama->Value("training.device"), "cuda");
  EXPECT_EQ(llama->Value("training.mixed_precision"), "bf16");
}

}  // namespace
}  // namespace fsdp
