#include "sharding/streams.h"

#include <c10/core/impl/DeviceGuardImplInterface.h>

namespace fsdp {

DeviceStreams::DeviceStreams(c10::Device device) : device_(device) {
  if (device.is_cuda()) {
    copy_in_ = c10::impl::getDeviceGuardImpl(device.type())->getStreamFromGlobalPool(device);
  }
}

void DeviceStreams::BeginCopyIn() {
  if (!enabled()) return;
  const auto* impl = c10::impl::getDeviceGuardImpl(device_.type());
  c10::Stream compute = impl->getStream(device_);
  c10::Event compute_done(device_.type());
  compute_done.record(compute);
  compute_done.block(*copy_in_);
  // Every stash was recorded on the compute stream before compute_done: the copy-in stream now
  // waits for all of them, so their memory may be reused on it.
  pending_.clear();
}

void DeviceStreams::Stash(std::vector<at::Tensor> tensors) {
  if (!enabled()) return;
  pending_.push_back(std::move(tensors));
}

}  // namespace fsdp
