#include "sharding/offload/host_offload.h"

#include <algorithm>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <ATen/record_function.h>
#include <c10/core/StreamGuard.h>

#include "common/env.h"
#include "common/env_knobs.h"
#include "common/status.h"
#include "common/strings.h"
#include "sharding/host_loops.h"

namespace fsdp {

absl::StatusOr<std::unique_ptr<HostOffload>> HostOffload::Create(Offload mode, c10::Device device,
                                                                 std::vector<FsdpParam*> params,
                                                                 bool one_shard, bool delayed,
                                                                 bool compute_copy) {
  TORCH_INTERNAL_ASSERT(mode != Offload::kNone);
  TORCH_INTERNAL_ASSERT(compute_copy || !delayed, "a delayed update loads the compute copies");
  std::unique_ptr<HostOffload> offload(new HostOffload(mode, device));
  // Slices start at multiples of 16 elements (Note [Prepared steps]).
  FSDP_ASSIGN_OR_RETURN(std::optional<int> slice,
                        GetOptionalIntEnv(ProcessEnv(), kOffloadStepSlice.name, 16, 1 << 30));
  if (slice.has_value() && *slice % 16 != 0) {
    return absl::InvalidArgumentError(
        StrCat(kOffloadStepSlice.name, "=", *slice,
               " is not a multiple of 16; valid: ", kOffloadStepSlice.valid));
  }
  const int64_t step_slice = slice.value_or(kDefaultStepSlice);
  const std::string host_pass = GetEnvKnob(kOffloadHostPass).value_or("on");
  if (host_pass != "on" && host_pass != "off") {
    return absl::InvalidArgumentError(
        StrCat(kOffloadHostPass.name, "=", host_pass, ": valid: ", kOffloadHostPass.valid));
  }
  FSDP_ASSIGN_OR_RETURN(std::optional<int> host_threads,
                        GetOptionalIntEnv(ProcessEnv(), kOffloadHostThreads.name, 1, 1024));
  if (host_threads.has_value()) SetHostLoopThreads(*host_threads);
  const HostBufferLayout layout{
      .one_shard = one_shard, .delayed = delayed, .compute_copy = compute_copy};
  FSDP_ASSIGN_OR_RETURN(offload->buffers_, HostBuffers::Allocate(mode, device, params, layout));
  offload->params_ = std::move(params);
  Stats& stats = offload->stats_;
  offload->transfers_ = std::make_unique<Transfers>(device, stats);
  offload->worker_ = std::make_unique<HostWorker>(stats, host_pass == "on", step_slice);
  offload->deferred_ = std::make_unique<DeferredGrads>(stats);
  HostStepConfig step_config{.mode = mode,
                             .params = offload->params_,
                             .can_delay = delayed,
                             .step_slice = step_slice,
                             .host_pass = host_pass == "on"};
  offload->stepper_ = std::make_unique<HostStepper>(
      std::move(step_config), *offload->worker_, *offload->deferred_, *offload->transfers_, stats);
  offload->RefreshComputeShards();
  return offload;
}

HostOffload::~HostOffload() {
  // The adder stops after its current task; what is still queued is dropped (a run that
  // stopped mid-backward: the gradients are not read any more). Then the copies that may still
  // read or write the host buffers finish.
  if (worker_) worker_->Stop();
  if (transfers_) transfers_->SynchronizeAtExit();
}

// ---- parameters -------------------------------------------------------------------------------

void HostOffload::PushShards(DeviceStreams& streams) {
  if (mode_ == Offload::kParams) RefreshComputeShards();
  if (mode_ != Offload::kOptimizer) return;
  at::NoGradGuard no_grad;
  // The copy-in stream waits for the compute stream first: with one rank the unsharded
  // parameters alias the device shards, which a backward still queued there may read.
  streams.BeginCopyIn();
  RECORD_FUNCTION("fsdp::offload_push", std::vector<c10::IValue>());
  PhaseTimer timer(stats_.push_s);
  std::optional<c10::StreamGuard> on_copy_in;
  if (streams.enabled()) on_copy_in.emplace(*streams.copy_in());
  transfers_->Push(params_);
}

void HostOffload::RefreshComputeShards() {
  const bool any = std::any_of(params_.begin(), params_.end(),
                               [](const FsdpParam* p) { return p->host->compute_shard.defined(); });
  if (!any) return;
  // A host->device copy still in flight may read the buffers about to be written (a load for
  // an all-gather that never came, an evaluation forward's last units).
  transfers_->SynchronizeHostToDevice();
  RECORD_FUNCTION("fsdp::offload_refresh", std::vector<c10::IValue>());
  PhaseTimer timer(stats_.refresh_s);
  at::NoGradGuard no_grad;
  // The cast the device does without offload (round to nearest even; Note [CPU offload]).
  for (FsdpParam* p : params_) {
    if (p->host->compute_shard.defined()) p->host->compute_shard.copy_(p->host->shard);
  }
}

bool HostOffload::LoadShards(std::vector<FsdpParam>& params, bool wait) {
  // kOptimizer: not from a prefetch, whose copy-in stream was not ordered after the compute
  // stream, which may still read the device shards (one rank: the parameters alias them).
  if (mode_ == Offload::kOptimizer && !wait) return false;
  std::optional<std::vector<FsdpParam*>> stepped = stepper_->TakeStepped(params, wait);
  if (!stepped) return false;
  if (mode_ == Offload::kOptimizer) {
    transfers_->Push(*stepped);
    return true;
  }
  if (mode_ != Offload::kParams) return true;
  transfers_->Load(params);
  return true;
}

void HostOffload::FinishStep(DeviceStreams& streams) {
  if (!step_pending()) return;
  std::vector<FsdpParam*> stepped = stepper_->Finish();
  if (mode_ != Offload::kOptimizer) return;
  // As PushShards: the copy-in stream waits for the compute stream first.
  streams.BeginCopyIn();
  RECORD_FUNCTION("fsdp::offload_push", std::vector<c10::IValue>());
  PhaseTimer timer(stats_.push_s);
  std::optional<c10::StreamGuard> on_copy_in;
  if (streams.enabled()) on_copy_in.emplace(*streams.copy_in());
  transfers_->Push(stepped);
}

void HostOffload::ReleaseShards(std::vector<FsdpParam>& params, DeviceStreams& streams) {
  if (mode_ != Offload::kParams) return;
  std::vector<at::Tensor> freed;
  for (FsdpParam& p : params) {
    if (!p.padded_shard.defined()) continue;
    transfers_->Unloaded(p.padded_shard.nbytes());
    freed.push_back(std::move(p.padded_shard));
    p.padded_shard.reset();
  }
  // The compute stream (one rank: aliased parameters) or an all-gather may still read them.
  if (!freed.empty()) streams.Stash(std::move(freed));
}

// ---- gradients left to the step ---------------------------------------------------------------

std::optional<at::Tensor> HostOffload::ClipDeferred(const std::vector<FsdpParam*>& with_grad,
                                                    double max_norm, c10::Device device) {
  std::optional<at::Tensor> norm = deferred_->Clip(with_grad, max_norm, device);
  if (!norm) MaterializeDeferred();
  return norm;
}

void HostOffload::MaterializeDeferred() {
  deferred_->Materialize([this](FsdpParam& p) { WaitForHostGrad(p); });
}

// ---- gradients --------------------------------------------------------------------------------

at::Tensor* HostOffload::DeviceGrad(FsdpParam& p) {
  at::Tensor& sum = p.host->device_grad;
  return accumulate_on_device_ || sum.defined() ? &sum : nullptr;
}

void HostOffload::DeviceGradUpdated(FsdpParam& p) {
  if (accumulate_on_device_) return;
  SendToHost(p, p.host->device_grad);  // kept alive by the copy in flight (CUDA)
  p.host->device_grad.reset();
}

void HostOffload::AccumulateGrad(FsdpParam& p, const at::Tensor& g, bool owned) {
  at::NoGradGuard no_grad;
  if (at::Tensor* sum = DeviceGrad(p)) {
    // The additions of the run without offload (collectives.cc), on the same device.
    if (sum->defined()) {
      sum->add_(g);
    } else if (owned && g.is_contiguous() && !g.is_view()) {
      *sum = g;
    } else {
      *sum = g.clone(at::MemoryFormat::Contiguous);
    }
    DeviceGradUpdated(p);
    return;
  }
  SendToHost(p, g);
}

bool HostOffload::SendComputeGrad(FsdpParam& p, const at::Tensor& grad) {
  const at::Tensor& landing = p.host->compute_grad;
  if (!landing.defined() || accumulate_on_device_ || p.host->device_grad.defined() ||
      grad.scalar_type() != landing.scalar_type() || grad.numel() != landing.numel()) {
    return false;
  }
  SendToHost(p, grad.reshape(p.sharded.sizes()));
  return true;
}

void HostOffload::SendToHost(FsdpParam& p, const at::Tensor& g) {
  at::NoGradGuard no_grad;
  HostShard& h = *p.host;
  at::Tensor& grad = p.sharded.mutable_grad();
  deferred_->NewGradient(p);  // Note [Deferred clipping multiplication]
  stats_.to_host_bytes += g.nbytes();
  // Note [CPU offload], "params": the compute dtype's gradient lands in compute_grad.
  const bool narrow = g.scalar_type() != p.sharded.scalar_type();
  if (narrow) stats_.to_host_compute_bytes += g.nbytes();
  TORCH_INTERNAL_ASSERT(!narrow || h.compute_grad.defined());
  const bool add = grad.defined();
  // p's landing buffer is written again only after the adder's last task for it is done.
  if (h.last_task != 0) {
    RECORD_FUNCTION("fsdp::offload_wait", std::vector<c10::IValue>());
    PhaseTimer timer(stats_.wait_s);
    worker_->WaitFor(h.last_task);
  }
  // Note [Deferred gradient conversion]: a deferred gradient is converted before a second one
  // lands over it (accumulation on the host); an entry whose .grad was reset since is stale.
  const bool was_deferred = deferred_->Forget(p);
  const bool converts_deferred = was_deferred && add;
  // Note [Delayed parameter update]: the fp32 buffer, written here by the conversion or the
  // copy, is the .grad a delayed update may still read.
  if (converts_deferred || (!narrow && !add)) stepper_->WaitForDelayedStep(p);
  if (converts_deferred) {
    ConvertDeferred(p, h.compute_grad, at::Tensor());
    ++stats_.deferred_materialized;
  }
  const bool defer = deferred_->defers_conversion() && narrow && !add;
  if (defer) deferred_->Defer(p, g);
  // The norm's term once the .grad is complete (Note [Deferred clipping multiplication]).
  const bool term = deferred_->final_gradients() && deferred_->defers_clip_multiply() && !defer;
  if (!device_.is_cuda()) {
    // Synchronous copies; the adder does the same additions as without offload (collectives.cc).
    if (narrow) {
      h.compute_grad.copy_(g);
      if (!defer) Enqueue(p, {add ? grad : h.grad, h.compute_grad, add, nullptr, {}});
    } else if (add) {
      Enqueue(p, {grad, g, /*add=*/true, nullptr, {}});  // g is not written again: kept by the task
    } else {
      h.grad.copy_(g);
    }
    if (!add) grad = h.grad;
    if (term) Enqueue(p, deferred_->ClipTermTask(p, nullptr));
    return;
  }
  at::Tensor target;
  if (narrow) {
    target = h.compute_grad;
  } else if (add) {
    if (!h.staging.defined()) {
      h.staging = at::empty(p.sharded.sizes(),
                            p.sharded.options().requires_grad(false).pinned_memory(true));
    }
    target = h.staging;
  } else {
    target = h.grad;
  }
  std::shared_ptr<c10::Event> copied = transfers_->CopyToHost(target, g);
  if (defer) {
    Enqueue(p, {at::Tensor(), target, false, copied, {}});  // the landing only
  } else if (narrow || add) {
    Enqueue(p, {add ? grad : h.grad, target, add, copied, {}});
  }
  // After p's addition: the adder is FIFO.
  if (term) Enqueue(p, deferred_->ClipTermTask(p, std::move(copied)));
  if (!add) grad = h.grad;  // not to be read before WaitForCopies
}

void HostOffload::Enqueue(FsdpParam& p, HostTask task) {
  p.host->last_task = worker_->Enqueue(std::move(task));
}

void HostOffload::WaitForHostGrad(FsdpParam& p) {
  if (p.host->last_task != 0) worker_->WaitFor(p.host->last_task);
  stepper_->WaitForDelayedStep(p);  // Note [Delayed parameter update]: it may still read it
}

void HostOffload::WaitForCopies(DeviceStreams& streams) {
  Drain();
  // The copy-in stream waits for the compute stream, so the stash may go (Note [Copy-in
  // stream]): otherwise the last units' device shards would stay allocated until the next
  // forward's first all-gather.
  if (mode_ == Offload::kParams) streams.BeginCopyIn();
}

void HostOffload::Drain() {
  RECORD_FUNCTION("fsdp::offload_wait", std::vector<c10::IValue>());
  PhaseTimer timer(stats_.wait_s);
  // The gradients' tasks, not a step's queued before them: its groups are waited for by the
  // loads, by FinishStep, or (a delayed one: Note [Delayed parameter update]) by the gradients
  // that would write what it reads, so that it runs through every micro-batch of the next step.
  uint64_t last_gradient = 0;
  for (FsdpParam* p : params_) last_gradient = std::max(last_gradient, p->host->last_task);
  stats_.late_adds += static_cast<int64_t>(worker_->Unfinished(last_gradient));
  transfers_->SynchronizeAll();
  for (FsdpParam* p : params_) p->host->last_task = 0;
  worker_->WaitFor(last_gradient);  // also rethrows an earlier task's error
}

}  // namespace fsdp
