// The training loop's metrics component: it keeps each step's loss, gradient norm and learning
// rate on the device, decides when to log (every training.log_interval steps and at the last),
// and then makes one host synchronisation for the whole interval. Each log emits a structured
// record (StepRecord): rank 0 writes it to <run.dir>/metrics.jsonl, prints the fixed-field step
// line, and publishes it for progress bars (its own on a terminal, or the launcher's through
// the FSDP_PROGRESS_FILE the CLI sets).
//
// Collective: Log() all-reduces over the world; every rank calls it at the same steps. The same
// all-reduce carries whether any rank got SIGTERM, so all ranks stop at the same step (between
// log steps, engine/term_watch.h tells them).
//
//   TrainMetrics metrics(config, ctx, device, flops_per_token, comm, jsonl);
//   metrics.BeginStep();  ...the step...
//   metrics.Record(out.loss, out.grad_norm, out.nonfinite, step, lr);
//   if (metrics.ShouldLog(step + 1)) { FSDP_ASSIGN_OR_RETURN(IntervalEnd end, metrics.Log(...)); }
#pragma once

#include <chrono>
#include <cmath>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Event.h>
#include <nlohmann/json.hpp>

#include "absl/status/statusor.h"
#include "device_mesh/dist_context.h"
#include "engine/config.h"
#include "engine/metrics.h"
#include "sharding/comm_stats.h"

namespace fsdp {

// One step as logged (rank 0's view; losses averaged over the data-parallel ranks).
struct StepRecord {
  int64_t step = 0;
  int64_t total_steps = 0;
  double loss = 0, grad_norm = 0, lr = 0;
  double step_time_s = 0, tokens_per_s = 0, tokens_per_s_per_device = 0;
  double mfu = std::nan("");  // NaN without a peak (a CPU without metrics.cpu_peak_flops)
  double step_ms = 0;  // this step alone (Note [Step timing])
  int64_t peak_mem_bytes = 0;
  double comm_wait_s = 0, comm_bytes = 0;  // this rank's, per step of the interval
  bool skipped = false;                    // on_nonfinite: skip skipped this step's update
  double elapsed_s = 0;                    // since the loop started

  nlohmann::json ToJson() const;  // the metrics.jsonl record
  std::string ToLine() const;     // "step     10/200  loss 5.1234  grad_norm ..."
};

// The record a progress bar reads (FSDP_PROGRESS_FILE): {"step", "total_steps", "elapsed_s"}.
absl::StatusOr<StepRecord> ReadProgressFile(const std::string& path);

// What the interval's synchronisation found.
struct IntervalEnd {
  bool terminate = false;       // some rank got SIGTERM
  int64_t first_nonfinite = -1;  // first step (1-based) with a non-finite loss or norm, or -1
};

class TrainMetrics {
 public:
  TrainMetrics(const RunConfig& config, std::shared_ptr<DistContext> ctx, c10::Device device,
               double flops_per_token, CommStats& comm, std::optional<MetricsWriter> jsonl);

  // Starts the clocks and the peak-memory counters (right before the loop).
  void Start();
  // A step begins (Note [Step timing]): records its start marker, no host synchronisation.
  void BeginStep();
  // Step `step` (0-based) is done; `nonfinite` (0-dim bool on the device) marks a non-finite
  // loss or norm, noted without a host read.
  // `skipped`: the update was skipped (on_nonfinite: skip), recorded as such.
  void Record(const at::Tensor& loss, const at::Tensor& grad_norm, const at::Tensor& nonfinite,
              int64_t step, double lr, bool skipped = false);
  bool ShouldLog(int64_t steps_done) const;
  // The first step (1-based) any rank recorded as non-finite so far, or -1: one small
  // all-reduce and host read, for the points that must not go on from a non-finite state (a
  // checkpoint about to be saved). Collective over the world.
  int64_t FirstNonFiniteOnAnyRank();
  // The interval's all-reduce and host read; writes, prints and publishes one record per step.
  // An earlier failed write of metrics.jsonl (rank 0) is an error on every rank.
  absl::StatusOr<IntervalEnd> Log(int64_t steps_done, bool term_requested);
  // Rank 0 only: extra records in metrics.jsonl.
  void RecordEval(int64_t step, double val_loss);
  void RecordCheckpoint(int64_t step, double blocking_seconds);
  // The end of the run: the progress bar's newline and the summary line. Collective: a failed
  // write of metrics.jsonl is an error on every rank.
  absl::Status Finish(int64_t steps);

  double last_loss() const { return last_loss_; }
  double peak_flops() const { return peak_flops_; }

 private:
  using Clock = std::chrono::steady_clock;
  absl::Status WriteError() const;
  const RunConfig& config_;
  std::shared_ptr<DistContext> ctx_;
  c10::Device device_;
  double flops_per_token_;
  double peak_flops_;
  int64_t tokens_per_step_;
  CommStats& comm_;
  CommStats interval_comm_;  // counters at the start of the log interval
  std::optional<MetricsWriter> jsonl_;
  bool draw_bar_ = false;       // rank 0 on a terminal of its own
  std::string progress_file_;   // FSDP_PROGRESS_FILE (rank 0), or empty
  std::vector<at::Tensor> losses_, norms_;  // per step of the interval, on the device
  std::vector<double> lrs_;
  std::vector<bool> skipped_;  // per step of the interval
  // Note [Step timing]: per step of the interval, the milliseconds (CPU: measured; CUDA: read
  // from the step's (start, end) events in Log).
  struct StepTime {
    double ms = 0;
    std::optional<std::pair<c10::Event, c10::Event>> events;
  };
  std::vector<StepTime> step_times_;
  std::optional<c10::Event> step_start_event_;
  Clock::time_point step_start_;
  int64_t skipped_total_ = 0;
  at::Tensor first_bad_;  // 0-dim int64 on the device: first non-finite step, or -1
  Clock::time_point run_start_, interval_start_;
  double last_loss_ = std::nan("");
};

}  // namespace fsdp
