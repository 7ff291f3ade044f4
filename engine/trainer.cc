#include "engine/trainer.h"

#include <stdlib.h>

#include <signal.h>
#include <unistd.h>

#include <csignal>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <utility>

#include <ATen/Context.h>
#include <ATen/record_function.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include "checkpoint/format.h"
#include "common/env_knobs.h"
#include "common/failure.h"
#include "common/logging.h"
#include "common/status.h"
#include "common/strings.h"
#include "device_mesh/cuda_support.h"
#include "device_mesh/device_mesh.h"
#include "device_mesh/torch_status.h"
#include "device_mesh/watchdog.h"
#include "engine/checkpointing.h"
#include "engine/data.h"
#include "engine/freeze.h"
#include "engine/metrics.h"
#include "engine/optimizer.h"
#include "engine/profiler.h"
#include "engine/run_lock.h"
#include "engine/same_config.h"
#include "engine/schedule.h"
#include "engine/train_metrics.h"
#include "engine/term_watch.h"
#include "engine/trainable.h"
#include "engine/unwrapped.h"
#include "models/model.h"
#include "sharding/comm_stats.h"
#include "sharding/fsdp_model.h"
#include "sharding/host_loops.h"
#include "sharding/memory_tracker.h"

namespace fsdp {
namespace {

using Clock = std::chrono::steady_clock;

volatile std::sig_atomic_t g_term = 0;
void OnTerm(int) { g_term = 1; }
void InstallTermHandler() {
  struct sigaction action {};
  action.sa_handler = OnTerm;
  sigemptyset(&action.sa_mask);
  sigaction(SIGTERM, &action, nullptr);
}
bool TermRequested() { return g_term != 0; }

// A data error (a file named by data.path, or a loader that cannot be built from the config)
// is a configuration error (exit 2), not a checkpoint's (kDataLoss's default class), except
// where the file could not be read at all (permissions: io; mmap: internal).
absl::Status AsDataFailure(absl::Status s) {
  if (s.ok() || s.code() == absl::StatusCode::kPermissionDenied ||
      s.code() == absl::StatusCode::kInternal) {
    return s;
  }
  return WithFailureClass(std::move(s), FailureClass::kConfig);
}

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

// Note [Rank statistics]
// At the end of a run every rank writes <run.dir>/rank_stats/rank<r>.json: its peak resident
// set (VmHWM), its peak tensor bytes (CPU tracker or CUDA allocator), the tensor bytes right
// after the last optimizer step (parameters, gradients and optimizer state, plus whatever
// the step keeps alive: the model states the ZeRO formulas count), the same model states
// counted tensor by tensor and split into device and host memory (model_state: what
// parallelism.offload moves; on a CPU both are host RAM, the split says which would be on a
// GPU; host_untouched_bytes: gradient buffers reserved but never written, which take no
// memory: Note [Gradients committed on demand] in sharding/offload.cc), and the collectives it
// issued (calls, bytes of the full buffers, seconds blocked waiting), and the model FLOPs per
// token and the device (its name and peak FLOP/s) behind the MFU figures. With offload,
// "offload" holds the host's share of the steps (docs/offload.md): optimizer_step_s, the
// optimizer step's wall time on the training thread (on the host there; with the step
// overlapped, Note [Overlapped host step], only preparing it: host_step_s is the step itself on
// the host's thread and step_wait_s what the next forwards waited for it), and
// HostOffload::Stats (copies' bytes, host waits and additions, offload params' cast of the
// masters after the step: refresh, evaluations included), each also per step. Rank 0's metrics.jsonl
// shows rank 0 only; `fsdp bench` reads these files for the maximum over ranks.
void WriteRankStats(const std::filesystem::path& run_dir, int rank, int64_t steps, int64_t peak_rss,
                    int64_t peak_tensor, int64_t state_bytes, const ModelStateBytes& model_state,
                    Offload offload, const CommStats& comm, double flops_per_token,
                    double peak_flops, const std::string& device,
                    const nlohmann::json& offload_stats) {
  nlohmann::json stats = {{"rank", rank},
                          {"steps", steps},
                          {"peak_rss_bytes", peak_rss},
                          {"peak_tensor_bytes", peak_tensor},
                          {"state_bytes", state_bytes},
                          {"model_state",
                           {{"device_bytes", model_state.device},
                            {"host_bytes", model_state.host},
                            {"host_untouched_bytes", model_state.host_untouched},
                            {"offload", OffloadName(offload)}}},
                          {"flops_per_token", flops_per_token},
                          {"peak_flops_per_device", peak_flops},
                          {"device", device}};
  const HostHeapStats heap = GetHostHeapStats();
  stats["host_heap"] = {{"held_bytes", heap.held_bytes}, {"free_bytes", heap.free_bytes}};
  if (!offload_stats.is_null()) stats["offload"] = offload_stats;
  double wait = 0;
  int64_t bytes = 0;
  for (int k = 0; k < kNumCommKinds; ++k) {
    const CommCounter& c = comm.Get(static_cast<CommKind>(k));
    stats["comm"][CommKindName(static_cast<CommKind>(k))] = {
        {"calls", c.calls}, {"bytes", c.bytes}, {"wait_s", c.wait_seconds}};
    wait += c.wait_seconds;
    bytes += c.bytes;
  }
  stats["comm_wait_s_total"] = wait;
  stats["comm_bytes_total"] = bytes;
  std::error_code ec;
  std::filesystem::create_directories(run_dir / "rank_stats", ec);
  std::ofstream(run_dir / "rank_stats" / fmt::format("rank{}.json", rank)) << stats.dump(1) << "\n";
}

absl::Status NonFiniteError(int64_t step) {
  return WithFailureClass(
      absl::FailedPreconditionError(StrCat(
          "step ", step, ": the loss or the gradient norm is not finite (NaN or inf); "
          "stopping. Lower optimizer.lr, or set training.on_nonfinite: skip")),
      FailureClass::kNonFinite);
}

// A config error found after loading (it needs the device or the wrapped model), placed where
// its key was set, as the loader's own errors are ("configs/x.yaml:12: model.attention: ...").
absl::Status AtKey(const RunConfig& config, std::string_view key, absl::Status status) {
  if (status.ok()) return status;
  return absl::Status(status.code(), StrCat(config.Where(key), ": ", std::string(status.message())));
}

// training.eval_interval needs a held-out batch: without one every evaluation was NaN, exit 0
// (data.val_fraction 0 is refused by the config's validation; this is a held-out part too
// small for one batch of dp x micro_batch windows). More eval_batches than there are use them
// all, said once.
absl::Status CheckEvaluation(const RunConfig& config, const DataLoader& loader, int world,
                             int rank) {
  const TrainingSection& t = config.training;
  if (t.eval_interval == 0) return absl::OkStatus();
  const int64_t per_batch = int64_t{world} * t.micro_batch_size;
  if (loader.num_val_batches() == 0) {
    return AtKey(
        config, "training.eval_interval",
        absl::InvalidArgumentError(StrCat(
            "training.eval_interval: ", t.eval_interval, " evaluates on the held-out part of "
            "the data, which has ", loader.num_val_windows(), " window(s) of model.seq_len ",
            config.model.seq_len, " (data.val_fraction ", config.data.val_fraction,
            "), fewer than one held-out batch of ", per_batch, " (", world,
            " rank(s) x training.micro_batch_size ", t.micro_batch_size,
            "); raise data.val_fraction, or set training.eval_interval: 0")));
  }
  if (rank == 0 && t.eval_batches > loader.num_val_batches()) {
    FSDP_LOG_WARN(
        "training.eval_batches {}: the held-out part has {} batch(es) of {} windows "
        "(data.val_fraction {}); each evaluation uses those {}",
        t.eval_batches, loader.num_val_batches(), per_batch, config.data.val_fraction,
        loader.num_val_batches());
  }
  return absl::OkStatus();
}

// A warm-up longer than the run leaves the learning rate below optimizer.lr throughout and
// never decays it: said once at start. The schedule stays as configured (shortening the
// warm-up would make a longer run resumed from this one follow another schedule).
void WarnAboutTheSchedule(const RunConfig& config, int rank) {
  const int64_t warmup = config.lr_scheduler.warmup_steps, steps = config.training.steps;
  if (rank != 0 || warmup <= steps) return;
  FSDP_LOG_WARN(
      "lr_scheduler.warmup_steps {} is longer than training.steps {}: the learning rate rises "
      "only to {:.3g} ({}/{} of optimizer.lr) and never decays",
      warmup, steps, config.optimizer.lr * static_cast<double>(steps) / static_cast<double>(warmup),
      steps, warmup);
}

// A resume on other data (another file, data.val_fraction or model.seq_len: another number of
// training windows) or another run.seed draws other epoch permutations, so the position no
// longer says which windows were trained on: the rest of the epoch may repeat some and skip
// others. Allowed (a second stage on new data), and said.
void WarnAboutOtherData(const DataPosition& saved, const DataLoader& loader) {
  const DataPosition now = loader.position();
  std::vector<std::string> changed;
  if (saved.train_windows > 0 && saved.train_windows != now.train_windows) {
    changed.push_back(StrCat(saved.train_windows, " training windows, now ", now.train_windows,
                             " (data.path, data.val_fraction or model.seq_len changed)"));
  }
  if (saved.train_windows > 0 && saved.seed != now.seed) {
    changed.push_back(StrCat("run.seed ", saved.seed, ", now ", now.seed));
  }
  if (changed.empty()) return;
  FSDP_LOG_WARN(
      "the checkpoint's data position (epoch {}) was taken with {}: the epochs' order differs, "
      "so the rest of this epoch may repeat windows trained on before the checkpoint and skip "
      "others",
      saved.epoch, StrJoin(changed, " and "));
}

// A checkpoint's step past training.steps ran no step and saved the checkpoint's state again
// as step training.steps, exit 0. (A data position that cannot be one is refused where
// metadata.json is read, Checkpointer::Load.)
absl::Status CheckResumePoint(const RunConfig& config, const ResumePoint& resume) {
  if (resume.step > config.training.steps) {
    return AtKey(
        config, "training.steps",
        absl::InvalidArgumentError(StrCat(
            "training.steps: ", config.training.steps, " is before the step of the checkpoint "
            "loaded (", resume.dir, ", step ", resume.step, "): nothing would train, and its "
            "state would be saved again as step ", config.training.steps,
            "; set training.steps > ", resume.step, ", or load an earlier checkpoint")));
  }
  return absl::OkStatus();
}

// training.activation_checkpointing that applies to no unit (every:k past the last unit, or a
// wrap policy that made no unit besides the root) would be a silent no-op: a config error.
absl::Status CheckSomeUnitIsCheckpointed(const FsdpModel* sharded,
                                         const ActivationCheckpointing& ac) {
  if (sharded == nullptr || ac.mode == ActivationCheckpointing::Mode::kNone) {
    return absl::OkStatus();
  }
  int units = 0;
  for (const FsdpUnit* u : sharded->units()) {
    if (u->is_root()) continue;
    if (sharded->IsCheckpointed(*u)) return absl::OkStatus();
    ++units;
  }
  const std::string what = ac.mode == ActivationCheckpointing::Mode::kSelective ? "selective"
                           : ac.every == 1 ? "full"
                                           : StrCat("every:", ac.every);
  if (units == 0) {
    return absl::InvalidArgumentError(StrCat(
        "training.activation_checkpointing: ", what, " has no unit to checkpoint: "
        "parallelism.wrap_policy made none besides the root (use the block policy, a smaller "
        "params:N, or activation_checkpointing: none)"));
  }
  return absl::InvalidArgumentError(StrCat(
      "training.activation_checkpointing: ", what, " checkpoints none of the model's ", units,
      " unit(s) (every:k checkpoints units k, 2k, ...); valid here: full, selective, every:1 to "
      "every:", units, ", or none"));
}

// A save's error, of class checkpoint unless it has a more specific one (a timeout waiting for
// a rank's shard, a write error's I/O class).
// Rank 0's outcome of a set-up step only it performs (`status`; OK on the other ranks), shared
// by one small all-reduce: rank 0 returns its error with class `c`, the others stop naming
// `what` rank 0 could not do, rather than wait in the first collective until it times out.
absl::Status AgreeWithRankZero(const absl::Status& status, FailureClass c, std::string_view what,
                               ProcessGroup& world, c10::Device device) {
  at::Tensor failed = at::full({1}, status.ok() ? 0.0 : 1.0,
                               at::TensorOptions().dtype(at::kDouble).device(device));
  world.AllReduce(failed)->wait();
  FSDP_RETURN_IF_ERROR(WithFailureClass(status, c));
  if (failed.item<double>() > 0) {
    return WithFailureClass(absl::FailedPreconditionError(StrCat(
                                "rank 0 could not ", what, " (rank 0's error says why)")),
                            FailureClass::kPeerLost);
  }
  return absl::OkStatus();
}

absl::Status AsCheckpointFailure(absl::Status s) {
  if (s.ok() || ClassifyFailure(s) != FailureClass::kError) return s;
  return WithFailureClass(std::move(s), FailureClass::kCheckpoint);
}

// Every rank learnt of a SIGTERM at the same step: the caller saved (a step already saved
// by the periodic cadence is not saved twice: Checkpointer::Save); stop with the preempted
// class (exit 143, Note [Exit codes]): the run did not finish, whichever ranks got the signal.
absl::Status StopOnTerm(std::optional<Checkpointer>& checkpointer, int64_t step, int64_t steps,
                        int rank) {
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

// Parameters, gradients and optimizer state after the last step, by where they live: the
// optimizer's state lives with the tensors it steps (host masters with offload).
ModelStateBytes ModelStateOf(const TrainableModel& trained, torch::optim::Optimizer& optimizer,
                             Offload offload) {
  ModelStateBytes bytes = trained.model_state_bytes();
  (offload == Offload::kNone ? bytes.device : bytes.host) += OptimizerStateBytes(optimizer);
  return bytes;
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

// `delayed`: the update may run through the next step (parallelism.offload_delayed_update).
// `poisoned`: FSDP_TEST_NONFINITE names this rank and step; its first loss becomes NaN.
absl::StatusOr<StepOutput> TrainStep(Model& model, TrainableModel& trained,
                                     torch::optim::Optimizer& optimizer, DataLoader& loader,
                                     const TrainingSection& t, c10::Device device, bool delayed,
                                     bool poisoned) {
  RECORD_FUNCTION("fsdp::train_step", std::vector<c10::IValue>());
  StepOutput out;
  out.loss = at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(device));
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
    // A delayed update still pending from the step before becomes visible now, as it would at
    // this step's update (Note [Delayed parameter update] in sharding/offload.h).
    if (delayed) trained.FinishStep();
    optimizer.zero_grad();
    out.skipped = true;
    return out;
  }
  {
    RECORD_FUNCTION("fsdp::optimizer_step", std::vector<c10::IValue>());
    const auto start = std::chrono::steady_clock::now();
    // See Note [Overlapped host step] (trainable.cc): with offload the step may overlap the
    // next forward; optimizer_s is then the time to prepare and queue it.
    const bool overlapped = trained.StepOverlapped(optimizer, delayed);
    if (!overlapped) optimizer.step();
    out.optimizer_s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (!overlapped) trained.AfterStep();
    optimizer.zero_grad();
  }
  return out;
}

// The model's FSDP units under parallelism.wrap_policy.
std::vector<std::shared_ptr<torch::nn::Module>> UnitModules(Model& model, const UnitPolicy& policy) {
  if (policy.kind == UnitPolicy::Kind::kBlock) return model.FsdpUnits();
  return SelectUnits(*model.module(), {.module_types = {}, .min_num_params = policy.min_params});
}

// The model wrapped as the config says: FSDP units over the mesh, or the unwrapped baseline.
absl::StatusOr<std::unique_ptr<TrainableModel>> WrapModel(const RunConfig& config, Model& model,
                                                          const DeviceMesh& mesh) {
  if (config.parallelism.Unwrapped()) {
    return std::unique_ptr<TrainableModel>(std::make_unique<UnwrappedModel>(
        model.module(), ScalarTypeOf(config.training.mixed_precision)));
  }
  FSDP_ASSIGN_OR_RETURN(ShardingPlan plan, ShardingPlanFor(config, *config.parallelism.strategy,
                                                           mesh.shape().degrees.back()));
  plan.options.param_init = model.ParamInit(static_cast<uint64_t>(config.run.seed));
  FSDP_ASSIGN_OR_RETURN(std::unique_ptr<FsdpModel> sharded,
                        FsdpModel::Wrap(model.module(), mesh,
                                        UnitModules(model, config.parallelism.wrap_policy),
                                        plan.options));
  return WrapForTraining(std::move(sharded),
                         /*sync_every_micro_batch=*/config.training.grad_sync == GradSync::kEvery);
}

DistOptions DistOptionsFor(const TrainingSection& t, const ParallelismSection& p,
                           const std::string& run_dir) {
  DistOptions dist;
  // A hung collective ends the rank naming it (device_mesh/watchdog.h).
  dist.watchdog = true;
  dist.collective_timeout = std::chrono::seconds(p.collective_timeout_s);
  dist.flight_dir = (std::filesystem::path(run_dir) / "flight").string();
  dist.device = DeviceKindName(t.device);
  dist.cuda_backend = p.backend == CudaBackend::kGloo ? "gloo" : "nccl";
  dist.cpu_collectives = CpuCollectivesName(p.cpu_collectives);
  return dist;
}

}  // namespace

absl::Status CheckDeviceAvailable(const RunConfig& config) {
  if (config.training.device != DeviceKind::kCuda || CudaDeviceCount() > 0) {
    return absl::OkStatus();
  }
  const bool nccl = config.parallelism.backend == CudaBackend::kNccl;
  return absl::FailedPreconditionError(
      StrCat("training.device is cuda (",
             config.source_file.empty() ? "the configuration" : config.source_file,
             ") but no GPU was found", IsCudaBuild() ? "" : " (and this fsdp is a CPU-only build)",
             "; to train on the CPU set training.device=cpu",
             nccl ? " and parallelism.backend=gloo (nccl needs GPUs)" : "",
             " (e.g. --set training.device=cpu", nccl ? " --set parallelism.backend=gloo" : "",
             "), or training.device=auto to use a GPU when "
             "there is one"));
}

namespace {

// Note [Deterministic mode]
// training.deterministic: a run repeated gives the same bits on CUDA as well. CPU runs already
// do (fixed reduction orders in the kernels, in Gloo's and in our own collectives); on a GPU the
// differences come from kernels that accumulate with atomics or pick algorithms by timing.
// Set before any CUDA work:
//   - CUBLAS_WORKSPACE_CONFIG=:4096:8 (cuBLAS's documented requirement for reproducible GEMMs;
//     not overridden when the environment already sets it);
//   - ATen's deterministic algorithms: an op without a deterministic implementation is an error
//     naming it, not a silent difference (warn_only false);
//   - cuDNN deterministic, autotuning (benchmark) off;
//   - scaled-dot-product attention restricted to flash and math: the memory-efficient and cuDNN
//     backends' backward passes accumulate with atomics; flash's backward follows the
//     deterministic flag (attention_backward.cu asks FlashAttention for its deterministic
//     backward when deterministic algorithms are on and warn_only is off, as here);
//   - no fill of uninitialized memory: deterministic algorithms make every at::empty write NaN
//     (ints: their maximum) by default, one extra kernel per allocation (each gather buffer and
//     activation). The engine reads nothing it has not written (padding rows are zeroed, a
//     collective writes its whole output), so the fill buys nothing here; torchtitan turns it
//     off too. (TrainTest.DeterministicModeRunsAndRepeatsBitwise compares repeated runs'
//     bits; a read of uninitialized memory could, not must, break it.)
// NCCL's reductions are deterministic for a fixed world size and message sizes (its algorithm
// choice depends on nothing else); the mode does not pin NCCL_ALGO. The cost on a GPU is not
// measured yet (docs/benchmarks.md lists it with the GPU figures still to take).
void ConfigureDeterminism() {
  setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8", /*overwrite=*/0);
  at::Context& context = at::globalContext();
  context.setDeterministicAlgorithms(true, /*warn_only=*/false);
  context.setDeterministicFillUninitializedMemory(false);
  context.setDeterministicCuDNN(true);
  context.setBenchmarkCuDNN(false);
  context.setSDPUseMemEfficient(false);
  context.setSDPUseCuDNN(false);
}

// model.kernels as it resolves on `device`, "(auto)" after it when the config left the choice.
std::string KernelsLabel(KernelMode mode, c10::Device device) {
  const char* resolved = KernelModeName(ResolveKernelMode(mode, device.is_cuda()));
  return mode == KernelMode::kAuto ? StrCat(resolved, " (auto)") : resolved;
}

}  // namespace

absl::Status Train(const RunConfig& config, const TrainOptions& options) {
  // ===== setup: rendezvous, mesh, run folder ====================================================
  const TrainingSection& t = config.training;
  ConfigureHostAllocator(t.cpu_allocator == HostAllocator::kCaching);
  if (t.deterministic) ConfigureDeterminism();  // Note [Deterministic mode]
  FSDP_RETURN_IF_ERROR(CheckDeviceAvailable(config));
  FSDP_ASSIGN_OR_RETURN(std::shared_ptr<DistContext> ctx,
                        DistContext::InitFromEnvironment(
                            DistOptionsFor(t, config.parallelism, config.run.dir)));
  const int rank = ctx->rank();
  const int world = ctx->world_size();
  FSDP_RETURN_IF_ERROR(config.ValidateForWorld(world));
  FSDP_RETURN_IF_ERROR(CheckSameConfigOnEveryRank(config, *ctx, ctx->device()));
  const auto [replicate, shard] = config.parallelism.MeshDegrees(world);
  FSDP_ASSIGN_OR_RETURN(MeshShape shape,
                        ResolveMeshShape({"replicate", "shard"}, {replicate, shard}, world));
  FSDP_ASSIGN_OR_RETURN(DeviceMesh mesh, DeviceMesh::Create(ctx, shape));
  const c10::Device device = ctx->device();
  CpuMemoryTracker::Install();
  std::filesystem::path run_dir(config.run.dir);
  // Rank 0 sets up the run folder and holds its lock (engine/run_lock.h); every rank learns
  // whether that worked (one small all-reduce), so that a bad run.dir is one clear error
  // rather than rank 0's error and the others waiting in the first collective until it times
  // out.
  std::unique_ptr<RunDirLock> run_lock;
  absl::Status setup = absl::OkStatus();
  if (rank == 0) {
    setup = [&]() -> absl::Status {
      std::error_code ec;
      std::filesystem::create_directories(run_dir, ec);
      if (ec) {
        return absl::FailedPreconditionError(StrCat("run.dir '", run_dir.string(), "': ", ec.message()));
      }
      FSDP_ASSIGN_OR_RETURN(run_lock, RunDirLock::Acquire(run_dir.string()));
      std::string yaml = config.ToYaml();
      if (config.metrics.print_config && !options.quiet) {
        std::cout << "fsdp train: resolved configuration (" << config.source_file << ")\n"
                  << yaml << "\n";
      }
      if (config.checkpoint.enabled) {
        // A checkpoint folder that cannot be one is found now rather than by the first save,
        // an interval of training later.
        const std::string root = CheckpointRoot(config);
        const char* key = config.checkpoint.dir.empty() ? "run.dir" : "checkpoint.dir";
        std::filesystem::create_directories(root, ec);
        if (ec || !std::filesystem::is_directory(root) || ::access(root.c_str(), W_OK) != 0) {
          return absl::FailedPreconditionError(StrCat(
              key, ": the checkpoint folder '", root, "' ",
              ec ? StrCat("cannot be created: ", ec.message())
                 : !std::filesystem::is_directory(root) ? std::string("is not a folder")
                                                        : std::string("is not writable"),
              "; set checkpoint.dir to a writable folder, or checkpoint.enabled: false"));
        }
      }
      std::ofstream out(run_dir / "config.yaml");
      if (!(out << yaml).flush()) {
        return absl::FailedPreconditionError(
            StrCat("run.dir '", run_dir.string(), "': cannot write config.yaml"));
      }
      return absl::OkStatus();
    }();
  }
  FSDP_RETURN_IF_ERROR(AgreeWithRankZero(setup, FailureClass::kIo,
                                         StrCat("set up run.dir '", run_dir.string(), "'"),
                                         ctx->world(), device));

  // ===== model (from the registry), wrapped, and its optimizer ==================================
  // model.attention: one SDPA backend for the whole run, chosen here (engine/attention.h).
  std::string attention = "none";
  if (config.model.arch != "mlp") {
    absl::StatusOr<AttentionBackend> backend =
        SelectAttentionBackend(config.model.attention, config.model,
                               ScalarTypeOf(t.mixed_precision), device, t.deterministic);
    FSDP_RETURN_IF_ERROR(AtKey(config, "model.attention", backend.status()));
    attention = AttentionBackendName(*backend);
  }
  std::unique_ptr<Model> model = FindModelFamily(config.model.arch)->build(config.model);
  for (auto& buffer : model->module()->buffers()) buffer.set_data(buffer.to(device));
  if (!config.model.deferred_init || config.parallelism.Unwrapped()) {
    model->MaterializeSeeded(static_cast<uint64_t>(config.run.seed));  // whole, then sharded
    model->module()->to(device);
  }
  // model.freeze: before wrapping, so that the units see which parameters train.
  FSDP_ASSIGN_OR_RETURN(FreezeSummary frozen,
                        FreezeParameters(*model->module(), config.model.freeze));
  if (rank == 0 && frozen.frozen_params > 0) {
    std::cout << fmt::format(
        "fsdp train: model.freeze: {} parameter tensors ({} values) frozen, {} ({} values) "
        "train\n",
        frozen.frozen_params, frozen.frozen_numel, frozen.trainable_params, frozen.trainable_numel);
  }
  FSDP_ASSIGN_OR_RETURN(std::unique_ptr<TrainableModel> trained, WrapModel(config, *model, mesh));
  FSDP_RETURN_IF_ERROR(AtKey(config, "training.activation_checkpointing",
                             CheckSomeUnitIsCheckpointed(trained->fsdp(),
                                                         t.activation_checkpointing)));
  // Over the shards (host shards with offload: Note [CPU offload]); fused by default.
  std::unique_ptr<torch::optim::Optimizer> optimizer =
      BuildOptimizer(config.optimizer, trained->parameters());

  // ===== data ===================================================================================
  absl::StatusOr<std::unique_ptr<TokenDataset>> opened = OpenDataset(
      config.data, config.model.vocab_size, static_cast<uint64_t>(config.run.seed));
  FSDP_RETURN_IF_ERROR(AsDataFailure(opened.status()));
  std::unique_ptr<TokenDataset> dataset = *std::move(opened);
  // Every rank is a data-parallel rank (replicate x shard).
  absl::StatusOr<DataLoader> created =
      DataLoader::Create(*dataset, LoaderOptionsFor(config, rank, world));
  FSDP_RETURN_IF_ERROR(AsDataFailure(created.status()));
  DataLoader loader = *std::move(created);
  FSDP_RETURN_IF_ERROR(CheckEvaluation(config, loader, world, rank));
  WarnAboutTheSchedule(config, rank);

  // ===== checkpoint: resume, or start from a safetensors file ===================================
  // (checkpoint.enabled is false for the unwrapped model: config validation.)
  std::optional<Checkpointer> checkpointer;
  std::optional<ResumePoint> resume;
  auto load_start = std::chrono::steady_clock::now();
  if (FsdpModel* sharded = trained->fsdp()) {
    checkpointer.emplace(config, ctx, mesh, *sharded, *optimizer);
    absl::StatusOr<std::optional<ResumePoint>> loaded = checkpointer->Load();
    if (!loaded.ok()) return WithFailureClass(loaded.status(), FailureClass::kCheckpoint);
    resume = *std::move(loaded);
  }
  int64_t start_step = 0;
  if (resume) {
    start_step = resume->step;
    FSDP_RETURN_IF_ERROR(CheckResumePoint(config, *resume));
    loader.set_position(resume->data);
    if (rank == 0) WarnAboutOtherData(resume->data, loader);
    if (rank == 0) {
      std::cout << fmt::format(
          "fsdp train: resumed from {} at step {} (loaded in {:.2f} s)\n", resume->dir, start_step,
          std::chrono::duration<double>(std::chrono::steady_clock::now() - load_start).count());
    }
    if (start_step == t.steps) {
      // The run is complete: no step to train, so no "final loss nan" and no second save of
      // the step just loaded.
      if (rank == 0) {
        std::cout << fmt::format(
            "fsdp train: done: the checkpoint loaded is at step {}, which is training.steps; "
            "nothing left to train (raise training.steps to continue)\n",
            start_step);
      }
      // As at the end of a run: rank 0 may host the store the others' watchdogs still use.
      ctx->world().Barrier()->wait();
      return absl::OkStatus();
    }
  } else if (!config.model.init_from.empty()) {
    if (absl::Status s = trained->InitFromSafetensors(config.model.init_from); !s.ok()) {
      return WithFailureClass(
          absl::Status(s.code(), StrCat("model.init_from: ", std::string(s.message()))),
          ClassifyFailure(s) == FailureClass::kError ? FailureClass::kCheckpoint
                                                     : ClassifyFailure(s));
    }
    if (rank == 0) std::cout << "fsdp train: parameters from " << config.model.init_from << "\n";
  }
  if (checkpointer && checkpointer->enabled()) {
    // Note [A run that goes back] (checkpoint/format.h): rank 0 commits and prunes, so moving
    // the later steps' checkpoints aside here comes before any of this run's commits. The
    // others learn whether it worked (one small all-reduce), as for run.dir above.
    absl::StatusOr<std::vector<std::string>> moved = std::vector<std::string>();
    if (rank == 0) moved = ckpt::SetAsideCheckpointsAfter(checkpointer->root(), start_step);
    FSDP_RETURN_IF_ERROR(AgreeWithRankZero(
        moved.status(), FailureClass::kCheckpoint,
        StrCat("move later checkpoints aside in ", checkpointer->root()), ctx->world(), device));
    if (rank == 0 && !moved->empty()) {
      std::vector<std::string> names;
      for (const std::string& p : *moved) names.push_back(std::filesystem::path(p).filename());
      std::cout << fmt::format(
          "checkpoint: this run goes on from step {}; {} committed checkpoint(s) of later steps "
          "written by an earlier run ({}) moved to {} (load: latest and keep_latest_k no longer "
          "see them; delete them when they are not needed)\n",
          start_step, moved->size(), StrJoin(names, ", "),
          (std::filesystem::path(checkpointer->root()) / ckpt::kSupersededDir).string());
    }
    // Note [Checkpoint staging]: the saves' host buffers, page-locked here rather than by the
    // first save inside the loop.
    auto reserve_start = std::chrono::steady_clock::now();
    const int64_t reserved = checkpointer->ReserveStaging();
    if (rank == 0 && reserved > 0 && !options.quiet) {
      std::cout << fmt::format(
          "checkpoint: {} reserved in {:.2f} s\n",
          StagingLabel(reserved, checkpointer->staging_held_pinned_bytes()),
          std::chrono::duration<double>(std::chrono::steady_clock::now() - reserve_start).count());
    }
  }
  InstallTermHandler();

  std::optional<MetricsWriter> jsonl;
  if (rank == 0 && config.metrics.jsonl) {
    FSDP_ASSIGN_OR_RETURN(MetricsWriter writer,
                          MetricsWriter::Open((run_dir / "metrics.jsonl").string(),
                                              resume ? resume->step : -1));
    jsonl.emplace(std::move(writer));
  }
  TrainMetrics metrics(config, ctx, device, model->FlopsPerToken(), trained->comm_stats(),
                       std::move(jsonl));
  if (rank == 0 && !options.quiet) {
    std::cout << fmt::format(
        "fsdp train: {} on {} rank(s), mesh {}, strategy {}, model {} ({} parameters, {:.3g} "
        "FLOPs/token), data {}, {} tokens/step, attention {}, kernels {}\n",
        config.run.name, world, shape.ToString(), StrategyLabel(config.parallelism.strategy),
        config.model.arch, model->NumParameters(), model->FlopsPerToken(), dataset->Describe(),
        world * t.micro_batch_size * t.grad_accum_steps * config.model.seq_len, attention,
        KernelsLabel(config.model.kernels, device));
    if (const FsdpModel* sharded = trained->fsdp();
        sharded != nullptr && sharded->offload_compute_copy()) {
      const ComputeCopyChoice& copy = *sharded->offload_compute_copy();
      std::cout << fmt::format(
          "fsdp train: offload params {} a {} copy of each shard on the host ({})
",
          copy.keep ? "keeps" : "keeps no", PrecisionName(t.mixed_precision), copy.reason);
    }
    std::cout.flush();
  }

  // The checkpoint cadence (Checkpointer::MaybeSave), each save noted in metrics.jsonl.
  // Note [Non-finite state is never saved]: with on_nonfinite: stop, a non-finite step
  // updated the parameters with NaN/inf, and the flag is only read at the log interval; a
  // checkpoint due in between would commit that state and prune good ones. So each save first
  // reads every rank's flag (one tiny all-reduce per save, none per step) and stops instead.
  // With skip, non-finite steps never update, so the state stays finite.
  auto maybe_save = [&](int64_t step, bool last) -> absl::Status {
    if (!checkpointer || !checkpointer->Due(step, last)) return absl::OkStatus();
    if (t.on_nonfinite == OnNonFinite::kStop) {
      if (int64_t bad = metrics.FirstNonFiniteOnAnyRank(); bad >= 0) {
        FSDP_RETURN_IF_ERROR(checkpointer->Finish());  // an earlier, finite save may be in flight
        return WithFailureClass(absl::FailedPreconditionError(
            StrCat(std::string(NonFiniteError(bad).message()), "; the checkpoint of step ", step,
                   " was not saved (the newest checkpoint holds the last finite state)")),
            FailureClass::kNonFinite);
      }
    }
    absl::StatusOr<bool> saved = checkpointer->MaybeSave(step, last, loader.position());
    if (!saved.ok()) return AsCheckpointFailure(saved.status());
    if (*saved) metrics.RecordCheckpoint(step, checkpointer->last_blocking_seconds());
    return absl::OkStatus();
  };

  // ===== the loop ===============================================================================
  int64_t state_bytes = 0;  // model states right after the last update: Note [Rank statistics]
  constexpr int kMaxConsecutiveSkips = 10;
  int consecutive_skips = 0;
  bool epoch_noted = false;  // the first wrap to another epoch is noted, once
  double optimizer_s = 0;    // StepOutput::optimizer_s summed (rank_stats' "offload")
  StepProfiler profiler(t.profile,
                        t.profile_dir.empty() ? run_dir / "profile" : std::filesystem::path(t.profile_dir),
                        device, rank);
  FSDP_RETURN_IF_ERROR(WithFailureClass(profiler.Prepare(), FailureClass::kIo));
  TermWatch term_watch(ctx->world());
  const std::pair<int, int64_t> nonfinite_at = GetRankAtStepKnob(kTestNonFinite);  // testing
  metrics.Start();
  for (int64_t step = start_step; step < t.steps; ++step) {
    const int64_t done = step + 1;
    FlightRecorder::Get().SetStep(done);  // names the step of a hung collective
    const double lr = LearningRate(config.lr_scheduler, config.optimizer.lr, step, t.steps);
    SetLearningRate(*optimizer, lr);
    profiler.BeforeStep(step);
    metrics.BeginStep();
    const int64_t epoch = loader.position().epoch;
    // See Note [Delayed parameter update] (sharding/offload.h).
    const bool delayed = config.parallelism.offload_delayed_update.At(step);
    const bool poisoned = nonfinite_at == std::pair<int, int64_t>{rank, done};
    FSDP_ASSIGN_OR_RETURN(StepOutput out, TrainStep(*model, *trained, *optimizer, loader, t,
                                                    device, delayed, poisoned));
    optimizer_s += out.optimizer_s;
    if (rank == 0 && loader.position().epoch > epoch && !epoch_noted) {
      std::cout << fmt::format(
          "fsdp train: step {} finished epoch {} of the training data ({} steps of {} windows); "
          "later epochs see the same windows again, reshuffled (not noted again)\n",
          done, epoch + 1, loader.batches_per_epoch(), loader.global_batch());
      epoch_noted = true;
    }
    absl::StatusOr<std::optional<std::string>> profiled = profiler.AfterStep(step);
    if (!profiled.ok()) return WithFailureClass(profiled.status(), FailureClass::kIo);
    const std::optional<std::string>& profile_summary = *profiled;
    if (profile_summary && rank == 0) std::cout << *profile_summary << std::flush;
    if (out.skipped && rank == 0) FSDP_LOG_WARN("step {}: non-finite loss or gradient norm; update skipped", done);
    if (!out.skipped) state_bytes = DeviceAllocatedBytes(device);
    metrics.Record(out.loss, out.grad_norm,
                   t.on_nonfinite == OnNonFinite::kStop ? out.nonfinite : at::Tensor(), step, lr,
                   out.skipped);
    // Skipping keeps a run alive through a rare bad batch; a run whose every update is skipped
    // has diverged and would otherwise "finish" without learning (skipped is known on the host
    // in skip mode, and identical on every rank: the norm is global).
    consecutive_skips = out.skipped ? consecutive_skips + 1 : 0;
    if (consecutive_skips >= kMaxConsecutiveSkips) {
      return WithFailureClass(absl::FailedPreconditionError(StrCat(
          "steps ", done - consecutive_skips + 1, "-", done, ": ", consecutive_skips,
          " updates in a row skipped (non-finite loss or gradient norm): training diverged; "
          "lower optimizer.lr, or check the data")), FailureClass::kNonFinite);
    }
    // See Note [SIGTERM at every step] (engine/term_watch.h): the same answer on every rank.
    const bool term_seen = term_watch.Poll(TermRequested());
    if (checkpointer) FSDP_RETURN_IF_ERROR(AsCheckpointFailure(checkpointer->PollBackgroundSave()));
    if (done < t.steps) FSDP_RETURN_IF_ERROR(maybe_save(done, /*last=*/false));
    // An evaluation due between two log steps logs the interval so far with it (it ran only at
    // log steps, so with eval_interval 25 and log_interval 10 every other one was skipped).
    const bool eval_due =
        t.eval_interval > 0 && (done % t.eval_interval == 0 || done == t.steps);
    // A stop logs the steps since the last log before it saves.
    if (!metrics.ShouldLog(done) && !eval_due && !term_seen) continue;
    FSDP_ASSIGN_OR_RETURN(IntervalEnd end, metrics.Log(done, TermRequested()));
    if (end.first_nonfinite >= 0) return NonFiniteError(end.first_nonfinite);
    // SIGTERM during the last step: the run has finished; it ends as usual (saved, exit 0).
    if ((end.terminate || term_seen) && done < t.steps) {
      term_watch.Drain();
      if (checkpointer && checkpointer->enabled()) {
        FSDP_RETURN_IF_ERROR(maybe_save(done, /*last=*/true));
        // Rank 0 commits after the others have written their shards: they wait for it here,
        // since the launcher stops the group soon after the first rank exits 143.
        at::Tensor committed = at::zeros({1}, at::TensorOptions().device(device));
        ctx->world().AllReduce(committed)->wait();
      }
      return StopOnTerm(checkpointer, done, t.steps, rank);
    }
    if (eval_due) {
      // A delayed update is visible to evaluations (and to the steps after them).
      if (config.parallelism.offload_delayed_update.enabled) trained->FinishStep();
      FSDP_ASSIGN_OR_RETURN(double val_loss,
                            Evaluate(*model, loader, t.eval_batches, ctx->world(), device));
      metrics.RecordEval(done, val_loss);
    }
  }

  // ===== the end: last checkpoint, statistics ===================================================
  term_watch.Drain();
  trained->FinishStep();  // an overlapped step's last units (Note [Overlapped host step])
  FSDP_RETURN_IF_ERROR(maybe_save(t.steps, /*last=*/true));
  const ModelStateBytes model_state =
      ModelStateOf(*trained, *optimizer, config.parallelism.offload);
  nlohmann::json offload_stats;
  if (trained->fsdp() != nullptr && trained->fsdp()->context().offload != nullptr) {
    const HostOffload::Stats& o = trained->fsdp()->context().offload->stats();
    const double steps = std::max<int64_t>(1, t.steps - start_step);
    offload_stats = {{"optimizer_step_s", optimizer_s},
                     {"to_host_bytes", o.to_host_bytes},
                     {"to_host_compute_bytes", o.to_host_compute_bytes},
                     {"to_device_bytes", o.to_device_bytes},
                     {"host_adds", o.host_adds},
                     {"late_adds", o.late_adds},
                     {"wait_s", o.wait_s},
                     {"add_s", o.add_s},
                     {"clip_term_s", o.clip_term_s},
                     {"push_s", o.push_s},
                     {"refresh_s", o.refresh_s},
                     {"host_step_s", o.host_step_s},
                     {"step_wait_s", o.step_wait_s},
                     {"overlapped_steps", o.overlapped_steps},
                     {"deferred_steps", o.deferred_steps},
                     {"deferred_materialized", o.deferred_materialized},
                     {"host_passes", o.host_passes},
                     {"host_add_passes", o.host_add_passes},
                     {"clip_multiplies_deferred", o.clip_multiplies_deferred},
                     {"clip_terms_on_adder", o.clip_terms_on_adder},
                     {"delayed_steps", o.delayed_steps}};
    // Each total per step; seconds as milliseconds (x_s -> x_ms).
    nlohmann::json& per_step = offload_stats["per_step"];
    for (const auto& [key, value] : offload_stats.items()) {
      if (key == "per_step") continue;
      const bool seconds = key.size() > 2 && key.compare(key.size() - 2, 2, "_s") == 0;
      per_step[seconds ? key.substr(0, key.size() - 2) + "_ms" : key] =
          (seconds ? 1e3 : 1.0) * value.get<double>() / steps;
    }
    offload_stats["host_threads"] = HostLoopThreads();  // the one loops' (Note [Host loops])
  }
  WriteRankStats(run_dir, rank, t.steps - start_step, ProcessPeakRssBytes(),
                 DevicePeakBytes(device), state_bytes, model_state, config.parallelism.offload,
                 trained->comm_stats(), model->FlopsPerToken(), metrics.peak_flops(),
                 device.is_cuda() ? CudaDeviceDescription(device.index()) : "cpu",
                 offload_stats);
  if (rank == 0 && trained->fsdp() != nullptr && !options.quiet) {
    std::cout << fmt::format(
        "fsdp train: model state on rank 0 (parameters, gradients, optimizer): {:.2f} MiB on the "
        "device, {:.2f} MiB in host memory (parallelism.offload: {}){}\n",
        model_state.device / 1048576.0, model_state.host / 1048576.0,
        OffloadName(config.parallelism.offload),
        model_state.host_untouched > 0
            ? fmt::format("; {:.2f} MiB of gradient buffers reserved on the host and never "
                          "written take none",
                          model_state.host_untouched / 1048576.0)
            : "");
  }
  FSDP_RETURN_IF_ERROR(metrics.Finish(t.steps));
  ctx->world().Barrier()->wait();
  return absl::OkStatus();
}

}  // namespace fsdp
