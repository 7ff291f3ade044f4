// The FSDP engine beyond parity: communication volume per strategy from the counters, the
// limit on unsharded units measured from real storage, memory really freed, evaluation mode,
// gathering full parameters, and the errors a user gets when wrapping goes wrong.
#include <fstream>
#include <functional>

#include <torch/torch.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "common/strings.h"
#include "sharding/fsdp_model.h"
#include "sharding/memory_tracker.h"
#include "tests/multirank.h"
#include "tests/tiny_gpt.h"

namespace fsdp {
namespace {

using ::testing::HasSubstr;
using testing::TinyGpt;
using testing::TinyGptConfig;

struct Wrapped {
  TinyGpt model{nullptr};
  std::unique_ptr<DeviceMesh> mesh;
  std::unique_ptr<FsdpModel> fsdp;
};

Wrapped WrapTiny(const std::string& strategy, int world, int replicate, FsdpOptions* custom = nullptr,
                 TinyGptConfig config = {}) {
  Wrapped w;
  torch::manual_seed(7);
  w.model = TinyGpt(config);
  std::shared_ptr<DistContext> ctx = testing::InitDist();
  Strategy s = *ParseStrategy(strategy);
  w.mesh = std::make_unique<DeviceMesh>(*DeviceMesh::Create(ctx, *MeshShapeForStrategy(s, world, replicate)));
  FsdpOptions options = custom ? *custom : OptionsForStrategy(s);
  auto units = SelectUnits(*w.model, {.module_types = {"fsdp::testing::BlockImpl"}});
  absl::StatusOr<std::unique_ptr<FsdpModel>> f = FsdpModel::Wrap(w.model.ptr(), *w.mesh, units, options);
  if (!f.ok()) throw std::runtime_error(std::string(f.status().message()));
  w.fsdp = std::move(*f);
  return w;
}

void TrainStep(Wrapped& w, const TinyGptConfig& config = {}) {
  torch::manual_seed(3);
  torch::Tensor x = torch::randint(config.vocab, {4, config.seq});
  torch::Tensor logits = w.model->forward(x);
  torch::nn::functional::cross_entropy(logits.reshape({-1, config.vocab}), x.reshape({-1}))
      .backward();
}

// Unit sizes computed from the model's shapes, independently of the engine's layout code.
struct UnitBytes {
  int64_t all = 0, trainable = 0;
};
std::map<std::string, UnitBytes> ExpectedUnitBytes(torch::nn::Module& model, int shards) {
  std::map<std::string, UnitBytes> units;
  std::set<const void*> seen;
  for (const auto& item : model.named_parameters()) {
    if (!seen.insert(item.value().unsafeGetTensorImpl()).second) continue;  // tied
    std::string unit = "root";
    if (StartsWith(item.key(), "blocks.")) unit = item.key().substr(0, item.key().find('.', 7));
    int64_t d0 = item.value().dim() == 0 ? 1 : item.value().size(0);
    int64_t row = item.value().numel() / std::max<int64_t>(d0, 1);
    int64_t padded = (d0 + shards - 1) / shards * shards * row * 4;
    units[unit].all += padded;
    if (item.value().requires_grad()) units[unit].trainable += padded;
  }
  return units;
}

struct VolumeCase {
  std::string strategy;
  int world, replicate;
};
void PrintTo(const VolumeCase& c, std::ostream* os) { *os << c.strategy << "_w" << c.world; }

class CommVolumeTest : public ::testing::TestWithParam<VolumeCase> {};

TEST_P(CommVolumeTest, CountersMatchTheStrategy) {
  const VolumeCase c = GetParam();
  testing::RunOnRanks(c.world, [&](int) {
    Wrapped w = WrapTiny(c.strategy, c.world, c.replicate);
    const int shards = w.fsdp->context().num_shards;
    const bool replicated = w.fsdp->context().replicate_group != nullptr;
    w.fsdp->comm_stats().Reset();
    TrainStep(w);
    std::map<std::string, UnitBytes> units = ExpectedUnitBytes(*w.model, shards);
    ASSERT_EQ(units.size(), 4u);  // 3 blocks + root
    int64_t blocks_all = 0, all = 0, trainable = 0;
    for (const auto& [name, b] : units) {
      if (name != "root") blocks_all += b.all;
      all += b.all;
      trainable += b.trainable;
    }
    const CommStats& s = w.fsdp->comm_stats();
    const CommCounter& ag = s.Get(CommKind::kAllGather);
    const CommCounter& rs = s.Get(CommKind::kReduceScatter);
    const CommCounter& ar = s.Get(CommKind::kAllReduce);
    bool reshard = c.strategy == "full_shard" || c.strategy == "hybrid_shard";
    if (shards == 1) {  // DDP: only all-reduces, one per unit, of the unpadded gradients
      EXPECT_EQ(ag.calls, 0);
      EXPECT_EQ(rs.calls, 0);
    } else {
      // Every unit once in forward; non-root units again in backward after resharding.
      EXPECT_EQ(ag.calls, 4 + (reshard ? 3 : 0)) << s.ToString();
      EXPECT_EQ(ag.bytes, all + (reshard ? blocks_all : 0)) << s.ToString();
      EXPECT_EQ(rs.calls, 4) << s.ToString();
      EXPECT_EQ(rs.bytes, trainable) << s.ToString();
    }
    if (replicated) {
      EXPECT_EQ(ar.calls, 4) << s.ToString();
      EXPECT_EQ(ar.bytes, trainable / shards) << s.ToString();
    } else {
      EXPECT_EQ(ar.calls, 0) << s.ToString();
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Strategies, CommVolumeTest,
                         ::testing::Values(VolumeCase{"full_shard", 4, 1},
                                           VolumeCase{"shard_grad_op", 4, 1},
                                           VolumeCase{"no_shard", 4, 1},
                                           VolumeCase{"hybrid_shard", 4, 2},
                                           VolumeCase{"full_shard", 3, 1}),
                         [](const ::testing::TestParamInfo<VolumeCase>& info) {
                           return info.param.strategy + "_w" + std::to_string(info.param.world);
                         });

TEST(FsdpMemoryTest, UnshardedUnitsStayWithinTheLimit) {
  testing::RunOnRanks(2, [](int) {
    TinyGptConfig config;
    config.layers = 6;
    for (int limit : {1, 2, 3}) {
      SCOPED_TRACE(StrCat("limit ", limit));
      FsdpOptions options = OptionsForStrategy(Strategy::kFullShard);
      options.max_unsharded_units = limit;
      Wrapped w = WrapTiny("full_shard", 2, 1, &options, config);
      TrainStep(w, config);  // records the forward order; prefetching starts next iteration
      w.fsdp->ResetMemoryStats();
      torch::Tensor x = torch::randint(config.vocab, {4, config.seq});
      torch::Tensor logits = w.model->forward(x);
      const MemoryStats forward = w.fsdp->memory_stats();
      EXPECT_EQ(forward.peak_unsharded_units, limit);
      // Bytes: at most `limit` blocks' parameters (all blocks are the same size) plus the
      // gather buffers of one of them.
      int64_t block_bytes = ExpectedUnitBytes(*w.model, 2)["blocks.0"].all;
      EXPECT_LE(forward.peak_unsharded_bytes, limit * block_bytes + block_bytes + block_bytes / 2);
      logits.sum().backward();
      EXPECT_LE(w.fsdp->memory_stats().peak_unsharded_units, limit);
      // After backward every unit, the root too, has given its unsharded memory back.
      EXPECT_EQ(w.fsdp->NumUnshardedUnits(), 0);
      for (const auto& p : w.model->parameters()) {
        EXPECT_EQ(p.storage().nbytes(), 0u);
      }
    }
    // ZeRO-2 keeps every block unsharded from its forward to its backward.
    Wrapped z2 = WrapTiny("shard_grad_op", 2, 1, nullptr, config);
    torch::Tensor x = torch::randint(config.vocab, {4, config.seq});
    torch::Tensor logits = z2.model->forward(x);
    EXPECT_EQ(z2.fsdp->memory_stats().peak_unsharded_units, 6);
    logits.sum().backward();
    EXPECT_EQ(z2.fsdp->NumUnshardedUnits(), 0);
  });
}

TEST(FsdpMemoryTest, FullShardHoldsLessThanDdpPerRank) {
  // The same model trained for 3 AdamW steps on 4 ranks; each rank's peak of CPU tensor bytes
  // after wrapping (every rank first builds the whole model, as a user's code would).
  TinyGptConfig config;
  config.dim = 256;
  config.heads = 4;
  config.layers = 4;
  config.vocab = 2048;
  std::map<std::string, int64_t> peak;
  for (std::string strategy : {"no_shard", "full_shard"}) {
    testing::RunOnRanks(4, [&](int rank) {
      CpuMemoryTracker& tracker = CpuMemoryTracker::Install();
      Wrapped w = WrapTiny(strategy, 4, 1, nullptr, config);
      torch::optim::AdamW opt(w.fsdp->parameters(), torch::optim::AdamWOptions(1e-3));
      tracker.ResetPeak();
      for (int step = 0; step < 3; ++step) {
        TrainStep(w, config);
        opt.step();
        opt.zero_grad();
      }
      int64_t params = 0;
      for (const auto& p : w.fsdp->parameters()) params += p.numel();
      int64_t peak = tracker.peak_bytes();
      std::cout << "[memory] " << strategy << " rank " << rank << ": peak tensor bytes "
                << peak << ", local trainable parameters " << params << "\n";
      // Every rank reports; rank 0 compares the two strategies across runs via a file.
      torch::Tensor t = torch::tensor({static_cast<double>(peak)}, torch::kDouble);
      w.mesh->context().world().AllReduce(t, c10d::ReduceOp::MAX)->wait();
      if (rank == 0) {
        std::ofstream(StrCat("/tmp/fsdp-memory-", getppid(), "-", strategy)) << t.item<double>();
      }
      if (strategy == "full_shard") {
        int64_t total = 0;
        for (const auto& p : testing::UniqueTrainable(*w.model)) total += p.numel();
        EXPECT_LE(params, total / 4 + 4 * 64 * 8) << "shards are about a quarter of the model";
      }
    });
  }
  if (testing::InRankProcess()) return;
  auto read = [](const std::string& s) {
    double v = 0;
    std::ifstream(StrCat("/tmp/fsdp-memory-", getpid(), "-", s)) >> v;
    std::remove(StrCat("/tmp/fsdp-memory-", getpid(), "-", s).c_str());
    return v;
  };
  double ddp = read("no_shard"), fsdp = read("full_shard");
  std::cout << "[memory] peak tensor bytes per rank, 4 ranks: DDP " << ddp << ", FULL_SHARD "
            << fsdp << " (" << fsdp / ddp << "x)\n";
  EXPECT_GT(ddp, 0);
  EXPECT_LT(fsdp, 0.7 * ddp);
}

TEST(FsdpEngineTest, BuffersAreReplicatedFromRankZero) {
  testing::RunOnRanks(2, [](int rank) {
    torch::manual_seed(7);
    TinyGpt model{TinyGptConfig{}};
    if (rank == 1) {
      torch::NoGradGuard no_grad;
      model->pos_ids.zero_();  // a rank that built its buffer differently
    }
    std::shared_ptr<DistContext> ctx = testing::InitDist();
    DeviceMesh mesh = *DeviceMesh::Create(ctx, *MeshShapeForStrategy(Strategy::kFullShard, 2, 1));
    auto f = FsdpModel::Wrap(model.ptr(), mesh, {}, OptionsForStrategy(Strategy::kFullShard));
    ASSERT_TRUE(f.ok()) << f.status();
    EXPECT_TRUE(torch::equal(model->pos_ids, torch::arange(8))) << model->pos_ids;
  });
}

TEST(FsdpEngineTest, EvaluationForwardMatchesAndFreesEverything) {
  testing::RunOnRanks(3, [](int) {
    Wrapped w = WrapTiny("shard_grad_op", 3, 1);
    torch::manual_seed(7);
    TinyGpt reference{TinyGptConfig{}};
    torch::Tensor x = torch::randint(37, {2, 8});
    torch::NoGradGuard no_grad;
    torch::Tensor out = w.model->forward(x);
    EXPECT_TRUE(torch::allclose(out, reference->forward(x), 1e-5, 1e-6));
    EXPECT_EQ(w.fsdp->NumUnshardedUnits(), 0);
    for (const auto& item : reference->named_parameters()) {
      const FsdpParam* p = w.fsdp->FindParam(item.key());
      ASSERT_NE(p, nullptr) << item.key();
      EXPECT_TRUE(torch::equal(w.fsdp->GatherFullParameter(*p), item.value())) << item.key();
    }
  });
}

// Writes `source`'s values into the wrapped model's shards (each rank its own rows), as an
// optimizer step or a checkpoint load does: only the shards change.
void WriteShards(Wrapped& w, torch::nn::Module& source) {
  torch::NoGradGuard no_grad;
  for (const auto& item : source.named_parameters()) {
    const FsdpParam* p = w.fsdp->FindParam(item.key());
    ASSERT_NE(p, nullptr) << item.key();
    int64_t rows = p->sharded.size(0);
    if (rows == 0) continue;  // a short parameter: this rank holds padding only
    p->sharded.copy_(item.value().narrow(0, w.fsdp->FirstLocalRow(*p), rows));
  }
}

// Note [Reshard to a sub-group] (sharding/collectives.h): the post-forward shard is a copy of
// the parameters that only a backward may use. An evaluation forward must not leave it behind:
// the next forward would gather the old values and ignore shards changed in between. While it
// exists (a training forward) it counts toward UnshardedBytes.
TEST(FsdpEngineTest, EvaluationForwardWithSubGroupReshardLeavesNoStaleCopy) {
  testing::RunOnRanks(4, [](int) {
    FsdpOptions options = OptionsForStrategy(Strategy::kFullShard);
    options.reshard_group_size = 2;
    Wrapped w = WrapTiny("full_shard", 4, 1, &options);
    torch::manual_seed(5);
    torch::Tensor x = torch::randint(37, {2, 8});
    {
      torch::NoGradGuard no_grad;
      w.model->forward(x);
    }
    for (const FsdpUnit* unit : w.fsdp->units()) {
      EXPECT_EQ(unit->state(), FsdpUnit::ShardedState::kSharded) << unit->name();
      EXPECT_EQ(unit->UnshardedBytes(), 0) << unit->name();
    }

    torch::manual_seed(11);  // other values than WrapTiny's seed 7
    TinyGpt updated{TinyGptConfig{}};
    WriteShards(w, *updated);
    {
      torch::NoGradGuard no_grad;
      torch::Tensor out = w.model->forward(x);
      EXPECT_TRUE(torch::allclose(out, updated->forward(x), 1e-5, 1e-6))
          << "the forward after an evaluation forward used stale parameters";
    }

    // A training forward keeps the post-forward shards for backward, and counts them.
    torch::Tensor out = w.model->forward(x);
    EXPECT_TRUE(torch::allclose(out, updated->forward(x), 1e-5, 1e-6));
    for (const FsdpUnit* unit : w.fsdp->units()) {
      if (unit->is_root()) continue;
      EXPECT_EQ(unit->state(), FsdpUnit::ShardedState::kShardedPostForward) << unit->name();
      EXPECT_GT(unit->UnshardedBytes(), 0) << unit->name();
      EXPECT_FALSE(unit->HoldsUnsharded()) << unit->name();
    }
    EXPECT_GT(w.fsdp->memory_stats().peak_unsharded_bytes, 0);
    out.sum().backward();
    for (const FsdpUnit* unit : w.fsdp->units()) {
      EXPECT_EQ(unit->state(), FsdpUnit::ShardedState::kSharded) << unit->name();
      EXPECT_EQ(unit->UnshardedBytes(), 0) << unit->name();
    }
  });
}

// Note [Unit lifecycle]: every transition checks its from-state; a call out of order is an
// error naming the unit, its state and the call, never a silent no-op.
TEST(FsdpUnitStateTest, OutOfOrderTransitionsAreErrors) {
  EngineContext ctx;
  FsdpUnit unit("lonely", /*module=*/nullptr, /*params=*/{}, &ctx, /*is_root=*/false);
  EXPECT_EQ(unit.state(), FsdpUnit::ShardedState::kSharded);
  try {
    unit.Reshard();
    ADD_FAILURE() << "Reshard of a sharded unit did not throw";
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("'lonely'"));
    EXPECT_THAT(e.what(), HasSubstr("Reshard"));
    EXPECT_THAT(e.what(), HasSubstr("kSharded"));
  }
  EXPECT_THROW(unit.WaitForUnshard(), c10::Error);
  EXPECT_THROW(unit.DropPostForwardShard(), c10::Error);
  unit.Unshard();  // no parameters: nothing to gather
  EXPECT_EQ(unit.state(), FsdpUnit::ShardedState::kUnsharded);
  EXPECT_THROW(unit.Unshard(), c10::Error);
  EXPECT_THROW(unit.PostBackward(), c10::Error);  // still unsharded
  unit.Reshard();
  EXPECT_EQ(unit.state(), FsdpUnit::ShardedState::kSharded);

  EXPECT_THROW(unit.EndForward(), c10::Error);
  unit.BeginForward();
  EXPECT_THROW(unit.BeginForward(), c10::Error);
  EXPECT_THROW(unit.BeginPreBackward(), c10::Error);
  unit.EndForward();
  unit.BeginPreBackward();
  unit.PostBackward();
  EXPECT_EQ(unit.training_state(), FsdpUnit::TrainingState::kPostBackward);
  EXPECT_THROW(unit.PostBackward(), c10::Error);
  unit.ResetIteration();
  EXPECT_EQ(unit.training_state(), FsdpUnit::TrainingState::kIdle);
}

// Note [One shard]: with one shard the unsharded parameters are the shards' own memory (no
// gather, no copy), and each gradient becomes the shard's gradient, as a tensor an optimizer
// can zero. Under mixed precision the parameters hold one cast of the shards.
TEST(FsdpEngineTest, OneShardUsesTheShardsInPlace) {
  testing::RunOnRanks(1, [](int) {
    Wrapped w = WrapTiny("shard_grad_op", 1, 1);  // units stay unsharded from forward to backward
    torch::manual_seed(3);
    torch::Tensor x = torch::randint(37, {4, 8});
    torch::Tensor loss = w.model->forward(x).logsumexp(-1).mean();
    for (const FsdpUnit* unit : w.fsdp->units()) {
      for (const FsdpParam& p : unit->params()) {
        EXPECT_EQ(p.param.data_ptr(), p.padded_shard.data_ptr()) << p.names[0];
      }
    }
    loss.backward();
    torch::optim::SGD sgd(w.fsdp->parameters(), torch::optim::SGDOptions(0.1));
    for (const at::Tensor& shard : w.fsdp->parameters()) {
      ASSERT_TRUE(shard.grad().defined());
      EXPECT_FALSE(shard.grad().is_view());
    }
    sgd.step();
    EXPECT_NO_THROW(sgd.zero_grad());

    FsdpOptions bf16 = OptionsForStrategy(Strategy::kShardGradOp);
    bf16.mixed_precision.param_dtype = at::kBFloat16;
    Wrapped m = WrapTiny("shard_grad_op", 1, 1, &bf16);
    torch::Tensor out = m.model->forward(x);
    for (const FsdpUnit* unit : m.fsdp->units()) {
      for (const FsdpParam& p : unit->params()) {
        EXPECT_NE(p.param.data_ptr(), p.padded_shard.data_ptr()) << p.names[0];
        EXPECT_TRUE(torch::equal(p.param, p.padded_shard.to(at::kBFloat16))) << p.names[0];
      }
    }
  });
}

TEST(FsdpWrapErrors, DifferentModelsAreAnErrorOnEveryRank) {
  testing::RunOnRanks(2, [](int rank) {
    TinyGptConfig config;
    if (rank == 1) config.dim = 24;  // rank 1 built another model
    torch::manual_seed(7);
    TinyGpt model(config);
    std::shared_ptr<DistContext> ctx = testing::InitDist();
    DeviceMesh mesh = *DeviceMesh::Create(ctx, *MeshShapeForStrategy(Strategy::kFullShard, 2, 1));
    auto units = SelectUnits(*model, {.module_types = {"fsdp::testing::BlockImpl"}});
    absl::StatusOr<std::unique_ptr<FsdpModel>> f =
        FsdpModel::Wrap(model.ptr(), mesh, units, OptionsForStrategy(Strategy::kFullShard));
    ASSERT_FALSE(f.ok());
    EXPECT_EQ(f.status().code(), absl::StatusCode::kFailedPrecondition);
    std::string m(f.status().message());
    EXPECT_THAT(m, HasSubstr("the model on rank 1 differs from the model on rank 0"));
    EXPECT_THAT(m, HasSubstr("'root pos_emb [8, 20] Float frozen' vs 'root pos_emb [8, 24]"));
  });
}

struct SharedAcrossBlocksImpl : torch::nn::Module {
  SharedAcrossBlocksImpl() {
    a = register_module("a", torch::nn::ModuleList());
    auto l0 = torch::nn::Linear(4, 4);
    auto l1 = torch::nn::Linear(4, 4);
    l1->register_parameter("shared", l0->weight);
    a->push_back(l0);
    a->push_back(l1);
  }
  torch::nn::ModuleList a{nullptr};
};
TORCH_MODULE(SharedAcrossBlocks);

TEST(FsdpWrapErrors, BadUnitsAndMeshesAreExplained) {
  testing::RunOnRanks(2, [](int) {
    std::shared_ptr<DistContext> ctx = testing::InitDist();
    DeviceMesh mesh = *DeviceMesh::Create(ctx, *MeshShapeForStrategy(Strategy::kFullShard, 2, 1));
    FsdpOptions options = OptionsForStrategy(Strategy::kFullShard);

    SharedAcrossBlocks shared;
    auto units = SelectUnits(*shared, {.module_types = {"torch::nn::LinearImpl"}});
    ASSERT_EQ(units.size(), 2u);
    absl::StatusOr<std::unique_ptr<FsdpModel>> f = FsdpModel::Wrap(shared.ptr(), mesh, units, options);
    ASSERT_FALSE(f.ok());
    EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(f.status().message()), HasSubstr("is shared by units 'a.0' and 'a.1'"));

    TinyGpt model{TinyGptConfig{}};
    TinyGpt other{TinyGptConfig{}};
    f = FsdpModel::Wrap(model.ptr(), mesh, {other->blocks[0]}, options);
    ASSERT_FALSE(f.ok());
    EXPECT_THAT(std::string(f.status().message()), HasSubstr("is not a submodule of the root"));

    options.reshard_group_size = 3;
    f = FsdpModel::Wrap(model.ptr(), mesh, {}, options);
    ASSERT_FALSE(f.ok());
    EXPECT_THAT(std::string(f.status().message()), HasSubstr("must divide the shard degree 2"));

    DeviceMesh odd = *DeviceMesh::Create(ctx, *ResolveMeshShape({"dp", "tp"}, {1, 2}, 2));
    f = FsdpModel::Wrap(model.ptr(), odd, {}, OptionsForStrategy(Strategy::kFullShard));
    ASSERT_FALSE(f.ok());
    EXPECT_EQ(f.status().code(), absl::StatusCode::kUnimplemented);
  });
}

// A model built from raw parameters that can be deferred (no memory until sharded).
struct RawBlockImpl : torch::nn::Module {
  RawBlockImpl(int64_t d, bool deferred) {
    auto make = [&](std::vector<int64_t> shape) {
      return deferred ? DeferredTensor(shape) : torch::empty(shape);
    };
    w1 = register_parameter("w1", make({4 * d, d}));
    b1 = register_parameter("b1", make({4 * d}));
    w2 = register_parameter("w2", make({d, 4 * d}));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return UnitForward(this, x, [&](const torch::Tensor& h) {
      return h + torch::gelu(torch::nn::functional::linear(h, w1, b1)).matmul(w2.t());
    });
  }
  torch::Tensor w1, b1, w2;
};
TORCH_MODULE(RawBlock);

struct RawNetImpl : torch::nn::Module {
  RawNetImpl(int64_t vocab, int64_t d, int layers, bool deferred) {
    emb = register_parameter("emb", deferred ? DeferredTensor({vocab, d}) : torch::empty({vocab, d}));
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int i = 0; i < layers; ++i) blocks->push_back(RawBlock(d, deferred));
  }
  torch::Tensor forward(const torch::Tensor& tokens) {
    return UnitForward(this, tokens, [&](const torch::Tensor& t) {
      torch::Tensor h = emb.index_select(0, t.reshape({-1})).view({t.size(0), t.size(1), -1});
      for (const auto& b : *blocks) h = b->as<RawBlockImpl>()->forward(h);
      return h.matmul(emb.t());
    });
  }
  torch::Tensor emb;
  torch::nn::ModuleList blocks{nullptr};
};
TORCH_MODULE(RawNet);

InitSpec SpecOf(const std::string& name) {
  if (name.ends_with("b1")) return InitSpec::Zeros();
  if (name == "emb") return InitSpec::Normal(0.02);
  return InitSpec::Uniform(-0.05, 0.05);
}

TEST(FsdpDeferredInitTest, ShardsAreCreatedFromTheSeedWithoutTheFullModel) {
  for (int world : {2, 3}) {
    testing::RunOnRanks(world, [&](int) {
      CpuMemoryTracker& tracker = CpuMemoryTracker::Install();
      const int64_t vocab = 512, d = 128;
      const int layers = 4;
      int64_t full_bytes = (vocab * d + layers * (9 * d * d)) * 4;
      tracker.ResetPeak();
      int64_t before = tracker.current_bytes();
      RawNet model(vocab, d, layers, /*deferred=*/true);
      std::shared_ptr<DistContext> ctx = testing::InitDist();
      DeviceMesh mesh = *DeviceMesh::Create(ctx, *MeshShapeForStrategy(Strategy::kFullShard, world, 1));
      FsdpOptions options = OptionsForStrategy(Strategy::kFullShard);
      options.param_init = SeededInit(42, SpecOf);
      auto units = SelectUnits(*model, {.module_types = {"fsdp::(anonymous namespace)::RawBlockImpl"}});
      ASSERT_EQ(units.size(), static_cast<size_t>(layers));
      absl::StatusOr<std::unique_ptr<FsdpModel>> f = FsdpModel::Wrap(model.ptr(), mesh, units, options);
      ASSERT_TRUE(f.ok()) << f.status();
      int64_t peak = tracker.peak_bytes() - before;
      std::cout << "[deferred] world " << world << ": peak tensor bytes while building and "
                << "sharding " << peak << " of a " << full_bytes << "-byte model\n";
      EXPECT_LT(peak, full_bytes / world + full_bytes / 4);
      // Identical to the whole tensors a single process makes from the same seed.
      for (const auto& item : model->named_parameters()) {
        const FsdpParam* p = (*f)->FindParam(item.key());
        ASSERT_NE(p, nullptr);
        torch::Tensor expected = SeededFull(42, item.key(), p->sharding.shape, SpecOf(item.key()));
        EXPECT_TRUE(torch::equal((*f)->GatherFullParameter(*p), expected)) << item.key();
      }
      // And it trains.
      torch::Tensor x = torch::randint(vocab, {2, 8});
      model->forward(x).sum().backward();
      for (const at::Tensor& p : (*f)->parameters()) {
        if (p.numel() > 0) {
          EXPECT_TRUE(p.grad().defined());
        }
      }
    });
  }
}

// Values are a function of the global element index alone: a shard filled from a row in the
// middle equals the whole tensor's rows there, across the fill's chunks (2^22 elements) and
// whatever the number of threads computing them.
TEST(FsdpDeferredInitTest, ValuesDependOnTheIndexOnlyAcrossChunksAndThreads) {
  const int64_t n = 3 * (int64_t{1} << 21) + 11;  // a chunk and a half, and a tail
  const InitSpec spec = InitSpec::Normal(0.02);
  at::Tensor full = SeededFull(7, "w", {n}, spec);
  const int64_t first = 1234567;
  at::Tensor rows = at::empty({n - first}, at::kFloat);
  SeededInit(7, [&](const std::string&) { return spec; })("w", first, 1, rows);
  EXPECT_TRUE(at::equal(rows, full.narrow(0, first, n - first)));
  const int64_t chunk = int64_t{1} << 22;
  EXPECT_NE(full[0].item<float>(), full[chunk].item<float>());  // no chunk restarts the index
  const int threads = at::get_num_threads();
  at::set_num_threads(1);
  at::Tensor one_thread = SeededFull(7, "w", {n}, spec);
  at::set_num_threads(threads);
  EXPECT_TRUE(at::equal(one_thread, full));
  // Into bf16: the double rounded once, as before the chunking.
  at::Tensor bf16 = at::empty({1000}, at::kBFloat16);
  SeededInit(7, [&](const std::string&) { return spec; })("w", 0, 1, bf16);
  at::Tensor doubles = at::empty({1000}, at::kDouble);
  SeededInit(7, [&](const std::string&) { return spec; })("w", 0, 1, doubles);
  EXPECT_TRUE(at::equal(bf16, doubles.to(at::kBFloat16)));
}

TEST(FsdpDeferredInitTest, DeferredWithoutInitialiserIsAnError) {
  testing::RunOnRanks(1, [](int) {
    RawNet model(16, 8, 1, /*deferred=*/true);
    std::shared_ptr<DistContext> ctx = testing::InitDist();
    DeviceMesh mesh = *DeviceMesh::Create(ctx, *MeshShapeForStrategy(Strategy::kFullShard, 1, 1));
    absl::StatusOr<std::unique_ptr<FsdpModel>> f =
        FsdpModel::Wrap(model.ptr(), mesh, {}, OptionsForStrategy(Strategy::kFullShard));
    ASSERT_FALSE(f.ok());
    EXPECT_THAT(std::string(f.status().message()),
                HasSubstr("parameter 'emb' is deferred (no memory yet) but FsdpOptions::param_init"));
  });
}

TEST(FsdpEngineTest, SequentialChildrenByParameterCount) {
  testing::RunOnRanks(2, [](int) {
    torch::manual_seed(5);
    torch::nn::Sequential seq(torch::nn::Linear(6, 40), torch::nn::Tanh(),
                              torch::nn::Linear(40, 3));
    torch::manual_seed(5);
    torch::nn::Sequential reference(torch::nn::Linear(6, 40), torch::nn::Tanh(),
                                    torch::nn::Linear(40, 3));
    // Both Linear layers have at least 100 parameters; Tanh has none.
    auto units = SelectUnits(*seq, {.module_types = {}, .min_num_params = 100});
    ASSERT_EQ(units.size(), 2u);
    std::shared_ptr<DistContext> ctx = testing::InitDist();
    DeviceMesh mesh = *DeviceMesh::Create(ctx, *MeshShapeForStrategy(Strategy::kFullShard, 2, 1));
    auto f = FsdpModel::Wrap(seq.ptr(), mesh, units, OptionsForStrategy(Strategy::kFullShard));
    ASSERT_TRUE(f.ok()) << f.status();
    EXPECT_EQ((*f)->units().size(), 3u);  // two Linear units and the (empty) root
    torch::Tensor x = torch::randn({5, 6});
    torch::Tensor out = SequentialForward(*seq, x);
    EXPECT_TRUE(torch::allclose(out, reference->forward(x), 1e-5, 1e-6));
    out.sum().backward();
    reference->forward(x).sum().backward();
    for (const auto& item : reference->named_parameters()) {
      const FsdpParam* p = (*f)->FindParam(item.key());
      ASSERT_NE(p, nullptr) << item.key();
      int64_t rows = p->sharded.size(0);
      if (rows == 0) continue;
      torch::Tensor expected = item.value().grad().reshape({p->sharding.dim0, -1})
                                   .narrow(0, (*f)->FirstLocalRow(*p), rows);  // same batch on both ranks
      EXPECT_TRUE(torch::allclose(p->sharded.grad().reshape({rows, -1}), expected, 1e-5, 1e-6))
          << item.key();
    }
  });
}

// Two same-shaped blocks; the root either bypasses the second block (calls its submodule
// directly) or the second block's forward forgets UnitForward.
struct LinearBlockImpl : torch::nn::Module {
  explicit LinearBlockImpl(bool wrapped) : wrapped(wrapped) {}
  torch::Tensor forward(const torch::Tensor& x) {
    if (!wrapped) return x + fc->forward(x);  // the user's bug: no UnitForward
    return UnitForward(this, x, [&](const torch::Tensor& h) { return h + fc->forward(h); });
  }
  bool wrapped;
  torch::nn::Linear fc{register_module("fc", torch::nn::Linear(8, 8))};
};
TORCH_MODULE(LinearBlock);

struct TwoBlockNetImpl : torch::nn::Module {
  TwoBlockNetImpl(bool bypass, bool second_wrapped) : bypass(bypass) {
    first = register_module("first", LinearBlock(true));
    second = register_module("second", LinearBlock(second_wrapped));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return UnitForward(this, x, [&](const torch::Tensor& h) {
      torch::Tensor y = first->forward(h);
      return bypass ? second->fc->forward(y) : second->forward(y);
    });
  }
  bool bypass;
  LinearBlock first{nullptr}, second{nullptr};
};
TORCH_MODULE(TwoBlockNet);

TEST(FsdpWrapErrors, ForwardWithoutUnitForwardNamesTheUnit) {
  testing::RunOnRanks(2, [](int) {
    std::shared_ptr<DistContext> ctx = testing::InitDist();
    DeviceMesh mesh = *DeviceMesh::Create(ctx, *MeshShapeForStrategy(Strategy::kFullShard, 2, 1));
    for (bool bypass : {true, false}) {
      TwoBlockNet model(bypass, /*second_wrapped=*/bypass);
      auto f = FsdpModel::Wrap(model.ptr(), mesh, {model->first.ptr(), model->second.ptr()},
                               OptionsForStrategy(Strategy::kFullShard));
      ASSERT_TRUE(f.ok()) << f.status();
      try {
        model->forward(torch::randn({4, 8}));
        ADD_FAILURE() << "the forward through a sharded unit did not fail";
      } catch (const c10::Error& e) {
        const std::string message = e.what_without_backtrace();
        EXPECT_THAT(message, HasSubstr("FSDP unit 'second' (fsdp::(anonymous namespace)::"
                                       "LinearBlockImpl) was used while sharded"));
        EXPECT_THAT(message, HasSubstr("'second.fc."));
        EXPECT_THAT(message, HasSubstr("through fsdp::UnitForward(this, x, fn)"));
        EXPECT_THAT(message, HasSubstr("out of bounds for storage of size 0"));
      }
    }
  });
}

// Trains the wrapped TinyGpt and an unwrapped copy (same seed, same batch on both ranks, so the
// reference's gradient is every rank's) with SGD; `between` runs on both after each backward
// and before the step, `zero` clears the gradients after it. Returns the largest difference of
// the losses and of the gathered parameters.
double TrainAgainstReference(Wrapped& w, const std::function<void(TinyGpt&)>& between,
                             const std::function<void(TinyGpt&, torch::optim::Optimizer&)>& zero) {
  torch::manual_seed(7);
  TinyGpt reference{TinyGptConfig{}};
  torch::optim::SGD opt(w.fsdp->parameters(), 0.5);
  std::vector<torch::Tensor> ref_params;  // each tied tensor once, as FsdpModel::parameters()
  for (const torch::Tensor& t : reference->parameters()) {
    bool seen = false;
    for (const torch::Tensor& u : ref_params) seen |= u.is_same(t);
    if (!seen) ref_params.push_back(t);
  }
  torch::optim::SGD ref_opt(ref_params, 0.5);
  double worst = 0;
  for (int step = 0; step < 3; ++step) {
    torch::manual_seed(100 + step);
    torch::Tensor x = torch::randint(37, {4, 8});
    double losses[2];
    for (int which = 0; which < 2; ++which) {
      TinyGpt& model = which == 0 ? w.model : reference;
      torch::optim::Optimizer& o =
          which == 0 ? static_cast<torch::optim::Optimizer&>(opt) : ref_opt;
      torch::Tensor loss = torch::nn::functional::cross_entropy(model->forward(x).reshape({-1, 37}),
                                                                x.reshape({-1}));
      loss.backward();
      between(model);
      o.step();
      if (which == 0) {
        zero(model, o);
      } else {
        o.zero_grad();
      }
      losses[which] = loss.item<double>();
    }
    worst = std::max(worst, std::abs(losses[0] - losses[1]));
  }
  for (const auto& item : reference->named_parameters()) {
    const FsdpParam* p = w.fsdp->FindParam(item.key());
    if (p == nullptr) continue;  // the tied head: compared as the embedding
    worst = std::max(worst,
                     (w.fsdp->GatherFullParameter(*p) - item.value()).abs().max().item<double>());
  }
  return worst;
}

// Note [Forward without backward]: a forward with grad mode on whose loss is dropped, then the
// optimizer step. The next forward used to find the root (and, for shard_grad_op, every unit)
// still unsharded with the values of before the step and gather nothing: losses and parameters
// drifted from the reference, silently.
TEST(FsdpEngineTest, ForwardWithoutBackwardThenStepUsesTheUpdatedParameters) {
  testing::RunOnRanks(2, [](int) {
    for (const char* strategy : {"full_shard", "shard_grad_op"}) {
      Wrapped w = WrapTiny(strategy, 2, 1);
      // Between backward and step: a metric computed with grad mode on.
      double diff = TrainAgainstReference(
          w,
          [](TinyGpt& m) {
            m->forward(torch::randint(37, {2, 8}));
          },
          [](TinyGpt&, torch::optim::Optimizer& o) { o.zero_grad(); });
      EXPECT_LT(diff, 1e-5) << strategy;
    }
  });
}

// Note [zero_grad on the module]: model->zero_grad() instead of optimizer.zero_grad() used to
// leave the shards' gradients in place, so every step added to all the earlier ones.
TEST(FsdpEngineTest, ModuleZeroGradClearsTheShardGradients) {
  testing::RunOnRanks(2, [](int) {
    for (bool set_to_none : {true, false}) {
      Wrapped w = WrapTiny("full_shard", 2, 1);
      double diff = TrainAgainstReference(
          w, [](TinyGpt&) {},
          [&](TinyGpt& m, torch::optim::Optimizer&) { m->zero_grad(set_to_none); });
      EXPECT_LT(diff, 1e-5) << "set_to_none " << set_to_none;
    }
    // Gradients accumulated over two backwards between steps are kept.
    Wrapped w = WrapTiny("full_shard", 2, 1);
    TrainStep(w);
    torch::Tensor first = w.fsdp->parameters()[0].grad().clone();
    TrainStep(w);
    EXPECT_TRUE(torch::allclose(w.fsdp->parameters()[0].grad(), 2 * first, 1e-5, 1e-6));
  });
}

// A root parameter used only after the root's forward returns: autograd accumulates its
// gradient before the root output's hook runs, so a zero_grad sentinel still in place then
// (Note [zero_grad on the module]) made the second step fail with a size mismatch.
struct HeadOutsideNetImpl : torch::nn::Module {
  HeadOutsideNetImpl() {
    first = register_module("first", LinearBlock(true));
    head = register_parameter("head", torch::randn({4, 8}) * 0.1);
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return UnitForward(this, x, [&](const torch::Tensor& h) { return first->forward(h); });
  }
  LinearBlock first{nullptr};
  torch::Tensor head;
};
TORCH_MODULE(HeadOutsideNet);

TEST(FsdpEngineTest, ParameterUsedAfterTheRootForward) {
  testing::RunOnRanks(2, [](int) {
    std::shared_ptr<DistContext> ctx = testing::InitDist();
    DeviceMesh mesh = *DeviceMesh::Create(ctx, *MeshShapeForStrategy(Strategy::kFullShard, 2, 1));
    for (bool module_zero_grad : {false, true}) {
      torch::manual_seed(3);
      HeadOutsideNet model;
      torch::manual_seed(3);
      HeadOutsideNet reference;
      auto f = FsdpModel::Wrap(model.ptr(), mesh, {model->first.ptr()},
                               OptionsForStrategy(Strategy::kFullShard));
      ASSERT_TRUE(f.ok()) << f.status();
      torch::optim::SGD sharded_sgd((*f)->parameters(), torch::optim::SGDOptions(0.1));
      torch::optim::SGD reference_sgd(reference->parameters(), torch::optim::SGDOptions(0.1));
      torch::manual_seed(4);  // the same batch on both ranks
      const torch::Tensor x = torch::randn({6, 8});
      for (int step = 0; step < 3; ++step) {
        torch::Tensor loss = torch::linear(model->forward(x), model->head).pow(2).mean();
        loss.backward();
        sharded_sgd.step();
        if (module_zero_grad) {
          model->zero_grad();
        } else {
          sharded_sgd.zero_grad();
        }
        torch::Tensor expected =
            torch::linear(reference->forward(x), reference->head).pow(2).mean();
        expected.backward();
        reference_sgd.step();
        reference_sgd.zero_grad();
        EXPECT_NEAR(loss.item<double>(), expected.item<double>(), 1e-6)
            << "step " << step << ", module zero_grad " << module_zero_grad;
      }
    }
  });
}

// Note [Nested UnitForward of one unit]: SequentialForward over blocks whose forward goes
// through UnitForward, as unit_forward.h's example does, used to fail with "BeginForward called
// in training state kForward".
TEST(FsdpEngineTest, SequentialForwardOfBlocksThatUseUnitForward) {
  testing::RunOnRanks(2, [](int) {
    std::shared_ptr<DistContext> ctx = testing::InitDist();
    DeviceMesh mesh = *DeviceMesh::Create(ctx, *MeshShapeForStrategy(Strategy::kFullShard, 2, 1));
    // With activation checkpointing the recompute in backward reaches UnitForward again too.
    for (auto mode : {ActivationCheckpointing::Mode::kNone, ActivationCheckpointing::Mode::kFull}) {
      torch::manual_seed(5);
      torch::nn::Sequential seq(LinearBlock(true), LinearBlock(true));
      torch::manual_seed(5);
      torch::nn::Sequential reference(LinearBlock(true), LinearBlock(true));
      FsdpOptions options = OptionsForStrategy(Strategy::kFullShard);
      options.activation_checkpointing.mode = mode;
      auto f = FsdpModel::Wrap(seq.ptr(), mesh,
                               SelectUnits(*seq, {.module_types = {"LinearBlockImpl"}}), options);
      ASSERT_TRUE(f.ok()) << f.status();
      ASSERT_EQ((*f)->units().size(), 3u);
      torch::manual_seed(6);  // the same batch on both ranks
      torch::Tensor x = torch::randn({4, 8});
      torch::Tensor out = SequentialForward(*seq, x);
      EXPECT_TRUE(torch::allclose(out, reference->forward(x), 1e-5, 1e-6));
      out.sum().backward();
      reference->forward(x).sum().backward();
      if (mode == ActivationCheckpointing::Mode::kFull) {
        EXPECT_EQ((*f)->Recomputes(*(*f)->units()[1]), 1);
      }
      for (const auto& item : reference->named_parameters()) {
        const FsdpParam* p = (*f)->FindParam(item.key());
        ASSERT_NE(p, nullptr) << item.key();
        int64_t rows = p->sharded.size(0);
        torch::Tensor expected = item.value().grad().narrow(0, (*f)->FirstLocalRow(*p), rows);
        EXPECT_TRUE(torch::allclose(p->sharded.grad(), expected, 1e-5, 1e-6)) << item.key();
      }
    }
  });
}

// A unit with parameters of two dtypes used to abort in Gloo ("Received data size doesn't
// match expected size"); a model wrapped twice got "is deferred"; the root or a module listed
// twice among the units became a unit that never gathered its parameters.
TEST(FsdpWrapErrors, MixedDtypesWrappingTwiceRootAndDuplicateUnits) {
  testing::RunOnRanks(2, [](int) {
    std::shared_ptr<DistContext> ctx = testing::InitDist();
    DeviceMesh mesh = *DeviceMesh::Create(ctx, *MeshShapeForStrategy(Strategy::kFullShard, 2, 1));
    const FsdpOptions options = OptionsForStrategy(Strategy::kFullShard);
    {
      torch::manual_seed(3);
      TwoBlockNet model(false, true);
      model->second->fc->bias.set_data(model->second->fc->bias.to(torch::kBFloat16));
      auto f =
          FsdpModel::Wrap(model.ptr(), mesh, {model->first.ptr(), model->second.ptr()}, options);
      ASSERT_FALSE(f.ok());
      EXPECT_EQ(f.status().code(), absl::StatusCode::kUnimplemented);
      EXPECT_THAT(std::string(f.status().message()),
                  HasSubstr("FSDP unit 'second' holds parameters of different dtypes: "
                            "'second.fc.weight' is Float, 'second.fc.bias' is BFloat16"));
      FsdpOptions bf16 = options;  // one compute dtype: trains
      bf16.mixed_precision.param_dtype = torch::kBFloat16;
      f = FsdpModel::Wrap(model.ptr(), mesh, {model->first.ptr(), model->second.ptr()}, bf16);
      ASSERT_TRUE(f.ok()) << f.status();
      model->forward(torch::randn({4, 8})).sum().backward();
      EXPECT_TRUE((*f)->FindParam("second.fc.bias")->sharded.grad().defined());
    }
    torch::manual_seed(3);
    TwoBlockNet model(false, true);
    torch::Tensor x = torch::randn({4, 8});
    torch::Tensor expected = model->forward(x);
    auto f = FsdpModel::Wrap(
        model.ptr(), mesh,
        {model->first.ptr(), model.ptr(), model->second.ptr(), model->first.ptr()}, options);
    ASSERT_TRUE(f.ok()) << f.status();
    EXPECT_EQ((*f)->units().size(), 3u);  // first, second and the root
    EXPECT_TRUE(torch::allclose(model->forward(x), expected, 1e-5, 1e-6));
    auto again = FsdpModel::Wrap(model.ptr(), mesh, {}, options);
    ASSERT_FALSE(again.ok());
    EXPECT_EQ(again.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(std::string(again.status().message()), HasSubstr("is already wrapped"));
  });
}

// A type given without its namespace used to select nothing (Module::name() is qualified:
// "fsdp::(anonymous namespace)::LinearBlockImpl"), silently: one root unit, nothing saved.
TEST(FsdpEngineTest, SelectUnitsByUnqualifiedTypeAndInModuleDicts) {
  torch::nn::Sequential seq(LinearBlock(true), torch::nn::Tanh(), LinearBlock(true));
  EXPECT_EQ(SelectUnits(*seq, {.module_types = {"LinearBlockImpl"}}).size(), 2u);
  EXPECT_EQ(
      SelectUnits(*seq, {.module_types = {"fsdp::(anonymous namespace)::LinearBlockImpl"}}).size(),
      2u);
  EXPECT_EQ(SelectUnits(*seq, {.module_types = {"BlockImpl"}}).size(), 0u);  // whole names only
  torch::nn::ModuleDict dict;
  dict->update({{"a", LinearBlock(true).ptr()}, {"b", LinearBlock(true).ptr()}});
  EXPECT_EQ(SelectUnits(*dict, {.module_types = {"LinearBlockImpl"}}).size(), 2u);
}

TEST(FsdpEngineTest, UnwrappedModelRunsUnchanged) {
  // UnitForward is a plain call when the module is not a unit.
  torch::manual_seed(7);
  TinyGpt a{TinyGptConfig{}};
  torch::manual_seed(7);
  TinyGpt b{TinyGptConfig{}};
  torch::Tensor x = torch::randint(37, {2, 8});
  EXPECT_TRUE(torch::equal(a->forward(x), b->forward(x)));
}

}  // namespace
}  // namespace fsdp
