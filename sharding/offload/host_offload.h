// Internal to sharding/: CPU offload of the fp32 shards' optimizer (FsdpOptions::offload,
// parallelism.offload). HostOffload owns the host side of every sharded parameter and the copies
// between the host and the device; FsdpUnit and FsdpModel call it at the points below. It is a
// facade over sharding/offload/: host_buffers.h (the memory), transfers.h (the copies),
// host_worker.h (the adder thread), host_step.h (the overlapped and delayed step),
// deferred_grads.h (conversion and clipping left to the step), stats.h. Users see only the
// option and two calls on FsdpModel (CopyShardsToDevice after they write the shards,
// model_state_bytes).
//
// Cross-rank contract: none. Every copy is local to the rank; the collectives and their order
// are those of the run without offload.
//
// Note [CPU offload]
// The optimizer's tensors (FsdpParam::sharded, what parameters() returns and checkpoints read
// and write) are fp32 *host* masters, carved once at wrap time out of host arenas
// (HostBuffers; pinned on CUDA) with, per trainable parameter, its gradient buffer; their .grad
// are host tensors, so clipping and the optimizer step run on the host.
//   optimizer  The device keeps the fp32 padded shard (the all-gather's source). Once a unit's
//              gradient shard is final it is copied into the host buffer, which becomes the
//              master's .grad (added into it when a .grad is there: accumulation). After the
//              step the masters are copied into the device shards (CopyShardsToDevice; a caller
//              that writes the masters itself must call it before the next forward).
//   params     The device keeps nothing between iterations: the padded shard is loaded from
//              the host just before the unit's all-gather (or ahead of it: the prefetch) and
//              freed when the unit reshards. With a compute dtype narrower than the shard's the
//              host keeps the shard cast to it (HostShard::compute_shard, the cast the device
//              would do, refreshed after each step) and loads that; with one shard the
//              gradient comes back in the compute dtype too when its rounding to the reduce
//              dtype is exact (HostShard::compute_grad), and the adder converts it into, or
//              adds it to, the fp32 .grad: each element a + float(b) rounded once, bit for bit.
// Accumulating on the device (set_accumulate_on_device): a backward with it true adds its final
// gradient shards into HostShard::device_grad instead of sending them; the next backward with
// it false adds its own there too and sends the sum, once: one copy per step instead of one
// per micro-batch, for the shard's bytes on the device between micro-batches.
// Host additions: what the host does with a landed gradient runs on the adder (host_worker.h);
// the host waits only at the end of backward (WaitForCopies), where it must anyway before it
// clips and steps. Where the device is the CPU (tests) the host buffers are distinct tensors:
// every copy really happens and the arithmetic is the one without offload, bit for bit.
//
//   FsdpOptions options = OptionsForStrategy(Strategy::kFullShard);
//   options.offload = Offload::kParams;
//   auto sharded = FsdpModel::Wrap(model, mesh, units, options).value();
//   torch::optim::AdamW opt(sharded->parameters(), ...);   // host tensors
//   loss.backward();                                        // .grad on the host when it returns
//   sharded->ClipGradNorm(1.0); opt.step(); sharded->CopyShardsToDevice(); opt.zero_grad();
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "absl/status/statusor.h"
#include "sharding/fsdp_param.h"
#include "sharding/model_state_bytes.h"
#include "sharding/offload/deferred_grads.h"
#include "sharding/offload/host_buffers.h"
#include "sharding/offload/host_step.h"
#include "sharding/offload/host_worker.h"
#include "sharding/offload/stats.h"
#include "sharding/offload/transfers.h"
#include "sharding/options.h"
#include "sharding/streams.h"

namespace fsdp {

class HostOffload {
 public:
  using Stats = OffloadStats;

  // Moves `params`' masters to host memory as Note [CPU offload] says (mode kOptimizer or
  // kParams): allocates the host arenas (pinned on CUDA), copies the shards in, points each
  // `sharded` at its master and, with kParams, frees the device shards. kResourceExhausted
  // naming parallelism.offload when the host memory cannot be allocated.
  // `one_shard`: gradients reach AccumulateGrad/SendComputeGrad unreduced (one shard, no
  // replicas), so kParams allocates HostShard::compute_grad for them.
  // `delayed`: allocates the second buffers of Note [Delayed parameter update].
  // `compute_copy` false (FsdpOptions::offload_compute_copy): kParams keeps no compute-dtype
  // copy of the shards (not with `delayed`); loads copy the fp32 masters.
  static absl::StatusOr<std::unique_ptr<HostOffload>> Create(Offload mode, c10::Device device,
                                                             std::vector<FsdpParam*> params,
                                                             bool one_shard, bool delayed = false,
                                                             bool compute_copy = true);
  ~HostOffload();

  Offload mode() const { return mode_; }

  // ---- parameters -----------------------------------------------------------------------------
  // kOptimizer: every master into its device shard (copy-in stream, after it waited for the
  // compute stream). kParams: RefreshComputeShards.
  void PushShards(DeviceStreams& streams);
  // kParams: every compute-dtype copy cast afresh from its master, after waiting for the
  // host->device copies still reading them. Synchronous, on the calling thread (ATen's copy_
  // uses its intra-op threads).
  void RefreshComputeShards();
  // kParams: allocates the device shards of `params` that are not loaded and issues their copy
  // from the host (the compute-dtype copy when there is one, else the shard) on the current
  // stream (the caller makes it the copy-in stream). With a host step in flight (StepInOrder)
  // it first waits for these parameters' step; `wait` false (a prefetch) returns false
  // instead, loading nothing, while that step runs. kOptimizer: with a host step in flight,
  // the same wait, then the stepped masters are copied into their device shards (on the
  // current stream, which the caller ordered after the compute stream); otherwise nothing.
  bool LoadShards(std::vector<FsdpParam>& params, bool wait = true);

  // ---- the optimizer step, overlapped (Note [Overlapped host step], engine/trainable.cc) ----
  // HostStepper::StepInOrder (host_step.h). `delayed` needs Create's `delayed`.
  void StepInOrder(const std::vector<std::vector<FsdpParam*>>& groups, HostStep step,
                   bool delayed = false) {
    stepper_->StepInOrder(groups, std::move(step), delayed);
  }
  // Waits for every step StepInOrder queued (rethrowing its error) and, with kOptimizer, copies
  // the masters not copied yet into their device shards (copy-in stream, after the compute
  // stream): afterwards the masters and device shards are those of a step run in place. A
  // delayed step's loaded copies become the ones loads read.
  void FinishStep(DeviceStreams& streams);
  // Whether a step queued by StepInOrder has groups not loaded or pushed since.
  bool step_pending() const { return stepper_->step_pending(); }
  // Whether Create allocated the second buffers of Note [Delayed parameter update].
  bool can_delay() const { return stepper_->can_delay(); }
  // kParams: frees the device shards of `params` (through `streams`' stash: Note [Copy-in
  // stream]).
  void ReleaseShards(std::vector<FsdpParam>& params, DeviceStreams& streams);
  // Makes the current stream wait for the host->device copies issued so far (one rank: the
  // unsharded parameters alias the device shards, no all-gather orders them). No-op on CPU.
  void WaitForShardsOnCurrentStream() { transfers_->WaitOnCurrentStream(); }

  // ---- gradients left to the step (deferred_grads.h) -------------------------------------------
  // Note [Deferred gradient conversion]. Off by default.
  void set_defer_conversion(bool defer) { deferred_->set_defer_conversion(defer); }
  bool has_deferred() const { return deferred_->has_deferred(); }
  // After WaitForCopies: DeferredGrads::Clip, and when it returns nullopt, MaterializeDeferred
  // (the caller clips the .grads as usual).
  std::optional<at::Tensor> ClipDeferred(const std::vector<FsdpParam*>& with_grad, double max_norm,
                                         c10::Device device);
  // Converts every deferred gradient into its .grad and does the multiplications
  // DeferClipMultiply left (DeferredGrads::Materialize). On the calling thread.
  void MaterializeDeferred();
  // Note [Deferred clipping multiplication]. Off by default.
  void set_defer_clip_multiply(bool defer) { deferred_->set_defer_clip_multiply(defer); }
  bool defers_clip_multiply() const { return deferred_->defers_clip_multiply(); }
  // After WaitForCopies: DeferredGrads::DeferClipMultiply. A gradient that lands before the
  // step (the step was skipped) drops its parameter's pending multiplication.
  void DeferClipMultiply(const std::vector<FsdpParam*>& with_grad, at::Tensor coef) {
    deferred_->DeferClipMultiply(with_grad, std::move(coef));
  }
  // True: the gradients that land from now on are their parameters' last before clipping (the
  // trainer's last micro-batch); with set_defer_clip_multiply(true) the adder computes each
  // fp32 .grad's term of the norm once it is complete.
  void set_final_gradients(bool final) { deferred_->set_final_gradients(final); }
  // After WaitForCopies: the terms the adder computed for `with_grad`, in its order (undefined
  // where it computed none); forgets every term.
  std::vector<at::Tensor> TakeClipTerms(const std::vector<FsdpParam*>& with_grad) {
    return deferred_->TakeClipTerms(with_grad);
  }

  // ---- gradients ------------------------------------------------------------------------------
  // Whether the gradients of the backwards that follow stay on the device (HostShard::
  // device_grad) or, false (the default), go to the host, with any sum kept on the device
  // before them. Note [CPU offload], "Accumulating on the device".
  void set_accumulate_on_device(bool on_device) { accumulate_on_device_ = on_device; }
  bool accumulate_on_device() const { return accumulate_on_device_; }
  // `g` is p's final gradient shard for this backward (device, the shard's shape and dtype).
  // With a sum on the device, or accumulating there: adds it into device_grad (or it becomes
  // that: itself when `owned` and plain, else a copy) and, unless accumulating, sends the sum to
  // the host. Otherwise copies `g` into the host's buffer, which becomes p.sharded's .grad, or
  // adds it into the .grad already there.
  void AccumulateGrad(FsdpParam& p, const at::Tensor& g, bool owned);
  // &device_grad when this backward's gradient of p is to be added into it (it holds an
  // earlier backward's sum, or accumulates from now), for a caller that adds in place and then
  // calls DeviceGradUpdated(p); nullptr when the gradient goes straight to the host.
  at::Tensor* DeviceGrad(FsdpParam& p);
  // After an in-place addition into *DeviceGrad(p): sends the sum unless accumulating.
  void DeviceGradUpdated(FsdpParam& p);
  // One shard: `grad` is p's unsharded gradient (device, the compute dtype), whose rounding to
  // the reduce dtype the caller checked to be exact. Sends it to the host as is and returns
  // true when p has a compute_grad and no sum waits on the device (Note [CPU offload],
  // "params"); else false, and the caller casts it and calls AccumulateGrad.
  bool SendComputeGrad(FsdpParam& p, const at::Tensor& grad);
  // End of backward: waits for every copy in flight, both ways, and for the adder's additions
  // and conversions (afterwards the host .grads are final; an error of the adder is rethrown
  // here), but not for a step StepInOrder queued (FinishStep), and gives back the device shards
  // that this backward's reshards stashed in `streams`.
  void WaitForCopies(DeviceStreams& streams);

  // Most bytes of device shards loaded at once (kParams), since wrapping.
  int64_t peak_loaded_bytes() const { return transfers_->peak_loaded_bytes(); }
  // What the offload cost since wrapping (stats.h).
  const Stats& stats() const { return stats_; }

 private:
  HostOffload(Offload mode, c10::Device device) : mode_(mode), device_(device) {}
  // `g` (device) into p's host .grad: copied into the fp32 buffer, or added into the .grad
  // there; in p's compute dtype through compute_grad (SendComputeGrad). On CUDA asynchronous:
  // `g` is kept alive and must not change until WaitForCopies.
  void SendToHost(FsdpParam& p, const at::Tensor& g);
  // Queues `task` on the adder as p's last task.
  void Enqueue(FsdpParam& p, HostTask task);
  // Before the training thread writes p's fp32 .grad buffer: the adder's tasks queued for p,
  // and its delayed update, done.
  void WaitForHostGrad(FsdpParam& p);
  // Waits for the copies in flight and the gradients' tasks (WaitForCopies' first part).
  void Drain();

  Offload mode_;
  c10::Device device_;
  std::vector<FsdpParam*> params_;
  bool accumulate_on_device_ = false;
  Stats stats_;
  // Declared in the order they depend on each other; ~HostOffload stops the adder first.
  std::unique_ptr<HostBuffers> buffers_;
  std::unique_ptr<Transfers> transfers_;
  std::unique_ptr<HostWorker> worker_;
  std::unique_ptr<DeferredGrads> deferred_;
  std::unique_ptr<HostStepper> stepper_;
};

}  // namespace fsdp
