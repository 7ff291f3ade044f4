// `fsdp train` as the end-to-end tests run it: one command, then what its run folder holds.
//
//   TrainRun run = RunTrain(SourceDir() + "/configs/default.yaml", dir,
//                           {"parallelism.nproc=2", "training.steps=4"});
//   ASSERT_EQ(run.result.exit.code, 0) << run.result.Output();
//   EXPECT_NEAR(run.losses.at(4), reference.losses.at(4), 1e-6);
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tests/multirank.h"

namespace fsdp::testing {

struct TrainRun {
  CommandResult result;
  std::map<int64_t, double> losses;    // by step: the records whose loss is a number
  std::vector<nlohmann::json> records;       // every metrics.jsonl record, in order
  std::vector<nlohmann::json> step_records;  // those with a "loss" key (JSON has no NaN: a
                                             // non-finite loss is written as null)
  nlohmann::json rank0_stats;           // <run.dir>/rank_stats/rank0.json; null without one
};

// Runs `fsdp train <config> --set run.dir=<dir> --set metrics.progress_bar=off [flags...]
// [--set s...]` (RunCommand: no GPU unless `env` says so, WithGpus) and reads the run folder.
// Lines of metrics.jsonl that do not parse are skipped (a run killed mid-write).
TrainRun RunTrain(const std::string& config, const std::string& dir,
                  const std::vector<std::string>& sets,
                  const std::map<std::string, std::string>& env = {},
                  std::chrono::seconds timeout = std::chrono::seconds(180),
                  const std::vector<std::string>& flags = {});

// The step records' losses in order, NaN where a loss is null.
std::vector<double> LossSeries(const TrainRun& run);

}  // namespace fsdp::testing
