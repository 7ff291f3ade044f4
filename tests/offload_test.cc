// CPU offload (parallelism.offload, Note [CPU offload] in sharding/offload/host_offload.h) on real
// ranks. On a CPU the "device" shards and the host masters are distinct tensors and every copy
// happens, so the offloaded runs must equal the run without offload bit for bit (same arithmetic:
// libtorch's AdamW on both sides here); the device must hold fewer bytes of model state; and `fsdp
// train` must run, checkpoint and resume with offload, across offload modes.
#include <atomic>
#include <filesystem>
#include <thread>
#include <fstream>

#include <torch/torch.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "checkpoint/format.h"
#include "common/strings.h"
#include "sharding/fsdp_model.h"
#include "sharding/host_loops.h"
#include "tests/multirank.h"
#include "tests/train_run.h"
#include "tests/tiny_gpt.h"

namespace fsdp {
namespace {

using testing::TinyGpt;
using testing::TinyGptConfig;

constexpr int kSteps = 3;
constexpr int kMicroBatches = 2;
constexpr int64_t kGlobalBatch = 8;  // divisible by every data-parallel size x micro-batches

struct Case {
  std::string strategy;
  int replicate = 1;
  bool bf16 = false;
  bool no_sync = false;   // first micro-batch without gradient sync
  int reshard_group = 0;  // reshard_after_forward = k
  std::string Name() const {
    return StrCat(strategy, replicate > 1 ? StrCat("_r", replicate) : "", bf16 ? "_bf16" : "",
                  no_sync ? "_nosync" : "", reshard_group ? StrCat("_k", reshard_group) : "");
  }
};

struct RunResult {
  std::vector<double> losses, norms;
  std::map<std::string, torch::Tensor> shards;  // final masters, by name
  ModelStateBytes bytes;                        // after the last step, before zero_grad
  int64_t peak_loaded = 0;                      // offload params: device shards at once
  HostOffload::Stats stats;                     // offload only
  int64_t host_shard_bytes = 0;                 // offload: the fp32 padded shards on the host
  int64_t host_compute_bytes = 0;               // offload params: their compute-dtype copies
  int64_t host_compute_grad_bytes = 0;          // offload params, one shard: gradients' landing
};

// `device`: where the model and the batches live (CUDA: the offload's copies run on streams).
// `on_device`: the micro-batches but the last accumulate their gradients on the device
// (FsdpModel::set_offload_accumulate_on_device, as the trainer does with offload optimizer).
// `compute_copy`: FsdpOptions::offload_compute_copy kKeep, or kDrop when false.
RunResult Train(const Case& c, Offload offload, DeviceMesh& mesh, int rank,
                at::Device device = at::kCPU, bool on_device = false, bool compute_copy = true) {
  TinyGptConfig config;
  config.layers = 6;  // more units than the prefetch reaches
  torch::manual_seed(1234);
  TinyGpt model(config);
  model->to(device);
  Strategy strategy = *ParseStrategy(c.strategy);
  FsdpOptions options = OptionsForStrategy(strategy);
  options.offload = offload;
  options.offload_compute_copy = compute_copy ? ComputeCopy::kKeep : ComputeCopy::kDrop;
  options.reshard_group_size = c.reshard_group;
  if (c.bf16) {
    options.mixed_precision.param_dtype = at::kBFloat16;
    options.mixed_precision.reduce_dtype = at::kFloat;
    options.mixed_precision.output_dtype = at::kFloat;
  }
  auto units = SelectUnits(*model, {.module_types = {"fsdp::testing::BlockImpl"}});
  absl::StatusOr<std::unique_ptr<FsdpModel>> wrapped =
      FsdpModel::Wrap(model.ptr(), mesh, units, options);
  if (!wrapped.ok()) throw std::runtime_error(std::string(wrapped.status().message()));
  FsdpModel& fsdp = **wrapped;
  torch::optim::AdamW opt(fsdp.parameters(),
                          torch::optim::AdamWOptions(1e-2).weight_decay(0.1).eps(1e-6));
  const int dp = mesh.shape().num_ranks();
  const int64_t micro = kGlobalBatch / dp / kMicroBatches;
  RunResult run;
  for (int step = 0; step < kSteps; ++step) {
    torch::manual_seed(100 + step);
    torch::Tensor x = torch::randint(config.vocab, {kGlobalBatch, config.seq}).to(device);
    torch::Tensor y = torch::randint(config.vocab, {kGlobalBatch, config.seq}).to(device);
    double loss_sum = 0;
    for (int m = 0; m < kMicroBatches; ++m) {
      const bool last = m == kMicroBatches - 1;
      if (c.no_sync) fsdp.set_requires_gradient_sync(last);
      if (c.replicate > 1) fsdp.set_requires_all_reduce(last);
      if (on_device) fsdp.set_offload_accumulate_on_device(!last);
      int64_t begin = (rank * kMicroBatches + m) * micro;
      torch::Tensor logits = model->forward(x.narrow(0, begin, micro));
      torch::Tensor loss =
          torch::nn::functional::cross_entropy(logits.reshape({-1, config.vocab}),
                                               y.narrow(0, begin, micro).reshape({-1})) /
          kMicroBatches;
      loss.backward();
      loss_sum += loss.item<double>();
      if (on_device && !last) {
        // The sum waits on the device: nothing on the host yet, counted as device state.
        ModelStateBytes mid = fsdp.model_state_bytes();
        EXPECT_GT(mid.device, 0);
        for (const auto& [name, shard] : fsdp.named_parameters()) {
          const FsdpParam* p = fsdp.FindParam(name);
          if (!p->requires_grad) continue;
          EXPECT_FALSE(shard.grad().defined()) << name;
          if (!c.no_sync && c.replicate == 1) {  // HSDP keeps its unreduced sum instead
            EXPECT_TRUE(p->host->device_grad.defined()) << name;
          }
        }
      }
    }
    if (offload != Offload::kNone) {
      // The gradients are the host buffers allocated at wrap time, not device tensors.
      for (const auto& [name, shard] : fsdp.named_parameters()) {
        const FsdpParam* p = fsdp.FindParam(name);
        if (!p->requires_grad) continue;
        EXPECT_EQ(shard.grad().data_ptr(), p->host->grad.data_ptr()) << name;
        EXPECT_FALSE(p->host->device_grad.defined()) << name;  // sent with the last micro-batch
      }
    }
    run.norms.push_back(fsdp.ClipGradNorm(0.5).item<double>());
    opt.step();
    fsdp.CopyShardsToDevice();
    run.bytes = fsdp.model_state_bytes();
    opt.zero_grad();
    run.losses.push_back(loss_sum);
  }
  for (const auto& [name, shard] : fsdp.named_parameters()) {
    run.shards[name] = shard.detach().cpu().clone();
    const FsdpParam* p = fsdp.FindParam(name);
    if (offload == Offload::kOptimizer) {
      // Distinct memory: the device shard is a copy of the master, padding rows zero.
      EXPECT_NE(p->padded_shard.data_ptr(), shard.data_ptr()) << name;
      EXPECT_TRUE(torch::equal(p->padded_shard.cpu(), p->host->shard)) << name;
    }
    if (offload == Offload::kParams) {
      EXPECT_FALSE(p->padded_shard.defined()) << name;
      // Note [CPU offload]: with bf16 compute the host keeps each shard cast to bf16, refreshed
      // after every step: the cast of the current master.
      EXPECT_EQ(p->host->compute_shard.defined(), c.bf16 && compute_copy) << name;
      if (c.bf16 && compute_copy) {
        EXPECT_EQ(p->host->compute_shard.scalar_type(), at::kBFloat16) << name;
        EXPECT_TRUE(torch::equal(p->host->compute_shard, p->host->shard.to(at::kBFloat16))) << name;
        run.host_compute_bytes += static_cast<int64_t>(p->host->compute_shard.nbytes());
      }
      if (p->host->compute_grad.defined()) {
        EXPECT_EQ(p->host->compute_grad.scalar_type(), at::kBFloat16) << name;
        run.host_compute_grad_bytes += static_cast<int64_t>(p->host->compute_grad.nbytes());
      }
    }
    if (offload != Offload::kNone) {
      run.host_shard_bytes += static_cast<int64_t>(p->host->shard.nbytes());
    }
  }
  if (offload == Offload::kParams) run.peak_loaded = fsdp.context().offload->peak_loaded_bytes();
  if (offload != Offload::kNone) run.stats = fsdp.context().offload->stats();
  return run;
}

void ExpectSame(const RunResult& base, const RunResult& run, const std::string& what) {
  SCOPED_TRACE(what);
  // Bitwise: the same operations on the same values, only in other memory.
  EXPECT_EQ(run.losses, base.losses);
  EXPECT_EQ(run.norms, base.norms);
  for (const auto& [name, shard] : base.shards) {
    EXPECT_TRUE(torch::equal(run.shards.at(name), shard)) << name;
  }
}

std::vector<Case> CasesFor(int world) {
  if (world == 1) return {{"full_shard"}, {"shard_grad_op"}, {"full_shard", 1, true}};
  if (world == 2) {
    return {{"full_shard"},
            {"shard_grad_op"},
            {"no_shard"},
            {"full_shard", 1, false, true},
            {"full_shard", 1, true}};
  }
  return {{"full_shard"},      {"shard_grad_op"},         {"no_shard"},
          {"hybrid_shard", 2}, {"hybrid_shard", 2, true}, {"full_shard", 1, false, false, 2}};
}

// For each case: the run without offload, then with optimizer and with params offload.
// `cpu_collectives`: "p2p", or "gloo" for the flat buffers that NCCL runs use (the copy-in of
// the loaded shards, the copy-out, the packed reduce-scatter).
void ExpectOffloadParity(int world, const std::string& cpu_collectives) {
  testing::RunOnRanks(world, [&](int rank) {
    DistOptions dist = testing::TestDistOptions();
    dist.cpu_collectives = cpu_collectives;
    std::shared_ptr<DistContext> ctx = testing::InitDist(dist);
    for (const Case& c : CasesFor(world)) {
      Strategy strategy = *ParseStrategy(c.strategy);
      DeviceMesh mesh =
          *DeviceMesh::Create(ctx, *MeshShapeForStrategy(strategy, world, c.replicate));
      RunResult base = Train(c, Offload::kNone, mesh, rank);
      RunResult opt = Train(c, Offload::kOptimizer, mesh, rank);
      RunResult params = Train(c, Offload::kParams, mesh, rank);
      RunResult summed = Train(c, Offload::kOptimizer, mesh, rank, at::kCPU, /*on_device=*/true);
      ExpectSame(base, opt, c.Name() + " offload optimizer");
      ExpectSame(base, params, c.Name() + " offload params");
      ExpectSame(base, summed, c.Name() + " offload optimizer, accumulating on the device");
      // Accumulating on the device: one copy of each gradient shard per step, no host
      // addition; on the host, a copy per micro-batch that reduces (no_sync: the last only)
      // and an addition for each one after the first. HSDP sums its micro-batches on the
      // device either way.
      EXPECT_EQ(summed.stats.host_adds, 0);
      const int reducing = c.no_sync || c.replicate > 1 ? 1 : kMicroBatches;
      EXPECT_EQ(opt.stats.to_host_bytes, reducing * summed.stats.to_host_bytes);
      EXPECT_EQ(opt.stats.host_adds > 0, reducing > 1);
      EXPECT_EQ(summed.bytes.device, opt.bytes.device);  // nothing left on the device
      EXPECT_GT(params.stats.to_device_bytes, opt.stats.to_device_bytes);
      // Model state on the device: shards and gradients; shards only; nothing between steps.
      EXPECT_EQ(base.bytes.host, 0);
      EXPECT_GT(base.bytes.device, 0);
      EXPECT_LT(opt.bytes.device, base.bytes.device);
      EXPECT_GT(opt.bytes.host, opt.bytes.device);
      EXPECT_EQ(params.bytes.device, 0);
      // Offload params with bf16 compute also keeps the shards in bf16 on the host: 2 bytes
      // per parameter of shard more than offload optimizer (and with one shard 2 per trainable
      // one for the gradients that land in bf16).
      EXPECT_EQ(params.bytes.host,
                opt.bytes.host + params.host_compute_bytes + params.host_compute_grad_bytes);
      EXPECT_EQ(params.host_compute_grad_bytes > 0, c.bf16 && world == 1);
      EXPECT_EQ(2 * params.host_compute_bytes, c.bf16 ? params.host_shard_bytes : 0);
      EXPECT_GT(params.peak_loaded, 0);
      EXPECT_LE(params.peak_loaded, opt.bytes.device);
      if (c.strategy == "full_shard" && c.reshard_group == 0) {
        // The root, the current unit and the two the prefetch copies ahead: 4 of 7 units.
        EXPECT_LT(params.peak_loaded, opt.bytes.device);
      }
      if (c.bf16) {
        // Without the compute copy (Note [Compute copy]): no bf16 copies on the host; the loads
        // copy the fp32 masters (twice the bytes) and the device casts them as it does without
        // offload: the same values.
        RunResult no_copy = Train(c, Offload::kParams, mesh, rank, at::kCPU, false,
                                  /*compute_copy=*/false);
        ExpectSame(base, no_copy, c.Name() + " offload params without the compute copy");
        EXPECT_EQ(no_copy.host_compute_bytes, 0);
        EXPECT_EQ(no_copy.bytes.host, params.bytes.host - params.host_compute_bytes);
        EXPECT_EQ(no_copy.stats.to_device_bytes, 2 * params.stats.to_device_bytes);
        EXPECT_EQ(no_copy.stats.to_host_bytes, params.stats.to_host_bytes);  // unchanged
        EXPECT_EQ(no_copy.stats.refresh_s, 0);
      }
      if (rank == 0) {
        std::cout << "[offload] world " << world << " " << c.Name() << ": losses "
                  << base.losses.front() << " .. " << base.losses.back()
                  << " equal; model state bytes device/host: none " << base.bytes.device << "/"
                  << base.bytes.host << ", optimizer " << opt.bytes.device << "/" << opt.bytes.host
                  << ", params " << params.bytes.device << "/" << params.bytes.host
                  << " (peak device shards " << params.peak_loaded << ")\n";
      }
      if (::testing::Test::HasFailure()) break;
    }
  });
}

class OffloadParityTest : public ::testing::TestWithParam<int> {};

TEST_P(OffloadParityTest, EqualsTheRunWithoutOffloadBitwise) { ExpectOffloadParity(GetParam(), "p2p"); }

TEST(OffloadFlatCollectivesTest, EqualsTheRunWithoutOffloadBitwise) {
  ExpectOffloadParity(2, "gloo");
}

INSTANTIATE_TEST_SUITE_P(Worlds, OffloadParityTest, ::testing::Values(1, 2, 4),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return StrCat("w", info.param);
                         });

// Note [CPU offload]: with bf16 compute offload params loads the host's bf16 copy of each
// shard, so the same schedule of loads moves half the bytes of the fp32 run (the run itself
// equals the run without offload bit for bit: OffloadParityTest's bf16 cases). One rank (the
// loaded shard is the parameters' storage) and two (it is the all-gather's input), with
// resharding after forward (two loads per unit and micro-batch) and without.
TEST(OffloadParamsBytesTest, Bf16ComputeLoadsHalfTheBytes) {
  for (int world : {1, 2}) {
    testing::RunOnRanks(world, [&](int rank) {
      std::shared_ptr<DistContext> ctx = testing::InitDist(testing::TestDistOptions());
      for (const char* strategy : {"full_shard", "shard_grad_op"}) {
        DeviceMesh mesh =
            *DeviceMesh::Create(ctx, *MeshShapeForStrategy(*ParseStrategy(strategy), world, 1));
        RunResult fp32 = Train(Case{strategy}, Offload::kParams, mesh, rank);
        RunResult bf16 = Train(Case{strategy, 1, true}, Offload::kParams, mesh, rank);
        const std::string name = StrCat(strategy, " world ", world);
        EXPECT_GT(fp32.stats.to_device_bytes, 0) << name;
        EXPECT_EQ(2 * bf16.stats.to_device_bytes, fp32.stats.to_device_bytes) << name;
        // What is loaded at once halves too.
        EXPECT_EQ(2 * bf16.peak_loaded, fp32.peak_loaded) << name;
        EXPECT_GT(bf16.stats.refresh_s, 0) << name;
        EXPECT_EQ(fp32.stats.refresh_s, 0) << name;
        // Without resharding after forward a unit's shard stays loaded from its forward to its
        // backward: each is loaded once per micro-batch (with it, twice but for the root).
        const int64_t once = int64_t{kSteps} * kMicroBatches * bf16.host_compute_bytes;
        if (std::string(strategy) == "shard_grad_op") {
          EXPECT_EQ(bf16.stats.to_device_bytes, once) << name;
        } else {
          EXPECT_GT(bf16.stats.to_device_bytes, once) << name;
          EXPECT_LT(bf16.stats.to_device_bytes, 2 * once) << name;
        }
      }
    });
  }
}

// Note [CPU offload], "params": with one shard and bf16 compute each micro-batch's gradient goes
// to the host in bf16 (its cast to the fp32 reduce dtype is exact) and is converted or added
// into the fp32 .grad there, so the device->host bytes halve, with the same host additions
// (the run itself equals the run without offload bit for bit: OffloadParityTest's bf16 cases).
// With two shards the reduce-scatter's fp32 output is what is sent, as before.
TEST(OffloadParamsBytesTest, Bf16ComputeOneShardSendsHalfTheGradientBytes) {
  for (int world : {1, 2}) {
    testing::RunOnRanks(world, [&](int rank) {
      std::shared_ptr<DistContext> ctx = testing::InitDist(testing::TestDistOptions());
      for (const char* strategy : {"full_shard", "shard_grad_op"}) {
        DeviceMesh mesh =
            *DeviceMesh::Create(ctx, *MeshShapeForStrategy(*ParseStrategy(strategy), world, 1));
        RunResult fp32 = Train(Case{strategy}, Offload::kParams, mesh, rank);
        RunResult bf16 = Train(Case{strategy, 1, true}, Offload::kParams, mesh, rank);
        RunResult again = Train(Case{strategy, 1, true}, Offload::kParams, mesh, rank);
        const std::string name = StrCat(strategy, " world ", world);
        EXPECT_GT(fp32.stats.to_host_bytes, 0) << name;
        EXPECT_EQ((world == 1 ? 2 : 1) * bf16.stats.to_host_bytes, fp32.stats.to_host_bytes)
            << name;
        EXPECT_EQ(bf16.stats.to_host_compute_bytes, world == 1 ? bf16.stats.to_host_bytes : 0)
            << name;
        EXPECT_EQ(fp32.stats.to_host_compute_bytes, 0) << name;
        // One addition per trainable shard and micro-batch after the first, as in fp32.
        EXPECT_GT(bf16.stats.host_adds, 0) << name;
        EXPECT_EQ(bf16.stats.host_adds, fp32.stats.host_adds) << name;
        // The bf16 gradients (one shard) are added by one loop where the CPU has AVX2 (Note
        // [Host loops]); the fp32 ones by add_. The values: OffloadParityTest's bf16 cases.
        const bool loop = world == 1 && HostAddConvertedAvailable(HostNarrow::kBFloat16);
        EXPECT_EQ(bf16.stats.host_add_passes, loop ? bf16.stats.host_adds : 0) << name;
        EXPECT_EQ(fp32.stats.host_add_passes, 0) << name;
        EXPECT_GT(bf16.stats.add_s, 0) << name;
        ExpectSame(bf16, again, name + " bf16 twice");
      }
    });
  }
}

// On a GPU the offload's copies run on their own streams (Note [CPU offload]): world size 1
// on NCCL (one shard: no all-gather, the copies alone feed the unit) and 2 on Gloo with CUDA
// tensors (the copy-in stream before each all-gather). The run without offload steps AdamW on
// the GPU and the offloaded ones on the host, and the gradient norm is summed in other orders,
// so the results agree to rounding, not bitwise (atomics in some backward kernels too); in bf16
// a cast that rounds the other way after a step moves a weight by 2^-8, so bf16's tolerances.
// The memory split is as on the CPU.
void ExpectClose(const RunResult& base, const RunResult& run, const std::string& what,
                 bool bf16 = false) {
  SCOPED_TRACE(what);
  const double rel = bf16 ? 1e-2 : 1e-5, rtol = bf16 ? 5e-2 : 1e-4, atol = bf16 ? 1e-3 : 1e-6;
  ASSERT_EQ(run.losses.size(), base.losses.size());
  for (size_t i = 0; i < base.losses.size(); ++i) {
    EXPECT_NEAR(run.losses[i], base.losses[i], rel * std::abs(base.losses[i])) << "step " << i;
    EXPECT_NEAR(run.norms[i], base.norms[i], rel * std::abs(base.norms[i])) << "step " << i;
  }
  for (const auto& [name, shard] : base.shards) {
    EXPECT_TRUE(torch::allclose(run.shards.at(name), shard, rtol, atol)) << name;
  }
}

TEST(OffloadCudaTest, EqualsTheRunWithoutOffloadOnTheGpu) {
  FSDP_SKIP_WITHOUT_GPU();
  for (int world : {1, 2}) {
    testing::RunOnRanks(world, [&](int rank) {
      std::shared_ptr<DistContext> ctx = testing::InitCudaDist(world);
      ASSERT_TRUE(ctx->device().is_cuda());
      // bf16: params offload loads the bf16 host copies and, with one shard, sends bf16
      // gradients that the host converts and adds on its adder thread (Note [CPU offload]).
      for (const Case& c : {Case{"full_shard"}, Case{"shard_grad_op"},
                            Case{"full_shard", 1, /*bf16=*/true}}) {
        DeviceMesh mesh = *DeviceMesh::Create(
            ctx, *MeshShapeForStrategy(*ParseStrategy(c.strategy), world, 1));
        RunResult base = Train(c, Offload::kNone, mesh, rank, ctx->device());
        RunResult opt = Train(c, Offload::kOptimizer, mesh, rank, ctx->device());
        RunResult params = Train(c, Offload::kParams, mesh, rank, ctx->device());
        RunResult summed = Train(c, Offload::kOptimizer, mesh, rank, ctx->device(),
                                 /*on_device=*/true);
        const std::string name = StrCat(c.Name(), " world ", world);
        ExpectClose(base, summed, name + " offload optimizer, accumulating on the device", c.bf16);
        EXPECT_EQ(summed.stats.host_adds, 0) << name;
        ExpectClose(base, opt, name + " offload optimizer", c.bf16);
        ExpectClose(base, params, name + " offload params", c.bf16);
        EXPECT_EQ(base.bytes.host, 0) << name;
        EXPECT_LT(opt.bytes.device, base.bytes.device) << name;
        EXPECT_EQ(params.bytes.device, 0) << name;
        EXPECT_GT(params.peak_loaded, 0) << name;
        EXPECT_LE(params.peak_loaded, opt.bytes.device) << name;
        if (::testing::Test::HasFailure()) break;
      }
    });
  }
}

// ---- `fsdp train` ---------------------------------------------------------------------------

using testing::CommandResult;
using testing::FreshTempDir;
using testing::FsdpBinary;
using testing::RunCommand;
using testing::SourceDir;
namespace fs = std::filesystem;

using testing::TrainRun;

// configs/default.yaml on 2 ranks, 6 steps, 2 micro-batches per step.
TrainRun FsdpTrain(const std::string& dir, std::vector<std::string> sets) {
  sets.insert(sets.begin(), {"training.steps=6", "training.log_interval=1", "training.eval_interval=0",
                             "parallelism.nproc=2", "training.micro_batch_size=2",
                             "training.grad_accum_steps=2", "model.n_layers=2"});
  return testing::RunTrain(SourceDir() + "/configs/default.yaml", dir, sets);
}

std::set<std::string> CheckpointKeys(const std::string& dir) {
  std::ifstream in(dir + "/metadata.json");
  nlohmann::json metadata = nlohmann::json::parse(in);
  std::set<std::string> keys;
  for (const auto& t : metadata["tensors"]) keys.insert(t["name"].get<std::string>());
  return keys;
}

// `fsdp train configs/default.yaml --set parallelism.offload=params` end to end: losses equal
// to the run without offload up to the fused host AdamW's rounding; a checkpoint saved with
// offload holds the same keys and resumes exactly with offload, and without it to rounding.
TEST(OffloadTrainTest, TrainsCheckpointsAndResumesAcrossModes) {
  std::string none_dir = FreshTempDir("off-none"), dir = FreshTempDir("off-params");
  TrainRun none = FsdpTrain(none_dir, {"checkpoint.enabled=true", "checkpoint.interval=3"});
  ASSERT_TRUE(none.result.exit.ok()) << none.result.Output();
  TrainRun params = FsdpTrain(
      dir, {"parallelism.offload=params", "checkpoint.enabled=true", "checkpoint.interval=3"});
  ASSERT_TRUE(params.result.exit.ok()) << params.result.Output();
  ASSERT_EQ(params.losses.size(), 6u) << params.result.Output();
  ASSERT_EQ(none.losses.size(), 6u) << none.result.Output();
  for (int64_t step = 1; step <= 6; ++step) {
    // The offloaded run steps with ATen's fused AdamW: the same update, other roundings.
    EXPECT_NEAR(params.losses.at(step), none.losses.at(step), 1e-5 * none.losses.at(step))
        << "step " << step;
  }
  EXPECT_TRUE(params.result.StdoutHas("parallelism.offload: params")) << params.result.Output();
  // The trainer's rank statistics split the model state: nothing on the device after a step.
  const nlohmann::json& state = params.rank0_stats["model_state"];
  EXPECT_EQ(state["offload"], "params");
  EXPECT_EQ(state["device_bytes"], 0) << state.dump();
  EXPECT_EQ(state["host_bytes"].get<int64_t>(),
            none.rank0_stats["model_state"]["device_bytes"].get<int64_t>())
      << state.dump() << " vs " << none.rank0_stats["model_state"].dump();

  std::string step3 = dir + "/checkpoints/" + ckpt::StepDirName(3);
  EXPECT_EQ(CheckpointKeys(step3),
            CheckpointKeys(none_dir + "/checkpoints/" + ckpt::StepDirName(3)));
  for (const char* mode : {"params", "optimizer", "none"}) {
    SCOPED_TRACE(mode);
    std::string resume_dir = FreshTempDir(StrCat("off-resume-", mode));
    TrainRun resumed =
        FsdpTrain(resume_dir, {StrCat("parallelism.offload=", mode), "checkpoint.load=" + step3});
    ASSERT_TRUE(resumed.result.exit.ok()) << resumed.result.Output();
    ASSERT_EQ(resumed.losses.size(), 3u) << resumed.result.Output();
    for (int64_t step = 4; step <= 6; ++step) {
      if (std::string(mode) == "none") {  // libtorch's unfused AdamW from step 4 on
        EXPECT_NEAR(resumed.losses.at(step), params.losses.at(step), 1e-5 * params.losses.at(step))
            << "step " << step;
      } else {  // the same fused host step: exact
        EXPECT_EQ(resumed.losses.at(step), params.losses.at(step)) << "step " << step;
      }
    }
    fs::remove_all(resume_dir);
  }
  fs::remove_all(none_dir);
  fs::remove_all(dir);
}

// bf16 compute through the trainer (TrainableModel::AfterStep refreshes the host's bf16 copies
// after each step, Note [CPU offload]): offload params trains exactly as offload optimizer (the
// same host AdamW; the same casts, on the host instead of the device), and its rank statistics
// count half the host->device bytes per step of the fp32 run.
TEST(OffloadTrainTest, Bf16ParamsLoadHalfTheBytesPerStep) {
  std::string fp32_dir = FreshTempDir("off-params-fp32"), bf16_dir = FreshTempDir("off-params-bf16"),
              opt_dir = FreshTempDir("off-opt-bf16");
  TrainRun fp32 = FsdpTrain(fp32_dir, {"parallelism.offload=params"});
  ASSERT_TRUE(fp32.result.exit.ok()) << fp32.result.Output();
  TrainRun bf16 =
      FsdpTrain(bf16_dir, {"parallelism.offload=params", "training.mixed_precision=bf16"});
  ASSERT_TRUE(bf16.result.exit.ok()) << bf16.result.Output();
  TrainRun opt =
      FsdpTrain(opt_dir, {"parallelism.offload=optimizer", "training.mixed_precision=bf16"});
  ASSERT_TRUE(opt.result.exit.ok()) << opt.result.Output();
  ASSERT_EQ(bf16.losses.size(), 6u) << bf16.result.Output();
  EXPECT_EQ(bf16.losses, opt.losses);
  const nlohmann::json& per_step_fp32 = fp32.rank0_stats["offload"]["per_step"];
  const nlohmann::json& per_step_bf16 = bf16.rank0_stats["offload"]["per_step"];
  EXPECT_GT(per_step_fp32["to_device_bytes"].get<int64_t>(), 0) << per_step_fp32.dump();
  EXPECT_EQ(2 * per_step_bf16["to_device_bytes"].get<int64_t>(),
            per_step_fp32["to_device_bytes"].get<int64_t>())
      << per_step_bf16.dump() << " vs " << per_step_fp32.dump();
  EXPECT_GT(per_step_bf16["refresh_ms"].get<double>(), 0) << per_step_bf16.dump();
  // Two shards: the gradients go as the reduce-scatter's fp32 output, added on the host
  // (Note [CPU offload], "Host additions"): one addition per trainable shard per step here.
  EXPECT_EQ(per_step_bf16["to_host_bytes"], per_step_fp32["to_host_bytes"]) << per_step_bf16.dump();
  EXPECT_EQ(per_step_bf16["to_host_compute_bytes"], 0) << per_step_bf16.dump();
  EXPECT_GT(per_step_bf16["host_adds"].get<int64_t>(), 0) << per_step_bf16.dump();
  // Late: additions, and the norm's terms the adder computes after them (Note [Deferred
  // clipping multiplication]), one per trainable shard per step.
  EXPECT_EQ(per_step_bf16["clip_terms_on_adder"], per_step_bf16["host_adds"])
      << per_step_bf16.dump();
  EXPECT_LE(per_step_bf16["late_adds"].get<int64_t>(),
            per_step_bf16["host_adds"].get<int64_t>() +
                per_step_bf16["clip_terms_on_adder"].get<int64_t>())
      << per_step_bf16.dump();
  // The host holds the bf16 copies too: 2 bytes per parameter of shard beyond the fp32 run's.
  const int64_t host_fp32 = fp32.rank0_stats["model_state"]["host_bytes"].get<int64_t>();
  const int64_t host_bf16 = bf16.rank0_stats["model_state"]["host_bytes"].get<int64_t>();
  EXPECT_GT(host_bf16, host_fp32);
  EXPECT_LT(host_bf16, host_fp32 * 3 / 2);
  fs::remove_all(fp32_dir);
  fs::remove_all(bf16_dir);
  fs::remove_all(opt_dir);
}

TEST(OffloadTrainTest, RefusedWithoutTheFsdpWrapper) {
  std::string dir = FreshTempDir("off-none-strategy");
  TrainRun run = FsdpTrain(
      dir, {"parallelism.strategy=none", "parallelism.nproc=1", "parallelism.offload=optimizer"});
  EXPECT_EQ(run.result.exit.code, 2) << run.result.Output();
  EXPECT_TRUE(run.result.StderrHas("parallelism.offload")) << run.result.Output();
  fs::remove_all(dir);
}

// Note [Host loops]: the bf16 / fp16 gradient's one-loop addition gives what ATen's
// conversion and add_ give, bit for bit, over sizes with a tail, one part and several (parts of
// 2^16 elements and more), and sums that round (values of mixed magnitude).
TEST(HostLoopsTest, AddConvertedEqualsAtensConversionAndAddBitwise) {
  for (const auto& [dtype, narrow] : {std::pair{at::kBFloat16, HostNarrow::kBFloat16},
                                      std::pair{at::kHalf, HostNarrow::kHalf}}) {
    if (!HostAddConvertedAvailable(narrow)) {
      std::cout << "[host loops] no AVX2 / F16C here: " << dtype << " not checked\n";
      continue;
    }
    for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{8}, int64_t{1000}, int64_t{65536 + 9},
                      int64_t{1000003}}) {
      SCOPED_TRACE(StrCat(c10::toString(dtype), " n ", n));
      at::manual_seed(static_cast<uint64_t>(n));
      const at::Tensor dst = at::randn({n}) * at::exp(at::randn({n}) * 4);
      const at::Tensor src = (at::randn({n}) * 3).to(dtype);
      const at::Tensor expected = dst.clone().add_(src.to(at::kFloat));
      at::Tensor got = dst.clone();
      HostAddConverted(got.data_ptr<float>(), static_cast<const uint16_t*>(src.const_data_ptr()),
                       narrow, n);
      EXPECT_TRUE(at::equal(got, expected)) << (got - expected).abs().max().item<float>();
      EXPECT_FALSE(at::equal(got, dst));  // it added something
    }
  }
}

// Note [Deferred clipping multiplication]: the adder computes the norm's terms with ATen's sum
// on its own thread, and the norm keeps its bits only if that sum splits its work as it does on
// the training thread. ATen gives a thread the process's count at its first parallel op: sums of
// squares on a fresh thread equal the calling thread's at 2, 3 and 4 threads. The control: the
// same sums on 1 thread round differently for at least one of them, so these sizes show a split.
TEST(HostLoopsTest, SumsOfSquaresOnAnotherThreadAreTheSame) {
  const int before = at::get_num_threads();
  at::manual_seed(7);
  std::vector<at::Tensor> grads;
  for (int64_t n :
       {int64_t{1} << 20, (int64_t{1} << 20) + 13, int64_t{3} << 20, int64_t{5000011}}) {
    grads.push_back(at::randn({n}));
  }
  at::set_num_threads(1);
  const std::vector<at::Tensor> serial = ClipNormTerms(grads);
  bool split_shows = false;
  for (int threads : {2, 3, 4}) {
    SCOPED_TRACE(StrCat(threads, " threads"));
    at::set_num_threads(threads);
    const std::vector<at::Tensor> here = ClipNormTerms(grads);
    std::vector<at::Tensor> there;
    std::thread([&] { there = ClipNormTerms(grads); }).join();
    ASSERT_EQ(there.size(), grads.size());
    for (size_t i = 0; i < grads.size(); ++i) {
      EXPECT_TRUE(at::equal(here[i], there[i]))
          << grads[i].numel() << " elements: " << here[i].item<float>() << " here, "
          << there[i].item<float>() << " on another thread";
      split_shows = split_shows || !at::equal(here[i], serial[i]);
    }
  }
  at::set_num_threads(before);
  EXPECT_TRUE(split_shows) << "no size rounds differently on 1 thread: the test shows nothing";
}

// Every element in exactly one part, parts beginning at multiples of 16, with one thread, the
// default and more threads than cores (SetHostLoopThreads grows the pool), and again while
// another thread spins on a core (a part a slowed thread would hold is claimed by the others).
TEST(HostLoopsTest, ParallelForCoversEachElementOnce) {
  const int default_threads = HostLoopThreads();
  std::atomic<bool> stop{false};
  for (const auto& [busy, threads] :
       {std::pair{false, 1}, std::pair{false, default_threads}, std::pair{false, 5},
        std::pair{true, default_threads}, std::pair{true, 3}}) {
    EXPECT_EQ(SetHostLoopThreads(threads), default_threads);
    EXPECT_EQ(HostLoopThreads(), threads);
    std::thread spinner;
    if (busy) {
      spinner = std::thread([&] {
        while (!stop.load(std::memory_order_relaxed)) {
        }
      });
    }
    for (int64_t n : {int64_t{1}, int64_t{15}, int64_t{16}, int64_t{4096 + 3}, int64_t{300001}}) {
      std::vector<int> seen(static_cast<size_t>(n), 0);
      std::atomic<int> calls{0};
      HostParallelFor(n, 1024, [&](int64_t begin, int64_t end) {
        EXPECT_EQ(begin % 16, 0);
        EXPECT_LT(begin, end);
        for (int64_t i = begin; i < end; ++i) ++seen[static_cast<size_t>(i)];
        ++calls;
      });
      EXPECT_EQ(std::count(seen.begin(), seen.end(), 1), n)
          << "n " << n << " busy " << busy << " threads " << threads;
      EXPECT_LE(calls.load(), std::max<int64_t>(1, (n + 1023) / 1024)) << n;
    }
    stop = true;
    if (spinner.joinable()) spinner.join();
    stop = false;
    SetHostLoopThreads(default_threads);
  }
  EXPECT_GE(default_threads, 1);
}

}  // namespace
}  // namespace fsdp
