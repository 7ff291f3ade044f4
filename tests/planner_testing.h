// What the planner's tests share: configs by name, requests, modes, a flat link, and the
// offload debugging knobs set for a scope.
#pragma once

#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "planner/cost_model.h"

namespace fsdp::plan {

inline std::string ConfigPath(const std::string& name) {
  std::filesystem::path from_source =
      std::filesystem::path(__FILE__).parent_path().parent_path() / "configs";
  if (!std::filesystem::is_directory(from_source)) {
    from_source = std::filesystem::read_symlink("/proc/self/exe").parent_path() / "../../configs";
  }
  return (from_source / (name + ".yaml")).string();
}

// An environment variable for the scope: the offload debugging knobs ShardingPlanFor reads
// (FSDP_OFFLOAD_OVERLAP_STEP=0: the host step in place).
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) { ::setenv(name, value, 1); }
  ~ScopedEnv() { ::unsetenv(name_); }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
};
inline constexpr const char* kOverlapKnob = "FSDP_OFFLOAD_OVERLAP_STEP";

inline PlanRequest Request(const std::string& config, int world, int per_node, const std::string& gpu,
                    const std::vector<std::string>& overrides = {}) {
  absl::StatusOr<PlanRequest> r =
      MakePlanRequest(ConfigPath(config), overrides, world, per_node, gpu, "");
  EXPECT_TRUE(r.ok()) << r.status();
  return *r;
}

// Bandwidth only: no latency, one flat link, so collective times are bytes / bandwidth.
inline Hardware FlatLink() {
  Hardware hw = *HardwareByName("h100");
  hw.intra_node_latency_s = hw.inter_node_latency_s = 0;
  hw.inter_node_bw = hw.intra_node_bw;
  return hw;
}

inline PlanRequest WithModes(PlanRequest r, const std::string& ac, const std::string& offload) {
  r.config.training.activation_checkpointing = {
      ac == "none"        ? ActivationCheckpointing::Mode::kNone
      : ac == "selective" ? ActivationCheckpointing::Mode::kSelective
                          : ActivationCheckpointing::Mode::kFull,
      ac.starts_with("every:") ? std::stoi(ac.substr(6)) : 1};
  r.config.parallelism.offload = offload == "none"        ? Offload::kNone
                                 : offload == "optimizer" ? Offload::kOptimizer
                                                          : Offload::kParams;
  return r;
}

}  // namespace fsdp::plan
