// Internal to sharding/offload/: the adder, CPU offload's host thread. What the host does with a
// gradient once it landed (an addition into the .grad, or a conversion into the fp32 buffer),
// the norm's terms and the overlapped step's groups run on it, in the order they were queued,
// so that they overlap the rest of the backward and the next micro-batch's forward instead of
// stalling the training thread. One thread: a parameter's additions keep their order (micro-
// batch by micro-batch), so the sums are those of the run without offload, bit for bit. On
// CUDA a task first waits for its copy's event. The training thread waits for a task only where
// it must (Note [CPU offload], "Host additions", host_offload.h).
//
// Cross-rank contract: none; local to the rank.
//
//   HostWorker worker(stats, /*host_pass=*/true, /*scratch_numel=*/1 << 22);
//   uint64_t seq = worker.Enqueue({.dst = fp32_grad, .src = landed, .add = true});
//   worker.WaitFor(seq);  // rethrows the task's error
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include <ATen/core/Tensor.h>
#include <c10/core/Event.h>

#include "sharding/offload/stats.h"

namespace fsdp {

// The host's part of a gradient sent to it, or a job.
struct HostTask {
  at::Tensor dst;   // the fp32 .grad (HostShard::grad); undefined: a landing only
  at::Tensor src;   // where the gradient landed: HostShard::staging or compute_grad (CPU
                    // device: the device gradient itself for an fp32 addition)
  bool add = true;  // dst += src (converted when narrower), else dst = src
  std::shared_ptr<c10::Event> copied;  // CUDA: the copy into src; null on a CPU device
  std::function<void()> job;           // set: run this instead (a group's host step, a term)
};

class HostWorker {
 public:
  // `host_pass`: a narrower gradient's addition may run as one loop (HostAddConverted, Note
  // [Host loops]); `scratch_numel`: the fp32 chunk of AddConvertedInChunks otherwise.
  HostWorker(OffloadStats& stats, bool host_pass, int64_t scratch_numel)
      : stats_(stats), host_pass_(host_pass), scratch_numel_(scratch_numel) {}
  ~HostWorker() { Stop(); }
  HostWorker(const HostWorker&) = delete;
  HostWorker& operator=(const HostWorker&) = delete;

  // Queues `task` (starting the thread the first time); returns its number (1-based).
  uint64_t Enqueue(HostTask task);
  // Blocks until the `seq`-th task finished; rethrows the first error of any task (once).
  void WaitFor(uint64_t seq);
  // Whether the `seq`-th task finished (no wait, no rethrow).
  bool Finished(uint64_t seq);
  // How many of the tasks up to the `seq`-th have not finished yet.
  uint64_t Unfinished(uint64_t seq);
  // Stops the thread after its current task; what is still queued is dropped (a run that
  // stopped mid-backward: the gradients are not read any more).
  void Stop();

 private:
  void Run();
  void Finish(const HostTask& task);

  OffloadStats& stats_;
  const bool host_pass_;
  const int64_t scratch_numel_;
  at::Tensor add_scratch_;  // fp32, for AddConvertedInChunks; allocated at the first addition
  std::thread thread_;
  std::mutex mutex_;                 // guards what follows
  std::condition_variable changed_;  // a task queued or finished, or stop_
  std::deque<HostTask> tasks_;
  uint64_t queued_ = 0;
  uint64_t finished_ = 0;
  bool stop_ = false;
  std::exception_ptr error_;
};

}  // namespace fsdp
