#include "device_mesh/torch_status.h"
#include "common/failure.h"
#include "common/strings.h"

#include <string>

#include <c10/util/Exception.h>


namespace fsdp {

absl::Status StatusFromException(std::string_view what, const std::exception& e) {
  // c10::Error::what() appends a C++ backtrace; the first message line is what users need.
  std::string message;
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e)) {
    message = c10_error->msg();
  } else {
    message = e.what();
  }
  if (size_t cut = message.find("\nException raised from"); cut != std::string::npos) {
    message.resize(cut);
  }
  while (!message.empty() && (message.back() == '\n' || message.back() == ' ')) message.pop_back();
  std::string text = StrCat(what, ": ", message);
  // An allocation that failed (CUDA's caching allocator, the CPU allocator) or a tensor too large
  // to size: the run does not fit, not a bug (Note [Exit codes]: 8).
  if (dynamic_cast<const c10::OutOfMemoryError*>(&e) != nullptr ||
      ContainsIgnoreCase(message, "out of memory") ||
      ContainsIgnoreCase(message, "can't allocate memory") ||
      ContainsIgnoreCase(message, "Storage size calculation overflowed")) {
    return WithFailureClass(absl::ResourceExhaustedError(text), FailureClass::kOutOfMemory);
  }
  if (ContainsIgnoreCase(message, "timed out") ||
      ContainsIgnoreCase(message, "timeout")) {
    return absl::DeadlineExceededError(text);
  }
  // A peer process that ended (or its node): Gloo reports the closed connection.
  if (dynamic_cast<const c10::DistNetworkError*>(&e) != nullptr ||
      ContainsIgnoreCase(message, "connection closed by peer") ||
      ContainsIgnoreCase(message, "connection reset by peer") ||
      ContainsIgnoreCase(message, "broken pipe")) {
    return absl::UnavailableError(text);
  }
  return absl::InternalError(text);
}

}  // namespace fsdp
