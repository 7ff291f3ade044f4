// FsdpModel: a libtorch C++ module sharded over a DeviceMesh in FSDP units.
//
// Each unit (typically a transformer block) all-gathers its parameters in one collective just
// before its forward, frees them after (FULL_SHARD) or keeps them (SHARD_GRAD_OP), gathers them
// again before its backward and reduce-scatters its gradients right after it; HSDP then
// all-reduces the gradient shards over the replicate axis, DDP (shard axis of size 1) only
// all-reduces. The root unit holds every parameter no other unit holds. See
// docs/sharding.md for the lifecycle, buffers and ordering.
//
// Cross-rank contract: Wrap is collective over the whole world; every rank wraps a model of
// the same structure (checked: a different model is an error on every rank, not a hang), and
// runs forward/backward in the same order.
//
// What a module must do to be wrappable (libtorch modules have no forward hooks): route its
// forward through UnitForward (unit_forward.h, the only header model code needs); forgetting
// it is an error naming the unit (Note [Parameters used while sharded]).
//
//   auto units = fsdp::SelectUnits(*model, {.module_types = {"BlockImpl"}});
//   auto fsdp_model = fsdp::FsdpModel::Wrap(model, mesh, units, options).value();
//   torch::optim::AdamW opt(fsdp_model->parameters(), ...);   // sharded parameters
//   loss = criterion(model->forward(x), y); loss.backward();
//   fsdp_model->ClipGradNorm(1.0); opt.step(); opt.zero_grad();
#pragma once

#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"
#include "device_mesh/device_mesh.h"
#include "sharding/comm_stats.h"
#include "sharding/fsdp_unit.h"
#include "sharding/offload/offload_plan.h"
#include "sharding/options.h"
#include "sharding/unit_forward.h"

namespace torch::nn {
class Module;
}

namespace fsdp {

// Which children of Sequential / ModuleList / ModuleDict containers become units.
struct WrapPolicy {
  // Module::name(), qualified ("myproject::BlockImpl") or not ("BlockImpl").
  std::vector<std::string> module_types;
  int64_t min_num_params = 0;             // > 0: also any child with at least this many
};
std::vector<std::shared_ptr<torch::nn::Module>> SelectUnits(torch::nn::Module& root,
                                                            const WrapPolicy& policy);

struct MemoryStats {
  int peak_unsharded_units = 0;       // non-root units holding unsharded parameters at once
  int64_t peak_unsharded_bytes = 0;   // their bytes (parameters and gather buffers)
};

// Scales `grads` in place so that their global 2-norm is at most `max_norm` (coefficient
// min(max_norm / (norm + 1e-6), 1), as torch.nn.utils.clip_grad_norm_) and returns the norm
// before clipping as a 0-dim fp32 tensor on `device`: no host synchronisation. A `max_norm` of
// kNoClipping computes the norm only (the trainer logs it) and leaves `grads` untouched.
// `sum_over`, when given, sums the squares over that group (ranks holding disjoint pieces of
// the gradients).
inline constexpr double kNoClipping = std::numeric_limits<double>::infinity();
at::Tensor ClipGradientsByNorm(const std::vector<at::Tensor>& grads, double max_norm,
                               c10::Device device, ProcessGroup* sum_over);
// Its two halves, for gradients whose terms are computed apart (Note [Deferred gradient
// conversion] in offload/deferred_grads.h): each gradient's term of the norm (on CUDA its fp32
// 2-norm, else the fp32 sum of its squares), and the norm and coefficient from the terms in the
// gradients' order (on `device`, summed over `sum_over` when given).
std::vector<at::Tensor> ClipNormTerms(const std::vector<at::Tensor>& grads);
struct ClipNorm {
  at::Tensor norm;  // before clipping
  at::Tensor coef;  // min(max_norm / (norm + 1e-6), 1); undefined for kNoClipping
};
ClipNorm ClipNormFromTerms(const std::vector<at::Tensor>& terms, double max_norm,
                           c10::Device device, ProcessGroup* sum_over);

// Note [Rank-identical prefetch]
// Which unit to all-gather next, and whether to skip one, must be a pure function of state that
// is identical on every rank: the recorded forward order, the units' ShardedStates, the options
// (max_unsharded_units, reshard_after_forward) and the unit's own position. Never of timing
// (whether a collective has finished, how long a step took) or of rank-local memory (free
// bytes, allocator state): every rank of a group must issue its collectives in the same order,
// and one rank that prefetched a different unit would pair its all-gather with another rank's
// different collective: a hang or silently mixed data.
// Note [Parameters used while sharded]
// Outside its forward and backward a unit's parameters keep their shape but have no memory
// (their storage is resized to 0). A module that is a unit but whose forward does not go
// through UnitForward, or a parent that calls a unit's submodules directly (block->fc(x)
// instead of block(x)), runs ATen on such a parameter, which fails with "setStorage: ... out
// of bounds for storage of size 0". The root's UnitForward catches that failure and names the
// unit instead: among the non-root units that hold no unsharded parameters and have not begun
// a forward in this iteration, those with a parameter of the failing sizes, the first in
// wrapping order (a model's forward order). No cost on the success path: one flag per unit.
// A root whose own forward skips UnitForward cannot be diagnosed this way (nothing catches).
// Note [Keeping parameters across micro-batches]
// FsdpOptions::reshard_between_micro_batches = false (parallelism.reshard_between_micro_batches)
// with FSDP2's set_reshard_after_backward: under gradient accumulation the parameters do not
// change between micro-batches, so gathering them again (or, with one shard and bf16 compute,
// casting the fp32 shards again) for every micro-batch's forward and backward is pure overhead.
// With the option false, no unit reshards after a training forward (as shard_grad_op), and a
// backward run with set_reshard_after_backward(false) leaves every unit unsharded (its
// gradients are reduced as usual: the parameters' state and the gradients' are independent);
// the next forward and backward find the units unsharded and gather nothing. The backward run
// with set_reshard_after_backward(true), the step's last, reshards every unit as it finishes,
// so the optimizer step finds only shards and the next step gathers the updated values.
// Per step: one gather (cast) per unit instead of micro-batches x (2 for full_shard, 1 for
// shard_grad_op); EngineContext::unshards counts them. The price: from its first gather to the
// end of the last backward every unit holds its unsharded parameters, i.e. the whole model's
// parameter count x the compute dtype's bytes per rank (not divided by the shard degree; the
// planner counts it), plus with offload: params every unit's device shard. The arithmetic is
// unchanged (bit for bit on the CPU). The engine's default for set_reshard_after_backward is
// true, so a loop that never calls it reshards after every backward (a shard_grad_op step);
// the trainer calls it per micro-batch (engine/trainable.cc). A caller that steps the optimizer
// after a backward with false would run the next forward on stale parameters: don't.
// Note [Forward without backward]
// A training forward (grad mode on) leaves the root unit unsharded for its backward, and with
// reshard_after_forward false every unit. When no backward follows (a metric computed with
// grad mode on, a forward whose loss is dropped) and the optimizer then steps, those unsharded
// copies are stale: the next forward would find them unsharded and gather nothing, computing
// with the parameters of before the step, silently. So the root's forward that starts while
// the previous training forward has had no backward first reshards every unit
// (ReshardFully): they are gathered again from the current shards. Two forwards before one
// backward (loss = f(a) + f(b)) pay one extra gather per unit kept unsharded; the backward
// gathers what it needs as usual. An evaluation forward (grad mode off) already reshards
// everything at its end.
// Note [Nested UnitForward of one unit]
// A unit's forward that reaches UnitForward for the same unit again (its module's forward goes
// through UnitForward and its parent calls it through SequentialForward, which does too; or a
// checkpointed unit's recompute) just runs the function: the unit is unsharded and its
// forward already counted.
// Note [zero_grad on the module]
// The optimizer updates the shards (FsdpModel::parameters()) and reads their .grad, which
// backward writes and accumulates into; the module's own parameters (P) hold no gradient
// after a backward with gradient sync. module->zero_grad(), the usual PyTorch idiom, clears
// only P's .grad, so on its own it would leave the shards' gradients to be added to by the
// next backward, silently. So, as FSDP2's module.zero_grad() clears the sharded gradients,
// each backward leaves a 0-element tensor of its own (FsdpParam::grad_sentinel) as .grad of
// every trainable P that has none, and the root's next forward looks at it (the next backward
// too, for a zero_grad() between forward and backward; not for a parameter used only after
// the root's forward returns, whose accumulation autograd runs before the root output's hook):
// still there, it is removed; gone (zero_grad() reset it) the shard's .grad is reset too;
// replaced (zero_grad(false) zeroes a detached copy) the shard's .grad is zeroed. A P's .grad that
// holds real gradients (set_requires_gradient_sync(false)) is never replaced. Between two
// backwards, code that reads P's .grad sees an empty tensor where it saw none.
class FsdpModel {
 public:
  // Shards `root`: each of `unit_modules` (submodules of root) becomes a unit, the root unit
  // holds the rest (the root itself or a module listed twice in `unit_modules` adds nothing).
  // The mesh needs a "shard" axis and may have a "replicate" axis. A model is wrapped once:
  // from then on its modules' own parameters have no memory outside forward and backward
  // (clone, save or read them through named_parameters() / GatherFullParameter instead), also
  // after this FsdpModel is destroyed. The parameters of one unit share one dtype (or set
  // mixed_precision.param_dtype).
  static absl::StatusOr<std::unique_ptr<FsdpModel>> Wrap(
      std::shared_ptr<torch::nn::Module> root, const DeviceMesh& mesh,
      const std::vector<std::shared_ptr<torch::nn::Module>>& unit_modules,
      const FsdpOptions& options);
  ~FsdpModel();
  FsdpModel(const FsdpModel&) = delete;
  FsdpModel& operator=(const FsdpModel&) = delete;

  // The sharded trainable parameters, for the optimizer (each tied tensor once).
  std::vector<at::Tensor> parameters() const;
  // Every sharded parameter (frozen ones too) under its first state-dict name.
  std::vector<std::pair<std::string, at::Tensor>> named_parameters() const;
  // The sharding of a parameter by any of its names; null if unknown.
  const FsdpParam* FindParam(const std::string& name) const;
  // First global row held by this rank's shard of a parameter.
  int64_t FirstLocalRow(const FsdpParam& param) const;
  // The full parameter (original dtype), gathered over the shard axis. Collective.
  at::Tensor GatherFullParameter(const FsdpParam& param);

  // Clips gradients by their global norm over all shards (replicas counted once) and returns
  // the norm before clipping (a 0-dim fp32 tensor on the device, so that the step needs no
  // host synchronisation), as torch.nn.utils.clip_grad_norm_. Collective over the shard axis.
  at::Tensor ClipGradNorm(double max_norm);
  // false: no communication in backward; gradients accumulate unsharded until a backward with
  // true (FSDP2's set_requires_gradient_sync).
  void set_requires_gradient_sync(bool sync) { ctx_.requires_gradient_sync = sync; }
  // HSDP: false reduce-scatters but leaves the all-reduce over replicas to the next backward
  // with true (FSDP2's set_requires_all_reduce).
  void set_requires_all_reduce(bool all_reduce) { ctx_.requires_all_reduce = all_reduce; }
  // false: the next backwards leave every unit's unsharded parameters in place for the next
  // micro-batch; true (default): the step's last backward reshards them (FSDP2's
  // set_reshard_after_backward). See Note [Keeping parameters across micro-batches].
  void set_reshard_after_backward(bool reshard) { ctx_.reshard_after_backward = reshard; }
  // Offload: true keeps the next backwards' gradient shards summed on the device (fp32, 4 bytes
  // per parameter of shard) and sends the sum to the host in the next backward with false (the
  // default), once: fewer copies and no host additions under gradient accumulation. A no-op
  // without offload. See Note [CPU offload] in offload/host_offload.h, "Accumulating on the
  // device".
  void set_offload_accumulate_on_device(bool on_device) {
    if (ctx_.offload) ctx_.offload->set_accumulate_on_device(on_device);
  }
  // Offload params, one shard: true leaves a gradient that lands on the host alone in the
  // compute dtype until the step, which converts, clips and steps it in one pass (Note [Deferred
  // gradient conversion] in offload/deferred_grads.h). Only for a caller that steps through
  // StepOnHost(HostStep) after ClipGradNorm, or calls MaterializeDeferredGradients before reading
  // the .grads otherwise (engine/trainer.cc's TrainStep does). A no-op without offload.
  void set_offload_defer_conversion(bool defer) {
    if (ctx_.offload) ctx_.offload->set_defer_conversion(defer);
  }
  // Offload: true lets ClipGradNorm leave the multiplication of the host's fp32 .grads to the
  // step (Note [Deferred clipping multiplication] in offload/deferred_grads.h); the same contract.
  void set_offload_defer_clip_multiply(bool defer) {
    if (ctx_.offload) ctx_.offload->set_defer_clip_multiply(defer);
  }
  // Offload: whether this backward's gradients are the last before ClipGradNorm (the last
  // micro-batch), so that the host may compute the norm's terms as they land (the same Note).
  void set_offload_final_gradients(bool final) {
    if (ctx_.offload) ctx_.offload->set_final_gradients(final);
  }
  // The .grads of deferred gradients written (multiplied by the clipping coefficient when
  // ClipGradNorm ran since their backward), and clipping's deferred multiplications done. A
  // no-op without any.
  void MaterializeDeferredGradients() {
    if (ctx_.offload) ctx_.offload->MaterializeDeferred();
  }
  // Unshard() calls (all-gathers, or casts with one shard) on units with parameters so far.
  int64_t unshards() const { return ctx_.unshards; }

  // Offload (Note [CPU offload] in offload/host_offload.h): copies the host masters (the
  // optimizer's tensors) into the device shards. Call after the optimizer step and after writing
  // the masters otherwise (checkpoint load); a no-op without offload or with offloaded parameters.
  // On CUDA the copies are asynchronous: work issued afterwards on the current stream sees the
  // new shards, and the host must not write the masters again before that work has run (the
  // next backward's end waits for it; otherwise synchronise the device first).
  void CopyShardsToDevice();
  // Offload: the optimizer step run on the host a unit at a time, in forward order, on
  // HostOffload's thread, while the caller goes on: `step(masters)` updates those masters (the
  // tensors parameters() returns) and must not touch anything the training thread uses. Each
  // unit's next unshard waits for its own step (and with offloaded parameters loads the new
  // values; with offload=optimizer copies them into the device shards), so the next forward
  // starts while the host steps the units after it. Call after the backward's end, instead of
  // stepping and CopyShardsToDevice; FinishHostStep (also called by CopyShardsToDevice) waits
  // for all of it. See Note [Overlapped host step] (engine/trainable.cc).
  void StepOnHost(std::function<void(const std::vector<at::Tensor>&)> step);
  // The same with slices for deferred gradients (HostStep, offload/host_offload.h). `delayed`
  // (needs FsdpOptions::offload_delayed_update): the next forward and backward do not wait for it
  // and use the parameters from before it; it becomes visible at the next StepOnHost or
  // FinishHostStep (Note [Delayed parameter update] in offload/host_step.h).
  void StepOnHost(HostStep step, bool delayed = false);
  // Waits for StepOnHost's step; then the masters and the device shards are as after
  // CopyShardsToDevice. A no-op without one in flight. Call before reading or writing the
  // masters or the optimizer state (checkpoints do).
  void FinishHostStep();
  // Bytes of parameter shards and gradient shards on the device and (offload) in host memory.
  ModelStateBytes model_state_bytes() const;
  // The same without asking the kernel which pages of the gradients committed on demand are
  // written (all of them in host_untouched): cheap enough for every step. CountResidentBytes
  // completes it into model_state_bytes()'s figures (those pages stay resident once written).
  ModelStateBytes model_state_sizes() const;
  void CountResidentBytes(ModelStateBytes& bytes) const;

  // Offload params with a narrower compute dtype: whether the host keeps each shard's compute
  // copy (Note [Compute copy] in offload/offload_plan.h); nullopt where there is no such choice.
  const std::optional<ComputeCopyChoice>& offload_compute_copy() const { return compute_copy_; }
  CommStats& comm_stats() { return ctx_.stats; }
  const MemoryStats& memory_stats() const { return memory_; }
  void ResetMemoryStats() { memory_ = {}; }
  // Units in forward order once one forward has run (construction order before).
  std::vector<const FsdpUnit*> units() const;
  const EngineContext& context() const { return ctx_; }
  // Non-root units holding unsharded parameters right now (from their real storage).
  int NumUnshardedUnits() const;
  // Whether training.activation_checkpointing applies to `unit`, and how many times its
  // forward was re-run in backward so far (Note [Activation checkpointing]).
  bool IsCheckpointed(const FsdpUnit& unit) const;
  int64_t Recomputes(const FsdpUnit& unit) const;

  // Internal: the body of UnitForward for one of this model's units.
  at::Tensor RunUnitForward(FsdpUnit& unit, const at::Tensor& input,
                            const std::function<at::Tensor(const at::Tensor&)>& fn);
  // Internal: a trainable parameter of `unit` got its gradient.
  void OnGradAccumulated(FsdpUnit& unit);

 private:
  FsdpModel() = default;
  // kSharded / kShardedPostForward / kGathering -> kUnsharded (already kUnsharded: nothing).
  void EnsureUnsharded(FsdpUnit& unit);
  void PreForward(FsdpUnit& unit);
  // fn(x) under activation checkpointing (Note [Activation checkpointing]).
  at::Tensor CheckpointUnitForward(FsdpUnit& unit, const at::Tensor& x,
                                   const std::function<at::Tensor(const at::Tensor&)>& fn);
  at::Tensor PostForward(FsdpUnit& unit, at::Tensor output);
  // Throws an error naming the unit when `error` is ATen's failure on a sharded parameter's
  // empty storage; returns otherwise. See Note [Parameters used while sharded].
  void ExplainShardedUse(const c10::Error& error) const;
  void PreBackward(FsdpUnit& unit);
  void FinishBackward();
  // Starts all-gathers of the next units in `direction` (+1 forward, -1 backward order).
  // See Note [Rank-identical prefetch].
  void Prefetch(const FsdpUnit& current, int direction);
  FsdpUnit* Neighbour(const FsdpUnit& unit, int step) const;
  void UpdateMemoryStats();
  // See Note [zero_grad on the module]: at the end of a backward and at the start of the next.
  void LeaveGradSentinels();
  void ApplyModuleZeroGrad();

  std::shared_ptr<torch::nn::Module> root_;
  EngineContext ctx_;
  std::optional<ComputeCopyChoice> compute_copy_;
  std::vector<std::unique_ptr<FsdpUnit>> units_;  // root last
  std::vector<FsdpUnit*> order_;                  // forward order (root first)
  bool order_final_ = false;
  bool backward_started_ = false;
  // A training forward of the root began and no backward finished since: Note [Forward
  // without backward].
  bool forward_without_backward_ = false;
  FsdpUnit* last_reducing_ = nullptr;  // the unit whose reduce-scatter was issued last
  MemoryStats memory_;
  std::unordered_map<std::string, const FsdpParam*> by_name_;
  // Activation checkpointing: recomputes per unit, the unit whose checkpointed forward or
  // recompute is running (a nested unit's forward inside it is an error), units whose forward
  // was checked for randomness.
  std::unordered_map<const FsdpUnit*, int64_t> recomputes_;
  const FsdpUnit* in_checkpoint_ = nullptr;
  std::unordered_map<const FsdpUnit*, bool> rng_checked_;
};

}  // namespace fsdp
