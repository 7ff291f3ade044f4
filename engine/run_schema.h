// The run configuration's schema: every section and key of RunConfig, in the order ToYaml
// writes them, with the spelling of each choice, and the keys that were removed. Internal to
// the engine's config*.cc (the public API is engine/config.h); the machinery that reads a
// schema is common/yaml_schema.h.
//
//   RunConfig config;
//   Parser parser(name, RunSections(config), RemovedRunKeys(), kRunDocument);
//   const char* name = PrecisionNames().Name(Precision::kBf16);   // "bf16"
#pragma once

#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include "common/yaml_schema.h"
#include "engine/config.h"

namespace fsdp {

// What one YAML document is, for the message on a file of several.
inline constexpr std::string_view kRunDocument = "a run configuration";

// Every section and key, pointing into `c`.
std::vector<Section> RunSections(RunConfig& c);
// Keys that no longer exist, with what replaces them.
std::span<const RemovedKey> RemovedRunKeys();

// The YAML spellings of the choices whose names also appear in messages and records.
const EnumNames<Precision>& PrecisionNames();            // fp32, bf16
const EnumNames<DeviceKind>& DeviceKindNames();          // auto, cpu, cuda
const EnumNames<CudaBackend>& CudaBackendNames();        // auto, nccl, gloo
const EnumNames<CpuCollectives>& CpuCollectivesNames();  // p2p, gloo
// full_shard, shard_grad_op, hybrid_shard, hybrid_shard_zero2, no_shard, none (nullopt).
const EnumNames<std::optional<Strategy>>& StrategyNames();

}  // namespace fsdp
