// The fsdp command line's own errors, through the binary: every mistake in the words typed is
// one line naming the flag or word and what is valid, and exit code 2 (Note [Exit codes]);
// --help still exits 0. And `fsdp plan`'s memory beside `fsdp train`'s.
#include <algorithm>
#include <filesystem>
#include <fstream>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "common/strings.h"
#include "tests/multirank.h"

namespace fsdp {
namespace {

using testing::CommandResult;
using testing::FsdpBinary;
using testing::RunCommand;
using testing::SourceDir;

struct CliCase {
  std::vector<std::string> args;
  std::string message;  // the whole stderr line
};

// CLI11's defaults said "Value 0 not in range 0.000000 to 1797693134862315708145..." (exit 105),
// "Could not convert" (104), "A subcommand is required" for a misspelt one (106) and so on.
TEST(CommandLineErrors, OneLineAndExitCodeTwo) {
  const std::string config = SourceDir() + "/configs/default.yaml";
  for (const CliCase& c : std::vector<CliCase>{
           {{"bogus"},
            "fsdp: unknown subcommand 'bogus' (valid: launch, doctor, train, checkpoint, plan, "
            "bench)"},
           {{},
            "fsdp: a subcommand is required (valid: launch, doctor, train, checkpoint, plan, "
            "bench)"},
           {{"checkpoint", "bogus"},
            "fsdp checkpoint: unknown subcommand 'bogus' (valid: inspect, export)"},
           {{"checkpoint"}, "fsdp checkpoint: a subcommand is required (valid: inspect, export)"},
           {{"bench", "bogus"},
            "fsdp bench: unknown subcommand 'bogus' (valid: compare, kernels, host, sweep)"},
           {{"plan", config, "--top", "-1"}, "fsdp plan: --top: must be >= 0, got -1"},
           {{"plan", config, "--world-size", "abc"},
            "fsdp plan: --world-size: 'abc' is not an integer (must be >= 1)"},
           {{"plan", config, "--world-size", "99999999999"},
            "fsdp plan: --world-size: '99999999999' is out of range (must be in 1..2147483647)"},
           {{"doctor", "extra_positional"},
            "fsdp doctor: the following argument was not expected: extra_positional"},
           {{"bench", "compare", config, "--steps", "0"},
            "fsdp bench compare: --steps: must be >= 1, got 0"},
           {{"bench", "compare", config, "--repeats", "0"},
            "fsdp bench compare: --repeats: must be >= 1, got 0"},
           {{"bench", "compare", config, "--nproc", "-1"},
            "fsdp bench compare: --nproc: must be >= 0, got -1"},
           {{"bench", "kernels", config, "--repeats", "0"},
            "fsdp bench kernels: --repeats: must be >= 1, got 0"},
           {{"bench", "kernels", config, "--warmup", "-1"},
            "fsdp bench kernels: --warmup: must be >= 0, got -1"},
           {{"bench", "kernels", config, "--tokens", "-5"},
            "fsdp bench kernels: --tokens: must be >= 1, got -5"},
           {{"bench", "host", "--elements", "1.5"},
            "fsdp bench host: --elements: '1.5' is not a whole number of elements in 1..1e15"},
           {{"bench", "host", "--busy", "0,300"},
            "fsdp bench host: --busy: must be in 0..256, got 300"},
           {{"bench", "host", "--repeats", "0"}, "fsdp bench host: --repeats: must be >= 1, got 0"},
           {{"bench", "sweep", "--steps", "0"}, "fsdp bench sweep: --steps: must be >= 1, got 0"},
           {{"bench", "sweep", "--world-sizes", "1,x"},
            "fsdp bench sweep: --world-sizes: 'x' is not an integer (must be >= 1)"},
       }) {
    std::vector<std::string> argv = {FsdpBinary()};
    argv.insert(argv.end(), c.args.begin(), c.args.end());
    CommandResult r = RunCommand(argv, {}, std::chrono::seconds(30));
    EXPECT_EQ(r.exit.code, 2) << StrJoin(c.args, " ") << "\n" << r.Output();
    EXPECT_THAT(r.stderr_lines, ::testing::ElementsAre(c.message)) << r.Output();
    EXPECT_TRUE(r.stdout_lines.empty()) << r.Output();
  }
}

TEST(CommandLineErrors, HelpStillExitsZero) {
  for (std::vector<std::string> args :
       std::vector<std::vector<std::string>>{{"--help"},
                                             {"bench", "--help"},
                                             {"checkpoint", "--help"},
                                             {"plan", "--help"},
                                             {"bench", "kernels", "--help"},
                                             {"bench", "host", "--help"}}) {
    args.insert(args.begin(), FsdpBinary());
    CommandResult r = RunCommand(args);
    EXPECT_EQ(r.exit.code, 0) << r.Output();
    EXPECT_TRUE(r.StdoutHas("Usage:")) << r.Output();
    EXPECT_FALSE(r.StdoutHas("179769313")) << r.Output();  // DBL_MAX, CLI11's range text
  }
}

// `fsdp plan`'s peak memory per rank beside `fsdp train`'s measured peak on this CPU (the
// target: within 15%), with activation checkpointing (full, selective), offload (optimizer,
// params, the delayed update, params kept with grad_sync last), bf16 and DDP, on one rank and
// two. On a CPU the host state (offload) lives in the memory the peak counts, so it is added. At
// one rank in fp32 the accounting is exact up to the allocator's slack (Note [One shard]:
// parameters alias their shards, gradients become theirs, nothing is gathered or reduced), which
// the planner once counted as copies (+14% here): within 5%.
TEST(PlanTest, PredictedPeakIsNearTheMeasuredOne) {
  struct Case {
    int ranks;
    std::vector<std::string> sets;
    double tolerance;
    std::map<std::string, std::string> env = {};  // for both commands
  };
  const std::string dir = testing::FreshTempDir("plan-vs-train");
  for (const Case& c : std::vector<Case>{
           {1, {}, 0.05},
           {1, {"training.activation_checkpointing=full"}, 0.15},
           {1, {"training.mixed_precision=bf16"}, 0.15},
           {1, {"training.activation_checkpointing=selective"}, 0.15},
           {2, {}, 0.15},
           // DDP: a shard axis of 1 gathers nothing, the fp32 parameters are their shards
           // (Note [One shard]); counted as copies before 2026-11-28, +19% here.
           {2,
            {"parallelism.strategy=no_shard", "parallelism.data_parallel_replicate_degree=-1",
             "parallelism.data_parallel_shard_degree=1"},
            0.15},
           {2, {"parallelism.offload=optimizer"}, 0.15},
           {2, {"parallelism.offload=params"}, 0.15},
           // The delayed update's second loaded copy and landing buffer (Note [Delayed parameter
           // update]), and offload params with one load and one gradient send per step.
           {1,
            {"parallelism.offload=params", "training.mixed_precision=bf16",
             "parallelism.offload_delayed_update=on"},
            0.15},
           {1,
            {"parallelism.offload=params", "training.mixed_precision=bf16",
             "parallelism.reshard_between_micro_batches=false", "training.grad_sync=last",
             "training.grad_accum_steps=2"},
            0.15},
           // Host memory per parameter (docs/offload.md): the fp32 gradients never written
           // (one micro-batch, the one loop) and, without the compute copy, no bf16 copies.
           {1, {"parallelism.offload=params", "training.mixed_precision=bf16"}, 0.15},
           {1,
            {"parallelism.offload=params", "training.mixed_precision=bf16"},
            0.15,
            {{"FSDP_OFFLOAD_COMPUTE_COPY", "0"}}},
           {1,
            {"parallelism.offload=params", "training.mixed_precision=bf16",
             "training.grad_accum_steps=2"},
            0.15},
       }) {
    const std::string what = StrCat(c.ranks, " rank(s) ", StrJoin(c.sets, " "));
    const std::string run_dir = StrCat(dir, "/run");
    std::filesystem::remove_all(run_dir);
    std::vector<std::string> train = {FsdpBinary(), "train", SourceDir() + "/configs/default.yaml",
                                      "--quiet", "--set", "training.steps=4", "--set",
                                      "training.eval_interval=0", "--set",
                                      StrCat("parallelism.nproc=", c.ranks), "--set",
                                      "run.dir=" + run_dir};
    std::vector<std::string> plan = {FsdpBinary(), "plan", SourceDir() + "/configs/default.yaml",
                                     "--world-size", std::to_string(c.ranks), "--gpu", "cpu",
                                     "--json", dir + "/plan.json"};
    for (const std::string& set : c.sets) {
      for (auto* argv : {&train, &plan}) {
        argv->push_back("--set");
        argv->push_back(set);
      }
    }
    CommandResult trained = RunCommand(train, c.env, std::chrono::seconds(120));
    ASSERT_TRUE(trained.exit.ok()) << what << "\n" << trained.Output();
    CommandResult planned = RunCommand(plan, c.env);
    ASSERT_TRUE(planned.exit.ok()) << what << "\n" << planned.Output();

    double measured = 0;
    std::ifstream metrics(run_dir + "/metrics.jsonl");
    for (std::string line; std::getline(metrics, line);) {
      auto record = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
      if (record.is_object() && record.contains("peak_mem_bytes")) {
        measured = std::max(measured, record["peak_mem_bytes"].get<double>());
      }
    }
    ASSERT_GT(measured, 0) << what;
    // The prediction for the configured layout (full_shard over every rank unless the case
    // names a strategy) and modes.
    std::string strategy = "full_shard";
    for (const std::string& set : c.sets) {
      if (set.starts_with("parallelism.strategy=")) strategy = set.substr(set.find('=') + 1);
    }
    const nlohmann::json p = nlohmann::json::parse(std::ifstream(dir + "/plan.json"));
    const nlohmann::json& configured = p["configured"];
    double predicted = 0, predicted_host = 0;
    for (const char* list : {"layouts", "alternatives"}) {
      if (!p.contains(list)) continue;
      for (const nlohmann::json& l : p[list]) {
        if (l.value("strategy", "") == strategy &&
            l["activation_checkpointing"] == configured["activation_checkpointing"] &&
            l["offload"] == configured["offload"] && predicted == 0) {
          predicted_host = l["memory_bytes"]["host"].get<double>();
          predicted = l["memory_bytes"]["total"].get<double>() + predicted_host;
        }
      }
    }
    ASSERT_GT(predicted, 0) << what << ": no such layout in " << p.dump();
    EXPECT_NEAR(predicted / measured, 1.0, c.tolerance)
        << what << ": predicted " << predicted << " B, measured " << measured << " B";
    // With offload, the host's share on its own against rank 0's model state in host memory
    // (rank_stats: what is resident; gradient buffers never written are not).
    if (configured["offload"] != "none") {
      const nlohmann::json stats =
          nlohmann::json::parse(std::ifstream(run_dir + "/rank_stats/rank0.json"));
      const double host = stats["model_state"]["host_bytes"].get<double>();
      ASSERT_GT(host, 0) << what << ": " << stats.dump();
      EXPECT_NEAR(predicted_host / host, 1.0, 0.02)
          << what << ": host predicted " << predicted_host << " B, measured " << host << " B";
    }
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace fsdp
