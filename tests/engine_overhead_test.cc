// The engine's per-step overhead under gradient accumulation: with
// reshard_between_micro_batches = false the units are gathered (cast, with one shard) once per
// step instead of once or twice per micro-batch, with the same arithmetic bit for bit, the
// memory documented in Note [Keeping parameters across micro-batches] (fsdp_model.h), and a
// steady-state step that allocates the same every time and less than with resharding.
#include <torch/torch.h>

#include <gtest/gtest.h>

#include "common/strings.h"
#include "sharding/fsdp_model.h"
#include "sharding/memory_tracker.h"
#include "tests/multirank.h"
#include "tests/tiny_gpt.h"

namespace fsdp {
namespace {

using testing::TinyGpt;
using testing::TinyGptConfig;

constexpr int kSteps = 3;
constexpr int64_t kMicroBatch = 2;  // sequences per rank per micro-batch

struct Case {
  std::string strategy = "full_shard";
  int world = 1;
  int replicate = 1;
  int micro_batches = 3;
  bool sync_last = false;  // training.grad_sync: last
  bool keep = false;       // reshard_between_micro_batches = false
  bool bf16 = true;
  ActivationCheckpointing checkpointing;
  Offload offload = Offload::kNone;
  std::string Name() const {
    return StrCat(strategy, " w", world, " k", micro_batches, sync_last ? " sync_last" : "",
                  keep ? " keep" : "", bf16 ? " bf16" : "",
                  checkpointing.enabled() ? " checkpointed" : "",
                  offload != Offload::kNone ? StrCat(" offload ", OffloadName(offload)) : "");
  }
};

struct TrainRun {
  std::vector<at::Tensor> losses;    // per micro-batch
  std::vector<at::Tensor> params;    // final local shards
  std::vector<int64_t> unshards;     // per step
  std::vector<int64_t> allocations;  // per step (CPU tracker; meaningful when installed first)
  MemoryStats memory;                // of the last step
  int num_units = 0;
  int64_t block_unsharded_bytes = 0;  // every non-root unit's unsharded parameters
};

TrainRun Train(const Case& c, int rank) {
  TinyGptConfig config;
  torch::manual_seed(7);
  TinyGpt model(config);
  std::shared_ptr<DistContext> ctx = testing::InitDist();
  const Strategy strategy = *ParseStrategy(c.strategy);
  DeviceMesh mesh = *DeviceMesh::Create(ctx, *MeshShapeForStrategy(strategy, c.world, c.replicate));
  FsdpOptions options = OptionsForStrategy(strategy);
  if (c.bf16) {
    options.mixed_precision.param_dtype = at::kBFloat16;
    options.mixed_precision.reduce_dtype = at::kFloat;
    options.mixed_precision.output_dtype = at::kFloat;
  }
  options.reshard_between_micro_batches = !c.keep;
  options.activation_checkpointing = c.checkpointing;
  options.offload = c.offload;
  auto units = SelectUnits(*model, {.module_types = {"fsdp::testing::BlockImpl"}});
  absl::StatusOr<std::unique_ptr<FsdpModel>> wrapped =
      FsdpModel::Wrap(model.ptr(), mesh, units, options);
  if (!wrapped.ok()) throw std::runtime_error(std::string(wrapped.status().message()));
  FsdpModel& fsdp = **wrapped;
  torch::optim::AdamW opt(fsdp.parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.1));

  TrainRun run;
  for (const FsdpUnit* unit : fsdp.units()) {
    if (unit->params().empty()) continue;
    ++run.num_units;
    if (unit->is_root()) continue;
    for (const FsdpParam& p : unit->params()) run.block_unsharded_bytes += p.unsharded_nbytes();
  }
  const int dp = mesh.shape().num_ranks();
  CpuMemoryTracker& tracker = CpuMemoryTracker::Install();
  for (int step = 0; step < kSteps + 2; ++step) {
    torch::manual_seed(100 + step);
    const int64_t global = dp * kMicroBatch * c.micro_batches;
    torch::Tensor x = torch::randint(config.vocab, {global, config.seq});
    torch::Tensor y = torch::randint(config.vocab, {global, config.seq});
    const int64_t unshards_before = fsdp.unshards();
    const int64_t allocations_before = tracker.allocations();
    fsdp.ResetMemoryStats();
    for (int m = 0; m < c.micro_batches; ++m) {
      const bool last = m == c.micro_batches - 1;
      // As engine/trainable.cc's BeginMicroBatch.
      if (c.sync_last) fsdp.set_requires_gradient_sync(last);
      if (c.keep) fsdp.set_reshard_after_backward(last);
      const int64_t begin = (rank * c.micro_batches + m) * kMicroBatch;
      torch::Tensor logits = model->forward(x.narrow(0, begin, kMicroBatch));
      torch::Tensor loss =
          torch::nn::functional::cross_entropy(logits.reshape({-1, config.vocab}),
                                               y.narrow(0, begin, kMicroBatch).reshape({-1})) /
          c.micro_batches;
      loss.backward();
      run.losses.push_back(loss.detach());
    }
    fsdp.ClipGradNorm(1.0);
    opt.step();
    fsdp.CopyShardsToDevice();
    opt.zero_grad();
    EXPECT_EQ(fsdp.NumUnshardedUnits(), 0) << "step " << step;
    run.unshards.push_back(fsdp.unshards() - unshards_before);
    run.allocations.push_back(tracker.allocations() - allocations_before);
    run.memory = fsdp.memory_stats();
  }
  for (const at::Tensor& p : fsdp.parameters()) run.params.push_back(p.detach().clone());
  return run;
}

// The same case with and without resharding between micro-batches: identical losses and
// parameters, bit for bit (the same casts of the same shards, the same gradient arithmetic),
// casts/gathers per step from units x micro-batches x (2 full_shard, 1 shard_grad_op) down to
// units, and every unit unsharded at once.
void ExpectKeepingChangesOnlyTheGathers(Case c, int rank) {
  SCOPED_TRACE(c.Name());
  c.keep = false;
  const TrainRun resharded = Train(c, rank);
  c.keep = true;
  const TrainRun kept = Train(c, rank);
  ASSERT_EQ(resharded.losses.size(), kept.losses.size());
  for (size_t i = 0; i < kept.losses.size(); ++i) {
    EXPECT_TRUE(torch::equal(resharded.losses[i], kept.losses[i]))
        << "micro-batch " << i << ": " << resharded.losses[i].item<double>() << " vs "
        << kept.losses[i].item<double>();
  }
  ASSERT_EQ(resharded.params.size(), kept.params.size());
  for (size_t i = 0; i < kept.params.size(); ++i) {
    EXPECT_TRUE(torch::equal(resharded.params[i], kept.params[i])) << "parameter " << i;
  }
  const bool ddp = c.strategy == "no_shard";
  const bool full = c.strategy == "full_shard" || c.strategy == "hybrid_shard";
  const int blocks = kept.num_units - 1;
  const int64_t per_micro_batch = 1 + blocks * (full && !ddp ? 2 : 1);
  for (int step = 0; step < kSteps + 2; ++step) {
    EXPECT_EQ(kept.unshards[step], kept.num_units) << "step " << step;
    EXPECT_EQ(resharded.unshards[step], per_micro_batch * c.micro_batches) << "step " << step;
  }
  // Every block unsharded at once, with all of its parameters.
  EXPECT_EQ(kept.memory.peak_unsharded_units, blocks);
  EXPECT_GE(kept.memory.peak_unsharded_bytes, kept.block_unsharded_bytes);
  if (full && !ddp) {
    EXPECT_LE(resharded.memory.peak_unsharded_units, 2);  // max_unsharded_units
  }
  if (rank == 0) {
    std::cout << "[overhead] " << c.Name() << ": unshards/step " << resharded.unshards.back()
              << " -> " << kept.unshards.back() << ", peak unsharded units "
              << resharded.memory.peak_unsharded_units << " -> " << kept.memory.peak_unsharded_units
              << ", bytes " << resharded.memory.peak_unsharded_bytes << " -> "
              << kept.memory.peak_unsharded_bytes << "\n";
  }
}

std::vector<Case> Grid(int world) {
  std::vector<Case> cases;
  for (std::string strategy : {"full_shard", "shard_grad_op"}) {
    for (int k : {1, 3}) {
      for (bool sync_last : {false, true}) {
        Case c;
        c.strategy = strategy;
        c.world = world;
        c.micro_batches = k;
        c.sync_last = sync_last;
        cases.push_back(c);
      }
    }
  }
  return cases;
}

TEST(KeepAcrossMicroBatchesTest, OneRankMatchesBitForBit) {
  testing::RunOnRanks(1, [](int rank) {
    for (const Case& c : Grid(1)) ExpectKeepingChangesOnlyTheGathers(c, rank);
    Case fp32;
    fp32.bf16 = false;  // one shard, no cast: the parameters alias the shards either way
    ExpectKeepingChangesOnlyTheGathers(fp32, rank);
  });
}

TEST(KeepAcrossMicroBatchesTest, TwoRanksMatchBitForBit) {
  testing::RunOnRanks(2, [](int rank) {
    for (const Case& c : Grid(2)) ExpectKeepingChangesOnlyTheGathers(c, rank);
  });
}

TEST(KeepAcrossMicroBatchesTest, ComposesWithCheckpointingOffloadAndDdp) {
  testing::RunOnRanks(2, [](int rank) {
    Case c;
    c.world = 2;
    c.checkpointing.mode = ActivationCheckpointing::Mode::kFull;
    ExpectKeepingChangesOnlyTheGathers(c, rank);
    c.checkpointing = {};
    for (Offload offload : {Offload::kOptimizer, Offload::kParams}) {
      c.offload = offload;
      ExpectKeepingChangesOnlyTheGathers(c, rank);
    }
    c.offload = Offload::kNone;
    c.strategy = "no_shard";
    c.sync_last = true;
    ExpectKeepingChangesOnlyTheGathers(c, rank);
  });
}

TEST(KeepAcrossMicroBatchesTest, ComposesWithHybridSharding) {
  testing::RunOnRanks(4, [](int rank) {
    Case c;
    c.strategy = "hybrid_shard";
    c.world = 4;
    c.replicate = 2;
    ExpectKeepingChangesOnlyTheGathers(c, rank);
  });
}

// Steady state at one rank, bf16, three micro-batches: every step after the first two
// (AdamW's state is created in the first) allocates exactly as many tensors as the one
// before, and keeping the parameters saves at least one allocation per parameter for every
// cast it avoids.
TEST(KeepAcrossMicroBatchesTest, SteadyStateAllocationsDoNotGrow) {
  testing::RunOnRanks(1, [](int rank) {
    CpuMemoryTracker::Install();  // before the model: its parameters' storage is counted
    at::set_num_threads(1);       // kernels' per-thread buffers: one fixed count
    Case c;
    const TrainRun resharded = Train(c, rank);
    c.keep = true;
    const TrainRun kept = Train(c, rank);
    for (const TrainRun* run : {&resharded, &kept}) {
      for (int step = 3; step < kSteps + 2; ++step) {
        EXPECT_EQ(run->allocations[step], run->allocations[2]) << "step " << step;
      }
    }
    EXPECT_LT(kept.allocations.back(), resharded.allocations.back());
    std::cout << "[overhead] allocations per steady step, full_shard w1 k3 bf16: "
              << resharded.allocations.back() << " resharding, " << kept.allocations.back()
              << " keeping\n";
  });
}

}  // namespace
}  // namespace fsdp
