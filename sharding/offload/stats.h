// Internal to sharding/offload/: what CPU offload cost since wrapping (HostOffload::Stats,
// rank_stats' "offload": Note [Rank statistics] in engine/trainer.cc), and the timer that adds
// a phase's wall time to it. Each host phase is also a profiler range, fsdp::offload_<phase>,
// in training.profile traces.
//
//   OffloadStats stats;
//   {
//     PhaseTimer timer(stats.wait_s);  // adds the scope's wall time
//     ...
//   }
#pragma once

#include <chrono>
#include <cstdint>

namespace fsdp {

struct OffloadStats {
  int64_t to_host_bytes = 0;          // gradient shards copied device->host
  int64_t to_host_compute_bytes = 0;  // of which in the compute dtype (kParams, one shard)
  int64_t to_device_bytes = 0;        // parameter shards copied host->device
  int64_t host_adds = 0;              // gradient shards added on the host (accumulation)
  int64_t late_adds = 0;   // host additions, conversions and the norm's terms not done yet when
                           // the end of backward began to wait for them (not hidden)
  double wait_s = 0;       // training thread blocked on copies in flight and on the adder
                           // (fsdp::offload_wait)
  double add_s = 0;        // the adder's additions of gradients, and conversions of
                           // compute-dtype ones into the fp32 .grad (fsdp::offload_host_add)
  double clip_term_s = 0;  // the adder's terms of the clipping norm (Note [Deferred clipping
                           // multiplication]; fsdp::offload_clip_term)
  double push_s = 0;       // issuing the masters' host->device copies (fsdp::offload_push)
  double refresh_s = 0;    // kParams: casting the masters into their compute-dtype copies
                           // (fsdp::offload_refresh; on the adder when overlapped)
  // Overlapped host steps (HostOffload::StepInOrder): the adder's time stepping the groups
  // (refresh included; fsdp::offload_host_step), and the training thread's time blocked waiting
  // for a group's step before loading it (fsdp::offload_step_wait): the part not hidden.
  double host_step_s = 0;
  double step_wait_s = 0;
  int64_t overlapped_steps = 0;  // StepInOrder calls
  // Note [Deferred gradient conversion]: gradients converted, clipped and stepped in one pass
  // by the host step, and those converted apart (MaterializeDeferred, a second gradient).
  int64_t deferred_steps = 0;
  int64_t deferred_materialized = 0;
  // Parameters stepped by the optimizer's one loop (Note [Host Adam pass]): the deferred ones
  // from their bf16 gradient, the others from their fp32 .grad.
  int64_t host_passes = 0;
  // Note [Deferred clipping multiplication]: parameters whose clipping multiplication the step
  // did (in its one loop or just before ATen's step), not the training thread.
  int64_t clip_multiplies_deferred = 0;
  // Of those, the parameters whose term of the norm the adder computed during the backward.
  int64_t clip_terms_on_adder = 0;
  // Of host_adds: the compute-dtype gradients added by one loop (HostAddConverted, Note [Host
  // loops]) instead of ATen's conversion and add_.
  int64_t host_add_passes = 0;
  // Note [Delayed parameter update]: StepInOrder calls with `delayed` (of overlapped_steps).
  int64_t delayed_steps = 0;
};

// Adds the wall time of its scope to `seconds` (a field of OffloadStats).
class PhaseTimer {
 public:
  explicit PhaseTimer(double& seconds)
      : seconds_(seconds), start_(std::chrono::steady_clock::now()) {}
  ~PhaseTimer() {
    seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  }
  PhaseTimer(const PhaseTimer&) = delete;
  PhaseTimer& operator=(const PhaseTimer&) = delete;

 private:
  double& seconds_;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace fsdp
