#include "engine/train_metrics.h"

#include <limits>

#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <fmt/format.h>

#include "common/env_knobs.h"
#include "common/strings.h"
#include "device_mesh/cuda_support.h"
#include "sharding/memory_tracker.h"

namespace fsdp {

nlohmann::json StepRecord::ToJson() const {
  nlohmann::json j = {{"step", step},
                      {"loss", loss},
                      {"grad_norm", grad_norm},
                      {"lr", lr},
                      {"step_time_s", step_time_s},
                      {"step_ms", step_ms},
                      {"tokens_per_s", tokens_per_s},
                      {"tokens_per_s_per_device", tokens_per_s_per_device},
                      {"mfu", std::isfinite(mfu) ? nlohmann::json(mfu) : nlohmann::json(nullptr)},
                      {"peak_mem_bytes", peak_mem_bytes},
                      {"comm_wait_s", comm_wait_s},
                      {"comm_bytes", comm_bytes}};
  if (skipped) j["skipped"] = true;  // its loss / grad_norm are null (non-finite)
  return j;
}

std::string StepRecord::ToLine() const {
  return fmt::format(
      "step {:>6}/{}  loss {:.4f}  grad_norm {:.3f}  lr {:.3e}  {:.0f} ms/step  {:.0f} tok/s "
      "({:.0f}/device)  mfu {}  peak_mem {}",
      step, total_steps, loss, grad_norm, lr, step_time_s * 1e3, tokens_per_s,
      tokens_per_s_per_device, std::isfinite(mfu) ? fmt::format("{:.2f}%", 100 * mfu) : "n/a",
      HumanBytes(static_cast<double>(peak_mem_bytes)));
}

absl::StatusOr<StepRecord> ReadProgressFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  nlohmann::json j = nlohmann::json::parse(text.str(), nullptr, /*allow_exceptions=*/false);
  if (!j.is_object() || !j.contains("step") || !j["step"].is_number_integer() ||
      !j.contains("total_steps") || !j["total_steps"].is_number_integer() ||
      !j.contains("elapsed_s") || !j["elapsed_s"].is_number()) {
    return absl::NotFoundError(StrCat(path, ": no progress record yet"));
  }
  StepRecord r;
  r.step = j["step"].get<int64_t>();
  r.total_steps = j["total_steps"].get<int64_t>();
  r.elapsed_s = j["elapsed_s"].get<double>();
  return r;
}

namespace {

// Written to a temporary name and renamed, so a reader never sees half a record.
void PublishProgress(const std::string& path, const StepRecord& r) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << nlohmann::json{{"step", r.step}, {"total_steps", r.total_steps}, {"elapsed_s", r.elapsed_s}}
               .dump()
        << "\n";
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
}

}  // namespace

TrainMetrics::TrainMetrics(const RunConfig& config, std::shared_ptr<DistContext> ctx,
                           c10::Device device, double flops_per_token, CommStats& comm,
                           std::optional<MetricsWriter> jsonl)
    : config_(config),
      ctx_(std::move(ctx)),
      device_(device),
      flops_per_token_(flops_per_token),
      comm_(comm),
      jsonl_(std::move(jsonl)) {
  const TrainingSection& t = config.training;
  tokens_per_step_ = ctx_->world_size() * t.micro_batch_size * t.grad_accum_steps *
                     config.model.seq_len;
  const bool bf16 = t.mixed_precision == Precision::kBf16;
  peak_flops_ = device.is_cuda() ? PeakFlopsPerDevice(CudaDeviceDescription(device.index()), bf16)
                                 : config.metrics.cpu_peak_flops;
  // On a terminal of its own (torchrun, srun) rank 0 draws the bar; under `fsdp train`'s own
  // launcher the CLI draws it from the progress file (cli/train.cc).
  if (ctx_->rank() == 0) {
    draw_bar_ = config.metrics.progress_bar != ProgressBarMode::kOff && isatty(STDERR_FILENO);
    progress_file_ = GetEnvKnob(kProgressFile).value_or("");
  }
  first_bad_ = at::full({}, -1, at::TensorOptions().dtype(at::kLong).device(device));
}

void TrainMetrics::Start() {
  ResetDevicePeak(device_);
  comm_.Reset();
  interval_comm_ = comm_;
  run_start_ = interval_start_ = step_start_ = Clock::now();
}

// Note [Step timing]
// Each metrics.jsonl step record carries step_ms, the time of that step alone (BeginStep to
// Record: the micro-batches, clipping and the update; not the logging, evaluation or checkpoint
// saves between steps). On CUDA a pair of timing events is recorded on the current stream
// around the step and their elapsed time is read only in Log(), after the interval's host
// synchronisation, so the step itself still makes none; it is the device's time from the start
// marker to the end marker, idle gaps included. On the CPU the work is synchronous and a steady
// clock measures it. (c10::Event: device-generic, no CUDA headers, as sharding/streams.cc.)
void TrainMetrics::BeginStep() {
  step_start_ = Clock::now();
  if (!device_.is_cuda()) return;
  step_start_event_.emplace(device_.type(), c10::EventFlag::BACKEND_DEFAULT);  // timing on
  step_start_event_->record(c10::impl::getDeviceGuardImpl(device_.type())->getStream(device_));
}

void TrainMetrics::Record(const at::Tensor& loss, const at::Tensor& grad_norm,
                          const at::Tensor& nonfinite, int64_t step, double lr, bool skipped) {
  // See Note [Step timing]; without a BeginStep the step is timed from the previous Record.
  StepTime& time = step_times_.emplace_back();
  if (step_start_event_) {
    c10::Event end(device_.type(), c10::EventFlag::BACKEND_DEFAULT);
    end.record(c10::impl::getDeviceGuardImpl(device_.type())->getStream(device_));
    time.events.emplace(std::move(*step_start_event_), std::move(end));  // read in Log
    step_start_event_.reset();
  } else {
    time.ms = std::chrono::duration<double, std::milli>(Clock::now() - step_start_).count();
  }
  step_start_ = Clock::now();  // the next step's start, if no BeginStep says otherwise
  skipped_.push_back(skipped);
  skipped_total_ += skipped;
  losses_.push_back(loss);
  norms_.push_back(grad_norm);
  lrs_.push_back(lr);
  if (nonfinite.defined()) {
    first_bad_ = at::where(nonfinite & first_bad_.lt(0), at::full_like(first_bad_, step + 1),
                           first_bad_);
  }
}

int64_t TrainMetrics::FirstNonFiniteOnAnyRank() {
  constexpr int64_t kNone = std::numeric_limits<int64_t>::max();
  at::Tensor first = at::where(first_bad_.lt(0), at::full_like(first_bad_, kNone), first_bad_)
                         .reshape({1});
  ctx_->world().AllReduce(first, c10d::ReduceOp::MIN)->wait();
  const int64_t step = first.item<int64_t>();
  return step == kNone ? -1 : step;
}

bool TrainMetrics::ShouldLog(int64_t steps_done) const {
  return steps_done % config_.training.log_interval == 0 || steps_done == config_.training.steps;
}

absl::StatusOr<IntervalEnd> TrainMetrics::Log(int64_t steps_done, bool term_requested) {
  RECORD_FUNCTION("fsdp::log", std::vector<c10::IValue>());
  const int world = ctx_->world_size();
  const int64_t n = static_cast<int64_t>(losses_.size());
  // One host synchronisation per log interval: the losses (averaged over data-parallel ranks),
  // the norms and the non-finite flag of every step since the last log, and SIGTERM.
  // Flags summed over ranks with the losses: SIGTERM, a failed metrics write (rank 0), and a
  // non-finite step seen (the first such step over all ranks costs a second all-reduce, only
  // then).
  const bool write_failed = jsonl_ && !jsonl_->status().ok();
  at::Tensor flags = at::cat({at::tensor({term_requested ? 1.0 : 0.0, write_failed ? 1.0 : 0.0},
                                         at::TensorOptions().dtype(at::kDouble)).to(device_),
                              first_bad_.ge(0).to(at::kDouble).reshape({1})});
  at::Tensor stacked = at::cat({at::stack(losses_).to(at::kDouble), flags});
  ctx_->world().AllReduce(stacked)->wait();
  stacked = stacked.cpu();
  if (stacked[n + 1].item<double>() > 0) return WriteError();
  IntervalEnd end;
  end.terminate = stacked[n].item<double>() > 0;
  // Any rank's flag counts: every rank must stop at the same interval.
  if (stacked[n + 2].item<double>() > 0) end.first_nonfinite = FirstNonFiniteOnAnyRank();
  stacked = stacked.narrow(0, 0, n) / world;
  at::Tensor norm_values = at::stack(norms_).to(at::kDouble).cpu();

  StepRecord r;
  r.total_steps = config_.training.steps;
  r.elapsed_s = std::chrono::duration<double>(Clock::now() - run_start_).count();
  r.step_time_s =
      std::chrono::duration<double>(Clock::now() - interval_start_).count() / static_cast<double>(n);
  r.tokens_per_s = static_cast<double>(tokens_per_step_) / r.step_time_s;
  r.tokens_per_s_per_device = r.tokens_per_s / world;
  if (peak_flops_ > 0) r.mfu = flops_per_token_ * r.tokens_per_s_per_device / peak_flops_;
  r.peak_mem_bytes = DevicePeakBytes(device_);
  for (int k = 0; k < kNumCommKinds; ++k) {
    const CommCounter &now = comm_.Get(static_cast<CommKind>(k)),
                      &before = interval_comm_.Get(static_cast<CommKind>(k));
    r.comm_wait_s += (now.wait_seconds - before.wait_seconds) / static_cast<double>(n);
    r.comm_bytes += static_cast<double>(now.bytes - before.bytes) / static_cast<double>(n);
  }
  interval_comm_ = comm_;
  // See Note [Step timing]: the events completed before the host read above.
  for (StepTime& time : step_times_) {
    if (!time.events) continue;
    time.events->second.synchronize();
    time.ms = time.events->first.elapsedTime(time.events->second);
    time.events.reset();
  }
  const int64_t first = steps_done - n;
  for (int64_t i = 0; i < n; ++i) {
    r.step = first + i + 1;
    r.loss = stacked[i].item<double>();
    r.grad_norm = norm_values[i].item<double>();
    r.lr = lrs_[i];
    r.skipped = skipped_[i];
    r.step_ms = step_times_[i].ms;
    if (jsonl_) jsonl_->Write(r.ToJson());
  }
  last_loss_ = r.loss;
  if (ctx_->rank() == 0) {
    if (!progress_file_.empty()) PublishProgress(progress_file_, r);  // before the line wakes the CLI
    if (draw_bar_) std::cerr << "\r\033[K";
    std::cout << r.ToLine() << "\n";
    std::cout.flush();
    if (draw_bar_) {
      std::cerr << ProgressBar(r.step, r.total_steps, r.elapsed_s / static_cast<double>(r.step));
      std::cerr.flush();
    }
  }
  losses_.clear();
  norms_.clear();
  lrs_.clear();
  skipped_.clear();
  step_times_.clear();
  interval_start_ = Clock::now();
  return end;
}

void TrainMetrics::RecordEval(int64_t step, double val_loss) {
  interval_start_ = Clock::now();  // the evaluation is not part of the next interval's steps
  if (ctx_->rank() != 0) return;
  std::cout << fmt::format("eval   step {:>6}  val_loss {:.4f}\n", step, val_loss);
  if (jsonl_) jsonl_->Write({{"step", step}, {"val_loss", val_loss}});
}

void TrainMetrics::RecordCheckpoint(int64_t step, double blocking_seconds) {
  if (jsonl_) jsonl_->Write({{"step", step}, {"checkpoint_blocking_s", blocking_seconds}});
}

absl::Status TrainMetrics::WriteError() const {
  if (jsonl_ && !jsonl_->status().ok()) return jsonl_->status();
  return absl::ResourceExhaustedError(
      "rank 0 could not write metrics.jsonl (its message names the file); stopping");
}

absl::Status TrainMetrics::Finish(int64_t steps) {
  at::Tensor failed = at::full({1}, jsonl_ && !jsonl_->status().ok() ? 1.0 : 0.0,
                               at::TensorOptions().dtype(at::kDouble).device(device_));
  ctx_->world().AllReduce(failed)->wait();
  if (failed.item<double>() > 0) return WriteError();
  if (ctx_->rank() != 0) return absl::OkStatus();
  if (draw_bar_) std::cerr << "\n";
  const double total = std::chrono::duration<double>(Clock::now() - run_start_).count();
  std::cout << fmt::format("fsdp train: done, {} steps in {:.1f} s, final loss {:.4f}{}; metrics in {}\n",
                           steps, total, last_loss_,
                           skipped_total_ > 0
                               ? fmt::format(" ({} update(s) skipped: non-finite)", skipped_total_)
                               : "",
                           (std::filesystem::path(config_.run.dir) / "metrics.jsonl").string());
  return absl::OkStatus();
}

}  // namespace fsdp
