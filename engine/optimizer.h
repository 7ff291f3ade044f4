// Optimizers: one place that builds them from the `optimizer` section and names their state
// for checkpoints.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <ATen/core/Tensor.h>

namespace torch::optim {
class Optimizer;
}

namespace fsdp {

enum class OptimizerKind { kAdamW, kAdam, kSgd };
std::string_view OptimizerKindName(OptimizerKind kind);  // "adamw" | "adam" | "sgd"
std::optional<OptimizerKind> ParseOptimizerKind(std::string_view name);
std::vector<std::string> OptimizerKindNames();  // for "valid: ..." messages

struct OptimizerOptions {  // the YAML `optimizer` section, typed
  OptimizerKind kind = OptimizerKind::kAdamW;
  double lr = 3e-3;
  double weight_decay = 0.1;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double momentum = 0.9;  // sgd
};

std::unique_ptr<torch::optim::Optimizer> BuildOptimizer(const OptimizerOptions& options,
                                                        std::vector<at::Tensor> params);
void SetLearningRate(torch::optim::Optimizer& optimizer, double lr);

}  // namespace fsdp
