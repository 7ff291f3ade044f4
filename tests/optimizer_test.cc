#include "engine/optimizer.h"

#include <algorithm>
#include <string>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include "common/strings.h"
#include "engine/host_adam.h"
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

TEST(OptimizerImplementationTest, NamesRoundTrip) {
  EXPECT_THAT(OptimizerImplementationNames(), ElementsAre("fused", "foreach", "per_tensor"));
  for (const std::string& name : OptimizerImplementationNames()) {
    ASSERT_TRUE(ParseOptimizerImplementation(name).has_value()) << name;
    EXPECT_EQ(OptimizerImplementationName(*ParseOptimizerImplementation(name)), name);
  }
  EXPECT_EQ(ParseOptimizerImplementation("Fused"), std::nullopt);
}

// Three parameters of two shapes and two dtypes (two batches for the multi-tensor kernels).
std::vector<at::Tensor> Params() {
  at::manual_seed(0);
  return {at::randn({64, 33}), at::randn({7}), at::randn({5, 3}, at::kDouble)};
}

std::vector<at::Tensor> Trainable(const std::vector<at::Tensor>& init) {
  std::vector<at::Tensor> out;
  for (const at::Tensor& t : init) out.push_back(t.clone().requires_grad_(true));
  return out;
}

// `steps` steps with gradients drawn from `seed`; parameter 1 skips step 1 (no gradient), as a
// frozen or unused parameter would.
void Train(torch::optim::Optimizer& opt, std::vector<at::Tensor>& params, int steps,
           uint64_t seed) {
  at::manual_seed(seed);
  for (int step = 0; step < steps; ++step) {
    for (size_t i = 0; i < params.size(); ++i) {
      at::Tensor g = at::randn(params[i].sizes(), params[i].options().requires_grad(false)) * 1e-2;
      if (i == 1 && step == 1) {
        params[i].mutable_grad() = at::Tensor();
      } else {
        params[i].mutable_grad() = g;
      }
    }
    opt.step();
  }
}

double MaxDiff(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  double diff = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff = std::max(diff, (a[i] - b[i]).abs().max().item<double>());
  }
  return diff;
}

struct Case {
  OptimizerKind kind;
  OptimizerImplementation implementation;
  double weight_decay;
  double momentum = 0.9;
};

std::string Name(const Case& c) {
  return StrCat(OptimizerKindName(c.kind), "/", OptimizerImplementationName(c.implementation),
                "/wd=", c.weight_decay, "/momentum=", c.momentum);
}

// fused and foreach are libtorch's per-tensor step up to rounding, keep the same state under the
// same names (checkpoints), and the same step counter.
TEST(MultiTensorOptimizerTest, MatchesLibtorchsStepToRounding) {
  std::vector<Case> cases;
  for (auto implementation : {OptimizerImplementation::kFused, OptimizerImplementation::kForeach}) {
    for (OptimizerKind kind : {OptimizerKind::kAdamW, OptimizerKind::kAdam, OptimizerKind::kSgd}) {
      for (double wd : {0.0, 0.1}) cases.push_back({kind, implementation, wd});
    }
    cases.push_back({OptimizerKind::kSgd, implementation, 0.1, /*momentum=*/0.0});
  }
  for (const Case& c : cases) {
    SCOPED_TRACE(Name(c));
    OptimizerOptions o{.kind = c.kind, .lr = 1e-2, .weight_decay = c.weight_decay,
                       .momentum = c.momentum};
    std::vector<at::Tensor> init = Params();
    std::vector<at::Tensor> plain_p = Trainable(init), multi_p = Trainable(init);
    OptimizerOptions plain_o = o;
    plain_o.implementation = OptimizerImplementation::kPerTensor;
    o.implementation = c.implementation;
    std::unique_ptr<torch::optim::Optimizer> plain = BuildOptimizer(plain_o, plain_p);
    std::unique_ptr<torch::optim::Optimizer> multi = BuildOptimizer(o, multi_p);
    EXPECT_EQ(KindOf(*multi), c.kind);
    Train(*plain, plain_p, 5, 7);
    Train(*multi, multi_p, 5, 7);
    const double diff = MaxDiff(plain_p, multi_p);
    EXPECT_LT(diff, 1e-6);
    EXPECT_GT(MaxDiff(init, multi_p), 1e-3) << "the parameters did not move";
    ASSERT_EQ(plain->state().size(), multi->state().size());
    for (size_t i = 0; i < plain_p.size(); ++i) {
      auto it = multi->state().find(multi_p[i].unsafeGetTensorImpl());
      if (c.kind == OptimizerKind::kSgd && c.momentum == 0) {
        EXPECT_EQ(it, multi->state().end());  // libtorch keeps no state without momentum
        continue;
      }
      ASSERT_NE(it, multi->state().end());
      auto& a = *plain->state().at(plain_p[i].unsafeGetTensorImpl());
      std::vector<OptimizerStateTensor> sa = StateTensors(a), sb = StateTensors(*it->second);
      ASSERT_EQ(sa.size(), sb.size());
      for (size_t j = 0; j < sa.size(); ++j) {
        EXPECT_EQ(sa[j].name, sb[j].name);
        EXPECT_TRUE(at::allclose(*sa[j].tensor, *sb[j].tensor, 1e-5, 1e-9)) << sa[j].name;
      }
      if (int64_t* step = StepCounter(a)) {
        EXPECT_EQ(*StepCounter(*it->second), *step);
        EXPECT_EQ(*step, i == 1 ? 4 : 5);  // parameter 1 skipped a step
      }
    }
  }
}

// A state that another optimizer made (a checkpoint load puts fresh states in) continues where
// it was: the fused step's device-side step counts follow the int64 counters they cache.
TEST(MultiTensorOptimizerTest, ResumesFromAnotherOptimizersState) {
  for (OptimizerKind kind : {OptimizerKind::kAdamW, OptimizerKind::kSgd}) {
    for (auto implementation :
         {OptimizerImplementation::kFused, OptimizerImplementation::kForeach}) {
      SCOPED_TRACE(StrCat(OptimizerKindName(kind), "/", OptimizerImplementationName(implementation)));
      OptimizerOptions o{.kind = kind, .lr = 1e-2, .weight_decay = 0.1};
      std::vector<at::Tensor> init = Params();
      // Reference: 3 + 4 steps of per_tensor in one optimizer.
      OptimizerOptions plain_o = o;
      plain_o.implementation = OptimizerImplementation::kPerTensor;
      std::vector<at::Tensor> ref_p = Trainable(init);
      std::unique_ptr<torch::optim::Optimizer> ref = BuildOptimizer(plain_o, ref_p);
      Train(*ref, ref_p, 3, 1);
      Train(*ref, ref_p, 4, 2);
      // Resumed: the multi-tensor optimizer steps 2 (its caches fill), then gets the state of
      // a per_tensor run of 3 steps (as a load writes it), then steps 4.
      o.implementation = implementation;
      std::vector<at::Tensor> p = Trainable(init);
      std::unique_ptr<torch::optim::Optimizer> multi = BuildOptimizer(o, p);
      Train(*multi, p, 2, 9);
      std::vector<at::Tensor> saved_p = Trainable(init);
      std::unique_ptr<torch::optim::Optimizer> saved = BuildOptimizer(plain_o, saved_p);
      Train(*saved, saved_p, 3, 1);
      for (size_t i = 0; i < p.size(); ++i) {
        at::NoGradGuard no_grad;
        p[i].copy_(saved_p[i]);
        auto& from = *saved->state().at(saved_p[i].unsafeGetTensorImpl());
        std::unique_ptr<torch::optim::OptimizerParamState> state = NewParamState(*multi);
        std::vector<OptimizerStateTensor> src = StateTensors(from), dst = StateTensors(*state);
        for (size_t j = 0; j < src.size(); ++j) *dst[j].tensor = src[j].tensor->clone();
        if (int64_t* step = StepCounter(from)) *StepCounter(*state) = *step;
        multi->state()[p[i].unsafeGetTensorImpl()] = std::move(state);
      }
      Train(*multi, p, 4, 2);
      EXPECT_LT(MaxDiff(ref_p, p), 1e-6);
    }
  }
}
// Note [Prepared steps]: a prepared step run in parts, on another thread, after the optimizer's
// learning rate changed and its .grad slots were reset, equals step() bit for bit, parameter by
// parameter, and leaves the same state; only Adam and AdamW (fused, foreach) have one.
// Parameters `a` of `opt_a` and `b` of `opt_b` equal bit for bit after `step`, with their
// states: step counters and every state tensor.
void ExpectSameStep(torch::optim::Optimizer& opt_a, const std::vector<at::Tensor>& a,
                    torch::optim::Optimizer& opt_b, const std::vector<at::Tensor>& b, int step) {
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(at::equal(a[i], b[i])) << "parameter " << i << " step " << step;
    auto& sa = *opt_a.state().at(a[i].unsafeGetTensorImpl());
    auto& sb = *opt_b.state().at(b[i].unsafeGetTensorImpl());
    EXPECT_EQ(*StepCounter(sa), *StepCounter(sb));
    std::vector<OptimizerStateTensor> ta = StateTensors(sa), tb = StateTensors(sb);
    for (size_t j = 0; j < ta.size(); ++j) {
      EXPECT_TRUE(at::equal(*ta[j].tensor, *tb[j].tensor)) << ta[j].name << " " << i;
    }
  }
}

TEST(PreparedStepTest, RunInPartsOnAnotherThreadEqualsStepBitwise) {
  for (OptimizerKind kind : {OptimizerKind::kAdamW, OptimizerKind::kAdam}) {
    for (auto implementation :
         {OptimizerImplementation::kFused, OptimizerImplementation::kForeach}) {
      SCOPED_TRACE(StrCat(OptimizerKindName(kind), "/", OptimizerImplementationName(implementation)));
      OptimizerOptions o{.kind = kind, .lr = 1e-2, .weight_decay = 0.1,
                         .implementation = implementation};
      std::vector<at::Tensor> init = Params();
      // A large tensor too: on CPU it takes the fused kernel's own threads (Note [Fused
      // optimizer steps]), the small ones one parallel region.
      at::manual_seed(3);
      init.push_back(at::randn({int64_t{1} << 18}));
      std::vector<at::Tensor> a = Trainable(init), b = Trainable(init);
      std::unique_ptr<torch::optim::Optimizer> in_place = BuildOptimizer(o, a);
      std::unique_ptr<torch::optim::Optimizer> prepared_opt = BuildOptimizer(o, b);
      for (int step = 0; step < 3; ++step) {
        at::manual_seed(50 + step);
        for (size_t i = 0; i < a.size(); ++i) {
          at::Tensor g = at::randn(a[i].sizes(), a[i].options().requires_grad(false)) * 1e-2;
          // Parameter 1 has no gradient at step 1: not stepped, not prepared.
          a[i].mutable_grad() = i == 1 && step == 1 ? at::Tensor() : g;
          b[i].mutable_grad() = i == 1 && step == 1 ? at::Tensor() : g.clone();
        }
        in_place->step();
        std::unique_ptr<PreparedStep> prepared = PrepareStep(*prepared_opt);
        ASSERT_NE(prepared, nullptr);
        EXPECT_EQ(prepared->params().size(), step == 1 ? b.size() - 1 : b.size());
        EXPECT_EQ(prepared->remaining(), prepared->params().size());
        // What the trainer does before the host runs it: the next learning rate, no .grad.
        SetLearningRate(*prepared_opt, 123.0);
        for (at::Tensor& p : b) p.mutable_grad().reset();
        std::thread host([&] {
          at::NoGradGuard no_grad;
          prepared->Run({b[3], b[0]});
          prepared->Run({b[0]});  // stepped already: ignored
          prepared->Run({b[2], b[1]});
        });
        host.join();
        EXPECT_EQ(prepared->remaining(), 0u);
        SetLearningRate(*prepared_opt, 1e-2);
        ExpectSameStep(*in_place, a, *prepared_opt, b, step);
      }
      EXPECT_GT(MaxDiff(init, b), 1e-3) << "the parameters did not move";
    }
  }
  // No prepared form: SGD, and libtorch's per-tensor classes; nothing about the state changed.
  for (OptimizerOptions o : {OptimizerOptions{.kind = OptimizerKind::kSgd},
                             OptimizerOptions{.implementation = OptimizerImplementation::kPerTensor}}) {
    std::vector<at::Tensor> p = Trainable(Params());
    std::unique_ptr<torch::optim::Optimizer> opt = BuildOptimizer(o, p);
    for (at::Tensor& t : p) t.mutable_grad() = at::ones_like(t);
    EXPECT_EQ(PrepareStep(*opt), nullptr);
    EXPECT_TRUE(opt->state().empty());
  }
}

}  // namespace
// Slices (Note [Deferred gradient conversion], sharding/offload/deferred_grads.h): the fused step's
// update of a parameter run as slices starting at multiples of 16 elements, on ATen's threads at
// once, in any order, equals step() bit for bit, state and counters included; the foreach step
// cannot.
TEST(PreparedStepTest, FusedSlicesEqualStepBitwise) {
  for (OptimizerKind kind : {OptimizerKind::kAdamW, OptimizerKind::kAdam}) {
    SCOPED_TRACE(OptimizerKindName(kind));
    OptimizerOptions o{.kind = kind, .lr = 1e-2, .weight_decay = 0.1};
    at::manual_seed(7);
    // Odd sizes: a last slice of 1, one not a multiple of 16, one shorter than a slice.
    std::vector<at::Tensor> init = {at::randn({3 * 4096 + 1}), at::randn({1000, 7}),
                                    at::randn({9})};
    std::vector<at::Tensor> a = Trainable(init), b = Trainable(init);
    std::unique_ptr<torch::optim::Optimizer> in_place = BuildOptimizer(o, a);
    std::unique_ptr<torch::optim::Optimizer> sliced = BuildOptimizer(o, b);
    for (int step = 0; step < 3; ++step) {
      at::manual_seed(70 + step);
      for (size_t i = 0; i < a.size(); ++i) {
        at::Tensor g = at::randn(a[i].sizes()) * 1e-2;
        a[i].mutable_grad() = g;
        b[i].mutable_grad() = g.clone();
      }
      in_place->step();
      std::unique_ptr<PreparedStep> prepared = PrepareStep(*sliced);
      ASSERT_NE(prepared, nullptr);
      for (at::Tensor& p : b) {
        ASSERT_TRUE(prepared->CanRunSlices(p));
        constexpr int64_t kSlice = 4096;
        const int64_t n = p.numel(), slices = (n + kSlice - 1) / kSlice;
        at::parallel_for(0, slices, 1, [&](int64_t first, int64_t last) {
          for (int64_t s = last - 1; s >= first; --s) {  // backwards, to show order is free
            prepared->RunSlice(p, s * kSlice, std::min(kSlice, n - s * kSlice));
          }
        });
        prepared->SlicesDone(p);
        EXPECT_FALSE(prepared->CanRunSlices(p));
      }
      EXPECT_EQ(prepared->remaining(), 0u);
      ExpectSameStep(*in_place, a, *sliced, b, step);
    }
  }
  std::vector<at::Tensor> p = Trainable(Params());
  std::unique_ptr<torch::optim::Optimizer> foreach_opt =
      BuildOptimizer({.implementation = OptimizerImplementation::kForeach}, p);
  for (at::Tensor& t : p) t.mutable_grad() = at::ones_like(t);
  std::unique_ptr<PreparedStep> prepared = PrepareStep(*foreach_opt);
  ASSERT_NE(prepared, nullptr);
  EXPECT_FALSE(prepared->CanRunSlices(p[0]));
}


// Note [Host Adam pass]: one loop per element gives what the separate ATen ops give, bit for bit:
// the bf16 gradient copied into fp32 (or an fp32 gradient) and multiplied by the clipping scale,
// ATen's fused Adam / AdamW on the whole tensor, the master cast to bf16 (or no copy). Sizes
// with and without a tail (numel not a multiple of the vector width), both lerp branches (beta1
// 0.9 and 0.3), AdamW's decay on and off and Adam without decay (Adam's L2 decay is not
// covered), one part and several, a first and a later step.
TEST(HostAdamPassTest, EqualsAtensSeparateOpsBitwise) {
#if defined(__x86_64__)
  // Where ATen runs the kernels the pass matches, the pass checked itself against them at first
  // use and must be on: a pass whose bits drifted turns itself off, which must not go unseen.
  const std::string capability = at::get_cpu_capability();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      (capability == "AVX2" || capability == "AVX512")) {
    ASSERT_TRUE(HostAdamPassAvailable()) << "its self-check against ATen's " << capability
                                         << " kernels failed";
  }
#endif
  if (!HostAdamPassAvailable()) {
    GTEST_SKIP() << "ATen runs its " << at::get_cpu_capability()
                 << " kernels here; the pass matches only its AVX2 / AVX-512 ones";
  }
  struct Case {
    int64_t n;
    double beta1, weight_decay;
    bool decoupled;
    float scale;
    double step;
  };
  const Case cases[] = {
      {1000003, 0.9, 0.1, true, 0.37f, 1}, {4096, 0.9, 0.1, true, 1.0f, 7},
      {333, 0.3, 0.0, true, 0.5f, 3},      {200013, 0.9, 0.01, true, 1.0f, 2},
      {70001, 0.3, 0.05, true, 0.25f, 11}, {17, 0.9, 0.0, false, 1.0f, 1},
      {65543, 0.3, 0.0, false, 0.8f, 5},  {175, 0.9, 0.1, true, 0.6f, 4},
  };
  EXPECT_FALSE(HostAdamPassCovers({1e-3, 0.9, 0.95, 1e-8, 0.1, /*decoupled=*/false, 1}));
  for (const Case& c : cases) {
    for (const bool wide : {false, true}) {  // a bf16 gradient and a copy; fp32, with and without
      for (const bool with_copy : {true, false}) {
        if (!wide && !with_copy) continue;
        SCOPED_TRACE(StrCat("n ", c.n, " beta1 ", c.beta1, " wd ", c.weight_decay, " decoupled ",
                            c.decoupled, " scale ", c.scale, " step ", c.step,
                            wide ? " fp32 gradient" : " bf16 gradient",
                            with_copy ? " with a copy" : ""));
        at::manual_seed(static_cast<uint64_t>(c.n));
        const at::Tensor grad = wide ? at::randn({c.n}) : at::randn({c.n}).to(at::kBFloat16);
        const at::Tensor param = at::randn({c.n});
        const at::Tensor exp_avg = at::randn({c.n}) * 0.1;
        const at::Tensor exp_avg_sq = at::rand({c.n}) * 0.01;
        // The separate ops.
        at::Tensor p1 = param.clone(), m1 = exp_avg.clone(), v1 = exp_avg_sq.clone();
        at::Tensor g1 = grad.to(at::kFloat, /*non_blocking=*/false, /*copy=*/true);
        if (c.scale != 1.0f) g1.mul_(at::scalar_tensor(c.scale));
        const at::Tensor step = at::full({}, c.step, at::kFloat);
        if (c.decoupled) {
          at::_fused_adamw_({p1}, {g1}, {m1}, {v1}, {}, {step}, 1e-3, c.beta1, 0.95,
                            c.weight_decay, 1e-8, false, false);
        } else {
          at::_fused_adam_({p1}, {g1}, {m1}, {v1}, {}, {step}, 1e-3, c.beta1, 0.95,
                           c.weight_decay, 1e-8, false, false);
        }
        const at::Tensor copy1 = p1.to(at::kBFloat16);
        // The pass.
        at::Tensor p2 = param.clone(), m2 = exp_avg.clone(), v2 = exp_avg_sq.clone();
        at::Tensor copy2 = at::zeros({c.n}, at::kBFloat16);
        HostAdamHyper hyper;
        hyper.lr = 1e-3;
        hyper.beta1 = c.beta1;
        hyper.beta2 = 0.95;
        hyper.eps = 1e-8;
        hyper.weight_decay = c.weight_decay;
        hyper.decoupled = c.decoupled;
        hyper.step = c.step;
        HostAdamPass(hyper, c.scale, c.n, p2.data_ptr<float>(), m2.data_ptr<float>(),
                     v2.data_ptr<float>(), grad,
                     with_copy ? static_cast<uint16_t*>(copy2.data_ptr()) : nullptr);
        EXPECT_TRUE(at::equal(p1, p2)) << (p1 - p2).abs().max().item<float>();
        EXPECT_TRUE(at::equal(m1, m2)) << (m1 - m2).abs().max().item<float>();
        EXPECT_TRUE(at::equal(v1, v2)) << (v1 - v2).abs().max().item<float>();
        // Without a copy nothing is written there.
        EXPECT_TRUE(at::equal(with_copy ? copy1 : at::zeros_like(copy2), copy2));
      }
    }
  }
}

}  // namespace fsdp
