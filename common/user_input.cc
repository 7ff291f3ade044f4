#include "common/user_input.h"

#include <limits>

#include "common/strings.h"

namespace fsdp {

absl::StatusOr<int64_t> ParseBinarySize(std::string_view text) {
  std::string_view digits = text;
  int shift = 0;
  if (!digits.empty()) {
    switch (digits.back()) {
      case 'K':
      case 'k':
        shift = 10;
        break;
      case 'M':
      case 'm':
        shift = 20;
        break;
      case 'G':
      case 'g':
        shift = 30;
        break;
    }
    if (shift > 0) digits.remove_suffix(1);
  }
  const bool all_digits =
      !digits.empty() && digits.find_first_not_of("0123456789") == std::string_view::npos;
  if (!all_digits) {
    return absl::InvalidArgumentError(
        StrCat("'", text, "' is not a size like 4096, 64K, 16M or 1G"));
  }
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  std::optional<int64_t> value = ParseInt<int64_t>(digits);  // nullopt: more than kMax
  if (!value || *value > (kMax >> shift)) {
    return absl::InvalidArgumentError(
        StrCat("'", text, "' is too large (at most ", kMax >> 30, "G)"));
  }
  return *value << shift;
}

std::string SafeFileName(std::string_view name) {
  std::string out(name);
  for (char& c : out) {
    const bool keep = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                      c == '.' || c == '-' || c == '_';
    if (!keep) c = '_';
  }
  if (out.find_first_not_of('.') == std::string::npos) out = std::string(out.size() + 1, '_');
  return out;
}

}  // namespace fsdp
