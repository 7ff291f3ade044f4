#include "engine/run_setup.h"

#include <stdlib.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string_view>
#include <utility>
#include <vector>

#include <ATen/Context.h>
#include <fmt/format.h>
#include <torch/nn/module.h>

#include "checkpoint/format.h"
#include "common/failure.h"
#include "common/logging.h"
#include "common/status.h"
#include "common/strings.h"
#include "device_mesh/cuda_support.h"
#include "device_mesh/mesh_shape.h"
#include "engine/attention.h"
#include "engine/freeze.h"
#include "engine/optimizer.h"
#include "engine/same_config.h"
#include "engine/unwrapped.h"
#include "sharding/fsdp_model.h"
#include "sharding/memory_tracker.h"

namespace fsdp {

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

absl::Status AsCheckpointFailure(absl::Status s) {
  if (s.ok() || ClassifyFailure(s) != FailureClass::kError) return s;
  return WithFailureClass(std::move(s), FailureClass::kCheckpoint);
}

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

// A config error found after loading (it needs the device or the wrapped model), placed where
// its key was set, as the loader's own errors are ("configs/x.yaml:12: model.attention: ...").
absl::Status AtKey(const RunConfig& config, std::string_view key, absl::Status status) {
  if (status.ok()) return status;
  return absl::Status(status.code(), StrCat(config.Where(key), ": ", std::string(status.message())));
}

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


// The process group over every rank, the configuration checked against the world (and every
// rank's against rank 0's), and the mesh.
absl::Status JoinRun(const RunConfig& config, TrainingRun& run) {
  const TrainingSection& t = config.training;
  ConfigureHostAllocator(t.cpu_allocator == HostAllocator::kCaching);
  if (t.deterministic) ConfigureDeterminism();  // Note [Deterministic mode]
  FSDP_RETURN_IF_ERROR(CheckDeviceAvailable(config));
  FSDP_ASSIGN_OR_RETURN(run.ctx, DistContext::InitFromEnvironment(
                                     DistOptionsFor(t, config.parallelism, config.run.dir)));
  const int world = run.world();
  FSDP_RETURN_IF_ERROR(config.ValidateForWorld(world));
  FSDP_RETURN_IF_ERROR(CheckSameConfigOnEveryRank(config, *run.ctx, run.ctx->device()));
  const auto [replicate, shard] = config.parallelism.MeshDegrees(world);
  FSDP_ASSIGN_OR_RETURN(MeshShape shape,
                        ResolveMeshShape({"replicate", "shard"}, {replicate, shard}, world));
  FSDP_ASSIGN_OR_RETURN(DeviceMesh mesh, DeviceMesh::Create(run.ctx, shape));
  run.mesh.emplace(std::move(mesh));
  run.device = run.ctx->device();
  CpuMemoryTracker::Install();
  return absl::OkStatus();
}

// Rank 0's part of setting up run.dir: the folder, its lock (engine/run_lock.h), the checkpoint
// folder (found unusable now rather than by the first save, an interval of training later),
// config.yaml, and the resolved configuration printed.
absl::Status SetUpRunDirOnRankZero(const RunConfig& config, const TrainOptions& options,
                                   TrainingRun& run) {
  const std::filesystem::path run_dir(config.run.dir);
  std::error_code ec;
  std::filesystem::create_directories(run_dir, ec);
  if (ec) {
    return absl::FailedPreconditionError(StrCat("run.dir '", run_dir.string(), "': ", ec.message()));
  }
  FSDP_ASSIGN_OR_RETURN(run.run_lock, RunDirLock::Acquire(run_dir.string()));
  std::string yaml = config.ToYaml();
  if (config.metrics.print_config && !options.quiet) {
    std::cout << "fsdp train: resolved configuration (" << config.source_file << ")\n"
              << yaml << "\n";
  }
  if (config.checkpoint.enabled) {
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
                         /*sync_every_micro_batch=*/config.training.grad_sync == GradSync::kEvery,
                         config.parallelism.offload_delayed_update);
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

// The model from the registry (materialized whole or deferred to the shards), frozen as
// model.freeze says, wrapped, and its optimizer; model.attention chosen for the whole run.
absl::Status BuildModel(const RunConfig& config, TrainingRun& run) {
  const TrainingSection& t = config.training;
  run.attention = "none";
  if (config.model.arch != "mlp") {
    absl::StatusOr<AttentionBackend> backend =
        SelectAttentionBackend(config.model.attention, config.model,
                               ScalarTypeOf(t.mixed_precision), run.device, t.deterministic);
    FSDP_RETURN_IF_ERROR(AtKey(config, "model.attention", backend.status()));
    run.attention = AttentionBackendName(*backend);
  }
  run.model = FindModelFamily(config.model.arch)->build(config.model);
  Model& model = *run.model;
  for (auto& buffer : model.module()->buffers()) buffer.set_data(buffer.to(run.device));
  if (!config.model.deferred_init || config.parallelism.Unwrapped()) {
    model.MaterializeSeeded(static_cast<uint64_t>(config.run.seed));  // whole, then sharded
    model.module()->to(run.device);
  }
  // model.freeze: before wrapping, so that the units see which parameters train.
  FSDP_ASSIGN_OR_RETURN(FreezeSummary frozen,
                        FreezeParameters(*model.module(), config.model.freeze));
  if (run.rank() == 0 && frozen.frozen_params > 0) {
    std::cout << fmt::format(
        "fsdp train: model.freeze: {} parameter tensors ({} values) frozen, {} ({} values) "
        "train\n",
        frozen.frozen_params, frozen.frozen_numel, frozen.trainable_params, frozen.trainable_numel);
  }
  FSDP_ASSIGN_OR_RETURN(run.trained, WrapModel(config, model, *run.mesh));
  FSDP_RETURN_IF_ERROR(AtKey(config, "training.activation_checkpointing",
                             CheckSomeUnitIsCheckpointed(run.trained->fsdp(),
                                                         t.activation_checkpointing)));
  // Over the shards (host shards with offload: Note [CPU offload]); fused by default.
  run.optimizer = BuildOptimizer(config.optimizer, run.trained->parameters());
  return absl::OkStatus();
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

// The dataset and this rank's loader over it (every rank is a data-parallel rank: replicate x
// shard).
absl::Status OpenData(const RunConfig& config, TrainingRun& run) {
  absl::StatusOr<std::unique_ptr<TokenDataset>> opened = OpenDataset(
      config.data, config.model.vocab_size, static_cast<uint64_t>(config.run.seed));
  FSDP_RETURN_IF_ERROR(AsDataFailure(opened.status()));
  run.dataset = *std::move(opened);
  absl::StatusOr<DataLoader> created =
      DataLoader::Create(*run.dataset, LoaderOptionsFor(config, run.rank(), run.world()));
  FSDP_RETURN_IF_ERROR(AsDataFailure(created.status()));
  run.loader.emplace(*std::move(created));
  FSDP_RETURN_IF_ERROR(CheckEvaluation(config, *run.loader, run.world(), run.rank()));
  WarnAboutTheSchedule(config, run.rank());
  return absl::OkStatus();
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

// checkpoint.load: the checkpoint's state and data position (the sharded model's checkpointer;
// none for the unwrapped model, whose checkpoint.enabled the config refuses), or the
// parameters of model.init_from.
absl::Status LoadStart(const RunConfig& config, TrainingRun& run) {
  const auto load_start = std::chrono::steady_clock::now();
  if (FsdpModel* sharded = run.trained->fsdp()) {
    run.checkpointer.emplace(config, run.ctx, *run.mesh, *sharded, *run.optimizer);
    absl::StatusOr<std::optional<ResumePoint>> loaded = run.checkpointer->Load();
    if (!loaded.ok()) return WithFailureClass(loaded.status(), FailureClass::kCheckpoint);
    run.resume = *std::move(loaded);
  }
  if (run.resume) {
    run.start_step = run.resume->step;
    FSDP_RETURN_IF_ERROR(CheckResumePoint(config, *run.resume));
    run.loader->set_position(run.resume->data);
    if (run.rank() == 0) {
      WarnAboutOtherData(run.resume->data, *run.loader);
      std::cout << fmt::format(
          "fsdp train: resumed from {} at step {} (loaded in {:.2f} s)\n", run.resume->dir,
          run.start_step,
          std::chrono::duration<double>(std::chrono::steady_clock::now() - load_start).count());
    }
  } else if (!config.model.init_from.empty()) {
    if (absl::Status s = run.trained->InitFromSafetensors(config.model.init_from); !s.ok()) {
      return WithFailureClass(
          absl::Status(s.code(), StrCat("model.init_from: ", std::string(s.message()))),
          ClassifyFailure(s) == FailureClass::kError ? FailureClass::kCheckpoint
                                                     : ClassifyFailure(s));
    }
    if (run.rank() == 0) std::cout << "fsdp train: parameters from " << config.model.init_from << "\n";
  }
  return absl::OkStatus();
}

// Before the first save: the checkpoints of later steps an earlier run left are moved aside,
// and the saves' host buffers reserved.
absl::Status PrepareSaves(const TrainOptions& options, TrainingRun& run) {
  Checkpointer& checkpointer = *run.checkpointer;
  // Note [A run that goes back] (checkpoint/format.h): rank 0 commits and prunes, so moving
  // the later steps' checkpoints aside here comes before any of this run's commits. The
  // others learn whether it worked (one small all-reduce), as for run.dir.
  absl::StatusOr<std::vector<std::string>> moved = std::vector<std::string>();
  if (run.rank() == 0) moved = ckpt::SetAsideCheckpointsAfter(checkpointer.root(), run.start_step);
  FSDP_RETURN_IF_ERROR(AgreeWithRankZero(
      moved.status(), FailureClass::kCheckpoint,
      StrCat("move later checkpoints aside in ", checkpointer.root()), run.ctx->world(),
      run.device));
  if (run.rank() == 0 && !moved->empty()) {
    std::vector<std::string> names;
    for (const std::string& p : *moved) names.push_back(std::filesystem::path(p).filename());
    std::cout << fmt::format(
        "checkpoint: this run goes on from step {}; {} committed checkpoint(s) of later steps "
        "written by an earlier run ({}) moved to {} (load: latest and keep_latest_k no longer "
        "see them; delete them when they are not needed)\n",
        run.start_step, moved->size(), StrJoin(names, ", "),
        (std::filesystem::path(checkpointer.root()) / ckpt::kSupersededDir).string());
  }
  // Note [Checkpoint staging]: the saves' host buffers, page-locked here rather than by the
  // first save inside the loop.
  const auto reserve_start = std::chrono::steady_clock::now();
  const int64_t reserved = checkpointer.ReserveStaging();
  if (run.rank() == 0 && reserved > 0 && !options.quiet) {
    std::cout << fmt::format(
        "checkpoint: {} reserved in {:.2f} s\n",
        StagingLabel(reserved, checkpointer.staging_held_pinned_bytes()),
        std::chrono::duration<double>(std::chrono::steady_clock::now() - reserve_start).count());
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<TrainingRun>> SetUpRun(const RunConfig& config,
                                                       const TrainOptions& options) {
  auto run = std::make_unique<TrainingRun>();
  FSDP_RETURN_IF_ERROR(JoinRun(config, *run));
  // Rank 0 sets up the run folder; every rank learns whether that worked (one small
  // all-reduce), so that a bad run.dir is one clear error rather than rank 0's error and the
  // others waiting in the first collective until it times out.
  absl::Status dir = run->rank() == 0 ? SetUpRunDirOnRankZero(config, options, *run)
                                      : absl::OkStatus();
  FSDP_RETURN_IF_ERROR(AgreeWithRankZero(dir, FailureClass::kIo,
                                         StrCat("set up run.dir '", config.run.dir, "'"),
                                         run->ctx->world(), run->device));
  FSDP_RETURN_IF_ERROR(BuildModel(config, *run));
  FSDP_RETURN_IF_ERROR(OpenData(config, *run));
  FSDP_RETURN_IF_ERROR(LoadStart(config, *run));
  if (!run->complete(config) && run->checkpointer && run->checkpointer->enabled()) {
    FSDP_RETURN_IF_ERROR(PrepareSaves(options, *run));
  }
  return run;
}

}  // namespace fsdp
