// Checkpoints through `fsdp train`: exact resume, the resharding matrix, a rank killed in the
// middle of a save, corrupt files, inspect and export.
#include <unistd.h>

#include <signal.h>

#include <cstring>
#include <filesystem>
#include <functional>
#include <mutex>
#include <fstream>
#include <sstream>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "checkpoint/format.h"
#include "checkpoint/safetensors.h"
#include "common/strings.h"
#include "launcher/worker_group.h"
#include "tests/multirank.h"
#include "tests/status_matchers.h"
#include "tests/train_run.h"

namespace fsdp {
namespace {

using testing::CommandResult;
using testing::FreshTempDir;
using testing::FsdpBinary;
using testing::RunCommand;
using testing::SourceDir;

namespace fs = std::filesystem;

using testing::TrainRun;

constexpr int64_t kGlobalBatch = 12;  // divisible by 2, 3 and 4 ranks

// One `fsdp train` of the tiny default model for 8 steps at the given layout.
TrainRun Train(const std::string& dir, int world, const std::string& strategy,
          std::vector<std::string> extra, std::map<std::string, std::string> env = {}) {
  std::string replicate = "1", shard = "-1";
  if (strategy == "no_shard") replicate = "-1", shard = "1";
  if (strategy == "hybrid_shard") replicate = "2", shard = "-1";
  std::vector<std::string> sets = {
      "training.steps=8", "training.log_interval=1", "training.eval_interval=0",
      StrCat("parallelism.nproc=", world), StrCat("training.micro_batch_size=", kGlobalBatch / world),
      "parallelism.strategy=" + strategy, "parallelism.data_parallel_replicate_degree=" + replicate,
      "parallelism.data_parallel_shard_degree=" + shard, "model.n_layers=2"};
  sets.insert(sets.end(), extra.begin(), extra.end());
  return testing::RunTrain(SourceDir() + "/configs/default.yaml", dir, sets, env);
}

TEST(CheckpointResumeTest, ResumedLossesEqualTheUninterruptedRunBitwise) {
  std::string straight_dir = FreshTempDir("straight"), dir = FreshTempDir("resume");
  TrainRun straight = Train(straight_dir, 2, "full_shard", {});
  ASSERT_TRUE(straight.result.exit.ok()) << straight.result.Output();
  // Save every 4 steps; then start again from the step-4 checkpoint.
  TrainRun first = Train(dir, 2, "full_shard", {"checkpoint.enabled=true", "checkpoint.interval=4"});
  ASSERT_TRUE(first.result.exit.ok()) << first.result.Output();
  std::string step4 = dir + "/checkpoints/" + ckpt::StepDirName(4);
  ASSERT_TRUE(fs::exists(step4 + "/metadata.json")) << first.result.Output();
  fs::remove(dir + "/metrics.jsonl");
  TrainRun resumed = Train(dir, 2, "full_shard", {"checkpoint.load=" + step4});
  ASSERT_TRUE(resumed.result.exit.ok()) << resumed.result.Output();
  EXPECT_TRUE(resumed.result.StdoutHas("resumed from")) << resumed.result.Output();
  ASSERT_EQ(resumed.losses.size(), 4u) << resumed.result.Output();
  for (int64_t step = 5; step <= 8; ++step) {
    EXPECT_EQ(resumed.losses.at(step), straight.losses.at(step)) << "step " << step;
  }
  fs::remove_all(straight_dir);
  fs::remove_all(dir);
}

struct ReshardCase {
  int from_world;
  std::string from_strategy;
  int to_world;
  std::string to_strategy;
};
void PrintTo(const ReshardCase& c, std::ostream* os) {
  *os << c.from_strategy << c.from_world << "->" << c.to_strategy << c.to_world;
}

class ReshardTest : public ::testing::TestWithParam<ReshardCase> {};

TEST_P(ReshardTest, LoadsIntoAnotherLayoutAndTrainsOn) {
  const ReshardCase c = GetParam();
  std::string ref_dir = FreshTempDir("ref"), dir = FreshTempDir("reshard");
  TrainRun reference = Train(ref_dir, c.to_world, c.to_strategy, {});  // never resharded
  ASSERT_TRUE(reference.result.exit.ok()) << reference.result.Output();
  TrainRun first = Train(dir, c.from_world, c.from_strategy,
                    {"checkpoint.enabled=true", "checkpoint.interval=4"});
  ASSERT_TRUE(first.result.exit.ok()) << first.result.Output();
  fs::remove(dir + "/metrics.jsonl");
  std::string step4 = dir + "/checkpoints/" + ckpt::StepDirName(4);
  TrainRun resumed = Train(dir, c.to_world, c.to_strategy, {"checkpoint.load=" + step4});
  ASSERT_TRUE(resumed.result.exit.ok()) << resumed.result.Output();
  ASSERT_EQ(resumed.losses.size(), 4u) << resumed.result.Output();
  for (int64_t step = 5; step <= 8; ++step) {
    EXPECT_NEAR(resumed.losses.at(step), reference.losses.at(step), 2e-5 * reference.losses.at(step))
        << "step " << step;
  }
  fs::remove_all(ref_dir);
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(
    Matrix, ReshardTest,
    ::testing::Values(ReshardCase{4, "full_shard", 2, "full_shard"},
                      ReshardCase{4, "full_shard", 3, "full_shard"},
                      ReshardCase{3, "full_shard", 4, "full_shard"},
                      ReshardCase{4, "hybrid_shard", 4, "full_shard"},
                      ReshardCase{2, "full_shard", 2, "no_shard"},
                      ReshardCase{2, "no_shard", 2, "full_shard"}),
    [](const ::testing::TestParamInfo<ReshardCase>& info) {
      return StrCat(info.param.from_strategy, info.param.from_world, "_to_",
                    info.param.to_strategy, info.param.to_world);
    });

TEST(CheckpointFaultTest, RankKilledDuringSaveLeavesThePreviousCheckpoint) {
  std::string dir = FreshTempDir("killed");
  // Saves at step 4 and would save at 8: rank 1 dies right after writing its step-8 shard.
  TrainRun crashed = Train(dir, 2, "full_shard", {"checkpoint.enabled=true", "checkpoint.interval=4",
                                             "checkpoint.async=false"},
                      {{"FSDP_CHECKPOINT_CRASH_AFTER_WRITE", ""}});
  ASSERT_TRUE(crashed.result.exit.ok()) << crashed.result.Output();
  fs::remove_all(dir + "/checkpoints/" + ckpt::StepDirName(8));
  fs::remove(dir + "/metrics.jsonl");
  TrainRun dying = Train(dir, 2, "full_shard",
                    {"checkpoint.enabled=true", "checkpoint.async=false",
                     "checkpoint.load=latest"},
                    {{"FSDP_CHECKPOINT_CRASH_AFTER_WRITE", "1"}});
  EXPECT_FALSE(dying.result.exit.ok()) << dying.result.Output();
  EXPECT_FALSE(fs::exists(dir + "/checkpoints/" + ckpt::StepDirName(8) + "/metadata.json"));
  absl::StatusOr<std::string> latest = ckpt::LatestCheckpoint(dir + "/checkpoints");
  ASSERT_TRUE(latest.ok()) << latest.status();
  EXPECT_EQ(fs::path(*latest).filename(), ckpt::StepDirName(4));
  fs::remove(dir + "/metrics.jsonl");
  TrainRun again = Train(dir, 2, "full_shard", {"checkpoint.load=latest"});
  ASSERT_TRUE(again.result.exit.ok()) << again.result.Output();
  EXPECT_EQ(again.losses.size(), 4u);
  fs::remove_all(dir);
}

TEST(CheckpointFaultTest, CorruptShardIsNamedWhenLoading) {
  std::string dir = FreshTempDir("corrupt");
  TrainRun saved = Train(dir, 2, "full_shard", {"checkpoint.enabled=true"});
  ASSERT_TRUE(saved.result.exit.ok()) << saved.result.Output();
  std::string step8 = dir + "/checkpoints/" + ckpt::StepDirName(8);
  {
    std::fstream f(step8 + "/" + ckpt::RankFileName(1), std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(100);
    char byte = 0;
    f.read(&byte, 1);
    f.seekp(100);
    byte ^= 0x5a;
    f.write(&byte, 1);
  }
  TrainRun load = Train(dir, 2, "full_shard", {"checkpoint.load=" + step8});
  EXPECT_FALSE(load.result.exit.ok());
  EXPECT_TRUE(load.result.StderrHas(ckpt::RankFileName(1))) << load.result.Output();
  CommandResult inspect = RunCommand({FsdpBinary(), "checkpoint", "inspect", step8, "--verify"});
  EXPECT_EQ(inspect.exit.code, 1) << inspect.Output();
  EXPECT_TRUE(inspect.StdoutHas("complete: no")) << inspect.Output();
  fs::remove_all(dir);
}

// Starts a long `fsdp train`, sends SIGTERM to it (as a scheduler would) once three steps were
// logged, and returns its output and how it ended.
struct Terminated {
  std::string output;
  WorkerExit exit;
  double seconds_after_signal = 0;
};
Terminated TrainUntilSigterm(const std::string& dir, std::vector<std::string> sets) {
  std::vector<std::string> argv = {
      FsdpBinary(), "train", SourceDir() + "/configs/default.yaml", "--set", "run.dir=" + dir,
      "--set", "metrics.progress_bar=off", "--set", "training.steps=100000", "--set",
      "training.log_interval=1", "--set", "training.eval_interval=0", "--set",
      "parallelism.nproc=2", "--set", "model.n_layers=2"};
  for (const std::string& s : sets) argv.insert(argv.end(), {"--set", s});
  std::vector<std::string> lines;
  std::mutex mu;
  WorkerGroup group([&](const OutputLine& l) {
    std::lock_guard<std::mutex> lock(mu);
    lines.emplace_back(l.text);
  });
  WorkerSpec spec;
  spec.argv = argv;
  Terminated t;
  if (!group.Start({spec}).ok()) return t;
  WaitOptions wait;
  wait.grace = std::chrono::seconds(30);
  wait.deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  std::optional<std::chrono::steady_clock::time_point> sent;
  wait.stop_requested = [&] {
    std::lock_guard<std::mutex> lock(mu);
    int steps = 0;
    for (const auto& l : lines) steps += l.find("]: step ") != std::string::npos;
    if (steps >= 3 && !sent) {
      group.SignalAll(SIGTERM);
      sent = std::chrono::steady_clock::now();
    }
    return false;
  };
  GroupResult result = group.Wait(wait);
  for (const auto& l : lines) t.output += l + "\n";
  t.exit = result.exits.at(0);
  if (sent) {
    t.seconds_after_signal =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - *sent).count();
  }
  return t;
}

TEST(CheckpointFaultTest, SigtermSavesBeforeExiting) {
  std::string dir = FreshTempDir("sigterm");
  Terminated t = TrainUntilSigterm(dir, {"checkpoint.enabled=true"});
  EXPECT_TRUE(t.output.find("SIGTERM: saved step") != std::string::npos) << t.output;
  absl::StatusOr<std::string> latest = ckpt::LatestCheckpoint(dir + "/checkpoints");
  ASSERT_TRUE(latest.ok()) << latest.status() << "\n" << t.output;
  absl::StatusOr<ckpt::CheckpointReader> reader = ckpt::CheckpointReader::Open(*latest);
  ASSERT_TRUE(reader.ok()) << reader.status();
  EXPECT_GE(reader->metadata().step, 3);
  fs::remove_all(dir);
}

TEST(CheckpointFaultTest, SigtermWithoutCheckpointingStopsPromptly) {
  std::string dir = FreshTempDir("sigterm-nockpt");
  Terminated t = TrainUntilSigterm(dir, {});
  EXPECT_TRUE(t.output.find("stopped by SIGTERM after step") != std::string::npos) << t.output;
  // The ranks stop by themselves at the next log interval, long before the launcher's grace
  // period (120 s) would kill them.
  EXPECT_LT(t.seconds_after_signal, 60.0) << t.output;
  EXPECT_FALSE(t.exit.ok());
  fs::remove_all(dir);
}

// Issue: SIGTERM that reached one rank only (one node of a job preempted) saved and stopped
// the run, but every rank exited 0, so a scheduler could not tell it from a finished run.
TEST(CheckpointFaultTest, SigtermToOneRankStopsEveryRankAsPreempted) {
  std::string dir = FreshTempDir("sigterm-one");
  TrainRun run = Train(dir, 2, "full_shard",
                       {"checkpoint.enabled=true", "checkpoint.interval=100", "training.steps=20"},
                       {{"FSDP_TEST_SIGTERM", "1@3"}});
  EXPECT_EQ(run.result.exit.code, 143) << run.result.Output();
  // Both ranks stop at the same barrier; either may report first.
  const std::string line =
      "preempted: stopped by SIGTERM after step 3 of 20; step 3 is saved (resume with "
      "checkpoint.load: latest)";
  EXPECT_TRUE(run.result.StderrHas("fsdp launch: rank 1 stopped first: rank 1: " + line +
                                   "; rank 0 stopped too") ||
              run.result.StderrHas("fsdp launch: rank 0 stopped first: rank 0: " + line +
                                   "; rank 1 stopped too"))
      << run.result.Output();
  EXPECT_FALSE(run.result.StderrHas("restarting")) << run.result.Output();
  EXPECT_THAT(ckpt::LatestCheckpoint(dir + "/checkpoints"),
              ::fsdp::testing::IsOkAndHolds(dir + "/checkpoints/" + ckpt::StepDirName(3)));
  EXPECT_EQ(run.losses.size(), 3u) << run.result.Output();
  // SIGTERM during the last step: the run finished, and ends as one that did (exit 0).
  const std::string last_dir = dir + "/last";
  TrainRun last = Train(last_dir, 2, "full_shard",
                        {"checkpoint.enabled=true", "checkpoint.interval=100", "training.steps=3"},
                        {{"FSDP_TEST_SIGTERM", "1@3"}});
  EXPECT_TRUE(last.result.exit.ok()) << last.result.Output();
  EXPECT_THAT(ckpt::LatestCheckpoint(last_dir + "/checkpoints"),
              ::fsdp::testing::IsOkAndHolds(last_dir + "/checkpoints/" + ckpt::StepDirName(3)));
  fs::remove_all(dir);
}

// Issue: SIGTERM was acted on only at log steps; with a log interval of 100 steps of a few
// seconds each, the scheduler's grace period ran out first and killed the ranks unsaved. Now
// every rank stops after the step that follows the signal's (one rank: at the signal's step),
// whatever the log interval, and logs the steps since the last log before saving.
TEST(CheckpointFaultTest, SigtermBetweenLogStepsStopsWithinAStep) {
  std::string dir = FreshTempDir("sigterm-unlogged");
  const std::vector<std::string> sets = {"checkpoint.enabled=true", "checkpoint.interval=100",
                                         "training.steps=20", "training.log_interval=100"};
  for (int world : {2, 1}) {
    const std::string run_dir = StrCat(dir, "/world", world);
    TrainRun run = Train(run_dir, world, "full_shard", sets, {{"FSDP_TEST_SIGTERM", "0@3"}});
    EXPECT_EQ(run.result.exit.code, 143) << run.result.Output();
    const int64_t stop = world == 1 ? 3 : 4;
    EXPECT_TRUE(run.result.StderrHas(StrCat("stopped by SIGTERM after step ", stop,
                                            " of 20; step ", stop, " is saved")))
        << run.result.Output();
    EXPECT_THAT(ckpt::LatestCheckpoint(run_dir + "/checkpoints"),
                ::fsdp::testing::IsOkAndHolds(run_dir + "/checkpoints/" + ckpt::StepDirName(stop)));
    EXPECT_EQ(run.losses.size(), static_cast<size_t>(stop)) << run.result.Output();
  }
  fs::remove_all(dir);
}

// Issue: SIGTERM landing on a checkpoint-interval step saved that step twice and committed a
// folder without rank00001.bin. With log_interval 1 the SIGTERM save is seen at every step, so
// it always coincides with interval 1, and with interval 2 on even steps.
struct PreemptCase {
  int interval;
  bool async;
};
class PreemptionTest : public ::testing::TestWithParam<PreemptCase> {};

TEST_P(PreemptionTest, SaveOnAnIntervalStepLeavesOneCompleteCheckpoint) {
  const PreemptCase c = GetParam();
  std::string dir = FreshTempDir(StrCat("preempt-", c.interval, c.async ? "-async" : "-sync"));
  Terminated t = TrainUntilSigterm(
      dir, {"checkpoint.enabled=true", StrCat("checkpoint.interval=", c.interval),
            "checkpoint.keep_latest_k=1", StrCat("checkpoint.async=", c.async ? "true" : "false")});
  ASSERT_TRUE(t.output.find("SIGTERM: saved step") != std::string::npos) << t.output;
  std::map<std::string, int> commits;  // "step N" -> times committed
  std::istringstream lines(t.output);
  for (std::string line; std::getline(lines, line);) {
    size_t at = line.find("checkpoint: step ");
    if (at != std::string::npos && line.find(" committed to ") != std::string::npos) {
      ++commits[line.substr(at + 11, line.find(" committed") - at - 11)];
    }
  }
  EXPECT_FALSE(commits.empty()) << t.output;
  for (const auto& [step, n] : commits) EXPECT_EQ(n, 1) << step << " committed twice\n" << t.output;
  absl::StatusOr<std::string> latest = ckpt::LatestCheckpoint(dir + "/checkpoints");
  ASSERT_TRUE(latest.ok()) << latest.status() << "\n" << t.output;
  absl::StatusOr<ckpt::CheckpointReader> reader = ckpt::CheckpointReader::Open(*latest);
  ASSERT_TRUE(reader.ok()) << reader.status() << "\n" << t.output;
  EXPECT_TRUE(reader->VerifyFiles().ok());
  EXPECT_EQ(reader->metadata().files.size(), 2u) << "both ranks' shards";
  // And it resumes.
  TrainRun resumed = Train(dir, 2, "full_shard", {"checkpoint.enabled=true", "checkpoint.load=latest",
                                                  StrCat("training.steps=", reader->metadata().step + 1)});
  EXPECT_TRUE(resumed.result.exit.ok()) << resumed.result.Output();
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Coincidences, PreemptionTest,
                         ::testing::Values(PreemptCase{1, true}, PreemptCase{1, false},
                                           PreemptCase{2, true}),
                         [](const ::testing::TestParamInfo<PreemptCase>& info) {
                           return StrCat("interval", info.param.interval,
                                         info.param.async ? "_async" : "_sync");
                         });

// Issue: with a huge learning rate the state turns NaN at step 2 but was acted on only at the
// log interval, so checkpoints of NaN state committed and pruned the good ones.
TEST(CheckpointFaultTest, NonFiniteStateIsNeverCheckpointed) {
  std::string dir = FreshTempDir("nan-gate");
  TrainRun run = Train(dir, 2, "full_shard",
                       {"optimizer.lr=1e12", "lr_scheduler.warmup_steps=0", "lr_scheduler.min_lr=0",
                        "training.log_interval=8", "checkpoint.enabled=true",
                        "checkpoint.interval=1", "checkpoint.keep_latest_k=1"});
  EXPECT_FALSE(run.result.exit.ok()) << run.result.Output();
  EXPECT_TRUE(run.result.StderrHas("was not saved") || run.result.StdoutHas("was not saved"))
      << run.result.Output();
  absl::StatusOr<std::string> latest = ckpt::LatestCheckpoint(dir + "/checkpoints");
  if (latest.ok()) {
    // Whatever committed is finite, and inspect --verify says so.
    CommandResult inspect = RunCommand({FsdpBinary(), "checkpoint", "inspect", *latest, "--verify"});
    EXPECT_EQ(inspect.exit.code, 0) << inspect.Output();
    EXPECT_TRUE(inspect.StdoutHas("every tensor finite")) << inspect.Output();
  }
  fs::remove_all(dir);
}

// Note [Strict loads] (engine/checkpointing.cc): each of these loaded (or crashed after
// "resumed from") before; now each is refused with the file, the tensor and both values.
TEST(CheckpointFaultTest, LoadsAreExactOrRefuse) {
  std::string dir = FreshTempDir("strict");
  // A 4-layer model saved at step 8 (AdamW: exp_avg, exp_avg_sq and a step counter per tensor).
  TrainRun saved = Train(dir, 2, "full_shard", {"checkpoint.enabled=true", "model.n_layers=4"});
  ASSERT_TRUE(saved.result.exit.ok()) << saved.result.Output();
  const std::string step8 = dir + "/checkpoints/" + ckpt::StepDirName(8);
  const std::string meta_path = step8 + "/metadata.json";
  const nlohmann::json original = nlohmann::json::parse(std::ifstream(meta_path));
  // Resumes from a copy of the checkpoint whose metadata `edit` changed; returns the output.
  auto resume = [&](const std::function<void(nlohmann::json&)>& edit,
                    std::vector<std::string> sets) {
    nlohmann::json m = original;
    edit(m);
    std::ofstream(meta_path) << m.dump();
    sets.insert(sets.begin(), {"checkpoint.load=" + step8, "training.steps=9", "model.n_layers=4"});
    fs::remove(dir + "/metrics.jsonl");
    TrainRun run = Train(dir + "/resume", 2, "full_shard", sets);
    std::ofstream(meta_path) << original.dump();
    return run;
  };
  auto drop = [](const std::string& suffix) {
    return [suffix](nlohmann::json& m) {
      auto& tensors = m["tensors"];
      for (auto it = tensors.begin(); it != tensors.end(); ++it) {
        if ((*it)["name"].get<std::string>().ends_with(suffix)) {
          tensors.erase(it);
          return;
        }
      }
    };
  };
  auto expect_refused = [](const TrainRun& run, const std::string& what) {
    EXPECT_FALSE(run.result.exit.ok()) << what << "\n" << run.result.Output();
    EXPECT_TRUE(run.result.StderrHas(what) || run.result.StdoutHas(what))
        << "expected '" << what << "'\n" << run.result.Output();
    EXPECT_FALSE(run.result.StdoutHas("step     9/9")) << run.result.Output();
  };
  expect_refused(resume(drop("/exp_avg_sq"), {}), "which the saved optimizer's state lists");
  expect_refused(resume(drop("/step"), {}), "bias correction");
  expect_refused(resume([](nlohmann::json& m) { m["tensors"][0]["dtype"] = "I32"; }, {}),
                 "is stored as I32, the model expects F32");
  // Into a 2-layer model: two layers' tensors are left over, unless strict is off.
  expect_refused(resume([](nlohmann::json&) {}, {"model.n_layers=2"}),
                 "tensor(s) the model does not have");
  TrainRun relaxed = resume([](nlohmann::json&) {}, {"model.n_layers=2", "checkpoint.strict=false"});
  EXPECT_TRUE(relaxed.result.exit.ok()) << relaxed.result.Output();
  // AdamW state into SGD: refused, unless the optimizer starts afresh.
  // Another head layout with the same tensor shapes (Note [Attention heads in a checkpoint]).
  expect_refused(resume([](nlohmann::json&) {}, {"model.n_heads=8"}),
                 "saved with model.n_heads: 4 and 4 key/value heads");
  expect_refused(resume([](nlohmann::json&) {}, {"optimizer.name=sgd"}),
                 "saved with optimizer 'adamw'");
  TrainRun fresh_optimizer =
      resume([](nlohmann::json&) {}, {"optimizer.name=sgd", "checkpoint.load_optimizer=false"});
  EXPECT_TRUE(fresh_optimizer.result.exit.ok()) << fresh_optimizer.result.Output();
  // The untouched checkpoint still resumes.
  TrainRun ok = resume([](nlohmann::json&) {}, {});
  EXPECT_TRUE(ok.result.exit.ok()) << ok.result.Output();
  // load: latest with nothing there says so.
  TrainRun nothing = Train(dir + "/empty", 2, "full_shard",
                           {"checkpoint.enabled=true", "checkpoint.load=latest", "training.steps=1"});
  EXPECT_TRUE(nothing.result.StdoutHas("no committed checkpoint in")) << nothing.result.Output();
  fs::remove_all(dir);
}

// Issue: a resumed run appended its records after the interrupted run's, so steps between
// the checkpoint and the interruption appeared twice.
TEST(CheckpointResumeTest, MetricsRecordEveryStepOnceAcrossResume) {
  std::string dir = FreshTempDir("metrics-resume");
  TrainRun first = Train(dir, 2, "full_shard", {"checkpoint.enabled=true", "checkpoint.interval=4"});
  ASSERT_TRUE(first.result.exit.ok()) << first.result.Output();
  fs::remove_all(dir + "/checkpoints/" + ckpt::StepDirName(8));  // as if killed after step 8
  TrainRun resumed = Train(dir, 2, "full_shard", {"checkpoint.enabled=true", "checkpoint.load=latest"});
  ASSERT_TRUE(resumed.result.exit.ok()) << resumed.result.Output();
  std::map<int64_t, int> seen;
  std::ifstream in(dir + "/metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    nlohmann::json r = nlohmann::json::parse(line);
    if (r.contains("loss")) ++seen[r["step"].get<int64_t>()];
  }
  ASSERT_EQ(seen.size(), 8u);
  for (const auto& [step, n] : seen) EXPECT_EQ(n, 1) << "step " << step;
  fs::remove_all(dir);
}

// Issue: resuming an older checkpoint in a folder that held later ones (an earlier run went
// further) deleted this run's own save as soon as it was committed: keep_latest_k kept the
// highest step, the earlier run's, which load: latest then resumed (Note [A run that goes
// back]).
TEST(CheckpointResumeTest, GoingBackSetsLaterCheckpointsAsideAndKeepsItsOwn) {
  std::string dir = FreshTempDir("go-back");
  const std::string root = dir + "/checkpoints";
  TrainRun first = Train(dir, 2, "full_shard", {"checkpoint.enabled=true", "checkpoint.interval=4"});
  ASSERT_TRUE(first.result.exit.ok()) << first.result.Output();
  TrainRun back = Train(dir, 2, "full_shard",
                        {"checkpoint.enabled=true", "checkpoint.interval=4",
                         "checkpoint.keep_latest_k=1", "training.steps=6",
                         "checkpoint.load=" + root + "/" + ckpt::StepDirName(4)});
  ASSERT_TRUE(back.result.exit.ok()) << back.result.Output();
  EXPECT_TRUE(back.result.StdoutHas("moved to " + root + "/superseded")) << back.result.Output();
  EXPECT_THAT(ckpt::LatestCheckpoint(root),
              ::fsdp::testing::IsOkAndHolds(root + "/" + ckpt::StepDirName(6)));
  EXPECT_FALSE(fs::exists(root + "/" + ckpt::StepDirName(4)));  // pruned: keep_latest_k 1
  EXPECT_TRUE(fs::exists(root + "/superseded/" + ckpt::StepDirName(8) + "/metadata.json"));
  // load: latest goes on from this run's step 6, not the earlier run's step 8.
  TrainRun latest = Train(dir, 2, "full_shard", {"checkpoint.enabled=true", "checkpoint.load=latest"});
  ASSERT_TRUE(latest.result.exit.ok()) << latest.result.Output();
  EXPECT_TRUE(latest.result.StdoutHas("at step 6")) << latest.result.Output();
  EXPECT_EQ(latest.losses.size(), 8u) << latest.result.Output();  // 1-6 kept, then 7 and 8
  // Once more: the newest checkpoint is at training.steps. The run is complete: it says so and
  // neither trains (it printed "final loss nan") nor saves step 8 again.
  const fs::path step8 = fs::path(root) / ckpt::StepDirName(8) / "metadata.json";
  const auto saved_at = fs::last_write_time(step8);
  TrainRun again = Train(dir, 2, "full_shard", {"checkpoint.enabled=true", "checkpoint.load=latest"});
  ASSERT_TRUE(again.result.exit.ok()) << again.result.Output();
  EXPECT_TRUE(again.result.StdoutHas("nothing left to train")) << again.result.Output();
  EXPECT_FALSE(again.result.StdoutHas("nan")) << again.result.Output();
  EXPECT_FALSE(again.result.StdoutHas("committed")) << again.result.Output();
  EXPECT_EQ(fs::last_write_time(step8), saved_at);
  EXPECT_EQ(again.losses.size(), 8u) << again.result.Output();
  fs::remove_all(dir);
}

// Issue: a background save that failed was reported by the next save, an interval of training
// later; now by the step after it fails, with the checkpoint exit code.
TEST(CheckpointFaultTest, FailedBackgroundSaveStopsTheRunPromptly) {
  std::string dir = FreshTempDir("async-fail");
  // Rank 1's shard file cannot be created: a folder has its name.
  fs::create_directories(dir + "/checkpoints/" + ckpt::StepDirName(10) + ".tmp/rank00001.bin");
  TrainRun run = Train(dir, 2, "full_shard",
                       {"checkpoint.enabled=true", "checkpoint.async=true",
                        "checkpoint.interval=10", "training.steps=60"});
  EXPECT_EQ(run.result.exit.code, 3) << run.result.Output();
  EXPECT_TRUE(run.result.StderrHas("rank00001.bin")) << run.result.Output();
  // Stopped after step 10 (the failed save), before the next save (step 20) would have noticed.
  EXPECT_GE(run.losses.size(), 10u) << run.result.Output();
  EXPECT_LT(run.losses.size(), 20u) << run.result.Output();
  fs::remove_all(dir);
}

TEST(CheckpointToolsTest, InspectAndExport) {
  std::string dir = FreshTempDir("tools");
  TrainRun saved = Train(dir, 2, "full_shard", {"checkpoint.enabled=true"});
  ASSERT_TRUE(saved.result.exit.ok()) << saved.result.Output();
  std::string root = dir + "/checkpoints";
  CommandResult inspect = RunCommand({FsdpBinary(), "checkpoint", "inspect", root, "--verify"});
  ASSERT_TRUE(inspect.exit.ok()) << inspect.Output();
  EXPECT_TRUE(inspect.StdoutHas("step        8")) << inspect.Output();
  EXPECT_TRUE(inspect.StdoutHas("mesh (replicate=1, shard=2)")) << inspect.Output();
  EXPECT_TRUE(inspect.StdoutHas("model/tok_embeddings")) << inspect.Output();
  EXPECT_TRUE(inspect.StdoutHas("complete: yes")) << inspect.Output();
  std::string out = dir + "/model.safetensors";
  CommandResult exported = RunCommand({FsdpBinary(), "checkpoint", "export", root, "--out", out});
  ASSERT_TRUE(exported.exit.ok()) << exported.Output();
  absl::StatusOr<ckpt::SafetensorsFile> file = ckpt::SafetensorsFile::Open(out);
  ASSERT_TRUE(file.ok()) << file.status();
  absl::StatusOr<ckpt::CheckpointReader> reader = ckpt::CheckpointReader::Open(*ckpt::LatestCheckpoint(root));
  ASSERT_TRUE(reader.ok());
  int tensors = 0;
  for (const auto& [name, entry] : file->entries()) {
    at::Tensor a, b;
    int64_t rows = entry.shape.empty() ? 1 : entry.shape[0];
    ASSERT_TRUE(file->ReadRows(name, 0, rows, a).ok());
    ASSERT_TRUE(reader->ReadRows("model/" + name, 0, rows, b).ok());
    EXPECT_TRUE(a.equal(b)) << name;
    ++tensors;
  }
  EXPECT_GT(tensors, 10);
  // Training can start from the exported file.
  TrainRun from = Train(FreshTempDir("from"), 2, "full_shard", {"model.init_from=" + out, "training.steps=9"});
  ASSERT_TRUE(from.result.exit.ok()) << from.result.Output();
  EXPECT_TRUE(from.result.StdoutHas("parameters from")) << from.result.Output();

  // The same bytes with one float tensor relabelled I32 (same size): refused, naming it, not
  // loaded as integers (red-team pass).
  std::string bytes;
  {
    std::ifstream in(out, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  uint64_t header_len = 0;
  std::memcpy(&header_len, bytes.data(), 8);
  nlohmann::json header = nlohmann::json::parse(bytes.substr(8, header_len));
  std::string relabel;  // the first F32 tensor
  for (const auto& [name, entry] : header.items()) {
    if (name != "__metadata__" && entry.value("dtype", "") == "F32") {
      relabel = name;
      break;
    }
  }
  ASSERT_FALSE(relabel.empty()) << header.dump();
  header[relabel]["dtype"] = "I32";
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  const uint64_t new_len = text.size();
  std::string relabelled(reinterpret_cast<const char*>(&new_len), 8);
  relabelled += text + bytes.substr(8 + header_len);
  const std::string bad = dir + "/relabelled.safetensors";
  std::ofstream(bad, std::ios::binary) << relabelled;
  TrainRun refused = Train(FreshTempDir("relabelled"), 2, "full_shard",
                           {"model.init_from=" + bad, "training.steps=9"});
  EXPECT_FALSE(refused.result.exit.ok()) << refused.result.Output();
  EXPECT_TRUE(refused.result.StderrHas(StrCat("tensor '", relabel, "' is stored as I32")))
      << refused.result.Output();
  fs::remove_all(dir);
}

}  // namespace
}  // namespace fsdp
