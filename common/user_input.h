// Values a user types on a command line that need more than ParseInt: a byte size ("64K"),
// and a name that becomes one component of a path the program writes or deletes.
//
//   ParseBinarySize("64K")             -> 65536
//   ParseBinarySize("99999999999G")    -> kInvalidArgument "'99999999999G' is too large ..."
//   SafeFileName("../../etc")          -> ".._.._etc"  (never a path separator, never "..")
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace fsdp {

// "4096", "64K", "16M", "1G" (binary units, either case) -> bytes. kInvalidArgument naming the
// text when it is not such a size, or when the bytes would not fit in an int64.
absl::StatusOr<int64_t> ParseBinarySize(std::string_view text);

// `name` as one file-name component: every character other than ASCII letters, digits, '.',
// '-' and '_' (a '/' above all) becomes '_', and a name of dots only ("", ".", "..") has them
// replaced too, so `folder / SafeFileName(name)` always stays inside `folder`.
std::string SafeFileName(std::string_view name);

}  // namespace fsdp
