// The model as the training loop drives it: one interface that the FSDP-wrapped model and the
// unwrapped baseline both implement, so the loop has no "sharded or not" branches.
//
// Per step, in this order (every rank, the same calls):
//   BeginStep(step);
//   for each micro-batch m of k:  BeginMicroBatch(m, k); loss = f(Forward(x)); loss.backward();
//                                 AfterBackward();
//   norm = ClipGradNorm(max);  optimizer.step();  AfterStep();  optimizer.zero_grad();
//   (or, for the first two: StepOverlapped(optimizer), when it returns true; or, for a step whose
//   update is skipped, AfterSkippedStep() instead of the four)
//
//   std::unique_ptr<TrainableModel> wrapped = WrapForTraining(std::move(fsdp_model));
//   auto optimizer = BuildOptimizer(config.optimizer, wrapped->parameters());
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

#include "absl/status/status.h"
#include "engine/config.h"
#include "sharding/comm_stats.h"
#include "sharding/offload/host_offload.h"

namespace fsdp {

class FsdpModel;

class TrainableModel {
 public:
  virtual ~TrainableModel() = default;
  // What the optimizer steps (sharded fp32 parameters, or the unwrapped model's masters).
  virtual std::vector<at::Tensor> parameters() const = 0;
  // Before the 0-based step `step`'s first micro-batch.
  virtual void BeginStep(int64_t step) {}
  // Before micro-batch `index` of `count` (HSDP: the replicas' all-reduce waits for the last).
  virtual void BeginMicroBatch(int index, int count) {}
  // After each micro-batch's backward.
  virtual void AfterBackward() {}
  // Clips by the global gradient norm; returns the norm before clipping (0-dim fp32 on the
  // device: no host synchronisation). Collective where the gradients are sharded. A max_norm
  // of kNoClipping (sharding/fsdp_model.h) computes the norm and multiplies nothing.
  virtual at::Tensor ClipGradNorm(double max_norm) = 0;
  // After the optimizer step.
  virtual void AfterStep() {}
  // Instead of optimizer.step() and AfterStep(): starts a step that overlaps the next forward
  // (Note [Overlapped host step] in trainable.cc) and returns true, or returns false, having
  // done nothing, when this model does not overlap its steps (no offload, the option off, an
  // optimizer without a prepared form). The caller still calls optimizer.zero_grad().
  // Where the delayed update applies to this step (WrapForTraining's `delayed`), the next
  // step's forward and backward use the parameters from before this update.
  virtual bool StepOverlapped(torch::optim::Optimizer& optimizer) { return false; }
  // A step whose update is skipped (training.on_nonfinite: skip): a delayed update still
  // pending from the step before becomes visible now, as it would at this step's update.
  virtual void AfterSkippedStep() {}
  // Before an evaluation: a delayed update becomes visible to it (and to the steps after).
  virtual void BeforeEvaluate() {}
  // For a caller that always tries StepOverlapped after ClipGradNorm (TrainStep): lets
  // StepOverlapped convert, clip and step offloaded gradients in one pass (Note [Deferred
  // gradient conversion] in sharding/offload/deferred_grads.h), its .grads written only by
  // that step or, when it returns false, before it does. A no-op where nothing is deferred.
  virtual void AllowDeferredGradients() {}
  // Waits for an overlapped step to finish (before anything but the next step's forward reads
  // or writes the parameters or the optimizer's state). A no-op otherwise.
  virtual void FinishStep() {}
  // The parameters from a safetensors file with the state-dict names (model.init_from).
  virtual absl::Status InitFromSafetensors(const std::string& path) = 0;
  // Parameter and gradient bytes on the device and in host memory (parallelism.offload) as
  // they were right after the last optimizer step; zeros before the first, and for the
  // unwrapped baseline (not counted). The optimizer's state is the caller's to add.
  virtual ModelStateBytes model_state_bytes() const { return {}; }
  // Collectives issued so far (all zero without a wrapper).
  virtual CommStats& comm_stats() = 0;
  // The sharded model, for sharded checkpoints; null for the unwrapped baseline.
  virtual FsdpModel* fsdp() { return nullptr; }
};

// Note [No-sync accumulation]
// training.grad_sync: last. With k micro-batches per step, the first k - 1 backwards make no
// gradient communication at all (FsdpModel::set_requires_gradient_sync(false), FSDP2's
// semantics): each unit's unsharded gradients accumulate in its full-shape parameters' .grad,
// in the compute dtype, on every rank, and the last micro-batch's backward reduce-scatters
// (all-reduces, for DDP; reduce-scatters and all-reduces over replicas, for HSDP) the sums
// once. Collectives per step drop from k per unit to 1; the price is memory: from the first
// micro-batch's backward to the last one's, every unit holds its unsharded gradients (the whole
// model's parameter count x the compute dtype's bytes per rank, not divided by the shard
// degree), and with bf16 compute the sums are accumulated in bf16 rather than reduced in
// reduce_dtype each micro-batch. With one micro-batch per step both settings are the same.

// The FSDP-wrapped model behind the interface. `sync_every_micro_batch` false: Note [No-sync
// accumulation]. `delayed`: the steps whose update runs through the next step
// (parallelism.offload_delayed_update; Note [Delayed parameter update] in
// sharding/offload/host_step.h), where the model offloads with a delayable step.
std::unique_ptr<TrainableModel> WrapForTraining(std::unique_ptr<FsdpModel> model,
                                                bool sync_every_micro_batch = true,
                                                DelayedUpdate delayed = {});

}  // namespace fsdp
