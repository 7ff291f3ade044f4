// Turning exceptions thrown by libtorch (c10::Error and its Dist* subclasses) into absl::Status
// at the boundary of a function that takes user input. No c10::Error escapes such a function.
//
//   absl::Status s = CallTorch("connecting to the store at host:29500", [&] { ... });
//   // kDeadlineExceeded for timeouts, kUnavailable for network errors and a peer that closed
//   // its connection (it ended), kResourceExhausted of FailureClass::kOutOfMemory for a failed
//   // allocation (device or host) or a tensor too large to size, else kInternal;
//   // the message is "<what>: <libtorch's first line>".
#pragma once

#include <exception>
#include <string_view>
#include <utility>

#include "absl/status/status.h"

namespace fsdp {

absl::Status StatusFromException(std::string_view what, const std::exception& e);

template <typename F>
absl::Status CallTorch(std::string_view what, F&& f) {
  try {
    std::forward<F>(f)();
  } catch (const std::exception& e) {
    return StatusFromException(what, e);
  }
  return absl::OkStatus();
}

}  // namespace fsdp
