#include "sharding/offload/transfers.h"

#include <algorithm>
#include <exception>
#include <utility>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include "common/logging.h"
#include "sharding/offload/host_buffers.h"

namespace fsdp {

Transfers::Transfers(c10::Device device, OffloadStats& stats) : device_(device), stats_(stats) {
  if (device.is_cuda()) {
    const auto* impl = c10::impl::getDeviceGuardImpl(device.type());
    to_host_ = impl->getStreamFromGlobalPool(device);
  }
}

void Transfers::Push(const std::vector<FsdpParam*>& params) {
  if (params.empty()) return;
  at::NoGradGuard no_grad;
  for (FsdpParam* p : params) {
    p->padded_shard.copy_(p->host->shard, /*non_blocking=*/true);
    stats_.to_device_bytes += p->padded_shard.nbytes();
  }
  RecordHostToDevice();
}

void Transfers::Load(std::vector<FsdpParam>& params) {
  at::NoGradGuard no_grad;
  bool issued = false;
  for (FsdpParam& p : params) {
    if (p.padded_shard.defined()) continue;  // loaded ahead (prefetch)
    // See Note [CPU offload]: the compute-dtype copy when there is one.
    const at::Tensor& source =
        p.host->compute_shard.defined() ? p.host->compute_shard : p.host->shard;
    p.padded_shard = at::empty(source.sizes(), source.options().device(device_));
    p.padded_shard.copy_(source, /*non_blocking=*/true);
    loaded_bytes_ += p.padded_shard.nbytes();
    stats_.to_device_bytes += p.padded_shard.nbytes();
    issued = true;
  }
  peak_loaded_bytes_ = std::max(peak_loaded_bytes_, loaded_bytes_);
  if (issued) RecordHostToDevice();
}

void Transfers::RecordHostToDevice() {
  if (!device_.is_cuda()) return;
  const auto* impl = c10::impl::getDeviceGuardImpl(device_.type());
  to_device_done_ = std::make_shared<c10::Event>(device_.type());
  to_device_done_->record(impl->getStream(device_));
}

void Transfers::WaitOnCurrentStream() {
  if (!to_device_done_) return;
  const auto* impl = c10::impl::getDeviceGuardImpl(device_.type());
  to_device_done_->block(impl->getStream(device_));
}

void Transfers::SynchronizeHostToDevice() {
  if (to_device_done_) to_device_done_->synchronize();
}

void Transfers::ReapFinished() {
  std::vector<InFlight> still;
  for (InFlight& f : in_flight_) {
    if (!f.done->query()) still.push_back(std::move(f));
  }
  in_flight_ = std::move(still);
}

std::shared_ptr<c10::Event> Transfers::CopyToHost(const at::Tensor& target, const at::Tensor& g) {
  ReapFinished();
  const auto* impl = c10::impl::getDeviceGuardImpl(device_.type());
  c10::Event produced(device_.type());
  produced.record(impl->getStream(device_));  // the compute stream made `g`
  produced.block(*to_host_);
  c10::StreamGuard on_to_host(*to_host_);
  target.copy_(g, /*non_blocking=*/true);
  auto copied = std::make_shared<c10::Event>(device_.type());
  copied->record(*to_host_);
  in_flight_.push_back(InFlight{g, copied});
  return copied;
}

void Transfers::SynchronizeAll() {
  for (InFlight& f : in_flight_) f.done->synchronize();
  in_flight_.clear();
  SynchronizeHostToDevice();
}

void Transfers::SynchronizeAtExit() {
  // Copies may still read or write the host buffers (a run that stopped mid-backward).
  try {
    for (InFlight& f : in_flight_) f.done->synchronize();
    SynchronizeHostToDevice();
  } catch (const std::exception& e) {
    // A sticky CUDA error: the device runs nothing more, so no copy still touches the buffers.
    // The error is the training thread's to report; a destructor must not throw it.
    FSDP_LOG_WARN("offload: waiting for the host copies at exit failed: {}", e.what());
  }
}

}  // namespace fsdp
