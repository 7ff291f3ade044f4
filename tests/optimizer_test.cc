#include "engine/optimizer.h"

#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fsdp {
namespace {

using ::testing::ElementsAre;

TEST(OptimizerKindTest, NamesRoundTrip) {
  EXPECT_THAT(OptimizerKindNames(), ElementsAre("adamw", "adam", "sgd"));
  for (OptimizerKind kind : {OptimizerKind::kAdamW, OptimizerKind::kAdam, OptimizerKind::kSgd}) {
    EXPECT_EQ(ParseOptimizerKind(OptimizerKindName(kind)), kind);
  }
  EXPECT_EQ(ParseOptimizerKind("AdamW"), std::nullopt);
  EXPECT_EQ(ParseOptimizerKind("lion"), std::nullopt);
}

// One parameter with a gradient, one step: the optimizer of `options` has its state.
std::unique_ptr<torch::optim::Optimizer> BuildAndStep(const OptimizerOptions& options,
                                                      at::Tensor& param) {
  param = at::ones({3, 2}).requires_grad_(true);
  std::unique_ptr<torch::optim::Optimizer> opt = BuildOptimizer(options, {param});
  param.mutable_grad() = at::full({3, 2}, 0.5);
  opt->step();
  return opt;
}

// Adam and AdamW take the same hyper-parameters.
template <typename Optimizer, typename Options>
void CheckAdamFamily(OptimizerKind kind) {
  OptimizerOptions o{
      .kind = kind, .lr = 0.01, .weight_decay = 0.2, .beta1 = 0.8, .beta2 = 0.9, .eps = 1e-6};
  at::Tensor p;
  std::unique_ptr<torch::optim::Optimizer> opt = BuildAndStep(o, p);
  ASSERT_NE(dynamic_cast<Optimizer*>(opt.get()), nullptr);
  const auto& g = static_cast<const Options&>(opt->param_groups()[0].options());
  EXPECT_EQ(g.lr(), 0.01);
  EXPECT_EQ(g.weight_decay(), 0.2);
  EXPECT_EQ(std::get<0>(g.betas()), 0.8);
  EXPECT_EQ(std::get<1>(g.betas()), 0.9);
  EXPECT_EQ(g.eps(), 1e-6);
  EXPECT_EQ(KindOf(*opt), kind);
  SetLearningRate(*opt, 0.5);
  EXPECT_EQ(opt->param_groups()[0].options().get_lr(), 0.5);
}

TEST(BuildOptimizerTest, AdamW) {
  CheckAdamFamily<torch::optim::AdamW, torch::optim::AdamWOptions>(OptimizerKind::kAdamW);
}

TEST(BuildOptimizerTest, Adam) {
  CheckAdamFamily<torch::optim::Adam, torch::optim::AdamOptions>(OptimizerKind::kAdam);
}

TEST(BuildOptimizerTest, Sgd) {
  OptimizerOptions o{.kind = OptimizerKind::kSgd, .lr = 0.1, .weight_decay = 0.01, .momentum = 0.5};
  at::Tensor p;
  std::unique_ptr<torch::optim::Optimizer> opt = BuildAndStep(o, p);
  ASSERT_NE(dynamic_cast<torch::optim::SGD*>(opt.get()), nullptr);
  const auto& g = static_cast<const torch::optim::SGDOptions&>(opt->param_groups()[0].options());
  EXPECT_EQ(g.lr(), 0.1);
  EXPECT_EQ(g.weight_decay(), 0.01);
  EXPECT_EQ(g.momentum(), 0.5);
  EXPECT_EQ(KindOf(*opt), OptimizerKind::kSgd);
}

// The state names a checkpoint saves match StateTensorNames, and a fresh state of the same
// kind exposes the same names (so a save loads back into it).
TEST(OptimizerStateTest, NamesRoundTrip) {
  for (OptimizerKind kind : {OptimizerKind::kAdamW, OptimizerKind::kAdam, OptimizerKind::kSgd}) {
    SCOPED_TRACE(std::string(OptimizerKindName(kind)));
    at::Tensor p;
    std::unique_ptr<torch::optim::Optimizer> opt = BuildAndStep({.kind = kind}, p);
    auto it = opt->state().find(p.unsafeGetTensorImpl());
    ASSERT_NE(it, opt->state().end());
    std::vector<std::string_view> names;
    for (const OptimizerStateTensor& s : StateTensors(*it->second)) {
      names.push_back(s.name);
      ASSERT_TRUE(s.tensor->defined()) << s.name;
      EXPECT_EQ(s.tensor->sizes(), p.sizes()) << s.name;
    }
    EXPECT_EQ(names, StateTensorNames(kind));
    std::unique_ptr<torch::optim::OptimizerParamState> fresh = NewParamState(*opt);
    std::vector<std::string_view> fresh_names;
    for (const OptimizerStateTensor& s : StateTensors(*fresh)) fresh_names.push_back(s.name);
    EXPECT_EQ(fresh_names, names);
    int64_t* step = StepCounter(*it->second);
    if (kind == OptimizerKind::kSgd) {
      EXPECT_EQ(step, nullptr);
      EXPECT_EQ(StepCounter(*fresh), nullptr);
    } else {
      ASSERT_NE(step, nullptr);
      EXPECT_EQ(*step, 1);
      ASSERT_NE(StepCounter(*fresh), nullptr);
      EXPECT_EQ(*StepCounter(*fresh), 0);
    }
  }
}

// The fused host step (parallelism.offload) is libtorch's Adam / AdamW up to rounding, keeps the
// same state under the same names (checkpoints), and resumes from a state libtorch's made.
TEST(FusedOptimizerTest, MatchesLibtorchsStepToRounding) {
  for (OptimizerKind kind : {OptimizerKind::kAdamW, OptimizerKind::kAdam}) {
    SCOPED_TRACE(std::string(OptimizerKindName(kind)));
    OptimizerOptions o{
        .kind = kind, .lr = 1e-2, .weight_decay = 0.1, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8};
    at::manual_seed(0);
    at::Tensor init = at::randn({64, 33});
    at::Tensor plain_p = init.clone().requires_grad_(true);
    at::Tensor fused_p = init.clone().requires_grad_(true);
    std::unique_ptr<torch::optim::Optimizer> plain = BuildOptimizer(o, {plain_p});
    std::unique_ptr<torch::optim::Optimizer> fused = BuildOptimizer(o, {fused_p}, /*fused=*/true);
    EXPECT_EQ(KindOf(*fused), kind);
    for (int step = 0; step < 5; ++step) {
      at::Tensor g = at::randn({64, 33}) * 1e-2;
      plain_p.mutable_grad() = g.clone();
      fused_p.mutable_grad() = g.clone();
      plain->step();
      fused->step();
    }
    const double diff = (plain_p - fused_p).abs().max().item<double>();
    EXPECT_GT(diff, 0.0) << "the fused kernel did not run";  // other roundings, not bitwise
    EXPECT_LT(diff, 1e-6);
    auto& plain_state = *plain->state().at(plain_p.unsafeGetTensorImpl());
    auto& fused_state = *fused->state().at(fused_p.unsafeGetTensorImpl());
    std::vector<OptimizerStateTensor> a = StateTensors(plain_state), b = StateTensors(fused_state);
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i) {
      EXPECT_EQ(a[i].name, b[i].name);
      EXPECT_TRUE(at::allclose(*a[i].tensor, *b[i].tensor, 1e-5, 1e-9)) << a[i].name;
    }
    EXPECT_EQ(*StepCounter(fused_state), 5);
  }
}

}  // namespace
}  // namespace fsdp
