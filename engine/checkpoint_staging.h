// CheckpointStaging: the host copy of a rank's checkpoint state that a save writes from, in
// buffers kept across saves. Device (CUDA) tensors go to page-locked buffers by non_blocking
// copies on a side stream, so the training loop waits only for issuing them; host tensors
// (CPU runs, offloaded masters) are copied right away into reused plain buffers.
//
// Contract (Note [Checkpoint staging]): a snapshot is Begin, Stage for each tensor, End; the
// returned StagedCopies must be waited (Wait) before the host buffers are read, and before the
// next Begin, which reuses the buffers. Not thread-safe: one owner (the Checkpointer) calls
// Begin/Stage/End on the training thread; Wait may run on the writer thread.
//
//   CheckpointStaging staging;
//   staging.Begin();
//   at::Tensor host = staging.Stage("model/w", shard);   // not to be read yet
//   StagedCopies copies = staging.End();                 // the loop goes on from here
//   ... on the writer thread: copies.Wait(); write `host` ...
// Reserve, between snapshots, allocates a key's buffer ahead of its first Stage (at start-up,
// so that the first save does not page-lock memory inside the training loop).
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>

namespace fsdp {

// The device->host copies of one snapshot: done when Wait returns.
class StagedCopies {
 public:
  StagedCopies() = default;
  StagedCopies(StagedCopies&&) = default;
  StagedCopies& operator=(StagedCopies&&) = default;
  ~StagedCopies();  // waits, if nobody did: the copies write into buffers that may be freed
  // Blocks until every copy of the snapshot has landed in host memory; releases the stash of
  // device tensors they read. Idempotent.
  void Wait();

 private:
  friend class CheckpointStaging;
  std::optional<c10::Event> copied_;  // recorded on the side stream after the last copy
  std::vector<at::Tensor> sources_;   // the device tensors read: alive until the copies end
  std::shared_ptr<std::atomic<bool>> waited_;  // shared with the staging (Begin checks it)
};

class CheckpointStaging {
 public:
  CheckpointStaging() = default;
  CheckpointStaging(const CheckpointStaging&) = delete;
  CheckpointStaging& operator=(const CheckpointStaging&) = delete;

  // Starts a snapshot. The previous snapshot's copies must have been waited for (checked).
  void Begin();
  // The host tensor that will hold `src`'s values (same sizes and dtype, contiguous): the
  // buffer `key` had in the previous snapshot when its sizes, dtype and kind (pinned for a
  // device source, plain for a host one) are the same, else a new one. A host `src` is copied
  // now; a device one by a non_blocking copy on the side stream (after the current stream's
  // work so far), complete only after the StagedCopies' Wait.
  at::Tensor Stage(const std::string& key, const at::Tensor& src);
  // Outside a snapshot: allocates now the buffer a later Stage(key, t) claims for a `t` of
  // `like`'s sizes, dtype and kind (device: pinned, page-locked now; host: plain, its pages
  // touched now), unless `key` holds one that fits already. Returns the bytes allocated.
  // The buffers reserved and not staged by the next snapshot are freed at its End.
  int64_t Reserve(const std::string& key, const at::Tensor& like);
  // Ends the snapshot: the current stream waits (on the device, no host sync) for the copies,
  // so later work on it may write the tensors staged; buffers of keys not staged this time are
  // freed.
  StagedCopies End();

  // Host bytes the buffers hold, and how many of them the last snapshot allocated (0 when
  // every buffer was reused); pinned: page-locked ones.
  int64_t held_bytes() const { return HeldBytes(/*pinned_only=*/false); }
  int64_t held_pinned_bytes() const { return HeldBytes(/*pinned_only=*/true); }
  int64_t last_allocated_bytes() const { return last_allocated_bytes_; }
  int64_t last_allocated_pinned_bytes() const { return last_allocated_pinned_bytes_; }

 private:
  struct Buffer {
    at::Tensor host;  // contiguous, src's sizes and dtype
    bool pinned = false;
  };
  Buffer Allocate(const at::Tensor& src, bool pinned);
  int64_t HeldBytes(bool pinned_only) const;
  // Whether `b` can hold a copy of `src`: same sizes and dtype, pinned if `src` is on a device.
  static bool Fits(const Buffer& b, const at::Tensor& src);

  std::map<std::string, Buffer> buffers_;   // this snapshot's, by key
  std::map<std::string, Buffer> previous_;  // the last snapshot's, not yet claimed by Stage
  std::optional<c10::Stream> side_;         // CUDA: the device->host copy stream
  std::optional<c10::Event> copied_;        // this snapshot's copies (recorded in End)
  std::vector<at::Tensor> sources_;
  bool side_waited_ = false;  // this snapshot's side stream waited for the current stream
  bool in_snapshot_ = false;
  std::shared_ptr<std::atomic<bool>> last_waited_;  // the previous snapshot's StagedCopies
  int64_t last_allocated_bytes_ = 0;
  int64_t last_allocated_pinned_bytes_ = 0;
  bool warned_unpinned_ = false;
};

}  // namespace fsdp
