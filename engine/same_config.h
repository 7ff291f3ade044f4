// One configuration on every rank (Note [One configuration on every rank]).
#pragma once

#include <string>
#include <vector>

#include <c10/core/Device.h>

#include "absl/status/status.h"
#include "device_mesh/dist_context.h"
#include "engine/config.h"

namespace fsdp {

// "section.key: value" for every key of a resolved configuration's YAML (RunConfig::ToYaml),
// comments left out (they name the file it was read from, which may differ between machines).
std::vector<std::string> ConfigKeyLines(const std::string& yaml);

// The keys where `mine` differs from `theirs` ("training.steps: 20 here, 1000 on rank 0"),
// both ConfigKeyLines; empty when equal.
std::vector<std::string> ConfigDifferences(const std::vector<std::string>& mine,
                                           const std::vector<std::string>& theirs,
                                           int their_rank);

// Collective over ctx's world: OK when every rank resolved the same configuration. Otherwise
// a rank whose configuration differs from rank 0's fails as a config error naming the keys,
// and the others (rank 0 among them) as peer lost, pointing at it.
absl::Status CheckSameConfigOnEveryRank(const RunConfig& config, DistContext& ctx,
                                        c10::Device device);

}  // namespace fsdp
