// Checks for the fsdp command line's integer options, with messages that name what is valid.
// CLI11's own CLI::PositiveNumber / NonNegativeNumber print "Value 0 not in range 0.000000 to
// 1797693134862315708145..." and say "not in range" for "abc" too.
//
//   cmd->add_option("--nproc-per-node", n, "Ranks")->check(IntAtLeast(1));
//   // fsdp launch --nproc-per-node 0   -> "--nproc-per-node: must be >= 1, got 0"
//   // fsdp launch --nproc-per-node abc
//   //   -> "--nproc-per-node: 'abc' is not an integer (must be >= 1)"
//
// CLI11 runs checks on the text before converting it, so the option's variable is only set
// from text that passed. How the error reaches the user: see main.cc (exit code 2).
#pragma once

#include <limits>
#include <optional>
#include <string>

#include <CLI/CLI.hpp>

#include "common/strings.h"

namespace fsdp {

// An integer of type Int in [min, max]. The description shown in --help: POSITIVE (min 1),
// NONNEGATIVE (min 0) or MIN..MAX.
template <typename Int = int>
CLI::Validator IntInRange(Int min, Int max = std::numeric_limits<Int>::max()) {
  const bool unbounded = max == std::numeric_limits<Int>::max();
  const std::string valid = unbounded ? StrCat(">= ", min) : StrCat("in ", min, "..", max);
  std::string description = StrCat(min, "..", max);
  if (unbounded && min == 0) description = "NONNEGATIVE";
  if (unbounded && min == 1) description = "POSITIVE";
  return CLI::Validator(
      [min, max, valid](std::string& text) -> std::string {
        std::optional<Int> value = ParseInt<Int>(text);
        if (!value) {
          const std::string_view digits =
              StartsWith(text, "-") ? std::string_view(text).substr(1) : std::string_view(text);
          const bool integer =
              !digits.empty() && digits.find_first_not_of("0123456789") == std::string_view::npos;
          return integer ? StrCat("'", text, "' is out of range (must be in ", min, "..", max, ")")
                         : StrCat("'", text, "' is not an integer (must be ", valid, ")");
        }
        if (*value < min || *value > max) return StrCat("must be ", valid, ", got ", text);
        return std::string();
      },
      description);
}

template <typename Int = int>
CLI::Validator IntAtLeast(Int min) {
  return IntInRange<Int>(min);
}

}  // namespace fsdp
