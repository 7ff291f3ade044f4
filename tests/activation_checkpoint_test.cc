// Activation checkpointing (sharding/activation_checkpoint.h): losses and gradients equal to
// the same run without it for every mode and strategy on real ranks, one recompute per
// checkpointed unit and backward, less activation memory, and the errors for what cannot be
// recomputed.
#include <torch/torch.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "common/strings.h"
#include "engine/config.h"
#include "models/model.h"
#include "sharding/fsdp_model.h"
#include "sharding/memory_tracker.h"
#include "tests/multirank.h"

namespace fsdp {
namespace {

using ::testing::HasSubstr;
using Mode = ActivationCheckpointing::Mode;

// A small Llama: RMSNorm, RoPE, SwiGLU through fsdp::Linear, odd sizes so shards are uneven.
ModelArgs TinyLlama(int64_t seq = 8) {
  return {.arch = "llama", .vocab_size = 29, .dim = 24, .n_layers = 4, .n_heads = 2,
          .seq_len = seq, .ffn_hidden = 40, .norm = NormKind::kRmsNorm,
          .activation = Activation::kSwiglu, .positions = Positions::kRope,
          .tie_embeddings = false};
}

struct Built {
  std::unique_ptr<Model> model;
  std::unique_ptr<FsdpModel> fsdp;
};

Built Build(const ModelArgs& args, const DeviceMesh& mesh, FsdpOptions options) {
  Built b;
  b.model = FindModelFamily(args.arch)->build(args);
  options.param_init = b.model->ParamInit(/*seed=*/11);
  absl::StatusOr<std::unique_ptr<FsdpModel>> f =
      FsdpModel::Wrap(b.model->module(), mesh, b.model->FsdpUnits(), options);
  if (!f.ok()) throw std::runtime_error(std::string(f.status().message()));
  b.fsdp = std::move(*f);
  return b;
}

int CheckpointedUnits(const FsdpModel& fsdp) {
  int n = 0;
  for (const FsdpUnit* unit : fsdp.units()) n += fsdp.IsCheckpointed(*unit);
  return n;
}

int64_t TotalRecomputes(const FsdpModel& fsdp) {
  int64_t n = 0;
  for (const FsdpUnit* unit : fsdp.units()) n += fsdp.Recomputes(*unit);
  return n;
}

struct AcCase {
  std::string strategy;
  int world;
  ActivationCheckpointing ac;
  int replicate = 1;
  int reshard_group = 0;
  bool bf16 = false;
  bool fused = false;  // model.kernels=fused (the CPU references) and the model's Loss
  std::string Name() const {
    std::string mode = ac.mode == Mode::kSelective ? "selective"
                       : ac.every == 1             ? "full"
                                                   : StrCat("every", ac.every);
    std::string n = StrCat(mode, "_", strategy, "_w", world);
    if (reshard_group) n += StrCat("_k", reshard_group);
    if (bf16) n += "_bf16";
    if (fused) n += "_fused";
    return n;
  }
};

// Two identical models on the same mesh, one checkpointed: three SGD steps of two
// micro-batches each; every loss and every gradient shard must agree.
void CompareWithoutCheckpointing(const AcCase& c, int rank) {
  std::shared_ptr<DistContext> ctx = testing::InitDist();
  Strategy strategy = *ParseStrategy(c.strategy);
  DeviceMesh mesh = *DeviceMesh::Create(ctx, *MeshShapeForStrategy(strategy, c.world, c.replicate));
  FsdpOptions options = OptionsForStrategy(strategy);
  options.reshard_group_size = c.reshard_group;
  if (c.bf16) {
    options.mixed_precision.param_dtype = at::kBFloat16;
    options.mixed_precision.reduce_dtype = at::kFloat;
    options.mixed_precision.output_dtype = at::kFloat;
  }
  ModelArgs args = TinyLlama();
  if (c.fused) args.kernels = KernelMode::kFused;
  Built plain = Build(args, mesh, options);
  options.activation_checkpointing = c.ac;
  Built ac = Build(args, mesh, options);
  const int checkpointed = CheckpointedUnits(*ac.fsdp);
  EXPECT_EQ(checkpointed, c.ac.mode == Mode::kSelective ? 4 : 4 / c.ac.every);

  auto sgd = torch::optim::SGDOptions(0.5).momentum(0.9);
  torch::optim::SGD opt_plain(plain.fsdp->parameters(), sgd), opt_ac(ac.fsdp->parameters(), sgd);
  int64_t backwards = 0;
  // bf16: the two runs compute the same bf16 ops, but a replayed matmul's backward may round
  // differently from autograd's; fp32 agrees to rounding.
  const double tol = c.bf16 ? 2e-2 : 1e-6;
  for (int step = 0; step < 3; ++step) {
    for (int micro = 0; micro < 2; ++micro) {
      torch::manual_seed(1000 * step + 10 * micro + rank);
      torch::Tensor tokens = torch::randint(args.vocab_size, {3, args.seq_len});
      torch::Tensor targets = torch::randint(args.vocab_size, {3, args.seq_len});
      double losses[2];
      for (int i = 0; i < 2; ++i) {
        Built& b = i == 0 ? plain : ac;
        torch::Tensor loss =
            c.fused ? b.model->Loss(tokens, targets)
                    : torch::nn::functional::cross_entropy(
                          b.model->Forward(tokens).reshape({-1, args.vocab_size}),
                          targets.reshape({-1}));
        loss.backward();
        losses[i] = loss.item<double>();
      }
      ++backwards;
      EXPECT_NEAR(losses[1], losses[0], tol * std::abs(losses[0])) << "step " << step;
      EXPECT_EQ(TotalRecomputes(*ac.fsdp), checkpointed * backwards);
      EXPECT_EQ(TotalRecomputes(*plain.fsdp), 0);
    }
    auto named_plain = plain.fsdp->named_parameters();
    auto named_ac = ac.fsdp->named_parameters();
    ASSERT_EQ(named_plain.size(), named_ac.size());
    for (size_t i = 0; i < named_plain.size(); ++i) {
      const at::Tensor& g0 = named_plain[i].second.grad();
      const at::Tensor& g1 = named_ac[i].second.grad();
      ASSERT_EQ(g0.defined(), g1.defined()) << named_plain[i].first;
      if (!g0.defined() || g0.numel() == 0) continue;
      double scale = g0.abs().max().item<double>();
      double err = (g1 - g0).abs().max().item<double>();
      EXPECT_LE(err, tol * scale + 1e-12) << named_plain[i].first << " step " << step;
    }
    opt_plain.step();
    opt_ac.step();
    opt_plain.zero_grad();
    opt_ac.zero_grad();
  }
  // Evaluation (no grad) recomputes nothing and leaves every unit sharded.
  {
    torch::NoGradGuard no_grad;
    ac.model->Forward(torch::zeros({1, args.seq_len}, torch::kLong));
  }
  EXPECT_EQ(TotalRecomputes(*ac.fsdp), checkpointed * backwards);
  EXPECT_EQ(ac.fsdp->NumUnshardedUnits(), 0);
}

void PrintTo(const AcCase& c, std::ostream* os) { *os << c.Name(); }

class AcParityTest : public ::testing::TestWithParam<AcCase> {};

TEST_P(AcParityTest, LossesAndGradientsEqualTheRunWithout) {
  const AcCase c = GetParam();
  testing::RunOnRanks(c.world, [&](int rank) { CompareWithoutCheckpointing(c, rank); });
}

std::vector<AcCase> Cases() {
  const ActivationCheckpointing full{Mode::kFull, 1}, every2{Mode::kFull, 2},
      selective{Mode::kSelective, 1};
  return {
      {"full_shard", 1, full},
      {"full_shard", 2, full},
      {"full_shard", 3, selective},
      {"full_shard", 4, every2},
      {"shard_grad_op", 2, selective},
      {"shard_grad_op", 3, full},
      {"no_shard", 2, full},
      {"no_shard", 3, selective},
      {"hybrid_shard", 4, selective, 2},
      {"hybrid_shard_zero2", 4, full, 2},
      {"full_shard", 4, full, 1, 2},
      {"full_shard", 2, selective, 1, 0, true},
      {"full_shard", 1, every2, 1, 0, true},
      {"full_shard", 2, selective, 1, 0, false, true},
      {"full_shard", 2, selective, 1, 0, true, true},
      {"shard_grad_op", 2, full, 1, 0, true, true},
  };
}

INSTANTIATE_TEST_SUITE_P(Modes, AcParityTest, ::testing::ValuesIn(Cases()),
                         [](const ::testing::TestParamInfo<AcCase>& info) {
                           return info.param.Name();
                         });

// Peak bytes of one forward + backward on one rank, per mode, from the real allocations.
TEST(ActivationCheckpointingTest, ActivationMemoryFalls) {
  testing::RunOnRanks(1, [](int) {
    CpuMemoryTracker& tracker = CpuMemoryTracker::Install();
    std::shared_ptr<DistContext> ctx = testing::InitDist();
    DeviceMesh mesh = *DeviceMesh::Create(ctx, *MeshShapeForStrategy(Strategy::kFullShard, 1, 1));
    ModelArgs args = TinyLlama(/*seq=*/128);
    args.n_layers = 6;
    std::map<std::string, int64_t> peak;
    for (auto [name, ac] : {std::pair<std::string, ActivationCheckpointing>{"none", {}},
                            {"selective", {Mode::kSelective, 1}},
                            {"full", {Mode::kFull, 1}}}) {
      FsdpOptions options = OptionsForStrategy(Strategy::kFullShard);
      options.activation_checkpointing = ac;
      Built b = Build(args, mesh, options);
      torch::manual_seed(5);
      torch::Tensor tokens = torch::randint(args.vocab_size, {8, args.seq_len});
      const int64_t before = tracker.current_bytes();
      tracker.ResetPeak();
      torch::Tensor logits = b.model->Forward(tokens);
      torch::nn::functional::cross_entropy(logits.reshape({-1, args.vocab_size}),
                                           tokens.reshape({-1}))
          .backward();
      peak[name] = tracker.peak_bytes() - before;
      std::printf("activation checkpointing %-9s peak %8.2f MiB above the model\n", name.c_str(),
                  peak[name] / 1048576.0);
    }
    EXPECT_LT(peak["full"], peak["selective"]);
    EXPECT_LT(peak["selective"], peak["none"]);
    // Six blocks keep only their inputs plus one block's recompute: well under half.
    EXPECT_LT(peak["full"], peak["none"] * 0.6);
  });
}

// A unit that draws random numbers cannot be recomputed: an error naming the key.
struct DropoutBlockImpl : torch::nn::Module {
  DropoutBlockImpl() { w = register_parameter("w", torch::randn({6, 6})); }
  torch::Tensor forward(const torch::Tensor& x) {
    return UnitForward(this, x, [this](const torch::Tensor& h) {
      return torch::dropout(Linear(h, w), 0.5, /*train=*/true);
    });
  }
  torch::Tensor w;
};
TORCH_MODULE(DropoutBlock);

struct PlainBlockImpl : torch::nn::Module {
  PlainBlockImpl() { w = register_parameter("w", torch::randn({6, 6})); }
  torch::Tensor forward(const torch::Tensor& x) {
    return UnitForward(this, x, [this](const torch::Tensor& h) { return Linear(h, w); });
  }
  torch::Tensor w;
};
TORCH_MODULE(PlainBlock);

struct NestedImpl : torch::nn::Module {
  NestedImpl() {
    inner = register_module("inner", PlainBlock());
    v = register_parameter("v", torch::randn({6, 6}));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return UnitForward(this, x, [this](const torch::Tensor& h) {
      return inner->forward(Linear(h, v));
    });
  }
  PlainBlock inner{nullptr};
  torch::Tensor v;
};
TORCH_MODULE(Nested);

// A root unit around one block (Block: DropoutBlock or Nested).
template <typename Block>
struct RootImpl : torch::nn::Module {
  RootImpl() { block = register_module("block", Block()); }
  torch::Tensor forward(const torch::Tensor& x) {
    return UnitForward(this, x, [this](const torch::Tensor& h) { return block->forward(h); });
  }
  Block block{nullptr};
};

TEST(ActivationCheckpointingTest, WhatCannotBeRecomputedIsAnError) {
  testing::RunOnRanks(1, [](int) {
    std::shared_ptr<DistContext> ctx = testing::InitDist();
    DeviceMesh mesh = *DeviceMesh::Create(ctx, *MeshShapeForStrategy(Strategy::kFullShard, 1, 1));
    FsdpOptions options = OptionsForStrategy(Strategy::kFullShard);
    options.activation_checkpointing = {Mode::kFull, 1};
    {
      auto root = std::make_shared<RootImpl<DropoutBlock>>();
      auto f = FsdpModel::Wrap(root, mesh, {root->block.ptr()}, options);
      ASSERT_TRUE(f.ok()) << f.status();
      torch::Tensor x = torch::randn({2, 6}, torch::requires_grad());
      try {
        root->forward(x);
        ADD_FAILURE() << "a dropout unit was checkpointed";
      } catch (const c10::Error& e) {
        EXPECT_THAT(e.what(), HasSubstr("training.activation_checkpointing: unit"));
        EXPECT_THAT(e.what(), HasSubstr("draws random numbers"));
      }
    }
    {
      auto root = std::make_shared<RootImpl<Nested>>();
      auto f = FsdpModel::Wrap(root, mesh, {root->block.ptr(), root->block->inner.ptr()}, options);
      ASSERT_TRUE(f.ok()) << f.status();
      try {
        root->forward(torch::randn({2, 6}, torch::requires_grad()));
        ADD_FAILURE() << "a unit nested in a checkpointed unit was accepted";
      } catch (const c10::Error& e) {
        EXPECT_THAT(e.what(), HasSubstr("cannot contain other units"));
      }
    }
  });
}

TEST(ActivationCheckpointingConfigTest, KeysParseAndAreRefusedWithoutTheWrapper) {
  for (auto [text, yaml] : {std::pair<std::string, std::string>{"none", "none"},
                            {"full", "full"}, {"every:1", "full"}, {"every:3", "every:3"},
                            {"selective", "selective"}}) {
    absl::StatusOr<RunConfig> c =
        ParseRunConfig("", "t.yaml", {"training.activation_checkpointing=" + text});
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_EQ(c->Value("training.activation_checkpointing"), yaml);
  }
  for (const std::string bad : {"every:0", "every:x", "partial", "true"}) {
    absl::StatusOr<RunConfig> c =
        ParseRunConfig("", "t.yaml", {"training.activation_checkpointing=" + bad});
    ASSERT_FALSE(c.ok()) << bad;
    EXPECT_THAT(c.status().message(), HasSubstr("training.activation_checkpointing"));
    EXPECT_THAT(c.status().message(), HasSubstr("every:k"));
  }
  absl::StatusOr<RunConfig> unwrapped = ParseRunConfig(
      "", "t.yaml", {"parallelism.strategy=none", "training.activation_checkpointing=full"});
  ASSERT_FALSE(unwrapped.ok());
  EXPECT_THAT(unwrapped.status().message(), HasSubstr("training.activation_checkpointing"));
  EXPECT_THAT(unwrapped.status().message(), HasSubstr("parallelism.strategy none"));
  absl::StatusOr<RunConfig> offload =
      ParseRunConfig("", "t.yaml", {"parallelism.strategy=none", "parallelism.offload=params"});
  ASSERT_FALSE(offload.ok());
  EXPECT_THAT(offload.status().message(), HasSubstr("parallelism.offload"));
  absl::StatusOr<RunConfig> plan = ParseRunConfig(
      "", "t.yaml", {"training.activation_checkpointing=every:2", "parallelism.offload=optimizer"});
  ASSERT_TRUE(plan.ok()) << plan.status();
  absl::StatusOr<ShardingPlan> sharding = ShardingPlanFor(*plan, Strategy::kFullShard, 2);
  ASSERT_TRUE(sharding.ok());
  EXPECT_EQ(sharding->options.activation_checkpointing,
            (ActivationCheckpointing{Mode::kFull, 2}));
  EXPECT_EQ(sharding->options.offload, Offload::kOptimizer);
}

}  // namespace
}  // namespace fsdp
