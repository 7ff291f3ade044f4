#include "sharding/offload/host_step.h"

#include <algorithm>
#include <memory>
#include <set>
#include <utility>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <ATen/record_function.h>

#include "sharding/offload/host_buffers.h"

namespace fsdp {

void HostStepper::StepInOrder(const std::vector<std::vector<FsdpParam*>>& groups, HostStep step,
                              bool delayed) {
  TORCH_CHECK(!step_pending(), "HostOffload: a host step is already in flight");
  TORCH_CHECK(!delayed || config_.can_delay,
              "HostOffload: a delayed step needs FsdpOptions::offload_delayed_update");
  // Copies still reading the host shards or their compute copies (a load for an all-gather that
  // never came; offload optimizer's push of the last delayed update) finish before the adder
  // writes them: the adder waits for them, the training thread goes on.
  std::shared_ptr<c10::Event> loads_done = transfers_.host_to_device_done();
  ++stats_.overlapped_steps;
  if (delayed) ++stats_.delayed_steps;
  step_delayed_ = delayed;
  auto shared_step = std::make_shared<HostStep>(std::move(step));
  // Note [Deferred gradient conversion]: the clipping coefficient for the deferred gradients
  // (the device's, copied for the host: read on the adder once the copy is done). Note
  // [Deferred clipping multiplication]: the fp32 .grads clipping left to this step (a CPU
  // scalar, ready).
  DeferredGrads::StepScales scales = deferred_.TakeStepScales();
  const at::Tensor scale = scales.scale;
  const at::Tensor grad_scale = scales.grad_scale;
  // A parameter stepped in slices: where its deferred gradient landed (undefined: its .grad is
  // final already), and the loaded copy its updated master is cast into (undefined: none).
  struct Sliced {
    FsdpParam* p;
    at::Tensor landed, compute;
    at::Tensor scale;  // what to multiply the gradient by first (undefined: nothing)
  };
  // A delayed step runs the groups in the order the next backward sends their gradients.
  std::vector<const std::vector<FsdpParam*>*> order;
  for (const std::vector<FsdpParam*>& group : groups) order.push_back(&group);
  if (delayed) std::reverse(order.begin(), order.end());
  // Every group's job is made before the first is queued: a job removes the masters it stepped
  // from the shared step, whose can_run_slices this loop asks, so the loop must not overlap the
  // adder running the jobs queued before it (a data race on the optimizer's map of parameters).
  std::vector<std::pair<const std::vector<FsdpParam*>*, HostTask>> jobs;
  for (const std::vector<FsdpParam*>* group_ptr : order) {
    const std::vector<FsdpParam*>& group = *group_ptr;
    if (group.empty()) continue;
    std::vector<at::Tensor> masters;
    std::vector<at::Tensor> scaled_grads;  // masters' gradients, multiplied before their step
    std::vector<std::pair<at::Tensor, at::Tensor>> casts;  // (loaded copy, HostShard::shard)
    // Stepped in slices: deferred gradients (converted and clipped there) and, with a loaded
    // copy to cast, the others too (the cast of each slice while it is in cache); the deferred
    // ones whose step cannot run slices are converted first.
    std::vector<Sliced> sliced, converted;
    bool any_deferred = false;
    for (FsdpParam* p : group) {
      HostShard& h = *p->host;
      // The loaded copy the update writes: with a delayed step, the one the loads do not read.
      const at::Tensor& compute = delayed ? h.compute_shard_spare : h.compute_shard;
      const bool deferred = deferred_.Forget(*p);
      const bool sliceable = shared_step->can_run_slices && shared_step->can_run_slices(p->sharded);
      const bool casts_copy = config_.mode == Offload::kParams && compute.defined();
      // Note [Host Adam pass]: with the one loop, every parameter it may cover goes through
      // StepInSlices, which tries it first (an fp32 gradient too: several shards, gradients
      // summed on the host, fp32 compute, offload optimizer).
      const bool one_loop = sliceable && config_.host_pass && shared_step->run_host_pass != nullptr;
      const bool scaled = scales.to_scale.contains(p);
      stats_.clip_multiplies_deferred += scaled ? 1 : 0;
      if (deferred || (sliceable && casts_copy) || one_loop) {
        any_deferred = any_deferred || deferred;
        Sliced d{p, deferred ? h.compute_grad : at::Tensor(), casts_copy ? compute : at::Tensor(),
                 deferred ? scale : (scaled ? grad_scale : at::Tensor())};
        if (sliceable) {
          stats_.deferred_steps += deferred ? 1 : 0;
          sliced.push_back(std::move(d));
          continue;
        }
        converted.push_back(std::move(d));
      }
      masters.push_back(p->sharded);
      if (scaled) scaled_grads.push_back(h.grad);
      if (casts_copy) casts.emplace_back(compute, h.shard);
    }
    stats_.deferred_materialized += static_cast<int64_t>(converted.size());
    HostTask task;
    task.job = [this, shared_step, masters = std::move(masters), casts = std::move(casts),
                scaled_grads = std::move(scaled_grads), sliced = std::move(sliced),
                converted = std::move(converted), scale, grad_scale,
                scale_ready = any_deferred ? scales.scale_ready : nullptr,
                loads_done = jobs.empty() ? loads_done : nullptr] {
      RECORD_FUNCTION("fsdp::offload_host_step", std::vector<c10::IValue>());
      PhaseTimer timer(stats_.host_step_s);
      at::NoGradGuard no_grad;
      if (loads_done) loads_done->synchronize();
      if (scale_ready) scale_ready->synchronize();
      for (const Sliced& d : converted) ConvertDeferred(*d.p, d.landed, scale);
      for (const at::Tensor& g : scaled_grads) g.mul_(grad_scale);  // clipping's
      if (!masters.empty()) shared_step->run(masters);
      for (const Sliced& d : sliced) StepInSlices(*d.p, d.landed, d.compute, *shared_step, d.scale);
      if (casts.empty()) return;
      PhaseTimer refresh(stats_.refresh_s);
      // The cast the device does without offload, as HostOffload::RefreshComputeShards.
      for (const auto& [compute, master] : casts) compute.copy_(master);
    };
    jobs.emplace_back(&group, std::move(task));
  }
  for (auto& [group, task] : jobs) {
    const uint64_t seq = worker_.Enqueue(std::move(task));
    for (FsdpParam* p : *group) step_task_[p] = seq;
  }
  // Note [Delayed parameter update]: the next backward's gradients land in the other buffer.
  if (delayed) {
    for (FsdpParam* p : config_.params) {
      std::swap(p->host->compute_grad, p->host->compute_grad_spare);
    }
  }
}

void HostStepper::StepInSlices(FsdpParam& p, const at::Tensor& landed_grad,
                               const at::Tensor& compute_shard, const HostStep& step,
                               const at::Tensor& scale) {
  at::NoGradGuard no_grad;
  const at::Tensor master = p.sharded.view(-1);
  const at::Tensor grad = p.host->grad.view(-1);
  const at::Tensor landed = landed_grad.defined() ? landed_grad.view(-1) : at::Tensor();
  const at::Tensor compute = compute_shard.defined() ? compute_shard.view(-1) : at::Tensor();
  const int64_t n = master.numel();
  // The optimizer's one loop over the elements (Note [Host Adam pass]): from a deferred bf16
  // gradient, which it converts and clips (the .grad buffer stays unwritten: its .grad slot is
  // empty by now), or from the fp32 gradient the step took, clipped already; it writes the
  // loaded copy itself. Else, or when it cannot, ATen's ops slice after slice, each slice
  // converted, clipped, stepped and cast, each op on ATen's intra-op threads; or, with neither a
  // deferred gradient nor a copy, ATen's fused step on the whole tensor, as the group's other
  // masters.
  const bool one_loop =
      config_.host_pass && step.run_host_pass &&
      step.run_host_pass(p.sharded, landed, scale.defined() ? scale.item<float>() : 1.0f, compute);
  stats_.host_passes += one_loop ? 1 : 0;
  if (!one_loop && !landed.defined() && !compute.defined()) {
    if (scale.defined()) p.host->grad.mul_(scale);  // clipping's (Note [Deferred clipping ...])
    step.run({p.sharded});
    return;
  }
  const int64_t slice = config_.step_slice;
  for (int64_t begin = 0; !one_loop && begin < n; begin += slice) {
    const int64_t len = std::min(slice, n - begin);
    // A deferred gradient, converted here; then clipping's multiplication, when left to the
    // step (Note [Deferred clipping multiplication]).
    if (landed.defined() || scale.defined()) {
      at::Tensor g = grad.narrow(0, begin, len);
      if (landed.defined()) g.copy_(landed.narrow(0, begin, len));
      if (scale.defined()) g.mul_(scale);
    }
    step.run_slice(p.sharded, begin, len);
    if (compute.defined()) compute.narrow(0, begin, len).copy_(master.narrow(0, begin, len));
  }
  // The compute copy's padding rows: the cast of the master's, as the refresh does.
  if (compute.defined() && compute.numel() > n) {
    const int64_t pad = compute.numel() - n;
    compute.narrow(0, n, pad).copy_(p.host->shard.view(-1).narrow(0, n, pad));
  }
  step.slices_done(p.sharded);
}

void HostStepper::WaitForStep(uint64_t seq) {
  RECORD_FUNCTION("fsdp::offload_step_wait", std::vector<c10::IValue>());
  PhaseTimer timer(stats_.step_wait_s);
  worker_.WaitFor(seq);  // rethrows the step's error
}

std::optional<std::vector<FsdpParam*>> HostStepper::TakeStepped(std::vector<FsdpParam>& params,
                                                                bool wait) {
  std::vector<FsdpParam*> stepped;
  // Note [Delayed parameter update]: the loads read the copies from before it; Finish.
  if (step_delayed_) return stepped;
  uint64_t seq = 0;
  for (FsdpParam& p : params) {
    auto it = step_task_.find(&p);
    if (it == step_task_.end()) continue;
    stepped.push_back(&p);
    seq = std::max(seq, it->second);
  }
  if (stepped.empty()) return stepped;
  // Still stepping: the unit's own unshard waits.
  if (!wait && !worker_.Finished(seq)) return std::nullopt;
  WaitForStep(seq);
  for (FsdpParam* p : stepped) step_task_.erase(p);
  return stepped;
}

void HostStepper::WaitForDelayedStep(FsdpParam& p) {
  if (!step_delayed_) return;
  auto it = step_task_.find(&p);
  if (it == step_task_.end()) return;
  WaitForStep(it->second);
}

std::vector<FsdpParam*> HostStepper::Finish() {
  uint64_t seq = 0;
  std::vector<FsdpParam*> stepped;
  for (const auto& [p, task] : step_task_) {
    seq = std::max(seq, task);
    stepped.push_back(p);
  }
  WaitForStep(seq);
  step_task_.clear();
  // Note [Delayed parameter update]: the copies the update wrote are the ones to load now.
  if (std::exchange(step_delayed_, false) && config_.mode == Offload::kParams) {
    for (FsdpParam* p : config_.params) {
      std::swap(p->host->compute_shard, p->host->compute_shard_spare);
    }
  }
  return stepped;
}

}  // namespace fsdp
