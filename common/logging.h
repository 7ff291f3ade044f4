// Rank-prefixed logging on stderr (spdlog underneath).
//
// Every line carries the rank once it is known, so interleaved output of many ranks stays
// readable even without a launcher that prefixes lines:
//
//   fsdp::SetLogRank(3);
//   FSDP_LOG_INFO("mesh {} ready", mesh.ToString());   // [fsdp 12:00:01.123 rank 3 I] mesh ...
//
// Levels: FSDP_LOG_LEVEL=debug|info|warn|error (default info). Logging never throws.
#pragma once

#include <string_view>

#include <spdlog/spdlog.h>

namespace fsdp {

// Sets the rank shown in every following log line (-1: not known yet).
void SetLogRank(int rank);
// The project's logger (created on first use, level from FSDP_LOG_LEVEL).
spdlog::logger& Logger();

}  // namespace fsdp

#define FSDP_LOG_DEBUG(...) ::fsdp::Logger().debug(__VA_ARGS__)
#define FSDP_LOG_INFO(...) ::fsdp::Logger().info(__VA_ARGS__)
#define FSDP_LOG_WARN(...) ::fsdp::Logger().warn(__VA_ARGS__)
#define FSDP_LOG_ERROR(...) ::fsdp::Logger().error(__VA_ARGS__)
