// The run configuration's value checks, internal to the engine's config*.cc (the public API is
// engine/config.h: ParseRunConfig runs ValidateRunConfig, RunConfig::ValidateForWorld the
// checks that need the world size).
//
//   FSDP_RETURN_IF_ERROR(ValidateRunConfig(config, where));   // x.yaml:7: model.dim: ...
#pragma once

#include "absl/status/status.h"
#include "common/yaml_schema.h"
#include "engine/config.h"

namespace fsdp {

// Every value check that needs no world size; an error is placed where its key was set
// (`where`), else at the config's source file.
absl::Status ValidateRunConfig(const RunConfig& config, const Locations& where);

}  // namespace fsdp
