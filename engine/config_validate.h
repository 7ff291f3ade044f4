// The run configuration's value checks, internal to the engine's config*.cc (the public API is
// engine/config.h: ParseRunConfig runs ValidateRunConfig, RunConfig::ValidateForWorld the
// checks that need the world size).
//
//   FSDP_RETURN_IF_ERROR(ValidateRunConfig(config, where));   // x.yaml:7: model.dim: ...
//   FSDP_RETURN_IF_ERROR(CheckReshardGroup(reshard, shard, StrCat("got shard degree ", shard)));
#pragma once

#include <string_view>

#include "absl/status/status.h"
#include "common/yaml_schema.h"
#include "engine/config.h"

namespace fsdp {

// Every value check that needs no world size; an error is placed where its key was set
// (`where`), else at the config's source file.
absl::Status ValidateRunConfig(const RunConfig& config, const Locations& where);

// Note [Reshard group size]
// parallelism.reshard_after_forward = k keeps each unit's parameters sharded over groups of k
// ranks after forward (the rest of the shard axis is gathered in backward): k must divide the
// shard degree and be smaller than it (k equal to the degree is `true`; the parser already
// refuses k < 2). The same rule is checked against the run's own shard degree
// (RunConfig::ValidateForWorld) and against a candidate layout's (ShardingPlanFor, which the
// planner calls for every layout it tries).
//
// OK for any other policy, else kInvalidArgument "parallelism.reshard_after_forward=k must
// divide the shard degree and be smaller than it, <shard_degree_text>" (the text says where the
// degree came from).
absl::Status CheckReshardGroup(const ReshardPolicy& reshard, int shard_degree,
                               std::string_view shard_degree_text);

}  // namespace fsdp
