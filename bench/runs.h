// Internal to bench/: starting one measured run and reading back what it wrote.
//
// A run (either engine) leaves in its folder:
//   metrics.jsonl          rank 0, one line per step: step, loss, step_time_s, comm_wait_s,
//                          comm_bytes (other lines, e.g. eval records, have no "loss")
//   rank_stats/rank<r>.json  per rank at the end: peak_rss_bytes, and for fsdp.cpp also
//                          peak_tensor_bytes, state_bytes, comm (see Note [Rank statistics]
//                          in engine/trainer.cc)
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/status/statusor.h"

namespace fsdp::bench {

struct StepRecord {
  int64_t step = 0;
  double loss = 0, step_time_s = 0, comm_wait_s = 0, comm_bytes = 0;
};

struct RunResult {
  std::string engine;  // "fsdp.cpp" | "fsdp2"
  int repeat = 0;
  std::string dir;
  std::vector<StepRecord> steps;
  std::vector<nlohmann::json> rank_stats;  // index = rank
  double wall_s = 0;

  // Median of a field over the steps after `warmup`.
  double MedianAfter(int warmup, double StepRecord::*field) const;
  // Maximum of an integer field of the rank statistics over ranks (0 if absent).
  int64_t MaxOverRanks(const std::string& key) const;
};

// Starts `program` on `nproc` local ranks through the launcher (torchrun's environment,
// OMP_NUM_THREADS = cores / nproc) and echoes rank 0's step lines and every rank's stderr.
// Returns the launcher's exit code.
int LaunchRanks(int nproc, const std::vector<std::string>& program);

// Reads a finished run's folder; kDataLoss naming the file when something is missing.
absl::StatusOr<RunResult> ReadRun(const std::string& engine, int repeat, const std::string& dir,
                                  int nproc);

double Median(std::vector<double> values);
// "12.3 GiB".
std::string GiB(double bytes);
// --out checked before a benchmark runs: "" when the file can be written (nothing is left
// behind), else why not ("is a directory", "cannot be written (No such file or directory)").
std::string CheckOutPath(const std::string& out);
// This machine's physical memory in bytes (0 when unknown).
double HostMemoryBytes();
// "AMD EPYC 7B13, 2 cores" (+ the GPU when training on one).
std::string MachineDescription();
std::string Today();  // "2026-11-22"

// Runs `python bench/plot.py KIND DIR`; a failure is reported, not fatal (the numbers are
// already on disk).
void Plot(const std::string& python, const std::string& kind, const std::string& dir);

}  // namespace fsdp::bench
