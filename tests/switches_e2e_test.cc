// The switches users expect through `fsdp train` on 2 CPU ranks (real processes, Gloo):
//   training.grad_sync: last  losses and final parameters equal grad_sync: every's within the
//                             parity tests' fp32 tolerance (DDP and FULL_SHARD), with one
//                             reduction per unit per step instead of one per micro-batch;
//   model.freeze              frozen tensors bitwise equal their values in the unfrozen
//                             checkpoint the run starts from, the others change, the loss falls,
//                             an all-frozen unit issues no reduce-scatter, and a resume
//                             reproduces the straight run;
//   step_ms                   every step record of metrics.jsonl has a positive step time (on
//                             a GPU too, from CUDA events: skipped without one).
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "checkpoint/format.h"
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

namespace fs = std::filesystem;

constexpr int kSteps = 3;
constexpr int kMicroBatches = 4;
constexpr int kLayers = 2;  // units: 2 blocks and the root

using testing::TrainRun;

// `fsdp train` of the tiny default model on 2 ranks, 4 micro-batches per step, a checkpoint at
// the end (and every `extra` asks for).
// `env`: testing::WithGpus() for the run that means the GPU (RunCommand hides it otherwise).
TrainRun Train(const std::string& dir, const std::string& strategy,
               std::vector<std::string> extra, const std::map<std::string, std::string>& env = {}) {
  const bool ddp = strategy == "no_shard";
  std::vector<std::string> sets = {
      StrCat("training.steps=", kSteps),
      "training.log_interval=2", "training.eval_interval=0", "parallelism.nproc=2",
      "training.micro_batch_size=2", StrCat("training.grad_accum_steps=", kMicroBatches),
      "parallelism.strategy=" + strategy,
      StrCat("parallelism.data_parallel_replicate_degree=", ddp ? -1 : 1),
      StrCat("parallelism.data_parallel_shard_degree=", ddp ? 1 : -1),
      StrCat("model.n_layers=", kLayers), "model.dim=64",
      // Note [Parity tolerance] (tests/parity.cc): Adam's eps bounds how much rounding noise in
      // a near-zero gradient can move a parameter.
      "optimizer.eps=1e-6", "checkpoint.enabled=true"};
  sets.insert(sets.end(), extra.begin(), extra.end());
  return testing::RunTrain(SourceDir() + "/configs/default.yaml", dir, sets, env,
                           std::chrono::seconds(120));
}

// Rank 0's count of a collective kind ("calls" or "bytes"); -1 without the statistics file.
int64_t Comm(const TrainRun& run, const std::string& kind, const std::string& what = "calls") {
  if (!run.rank0_stats.is_object()) return -1;
  return run.rank0_stats.value(nlohmann::json::json_pointer("/comm/" + kind + "/" + what), int64_t{-1});
}

// Every model tensor of the newest checkpoint under <dir>/checkpoints, whole, by name.
std::map<std::string, at::Tensor> FinalModel(const std::string& dir) {
  std::map<std::string, at::Tensor> out;
  absl::StatusOr<std::string> latest = ckpt::LatestCheckpoint(dir + "/checkpoints");
  EXPECT_TRUE(latest.ok()) << latest.status();
  if (!latest.ok()) return out;
  absl::StatusOr<ckpt::CheckpointReader> reader = ckpt::CheckpointReader::Open(*latest);
  EXPECT_TRUE(reader.ok()) << reader.status();
  if (!reader.ok()) return out;
  for (const ckpt::TensorEntry& e : reader->metadata().tensors) {
    if (e.name.rfind("model/", 0) != 0) continue;
    at::Tensor t;
    int64_t rows = e.shape.empty() ? 1 : e.shape[0];
    absl::Status read = reader->ReadRows(e.name, 0, rows, t);
    EXPECT_TRUE(read.ok()) << read;
    out[e.name.substr(6)] = t;
  }
  return out;
}

void ExpectStepTimes(const TrainRun& run) {
  ASSERT_EQ(run.step_records.size(), static_cast<size_t>(kSteps)) << run.result.Output();
  for (const nlohmann::json& r : run.step_records) {
    ASSERT_TRUE(r.contains("step_ms")) << r.dump();
    EXPECT_GT(r["step_ms"].get<double>(), 0) << r.dump();
  }
}

struct SyncCase {
  std::string strategy;
  const char* reduce_kind;  // the collective that carries the gradients
};
void PrintTo(const SyncCase& c, std::ostream* os) { *os << c.strategy; }

class GradSyncTest : public ::testing::TestWithParam<SyncCase> {};

TEST_P(GradSyncTest, LastEqualsEveryWithOneReductionPerUnitPerStep) {
  const SyncCase c = GetParam();
  const std::string every_dir = FreshTempDir("every"), last_dir = FreshTempDir("last");
  TrainRun every = Train(every_dir, c.strategy, {"training.grad_sync=every"});
  ASSERT_TRUE(every.result.exit.ok()) << every.result.Output();
  TrainRun last = Train(last_dir, c.strategy, {"training.grad_sync=last"});
  ASSERT_TRUE(last.result.exit.ok()) << last.result.Output();
  ExpectStepTimes(every);
  ExpectStepTimes(last);

  // Losses and parameters: the parity tests' fp32 tolerance (tests/parity.cc). Only the order
  // of the gradient sums differs (per micro-batch across ranks, or per rank across micro-batches).
  ASSERT_EQ(last.losses.size(), every.losses.size());
  for (const auto& [step, loss] : every.losses) {
    EXPECT_NEAR(last.losses.at(step), loss, 1e-4 + 1e-5 * std::abs(loss)) << "step " << step;
  }
  std::map<std::string, at::Tensor> a = FinalModel(every_dir), b = FinalModel(last_dir);
  ASSERT_EQ(a.size(), b.size());
  ASSERT_GT(a.size(), 5u);
  for (const auto& [name, t] : a) {
    ASSERT_TRUE(b.count(name)) << name;
    EXPECT_TRUE(at::allclose(b.at(name), t, 1e-5, 1e-5))
        << name << ": max abs diff " << (b.at(name) - t).abs().max().item<double>();
  }

  // One reduction per unit per micro-batch, against one per unit per step.
  const int64_t units = kLayers + 1;
  EXPECT_EQ(Comm(every, c.reduce_kind), kSteps * kMicroBatches * units) << every.rank0_stats.dump();
  EXPECT_EQ(Comm(last, c.reduce_kind), kSteps * units) << last.rank0_stats.dump();
  EXPECT_LT(Comm(last, c.reduce_kind, "bytes"), Comm(every, c.reduce_kind, "bytes"));
  fs::remove_all(every_dir);
  fs::remove_all(last_dir);
}

INSTANTIATE_TEST_SUITE_P(Strategies, GradSyncTest,
                         ::testing::Values(SyncCase{"no_shard", "all_reduce"},
                                           SyncCase{"full_shard", "reduce_scatter"}),
                         [](const ::testing::TestParamInfo<SyncCase>& info) {
                           return info.param.strategy;
                         });

// model.freeze: the root unit is mixed (the tied embedding frozen, the position embedding and
// the final norm training), layers.0 is all frozen, layers.1 trains.
TEST(FreezeTest, FrozenTensorsKeepTheirValuesOthersTrainAndResumeWorks) {
  const std::string init_dir = FreshTempDir("init"), dir = FreshTempDir("frozen"),
                    resume_dir = FreshTempDir("resumed");
  // Values the test knows: one step without freezing, saved (optimizer state for every
  // parameter, which a run that freezes some must load without it).
  TrainRun init = Train(init_dir, "full_shard", {"training.steps=1"});
  ASSERT_TRUE(init.result.exit.ok()) << init.result.Output();
  std::map<std::string, at::Tensor> initial = FinalModel(init_dir);

  constexpr int kFrozenSteps = 6;
  const std::vector<std::string> frozen_sets = {"model.freeze=[tok_embeddings, layers.0.*]",
                                                StrCat("training.steps=", kFrozenSteps),
                                                "optimizer.lr=1e-2", "lr_scheduler.warmup_steps=0"};
  std::vector<std::string> straight_sets = frozen_sets;
  straight_sets.insert(straight_sets.end(),
                       {"checkpoint.interval=3",
                        "checkpoint.load=" + init_dir + "/checkpoints/" + ckpt::StepDirName(1)});
  TrainRun straight = Train(dir, "full_shard", straight_sets);
  ASSERT_TRUE(straight.result.exit.ok()) << straight.result.Output();
  EXPECT_TRUE(straight.result.StdoutHas("model.freeze: ")) << straight.result.Output();
  ASSERT_EQ(straight.step_records.size(), static_cast<size_t>(kFrozenSteps - 1));
  for (const nlohmann::json& r : straight.step_records) EXPECT_GT(r["step_ms"].get<double>(), 0);
  EXPECT_LT(straight.losses.at(kFrozenSteps), straight.losses.at(2));

  std::map<std::string, at::Tensor> trained = FinalModel(dir);
  ASSERT_EQ(trained.size(), initial.size());
  int frozen = 0, changed = 0;
  for (const auto& [name, t] : initial) {
    if (name == "tok_embeddings" || name.rfind("layers.0.", 0) == 0) {
      EXPECT_TRUE(at::equal(trained.at(name), t)) << name << " is frozen but changed";
      ++frozen;
    } else {
      EXPECT_FALSE(at::equal(trained.at(name), t)) << name << " trains but did not change";
      ++changed;
    }
  }
  EXPECT_GT(frozen, 5);
  EXPECT_GT(changed, 5);
  // layers.0 has no trainable parameter: no reduce-scatter; the root (mixed) and layers.1 do.
  EXPECT_EQ(Comm(straight, "reduce_scatter"), (kFrozenSteps - 1) * kMicroBatches * 2)
      << straight.rank0_stats.dump();

  // Resume from the step-3 checkpoint in another run folder: the straight run's losses, bitwise.
  std::vector<std::string> resume_sets = frozen_sets;
  resume_sets.push_back("checkpoint.load=" + dir + "/checkpoints/" + ckpt::StepDirName(3));
  TrainRun resumed = Train(resume_dir, "full_shard", resume_sets);
  ASSERT_TRUE(resumed.result.exit.ok()) << resumed.result.Output();
  EXPECT_TRUE(resumed.result.StdoutHas("resumed from")) << resumed.result.Output();
  ASSERT_EQ(resumed.losses.size(), static_cast<size_t>(kFrozenSteps - 3))
      << resumed.result.Output();
  for (const auto& [step, loss] : resumed.losses) EXPECT_EQ(loss, straight.losses.at(step)) << step;
  std::map<std::string, at::Tensor> after_resume = FinalModel(resume_dir);
  for (const auto& [name, t] : trained) {
    EXPECT_TRUE(at::equal(after_resume.at(name), t)) << name;
  }
  fs::remove_all(init_dir);
  fs::remove_all(dir);
  fs::remove_all(resume_dir);
}

// `fsdp bench compare` measures against FSDP2 doing the same computation: it refuses both.
TEST(SwitchesBenchTest, CompareRefusesWhatTheReferenceDoesNotDo) {
  for (const char* set : {"training.grad_sync=last", "model.freeze=[tok_embeddings]"}) {
    CommandResult r = RunCommand(
        {FsdpBinary(), "bench", "compare", SourceDir() + "/configs/default.yaml", "--set", set});
    EXPECT_EQ(r.exit.code, 2) << set << "\n" << r.Output();
    EXPECT_TRUE(r.StderrHas("implements neither model.freeze nor training.grad_sync: last"))
        << r.Output();
  }
}

// Note [Step timing] on a GPU: the CUDA events' times (skips without one).
TEST(StepTimingTest, CudaEventsTimeEveryStep) {
  if (CudaDeviceCount() == 0) {
    GTEST_SKIP() << (IsCudaBuild() ? "no CUDA device visible on this machine"
                                   : "CPU-only build (FSDP_CUDA off)");
  }
  const std::string dir = FreshTempDir("cuda");
  TrainRun run = Train(dir, "full_shard",
                       {"training.device=cuda", "parallelism.nproc=1", "parallelism.backend=gloo",
                        "checkpoint.enabled=false"},
                       testing::WithGpus());
  ASSERT_TRUE(run.result.exit.ok()) << run.result.Output();
  ExpectStepTimes(run);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace fsdp
