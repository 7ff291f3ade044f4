// Counts the ATen operators that run while an OpCounts lives, by name ("aten::add",
// "aten::add_", ...), on every thread: an at::RecordFunction callback, as the profiler's. For
// tests that check which kernels a function launches (an op is one or more launches on CUDA).
// One OpCounts at a time.
//
//   fsdp::testing::OpCounts ops;
//   loss.backward();
//   EXPECT_EQ(ops.Count("aten::add") + ops.Count("aten::add_"), 0);
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include <ATen/record_function.h>
#include <c10/util/Exception.h>

namespace fsdp::testing {

class OpCounts {
 public:
  OpCounts() {
    TORCH_CHECK(active() == nullptr, "OpCounts: one at a time");
    active() = this;
    handle_ = at::addGlobalCallback(
        at::RecordFunctionCallback(&OpCounts::Start).scopes({at::RecordScope::FUNCTION}));
  }
  ~OpCounts() {
    at::removeCallback(handle_);
    active() = nullptr;
  }
  OpCounts(const OpCounts&) = delete;
  OpCounts& operator=(const OpCounts&) = delete;

  int64_t Count(const std::string& name) const {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = counts_.find(name);
    return it == counts_.end() ? 0 : it->second;
  }
  // aten::add and aten::add_ (out-of-place and in-place tensor sums).
  int64_t Adds() const { return Count("aten::add") + Count("aten::add_"); }

 private:
  static OpCounts*& active() {
    static OpCounts* counts = nullptr;
    return counts;
  }
  static std::unique_ptr<at::ObserverContext> Start(const at::RecordFunction& fn) {
    OpCounts* self = active();
    if (self != nullptr) {
      std::lock_guard<std::mutex> lock(self->mutex_);
      ++self->counts_[fn.name()];
    }
    return nullptr;
  }

  at::CallbackHandle handle_;
  mutable std::mutex mutex_;
  std::map<std::string, int64_t> counts_;
};

}  // namespace fsdp::testing
