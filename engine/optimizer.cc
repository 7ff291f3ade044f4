#include "engine/optimizer.h"

#include <array>
#include <utility>

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
                                                        std::vector<at::Tensor> params) {
  switch (o.kind) {
    case OptimizerKind::kSgd:
      return std::make_unique<torch::optim::SGD>(
          std::move(params),
          torch::optim::SGDOptions(o.lr).momentum(o.momentum).weight_decay(o.weight_decay));
    case OptimizerKind::kAdam:
      return std::make_unique<torch::optim::Adam>(std::move(params),
                                                  torch::optim::AdamOptions(o.lr)
                                                      .betas({o.beta1, o.beta2})
                                                      .eps(o.eps)
                                                      .weight_decay(o.weight_decay));
    case OptimizerKind::kAdamW:
      break;
  }
  return std::make_unique<torch::optim::AdamW>(std::move(params),
                                               torch::optim::AdamWOptions(o.lr)
                                                   .betas({o.beta1, o.beta2})
                                                   .eps(o.eps)
                                                   .weight_decay(o.weight_decay));
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
