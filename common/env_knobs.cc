#include "common/env_knobs.h"

#include <array>
#include <cstdlib>

namespace fsdp {
namespace {

constexpr std::array kAllKnobs = {
    kLogLevel,         kRendezvousTimeoutS, kCollectiveTimeoutS,
    kGlooSocketIfname, kOmpNumThreads,      kCheckpointCrashAfterWrite,
    kPython,           kTestVerbose,        kProgressFile,
    kFailureDir,       kOffloadStepSlice,   kOffloadHostPass,   kOffloadHostThreads,
    kTestSigstop,      kTestSigterm,
};

}  // namespace

std::span<const EnvKnob> AllEnvKnobs() { return kAllKnobs; }

std::optional<std::string> GetEnvKnob(const EnvKnob& knob) {
  const char* value = std::getenv(std::string(knob.name).c_str());
  if (value == nullptr) return std::nullopt;
  return std::string(value);
}

}  // namespace fsdp
