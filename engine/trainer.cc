#include "engine/trainer.h"

#include <signal.h>
#include <unistd.h>

#include <csignal>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>

#include <torch/nn/functional/loss.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include "common/logging.h"
#include "common/status.h"
#include "common/strings.h"
#include "device_mesh/cuda_support.h"
#include "device_mesh/device_mesh.h"
#include "device_mesh/torch_status.h"
#include "engine/checkpointing.h"
#include "engine/data.h"
#include "engine/metrics.h"
#include "engine/schedule.h"
#include "engine/unwrapped.h"
#include "models/gpt.h"
#include "sharding/fsdp_model.h"
#include "sharding/comm_stats.h"
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

c10::ScalarType Dtype(const std::string& name) { return name == "bf16" ? at::kBFloat16 : at::kFloat; }

absl::StatusOr<FsdpOptions> ShardingOptions(const RunConfig& config, const GptImpl& model) {
  const ParallelismSection& p = config.parallelism;
  FSDP_ASSIGN_OR_RETURN(Strategy strategy, ParseStrategy(p.strategy));
  FsdpOptions options = OptionsForStrategy(strategy);
  if (p.reshard_after_forward == "true") options.reshard_after_forward = true;
  if (p.reshard_after_forward == "false") options.reshard_after_forward = false;
  if (std::optional<int> k = ParseInt(p.reshard_after_forward)) {
    options.reshard_after_forward = true;
    options.reshard_group_size = *k;
  }
  options.max_unsharded_units = static_cast<int>(p.max_unsharded_units);
  if (config.training.mixed_precision == "bf16") {
    options.mixed_precision.param_dtype = at::kBFloat16;
    options.mixed_precision.output_dtype = at::kFloat;
  }
  options.mixed_precision.reduce_dtype = Dtype(config.training.reduce_dtype);
  options.param_init = model.ParamInit(static_cast<uint64_t>(config.run.seed));
  return options;
}

std::vector<std::shared_ptr<torch::nn::Module>> Units(GptImpl& model, const std::string& policy) {
  if (policy == "block") return model.FsdpUnits();
  int64_t min_params = ParseInt<int64_t>(policy.substr(policy.find(':') + 1)).value_or(1);
  return SelectUnits(model, {.module_types = {}, .min_num_params = min_params});
}

std::unique_ptr<torch::optim::Optimizer> MakeOptimizer(const OptimizerSection& o,
                                                       std::vector<at::Tensor> params) {
  if (o.name == "sgd") {
    return std::make_unique<torch::optim::SGD>(
        params, torch::optim::SGDOptions(o.lr).momentum(o.momentum).weight_decay(o.weight_decay));
  }
  if (o.name == "adam") {
    return std::make_unique<torch::optim::Adam>(
        params, torch::optim::AdamOptions(o.lr).betas({o.beta1, o.beta2}).eps(o.eps)
                    .weight_decay(o.weight_decay));
  }
  return std::make_unique<torch::optim::AdamW>(
      params, torch::optim::AdamWOptions(o.lr).betas({o.beta1, o.beta2}).eps(o.eps)
                  .weight_decay(o.weight_decay));
}

void SetLearningRate(torch::optim::Optimizer& opt, double lr) {
  for (auto& group : opt.param_groups()) group.options().set_lr(lr);
}

// Evaluation on the held-out part: mean loss over eval_batches batches, averaged over ranks.
double Evaluate(GptImpl& model, const DataLoader& loader, int64_t batches, ProcessGroup& world,
                c10::Device device) {
  torch::NoGradGuard no_grad;
  int64_t n = std::min(batches, loader.num_val_batches());
  at::Tensor sum = at::zeros({}, at::TensorOptions().dtype(at::kDouble).device(device));
  for (int64_t i = 0; i < n; ++i) {
    Batch b = loader.ValBatch(i);
    at::Tensor logits = model.forward(b.inputs.to(device));
    sum += torch::nn::functional::cross_entropy(logits.flatten(0, 1).to(at::kFloat),
                                                b.targets.to(device).flatten())
               .to(at::kDouble);
  }
  world.AllReduce(sum)->wait();
  return n > 0 ? sum.item<double>() / (n * world.size()) : std::nan("");
}

// Note [Rank statistics]
// At the end of a run every rank writes <run.dir>/rank_stats/rank<r>.json: its peak resident
// set (VmHWM), its peak tensor bytes (CPU tracker or CUDA allocator), the tensor bytes right
// after the last optimizer step (parameters, gradients and optimizer state, plus whatever
// the step keeps alive: the model states the ZeRO formulas count), and the collectives it
// issued (calls, bytes of the full buffers, seconds blocked waiting), and the model FLOPs per
// token and the device (its name and peak FLOP/s) behind the MFU figures. Rank 0's metrics.jsonl
// shows rank 0 only; `fsdp bench` reads these files for the maximum over ranks.
void WriteRankStats(const std::filesystem::path& run_dir, int rank, int64_t steps,
                    int64_t peak_rss, int64_t peak_tensor, int64_t state_bytes,
                    const CommStats& comm, double flops_per_token, double peak_flops,
                    const std::string& device) {
  nlohmann::json stats = {{"rank", rank},
                          {"steps", steps},
                          {"peak_rss_bytes", peak_rss},
                          {"peak_tensor_bytes", peak_tensor},
                          {"state_bytes", state_bytes},
                          {"flops_per_token", flops_per_token},
                          {"peak_flops_per_device", peak_flops},
                          {"device", device}};
  const HostHeapStats heap = GetHostHeapStats();
  stats["host_heap"] = {{"held_bytes", heap.held_bytes}, {"free_bytes", heap.free_bytes}};
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

}  // namespace

absl::Status Train(const RunConfig& config) {
  // --- rendezvous and mesh ---------------------------------------------------------------------
  const TrainingSection& t = config.training;
  FSDP_RETURN_IF_ERROR(ConfigureHostAllocator(t.cpu_allocator));
  DistOptions dist;
  dist.device = t.device;
  dist.cuda_backend = config.parallelism.backend == "gloo" ? "gloo" : "nccl";
  dist.cpu_collectives = config.parallelism.cpu_collectives;
  FSDP_ASSIGN_OR_RETURN(std::shared_ptr<DistContext> ctx, DistContext::InitFromEnvironment(dist));
  const int rank = ctx->rank();
  const int world = ctx->world_size();
  FSDP_RETURN_IF_ERROR(config.ValidateForWorld(world));
  const auto [replicate, shard] = config.parallelism.MeshDegrees(world);
  FSDP_ASSIGN_OR_RETURN(MeshShape shape,
                        ResolveMeshShape({"replicate", "shard"}, {replicate, shard}, world));
  FSDP_ASSIGN_OR_RETURN(DeviceMesh mesh, DeviceMesh::Create(ctx, shape));
  const c10::Device device = ctx->device();
  const bool on_cuda = device.is_cuda();
  CpuMemoryTracker& cpu_memory = CpuMemoryTracker::Install();

  std::filesystem::path run_dir(config.run.dir);
  if (rank == 0) {
    std::error_code ec;
    std::filesystem::create_directories(run_dir, ec);
    if (ec) return absl::FailedPreconditionError(StrCat("run.dir '", run_dir.string(), "': ", ec.message()));
    std::string yaml = config.ToYaml();
    std::cout << "fsdp train: resolved configuration (" << config.source_file << ")\n" << yaml << "\n";
    std::ofstream(run_dir / "config.yaml") << yaml;
  }

  // --- model, sharded ---------------------------------------------------------------------------
  // Sharded (FsdpModel), or with parallelism.strategy none the plain module (UnwrappedModel).
  Gpt model(static_cast<const GptConfig&>(config.model));
  for (auto& buffer : model->buffers()) buffer.set_data(buffer.to(device));
  const bool unwrapped = config.parallelism.Unwrapped();
  if (!config.model.deferred_init || unwrapped) {
    model->MaterializeSeeded(static_cast<uint64_t>(config.run.seed));  // the whole model, then sharded
    model->to(device);
  }
  std::unique_ptr<FsdpModel> sharded;
  std::unique_ptr<UnwrappedModel> plain;
  if (unwrapped) {
    plain = std::make_unique<UnwrappedModel>(model.ptr(), Dtype(t.mixed_precision));
  } else {
    FSDP_ASSIGN_OR_RETURN(FsdpOptions options, ShardingOptions(config, *model));
    FSDP_ASSIGN_OR_RETURN(sharded, FsdpModel::Wrap(model.ptr(), mesh,
                                                   Units(*model, config.parallelism.wrap_policy),
                                                   options));
  }
  std::unique_ptr<torch::optim::Optimizer> optimizer =
      MakeOptimizer(config.optimizer, sharded ? sharded->parameters() : plain->parameters());

  // --- data ---------------------------------------------------------------------------------
  FSDP_ASSIGN_OR_RETURN(std::unique_ptr<TokenDataset> dataset,
                        OpenDataset(config.data, config.model.vocab_size,
                                    static_cast<uint64_t>(config.run.seed)));
  // Every rank is a data-parallel rank (replicate x shard).
  FSDP_ASSIGN_OR_RETURN(DataLoader loader,
                        DataLoader::Create(*dataset, LoaderOptionsFor(config, rank, world)));

  // --- checkpoint: resume, or start from a safetensors file --------------------------------
  // (checkpoint.enabled is false for the unwrapped model: config validation.)
  std::optional<Checkpointer> checkpointer;
  std::optional<ResumePoint> resume;
  auto load_start = Clock::now();
  if (sharded) {
    checkpointer.emplace(config, ctx, mesh, *sharded, *optimizer);
    FSDP_ASSIGN_OR_RETURN(resume, checkpointer->Load());
  }
  double load_seconds = std::chrono::duration<double>(Clock::now() - load_start).count();
  int64_t start_step = 0;
  if (resume) {
    start_step = resume->step;
    loader.set_position(resume->data);
    if (rank == 0) {
      std::cout << fmt::format("fsdp train: resumed from {} at step {} (loaded in {:.2f} s)\n",
                               resume->dir, start_step, load_seconds);
    }
  } else if (!config.model.init_from.empty()) {
    FSDP_RETURN_IF_ERROR(sharded ? InitFromSafetensors(config.model.init_from, *sharded)
                                 : plain->LoadSafetensors(config.model.init_from));
    if (rank == 0) std::cout << "fsdp train: parameters from " << config.model.init_from << "\n";
  }
  InstallTermHandler();

  const int64_t tokens_per_step = world * t.micro_batch_size * t.grad_accum_steps * config.model.seq_len;
  const double flops_per_token = model->FlopsPerToken();
  const std::string compute_dtype = t.mixed_precision;
  double peak_flops = on_cuda ? PeakFlopsPerDevice(CudaDeviceDescription(device.index()), compute_dtype)
                              : config.metrics.cpu_peak_flops;
  std::optional<MetricsWriter> jsonl;
  if (rank == 0 && config.metrics.jsonl) {
    FSDP_ASSIGN_OR_RETURN(MetricsWriter w,
                          MetricsWriter::Open((run_dir / "metrics.jsonl").string(), resume.has_value()));
    jsonl.emplace(std::move(w));
  }
  // On a terminal of its own (torchrun, srun): rank 0 draws the bar. Under `fsdp train`'s own
  // launcher the output goes through a pipe and the launcher draws it (cli/train.cc).
  bool progress = rank == 0 && config.metrics.progress_bar != "off" && isatty(STDERR_FILENO);
  if (rank == 0) {
    std::cout << fmt::format(
        "fsdp train: {} on {} rank(s), mesh {}, strategy {}, model {} ({} parameters, {:.3g} "
        "FLOPs/token), data {}, {} tokens/step\n",
        config.run.name, world, shape.ToString(), config.parallelism.strategy, config.model.arch,
        model->NumParameters(), flops_per_token, dataset->Describe(), tokens_per_step);
    std::cout.flush();
  }

  // --- the loop -----------------------------------------------------------------------------
  at::TensorOptions scalar = at::TensorOptions().dtype(at::kFloat).device(device);
  std::vector<at::Tensor> losses, norms;  // per step of the current log interval, on device
  std::vector<double> lrs;
  at::Tensor first_bad = at::full({}, -1, at::TensorOptions().dtype(at::kLong).device(device));
  const bool hsdp = replicate > 1 && shard > 1;
  cpu_memory.ResetPeak();
  if (on_cuda) CudaResetPeakMemory(device.index());
  auto interval_start = Clock::now();
  auto run_start = interval_start;
  int64_t state_bytes = 0;
  CommStats no_comm;
  CommStats& comm = sharded ? sharded->comm_stats() : no_comm;
  comm.Reset();
  CommStats interval_comm = comm;  // counters at the start of the log interval
  double last_loss = std::nan("");
  const CheckpointSection& cs = config.checkpoint;
  auto save = [&](int64_t steps_done) -> absl::Status {
    FSDP_RETURN_IF_ERROR(checkpointer->Save(steps_done, loader.position()));
    if (rank == 0) {
      std::cout << fmt::format("checkpoint: step {} {} (loop blocked {:.1f} ms)\n", steps_done,
                               cs.async ? "saving in the background" : "saved",
                               checkpointer->last_blocking_seconds() * 1e3);
      if (jsonl) jsonl->Write({{"step", steps_done}, {"checkpoint_blocking_s", checkpointer->last_blocking_seconds()}});
    }
    return absl::OkStatus();
  };
  for (int64_t step = start_step; step < t.steps; ++step) {
    double lr = LearningRate(config.lr_scheduler, config.optimizer.lr, step, t.steps);
    SetLearningRate(*optimizer, lr);
    at::Tensor loss_sum = at::zeros({}, scalar);
    for (int m = 0; m < t.grad_accum_steps; ++m) {
      if (hsdp) sharded->set_requires_all_reduce(m == t.grad_accum_steps - 1);
      Batch b = loader.Get(m);
      at::Tensor logits = model->forward(b.inputs.to(device));
      at::Tensor loss = torch::nn::functional::cross_entropy(logits.flatten(0, 1).to(at::kFloat),
                                                             b.targets.to(device).flatten()) /
                        static_cast<double>(t.grad_accum_steps);
      loss.backward();
      if (plain) plain->AfterBackward();
      loss_sum += loss.detach();
    }
    loader.Advance();
    const double max_norm = t.max_grad_norm > 0 ? t.max_grad_norm : 1e30;
    at::Tensor norm = sharded ? sharded->ClipGradNorm(max_norm) : plain->ClipGradNorm(max_norm);
    at::Tensor bad = loss_sum.isfinite().logical_not() | norm.isfinite().logical_not();
    if (t.on_nonfinite == "skip") {
      // Skipping needs the answer before the update: one host read per step.
      if (bad.item<bool>()) {
        if (rank == 0) FSDP_LOG_WARN("step {}: non-finite loss or gradient norm; update skipped", step + 1);
        optimizer->zero_grad();
        losses.push_back(loss_sum);
        norms.push_back(norm);
        lrs.push_back(lr);
        continue;
      }
    } else {
      first_bad = at::where(bad & first_bad.lt(0), at::full_like(first_bad, step + 1), first_bad);
    }
    optimizer->step();
    if (plain) plain->AfterStep();
    // Model states (parameters, gradients, optimizer state) right after the update: what the
    // ZeRO formulas count. See Note [Rank statistics].
    state_bytes = on_cuda ? CudaAllocatedBytes(device.index()) : cpu_memory.current_bytes();
    optimizer->zero_grad();
    losses.push_back(loss_sum);
    norms.push_back(norm);
    lrs.push_back(lr);
    if (cs.enabled && cs.interval > 0 && (step + 1) % cs.interval == 0 && step + 1 < t.steps) {
      FSDP_RETURN_IF_ERROR(save(step + 1));
    }

    bool log_now = (step + 1) % t.log_interval == 0 || step + 1 == t.steps;
    if (!log_now) continue;
    // One host synchronisation per log interval: the losses (averaged over data-parallel
    // ranks), the norms and the non-finite flag of every step since the last log. The same
    // all-reduce carries whether any rank got SIGTERM, so that all ranks stop at the same step.
    const int64_t n = static_cast<int64_t>(losses.size());
    at::Tensor term = at::full({1}, TermRequested() ? 1.0 : 0.0,
                               at::TensorOptions().dtype(at::kDouble).device(device));
    at::Tensor stacked = at::cat({at::stack(losses).to(at::kDouble), term});
    ctx->world().AllReduce(stacked)->wait();
    stacked = stacked.cpu();
    const bool terminate = stacked[n].item<double>() > 0;
    stacked = stacked.narrow(0, 0, n) / world;
    at::Tensor norm_values = at::stack(norms).to(at::kDouble).cpu();
    int64_t bad_step = first_bad.item<int64_t>();
    double elapsed = std::chrono::duration<double>(Clock::now() - interval_start).count();
    double step_time = elapsed / static_cast<double>(losses.size());
    double tokens_per_s = tokens_per_step / step_time;
    double mfu = peak_flops > 0 ? flops_per_token * tokens_per_s / world / peak_flops : 0.0;
    int64_t peak_mem = on_cuda ? CudaPeakAllocatedBytes(device.index()) : cpu_memory.peak_bytes();
    double comm_wait = 0, comm_bytes = 0;  // this rank's, per step of the interval
    for (int k = 0; k < kNumCommKinds; ++k) {
      const CommCounter &now = comm.Get(static_cast<CommKind>(k)),
                        &before = interval_comm.Get(static_cast<CommKind>(k));
      comm_wait += (now.wait_seconds - before.wait_seconds) / static_cast<double>(n);
      comm_bytes += static_cast<double>(now.bytes - before.bytes) / static_cast<double>(n);
    }
    interval_comm = comm;
    int64_t first = step + 1 - static_cast<int64_t>(losses.size());
    for (size_t i = 0; i < losses.size(); ++i) {
      if (jsonl) {
        jsonl->Write({{"step", first + static_cast<int64_t>(i) + 1},
                      {"loss", stacked[i].item<double>()},
                      {"grad_norm", norm_values[i].item<double>()},
                      {"lr", lrs[i]},
                      {"step_time_s", step_time},
                      {"tokens_per_s", tokens_per_s},
                      {"tokens_per_s_per_device", tokens_per_s / world},
                      {"mfu", mfu},
                      {"peak_mem_bytes", peak_mem},
                      {"comm_wait_s", comm_wait},
                      {"comm_bytes", comm_bytes}});
      }
    }
    last_loss = stacked[static_cast<int64_t>(losses.size()) - 1].item<double>();
    if (rank == 0) {
      if (progress) std::cerr << "\r\033[K";
      std::cout << fmt::format(
          "step {:>6}/{}  loss {:.4f}  grad_norm {:.3f}  lr {:.3e}  {:.0f} ms/step  {:.0f} tok/s "
          "({:.0f}/device)  mfu {:.2f}%  peak_mem {}\n",
          step + 1, t.steps, last_loss, norm_values[-1].item<double>(), lr, step_time * 1e3,
          tokens_per_s, tokens_per_s / world, 100 * mfu, HumanBytes(static_cast<double>(peak_mem)));
      std::cout.flush();
      if (progress) {
        std::cerr << ProgressBar(step + 1, t.steps,
                                 std::chrono::duration<double>(Clock::now() - run_start).count() /
                                     (step + 1));
        std::cerr.flush();
      }
    }
    losses.clear();
    norms.clear();
    lrs.clear();
    if (bad_step >= 0) {
      return absl::FailedPreconditionError(StrCat(
          "step ", bad_step, ": the loss or the gradient norm is not finite (NaN or inf); "
          "stopping. Lower optimizer.lr, or set training.on_nonfinite: skip"));
    }
    if (terminate) {
      if (cs.enabled) {
        FSDP_RETURN_IF_ERROR(checkpointer->Save(step + 1, loader.position()));
        FSDP_RETURN_IF_ERROR(checkpointer->Finish());
        if (rank == 0) std::cout << "fsdp train: SIGTERM: saved step " << step + 1 << " and stopped\n";
        return absl::OkStatus();
      }
      return absl::AbortedError(StrCat("stopped by SIGTERM after step ", step + 1,
                                       " (checkpoint.enabled is false: nothing saved)"));
    }
    if (t.eval_interval > 0 && ((step + 1) % t.eval_interval == 0 || step + 1 == t.steps)) {
      double val = Evaluate(*model, loader, t.eval_batches, ctx->world(), device);
      if (rank == 0) {
        std::cout << fmt::format("eval   step {:>6}  val_loss {:.4f}\n", step + 1, val);
        if (jsonl) jsonl->Write({{"step", step + 1}, {"val_loss", val}});
      }
    }
    interval_start = Clock::now();
  }
  if (cs.enabled) {
    FSDP_RETURN_IF_ERROR(save(t.steps));
    FSDP_RETURN_IF_ERROR(checkpointer->Finish());
  }
  WriteRankStats(run_dir, rank, t.steps - start_step, ProcessPeakRssBytes(),
                 on_cuda ? CudaPeakAllocatedBytes(device.index()) : cpu_memory.peak_bytes(),
                 state_bytes, comm, flops_per_token, peak_flops,
                 on_cuda ? CudaDeviceDescription(device.index()) : "cpu");
  if (rank == 0) {
    if (progress) std::cerr << "\n";
    double total = std::chrono::duration<double>(Clock::now() - run_start).count();
    std::cout << fmt::format("fsdp train: done, {} steps in {:.1f} s, final loss {:.4f}; metrics in {}\n",
                             t.steps, total, last_loss, (run_dir / "metrics.jsonl").string());
  }
  ctx->world().Barrier()->wait();
  return absl::OkStatus();
}

}  // namespace fsdp
