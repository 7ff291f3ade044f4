#include "common/env.h"
#include "common/strings.h"

#include <unistd.h>

#include <cstdlib>


namespace fsdp {

EnvLookup ProcessEnv() {
  return [](std::string_view name) -> std::optional<std::string> {
    const char* value = std::getenv(std::string(name).c_str());
    if (value == nullptr || *value == '\0') return std::nullopt;
    return std::string(value);
  };
}

EnvLookup MapEnv(std::map<std::string, std::string> vars) {
  return [vars = std::move(vars)](std::string_view name) -> std::optional<std::string> {
    auto it = vars.find(std::string(name));
    if (it == vars.end() || it->second.empty()) return std::nullopt;
    return it->second;
  };
}

absl::StatusOr<std::optional<int>> GetOptionalIntEnv(const EnvLookup& env,
                                                     std::string_view name, int min_value,
                                                     int max_value) {
  std::optional<std::string> raw = env(name);
  if (!raw) return std::optional<int>();
  std::optional<int> parsed = ParseInt(Strip(*raw));
  if (!parsed) {
    return absl::InvalidArgumentError(
        StrCat("environment variable ", name, "='", *raw, "' is not an integer"));
  }
  int value = *parsed;
  if (value < min_value || value > max_value) {
    return absl::InvalidArgumentError(StrCat("environment variable ", name, "=", value,
                                                   " is out of range; valid: ", min_value,
                                                   "..", max_value));
  }
  return std::optional<int>(value);
}

absl::StatusOr<int> GetIntEnv(const EnvLookup& env, std::string_view name, int min_value,
                              int max_value) {
  absl::StatusOr<std::optional<int>> value = GetOptionalIntEnv(env, name, min_value, max_value);
  if (!value.ok()) return value.status();
  if (!value->has_value()) {
    return absl::InvalidArgumentError(StrCat("environment variable ", name, " is not set"));
  }
  return **value;
}

std::string HostName() {
  char buf[256] = {0};
  if (gethostname(buf, sizeof(buf) - 1) != 0) return "unknown-host";
  return buf;
}

}  // namespace fsdp
