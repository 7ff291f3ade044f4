// CUDA streams for the engine's copies, behind a device-generic interface (c10::Stream and
// c10::Event, no CUDA headers). On CPU every call is a no-op.
//
// Note [Copy-in stream]: the cast-and-copy of a unit's shards into its all-gather input runs on
// a copy-in stream, and the all-gather is issued from it (c10d makes the collective's stream
// wait for the stream it is issued from), so that gathering the next unit overlaps the current
// unit's compute. The gather buffers are allocated on the copy-in stream and read on the
// compute stream by the copy-out. They are not freed right after the copy-out: they go into a
// stash, released only after the copy-in stream has been made to wait for an event recorded on
// the compute stream after the stash (at the next all-gather), so the caching
// allocator never hands their memory to the copy-in stream while the copy-out may still read
// it (the c10d [Sync Streams] discipline, without recordStream).
//
//   DeviceStreams streams(device);
//   streams.BeginCopyIn();            // copy-in waits for compute; old stash released
//   { c10::StreamGuard g(*streams.copy_in()); ... allocate, copy, issue all-gather ... }
//   ... work->wait(); copy out on the compute stream ...
//   streams.Stash({input, output});   // freed once the copy-in stream has passed this point
#pragma once

#include <optional>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>

namespace fsdp {

class DeviceStreams {
 public:
  explicit DeviceStreams(c10::Device device);
  bool enabled() const { return copy_in_.has_value(); }
  // The copy-in stream (CUDA), or nullopt on CPU.
  const std::optional<c10::Stream>& copy_in() const { return copy_in_; }
  // Makes the copy-in stream wait for the compute stream's work so far (the shards may have
  // just been updated by the optimizer) and releases the stashes it has now waited for.
  void BeginCopyIn();
  // Keeps `tensors` alive until the copy-in stream has waited for the compute stream's work
  // queued so far (see Note [Copy-in stream]).
  void Stash(std::vector<at::Tensor> tensors);

 private:
  c10::Device device_;
  std::optional<c10::Stream> copy_in_;
  // Stashed tensors, in the order stashed: all of them were queued on the compute stream
  // before the event BeginCopyIn records there, which covers every one of them.
  std::vector<std::vector<at::Tensor>> pending_;
};

}  // namespace fsdp
