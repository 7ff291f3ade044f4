// `fsdp train` end to end: every strategy's per-step losses on 2 and 4 CPU ranks equal the
// 1-rank run's at the same global batch; the default config's loss falls; errors exit cleanly;
// the example program trains on 2 ranks.
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/env.h"
#include "common/strings.h"
#include "device_mesh/cuda_support.h"
#include "tests/multirank.h"
#include "tests/train_run.h"

namespace fsdp {
namespace {

using testing::CommandResult;
using testing::FreshTempDir;
using testing::FsdpBinary;
using testing::RunCommand;
using testing::SourceDir;

// One `fsdp train` of configs/<config> in a fresh folder (removed after): its output, each step's
// loss in order (NaN where the record's loss is null) and every metrics record.
struct TrainOutcome {
  CommandResult result;
  std::vector<double> losses;
  std::vector<nlohmann::json> records;
};

TrainOutcome Train(const std::string& config, std::vector<std::string> sets, const std::string& tag,
                   const std::vector<std::string>& flags = {}) {
  std::string dir = FreshTempDir(tag);
  testing::TrainRun run = testing::RunTrain(SourceDir() + "/configs/" + config, dir, sets, {},
                                            std::chrono::seconds(240), flags);
  std::filesystem::remove_all(dir);
  return {run.result, testing::LossSeries(run), run.records};
}

std::vector<std::string> Common(int world, int global_batch = 8) {
  return {"training.steps=6", "training.log_interval=3", "training.eval_interval=0",
          StrCat("parallelism.nproc=", world),
          StrCat("training.micro_batch_size=", global_batch / world),
          "training.grad_accum_steps=2"};
}

struct StrategyCase {
  std::string config;
  int world;
};
void PrintTo(const StrategyCase& c, std::ostream* os) { *os << c.config << "@" << c.world; }

class TrainStrategyTest : public ::testing::TestWithParam<StrategyCase> {};

TEST_P(TrainStrategyTest, LossesEqualTheOneRankRun) {
  const StrategyCase c = GetParam();
  std::vector<std::string> one = Common(1);
  one.insert(one.end(), {"parallelism.strategy=full_shard",
                         "parallelism.data_parallel_replicate_degree=1",
                         "parallelism.data_parallel_shard_degree=-1"});
  TrainOutcome reference = Train(c.config, one, "ref");
  ASSERT_TRUE(reference.result.exit.ok()) << reference.result.Output();
  std::vector<std::string> sets = Common(c.world);
  // hybrid_shard.yaml is 2 x 2; on 2 ranks the shard degree is inferred (2 x 1).
  if (c.config == "hybrid_shard.yaml") sets.push_back("parallelism.data_parallel_shard_degree=-1");
  TrainOutcome run = Train(c.config, sets, StrCat("w", c.world));
  ASSERT_TRUE(run.result.exit.ok()) << run.result.Output();
  ASSERT_EQ(run.losses.size(), 6u) << run.result.Output();
  ASSERT_EQ(reference.losses.size(), 6u);
  for (size_t i = 0; i < 6; ++i) {
    EXPECT_NEAR(run.losses[i], reference.losses[i], 2e-5 * reference.losses[i])
        << "step " << i + 1;
  }
  // Every step's record has the fields a dashboard reads.
  for (const char* key : {"step", "loss", "grad_norm", "lr", "step_time_s", "tokens_per_s", "mfu",
                          "peak_mem_bytes"}) {
    EXPECT_TRUE(run.records.at(0).contains(key)) << key;
  }
}

INSTANTIATE_TEST_SUITE_P(Configs, TrainStrategyTest,
                         ::testing::Values(StrategyCase{"full_shard.yaml", 2},
                                           StrategyCase{"full_shard.yaml", 4},
                                           StrategyCase{"shard_grad_op.yaml", 2},
                                           StrategyCase{"shard_grad_op.yaml", 4},
                                           StrategyCase{"ddp.yaml", 2},
                                           StrategyCase{"ddp.yaml", 4},
                                           StrategyCase{"hybrid_shard.yaml", 2},
                                           StrategyCase{"hybrid_shard.yaml", 4}),
                         [](const ::testing::TestParamInfo<StrategyCase>& info) {
                           std::string name = info.param.config.substr(0, info.param.config.find('.'));
                           return StrCat(name, "_w", info.param.world);
                         });

// parallelism.strategy none (the benchmarks' unwrapped baseline, engine/unwrapped.h) does the
// arithmetic of FSDP at world size 1: fp32 agrees to rounding; bf16 (bf16 copies of fp32
// masters, fp32 gradient accumulation) to bf16 rounding of a different summation order.
TEST(TrainTest, UnwrappedModelMatchesOneRankFsdp) {
  for (const char* precision : {"fp32", "bf16"}) {
    std::vector<std::string> sets = Common(1);
    sets.insert(sets.end(), {"model.arch=llama", "model.norm=rmsnorm", "model.activation=swiglu",
                             "model.positions=rope", "model.tie_embeddings=false",
                             StrCat("training.mixed_precision=", precision)});
    TrainOutcome fsdp = Train("default.yaml", sets, StrCat("fsdp-", precision));
    sets.push_back("parallelism.strategy=none");
    TrainOutcome plain = Train("default.yaml", sets, StrCat("plain-", precision));
    ASSERT_TRUE(fsdp.result.exit.ok()) << fsdp.result.Output();
    ASSERT_TRUE(plain.result.exit.ok()) << plain.result.Output();
    ASSERT_EQ(plain.losses.size(), 6u) << plain.result.Output();
    ASSERT_EQ(fsdp.losses.size(), 6u);
    const double rtol = std::string(precision) == "fp32" ? 1e-6 : 5e-4;
    for (size_t i = 0; i < 6; ++i) {
      EXPECT_NEAR(plain.losses[i], fsdp.losses[i], rtol * fsdp.losses[i])
          << precision << " step " << i + 1;
    }
    EXPECT_LT(plain.losses.back(), plain.losses.front()) << plain.result.Output();
  }
}

// training.deterministic (Note [Deterministic mode]): every op of the llama step (RoPE, RMSNorm,
// SwiGLU, SDPA, the fused AdamW) runs under ATen's deterministic algorithms without an error,
// and a repeated run gives the same losses bitwise. (A CPU run is deterministic without the
// mode too; what differs on CUDA needs the GPU tests.)
TEST(TrainTest, DeterministicModeRunsAndRepeatsBitwise) {
  std::vector<std::string> sets = Common(2);
  sets.insert(sets.end(), {"model.arch=llama", "model.norm=rmsnorm", "model.activation=swiglu",
                           "model.positions=rope", "model.tie_embeddings=false",
                           "training.deterministic=true"});
  TrainOutcome a = Train("default.yaml", sets, "det-a");
  TrainOutcome b = Train("default.yaml", sets, "det-b");
  ASSERT_TRUE(a.result.exit.ok()) << a.result.Output();
  ASSERT_TRUE(b.result.exit.ok()) << b.result.Output();
  ASSERT_EQ(a.losses.size(), 6u);
  EXPECT_EQ(a.losses, b.losses);
}

TEST(TrainTest, UnwrappedModelNeedsOneRankAndNoCheckpoints) {
  TrainOutcome two = Train("default.yaml", {"parallelism.strategy=none", "parallelism.nproc=2"}, "plain2");
  EXPECT_NE(two.result.exit.code, 0) << two.result.Output();
  EXPECT_TRUE(two.result.StderrHas("parallelism.strategy none trains the plain model on one rank, not 2"))
      << two.result.Output();
  TrainOutcome ckpt = Train("default.yaml", {"parallelism.strategy=none", "parallelism.nproc=1",
                                         "checkpoint.enabled=true"},
                        "plainckpt");
  EXPECT_EQ(ckpt.result.exit.code, 2) << ckpt.result.Output();
  EXPECT_TRUE(ckpt.result.StderrHas("checkpoint.enabled")) << ckpt.result.Output();
  EXPECT_TRUE(ckpt.result.StderrHas("must be false with parallelism.strategy none"))
      << ckpt.result.Output();
}

TEST(TrainTest, DefaultConfigLossFalls) {
  TrainOutcome run = Train("default.yaml", {"training.steps=60", "training.log_interval=20"}, "default");
  ASSERT_TRUE(run.result.exit.ok()) << run.result.Output();
  ASSERT_EQ(run.losses.size(), 60u);
  EXPECT_LT(run.losses.back(), run.losses.front() - 1.0) << run.result.Output();
  EXPECT_TRUE(run.result.StdoutHas("fsdp train: resolved configuration")) << run.result.Output();
  EXPECT_TRUE(run.result.StdoutHas("val_loss")) << run.result.Output();
}

TEST(TrainTest, QuietKeepsTheStepLinesAndMfuNeedsACpuPeak) {
  const std::vector<std::string> sets = {"training.steps=4", "training.log_interval=2",
                                         "training.eval_interval=0", "parallelism.nproc=2"};
  TrainOutcome quiet = Train("default.yaml", sets, "quiet", {"--quiet"});
  ASSERT_TRUE(quiet.result.exit.ok()) << quiet.result.Output();
  EXPECT_FALSE(quiet.result.StdoutHas("resolved configuration")) << quiet.result.Output();
  EXPECT_FALSE(quiet.result.StdoutHas("fsdp train: default on 2 rank(s)")) << quiet.result.Output();
  EXPECT_FALSE(quiet.result.StderrHas("fsdp launch: starting")) << quiet.result.Output();
  EXPECT_TRUE(quiet.result.StdoutHas("step      4/4  loss")) << quiet.result.Output();
  EXPECT_TRUE(quiet.result.StdoutHas("fsdp train: done, 4 steps")) << quiet.result.Output();
  // No metrics.cpu_peak_flops on a CPU: no MFU, in the line and in metrics.jsonl.
  EXPECT_TRUE(quiet.result.StdoutHas("mfu n/a")) << quiet.result.Output();
  ASSERT_EQ(quiet.losses.size(), 4u);
  for (const nlohmann::json& r : quiet.records) {
    if (r.contains("loss")) {
      EXPECT_TRUE(r.at("mfu").is_null()) << r.dump();
    }
  }

  // metrics.print_config: false drops only the dump; a CPU peak gives MFU figures.
  std::vector<std::string> with_peak = sets;
  with_peak.insert(with_peak.end(), {"metrics.print_config=false", "metrics.cpu_peak_flops=1e9"});
  TrainOutcome run = Train("default.yaml", with_peak, "peak");
  ASSERT_TRUE(run.result.exit.ok()) << run.result.Output();
  EXPECT_FALSE(run.result.StdoutHas("resolved configuration")) << run.result.Output();
  EXPECT_TRUE(run.result.StdoutHas("fsdp train: default on 2 rank(s)")) << run.result.Output();
  EXPECT_FALSE(run.result.StdoutHas("mfu n/a")) << run.result.Output();
  int with_mfu = 0;
  for (const nlohmann::json& r : run.records) {
    if (!r.contains("loss")) continue;
    ASSERT_TRUE(r.at("mfu").is_number()) << r.dump();
    // MFU = FLOPs/token x tokens/s/rank / peak, from the record's own throughput.
    EXPECT_GT(r.at("mfu").get<double>(), 0);
    ++with_mfu;
  }
  EXPECT_EQ(with_mfu, 4);
}

TEST(TrainTest, CudaConfigWithoutGpuSaysWhatToSet) {
  if (CudaDeviceCount() > 0) GTEST_SKIP() << "a GPU is visible: configs/llama_1b.yaml would train";
  std::string dir = FreshTempDir("nogpu");
  CommandResult r = RunCommand(
      {FsdpBinary(), "train", SourceDir() + "/configs/llama_1b.yaml", "--set", "run.dir=" + dir},
      {}, std::chrono::seconds(60));
  EXPECT_EQ(r.exit.code, 2) << r.Output();
  EXPECT_TRUE(r.StderrHas("training.device is cuda (" + SourceDir() +
                          "/configs/llama_1b.yaml) but no GPU was found"))
      << r.Output();
  EXPECT_TRUE(r.StderrHas("--set training.device=cpu --set parallelism.backend=gloo"))
      << r.Output();
  EXPECT_FALSE(r.StderrHas("world size 0")) << r.Output();
  std::filesystem::remove_all(dir);
}

TEST(TrainTest, BadConfigurationExitsWithTheKey) {
  TrainOutcome run = Train("default.yaml", {"training.stpes=5"}, "bad");
  EXPECT_EQ(run.result.exit.code, 2) << run.result.Output();
  EXPECT_TRUE(run.result.StderrHas("training.stpes")) << run.result.Output();
  EXPECT_TRUE(run.result.StderrHas("did you mean 'steps'")) << run.result.Output();
}

// Checkpointing that applies to no unit was a silent no-op (same peak memory as none).
TEST(TrainTest, CheckpointingThatAppliesToNoUnitIsRefused) {
  TrainOutcome past = Train("default.yaml",
                            {"training.steps=1", "training.activation_checkpointing=every:5"},
                            "ac-past");
  EXPECT_EQ(past.result.exit.code, 2) << past.result.Output();
  // Found after the model is wrapped, and still placed where the key was set.
  EXPECT_TRUE(past.result.StderrHas(
      "--set training.activation_checkpointing=every:5: training.activation_checkpointing: "
      "every:5 checkpoints none of the model's 4 unit(s)"))
      << past.result.Output();
  EXPECT_TRUE(past.result.StderrHas("valid here: full, selective, every:1 to every:4, or none"))
      << past.result.Output();
  TrainOutcome root_only = Train("default.yaml",
                                 {"training.steps=1", "training.activation_checkpointing=full",
                                  "parallelism.wrap_policy=params:100000000"},
                                 "ac-root");
  EXPECT_EQ(root_only.result.exit.code, 2) << root_only.result.Output();
  EXPECT_TRUE(root_only.result.StderrHas("full has no unit to checkpoint"))
      << root_only.result.Output();
}

// The attention backend is chosen on the rank's device, after loading; its error names where
// model.attention was set, as the loader's errors do.
TEST(TrainTest, AttentionBackendThatCannotRunIsRefusedWhereSet) {
  TrainOutcome run = Train("default.yaml", {"training.steps=1", "model.attention=cudnn"},
                           "attention-cudnn");
  EXPECT_EQ(run.result.exit.code, 2) << run.result.Output();
  EXPECT_TRUE(run.result.StderrHas("--set model.attention=cudnn: model.attention: cudnn cannot "
                                   "run this model's attention"))
      << run.result.Output();
  EXPECT_TRUE(run.result.StderrHas("backends that can: flash, math")) << run.result.Output();
}

TEST(TrainTest, NonFiniteLossStopsNamingTheStep) {
  TrainOutcome run = Train("default.yaml",
                       {"training.steps=20", "optimizer.lr=1e12", "lr_scheduler.warmup_steps=0",
                        "lr_scheduler.min_lr=0", "training.max_grad_norm=0",
                        "training.log_interval=1", "parallelism.nproc=1"},
                       "nan");
  EXPECT_NE(run.result.exit.code, 0) << run.result.Output();
  EXPECT_TRUE(run.result.StderrHas("the loss or the gradient norm is not finite"))
      << run.result.Output();
  EXPECT_TRUE(run.result.StderrHas(StrCat("step ", run.losses.size(), ": the loss")))
      << "names the first non-finite step\n" << run.result.Output();
  EXPECT_TRUE(std::isnan(run.losses.back()));
}

// Issue: skip mode left metrics.jsonl without the skipped steps and exited 0 after skipping
// almost every step. Now each skipped step is a record saying so, and a run that skips every
// update for 10 steps in a row stops as diverged.
TEST(TrainTest, SkippedStepsAreRecordedAndDivergenceStops) {
  std::vector<std::string> blow_up = {"optimizer.lr=1e12", "lr_scheduler.warmup_steps=0",
                                      "lr_scheduler.min_lr=0", "training.max_grad_norm=0",
                                      "training.log_interval=1", "parallelism.nproc=1",
                                      "training.on_nonfinite=skip", "training.eval_interval=0"};
  std::vector<std::string> short_run = blow_up;
  short_run.push_back("training.steps=6");
  TrainOutcome run = Train("default.yaml", short_run, "skip");
  ASSERT_EQ(run.result.exit.code, 0) << run.result.Output();
  ASSERT_EQ(run.losses.size(), 6u) << "one record per step, skipped ones included";
  int skipped = 0;
  for (const nlohmann::json& r : run.records) {
    if (!r.contains("loss")) continue;
    const bool finite = !r["loss"].is_null() && !r["grad_norm"].is_null();
    EXPECT_EQ(r.value("skipped", false), !finite) << r.dump();
    skipped += r.value("skipped", false);
  }
  EXPECT_GT(skipped, 0) << run.result.Output();
  EXPECT_TRUE(run.result.StdoutHas(StrCat("(", skipped, " update(s) skipped: non-finite)")))
      << run.result.Output();

  std::vector<std::string> long_run = blow_up;
  long_run.push_back("training.steps=16");
  TrainOutcome diverged = Train("default.yaml", long_run, "skip-diverged");
  EXPECT_NE(diverged.result.exit.code, 0) << diverged.result.Output();
  EXPECT_TRUE(diverged.result.StderrHas("updates in a row skipped")) << diverged.result.Output();
  EXPECT_LT(diverged.losses.size(), 16u);
}

// Issue: a full disk truncated metrics.jsonl and the run exited 0. /dev/full fails every write.
TEST(TrainTest, MetricsWriteErrorStopsEveryRank) {
  std::string dir = FreshTempDir("full-disk");
  std::filesystem::create_symlink("/dev/full", dir + "/metrics.jsonl");
  CommandResult r = RunCommand({FsdpBinary(), "train", SourceDir() + "/configs/default.yaml",
                                "--set", "run.dir=" + dir, "--set", "metrics.progress_bar=off",
                                "--set", "training.steps=6", "--set", "training.log_interval=2",
                                "--set", "training.eval_interval=0"},
                               {}, std::chrono::seconds(120));
  EXPECT_NE(r.exit.code, 0) << r.Output();
  EXPECT_TRUE(r.StderrHas("writing metrics file")) << r.Output();
  EXPECT_TRUE(r.StderrHas("No space left on device")) << r.Output();
  EXPECT_FALSE(r.StdoutHas("fsdp train: done")) << r.Output();
  std::filesystem::remove_all(dir);
}

// A second YAML document would be ignored; more ranks than the node can run would fork until
// memory runs out.
TEST(TrainTest, MultiDocumentYamlAndAbsurdNprocAreRefused) {
  std::string dir = FreshTempDir("multidoc");
  std::ofstream(dir + "/two.yaml") << "training:\n  steps: 5\n---\ntraining:\n  steps: 7\n";
  CommandResult two = RunCommand({FsdpBinary(), "train", dir + "/two.yaml"});
  EXPECT_EQ(two.exit.code, 2) << two.Output();
  EXPECT_TRUE(two.StderrHas("the file holds 2 YAML documents")) << two.Output();
  TrainOutcome many = Train("default.yaml", {"parallelism.nproc=100000"}, "nproc");
  EXPECT_EQ(many.result.exit.code, 2) << many.result.Output();
  EXPECT_TRUE(many.result.StderrHas("pass --oversubscribe")) << many.result.Output();
  std::filesystem::remove_all(dir);
}

// Issue: two runs in one run.dir clobbered each other. The second now refuses, naming the
// first; a lock left by a killed run is taken over; an unusable run.dir is one error, not rank
// 0's error and the other ranks timing out.
TEST(TrainTest, OneRunPerRunDir) {
  std::string dir = FreshTempDir("run-lock");
  auto train = [&](const std::string& run_dir) {
    return RunCommand({FsdpBinary(), "train", SourceDir() + "/configs/default.yaml", "--set",
                       "run.dir=" + run_dir, "--set", "metrics.progress_bar=off", "--set",
                       "training.steps=2", "--set", "training.eval_interval=0"},
                      {}, std::chrono::seconds(120));
  };
  // A live owner: this test process.
  std::ofstream(dir + "/.fsdp.lock") << "pid " << ::getpid() << " on host "
                                     << HostName()
                                     << " since now\n";
  CommandResult busy = train(dir);
  EXPECT_NE(busy.exit.code, 0) << busy.Output();
  EXPECT_TRUE(busy.StderrHas("is in use by another fsdp train (pid " + std::to_string(::getpid())))
      << busy.Output();
  EXPECT_FALSE(busy.StderrHas("timed out")) << busy.Output();
  // A dead owner (pid 0x7ffffff0 does not exist): taken over; the lock is gone after the run.
  std::ofstream(dir + "/.fsdp.lock", std::ios::trunc) << "pid 2147483632 on host "
      << HostName() << " since then\n";
  CommandResult taken = train(dir);
  EXPECT_EQ(taken.exit.code, 0) << taken.Output();
  EXPECT_FALSE(std::filesystem::exists(dir + "/.fsdp.lock"));
  // A run.dir that cannot be created: every rank stops at once with the reason.
  std::ofstream(dir + "/file") << "x";
  CommandResult bad = train(dir + "/file/sub");
  EXPECT_NE(bad.exit.code, 0) << bad.Output();
  EXPECT_TRUE(bad.StderrHas("run.dir '" + dir + "/file/sub'")) << bad.Output();
  EXPECT_TRUE(bad.StderrHas("rank 0 could not set up run.dir")) << bad.Output();
  std::filesystem::remove_all(dir);
}

// Evaluations ran only at log steps: with eval_interval 4 and log_interval 3 the one at step 4
// was skipped without a word. Each now runs at its interval (logging the steps so far with it).
TEST(TrainTest, EvaluatesAtItsIntervalBetweenLogSteps) {
  const int steps = 6, eval_interval = 4, log_interval = 3;
  TrainOutcome run = Train("default.yaml",
                           {StrCat("training.steps=", steps),
                            StrCat("training.eval_interval=", eval_interval),
                            StrCat("training.log_interval=", log_interval),
                            "training.eval_batches=1", "parallelism.nproc=1"},
                           "eval-interval");
  ASSERT_EQ(run.result.exit.code, 0) << run.result.Output();
  std::vector<int64_t> expected, evaluated, stepped;
  for (int s = 1; s <= steps; ++s) {
    if (s % eval_interval == 0 || s == steps) expected.push_back(s);
  }
  for (const nlohmann::json& r : run.records) {
    if (r.contains("val_loss")) evaluated.push_back(r["step"].get<int64_t>());
    if (r.contains("loss")) stepped.push_back(r["step"].get<int64_t>());
  }
  EXPECT_EQ(evaluated, expected) << run.result.Output();
  EXPECT_EQ(stepped, (std::vector<int64_t>{1, 2, 3, 4, 5, 6})) << "each step recorded once";
}

// A data file's problems stopped the run as "checkpoint:" errors (exit 3), and an id past the
// vocabulary outside the sample the open checks ended inside the embedding as "internal: index
// out of range in self" (exit 70). Both are now configuration errors naming the file.
TEST(TrainTest, DataFileErrorsAreConfigErrorsNamingTheFile) {
  std::string dir = FreshTempDir("data-errors");
  // 400000 uint16 ids: every id below 256 in the sampled ranges (both ends' 64K tokens, 16
  // chunks of 4K at multiples of 400000 / 17), 9999 everywhere else.
  const int64_t n = 400000;
  std::vector<uint16_t> ids(n, 9999);
  auto good = [&](int64_t begin, int64_t end) {
    for (int64_t i = std::max<int64_t>(0, begin); i < std::min(n, end); ++i) ids[i] = i % 256;
  };
  good(0, 1 << 16);
  good(n - (1 << 16), n);
  for (int64_t c = 1; c <= 16; ++c) good(n / 17 * c, n / 17 * c + (1 << 12));
  const std::string bad = dir + "/bad_ids.bin", empty = dir + "/empty.bin";
  std::ofstream(bad, std::ios::binary)
      .write(reinterpret_cast<const char*>(ids.data()), static_cast<std::streamsize>(n * 2));
  std::ofstream(empty, std::ios::binary).flush();
  for (const std::string& file : {bad, empty}) {
    TrainOutcome run = Train("default.yaml",
                             {"training.steps=2", "parallelism.nproc=1", "data.source=tokens",
                              "data.path=" + file, "training.eval_interval=0"},
                             "data-error");
    EXPECT_EQ(run.result.exit.code, 2) << run.result.Output();
    EXPECT_TRUE(run.result.StderrHas("rank 0: config: data.path '" + file + "'"))
        << run.result.Output();
  }
  TrainOutcome run = Train("default.yaml",
                           {"training.steps=2", "parallelism.nproc=1", "data.source=tokens",
                            "data.path=" + bad, "training.eval_interval=0"},
                           "data-error");
  EXPECT_TRUE(run.result.StderrHas("is >= model.vocab_size 256")) << run.result.Output();
  EXPECT_TRUE(run.result.StderrHas("token id 9999 at position ")) << run.result.Output();
  std::filesystem::remove_all(dir);
}

// Resuming at another global batch read the saved batch index in the new batch size (repeating
// windows or skipping them); the data position now carries its global batch (Note [Resuming at
// another global batch]). And a checkpoint past training.steps ran nothing and saved its state
// again as step training.steps, exit 0: now refused, naming the key.
TEST(TrainTest, ResumeKeepsTheDataPositionAcrossGlobalBatchesAndRefusesAnEarlierEnd) {
  std::string dir = FreshTempDir("resume-data");
  const std::vector<std::string> common = {"parallelism.nproc=1", "training.eval_interval=0",
                                           "checkpoint.enabled=true", "checkpoint.async=false",
                                           "training.steps=4"};
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> sets = common;
    sets.insert(sets.end(), extra.begin(), extra.end());
    return sets;
  };
  const int first_batch = 4, second_batch = 2;  // windows per global batch (1 rank x micro)
  testing::TrainRun first = testing::RunTrain(
      SourceDir() + "/configs/default.yaml", dir + "/first",
      with({StrCat("training.micro_batch_size=", first_batch), "checkpoint.interval=2"}));
  ASSERT_EQ(first.result.exit.code, 0) << first.result.Output();
  const std::string step2 = dir + "/first/checkpoints/step_000000002";
  auto data_of = [](const std::string& checkpoint) {
    std::ifstream in(checkpoint + "/metadata.json");
    return nlohmann::json::parse(in)["extra"]["data"];
  };
  nlohmann::json saved = data_of(step2);
  EXPECT_EQ(saved["batch"], 2);
  EXPECT_EQ(saved["global_batch"], first_batch);
  testing::TrainRun second = testing::RunTrain(
      SourceDir() + "/configs/default.yaml", dir + "/second",
      with({StrCat("training.micro_batch_size=", second_batch), "checkpoint.load=" + step2}));
  ASSERT_EQ(second.result.exit.code, 0) << second.result.Output();
  // 2 x 4 windows done at step 2, then 2 steps of 2: 12 windows, 6 batches of 2.
  nlohmann::json resumed = data_of(dir + "/second/checkpoints/step_000000004");
  EXPECT_EQ(resumed["epoch"], 0);
  EXPECT_EQ(resumed["batch"].get<int64_t>() * resumed["global_batch"].get<int64_t>(),
            2 * first_batch + 2 * second_batch)
      << resumed.dump();

  // On other data (here another held-out share: another number of training windows) the
  // position no longer says which windows were trained on: allowed, and said.
  testing::TrainRun other = testing::RunTrain(
      SourceDir() + "/configs/default.yaml", dir + "/other",
      with({StrCat("training.micro_batch_size=", first_batch), "checkpoint.load=" + step2,
            "data.val_fraction=0.2"}));
  ASSERT_EQ(other.result.exit.code, 0) << other.result.Output();
  const std::string said = StrCat("was taken with ", saved["train_windows"].get<int64_t>(),
                                  " training windows, now ");
  EXPECT_TRUE(other.result.StderrHas(said) || other.result.StdoutHas(said))
      << other.result.Output();
  EXPECT_FALSE(second.result.StderrHas("training windows, now")) << second.result.Output();

  // A data position field of another type threw out of json::value as an internal error.
  std::filesystem::copy(step2, dir + "/edited", std::filesystem::copy_options::recursive);
  nlohmann::json metadata = nlohmann::json::parse(std::ifstream(dir + "/edited/metadata.json"));
  metadata["extra"]["data"]["batch"] = "x";
  std::ofstream(dir + "/edited/metadata.json", std::ios::trunc) << metadata.dump();
  testing::TrainRun edited = testing::RunTrain(
      SourceDir() + "/configs/default.yaml", dir + "/edited_run",
      with({StrCat("training.micro_batch_size=", first_batch),
            "checkpoint.load=" + dir + "/edited"}));
  EXPECT_EQ(edited.result.exit.code, 3) << edited.result.Output();
  EXPECT_TRUE(edited.result.StderrHas("metadata.json extra.data.batch must be an integer, got \"x\""))
      << edited.result.Output();

  testing::TrainRun earlier = testing::RunTrain(
      SourceDir() + "/configs/default.yaml", dir + "/earlier",
      with({"training.steps=3", "checkpoint.load=" + dir + "/first/checkpoints/step_000000004"}));
  EXPECT_EQ(earlier.result.exit.code, 2) << earlier.result.Output();
  EXPECT_TRUE(earlier.result.StderrHas("training.steps: 3 is before the step of the checkpoint "
                                       "loaded"))
      << earlier.result.Output();
  EXPECT_FALSE(std::filesystem::exists(dir + "/earlier/checkpoints/step_000000003"));
  std::filesystem::remove_all(dir);
}

TEST(ExampleTest, CustomModelTrainsOnTwoRanks) {
  std::string example =
      (std::filesystem::path(FsdpBinary()).parent_path() / "train_custom_model").string();
  CommandResult r = RunCommand({FsdpBinary(), "launch", "--nproc-per-node", "2", "--", example},
                               {}, std::chrono::seconds(180));
  ASSERT_TRUE(r.exit.ok()) << r.Output();
  EXPECT_TRUE(r.StdoutHas("(learned)")) << r.Output();
}

}  // namespace
}  // namespace fsdp
