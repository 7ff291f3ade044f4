#include "common/logging.h"

#include <memory>
#include <optional>
#include <string>

#include <spdlog/sinks/stdout_sinks.h>

#include "common/env_knobs.h"

namespace fsdp {
namespace {

std::string Pattern(int rank) {
  std::string who = rank >= 0 ? " rank " + std::to_string(rank) : "";
  return "[fsdp %H:%M:%S.%e" + who + " %L] %v";
}

std::shared_ptr<spdlog::logger> MakeLogger() {
  auto logger = std::make_shared<spdlog::logger>(
      "fsdp", std::make_shared<spdlog::sinks::stderr_sink_mt>());
  logger->set_pattern(Pattern(-1));
  std::optional<std::string> level = GetEnvKnob(kLogLevel);
  logger->set_level(level ? spdlog::level::from_str(*level) : spdlog::level::info);
  logger->flush_on(spdlog::level::trace);
  return logger;
}

}  // namespace

spdlog::logger& Logger() {
  static std::shared_ptr<spdlog::logger> logger = MakeLogger();
  return *logger;
}

void SetLogRank(int rank) { Logger().set_pattern(Pattern(rank)); }

}  // namespace fsdp
