#include "sharding/offload/deferred_grads.h"

#include <utility>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <ATen/record_function.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include "sharding/fsdp_model.h"
#include "sharding/offload/host_buffers.h"

namespace fsdp {

void ConvertDeferred(FsdpParam& p, const at::Tensor& landed, const at::Tensor& scale) {
  at::NoGradGuard no_grad;
  at::Tensor& grad = p.host->grad;
  grad.copy_(landed.view(grad.sizes()));  // exact: a wider dtype
  if (scale.defined()) grad.mul_(scale);  // clipping's multiplication
}

void DeferredGrads::NewGradient(const FsdpParam& p) {
  scale_pending_.erase(&p);
  clip_terms_.erase(&p);
}

void DeferredGrads::Defer(const FsdpParam& p, const at::Tensor& g) {
  deferred_[&p] = ClipNormTerms({g}).front();  // on the device, from the bf16 values
  clipped_ = false;  // a new backward: the last coefficient is not these gradients'
}

HostTask DeferredGrads::ClipTermTask(const FsdpParam& p, std::shared_ptr<c10::Event> copied) {
  auto slot = std::make_shared<at::Tensor>();
  clip_terms_[&p] = slot;
  HostTask task;
  task.job = [&stats = stats_, slot, grad = p.host->grad, copied = std::move(copied)] {
    if (copied) copied->synchronize();
    RECORD_FUNCTION("fsdp::offload_clip_term", std::vector<c10::IValue>());
    PhaseTimer timer(stats.clip_term_s);
    *slot = ClipNormTerms({grad}).front();
    ++stats.clip_terms_on_adder;
  };
  return task;
}

std::vector<at::Tensor> DeferredGrads::TakeClipTerms(const std::vector<FsdpParam*>& with_grad) {
  std::vector<at::Tensor> terms;
  terms.reserve(with_grad.size());
  for (const FsdpParam* p : with_grad) {
    auto it = clip_terms_.find(p);
    terms.push_back(it != clip_terms_.end() ? *it->second : at::Tensor());
  }
  clip_terms_.clear();
  return terms;
}

std::optional<at::Tensor> DeferredGrads::Clip(const std::vector<FsdpParam*>& with_grad,
                                              double max_norm, c10::Device device) {
  at::NoGradGuard no_grad;
  clipped_ = false;
  // Entries of parameters without a gradient now are stale (a step skipped after their
  // backward): their .grad was reset.
  std::erase_if(deferred_,
                [](const auto& entry) { return !entry.first->sharded.grad().defined(); });
  // ClipGradientsByNorm's arithmetic on the terms, in the parameters' order; one shard, so
  // nothing to sum over ranks.
  std::vector<at::Tensor> terms;
  for (FsdpParam* p : with_grad) {
    auto it = deferred_.find(p);
    if (it == deferred_.end()) break;
    terms.push_back(it->second);
  }
  if (terms.empty() || terms.size() != with_grad.size()) return std::nullopt;
  const ClipNorm clip = ClipNormFromTerms(terms, max_norm, device, /*sum_over=*/nullptr);
  // No clipping: clipped_ stays false, so the deferred gradients are converted unscaled.
  if (!clip.coef.defined()) return clip.norm;
  if (device.is_cuda()) {
    // A new pinned scalar each time: a delayed update may still read the last one (Note
    // [Delayed parameter update]; the caching host allocator reuses it once that is done).
    clip_scale_host_ = at::empty({}, at::TensorOptions().dtype(at::kFloat).pinned_memory(true));
    clip_scale_host_.copy_(clip.coef, /*non_blocking=*/true);
    const auto* impl = c10::impl::getDeviceGuardImpl(device.type());
    clip_scale_ready_ = std::make_shared<c10::Event>(device.type());
    clip_scale_ready_->record(impl->getStream(device));
  } else {
    clip_scale_host_ = clip.coef;
    clip_scale_ready_.reset();
  }
  clipped_ = true;
  return clip.norm;
}

void DeferredGrads::DeferClipMultiply(const std::vector<FsdpParam*>& with_grad, at::Tensor coef) {
  clip_scale_host_ = std::move(coef);
  clip_scale_ready_.reset();
  scale_pending_.clear();
  for (const FsdpParam* p : with_grad) scale_pending_.insert(p);
}

void DeferredGrads::Materialize(const std::function<void(FsdpParam&)>& before_write) {
  at::NoGradGuard no_grad;
  // Note [Deferred clipping multiplication]: the multiplications the step was to do.
  for (const FsdpParam* p : std::exchange(scale_pending_, {})) {
    FsdpParam& param = *const_cast<FsdpParam*>(p);
    before_write(param);
    param.host->grad.mul_(clip_scale_host_);
  }
  if (deferred_.empty()) return;
  at::Tensor scale;
  if (std::exchange(clipped_, false)) {
    if (clip_scale_ready_) clip_scale_ready_->synchronize();
    scale = clip_scale_host_;
  }
  for (auto& [p, term] : deferred_) {
    FsdpParam& param = *const_cast<FsdpParam*>(p);
    before_write(param);
    ConvertDeferred(param, param.host->compute_grad, scale);
    ++stats_.deferred_materialized;
  }
  deferred_.clear();
}

DeferredGrads::StepScales DeferredGrads::TakeStepScales() {
  StepScales s;
  s.scale = std::exchange(clipped_, false) ? clip_scale_host_ : at::Tensor();
  s.scale_ready = s.scale.defined() ? clip_scale_ready_ : nullptr;
  s.to_scale = std::exchange(scale_pending_, {});
  s.grad_scale = s.to_scale.empty() ? at::Tensor() : clip_scale_host_;
  return s;
}

}  // namespace fsdp
