// String helpers on std::string_view. (Debian's Abseil is built with its own
// absl::string_view, not std::string_view, so the project does not use absl's string functions;
// fmt does the formatting.)
//
//   StrCat("rank ", 3, " of ", 4)              -> "rank 3 of 4"
//   StrJoin(std::vector<int>{0, 2}, ", ")      -> "0, 2"
//   Split("a, b,,c", ",")                      -> {"a", " b", "", "c"}
//   ParseInt(" 42") -> nullopt (no whitespace), ParseInt("-1") -> -1
#pragma once

#include <charconv>
#include <iterator>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace fsdp {

template <typename... Args>
std::string StrCat(const Args&... args) {
  std::string out;
  (fmt::format_to(std::back_inserter(out), "{}", args), ...);
  return out;
}

template <typename Range>
std::string StrJoin(const Range& range, std::string_view sep) {
  return fmt::format("{}", fmt::join(range, sep));
}

// Splits at any of the characters in `separators`; keeps empty pieces.
inline std::vector<std::string_view> Split(std::string_view s, std::string_view separators) {
  std::vector<std::string_view> pieces;
  size_t start = 0;
  while (true) {
    size_t pos = s.find_first_of(separators, start);
    if (pos == std::string_view::npos) {
      pieces.push_back(s.substr(start));
      return pieces;
    }
    pieces.push_back(s.substr(start, pos - start));
    start = pos + 1;
  }
}

inline std::string_view Strip(std::string_view s) {
  const char* ws = " \t\r\n";
  size_t begin = s.find_first_not_of(ws);
  if (begin == std::string_view::npos) return {};
  size_t end = s.find_last_not_of(ws);
  return s.substr(begin, end - begin + 1);
}

inline bool StartsWith(std::string_view s, std::string_view prefix) {
  return s.substr(0, prefix.size()) == prefix;
}

// A whole base-10 integer, or nullopt (no sign other than '-', no spaces, no trailing text).
template <typename Int = int>
std::optional<Int> ParseInt(std::string_view s) {
  Int value{};
  auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), value);
  if (ec != std::errc() || ptr != s.data() + s.size() || s.empty()) return std::nullopt;
  return value;
}

std::string ToLower(std::string_view s);
bool ContainsIgnoreCase(std::string_view haystack, std::string_view needle);
// One CSV field (RFC 4180): as is, or in double quotes (inner quotes doubled) when it holds a
// comma, a quote or a line break, so that a user's text (a run.name) keeps the columns.
std::string CsvField(std::string_view s);

}  // namespace fsdp
