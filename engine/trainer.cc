#include "engine/trainer.h"

#include <signal.h>

#include <chrono>
#include <csignal>
#include <filesystem>
#include <iostream>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/record_function.h>
#include <torch/nn/module.h>
#include <fmt/format.h>
#include <torch/optim/optimizer.h>

#include "common/env_knobs.h"
#include "common/failure.h"
#include "common/logging.h"
#include "common/status.h"
#include "common/strings.h"
#include "device_mesh/cuda_support.h"
#include "device_mesh/watchdog.h"
#include "engine/attention.h"
#include "engine/checkpointing.h"
#include "engine/data.h"
#include "engine/metrics.h"
#include "engine/optimizer.h"
#include "engine/profiler.h"
#include "engine/rank_stats.h"
#include "engine/run_setup.h"
#include "engine/schedule.h"
#include "engine/train_metrics.h"
#include "engine/term_watch.h"
#include "engine/trainable.h"
#include "models/model.h"
#include "sharding/fsdp_model.h"
#include "sharding/memory_tracker.h"

namespace fsdp {
namespace {

volatile std::sig_atomic_t g_term = 0;
void OnTerm(int) { g_term = 1; }
void InstallTermHandler() {
  struct sigaction action {};
  action.sa_handler = OnTerm;
  sigemptyset(&action.sa_mask);
  sigaction(SIGTERM, &action, nullptr);
}
bool TermRequested() { return g_term != 0; }

// Evaluation on the held-out part: mean loss over eval_batches batches (at most the held-out
// batches there are: the trainer checks at start that there is one), averaged over ranks.
absl::StatusOr<double> Evaluate(Model& model, const DataLoader& loader, int64_t batches,
                                ProcessGroup& world, c10::Device device) {
  RECORD_FUNCTION("fsdp::evaluate", std::vector<c10::IValue>());
  torch::NoGradGuard no_grad;
  int64_t n = std::min(batches, loader.num_val_batches());
  at::Tensor sum = at::zeros({}, at::TensorOptions().dtype(at::kDouble).device(device));
  for (int64_t i = 0; i < n; ++i) {
    absl::StatusOr<Batch> b = loader.ValBatch(i);
    FSDP_RETURN_IF_ERROR(AsDataFailure(b.status()));
    sum += model.Loss(b->inputs.to(device), b->targets.to(device)).to(at::kDouble);
  }
  world.AllReduce(sum)->wait();
  return n > 0 ? sum.item<double>() / (n * world.size()) : std::nan("");
}

absl::Status NonFiniteError(int64_t step) {
  return WithFailureClass(
      absl::FailedPreconditionError(StrCat(
          "step ", step, ": the loss or the gradient norm is not finite (NaN or inf); "
          "stopping. Lower optimizer.lr, or set training.on_nonfinite: skip")),
      FailureClass::kNonFinite);
}

// Every rank learnt of a SIGTERM at the same step: the caller saved (a step already saved
// by the periodic cadence is not saved twice: Checkpointer::Save); stop with the preempted
// class (exit 143, Note [Exit codes]): the run did not finish, whichever ranks got the signal.
absl::Status StopOnTerm(const std::optional<Checkpointer>& checkpointer, int64_t step,
                        int64_t steps, int rank) {
  if (checkpointer && checkpointer->enabled()) {
    if (rank == 0) std::cout << "fsdp train: SIGTERM: saved step " << step << " and stopped\n";
    return WithFailureClass(
        absl::CancelledError(StrCat("stopped by SIGTERM after step ", step, " of ", steps,
                                    "; step ", step,
                                    " is saved (resume with checkpoint.load: latest)")),
        FailureClass::kPreempted);
  }
  return WithFailureClass(
      absl::CancelledError(StrCat("stopped by SIGTERM after step ", step, " of ", steps,
                                  " (checkpoint.enabled is false: nothing saved)")),
      FailureClass::kPreempted);
}

// A batch's host tensor on `device` without a host sync. A blocking copy to a GPU is
// cudaMemcpyAsync + cudaStreamSynchronize (c10::cuda::memcpy_and_sync): the host would wait at
// every micro-batch for all the work queued so far. So on CUDA the tokens go through a pinned
// buffer of libtorch's caching host allocator, copied non_blocking: the copy records an event
// on that buffer, which is not reused before the copy is done (as DataLoader(pin_memory=True)
// and .to(non_blocking=True) in PyTorch). On CPU a no-op, as before.
at::Tensor BatchToDevice(const at::Tensor& host, c10::Device device) {
  if (!device.is_cuda() || !host.is_cpu()) return host.to(device);
  return host.pin_memory().to(device, /*non_blocking=*/true);
}

// One training step: grad_accum_steps micro-batches, then clip and update. Returns the mean
// loss, the norm before clipping and whether either is non-finite, all on the device: the step
// makes no host read, except that on_nonfinite: skip must know before the update (one read).
struct StepOutput {
  at::Tensor loss, grad_norm, nonfinite;
  bool skipped = false;
  double optimizer_s = 0;  // the host's wall time in optimizer.step() (offload: the whole step;
                           // overlapped (Note [Overlapped host step]): preparing and queueing it)
};

// `step`: 0-based. `poisoned`: FSDP_TEST_NONFINITE names this rank and step; its first loss
// becomes NaN.
absl::StatusOr<StepOutput> TrainStep(TrainingRun& run, const TrainingSection& t, int64_t step,
                                     bool poisoned) {
  RECORD_FUNCTION("fsdp::train_step", std::vector<c10::IValue>());
  Model& model = *run.model;
  TrainableModel& trained = *run.trained;
  torch::optim::Optimizer& optimizer = *run.optimizer;
  DataLoader& loader = *run.loader;
  const c10::Device device = run.device;
  StepOutput out;
  out.loss = at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(device));
  trained.BeginStep(step);
  // Every step below ends with StepOverlapped after ClipGradNorm, or zero_grad.
  trained.AllowDeferredGradients();
  for (int m = 0; m < t.grad_accum_steps; ++m) {
    RECORD_FUNCTION("fsdp::micro_batch", std::vector<c10::IValue>());
    trained.BeginMicroBatch(m, static_cast<int>(t.grad_accum_steps));
    absl::StatusOr<Batch> b = loader.Get(m);
    FSDP_RETURN_IF_ERROR(AsDataFailure(b.status()));
    at::Tensor loss;
    {
      RECORD_FUNCTION("fsdp::forward", std::vector<c10::IValue>());
      loss = model.Loss(BatchToDevice(b->inputs, device), BatchToDevice(b->targets, device)) /
             static_cast<double>(t.grad_accum_steps);
      if (poisoned && m == 0) loss = loss * std::numeric_limits<double>::quiet_NaN();
    }
    {
      RECORD_FUNCTION("fsdp::backward", std::vector<c10::IValue>());
      loss.backward();
      trained.AfterBackward();
    }
    out.loss += loss.detach();
  }
  loader.Advance();
  {
    RECORD_FUNCTION("fsdp::clip_grad_norm", std::vector<c10::IValue>());
    out.grad_norm = trained.ClipGradNorm(t.max_grad_norm > 0 ? t.max_grad_norm : kNoClipping);
  }
  out.nonfinite = out.loss.isfinite().logical_not() | out.grad_norm.isfinite().logical_not();
  if (t.on_nonfinite == OnNonFinite::kSkip && out.nonfinite.item<bool>()) {
    trained.AfterSkippedStep();
    optimizer.zero_grad();
    out.skipped = true;
    return out;
  }
  {
    RECORD_FUNCTION("fsdp::optimizer_step", std::vector<c10::IValue>());
    const auto start = std::chrono::steady_clock::now();
    // See Note [Overlapped host step] (trainable.cc): with offload the step may overlap the
    // next forward; optimizer_s is then the time to prepare and queue it.
    const bool overlapped = trained.StepOverlapped(optimizer);
    if (!overlapped) optimizer.step();
    out.optimizer_s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (!overlapped) trained.AfterStep();
    optimizer.zero_grad();
  }
  return out;
}


// Note [Non-finite state is never saved]: with on_nonfinite: stop, a non-finite step updated
// the parameters with NaN/inf, and the flag is only read at the log interval; a checkpoint due
// in between would commit that state and prune good ones. So each save first reads every
// rank's flag (one tiny all-reduce per save, none per step) and stops instead. With skip,
// non-finite steps never update, so the state stays finite.
absl::Status SaveIfDue(const RunConfig& config, TrainingRun& run, TrainMetrics& metrics,
                       int64_t step, bool last) {
  std::optional<Checkpointer>& checkpointer = run.checkpointer;
  if (!checkpointer || !checkpointer->Due(step, last)) return absl::OkStatus();
  if (config.training.on_nonfinite == OnNonFinite::kStop) {
    if (int64_t bad = metrics.FirstNonFiniteOnAnyRank(); bad >= 0) {
      FSDP_RETURN_IF_ERROR(checkpointer->Finish());  // an earlier, finite save may be in flight
      return WithFailureClass(absl::FailedPreconditionError(
          StrCat(std::string(NonFiniteError(bad).message()), "; the checkpoint of step ", step,
                 " was not saved (the newest checkpoint holds the last finite state)")),
          FailureClass::kNonFinite);
    }
  }
  absl::StatusOr<bool> saved = checkpointer->MaybeSave(step, last, run.loader->position());
  if (!saved.ok()) return AsCheckpointFailure(saved.status());
  if (*saved) metrics.RecordCheckpoint(step, checkpointer->last_blocking_seconds());
  return absl::OkStatus();
}

// SIGTERM seen by every rank at step `done` (not the last): save it and stop.
absl::Status SaveAndStop(const RunConfig& config, TrainingRun& run, TrainMetrics& metrics,
                         TermWatch& term_watch, int64_t done) {
  term_watch.Drain();
  if (run.checkpointer && run.checkpointer->enabled()) {
    FSDP_RETURN_IF_ERROR(SaveIfDue(config, run, metrics, done, /*last=*/true));
    // Rank 0 commits after the others have written their shards: they wait for it here,
    // since the launcher stops the group soon after the first rank exits 143.
    at::Tensor committed = at::zeros({1}, at::TensorOptions().device(run.device));
    run.ctx->world().AllReduce(committed)->wait();
  }
  return StopOnTerm(run.checkpointer, done, config.training.steps, run.rank());
}

// Skipping keeps a run alive through a rare bad batch; a run whose every update is skipped has
// diverged and would otherwise "finish" without learning (skipped is known on the host in skip
// mode, and identical on every rank: the norm is global).
class SkipGuard {
 public:
  absl::Status Count(bool skipped, int64_t done) {
    consecutive_ = skipped ? consecutive_ + 1 : 0;
    if (consecutive_ < kMaxConsecutiveSkips) return absl::OkStatus();
    return WithFailureClass(absl::FailedPreconditionError(StrCat(
        "steps ", done - consecutive_ + 1, "-", done, ": ", consecutive_,
        " updates in a row skipped (non-finite loss or gradient norm): training diverged; "
        "lower optimizer.lr, or check the data")), FailureClass::kNonFinite);
  }

 private:
  static constexpr int kMaxConsecutiveSkips = 10;
  int consecutive_ = 0;
};

// The first wrap to another epoch of the training data is noted, once.
class EpochNote {
 public:
  void AfterStep(const DataLoader& loader, int64_t epoch_before, int64_t done, int rank) {
    if (rank != 0 || noted_ || loader.position().epoch <= epoch_before) return;
    std::cout << fmt::format(
        "fsdp train: step {} finished epoch {} of the training data ({} steps of {} windows); "
        "later epochs see the same windows again, reshuffled (not noted again)\n",
        done, epoch_before + 1, loader.batches_per_epoch(), loader.global_batch());
    noted_ = true;
  }

 private:
  bool noted_ = false;
};

// model.kernels as it resolves on `device`, "(auto)" after it when the config left the choice.
std::string KernelsLabel(KernelMode mode, c10::Device device) {
  const char* resolved = KernelModeName(ResolveKernelMode(mode, device.is_cuda()));
  return mode == KernelMode::kAuto ? StrCat(resolved, " (auto)") : resolved;
}

// The line rank 0 prints before the first step, and offload params' compute copy choice.
void PrintStartLine(const RunConfig& config, const TrainingRun& run) {
  const TrainingSection& t = config.training;
  std::cout << fmt::format(
      "fsdp train: {} on {} rank(s), mesh {}, strategy {}, model {} ({} parameters, {:.3g} "
      "FLOPs/token), data {}, {} tokens/step, attention {}, kernels {}\n",
      config.run.name, run.world(), run.mesh->shape().ToString(),
      StrategyLabel(config.parallelism.strategy), config.model.arch,
      run.model->NumParameters(), run.model->FlopsPerToken(), run.dataset->Describe(),
      run.world() * t.micro_batch_size * t.grad_accum_steps * config.model.seq_len,
      run.attention, KernelsLabel(config.model.kernels, run.device));
  if (const FsdpModel* sharded = run.trained->fsdp();
      sharded != nullptr && sharded->offload_compute_copy()) {
    const ComputeCopyChoice& copy = *sharded->offload_compute_copy();
    std::cout << fmt::format(
        "fsdp train: offload params {} a {} copy of each shard on the host ({})\n",
        copy.keep ? "keeps" : "keeps no", PrecisionName(t.mixed_precision), copy.reason);
  }
  std::cout.flush();
}

// The end of a run: every rank's statistics (Note [Rank statistics]) and rank 0's model-state
// line. `optimizer_s`: StepOutput::optimizer_s summed; `state_bytes`: the device's tensor bytes
// right after the last update.
void WriteStatistics(const RunConfig& config, TrainingRun& run, const TrainMetrics& metrics,
                     const TrainOptions& options, double optimizer_s, int64_t state_bytes) {
  const int64_t steps = config.training.steps - run.start_step;
  const Offload offload = config.parallelism.offload;
  RankStats stats{.steps = steps,
                  .peak_rss = ProcessPeakRssBytes(),
                  .peak_tensor = DevicePeakBytes(run.device),
                  .state_bytes = state_bytes,
                  .model_state = ModelStateOf(*run.trained, *run.optimizer, offload),
                  .offload = offload,
                  .comm = &run.trained->comm_stats(),
                  .flops_per_token = run.model->FlopsPerToken(),
                  .peak_flops = metrics.peak_flops(),
                  .device = run.device.is_cuda() ? CudaDeviceDescription(run.device.index())
                                                 : "cpu",
                  .offload_stats = nullptr};
  const FsdpModel* sharded = run.trained->fsdp();
  if (sharded != nullptr && sharded->context().offload != nullptr) {
    stats.offload_stats =
        OffloadStatsJson(sharded->context().offload->stats(), optimizer_s, steps);
  }
  WriteRankStats(config.run.dir, run.rank(), stats);
  if (run.rank() == 0 && sharded != nullptr && !options.quiet) {
    const ModelStateBytes& m = stats.model_state;
    std::cout << fmt::format(
        "fsdp train: model state on rank 0 (parameters, gradients, optimizer): {:.2f} MiB on the "
        "device, {:.2f} MiB in host memory (parallelism.offload: {}){}\n",
        m.device / 1048576.0, m.host / 1048576.0, OffloadName(offload),
        m.host_untouched > 0
            ? fmt::format("; {:.2f} MiB of gradient buffers reserved on the host and never "
                          "written take none",
                          m.host_untouched / 1048576.0)
            : "");
  }
}

}  // namespace

absl::Status Train(const RunConfig& config, const TrainOptions& options) {
  // ===== setup: rendezvous, mesh, run folder, model, optimizer, data, resume ===================
  const TrainingSection& t = config.training;
  FSDP_ASSIGN_OR_RETURN(std::unique_ptr<TrainingRun> run, SetUpRun(config, options));
  const int rank = run->rank();
  const std::filesystem::path run_dir(config.run.dir);
  if (run->complete(config)) {
    // The run is complete: no step to train, so no "final loss nan" and no second save.
    if (rank == 0) {
      std::cout << fmt::format(
          "fsdp train: done: the checkpoint loaded is at step {}, which is training.steps; "
          "nothing left to train (raise training.steps to continue)\n",
          run->start_step);
    }
    // As at the end of a run: rank 0 may host the store the others' watchdogs still use.
    run->ctx->world().Barrier()->wait();
    return absl::OkStatus();
  }
  InstallTermHandler();
  std::optional<MetricsWriter> jsonl;
  if (rank == 0 && config.metrics.jsonl) {
    FSDP_ASSIGN_OR_RETURN(MetricsWriter writer,
                          MetricsWriter::Open((run_dir / "metrics.jsonl").string(),
                                              run->resume ? run->resume->step : -1));
    jsonl.emplace(std::move(writer));
  }
  TrainMetrics metrics(config, run->ctx, run->device, run->model->FlopsPerToken(),
                       run->trained->comm_stats(), std::move(jsonl));
  if (rank == 0 && !options.quiet) PrintStartLine(config, *run);

  // ===== the loop ===============================================================================
  int64_t state_bytes = 0;  // tensor bytes right after the last update: Note [Rank statistics]
  double optimizer_s = 0;   // StepOutput::optimizer_s summed (rank_stats' "offload")
  SkipGuard skips;
  EpochNote epoch_note;
  StepProfiler profiler(t.profile,
                        t.profile_dir.empty() ? run_dir / "profile" : std::filesystem::path(t.profile_dir),
                        run->device, rank);
  FSDP_RETURN_IF_ERROR(WithFailureClass(profiler.Prepare(), FailureClass::kIo));
  TermWatch term_watch(run->ctx->world());
  const std::pair<int, int64_t> nonfinite_at = GetRankAtStepKnob(kTestNonFinite);  // testing
  metrics.Start();
  for (int64_t step = run->start_step; step < t.steps; ++step) {
    const int64_t done = step + 1;
    FlightRecorder::Get().SetStep(done);  // names the step of a hung collective
    const double lr = LearningRate(config.lr_scheduler, config.optimizer.lr, step, t.steps);
    SetLearningRate(*run->optimizer, lr);
    profiler.BeforeStep(step);
    metrics.BeginStep();
    const int64_t epoch = run->loader->position().epoch;
    FSDP_ASSIGN_OR_RETURN(StepOutput out, TrainStep(*run, t, step,
                                                    nonfinite_at == std::pair{rank, done}));
    optimizer_s += out.optimizer_s;
    epoch_note.AfterStep(*run->loader, epoch, done, rank);
    absl::StatusOr<std::optional<std::string>> profiled = profiler.AfterStep(step);
    if (!profiled.ok()) return WithFailureClass(profiled.status(), FailureClass::kIo);
    if (*profiled && rank == 0) std::cout << **profiled << std::flush;
    if (out.skipped && rank == 0) FSDP_LOG_WARN("step {}: non-finite loss or gradient norm; update skipped", done);
    if (!out.skipped) state_bytes = DeviceAllocatedBytes(run->device);
    metrics.Record(out.loss, out.grad_norm,
                   t.on_nonfinite == OnNonFinite::kStop ? out.nonfinite : at::Tensor(), step, lr,
                   out.skipped);
    FSDP_RETURN_IF_ERROR(skips.Count(out.skipped, done));
    // See Note [SIGTERM at every step] (engine/term_watch.h): the same answer on every rank.
    const bool term_seen = term_watch.Poll(TermRequested());
    if (run->checkpointer) FSDP_RETURN_IF_ERROR(AsCheckpointFailure(run->checkpointer->PollBackgroundSave()));
    if (done < t.steps) FSDP_RETURN_IF_ERROR(SaveIfDue(config, *run, metrics, done, /*last=*/false));
    // An evaluation due between two log steps logs the interval so far with it; a stop logs
    // the steps since the last log before it saves.
    const bool eval_due = t.eval_interval > 0 && (done % t.eval_interval == 0 || done == t.steps);
    if (!metrics.ShouldLog(done) && !eval_due && !term_seen) continue;
    FSDP_ASSIGN_OR_RETURN(IntervalEnd end, metrics.Log(done, TermRequested()));
    if (end.first_nonfinite >= 0) return NonFiniteError(end.first_nonfinite);
    // SIGTERM during the last step: the run has finished; it ends as usual (saved, exit 0).
    if ((end.terminate || term_seen) && done < t.steps) {
      return SaveAndStop(config, *run, metrics, term_watch, done);
    }
    if (eval_due) {
      run->trained->BeforeEvaluate();
      FSDP_ASSIGN_OR_RETURN(double val_loss, Evaluate(*run->model, *run->loader, t.eval_batches,
                                                      run->ctx->world(), run->device));
      metrics.RecordEval(done, val_loss);
    }
  }

  // ===== the end: last checkpoint, statistics ===================================================
  term_watch.Drain();
  run->trained->FinishStep();  // an overlapped step's last units (Note [Overlapped host step])
  FSDP_RETURN_IF_ERROR(SaveIfDue(config, *run, metrics, t.steps, /*last=*/true));
  WriteStatistics(config, *run, metrics, options, optimizer_s, state_bytes);
  FSDP_RETURN_IF_ERROR(metrics.Finish(t.steps));
  run->ctx->world().Barrier()->wait();
  return absl::OkStatus();
}

}  // namespace fsdp
