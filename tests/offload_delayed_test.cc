// The delayed parameter update with CPU offload (Note [Delayed parameter update] in
// sharding/offload/host_step.h) on real ranks: each step's forward and backward use the parameters
// from before the previous step's update, which runs on the host meanwhile. The engine's run
// equals, bit for bit, a reference the test computes with the same model wrapped without offload,
// whose masters it sets by hand to the stale values for each forward and back to the newest for
// each update (offload params and optimizer, fp32 and bf16 compute, one and two micro-batches, 1
// and 2 ranks); and through `fsdp train`: the warm-up steps train as without the delay, a resumed
// run continues exactly, and rank_stats counts the delayed steps.
#include <atomic>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <functional>
#include <map>
#include <thread>

#include <torch/torch.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "checkpoint/format.h"
#include "common/strings.h"
#include "engine/host_adam.h"
#include "engine/optimizer.h"
#include "sharding/fsdp_model.h"
#include "tests/gpu_skip.h"
#include "tests/multirank.h"
#include "tests/tiny_gpt.h"
#include "tests/train_run.h"

namespace fsdp {
namespace {

using testing::TinyGpt;
using testing::TinyGptConfig;

constexpr int kSteps = 4;
constexpr int64_t kGlobalBatch = 8;

struct Case {
  Offload offload;
  bool bf16;
  int micro_batches;
};

std::string Name(const Case& c) {
  return StrCat(OffloadName(c.offload), c.bf16 ? " bf16" : " fp32", " ", c.micro_batches,
                " micro-batches");
}

struct RunResult {
  int64_t host_bytes = 0;  // model_state_bytes(): host + host_untouched
  std::vector<double> losses;
  std::map<std::string, torch::Tensor> masters;
  HostOffload::Stats stats;
};

// The model of every run: same weights on every call (seeded), wrapped with `options`.
struct Wrapped {
  TinyGptConfig config;
  TinyGpt model{nullptr};
  std::unique_ptr<FsdpModel> fsdp;
  std::unique_ptr<torch::optim::Optimizer> optimizer;
};

// `delayable`: with offload, the second buffers of a delayed update allocated.
Wrapped Wrap(const Case& c, bool offload, DeviceMesh& mesh, at::Device device,
             bool delayable = true) {
  Wrapped w;
  w.config.layers = 3;
  torch::manual_seed(1234);
  w.model = TinyGpt(w.config);
  w.model->to(device);
  FsdpOptions options = OptionsForStrategy(Strategy::kFullShard);
  if (offload) {
    options.offload = c.offload;
    options.offload_delayed_update = delayable;
  }
  if (c.bf16) {
    options.mixed_precision.param_dtype = at::kBFloat16;
    options.mixed_precision.reduce_dtype = at::kFloat;
    options.mixed_precision.output_dtype = at::kFloat;
  }
  auto units = SelectUnits(*w.model, {.module_types = {"fsdp::testing::BlockImpl"}});
  w.fsdp = *FsdpModel::Wrap(w.model.ptr(), mesh, units, options);
  w.optimizer = BuildOptimizer({.kind = OptimizerKind::kAdamW, .lr = 1e-2, .weight_decay = 0.1},
                               w.fsdp->parameters());
  return w;
}

// One step's forward and backward on this rank's micro-batches; the summed loss.
double ForwardBackward(Wrapped& w, const Case& c, int step, int rank, int world) {
  torch::manual_seed(500 + step);
  const at::Device device = w.fsdp->context().device;
  torch::Tensor x = torch::randint(w.config.vocab, {kGlobalBatch, w.config.seq}).to(device);
  torch::Tensor y = torch::randint(w.config.vocab, {kGlobalBatch, w.config.seq}).to(device);
  const int64_t micro = kGlobalBatch / world / c.micro_batches;
  double loss_sum = 0;
  for (int m = 0; m < c.micro_batches; ++m) {
    const int64_t begin = (rank * c.micro_batches + m) * micro;
    torch::Tensor logits = w.model->forward(x.narrow(0, begin, micro));
    torch::Tensor loss =
        torch::nn::functional::cross_entropy(logits.reshape({-1, w.config.vocab}),
                                             y.narrow(0, begin, micro).reshape({-1})) /
        c.micro_batches;
    loss.backward();
    loss_sum += loss.item<double>();
  }
  return loss_sum;
}

std::map<std::string, torch::Tensor> Masters(FsdpModel& fsdp) {
  std::map<std::string, torch::Tensor> masters;
  for (const auto& [name, shard] : fsdp.named_parameters()) {
    masters[name] = shard.detach().cpu().clone();
  }
  return masters;
}

void SetMasters(FsdpModel& fsdp, const std::map<std::string, torch::Tensor>& values) {
  at::NoGradGuard no_grad;
  for (const auto& [name, shard] : fsdp.named_parameters()) shard.copy_(values.at(name));
}

// The engine: the trainer's sequence (clip, prepared step through StepOnHost, delayed).
// `slow_host`: the update first sleeps, so that it is still running when the next step's
// backward sends its gradients (the order of the two is then fixed by the engine's waits, not
// by timing).
RunResult TrainDelayed(const Case& c, DeviceMesh& mesh, int rank, at::Device device = at::kCPU,
                       bool slow_host = false) {
  Wrapped w = Wrap(c, /*offload=*/true, mesh, device);
  w.fsdp->set_offload_defer_conversion(true);  // as the trainer: every step goes through StepOnHost
  RunResult run;
  for (int step = 0; step < kSteps; ++step) {
    run.losses.push_back(ForwardBackward(w, c, step, rank, mesh.shape().num_ranks()));
    w.fsdp->ClipGradNorm(0.5);
    std::shared_ptr<PreparedStep> prepared = PrepareStep(*w.optimizer);
    EXPECT_NE(prepared, nullptr);
    if (prepared == nullptr) return run;
    for (const at::Tensor& p : prepared->params()) p.mutable_grad().reset();
    HostStep host_step;
    // StepInOrder asks can_run_slices of every master before the adder runs any job, which
    // changes the prepared step (the jobs were queued group by group once: a data race).
    auto job_began = std::make_shared<std::atomic<bool>>(false);
    host_step.run = [prepared, slow_host, job_began](const std::vector<at::Tensor>& masters) {
      *job_began = true;
      if (slow_host) std::this_thread::sleep_for(std::chrono::milliseconds(100));
      prepared->Run(masters);
    };
    host_step.can_run_slices = [prepared, job_began](const at::Tensor& p) {
      EXPECT_FALSE(job_began->load()) << "can_run_slices asked while the step's jobs run";
      return prepared->CanRunSlices(p);
    };
    host_step.run_slice = [prepared, job_began](const at::Tensor& p, int64_t begin, int64_t n) {
      *job_began = true;
      prepared->RunSlice(p, begin, n);
    };
    host_step.slices_done = [prepared](const at::Tensor& p) { prepared->SlicesDone(p); };
    if (!slow_host) {  // else the sleeping Run above steps every group
      host_step.run_host_pass = [prepared, job_began](const at::Tensor& p, const at::Tensor& grad,
                                                      float scale, const at::Tensor& copy) {
        *job_began = true;
        return prepared->RunHostPass(p, grad, scale, copy);
      };
    }
    w.fsdp->StepOnHost(std::move(host_step), /*delayed=*/true);
    w.optimizer->zero_grad();
  }
  w.fsdp->FinishHostStep();
  const ModelStateBytes bytes = w.fsdp->model_state_bytes();
  run.host_bytes = bytes.host + bytes.host_untouched;  // written or not: reserved
  run.masters = Masters(*w.fsdp);
  run.stats = w.fsdp->context().offload->stats();
  return run;
}

// The reference, without offload: step t's gradients are taken at the parameters from before
// update t-1 (`used`), and update t steps the newest ones (`latest`); `delay` false: the usual
// training, for the control.
RunResult TrainReference(const Case& c, DeviceMesh& mesh, int rank, bool delay,
                         at::Device device = at::kCPU) {
  Wrapped w = Wrap(c, /*offload=*/false, mesh, device);
  std::map<std::string, torch::Tensor> latest = Masters(*w.fsdp), used = latest;
  RunResult run;
  for (int step = 0; step < kSteps; ++step) {
    if (delay) SetMasters(*w.fsdp, used);
    run.losses.push_back(ForwardBackward(w, c, step, rank, mesh.shape().num_ranks()));
    w.fsdp->ClipGradNorm(0.5);
    if (delay) {
      used = latest;  // the next step's: from before this update
      SetMasters(*w.fsdp, latest);
    }
    w.optimizer->step();
    w.optimizer->zero_grad();
    latest = Masters(*w.fsdp);
  }
  run.masters = latest;
  return run;
}

// On `world` ranks (sharing the GPU with `cuda`), `body` for each offload mode, fp32 and bf16, and
// each of `micro_batches`.
void ForEachCase(int world, bool cuda, const std::vector<int>& micro_batches,
                 const std::function<void(const Case&, DeviceMesh&, int rank, at::Device)>& body) {
  testing::RunOnRanks(world, [&](int rank) {
    std::shared_ptr<DistContext> ctx =
        cuda ? testing::InitCudaDist(world) : testing::InitDist(testing::TestDistOptions());
    ASSERT_EQ(ctx->device().is_cuda(), cuda);
    DeviceMesh mesh =
        *DeviceMesh::Create(ctx, *MeshShapeForStrategy(Strategy::kFullShard, world, 1));
    for (Offload offload : {Offload::kParams, Offload::kOptimizer}) {
      for (bool bf16 : {false, true}) {
        for (int micro : micro_batches) {
          const Case c{offload, bf16, micro};
          SCOPED_TRACE(StrCat(Name(c), " world ", world, " rank ", rank));
          body(c, mesh, rank, ctx->device());
        }
      }
    }
  });
}

void ExpectSameMasters(const RunResult& run, const RunResult& reference) {
  ASSERT_EQ(run.masters.size(), reference.masters.size());
  for (const auto& [name, master] : reference.masters) {
    EXPECT_TRUE(torch::equal(run.masters.at(name), master)) << name;
  }
}

class OffloadDelayedTest : public ::testing::TestWithParam<int> {};

TEST_P(OffloadDelayedTest, EqualsTheStaleReferenceBitwise) {
  const int world = GetParam();
  ForEachCase(
      world, /*cuda=*/false, {1, 2}, [&](const Case& c, DeviceMesh& mesh, int rank, at::Device) {
        const auto [offload, bf16, micro_batches] = c;
        RunResult delayed = TrainDelayed(c, mesh, rank);
        RunResult reference = TrainReference(c, mesh, rank, /*delay=*/true);
        RunResult fresh = TrainReference(c, mesh, rank, /*delay=*/false);
        ASSERT_EQ(delayed.losses.size(), static_cast<size_t>(kSteps));
        EXPECT_EQ(delayed.losses, reference.losses);
        ExpectSameMasters(delayed, reference);
        // The control: the delay changes the run from the second step on, by far more than
        // the GPU test's tolerance.
        EXPECT_EQ(delayed.losses[0], fresh.losses[0]);
        EXPECT_GT(std::abs(delayed.losses[1] - fresh.losses[1]), 1e-3 * std::abs(fresh.losses[1]));
        EXPECT_EQ(delayed.stats.delayed_steps, kSteps);
        EXPECT_EQ(delayed.stats.overlapped_steps, kSteps);
        // Every parameter of every update by the optimizer's one loop where it matches ATen
        // here (Note [Host Adam pass]), into the spare loaded copy with offload params (bf16:
        // written by the loop; fp32 compute: copied after it).
        if (HostAdamPassAvailable()) {
          EXPECT_GT(delayed.stats.host_passes, 0);
          EXPECT_EQ(delayed.stats.host_passes % kSteps, 0);
        }
        // The second buffers, in the host's model state: offload params a loaded copy per
        // parameter (fp32 compute: two, where it had none) and, bf16 on one rank, a landing
        // buffer; offload optimizer none.
        Wrapped plain = Wrap(c, /*offload=*/true, mesh, at::kCPU, /*delayable=*/false);
        int64_t padded = 0, real = 0;
        for (const FsdpUnit* unit : plain.fsdp->units()) {
          for (const FsdpParam& p : unit->params()) {
            padded += p.host->shard.numel();
            if (p.requires_grad) real += p.sharded.numel();
          }
        }
        const int64_t width = bf16 ? 2 : 4;
        int64_t extra = 0;
        if (offload == Offload::kParams) {
          extra = padded * width * (bf16 ? 1 : 2) + (bf16 && world == 1 ? real * width : 0);
        }
        const ModelStateBytes plain_bytes = plain.fsdp->model_state_bytes();
        EXPECT_EQ(delayed.host_bytes - plain_bytes.host - plain_bytes.host_untouched, extra);
        // Offload params, one shard, bf16, one micro-batch: the gradients stayed in bf16
        // until the delayed update read them, from the buffer they landed in while the next
        // step's landed in the other (Note [Deferred gradient conversion]).
        const bool deferred = offload == Offload::kParams && bf16 && world == 1;
        EXPECT_EQ(delayed.stats.deferred_steps > 0, deferred && micro_batches == 1);
      });
}

// The same with an update slower than the next step's forward and backward: a gradient that
// lands on the host while its unit's update still reads the .grad buffer waits for it.
TEST_P(OffloadDelayedTest, SlowHostUpdateStillEqualsTheReference) {
  ForEachCase(GetParam(), /*cuda=*/false, {2},
              [&](const Case& c, DeviceMesh& mesh, int rank, at::Device) {
                RunResult delayed = TrainDelayed(c, mesh, rank, at::kCPU, /*slow_host=*/true);
                RunResult reference = TrainReference(c, mesh, rank, /*delay=*/true);
                EXPECT_EQ(delayed.losses, reference.losses);
                ExpectSameMasters(delayed, reference);
              });
}

INSTANTIATE_TEST_SUITE_P(Worlds, OffloadDelayedTest, ::testing::Values(1, 2),
                         [](const auto& info) { return StrCat("world", info.param); });

// The same on a GPU (one rank: NCCL; two: Gloo on CUDA tensors): the loads and pushes on the
// copy-in stream, the landing copies after events, the host step on the adder. The reference
// steps on the GPU (CUDA's fused AdamW, the device's clipping norm) and the engine on the host,
// so the values are close, not the same bits; the delay's own effect is far larger.
TEST(OffloadDelayedCudaTest, EqualsTheStaleReferenceOnTheGpu) {
  FSDP_SKIP_WITHOUT_GPU();
  for (int world : {1, 2}) {
    ForEachCase(world, /*cuda=*/true, {1, 2},
                [&](const Case& c, DeviceMesh& mesh, int rank, at::Device device) {
                  RunResult delayed = TrainDelayed(c, mesh, rank, device);
                  RunResult reference = TrainReference(c, mesh, rank, true, device);
                  RunResult fresh = TrainReference(c, mesh, rank, false, device);
                  ASSERT_EQ(delayed.losses.size(), static_cast<size_t>(kSteps));
                  for (int step = 0; step < kSteps; ++step) {
                    EXPECT_NEAR(delayed.losses[step], reference.losses[step],
                                1e-4 * std::abs(reference.losses[step]))
                        << "step " << step;
                  }
                  for (const auto& [name, master] : reference.masters) {
                    EXPECT_TRUE(torch::allclose(delayed.masters.at(name), master, 1e-3, 1e-5))
                        << name;
                  }
                  EXPECT_GT(std::abs(delayed.losses[1] - fresh.losses[1]),
                            1e-3 * std::abs(fresh.losses[1]));
                  EXPECT_EQ(delayed.stats.delayed_steps, kSteps);
                });
  }
}

// `fsdp train` with parallelism.offload_delayed_update on and after:2: the warm-up steps train
// as without the delay; with it the run differs from the second delayed step on, except right
// after a checkpoint or an evaluation (they see every update, and so does the step after them);
// a run resumed from its checkpoint continues with its losses exactly. Offload params on one rank
// with bf16, units kept across micro-batches and grad_sync last (gpu_check's
// offload_params_delayed_2x4: deferred gradients in the delayed update), and offload optimizer
// on two ranks.
TEST(OffloadDelayedTrainTest, WarmsUpResumesAndCounts) {
  namespace fs = std::filesystem;
  const std::vector<std::vector<std::string>> modes = {
      {"parallelism.offload=params", "parallelism.nproc=1", "training.grad_accum_steps=2",
       "training.grad_sync=last", "parallelism.reshard_between_micro_batches=false"},
      {"parallelism.offload=optimizer", "parallelism.nproc=2", "training.grad_accum_steps=2"},
  };
  for (const std::vector<std::string>& mode : modes) {
    SCOPED_TRACE(StrJoin(mode, " "));
    auto train = [&](const std::string& dir, std::vector<std::string> sets) {
      sets.insert(
          sets.begin(),
          {"training.steps=6", "training.log_interval=1", "training.eval_interval=4",
           "training.micro_batch_size=2", "model.n_layers=2", "training.mixed_precision=bf16",
           "training.max_grad_norm=0.05", "checkpoint.enabled=true", "checkpoint.interval=3"});
      sets.insert(sets.begin() + 1, mode.begin(), mode.end());
      return testing::RunTrain(testing::SourceDir() + "/configs/default.yaml", dir, sets);
    };
    const std::string delayed_dir = testing::FreshTempDir("delayed-on"),
                      plain_dir = testing::FreshTempDir("delayed-off"),
                      warmup_dir = testing::FreshTempDir("delayed-warmup"),
                      resume_dir = testing::FreshTempDir("delayed-resume");
    testing::TrainRun delayed = train(delayed_dir, {"parallelism.offload_delayed_update=on"});
    ASSERT_TRUE(delayed.result.exit.ok()) << delayed.result.Output();
    testing::TrainRun plain = train(plain_dir, {});
    ASSERT_TRUE(plain.result.exit.ok()) << plain.result.Output();
    // Delayed from the third step: the first three steps are the plain run's.
    testing::TrainRun warmup = train(warmup_dir, {"parallelism.offload_delayed_update=after:2"});
    ASSERT_TRUE(warmup.result.exit.ok()) << warmup.result.Output();
    ASSERT_EQ(delayed.losses.size(), 6u) << delayed.result.Output();
    ASSERT_EQ(plain.losses.size(), 6u) << plain.result.Output();
    ASSERT_EQ(warmup.losses.size(), 6u) << warmup.result.Output();
    // Step 1 uses the initial parameters either way; step 2 the stale ones.
    EXPECT_EQ(delayed.losses.at(1), plain.losses.at(1));
    EXPECT_NE(delayed.losses.at(2), plain.losses.at(2));
    // Steps 3 and 4's updates are delayed, but the checkpoint after step 3 and the evaluation
    // after step 4 make them visible to the next step: step 6 is the first to use stale
    // parameters.
    for (int64_t step = 1; step <= 5; ++step) {
      EXPECT_EQ(warmup.losses.at(step), plain.losses.at(step)) << "step " << step;
    }
    EXPECT_NE(warmup.losses.at(6), plain.losses.at(6));
    const nlohmann::json& on = delayed.rank0_stats["offload"];
    EXPECT_EQ(on["delayed_steps"], 6) << on.dump();
    EXPECT_EQ(warmup.rank0_stats["offload"]["delayed_steps"], 4) << warmup.rank0_stats.dump();
    EXPECT_EQ(plain.rank0_stats["offload"]["delayed_steps"], 0) << plain.rank0_stats.dump();
    if (mode.front() == "parallelism.offload=params") {
      EXPECT_GT(on["deferred_steps"].get<int64_t>(), 0) << on.dump();
    }
    // Resumed from step 3 of the delayed run, with the delay: steps 4-6 are that run's.
    testing::TrainRun resumed = train(
        resume_dir, {"parallelism.offload_delayed_update=on",
                     "checkpoint.load=" + delayed_dir + "/checkpoints/" + ckpt::StepDirName(3)});
    ASSERT_TRUE(resumed.result.exit.ok()) << resumed.result.Output();
    for (int64_t step = 4; step <= 6; ++step) {
      EXPECT_EQ(resumed.losses.at(step), delayed.losses.at(step)) << "step " << step;
    }
    for (const std::string& dir : {delayed_dir, plain_dir, warmup_dir, resume_dir}) {
      fs::remove_all(dir);
    }
  }
}

// A skipped step (training.on_nonfinite: skip; FSDP_TEST_NONFINITE makes step 3 non-finite)
// makes every delayed update visible, as a checkpoint does (Note [Delayed parameter update]):
// the run with a checkpoint right after the skipped step trains on as the run without one. If
// the skip left update 2 pending, step 4 of the run without the checkpoint would use the
// parameters from before it.
TEST(OffloadDelayedTrainTest, SkippedStepMakesTheUpdatesVisible) {
  namespace fs = std::filesystem;
  struct Mode {
    std::vector<std::string> sets;
    std::string poisoned;  // FSDP_TEST_NONFINITE
  };
  const Mode modes[] = {
      {{"parallelism.offload=params", "parallelism.nproc=1", "training.grad_accum_steps=2",
        "training.grad_sync=last", "parallelism.reshard_between_micro_batches=false"},
       "0@3"},
      {{"parallelism.offload=optimizer", "parallelism.nproc=2", "training.grad_accum_steps=2"},
       "1@3"},
  };
  for (const Mode& mode : modes) {
    SCOPED_TRACE(StrJoin(mode.sets, " "));
    auto train = [&](const std::string& dir, std::vector<std::string> sets) {
      sets.insert(sets.begin(),
                  {"training.steps=5", "training.log_interval=1", "training.eval_interval=0",
                   "training.micro_batch_size=2", "model.n_layers=2",
                   "training.mixed_precision=bf16", "training.max_grad_norm=0.05",
                   "training.on_nonfinite=skip", "parallelism.offload_delayed_update=on"});
      sets.insert(sets.end(), mode.sets.begin(), mode.sets.end());
      return testing::RunTrain(testing::SourceDir() + "/configs/default.yaml", dir, sets,
                               {{"FSDP_TEST_NONFINITE", mode.poisoned}});
    };
    const std::string skipped_dir = testing::FreshTempDir("delayed-skip"),
                      saved_dir = testing::FreshTempDir("delayed-skip-saved");
    testing::TrainRun skipped = train(skipped_dir, {});
    ASSERT_TRUE(skipped.result.exit.ok()) << skipped.result.Output();
    testing::TrainRun saved =
        train(saved_dir, {"checkpoint.enabled=true", "checkpoint.interval=3"});
    ASSERT_TRUE(saved.result.exit.ok()) << saved.result.Output();
    const std::vector<double> losses = testing::LossSeries(skipped);
    ASSERT_EQ(losses.size(), 5u) << skipped.result.Output();
    EXPECT_TRUE(std::isnan(losses[2])) << skipped.result.Output();
    EXPECT_TRUE(skipped.step_records[2].value("skipped", false)) << skipped.step_records[2];
    EXPECT_TRUE(std::isfinite(losses[4])) << skipped.result.Output();
    EXPECT_EQ(skipped.losses, saved.losses);
    // Every step but the skipped one updated with the delay.
    EXPECT_EQ(skipped.rank0_stats["offload"]["delayed_steps"], 4) << skipped.rank0_stats.dump();
    fs::remove_all(skipped_dir);
    fs::remove_all(saved_dir);
  }
}

}  // namespace
}  // namespace fsdp
