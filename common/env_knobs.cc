#include "common/env_knobs.h"

#include <array>
#include <cstdlib>
#include <vector>

#include "common/strings.h"

namespace fsdp {
namespace {

constexpr std::array kAllKnobs = {
    kLogLevel,         kRendezvousTimeoutS, kCollectiveTimeoutS,
    kGlooSocketIfname, kOmpNumThreads,      kCheckpointCrashAfterWrite,
    kPython,           kTestVerbose,        kProgressFile,
    kFailureDir,       kOffloadStepSlice,   kOffloadHostPass,   kOffloadHostThreads,
    kOffloadOverlapStep, kOffloadComputeCopy,
    kTestSigstop,      kTestSigterm,        kTestNonFinite,
};

}  // namespace

std::span<const EnvKnob> AllEnvKnobs() { return kAllKnobs; }

std::optional<std::string> GetEnvKnob(const EnvKnob& knob) {
  const char* value = std::getenv(std::string(knob.name).c_str());
  if (value == nullptr) return std::nullopt;
  return std::string(value);
}

std::pair<int, int64_t> GetRankAtStepKnob(const EnvKnob& knob) {
  constexpr std::pair<int, int64_t> kNone{-1, -1};
  std::optional<std::string> v = GetEnvKnob(knob);
  if (!v) return kNone;
  std::vector<std::string_view> parts = Split(*v, "@");
  if (parts.size() != 2) return kNone;
  std::optional<int> r = ParseInt<int>(parts[0]);
  std::optional<int64_t> s = ParseInt<int64_t>(parts[1]);
  if (!r || !s) return kNone;
  return {*r, *s};
}

}  // namespace fsdp
