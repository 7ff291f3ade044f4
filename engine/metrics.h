// What the trainer reports: one JSON object per step in <run.dir>/metrics.jsonl, a fixed-field
// line on rank 0's stdout every log interval, an optional progress bar on a terminal, and MFU
// against a table of peak FLOP/s.
//
//   FSDP_ASSIGN_OR_RETURN(MetricsWriter writer, MetricsWriter::Open(run_dir + "/metrics.jsonl"));
//   writer.Write({{"step", 1}, {"loss", 5.2}});
//   double peak = PeakFlopsPerDevice("NVIDIA H100 80GB HBM3", /*bf16=*/true);  // 989e12
// (compiled and run in tests/header_examples_test.cc)
#pragma once

#include <cstdio>
#include <string>

#include <nlohmann/json.hpp>

#include "absl/status/statusor.h"

namespace fsdp {

class MetricsWriter {
 public:
  // Opens `path` truncated; kFailedPrecondition naming the path if it cannot. With
  // `resume_step` >= 0 (resuming after that many steps) the file is kept up to that step:
  // records of later steps, written by the run that was interrupted, are dropped, so that
  // every step appears exactly once across resumes.
  static absl::StatusOr<MetricsWriter> Open(const std::string& path, int64_t resume_step = -1);
  MetricsWriter(MetricsWriter&& other) noexcept;
  ~MetricsWriter();
  // Appends one line and flushes it. A failed write (disk full, I/O error) is kept: status()
  // returns it from then on, and nothing more is written.
  void Write(const nlohmann::json& record);
  const absl::Status& status() const { return status_; }

 private:
  MetricsWriter() = default;
  std::string path_;
  std::FILE* file_ = nullptr;
  absl::Status status_;
};

// Dense peak FLOP/s of one GPU for the compute dtype (bf16, or fp32 = TF32), from its name
// (cudaDeviceProp::name); 0 when unknown.
double PeakFlopsPerDevice(const std::string& device_name, bool bf16);

// "[#########.........] 120/200 60% ETA 0:12" (no newline).
std::string ProgressBar(int64_t done, int64_t total, double seconds_per_step, int width = 30);

// "12.3 MiB"
std::string HumanBytes(double bytes);

}  // namespace fsdp
