// Internal to sharding/offload/: the copies between the device and the host buffers of CPU
// offload, and the streams and events that order them.
//
// On CUDA, host->device copies are issued on the current stream, which the caller makes the
// copy-in stream (Note [Copy-in stream], streams.h), so each all-gather issued from that
// stream follows its shard's copy; with one rank (no all-gather) the compute stream waits for
// the copies' event instead (WaitOnCurrentStream). Device->host copies of gradient shards run
// on a stream of their own after an event on the compute stream, into pinned buffers,
// non_blocking; the device gradient is kept alive until its copy is done. On a CPU device
// every copy is synchronous and no event is recorded.
//
// Cross-rank contract: none; every copy is local to the rank.
//
//   Transfers transfers(device, stats);
//   transfers.Load(unit_params);                       // copy-in stream current
//   std::shared_ptr<c10::Event> copied = transfers.CopyToHost(host_buffer, device_grad);
//   transfers.SynchronizeAll();                         // end of backward
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>

#include "sharding/fsdp_param.h"
#include "sharding/offload/stats.h"

namespace fsdp {

class Transfers {
 public:
  Transfers(c10::Device device, OffloadStats& stats);

  // ---- host->device -------------------------------------------------------------------------
  // kOptimizer: copies the masters of `params` (HostShard::shard) into their device shards on
  // the current stream, non_blocking.
  void Push(const std::vector<FsdpParam*>& params);
  // kParams: allocates the device shards of `params` that are not loaded and copies them from
  // the host (the compute-dtype copy when there is one, else the shard) on the current stream.
  void Load(std::vector<FsdpParam>& params);
  // Records that the current stream's host->device copies so far are to be waited for.
  void RecordHostToDevice();
  // Makes the current stream wait for the host->device copies issued so far. No-op on CPU.
  void WaitOnCurrentStream();
  // Blocks until the host->device copies issued so far are done (they read host buffers about
  // to be written).
  void SynchronizeHostToDevice();
  // The last host->device copies' event (CUDA; null before any, and on CPU).
  const std::shared_ptr<c10::Event>& host_to_device_done() const { return to_device_done_; }
  // kParams: forgets the bytes of a device shard freed by the caller.
  void Unloaded(int64_t bytes) { loaded_bytes_ -= bytes; }
  // Most bytes of device shards loaded at once (kParams), since wrapping.
  int64_t peak_loaded_bytes() const { return peak_loaded_bytes_; }

  // ---- device->host (CUDA only) -------------------------------------------------------------
  // Copies `g` (produced on the current stream) into `target` (pinned) on the device->host
  // stream; returns the copy's event. `g` is kept alive until the copy is done and must not
  // change before.
  std::shared_ptr<c10::Event> CopyToHost(const at::Tensor& target, const at::Tensor& g);
  // Blocks until every copy in flight, both ways, is done.
  void SynchronizeAll();
  // The same at destruction: logs instead of throwing (a sticky CUDA error).
  void SynchronizeAtExit();

 private:
  struct InFlight {
    at::Tensor device_source;  // kept alive until the copy reading it is done
    std::shared_ptr<c10::Event> done;
  };
  // Forgets device->host copies that have finished (their device tensors are freed).
  void ReapFinished();

  c10::Device device_;
  OffloadStats& stats_;
  std::optional<c10::Stream> to_host_;          // CUDA only: device->host copies
  std::shared_ptr<c10::Event> to_device_done_;  // CUDA only: the last host->device copies
  std::vector<InFlight> in_flight_;             // CUDA only
  int64_t loaded_bytes_ = 0;
  int64_t peak_loaded_bytes_ = 0;
};

}  // namespace fsdp
