#include "sharding/offload/host_worker.h"

#include <optional>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>
#include <ATen/record_function.h>

#include "sharding/host_loops.h"

namespace fsdp {
namespace {

// The narrow type whose addition into dst HostAddConverted does here (Note [Host loops]): an
// fp32 dst and a bf16 or fp16 src, both contiguous; else nullopt (AddConvertedInChunks).
std::optional<HostNarrow> OneLoopAdd(const at::Tensor& dst, const at::Tensor& src) {
  if (dst.scalar_type() != at::kFloat || !dst.is_cpu() || !src.is_cpu() || !dst.is_contiguous() ||
      !src.is_contiguous() || dst.numel() != src.numel()) {
    return std::nullopt;
  }
  std::optional<HostNarrow> narrow;
  if (src.scalar_type() == at::kBFloat16) narrow = HostNarrow::kBFloat16;
  if (src.scalar_type() == at::kHalf) narrow = HostNarrow::kHalf;
  if (!narrow.has_value() || !HostAddConvertedAvailable(*narrow)) return std::nullopt;
  return narrow;
}

}  // namespace

uint64_t HostWorker::Enqueue(HostTask task) {
  if (!thread_.joinable()) thread_ = std::thread([this] { Run(); });
  uint64_t seq = 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    tasks_.push_back(std::move(task));
    seq = ++queued_;
  }
  changed_.notify_all();
  return seq;
}

void HostWorker::WaitFor(uint64_t seq) {
  std::unique_lock<std::mutex> lock(mutex_);
  changed_.wait(lock, [&] { return finished_ >= seq; });
  if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
}

bool HostWorker::Finished(uint64_t seq) {
  std::lock_guard<std::mutex> lock(mutex_);
  return finished_ >= seq;
}

uint64_t HostWorker::Unfinished(uint64_t seq) {
  std::lock_guard<std::mutex> lock(mutex_);
  return seq > finished_ ? seq - finished_ : 0;
}

void HostWorker::Stop() {
  if (!thread_.joinable()) return;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  changed_.notify_all();
  thread_.join();
}

void HostWorker::Run() {
  at::init_num_threads();  // ATen's intra-op threads, as on the training thread
  at::NoGradGuard no_grad;
  while (true) {
    HostTask task;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      changed_.wait(lock, [&] { return stop_ || !tasks_.empty(); });
      if (stop_) return;
      task = std::move(tasks_.front());
      tasks_.pop_front();
    }
    std::exception_ptr error;
    try {
      Finish(task);
    } catch (...) {
      error = std::current_exception();
    }
    task = HostTask{};  // the buffers' references go before the training thread reuses them
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (error && !error_) error_ = error;
      ++finished_;
    }
    changed_.notify_all();
  }
}

void HostWorker::Finish(const HostTask& task) {
  if (task.job) {
    task.job();
    return;
  }
  if (task.copied) task.copied->synchronize();
  if (!task.dst.defined()) return;  // a deferred gradient's landing (HostOffload::SendToHost)
  RECORD_FUNCTION("fsdp::offload_host_add", std::vector<c10::IValue>());
  PhaseTimer timer(stats_.add_s);
  if (!task.add) {
    task.dst.copy_(task.src);  // exact: a wider float dtype
  } else if (task.src.scalar_type() == task.dst.scalar_type()) {
    task.dst.add_(task.src);
  } else if (std::optional<HostNarrow> narrow = OneLoopAdd(task.dst, task.src);
             host_pass_ && narrow.has_value()) {
    HostAddConverted(task.dst.data_ptr<float>(),
                     static_cast<const uint16_t*>(task.src.const_data_ptr()), *narrow,
                     task.dst.numel());
    ++stats_.host_add_passes;
  } else {
    // The adder's own scratch (only the adder runs tasks), allocated at its first addition.
    if (!add_scratch_.defined()) add_scratch_ = at::empty({scratch_numel_}, task.dst.options());
    AddConvertedInChunks(task.dst, task.src, add_scratch_);
  }
  if (task.add) ++stats_.host_adds;
}

}  // namespace fsdp
