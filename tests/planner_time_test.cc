// The planner's step time (planner/cost_model.cc): collectives against the engine's, the
// device's and the host's optimizer step, the overlapped step and the delayed update.
#include <sys/wait.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "absl/strings/str_split.h"
#include "common/strings.h"
#include "models/gpt/gpt.h"
#include "planner/cost_model.h"
#include "planner/search.h"
#include "tests/planner_testing.h"

namespace fsdp::plan {
namespace {

using ::testing::HasSubstr;
TEST(CommTest, FullShardSendsOneAndAHalfTimesDdp) {
  for (int n : {2, 8, 64}) {
    const int64_t p = 1000000;
    double ddp = TheoryWireBytesPerStep(p, 4, Strategy::kNoShard, n, 1, 1);
    EXPECT_DOUBLE_EQ(ddp, 2.0 * (n - 1) / n * p * 4);
    EXPECT_DOUBLE_EQ(TheoryWireBytesPerStep(p, 4, Strategy::kFullShard, 1, n, 1), 1.5 * ddp);
    EXPECT_DOUBLE_EQ(TheoryWireBytesPerStep(p, 4, Strategy::kShardGradOp, 1, n, 1), ddp);
    EXPECT_DOUBLE_EQ(TheoryWireBytesPerStep(p, 4, Strategy::kNoShard, n, 1, 3), 3 * ddp);
  }
  // HSDP 2x4: per micro-batch 3 x (3/4) x buffer in the shard group, once 2 x (1/2) x buffer / 4.
  EXPECT_DOUBLE_EQ(TheoryWireBytesPerStep(100, 4, Strategy::kHybridShard, 2, 4, 2),
                   2 * 3 * 0.75 * 400 + 1.0 * 400 / 4);
}

TEST(CommTest, PredictedTimesFollowTheEngine) {
  // fp32 everywhere, no latency: FULL_SHARD moves every block twice (forward, backward) and the
  // root once (it never reshards after forward), plus one reduce-scatter of everything; DDP one
  // all-reduce of everything: ratio (3P - root) / 2P.
  PlanRequest r = Request("default", 8, 8, "h100");
  r.hw = FlatLink();
  ModelCounts c = CountModel(r.config.model);
  Prediction full = *Predict(r, {Strategy::kFullShard, 1, 8});
  Prediction ddp = *Predict(r, {Strategy::kNoShard, 8, 1});
  const double p = static_cast<double>(c.params), root = static_cast<double>(c.unit_params[0]);
  EXPECT_NEAR((full.time.all_gather_s + full.time.reduce_scatter_s) / ddp.time.all_reduce_s,
              (3 * p - root) / (2 * p), 1e-12);
  EXPECT_NEAR(ddp.time.all_reduce_s, 2 * 7.0 / 8 * p * 4 / r.hw.intra_node_bw, 1e-15);
  EXPECT_EQ(full.time.all_reduce_s, 0);
  EXPECT_EQ(ddp.time.all_gather_s, 0);
  // Exposed communication never exceeds communication; step = compute + optimizer + exposed.
  for (const Prediction& x : {full, ddp}) {
    EXPECT_LE(x.time.exposed_comm_s, x.time.comm_s + 1e-15);
    EXPECT_DOUBLE_EQ(x.time.step_s, x.time.compute_s + x.time.optimizer_s + x.time.exposed_comm_s);
  }
}

TEST(CommTest, GroupsSpanningNodesUseTheNetwork) {
  // 2 nodes x 8: full_shard over 16 ranks crosses nodes, hybrid 2x8 keeps gathers on NVLink.
  PlanRequest r = Request("llama_1b", 16, 8, "h100");
  r.hw.intra_node_latency_s = r.hw.inter_node_latency_s = 0;
  r.hw.intra_node_bw = 8 * r.hw.inter_node_bw * 4;  // make the network the bottleneck
  Prediction full = *Predict(r, {Strategy::kFullShard, 1, 16});
  Prediction hybrid = *Predict(r, {Strategy::kHybridShard, 2, 8});
  EXPECT_GT(full.time.all_gather_s, 3 * hybrid.time.all_gather_s);
  EXPECT_GT(hybrid.time.all_reduce_s, 0);
}

// Note [Offload]: the host step overlapped with the next forward (the default) exposes only
// what the forward does not hide, on a GPU; on a CPU profile, where both need the same cores,
// it costs the whole step, as FSDP_OFFLOAD_OVERLAP_STEP=0 does everywhere. With an
// optimizer the one loop does not step (foreach) the host's bytes are the same either way: with
// bf16 offload params the overlapped step converts, updates and casts a slice at a time,
// measured at the separate passes' speed (Note [Deferred gradient conversion]), with or without
// grad_sync: last. (The one loop's fewer bytes: HostAdamPassCountsItsBytes.)
TEST(CostModelTest, OverlappedHostStepHidesBehindTheNextForwardOnAGpu) {
  for (const char* mode : {"optimizer", "params"}) {
    for (const char* sync : {"training.grad_sync=every", "training.grad_sync=last"}) {
      SCOPED_TRACE(StrCat(mode, " ", sync));
      const std::string offload = StrCat("parallelism.offload=", mode);
      const char* aten = "optimizer.implementation=foreach";
      for (const char* gpu : {"h100", "cpu"}) {
        Prediction on = *Predict(Request("llama_1b", 1, 1, gpu, {offload, sync, aten}),
                                 {Strategy::kFullShard, 1, 1});
        ScopedEnv in_place(kOverlapKnob, "0");
        Prediction off = *Predict(Request("llama_1b", 1, 1, gpu, {offload, sync, aten}),
                                  {Strategy::kFullShard, 1, 1});
        EXPECT_GT(on.time.optimizer_s, 0) << gpu;
        if (std::string(gpu) == "cpu") {
          EXPECT_EQ(on.time.optimizer_s, off.time.optimizer_s);
          continue;
        }
        // Hidden: at most the first forward's blocks, never the root's and first block's step.
        EXPECT_LT(on.time.optimizer_s, off.time.optimizer_s);
        EXPECT_LE(off.time.optimizer_s - on.time.optimizer_s, on.time.compute_s / 3);
        EXPECT_NEAR(on.time.step_s - on.time.optimizer_s, off.time.step_s - off.time.optimizer_s,
                    1e-9);
      }
    }
  }
}

// Note [Offload]: the delayed update (opt in) runs behind the whole next step on a GPU:
// exposed only beyond the device's step, at 1.2x (kHostBesideStepCost), never more than the
// overlapped step's; nothing changes on a CPU profile. Offload params keeps a second loaded copy
// and landing buffer on the host (bf16: 2 + 2 bytes per parameter), offload optimizer nothing
// more. With ATen's passes (foreach), whose bytes the step in place moves too.
TEST(CostModelTest, DelayedUpdateHidesBehindTheNextStepOnAGpu) {
  for (const char* mode : {"optimizer", "params"}) {
    SCOPED_TRACE(mode);
    const std::vector<std::string> base = {StrCat("parallelism.offload=", mode),
                                           "training.grad_accum_steps=4",
                                           "parallelism.reshard_between_micro_batches=false",
                                           "training.grad_sync=last",
                                           "optimizer.implementation=foreach"};
    std::vector<std::string> delayed = base;
    delayed.push_back("parallelism.offload_delayed_update=on");
    for (const char* gpu : {"h100", "cpu"}) {
      Prediction on = *Predict(Request("llama_1b", 1, 1, gpu, delayed), {Strategy::kFullShard, 1, 1});
      Prediction off = *Predict(Request("llama_1b", 1, 1, gpu, base), {Strategy::kFullShard, 1, 1});
      if (std::string(gpu) == "cpu") {
        EXPECT_EQ(on.time.optimizer_s, off.time.optimizer_s);
        continue;
      }
      EXPECT_LT(on.time.optimizer_s, off.time.optimizer_s);
      const double device_s = on.time.compute_s + on.time.exposed_comm_s + on.time.exposed_copy_s;
      EXPECT_GE(on.time.step_s, device_s);
      // The host's work (the step in place's: one landing, nothing added behind compute) at the
      // 1.2x it measured beside the device's step on the H100 machine, beyond that step.
      Prediction in_place;
      {
        ScopedEnv step_in_place(kOverlapKnob, "0");
        in_place = *Predict(Request("llama_1b", 1, 1, gpu, base), {Strategy::kFullShard, 1, 1});
      }
      EXPECT_NEAR(on.time.optimizer_s,
                  std::max(0.0, 1.2 * in_place.time.optimizer_s - device_s), 1e-9);
      if (std::string(mode) == "params") {
        EXPECT_GT(on.time.optimizer_s, 0);  // llama_1b at 2 x 4: the host's work is the longer
      }
      EXPECT_NEAR(on.time.step_s - on.time.optimizer_s, off.time.step_s - off.time.optimizer_s, 1e-9);
      const double extra = on.memory.host - off.memory.host;
      if (std::string(mode) == "optimizer") {
        EXPECT_EQ(extra, 0);
      } else {
        EXPECT_NEAR(extra / 9.53e8, 4.0, 0.05);  // 2 + 2 bytes per parameter (padding aside)
      }
    }
  }
}

// Without offload the device's step moves, per parameter of the shard: clipping's norm (4 on
// a GPU; 12 on a CPU, whose squares are a temporary) and multiplication (8, every step: the
// trainer logs the norm), the update (fused Adam(W) 28, the foreach ops 80 + AdamW's decay 8,
// fused SGD with momentum 20), and after each reduction (several shards) the division of the
// reduce output (8) and the gradient shard written from it (8, 12 when adding to it). A GPU
// at memory_bw; a CPU profile at host_memory_bw, the fused AdamW's rate over the node.
TEST(CostModelTest, DeviceStepCountsItsBytes) {
  const PlanRequest probe = Request("llama_1b", 1, 1, "h100");
  const double p = static_cast<double>(CountModel(probe.config.model).params);
  auto optimizer_s = [&](const char* gpu, const Layout& layout,
                         const std::vector<std::string>& sets) {
    return Predict(Request("llama_1b", layout.replicate * layout.shard,
                           layout.replicate * layout.shard, gpu, sets),
                   layout)
        ->time.optimizer_s;
  };
  const Layout one = {Strategy::kFullShard, 1, 1};
  const double bw = probe.hw.memory_bw;
  EXPECT_NEAR(optimizer_s("h100", one, {}), p * (4 + 8 + 28) / bw, 1e-12);
  EXPECT_NEAR(optimizer_s("h100", one, {"optimizer.implementation=foreach"}),
              p * (4 + 8 + 88) / bw, 1e-12);
  EXPECT_NEAR(optimizer_s("h100", one, {"optimizer.implementation=per_tensor"}),
              p * (4 + 8 + 88) / bw, 1e-12);
  EXPECT_NEAR(optimizer_s("h100", one, {"optimizer.name=sgd"}), p * (4 + 8 + 20) / bw, 1e-12);
  // Clipping off: the trainer still computes the norm (it logs it), but multiplies nothing.
  EXPECT_NEAR(optimizer_s("h100", one, {"training.max_grad_norm=0"}), p * (4 + 28) / bw, 1e-12);
  // Two shards: each rank's half, and the reduction's division and write (fp32 reduce).
  const Layout two = {Strategy::kFullShard, 1, 2};
  EXPECT_NEAR(optimizer_s("h100", two, {"training.grad_accum_steps=1"}),
              p / 2 * (4 + 8 + 28 + 8 + 8) / bw, 1e-12);
  // Four micro-batches (llama_1b's): four reductions, three of them added to the shard.
  EXPECT_NEAR(optimizer_s("h100", two, {}),
              p / 2 * (4 + 8 + 28 + 4 * (8 + 8) + 3 * 4) / bw, 1e-12);
  const PlanRequest cpu = Request("llama_1b", 1, 1, "cpu");
  EXPECT_NEAR(optimizer_s("cpu", one, {}), p * (12 + 8 + 28) / cpu.hw.host_memory_bw, 1e-9);
  // On a CPU profile the host is the device: offload only adds copies, whatever the run.
  for (const char* config : {"default", "llama_1b"}) {
    for (int world : {1, 2}) {
      SCOPED_TRACE(StrCat(config, " at ", world));
      const Layout layout = {Strategy::kFullShard, 1, world};
      const double none =
          Predict(Request(config, world, world, "cpu"), layout)->time.tokens_per_s;
      for (const char* mode : {"optimizer", "params"}) {
        EXPECT_LT(Predict(Request(config, world, world, "cpu",
                                  {StrCat("parallelism.offload=", mode)}),
                          layout)
                      ->time.tokens_per_s,
                  none)
            << mode;
      }
    }
  }
}

// Note [Host Adam pass] (engine/host_adam.cc): with the overlapped step and fused AdamW (the
// defaults) the host steps each parameter in one loop over 24 bytes (the master and moments,
// read and written), the gradient it reads (bf16 as it landed alone; else fp32, whose clipping
// norm reads it once more) and the bf16 copy it writes, at kHostLoopCost (1.2) times the fused
// AdamW's time per byte. On a CPU profile nothing hides the step: its time is those bytes.
// Without the loop (foreach, or the step in place) ATen's passes: the conversion, the step and
// clipping's read, the refresh's cast; clipping's multiplication of an fp32 gradient.
TEST(CostModelTest, HostAdamPassCountsItsBytes) {
  const PlanRequest probe = Request("llama_1b", 1, 1, "cpu");
  double bw = probe.hw.host_memory_bw;  // a CPU profile's optimizer passes run at this rate
  if (probe.hw.host_rank_bw > 0) bw = std::min(bw, probe.hw.host_rank_bw);
  const double p = static_cast<double>(CountModel(probe.config.model).params);
  auto optimizer_s = [&](const std::vector<std::string>& sets) {
    return Predict(Request("llama_1b", 1, 1, "cpu", sets), {Strategy::kFullShard, 1, 1})
        ->time.optimizer_s;
  };
  auto with = [](std::vector<std::string> sets, const char* more) {
    sets.push_back(more);
    return sets;
  };
  // bf16 offload params, one gradient landing per step: read as it landed, the copy written.
  const std::vector<std::string> params = {"parallelism.offload=params",
                                           "training.grad_accum_steps=4",
                                           "training.grad_sync=last"};
  EXPECT_NEAR(optimizer_s(params), p * (24 + 2 + 2) * 1.2 / bw, 1e-9);
  // Offload optimizer: the fp32 gradient, read by the norm too; no loaded copy.
  EXPECT_NEAR(optimizer_s({"parallelism.offload=optimizer"}), p * ((24 + 4) * 1.2 + 4) / bw,
              1e-9);
  // ATen's passes: the conversion (8 bytes, at twice), the step with clipping's read (32), the
  // refresh's cast (4 + 2, at twice).
  const double aten = p * (8 * 2 + 32 + 6 * 2) / bw;
  EXPECT_NEAR(optimizer_s(with(params, "optimizer.implementation=foreach")), aten, 1e-9);
  {
    ScopedEnv in_place(kOverlapKnob, "0");
    EXPECT_NEAR(optimizer_s(params), aten, 1e-9);
  }
  EXPECT_NEAR(optimizer_s(with(params, "optimizer.name=adam")), aten, 1e-9);  // L2 decay
  // An fp32 gradient's: the step with clipping's read (32) and its multiplication (8).
  EXPECT_NEAR(optimizer_s({"parallelism.offload=optimizer", "optimizer.implementation=foreach"}),
              p * (32 + 8) / bw, 1e-9);
  // Without clipping, neither the norm's read nor the multiplication.
  EXPECT_NEAR(optimizer_s({"parallelism.offload=optimizer", "training.max_grad_norm=0"}),
              p * (24 + 4) * 1.2 / bw, 1e-9);
  EXPECT_NEAR(optimizer_s({"parallelism.offload=optimizer", "optimizer.implementation=foreach",
                           "training.max_grad_norm=0"}),
              p * 32 / bw, 1e-9);
  // A profile's own costs (fsdp plan --calibrate-host) replace the built-in 1.2 and 1.1.
  PlanRequest calibrated = Request("llama_1b", 1, 1, "cpu", params);
  calibrated.hw.host_loop_cost = 2;
  EXPECT_NEAR(Predict(calibrated, {Strategy::kFullShard, 1, 1})->time.optimizer_s,
              p * (24 + 2 + 2) * 2 / bw, 1e-9);
  // The bf16 additions (4 micro-batches summed on the host): 3 of 12 bytes each, at the cost
  // given, beside the step from the summed fp32 gradient and the first one's conversion.
  const std::vector<std::string> sums = {"parallelism.offload=params",
                                         "training.grad_accum_steps=4"};
  PlanRequest fast = Request("llama_1b", 1, 1, "h100", sums);
  fast.hw.host_add_loop_cost = 1;
  PlanRequest slow = fast;
  slow.hw.host_add_loop_cost = 3;
  const double fast_s = Predict(fast, {Strategy::kFullShard, 1, 1})->time.optimizer_s;
  const double slow_s = Predict(slow, {Strategy::kFullShard, 1, 1})->time.optimizer_s;
  // Only what the additions take beyond the 3 micro-batches' compute is exposed: more at cost
  // 3 for llama_1b on one H100, by at most the extra time of their bytes.
  const double host_bw = std::min(fast.hw.host_memory_bw, fast.hw.host_rank_bw);
  EXPECT_GT(slow_s, fast_s);
  EXPECT_LE(slow_s - fast_s, p * 3 * 12 * (3 - 1) / host_bw + 1e-9);
}

}  // namespace
}  // namespace fsdp::plan
