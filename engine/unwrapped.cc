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
  for (const auto& item : module_->named_parameters()) {
    const at::Tensor& p = item.value();
    if (p.requires_grad()) trainable_.push_back(params_.size());
    names_.push_back(item.key());
    params_.push_back(p);
    masters_.push_back(mixed_ ? p.detach().to(at::kFloat, /*non_blocking=*/false, /*copy=*/true)
                                    .requires_grad_(p.requires_grad())
                              : p);
  }
  if (mixed_) module_->to(compute_dtype);
}

std::vector<at::Tensor> UnwrappedModel::parameters() const {
  std::vector<at::Tensor> out;
  for (size_t i : trainable_) out.push_back(masters_[i]);
  return out;
}

void UnwrappedModel::AfterBackward() {
  if (!mixed_) return;
  at::NoGradGuard no_grad;
  for (size_t i : trainable_) {
    at::Tensor& grad = params_[i].mutable_grad();
    if (!grad.defined()) continue;
    at::Tensor& master_grad = masters_[i].mutable_grad();
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
  for (size_t i : trainable_) {
    if (masters_[i].grad().defined()) grads.push_back(masters_[i].grad());
  }
  c10::Device device = masters_.empty() ? c10::Device(c10::kCPU) : masters_.front().device();
  return ClipGradientsByNorm(grads, max_norm, device, nullptr);
}

void UnwrappedModel::AfterStep() {
  if (!mixed_) return;
  at::NoGradGuard no_grad;
  for (size_t i : trainable_) params_[i].copy_(masters_[i]);
}

absl::Status UnwrappedModel::InitFromSafetensors(const std::string& path) {
  std::vector<InitTarget> targets;
  for (size_t i = 0; i < names_.size(); ++i) {
    targets.push_back({names_[i], masters_[i].sizes().vec(), 0, masters_[i]});
  }
  FSDP_RETURN_IF_ERROR(FillFromSafetensors(path, targets));
  if (mixed_) {
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < params_.size(); ++i) params_[i].copy_(masters_[i]);
  }
  return absl::OkStatus();
}

}  // namespace fsdp
