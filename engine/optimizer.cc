#include "engine/optimizer.h"

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

namespace fsdp {

std::string_view OptimizerKindName(OptimizerKind kind) {
  switch (kind) {
    case OptimizerKind::kAdamW: return "adamw";
    case OptimizerKind::kAdam: return "adam";
    case OptimizerKind::kSgd: return "sgd";
  }
  return "?";
}

std::optional<OptimizerKind> ParseOptimizerKind(std::string_view name) {
  for (OptimizerKind kind : {OptimizerKind::kAdamW, OptimizerKind::kAdam, OptimizerKind::kSgd}) {
    if (OptimizerKindName(kind) == name) return kind;
  }
  return std::nullopt;
}

std::vector<std::string> OptimizerKindNames() { return {"adamw", "adam", "sgd"}; }

std::unique_ptr<torch::optim::Optimizer> BuildOptimizer(const OptimizerOptions& o,
                                                        std::vector<at::Tensor> params) {
  switch (o.kind) {
    case OptimizerKind::kSgd:
      return std::make_unique<torch::optim::SGD>(
          params, torch::optim::SGDOptions(o.lr).momentum(o.momentum).weight_decay(o.weight_decay));
    case OptimizerKind::kAdam:
      return std::make_unique<torch::optim::Adam>(
          params, torch::optim::AdamOptions(o.lr).betas({o.beta1, o.beta2}).eps(o.eps)
                      .weight_decay(o.weight_decay));
    case OptimizerKind::kAdamW:
      break;
  }
  return std::make_unique<torch::optim::AdamW>(
      params, torch::optim::AdamWOptions(o.lr).betas({o.beta1, o.beta2}).eps(o.eps)
                  .weight_decay(o.weight_decay));
}

void SetLearningRate(torch::optim::Optimizer& optimizer, double lr) {
  for (auto& group : optimizer.param_groups()) group.options().set_lr(lr);
}

}  // namespace fsdp
