// Internal to sharding/offload/: the optimizer step on the host's masters, run on the adder
// group after group while the training thread goes on (Note [Overlapped host step],
// engine/trainable.cc), possibly one step late (Note [Delayed parameter update]). HostStepper
// queues the groups, and says which parameters' update a load must wait for.
//
// Cross-rank contract: none; the step is local to the rank.
//
//   HostStepper stepper(config, worker, deferred, transfers, stats);
//   stepper.StepInOrder(groups, step, /*delayed=*/false);  // after the end of backward
//   auto stepped = stepper.TakeStepped(unit_params, /*wait=*/true);  // before a unit's load
//   std::vector<FsdpParam*> rest = stepper.Finish();                 // every group stepped
//
// Note [Delayed parameter update]
// The overlapped step hides only what the next forward's first units take: their loads wait
// for their update. With FsdpOptions::offload_delayed_update the trainer may queue a step
// "delayed" (StepInOrder's `delayed`; DeepSpeed's ZeRO-Offload calls it the one-step delayed
// parameter update): the next step's loads do not wait for it, so step i+1's forward and
// backward use the parameters from before update i (one step stale) while the host runs update
// i. The end of a backward (HostOffload::WaitForCopies) waits for the gradients' tasks only, not
// for a step queued before them, so update i runs through all of step i+1's micro-batches; the
// next StepInOrder waits for what is left of it (FsdpModel::StepOnHost: FinishHostStep). Update
// i becomes visible at the next StepInOrder or Finish (FsdpModel::FinishHostStep: checkpoints,
// evaluations, the end of training, CopyShardsToDevice), so after those the next step sees
// every update so far: a run resumed from a checkpoint continues exactly as the one that saved.
// What step i+1 reads while update i writes has a second buffer (HostShard's *_spare):
//   params     the loaded copies: compute_shard is what loads read, compute_shard_spare what
//              the update casts the new masters into; Finish swaps them. With a delayed update
//              the host keeps these copies in the compute dtype whatever it is (fp32 compute
//              too: the masters themselves are being written). The gradients' landing buffers
//              (compute_grad, one shard) swap as the update is queued: it reads the buffer step
//              i's gradients landed in, step i+1's land in the other.
//   optimizer  the device shards are step i+1's; the caller of Finish copies the updated masters
//              into them (as without the delay, one step later).
// A gradient written straight into p's fp32 .grad buffer (several shards, fp32 compute, offload
// optimizer) first waits for p's update, which reads it (WaitForDelayedStep), so the delayed
// update runs the groups in backward order, the order the next backward sends them.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "sharding/fsdp_param.h"
#include "sharding/offload/deferred_grads.h"
#include "sharding/offload/host_worker.h"
#include "sharding/offload/stats.h"
#include "sharding/offload/transfers.h"
#include "sharding/options.h"

namespace fsdp {

// The optimizer's step as StepInOrder runs it: engine/optimizer.h's PreparedStep given as
// functions (sharding/ does not depend on engine/). `run` updates whole masters; the others
// are optional: the slices of Note [Deferred gradient conversion]. StepInOrder calls
// can_run_slices on the training thread before the adder runs any of the others, which forget
// the masters they updated (the functions need not be safe to call from two threads at once).
struct HostStep {
  std::function<void(const std::vector<at::Tensor>&)> run;
  std::function<bool(const at::Tensor&)> can_run_slices;
  std::function<void(const at::Tensor&, int64_t, int64_t)> run_slice;  // master, begin, n
  std::function<void(const at::Tensor&)> slices_done;
  // Optional: the whole update of a master from its bf16 gradient (times a clipping scale) in
  // one loop, casting into the loaded copy (undefined: none); false when it cannot, having
  // changed nothing (Note [Host Adam pass] in engine/host_adam.cc). slices_done follows.
  std::function<bool(const at::Tensor& master, const at::Tensor& grad, float scale,
                     const at::Tensor& copy)>
      run_host_pass;
};

// How HostStepper runs (HostOffload::Create's arguments and knobs).
struct HostStepConfig {
  Offload mode = Offload::kOptimizer;
  std::vector<FsdpParam*> params;  // every offloaded parameter
  bool can_delay = false;          // the second buffers of Note [Delayed parameter update] exist
  int64_t step_slice = 0;          // elements per slice (FSDP_OFFLOAD_STEP_SLICE)
  bool host_pass = true;           // the one loop may run (FSDP_OFFLOAD_HOST_PASS)
};

// Elements per slice of a sliced step by default (Note [Deferred gradient conversion]), a
// multiple of 16 (Note [Prepared steps]). Each of a slice's ops forks and joins ATen's threads,
// so a slice must be large enough to amortise that, and small enough that its arrays may stay in
// the shared cache between its ops.
inline constexpr int64_t kDefaultStepSlice = int64_t{1} << 22;

class HostStepper {
 public:
  HostStepper(HostStepConfig config, HostWorker& worker, DeferredGrads& deferred,
              Transfers& transfers, OffloadStats& stats)
      : config_(std::move(config)),
        worker_(worker),
        deferred_(deferred),
        transfers_(transfers),
        stats_(stats) {}

  // Queues on the adder, group after group (`groups`: the units' parameters in forward order),
  // `step(masters of the group)` and, with kParams, the cast of the group's masters into their
  // loaded copies. Call after the end of backward, with every master's .grad final. Deferred
  // gradients of the group (Note [Deferred gradient conversion]) are converted, clipped and
  // stepped a slice at a time when `step` runs slices; otherwise converted first. `delayed`
  // (config.can_delay only): the groups run in reverse, and TakeStepped does not wait for them.
  void StepInOrder(const std::vector<std::vector<FsdpParam*>>& groups, HostStep step, bool delayed);
  // Those of `params` with an update queued, once it ran (waiting for it; `wait` false: nullopt
  // while it runs), forgotten as stepped. Empty for a delayed step.
  std::optional<std::vector<FsdpParam*>> TakeStepped(std::vector<FsdpParam>& params, bool wait);
  // Waits for every group queued (rethrowing its error) and returns those not taken since; a
  // delayed step's loaded copies become the ones loads read.
  std::vector<FsdpParam*> Finish();
  // Before p's fp32 .grad buffer is written: its delayed update (which reads it) done.
  void WaitForDelayedStep(FsdpParam& p);
  // Whether a step queued has groups not taken since.
  bool step_pending() const { return !step_task_.empty(); }
  bool can_delay() const { return config_.can_delay; }

 private:
  // The pass of a group's job over one parameter: the one loop, else slices (else, with neither
  // `landed` nor `compute`, the step of the whole tensor). `landed`: where its deferred gradient
  // landed (undefined: p's .grad is final already); `compute`: the loaded copy to cast the
  // updated master into, a slice at a time (undefined: none); `scale`: the multiplication of the
  // gradient, converted or .grad (clipping's, Note [Deferred clipping multiplication]).
  void StepInSlices(FsdpParam& p, const at::Tensor& landed, const at::Tensor& compute,
                    const HostStep& step, const at::Tensor& scale);
  // Blocks until the adder finished the `seq`-th task, counted as the training thread's wait.
  void WaitForStep(uint64_t seq);

  HostStepConfig config_;
  HostWorker& worker_;
  DeferredGrads& deferred_;
  Transfers& transfers_;
  OffloadStats& stats_;
  // Each parameter's update task, until TakeStepped or Finish waited for it.
  std::map<FsdpParam*, uint64_t> step_task_;
  bool step_delayed_ = false;  // the step in step_task_ was queued delayed
};

}  // namespace fsdp
