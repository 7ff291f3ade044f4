#include "engine/checkpoint_staging.h"

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include "common/logging.h"
#include "device_mesh/cuda_support.h"

namespace fsdp {

// Note [Checkpoint staging]
// An async save must take a snapshot of the state of step N (the shards and the optimizer's
// tensors) while the loop goes on to step N+1. A pageable device->host copy blocks the host
// for the whole transfer (1.2 s for gpt_125m's 1.5 GB on an H100, ../shared/GPU.md). So, as
// torch.distributed.checkpoint's pinned staging cache does:
//  - host buffers are page-locked (cudaHostAlloc, exactly the size: AllocatePinnedHost),
//    allocated by the first save and reused by every later one (a buffer whose tensor changed
//    sizes or dtype is allocated again; one whose key is gone is freed);
//  - the copies are non_blocking on a side stream S, and Save returns once they are issued.
// Ordering, with C the current (compute) stream on which the loop runs the optimizer:
//  1. What is read is step N's state: Save runs after step N's update was issued on C (no host
//     sync in the step). Before its first copy, S waits for an event recorded on C: every copy
//     runs after that update.
//  2. Nothing overwrites a tensor before it is read: End records `copied` on S after the last
//     copy and makes C wait for it (cudaStreamWaitEvent, no host sync). Everything the loop
//     issues on C after Save returns (step N+1's forward, backward and optimizer update, the
//     only writer of the saved tensors) runs after the copies. The other streams of the engine
//     only read the shards (the copy-in stream, the collectives) or write what is not saved
//     (offload's gradient copies); offloaded masters are host tensors, copied synchronously.
//     The cost is device time, not host time: C starts step N+1 once the copies are done (the
//     transfer at pinned bandwidth); waiting only before the next optimizer update would let
//     forward and backward overlap it, at the price of a hook in the step.
//  3. The device tensors read stay alive until the copies end: StagedCopies keeps them (the
//     stash, released by Wait), and any memory C frees and reuses is reused after `copied`.
//  4. The writer reads the buffers only after StagedCopies::Wait (cudaEventSynchronize).
//  5. The next save's copies overwrite the buffers: the Checkpointer starts a save only after
//     the previous one's writer has finished (Note [One save per step]: one save in flight),
//     and Begin checks that the previous snapshot was waited for.
//  6. Non-finite state is gated before Save is called (Note [Non-finite state is never
//     saved], trainer.cc), unchanged: the flag read is a host sync of its own.
// The price is host memory: one copy of the rank's saved state, pinned, for the whole run
// (host tensors: one plain copy with async saves; a synchronous save writes them in place,
// Checkpointer::WritesInPlace). Page-locking it is slow (the kernel maps
// and pins every page: a large fraction of a second per GB), so the trainer reserves the
// buffers at start-up (Reserve, through Checkpointer::ReserveStaging), shaped after the shards
// and the optimizer state they will hold, and the first save blocks the loop no longer than
// later ones. A buffer the first save did not find reserved (a shape the reservation did not
// foresee) is allocated then, which that save's log line shows.

StagedCopies::~StagedCopies() {
  try {
    Wait();
  } catch (const std::exception& e) {
    // A sticky CUDA error (a kernel that faulted, an aborted communicator): the training
    // thread reports it; a destructor must not throw it.
    FSDP_LOG_WARN("checkpoint staging: waiting for the device->host copies failed: {}",
                  e.what());
  }
}

void StagedCopies::Wait() {
  if (copied_) {
    // Wait runs on the checkpoint writer's thread, whose current device is 0 unless set: the
    // event is waited for and destroyed under its own device, or c10 would create a context
    // on GPU 0 for every rank of the node (destroying an event restores the device it found).
    c10::DeviceGuard on_device(copied_->device());
    c10::Event copied = std::move(*copied_);
    copied_.reset();  // a second Wait (the destructor's, after an error) does not wait again
    copied.synchronize();
  }
  sources_.clear();
  if (waited_) waited_->store(true);
}

void CheckpointStaging::Begin() {
  if (in_snapshot_) End().Wait();  // a snapshot abandoned by an exception: let its copies end
  TORCH_CHECK(last_waited_ == nullptr || last_waited_->load(),
              "checkpoint staging: a save began while the previous save's device->host copies "
              "were not waited for (its writer still reads the buffers)");
  in_snapshot_ = true;
  side_waited_ = false;
  previous_ = std::move(buffers_);
  buffers_.clear();
  sources_.clear();
  last_allocated_bytes_ = 0;
  last_allocated_pinned_bytes_ = 0;
}

CheckpointStaging::Buffer CheckpointStaging::Allocate(const at::Tensor& src, bool pinned) {
  at::TensorOptions opts = at::TensorOptions().dtype(src.scalar_type()).device(c10::kCPU);
  const int64_t bytes = src.numel() * static_cast<int64_t>(src.element_size());
  Buffer b;
  if (pinned) {
    absl::StatusOr<c10::DataPtr> memory = AllocatePinnedHost(static_cast<size_t>(bytes));
    if (memory.ok()) {
      c10::Storage storage(c10::Storage::use_byte_size_t(), bytes, *std::move(memory),
                           /*allocator=*/nullptr, /*resizable=*/false);
      b.host = at::empty({0}, opts);
      b.host.set_(std::move(storage), 0, src.sizes(), c10::contiguous_strides(src.sizes()));
      b.pinned = true;
    } else if (!warned_unpinned_) {
      // Still correct (the copy then blocks the host for the transfer), only slower.
      FSDP_LOG_WARN(
          "checkpoint staging: pinned host memory unavailable ({}); staging in "
          "pageable memory, the loop waits for the device->host copies",
          std::string(memory.status().message()));
      warned_unpinned_ = true;
    }
  }
  if (!b.host.defined()) b.host = at::empty(src.sizes(), opts);
  return b;
}

bool CheckpointStaging::Fits(const Buffer& b, const at::Tensor& src) {
  return b.host.sizes() == src.sizes() && b.host.scalar_type() == src.scalar_type() &&
         (b.pinned || src.is_cpu());
}

int64_t CheckpointStaging::Reserve(const std::string& key, const at::Tensor& like) {
  TORCH_INTERNAL_ASSERT(!in_snapshot_, "CheckpointStaging::Reserve inside a snapshot");
  auto it = buffers_.find(key);
  if (it != buffers_.end() && Fits(it->second, like)) return 0;
  Buffer buffer = Allocate(like, /*pinned=*/!like.is_cpu());
  // Plain memory is mapped by the first write: make it now, not in the first save's copy
  // (page-locked memory is resident already).
  if (!buffer.pinned) buffer.host.zero_();
  const int64_t bytes = static_cast<int64_t>(buffer.host.nbytes());
  buffers_[key] = std::move(buffer);
  return bytes;
}

at::Tensor CheckpointStaging::Stage(const std::string& key, const at::Tensor& src) {
  TORCH_INTERNAL_ASSERT(in_snapshot_, "CheckpointStaging::Stage outside Begin/End");
  const bool on_device = !src.is_cpu();
  auto it = previous_.find(key);
  Buffer buffer;
  if (it != previous_.end() && Fits(it->second, src)) {
    buffer = std::move(it->second);
    previous_.erase(it);
  } else {
    buffer = Allocate(src, /*pinned=*/on_device);
    last_allocated_bytes_ += static_cast<int64_t>(buffer.host.nbytes());
    if (buffer.pinned) last_allocated_pinned_bytes_ += static_cast<int64_t>(buffer.host.nbytes());
  }
  at::Tensor host = buffer.host;
  buffers_[key] = std::move(buffer);
  if (!on_device) {
    host.copy_(src);
    return host;
  }
  const c10::Device device = src.device();
  const auto* impl = c10::impl::getDeviceGuardImpl(device.type());
  if (!side_) side_ = impl->getStreamFromGlobalPool(device);
  TORCH_CHECK(side_->device() == device, "checkpoint staging: tensors on ", side_->device(),
              " and ", device, " in one rank's checkpoint");
  if (!side_waited_) {  // point 1 of the Note
    c10::Event updated(device.type());
    updated.record(impl->getStream(device));
    updated.block(*side_);
    side_waited_ = true;
  }
  {
    c10::StreamGuard on_side(*side_);
    host.copy_(src, /*non_blocking=*/true);
  }
  sources_.push_back(src);
  return host;
}

StagedCopies CheckpointStaging::End() {
  TORCH_INTERNAL_ASSERT(in_snapshot_, "CheckpointStaging::End without Begin");
  in_snapshot_ = false;
  previous_.clear();  // keys not staged this time (Note: nothing reads them any more)
  StagedCopies copies;
  copies.waited_ = std::make_shared<std::atomic<bool>>(false);
  last_waited_ = copies.waited_;
  if (side_waited_) {  // point 2 of the Note
    const c10::Device device = side_->device();
    const auto* impl = c10::impl::getDeviceGuardImpl(device.type());
    copies.copied_.emplace(device.type());
    copies.copied_->record(*side_);
    copies.copied_->block(impl->getStream(device));
    copies.sources_ = std::move(sources_);
  }
  sources_.clear();
  return copies;
}

int64_t CheckpointStaging::HeldBytes(bool pinned_only) const {
  int64_t n = 0;
  for (const auto& [key, b] : buffers_) {
    if (b.pinned || !pinned_only) n += static_cast<int64_t>(b.host.nbytes());
  }
  return n;
}

}  // namespace fsdp
