// Offload's choices that follow from the run rather than from a key: each one decided here, so
// that the engine (sharding/wrap.cc) and the planner (planner/cost_model.cc) make it the same
// way.
#pragma once

#include <cstdint>
#include <string>

#include "sharding/options.h"

namespace fsdp {

// Note [Compute copy]
// Offload params with a compute dtype narrower than fp32 (bf16) can keep each shard's copy in
// that dtype on the host, refreshed after each step, and load it: half the host->device bytes
// of the fp32 masters, for 2 bytes per parameter of host memory. Without it the loads copy the
// masters and the device casts them; the values are the same either way. So the copy is kept
// unless the host's share of memory fits the offloaded state only without it; a delayed update
// always keeps it (the next step loads the copies while the update writes the masters).
struct ComputeCopyInputs {
  ComputeCopy requested = ComputeCopy::kAuto;
  bool delayed_update = false;
  double host_bytes_without = 0;  // the rank's offloaded state without the copy
  double copy_bytes = 0;          // the copy's bytes on this rank
  double host_available = 0;      // the rank's share of host memory; <= 0: unknown
};
struct ComputeCopyChoice {
  bool keep = true;
  std::string reason;  // why, for the start line: "2.1 GiB of the rank's 30.0 GiB ..."
};
ComputeCopyChoice ChooseComputeCopy(const ComputeCopyInputs& in);

// Bytes per shard element that offload params holds on the host without the copy: the fp32
// master and gradient, and Adam(W)'s two moments (what most runs step; the engine does not
// know the optimizer when it offloads, so the estimate is Adam's).
inline constexpr double kParamsOffloadHostBytesPerElement = 4 + 4 + 8;

// The rank's share of host memory: MemAvailable over the node's ranks; 0 when unknown.
double HostMemoryAvailablePerRank(int ranks_on_node);

}  // namespace fsdp
