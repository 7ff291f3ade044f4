#include "engine/optimizer.h"

#include <array>
#include <utility>

#include <ATen/ATen.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

namespace fsdp {
namespace {

constexpr std::array<std::pair<OptimizerKind, std::string_view>, 3> kKinds = {{
    {OptimizerKind::kAdamW, "adamw"},
    {OptimizerKind::kAdam, "adam"},
    {OptimizerKind::kSgd, "sgd"},
}};

// Adam / AdamW stepped by ATen's fused kernel: see BuildOptimizer. The kernel reads the step
// count from a float tensor and computes the bias corrections from it itself; libtorch's
// int64 counter stays the state (and what checkpoints save).
template <typename Base, typename State, typename Options, bool kDecoupledDecay>
class FusedAdam final : public Base {
 public:
  using Base::Base;

  at::Tensor step(torch::optim::Optimizer::LossClosure closure = nullptr) override {
    at::NoGradGuard no_grad;
    at::Tensor loss;
    if (closure != nullptr) {
      at::AutoGradMode enable_grad(true);
      loss = closure();
    }
    for (auto& group : this->param_groups()) {
      const auto& o = static_cast<const Options&>(group.options());
      std::vector<at::Tensor> params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps;
      for (const at::Tensor& p : group.params()) {
        if (!p.grad().defined()) continue;
        auto& slot = this->state_[p.unsafeGetTensorImpl()];
        if (!slot) {  // as libtorch's first step
          auto fresh = std::make_unique<State>();
          fresh->exp_avg(at::zeros_like(p, at::MemoryFormat::Preserve));
          fresh->exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
          if (o.amsgrad()) fresh->max_exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
          slot = std::move(fresh);
        }
        auto& state = static_cast<State&>(*slot);
        state.step(state.step() + 1);
        params.push_back(p);
        grads.push_back(p.grad());
        exp_avgs.push_back(state.exp_avg());
        exp_avg_sqs.push_back(state.exp_avg_sq());
        if (o.amsgrad()) max_exp_avg_sqs.push_back(state.max_exp_avg_sq());
        steps.push_back(at::scalar_tensor(static_cast<double>(state.step()),
                                          at::TensorOptions().dtype(at::kFloat)));
      }
      if (params.empty()) continue;
      const auto [beta1, beta2] = o.betas();
      if constexpr (kDecoupledDecay) {
        at::_fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, o.lr(),
                          beta1, beta2, o.weight_decay(), o.eps(), o.amsgrad(),
                          /*maximize=*/false);
      } else {
        at::_fused_adam_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, o.lr(),
                         beta1, beta2, o.weight_decay(), o.eps(), o.amsgrad(),
                         /*maximize=*/false);
      }
    }
    return loss;
  }
};

using FusedAdamW =
    FusedAdam<torch::optim::AdamW, torch::optim::AdamWParamState, torch::optim::AdamWOptions, true>;
using FusedAdamL2 =
    FusedAdam<torch::optim::Adam, torch::optim::AdamParamState, torch::optim::AdamOptions, false>;

}  // namespace

std::string_view OptimizerKindName(OptimizerKind kind) {
  for (const auto& [k, name] : kKinds) {
    if (k == kind) return name;
  }
  return "unknown";
}

std::optional<OptimizerKind> ParseOptimizerKind(std::string_view name) {
  for (const auto& [kind, kind_name] : kKinds) {
    if (kind_name == name) return kind;
  }
  return std::nullopt;
}

std::vector<std::string> OptimizerKindNames() {
  std::vector<std::string> names;
  for (const auto& entry : kKinds) names.emplace_back(entry.second);
  return names;
}

std::unique_ptr<torch::optim::Optimizer> BuildOptimizer(const OptimizerOptions& o,
                                                        std::vector<at::Tensor> params,
                                                        bool fused) {
  switch (o.kind) {
    case OptimizerKind::kSgd:
      return std::make_unique<torch::optim::SGD>(
          std::move(params),
          torch::optim::SGDOptions(o.lr).momentum(o.momentum).weight_decay(o.weight_decay));
    case OptimizerKind::kAdam: {
      auto adam = torch::optim::AdamOptions(o.lr)
                      .betas({o.beta1, o.beta2})
                      .eps(o.eps)
                      .weight_decay(o.weight_decay);
      if (fused) return std::make_unique<FusedAdamL2>(std::move(params), adam);
      return std::make_unique<torch::optim::Adam>(std::move(params), adam);
    }
    case OptimizerKind::kAdamW:
      break;
  }
  auto adamw = torch::optim::AdamWOptions(o.lr)
                   .betas({o.beta1, o.beta2})
                   .eps(o.eps)
                   .weight_decay(o.weight_decay);
  if (fused) return std::make_unique<FusedAdamW>(std::move(params), adamw);
  return std::make_unique<torch::optim::AdamW>(std::move(params), adamw);
}

void SetLearningRate(torch::optim::Optimizer& optimizer, double lr) {
  for (auto& group : optimizer.param_groups()) group.options().set_lr(lr);
}

std::optional<OptimizerKind> KindOf(const torch::optim::Optimizer& optimizer) {
  // AdamW before Adam: neither derives from the other in libtorch, but keep the order explicit.
  if (dynamic_cast<const torch::optim::AdamW*>(&optimizer)) return OptimizerKind::kAdamW;
  if (dynamic_cast<const torch::optim::Adam*>(&optimizer)) return OptimizerKind::kAdam;
  if (dynamic_cast<const torch::optim::SGD*>(&optimizer)) return OptimizerKind::kSgd;
  return std::nullopt;
}

std::vector<std::string_view> StateTensorNames(OptimizerKind kind) {
  if (kind == OptimizerKind::kSgd) return {"momentum_buffer"};
  return {"exp_avg", "exp_avg_sq"};
}

std::vector<OptimizerStateTensor> StateTensors(torch::optim::OptimizerParamState& state) {
  if (auto* a = dynamic_cast<torch::optim::AdamWParamState*>(&state)) {
    return {{"exp_avg", &a->exp_avg()}, {"exp_avg_sq", &a->exp_avg_sq()}};
  }
  if (auto* a = dynamic_cast<torch::optim::AdamParamState*>(&state)) {
    return {{"exp_avg", &a->exp_avg()}, {"exp_avg_sq", &a->exp_avg_sq()}};
  }
  if (auto* s = dynamic_cast<torch::optim::SGDParamState*>(&state)) {
    return {{"momentum_buffer", &s->momentum_buffer()}};
  }
  return {};
}

int64_t OptimizerStateBytes(torch::optim::Optimizer& optimizer) {
  int64_t bytes = 0;
  for (auto& [impl, state] : optimizer.state()) {
    for (const OptimizerStateTensor& t : StateTensors(*state)) {
      if (t.tensor->defined()) bytes += static_cast<int64_t>(t.tensor->nbytes());
    }
  }
  return bytes;
}

int64_t* StepCounter(torch::optim::OptimizerParamState& state) {
  if (auto* a = dynamic_cast<torch::optim::AdamWParamState*>(&state)) return &a->step();
  if (auto* a = dynamic_cast<torch::optim::AdamParamState*>(&state)) return &a->step();
  return nullptr;
}

std::unique_ptr<torch::optim::OptimizerParamState> NewParamState(
    const torch::optim::Optimizer& optimizer) {
  switch (KindOf(optimizer).value_or(OptimizerKind::kSgd)) {
    case OptimizerKind::kAdamW:
      return std::make_unique<torch::optim::AdamWParamState>();
    case OptimizerKind::kAdam:
      return std::make_unique<torch::optim::AdamParamState>();
    case OptimizerKind::kSgd:
      break;
  }
  return std::make_unique<torch::optim::SGDParamState>();
}

}  // namespace fsdp
