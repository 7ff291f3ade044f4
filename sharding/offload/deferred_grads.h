// Internal to sharding/offload/: CPU offload's work on the host's gradients that is left to the
// optimizer step: the conversion of bf16 gradients and clipping's multiplication (DeferredGrads),
// with the norm's terms that clipping needs meanwhile. HostOffload routes gradients through it;
// HostStepper takes what the step is to do.
//
// Cross-rank contract: none. Clipping's norm over ranks is the caller's (FsdpModel::ClipGradNorm);
// the deferred conversion exists only with one shard, where there is nothing to sum.
//
//   DeferredGrads deferred(stats);
//   deferred.set_defer_conversion(true);
//   deferred.Defer(p, device_grad);           // a gradient landing alone, in bf16
//   std::optional<at::Tensor> norm = deferred.Clip(with_grad, max_norm, device);
//   DeferredGrads::StepScales scales = deferred.TakeStepScales();  // for the step
//
// Note [Deferred gradient conversion]
// With kParams and one shard the host would make three passes over every parameter's bytes per
// step besides the optimizer's: the bf16 gradient's conversion into the fp32 .grad (the adder),
// clipping's norm and multiplication (the training thread), and the bf16 refresh after the
// update. set_defer_conversion(true) (the trainer's, with the overlapped step:
// engine/trainable.cc) folds them into the step:
//   - a gradient that lands on the host alone (no sum with an earlier micro-batch's) stays in
//     bf16 in HostShard::compute_grad and the .grad (HostShard::grad) is left unwritten. Its term
//     of the clipping norm is computed on the device from the gradient being sent, with the ops
//     ClipGradientsByNorm would use on the converted values (CUDA: its fp32 L2 norm; a CPU
//     device: the sum of squares of its fp32 conversion), so the same bits;
//   - Clip gives the norm from those terms, in the parameters' order, and keeps the clipping
//     coefficient instead of multiplying;
//   - the step (HostStepper::StepInOrder) converts, clips, updates and casts each deferred
//     parameter in one pass over it: the optimizer's one loop over the elements when it can
//     (Note [Host Adam pass], engine/host_adam.cc; the fp32 .grad is not written), else ATen's
//     ops a slice at a time (engine/optimizer.h): the slice of the .grad converted and
//     multiplied by the coefficient, stepped, and cast into the loaded copy while it is in cache.
//     Other parameters with a loaded copy to cast are stepped the same way without the
//     conversion. Elementwise ops, slices at multiples of 16 elements (Note [Prepared steps]):
//     the values of the separate passes, bit for bit;
//   - anything else that needs the fp32 .grads first calls MaterializeDeferred (the in-place
//     step, an optimizer that cannot run slices), and a second gradient for a deferred parameter
//     (host accumulation) converts the first before it lands.
//
// Note [Deferred clipping multiplication]
// Gradients that reach the host in fp32 (several shards, a sum over micro-batches on the host,
// fp32 compute, offload optimizer) are clipped on the host (FsdpModel::ClipGradNorm): the norm
// from each .grad's sum of squares, then a multiplication of every .grad, a pass over them on
// the training thread while the device waits for the step. With set_defer_clip_multiply(true)
// (the trainer's, with the overlapped step: it always steps or materializes after clipping) the
// multiplication is left to the step (DeferClipMultiply): the optimizer's one loop multiplies
// each element by the coefficient as it reads it, ATen's slices multiply each slice before
// stepping it, ATen's whole step multiplies the group's gradients on the adder first. One float
// multiplication per element either way: clipping's values, bit for bit. Anything else that
// reads the .grads first (the step in place) calls MaterializeDeferred, which multiplies them.
// The norm's terms leave the training thread too: a gradient complete on the host during the
// last micro-batch's backward (set_final_gradients) gets a task on the adder that computes its
// term (ClipTermTask), so clipping after the backward only sums them (TakeClipTerms) and
// all-reduces the sum. ATen's sum splits its work by at::get_num_threads(), which the adder
// shares with the training thread (ATen sets it on each thread at its first parallel op), so
// the adder's sums are the training thread's, bit for bit.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/Event.h>

#include "sharding/fsdp_param.h"
#include "sharding/offload/host_worker.h"
#include "sharding/offload/stats.h"

namespace fsdp {

class DeferredGrads {
 public:
  explicit DeferredGrads(OffloadStats& stats) : stats_(stats) {}

  // Note [Deferred gradient conversion]: whether a gradient landing on the host alone stays in
  // the compute dtype until the step (kParams, one shard). Off by default.
  void set_defer_conversion(bool defer) { defer_conversion_ = defer; }
  bool defers_conversion() const { return defer_conversion_; }
  bool has_deferred() const { return !deferred_.empty(); }
  // Note [Deferred clipping multiplication]. Off by default.
  void set_defer_clip_multiply(bool defer) { defer_clip_multiply_ = defer; }
  bool defers_clip_multiply() const { return defer_clip_multiply_; }
  void set_final_gradients(bool final) { final_gradients_ = final; }
  bool final_gradients() const { return final_gradients_; }

  // ---- as gradients are sent -----------------------------------------------------------------
  // A new gradient of p: the last one's step never came, so its pending multiplication and its
  // term (the old gradient's) are forgotten.
  void NewGradient(const FsdpParam& p);
  // Forgets p's deferred gradient; whether it had one (an entry whose .grad was reset since is
  // stale: the caller checks the .grad).
  bool Forget(const FsdpParam& p) { return deferred_.erase(&p) > 0; }
  // p's gradient `g` (device, the compute dtype) lands alone and stays deferred: its term of the
  // norm is computed now, on the device.
  void Defer(const FsdpParam& p, const at::Tensor& g);
  // The adder's task computing the term of p's .grad (HostShard::grad) for the norm, after
  // `copied` (CUDA: the copy into it; may be null). The caller queues it after p's tasks.
  HostTask ClipTermTask(const FsdpParam& p, std::shared_ptr<c10::Event> copied);

  // ---- clipping (after the end of backward) --------------------------------------------------
  // When every one of `with_grad` (the parameters whose .grad is defined, in FsdpModel::
  // parameters()' order) is deferred: their gradients' norm on `device` (as
  // ClipGradientsByNorm's), the coefficient for max_norm kept for the step. Otherwise nullopt:
  // the caller materializes and clips the .grads as usual.
  std::optional<at::Tensor> Clip(const std::vector<FsdpParam*>& with_grad, double max_norm,
                                 c10::Device device);
  // The fp32 .grads of `with_grad` are to be multiplied by `coef` (a CPU fp32 scalar) by the
  // step that reads them, or by Materialize if anything else reads them first.
  void DeferClipMultiply(const std::vector<FsdpParam*>& with_grad, at::Tensor coef);
  // The terms the adder computed for `with_grad`, in its order (undefined where it computed
  // none); forgets every term.
  std::vector<at::Tensor> TakeClipTerms(const std::vector<FsdpParam*>& with_grad);
  // Converts every deferred gradient into its .grad, multiplied by the coefficient Clip kept,
  // if any, and does the multiplications DeferClipMultiply left; `before_write(p)` first waits
  // for whatever still uses p's .grad buffer. On the calling thread.
  void Materialize(const std::function<void(FsdpParam&)>& before_write);

  // ---- the step ------------------------------------------------------------------------------
  // What the next step is to multiply by; taking it resets it.
  struct StepScales {
    at::Tensor scale;                         // the deferred gradients' coefficient (Clip's;
                                              // undefined: not clipped), ready after:
    std::shared_ptr<c10::Event> scale_ready;  // CUDA: its copy to the host; else null
    std::set<const FsdpParam*> to_scale;      // fp32 .grads left to multiply by grad_scale
    at::Tensor grad_scale;                    // DeferClipMultiply's coef (to_scale non-empty)
  };
  StepScales TakeStepScales();

 private:
  OffloadStats& stats_;
  bool defer_conversion_ = false;
  // p -> its term of the clipping norm (ClipNormTerms, on the device), until the step converted
  // it or Materialize did.
  std::map<const FsdpParam*, at::Tensor> deferred_;
  // The coefficient Clip computed, for the host (pinned on CUDA, ready once clip_scale_ready_
  // is), or DeferClipMultiply's.
  at::Tensor clip_scale_host_;
  std::shared_ptr<c10::Event> clip_scale_ready_;
  bool clipped_ = false;  // Clip ran since the deferred gradients landed
  bool defer_clip_multiply_ = false;
  std::set<const FsdpParam*> scale_pending_;  // .grads still waiting for clip_scale_host_
  // The norm's terms the adder computes (each written by its task before the end of backward
  // returns; the map itself only on the training thread).
  bool final_gradients_ = false;
  std::map<const FsdpParam*, std::shared_ptr<at::Tensor>> clip_terms_;
};

// p's .grad (HostShard::grad) from its gradient landed in `landed` (exact: a wider dtype), times
// `scale` when defined (clipping's multiplication).
void ConvertDeferred(FsdpParam& p, const at::Tensor& landed, const at::Tensor& scale);

}  // namespace fsdp
