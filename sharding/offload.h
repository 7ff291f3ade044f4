// Internal to sharding/: CPU offload of the fp32 shards' optimizer (FsdpOptions::offload,
// parallelism.offload). HostOffload owns the host side of every sharded parameter and the
// copies between the host and the device; FsdpUnit and FsdpModel call it at the points below.
// Users see only the option and two calls on FsdpModel (CopyShardsToDevice after they write the
// shards, model_state_bytes).
//
// Cross-rank contract: none. Every copy is local to the rank; the collectives and their order
// are those of the run without offload.
//
// Note [CPU offload]
// With offload the optimizer's tensors (FsdpParam::sharded, what FsdpModel::parameters() and
// named_parameters() return, what checkpoints read and write) are fp32 *host* masters: views
// of one host arena per dtype, allocated once at wrap time with each parameter's padded shard
// (host_shard; `sharded` is its real rows) and, for a trainable one, its gradient buffer
// (host_grad). When the device is a GPU the arena is page-locked (cudaHostAlloc, exactly its
// size: libtorch's pinned allocator would round it up to a power of two). The masters' .grad
// are host tensors, so gradient clipping and the optimizer step run on the host
// (engine/optimizer.h steps Adam/AdamW there with ATen's fused CPU kernel).
//   optimizer  The device keeps the fp32 padded shard (padded_shard: the all-gather's source).
//              Once a unit's gradient shard is final (FsdpUnit::FinishGradients, or at once
//              with one rank) it is copied into host_grad, which becomes sharded.grad (added
//              into it when a .grad is already there: gradient accumulation; the trainer
//              keeps the sum on the device instead, see "Accumulating on the device"). After the
//              optimizer step the masters are copied into the device shards:
//              FsdpModel::CopyShardsToDevice (TrainableModel::AfterStep, after a checkpoint
//              load or a safetensors init; a caller that writes the masters itself must call
//              it before the next forward).
//   params     The device keeps nothing between iterations: padded_shard is allocated and
//              filled from the host just before the unit's all-gather (FsdpUnit::Unshard, or
//              ahead of it: FsdpModel's prefetch starts the copy of the unit after the one it
//              gathers, so each copy overlaps the previous unit's compute) and freed when the
//              unit reshards (with one rank the unsharded parameters alias it until then).
//              Gradients go to the host as above, but with one shard (no reduction: the
//              unsharded gradient is the shard's) in the compute dtype when that is narrower
//              and the rounding to the reduce dtype is exact (reduce dtype = the gradient's or
//              the shard's: with bf16 compute and fp32 reduce the cast is exact): the copy
//              moves 2 bytes per parameter instead of 4 into host_compute_grad, and the host
//              converts it into host_grad (ATen's copy_) or adds it there in one loop over
//              the elements on the host loops' threads (HostAddConverted, Note [Host loops];
//              without AVX2, or FSDP_OFFLOAD_HOST_PASS=off: AddConvertedInChunks, a 16 MiB
//              chunk at a time converted by ATen into a scratch and added with add_; ATen's
//              mixed-dtype add_ is ~9x slower, docs/offload.md). Either way each element is
//              a + float(b) rounded once, the sum of the fp32 path and of the run without
//              offload, bit for bit. With
//              several shards the reduce-scatter's output is in the reduce dtype already.
//              When the compute dtype is narrower than the shard's (mixed precision: fp32
//              shards, bf16 compute) the host also keeps host_compute_shard, the padded shard
//              cast to the compute dtype (in the compute dtype's arena: pinned on CUDA, 2 bytes
//              per parameter of shard with bf16), and that is what is loaded: the copy moves 2
//              bytes per parameter instead of 4, and padded_shard arrives in the compute dtype,
//              so the unshard needs no cast on the device (one rank: the parameters alias it;
//              several: it is the all-gather's input as is; the collectives, their order and
//              bytes are those of the run without offload, which casts into its all-gather
//              input). The cast is the one the device would do (round to nearest even, also
//              ATen's on the CPU), so values are bit for bit the same. It is refreshed from the
//              masters at wrap time and by FsdpModel::CopyShardsToDevice (PushShards: after the
//              step, a checkpoint load, a safetensors init; a caller that writes the masters
//              itself must call it before the next forward, as with kOptimizer): one ATen
//              copy_ per shard, with ATen's intra-op threads, 6 bytes per parameter of host
//              memory traffic (HostOffload::Stats::refresh_s).
// Accumulating on the device (set_accumulate_on_device; FsdpModel::
// set_offload_accumulate_on_device): a backward run with it true adds its final gradient
// shards into p.device_grad (the shard's shape and dtype, on the device: the additions of the
// run without offload, on the same device) instead of sending them to the host; the next
// backward with it false adds its own there too and sends the sum, once. Under gradient
// accumulation this turns grad_accum_steps device->host copies and grad_accum_steps - 1 host
// additions per step into one copy, for 4 bytes per parameter of shard on the device between
// the micro-batches. The trainer does it with offload=optimizer (whose device holds the fp32
// shards already) and not with offload=params (whose point is the device memory); the time it
// saves: docs/offload.md.
// Where the device is the CPU (tests, CI) the host buffers are distinct tensors: every copy
// really happens and the arithmetic is the one without offload, bit for bit.
//
// On CUDA: host->device copies run on the copy-in stream (Note [Copy-in stream], streams.h),
// so each all-gather, issued from that stream, follows its shard's copy; with one rank (no
// all-gather) the compute stream waits for the copies' event instead. Device->host copies of
// gradient shards run on a stream of their own after an event on the compute stream, into the
// pinned buffers, non_blocking; the device gradient is kept alive until its copy is done.
// Host additions: what the host does with a gradient once it landed (an addition into the .grad,
// or a conversion into host_grad) runs on a thread of HostOffload's own (the adder), in the
// order the gradients were sent, as soon as its copy is done (on CUDA the adder waits for the
// copy's event), so it overlaps the rest of the backward and the next micro-batch's forward
// instead of stalling the training thread; a parameter's additions keep their order (micro-
// batch by micro-batch, one thread), so the sums are those of the run without offload, bit for
// bit. A parameter's landing buffer is written again only after its last addition finished
// (the training thread waits for it, counted in wait_s). Stats: add_s is the adder's time,
// late_adds what was not done when the end of backward began to wait (not hidden), and
// to_host_compute_bytes the bytes sent in the compute dtype. The host waits only at the end of
// backward (FsdpModel's final callback: WaitForCopies: the copies and the gradients' tasks on
// the adder, not an overlapped step queued before them), where it must anyway before it clips
// and steps, and which also guarantees that no copy still reads a master the host optimizer is
// about to write. Nothing pinned is allocated after wrapping,
// except each parameter's staging buffer, once, the first time accumulation needs it on CUDA.
//
// Note [Deferred gradient conversion]
// With kParams and one shard the host does three passes over every parameter's bytes per step
// besides AdamW: the bf16 gradient's conversion into the fp32 .grad (the adder), clipping's
// norm and multiplication (the training thread), and the bf16 refresh after the update; on the
// H100 machine they took longer than AdamW itself (docs/offload.md). set_defer_conversion(true)
// (the trainer's, with the overlapped step: engine/trainable.cc) folds them into the step:
//   - a gradient that lands on the host alone (no sum with an earlier micro-batch's: one
//     micro-batch per step, grad_sync last) stays in bf16 in host_compute_grad; p's .grad
//     (host_grad) is left unwritten ("deferred"). Its clipping contribution is computed on the
//     device from the gradient being sent, with the ops ClipGradientsByNorm would use on the
//     converted values (CUDA: its fp32 L2 norm; a CPU device: the sum of squares of its fp32
//     conversion, the host computation's own ops on the same values, so the same bits);
//   - ClipDeferred gives the norm from those, in the parameters' order, and keeps the clipping
//     coefficient instead of multiplying;
//   - the step (StepInOrder): with AdamW (or Adam without decay) on a CPU whose ATen kernels it
//     matches, the optimizer's one loop over the elements (Note [Host Adam pass],
//     engine/host_adam.cc: the bf16 gradient times the coefficient, the update, the cast into
//     host_compute_shard; 28 bytes per parameter; host_grad is not written); else, when the
//     optimizer runs slices (engine/optimizer.h), each
//     deferred parameter a chunk (4M elements) at a time, each op on ATen's intra-op threads: the
//     chunk of host_grad is written from host_compute_grad (exact) and multiplied by the
//     coefficient (clipping's multiplication), the chunk's AdamW update runs on it, and the chunk
//     of host_compute_shard is cast from the updated master, each while the chunk is in the
//     shared cache. Every other parameter with
//     a loaded copy to cast (kParams: several shards, or a gradient summed on the host) is stepped
//     the same way without the conversion: its update and its cast a chunk at a time, one pass
//     instead of two. The values are those of the
//     three passes, bit for bit (elementwise ops, slices at multiples of 16 elements: Note
//     [Prepared steps]); .grad holds the clipped gradient afterwards, as it would have.
//   - Anything else that needs the fp32 .grads first calls MaterializeDeferred (the in-place
//     step, an optimizer that cannot run slices), and a second gradient for a deferred parameter
//     (host accumulation) converts the first before it lands.
// Host bytes per parameter with AdamW: ~30 instead of ~56.
//
// Note [Deferred clipping multiplication]
// Gradients that reach the host in fp32 (several shards, a sum over micro-batches on the host,
// fp32 compute, offload optimizer) are clipped on the host (FsdpModel::ClipGradNorm): their sums
// of squares and the coefficient on the training thread, then a multiplication of every .grad,
// a pass of 8 bytes per parameter on the training thread while the device waits for the step.
// With set_defer_clip_multiply(true) (the trainer's, with the overlapped step: it always steps
// or materializes after clipping) the norm is computed as before, but the multiplication is left
// to the step (DeferClipMultiply): the optimizer's one loop multiplies each gradient element by
// the coefficient as it reads it (no pass of its own), ATen's slices multiply each slice before
// stepping it, ATen's whole step multiplies the unit's gradients on the adder first. The values
// are clipping's, bit for bit (one float multiplication per element either way); anything else
// that reads the .grads first (the step in place) calls MaterializeDeferred, which multiplies
// them there. The norm's terms (each .grad's sum of squares, ATen's own op so that the norm
// keeps its bits) leave the training thread too: a gradient complete on the host during the
// last micro-batch's backward gets a task on the adder that computes its term
// (set_final_gradients, QueueClipTerm), so clipping after the backward only sums them
// (TakeClipTerms) and all-reduces the sum. ATen's sum splits its work by at::get_num_threads(),
// which the adder's thread shares with the training thread (ATen sets it on each thread at its
// first parallel op), so the adder's sums are the training thread's, bit for bit.
//
// Note [Delayed parameter update]
// The overlapped step (Note [Overlapped host step], engine/trainable.cc) hides only what the
// next forward's first units take: their loads wait for their update. On a host whose AdamW
// takes about as long as the device's whole step, the step is the two in series. With
// FsdpOptions::offload_delayed_update the trainer may queue a step "delayed" (StepInOrder's
// `delayed`; DeepSpeed's ZeRO-Offload calls it the one-step delayed parameter update): the
// next step's loads do not wait for it, so step i+1's forward and backward use the parameters
// from before update i (one step stale) while the host runs update i. The end of a backward
// (WaitForCopies) waits for the gradients' tasks only, not for a step queued before them, so
// update i runs through all of step i+1's micro-batches; the next StepInOrder waits for what
// is left of it (FsdpModel::StepOnHost: FinishHostStep). Update i then becomes visible at
// the next StepInOrder or FinishStep (FsdpModel::FinishHostStep: checkpoints, evaluations, the
// end of training, CopyShardsToDevice), so after those the next step sees every update so far:
// a run resumed from a checkpoint continues exactly as the run that saved it did.
// What step i+1 reads while update i writes has a second buffer:
//   params     the loaded copies: host_compute_shard is what loads read, host_compute_shard_spare
//              what the update casts the new masters into; FinishStep swaps them. With a
//              delayed update the host keeps these copies in the compute dtype whatever it is
//              (fp32 compute too: the masters themselves are being written). The gradients'
//              landing buffers (host_compute_grad, one shard) swap as the update is queued: it
//              reads the buffer step i's gradients landed in, step i+1's land in the other.
//   optimizer  the device shards are step i+1's; FinishStep copies the updated masters into
//              them (as without the delay, one step later).
// A gradient written straight into p's fp32 host_grad (several shards, fp32 compute, offload
// optimizer) first waits for p's update (its .grad is that buffer: stats' step_wait_s), so
// the delayed update runs the groups in backward order, the order the next backward sends
// them. Host memory (pinned on CUDA): + the compute-dtype copy per parameter (2 bytes with bf16
// compute, 8 with fp32, which had none) and + the landing buffer (2 bytes, one shard) with
// offload params; nothing with offload optimizer.
//
//   FsdpOptions options = OptionsForStrategy(Strategy::kFullShard);
//   options.offload = Offload::kParams;
//   auto sharded = FsdpModel::Wrap(model, mesh, units, options).value();
//   torch::optim::AdamW opt(sharded->parameters(), ...);   // host tensors
//   loss.backward();                                        // .grad on the host when it returns
//   sharded->ClipGradNorm(1.0); opt.step(); sharded->CopyShardsToDevice(); opt.zero_grad();
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <thread>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>

#include "absl/status/statusor.h"
#include "sharding/fsdp_param.h"
#include "sharding/options.h"
#include "sharding/streams.h"

namespace fsdp {

// Bytes of model state (parameter shards and their gradients) by where they live. The
// optimizer's state is its owner's to count (it lives with the parameters it steps).
struct ModelStateBytes {
  int64_t device = 0;  // padded shards and gradient shards resident on the device
  int64_t host = 0;    // offload: host shards (with their compute-dtype copies) and
                       // gradient buffers, those committed on demand as far as written
  int64_t host_untouched = 0;  // gradient buffers committed on demand, the part never written
                               // (Note [Gradients committed on demand] in offload.cc)
};

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

class HostOffload {
 public:
  // Moves `params`' masters to host memory as Note [CPU offload] says (mode kOptimizer or
  // kParams): allocates the host arenas (pinned on CUDA), copies the shards in, points each
  // `sharded` at its master and, with kParams, frees the device shards. kResourceExhausted
  // naming parallelism.offload when the host memory cannot be allocated.
  // `one_shard`: gradients reach AccumulateGrad/SendComputeGrad unreduced (one shard, no
  // replicas), so kParams allocates host_compute_grad for them.
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
  // kParams: every host_compute_shard cast afresh from its master (host_shard), after waiting
  // for the host->device copies still reading them. Synchronous, on the calling thread (ATen's
  // copy_ uses its intra-op threads).
  void RefreshComputeShards();
  // kParams: allocates the device shards of `params` that are not loaded and issues their copy
  // from the host (host_compute_shard when there is one, else host_shard) on the current
  // stream (the caller makes it the copy-in stream). With a host step in flight (StepInOrder)
  // it first waits for these parameters' step; `wait` false (a prefetch) returns false
  // instead, loading nothing, while that step runs. kOptimizer: with a host step in flight,
  // the same wait, then the stepped masters are copied into their device shards (on the
  // current stream, which the caller ordered after the compute stream); otherwise nothing.
  bool LoadShards(std::vector<FsdpParam>& params, bool wait = true);

  // ---- the optimizer step, overlapped (Note [Overlapped host step], engine/trainable.cc) ----
  // Queues on the adder thread, group after group (`groups`: the units' parameters in forward
  // order), `step(masters of the group)` and, with kParams, the cast of the group's masters into
  // host_compute_shard; LoadShards then waits for a group's step before its first copy. Call
  // after the end of backward (WaitForCopies), with every master's .grad final.
  // Deferred gradients of the group (Note [Deferred gradient conversion]) are converted,
  // clipped and stepped a chunk at a time when `step` runs slices; otherwise converted first.
  // `delayed` (Create's `delayed` only): loads do not wait for it, it becomes visible at the next
  // StepInOrder or FinishStep (Note [Delayed parameter update]); the groups run in reverse.
  void StepInOrder(const std::vector<std::vector<FsdpParam*>>& groups, HostStep step,
                   bool delayed = false);
  // Waits for every step StepInOrder queued (rethrowing its error) and, with kOptimizer, copies
  // the masters not copied yet into their device shards (copy-in stream, after the compute
  // stream): afterwards the masters and device shards are those of a step run in place. A
  // delayed step's loaded copies become the ones loads read.
  void FinishStep(DeviceStreams& streams);
  // Whether a step queued by StepInOrder has groups not loaded or pushed since.
  bool step_pending() const { return !step_task_.empty(); }
  // Whether Create allocated the second buffers of Note [Delayed parameter update].
  bool can_delay() const { return can_delay_; }
  // kParams: frees the device shards of `params` (through `streams`' stash: Note [Copy-in
  // stream]).
  void ReleaseShards(std::vector<FsdpParam>& params, DeviceStreams& streams);
  // Makes the current stream wait for the host->device copies issued so far (one rank: the
  // unsharded parameters alias the device shards, no all-gather orders them). No-op on CPU.
  void WaitForShardsOnCurrentStream();

  // ---- gradients ------------------------------------------------------------------------------
  // Note [Deferred gradient conversion]: whether a gradient landing on the host alone stays in
  // the compute dtype until the step (kParams, one shard). Off by default.
  void set_defer_conversion(bool defer) { defer_conversion_ = defer; }
  bool has_deferred() const { return !deferred_.empty(); }
  // After WaitForCopies. When every one of `with_grad` (the parameters whose .grad is defined,
  // in FsdpModel::parameters()' order) is deferred: their gradients' norm on `device` (as
  // ClipGradientsByNorm's), the clipping coefficient for max_norm kept for the step. Otherwise
  // converts the deferred ones (MaterializeDeferred) and returns nullopt: the caller clips the
  // .grads as usual.
  std::optional<at::Tensor> ClipDeferred(const std::vector<FsdpParam*>& with_grad,
                                         double max_norm, c10::Device device);
  // Converts every deferred gradient into its .grad, multiplied by the coefficient ClipDeferred
  // kept, if any (what clipping would have done to it), and does the multiplications
  // DeferClipMultiply left. On the calling thread.
  void MaterializeDeferred();
  // Note [Deferred clipping multiplication]: whether FsdpModel::ClipGradNorm may leave the
  // multiplication of the host's fp32 .grads to the step (DeferClipMultiply). Off by default.
  void set_defer_clip_multiply(bool defer) { defer_clip_multiply_ = defer; }
  bool defers_clip_multiply() const { return defer_clip_multiply_; }
  // After WaitForCopies: the fp32 .grads (host_grad) of `with_grad` are to be multiplied by
  // `coef` (a CPU fp32 scalar, clipping's coefficient) by the step that reads them
  // (StepInOrder), or by MaterializeDeferred if anything else reads them first. A gradient that
  // lands before either (the step was skipped) drops its parameter's pending multiplication.
  void DeferClipMultiply(const std::vector<FsdpParam*>& with_grad, at::Tensor coef);
  // Note [Deferred clipping multiplication], the norm's terms: true says the gradients that
  // land from now on are their parameters' last before clipping (the trainer's last
  // micro-batch); with set_defer_clip_multiply(true), each fp32 .grad's term (ClipNormTerms) is
  // then computed on the adder once the gradient is complete, while the backward goes on.
  void set_final_gradients(bool final) { final_gradients_ = final; }
  // After WaitForCopies: the terms the adder computed for `with_grad`, in its order (undefined
  // where it computed none); forgets every term.
  std::vector<at::Tensor> TakeClipTerms(const std::vector<FsdpParam*>& with_grad);

  // Whether the gradients of the backwards that follow stay on the device (p.device_grad) or,
  // false (the default), go to the host, with any sum kept on the device before them. Note [CPU
  // offload], "Accumulating on the device".
  void set_accumulate_on_device(bool on_device) { accumulate_on_device_ = on_device; }
  bool accumulate_on_device() const { return accumulate_on_device_; }
  // `g` is p's final gradient shard for this backward (device, the shard's shape and dtype).
  // With a sum on the device, or accumulating there: adds it into p.device_grad (or it becomes
  // that: itself when `owned` and plain, else a copy) and, unless accumulating, sends the sum to
  // the host. Otherwise copies `g` into p.host_grad, which becomes p.sharded's .grad, or adds
  // it into the .grad already there.
  void AccumulateGrad(FsdpParam& p, const at::Tensor& g, bool owned);
  // &p.device_grad when this backward's gradient of p is to be added into it (it holds an
  // earlier backward's sum, or accumulates from now), for a caller that adds in place and then
  // calls DeviceGradUpdated(p); nullptr when the gradient goes straight to the host.
  at::Tensor* DeviceGrad(FsdpParam& p);
  // After an in-place addition into *DeviceGrad(p): sends the sum unless accumulating.
  void DeviceGradUpdated(FsdpParam& p);
  // One shard: `grad` is p's unsharded gradient (device, the compute dtype), whose rounding to
  // the reduce dtype the caller checked to be exact. Sends it to the host as is and returns
  // true when p has a host_compute_grad and no sum waits on the device (Note [CPU offload],
  // "params"); else false, and the caller casts it and calls AccumulateGrad.
  bool SendComputeGrad(FsdpParam& p, const at::Tensor& grad);
  // End of backward: waits for every copy in flight, both ways, and for the adder's additions
  // and conversions (afterwards the host .grads are final; an error of the adder is rethrown
  // here), but not for a step StepInOrder queued (FinishStep), and gives back the device shards
  // that this backward's reshards stashed in `streams`.
  void WaitForCopies(DeviceStreams& streams);

  // Most bytes of device shards loaded at once (kParams), since wrapping.
  int64_t peak_loaded_bytes() const { return peak_loaded_bytes_; }

  // What the offload cost since wrapping (rank_stats' "offload": Note [Rank statistics] in
  // engine/trainer.cc); each host phase is also a profiler range, fsdp::offload_<phase>, in
  // training.profile traces.
  struct Stats {
    int64_t to_host_bytes = 0;    // gradient shards copied device->host
    int64_t to_host_compute_bytes = 0;  // of which in the compute dtype (kParams, one shard)
    int64_t to_device_bytes = 0;  // parameter shards copied host->device
    int64_t host_adds = 0;        // gradient shards added on the host (accumulation)
    int64_t late_adds = 0;        // host additions, conversions and the norm's terms not done
                                  // yet when the end of backward began to wait for them (not
                                  // hidden behind compute)
    double wait_s = 0;            // training thread blocked on copies in flight and on the
                                  // adder (fsdp::offload_wait)
    double add_s = 0;             // the adder's additions of gradients, and conversions of
                                  // compute-dtype ones into host_grad (fsdp::offload_host_add;
                                  // off the training thread)
    double clip_term_s = 0;       // the adder's terms of the clipping norm (Note [Deferred
                                  // clipping multiplication]; fsdp::offload_clip_term)
    double push_s = 0;            // issuing the masters' host->device copies (offload_push)
    double refresh_s = 0;         // kParams: casting the masters into host_compute_shard
                                  // (fsdp::offload_refresh; on the adder when overlapped)
    // Overlapped host steps (StepInOrder): the adder's time stepping the groups (refresh
    // included; fsdp::offload_host_step), and the training thread's time blocked waiting for a
    // group's step before loading it (fsdp::offload_step_wait): the part not hidden.
    double host_step_s = 0;
    double step_wait_s = 0;
    int64_t overlapped_steps = 0;  // StepInOrder calls
    // Note [Deferred gradient conversion]: gradients converted, clipped and stepped in one pass
    // by the host step, and those converted apart (MaterializeDeferred, a second gradient).
    int64_t deferred_steps = 0;
    int64_t deferred_materialized = 0;
    // Parameters stepped by the optimizer's one loop (Note [Host Adam pass]): the deferred
    // ones from their bf16 gradient, the others from their fp32 .grad.
    int64_t host_passes = 0;
    // Note [Deferred clipping multiplication]: parameters whose clipping multiplication the
    // step did (in its one loop or just before ATen's step), not the training thread.
    int64_t clip_multiplies_deferred = 0;
    // Of those, the parameters whose term of the norm the adder computed during the backward.
    int64_t clip_terms_on_adder = 0;
    // Of host_adds: the compute-dtype gradients added by one loop (HostAddConverted, Note [Host
    // loops]) instead of ATen's conversion and add_.
    int64_t host_add_passes = 0;
    // Note [Delayed parameter update]: StepInOrder calls with `delayed` (of overlapped_steps).
    int64_t delayed_steps = 0;
  };
  const Stats& stats() const { return stats_; }

 private:
  HostOffload(Offload mode, c10::Device device) : mode_(mode), device_(device) {}
  // Records that the current stream's host->device copies so far are to be waited for.
  void RecordHostToDevice();
  // Forgets device->host copies that have finished (their device tensors are freed).
  void ReapFinished();
  // Waits for the copies in flight and the gradients' tasks (WaitForCopies' first part).
  void Drain();
  // `g` (device) into p's host .grad: copied into host_grad, or added into the .grad there;
  // in p's compute dtype through host_compute_grad (SendComputeGrad). On CUDA asynchronous:
  // `g` is kept alive and must not change until WaitForCopies.
  void SendToHost(FsdpParam& p, const at::Tensor& g);
  // The host's part of a gradient sent to it, run by the adder: see "Host additions" above.
  struct HostTask {
    at::Tensor dst;   // the fp32 .grad (host_grad)
    at::Tensor src;   // where the gradient landed: staging_ or host_compute_grad (CPU device:
                      // the device gradient itself for an fp32 addition)
    bool add = true;  // dst += src (converted when narrower), else dst = src
    std::shared_ptr<c10::Event> copied;  // CUDA: the copy into src; null on a CPU device
    std::function<void()> job;           // set: run this instead (a group's host step)
  };
  // Queues `task` for p (starting the adder the first time).
  void Enqueue(FsdpParam& p, HostTask task);
  // Queues `task` for no parameter; returns its number.
  uint64_t EnqueueTask(HostTask task);
  // StepInOrder's wait in LoadShards: those of `params` with an update queued, once it ran
  // (waiting for it; `wait` false: nullopt while it runs), their entries in step_task_ gone.
  std::optional<std::vector<FsdpParam*>> TakeStepped(std::vector<FsdpParam>& params, bool wait);
  // kOptimizer: copies the masters of `params` into their device shards (current stream).
  void Push(const std::vector<FsdpParam*>& params);
  // Note [Delayed parameter update]: before p's fp32 host_grad is written, its delayed update
  // (which reads it) is waited for.
  void WaitForDelayedStep(FsdpParam& p);
  // Before the training thread writes p's host_grad: the adder's tasks queued for p, and its
  // delayed update, done.
  void WaitForHostGrad(FsdpParam& p);
  // Blocks until the adder finished the `seq`-th task queued (1-based); rethrows its error.
  void WaitForTask(uint64_t seq);
  // The adder's loop; FinishOnHost runs one task on it.
  void RunAdder();
  void FinishOnHost(const HostTask& task);
  // Note [Deferred gradient conversion]: p's .grad from its landed gradient, times `scale` when
  // defined; and the pass of StepInOrder's job over one parameter: the one loop, else slices
  // (else, with neither `landed` nor `compute`, the step of the whole tensor).
  // `landed`: where its gradient landed (host_compute_grad when queued; StepInSlices:
  // undefined when p's .grad is final already); `compute`: the loaded copy to cast the updated
  // master into, a slice at a time (undefined: none); `scale`: StepInSlices' multiplication of
  // the gradient, converted or .grad (clipping's, Note [Deferred clipping multiplication]).
  void ConvertDeferred(FsdpParam& p, const at::Tensor& landed, const at::Tensor& scale);
  // Queues the term of p's .grad (host_grad) for the norm, after `copied` (CUDA: the copy into
  // host_grad; may be null) and p's tasks queued before.
  void QueueClipTerm(FsdpParam& p, std::shared_ptr<c10::Event> copied);
  void StepInSlices(FsdpParam& p, const at::Tensor& landed, const at::Tensor& compute,
                    const HostStep& step, const at::Tensor& scale);

  struct InFlight {
    at::Tensor device_source;  // kept alive until the copy reading it is done
    std::shared_ptr<c10::Event> done;
  };

  Offload mode_;
  c10::Device device_;
  std::vector<FsdpParam*> params_;
  // Note [Gradients committed on demand] (offload.cc): the fp32 gradients of parameters whose
  // gradients land in the compute dtype; pages taken when first written.
  at::Tensor on_demand_grads_;
  std::map<c10::ScalarType, at::Tensor> arenas_;  // 1-D each: shards (host and compute
                                                  // copies) and gradient buffers
  std::optional<c10::Stream> to_host_;            // CUDA only: device->host copies
  std::shared_ptr<c10::Event> to_device_done_;    // CUDA only: the last host->device copies
  std::vector<InFlight> in_flight_;               // CUDA only
  std::map<FsdpParam*, at::Tensor> staging_;      // CUDA only: pinned, the shard's shape
  std::map<FsdpParam*, uint64_t> last_task_;      // p's last task queued, until WaitForCopies
  // StepInOrder: each parameter's update task, until LoadShards or FinishStep waited for it
  // and, with kOptimizer, copied the updated master into its device shard.
  std::map<FsdpParam*, uint64_t> step_task_;
  bool can_delay_ = false;     // Create's `delayed`
  int64_t step_slice_ = 0;     // StepInSlices' elements per slice (FSDP_OFFLOAD_STEP_SLICE)
  bool host_pass_ = true;      // the one loops may run (FSDP_OFFLOAD_HOST_PASS): StepInSlices'
                               // HostStep::run_host_pass, FinishOnHost's HostAddConverted
  at::Tensor add_scratch_;     // the adder's fp32 chunk for AddConvertedInChunks (host_loops.h)
  bool step_delayed_ = false;  // the step in step_task_ was queued delayed
  // The adder (see "Host additions" above); mutex_ guards what follows it.
  std::thread adder_;
  std::mutex mutex_;
  std::condition_variable changed_;  // a task queued or finished, or stop_
  std::deque<HostTask> tasks_;
  uint64_t queued_ = 0;
  uint64_t finished_ = 0;
  bool stop_ = false;
  std::exception_ptr adder_error_;
  int64_t loaded_bytes_ = 0;
  int64_t peak_loaded_bytes_ = 0;
  bool accumulate_on_device_ = false;
  // Note [Deferred gradient conversion]: p -> its term of the clipping norm (ClipNormTerms, on
  // the device), until the step converted it or MaterializeDeferred did; the coefficient
  // ClipDeferred computed, for the host (pinned on CUDA, ready once clip_scale_ready_ is).
  bool defer_conversion_ = false;
  std::map<const FsdpParam*, at::Tensor> deferred_;
  at::Tensor clip_scale_host_;
  std::shared_ptr<c10::Event> clip_scale_ready_;
  bool clipped_ = false;  // ClipDeferred ran since the deferred gradients landed
  // Note [Deferred clipping multiplication]: parameters whose host_grad still waits for
  // clipping's multiplication by clip_scale_host_ (DeferClipMultiply).
  bool defer_clip_multiply_ = false;
  std::set<const FsdpParam*> scale_pending_;
  // The norm's terms the adder computes (each written by its task before Drain returns; the
  // map itself only on the training thread).
  bool final_gradients_ = false;
  std::map<const FsdpParam*, std::shared_ptr<at::Tensor>> clip_terms_;
  Stats stats_;
};

// Adds p's shard and gradient bytes to `bytes` (the shards' gradients as they are now; with
// offload, a gradient sum kept on the device counts as device bytes). A gradient committed on
// demand counts whole as host_untouched: CountResidentBytes moves its written part to host.
void AddModelStateBytes(const FsdpParam& p, ModelStateBytes& bytes);
// Moves what is resident of p's gradient committed on demand (if it has one) from
// bytes.host_untouched to bytes.host. Asks the kernel about every page (mincore): not for
// every step.
void CountResidentBytes(const FsdpParam& p, ModelStateBytes& bytes);

}  // namespace fsdp
