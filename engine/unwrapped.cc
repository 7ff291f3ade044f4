#include "engine/unwrapped.h"

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include "common/status.h"
#include "engine/checkpointing.h"
#include "sharding/fsdp_model.h"

namespace fsdp {

UnwrappedModel::UnwrappedModel(std::shared_ptr<torch::nn::Module> module,
                               at::ScalarType compute_dtype)
    : module_(std::move(module)), mixed_(compute_dtype != at::kFloat) {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> all_masters;
  for (const auto& item : module_->named_parameters()) {
    names_.push_back(item.key());
    params_.push_back(item.value());
    all_masters.push_back(mixed_ ? item.value().detach().to(at::kFloat, /*non_blocking=*/false,
                                                             /*copy=*/true)
                                       .requires_grad_(item.value().requires_grad())
                                 : item.value());
  }
  if (mixed_) module_->to(compute_dtype);
  for (size_t i = 0; i < params_.size(); ++i) {
    if (params_[i].requires_grad()) {
      trainable_.push_back(i);
      masters_.push_back(all_masters[i]);
    }
  }
  all_masters_ = std::move(all_masters);
}

void UnwrappedModel::AfterBackward() {
  if (!mixed_) return;
  at::NoGradGuard no_grad;
  for (size_t k = 0; k < trainable_.size(); ++k) {
    at::Tensor& grad = params_[trainable_[k]].mutable_grad();
    if (!grad.defined()) continue;
    at::Tensor& master_grad = masters_[k].mutable_grad();
    if (master_grad.defined()) {
      master_grad.add_(grad);
    } else {
      master_grad = grad.to(at::kFloat);
    }
    grad.reset();
  }
}

at::Tensor UnwrappedModel::ClipGradNorm(double max_norm) {
  std::vector<at::Tensor> grads;
  for (const at::Tensor& m : masters_) {
    if (m.grad().defined()) grads.push_back(m.grad());
  }
  c10::Device device = masters_.empty() ? c10::Device(c10::kCPU) : masters_.front().device();
  return ClipGradientsByNorm(grads, max_norm, device, nullptr);
}

void UnwrappedModel::AfterStep() {
  if (!mixed_) return;
  at::NoGradGuard no_grad;
  for (size_t k = 0; k < trainable_.size(); ++k) params_[trainable_[k]].copy_(masters_[k]);
}

absl::Status UnwrappedModel::LoadSafetensors(const std::string& path) {
  std::vector<InitTarget> targets;
  for (size_t i = 0; i < names_.size(); ++i) {
    targets.push_back({names_[i], all_masters_[i].sizes().vec(), 0, all_masters_[i]});
  }
  FSDP_RETURN_IF_ERROR(FillFromSafetensors(path, targets));
  if (mixed_) {
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < params_.size(); ++i) params_[i].copy_(all_masters_[i]);
  }
  return absl::OkStatus();
}

}  // namespace fsdp
