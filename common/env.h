// Reading launcher environment variables with errors that name the variable.
//
// Everything takes an EnvLookup so that tests can feed a map instead of the process
// environment:
//
//   EnvLookup env = ProcessEnv();
//   absl::StatusOr<int> rank = GetIntEnv(env, "RANK");         // error if missing/not an int
//   absl::StatusOr<std::optional<int>> lr = GetOptionalIntEnv(env, "LOCAL_RANK");
#pragma once

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace fsdp {

// Returns the value of a variable, or nullopt when it is unset. Empty values count as unset.
using EnvLookup = std::function<std::optional<std::string>(std::string_view name)>;

// The real process environment (getenv).
EnvLookup ProcessEnv();

// This machine's host name (gethostname), or "unknown-host".
std::string HostName();
// A fixed map, for tests.
EnvLookup MapEnv(std::map<std::string, std::string> vars);

// A required integer variable. kInvalidArgument names the variable when it is missing, is not a
// base-10 integer, or lies outside [min_value, max_value].
absl::StatusOr<int> GetIntEnv(const EnvLookup& env, std::string_view name, int min_value = 0,
                              int max_value = 1 << 30);
// Same, but an unset variable is nullopt rather than an error.
absl::StatusOr<std::optional<int>> GetOptionalIntEnv(const EnvLookup& env,
                                                     std::string_view name, int min_value = 0,
                                                     int max_value = 1 << 30);

}  // namespace fsdp
