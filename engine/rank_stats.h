// What each rank writes at the end of a run: <run.dir>/rank_stats/rank<R>.json.
//
//   RankStats stats{.steps = steps, .peak_rss = ProcessPeakRssBytes(), ...};
//   WriteRankStats(run_dir, rank, stats);
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>

#include <nlohmann/json.hpp>
#include <torch/optim/optimizer.h>

#include "sharding/comm_stats.h"
#include "sharding/offload/host_offload.h"

namespace fsdp {

class TrainableModel;

// Note [Rank statistics]
// At the end of a run every rank writes <run.dir>/rank_stats/rank<r>.json: its peak resident
// set (VmHWM), its peak tensor bytes (CPU tracker or CUDA allocator), the tensor bytes right
// after the last optimizer step (state_bytes: parameters, gradients and optimizer state, plus
// whatever the step keeps alive: the model states the ZeRO formulas count), the same model
// states counted tensor by tensor and split into device and host memory (model_state: what
// parallelism.offload moves; on a CPU both are host RAM, the split says which would be on a
// GPU; host_untouched_bytes: gradient buffers reserved but never written, which take no
// memory), the collectives it issued (calls, bytes of the full buffers, seconds blocked
// waiting), and the model FLOPs per token and the device (its name and peak FLOP/s) behind the
// MFU figures. With offload, "offload" holds the host's share of the steps (OffloadStatsJson).
// Rank 0's metrics.jsonl shows rank 0 only; `fsdp bench` reads these files for the maximum
// over ranks.
struct RankStats {
  int64_t steps = 0;        // trained by this process (resumed runs: since the resume)
  int64_t peak_rss = 0;
  int64_t peak_tensor = 0;
  int64_t state_bytes = 0;  // tensor bytes right after the last update
  ModelStateBytes model_state;
  Offload offload = Offload::kNone;
  const CommStats* comm = nullptr;
  double flops_per_token = 0;
  double peak_flops = 0;
  std::string device;
  nlohmann::json offload_stats;  // null without offload
};
void WriteRankStats(const std::filesystem::path& run_dir, int rank, const RankStats& stats);

// Parameters, gradients and optimizer state after the last step, by where they live: the
// optimizer's state lives with the tensors it steps (host masters with offload).
ModelStateBytes ModelStateOf(const TrainableModel& trained, torch::optim::Optimizer& optimizer,
                             Offload offload);

// Offload's statistics over `steps` steps: HostOffload::Stats (copies' bytes, host waits and
// additions, offload params' cast of the masters after the step: refresh, evaluations
// included) and optimizer_step_s, the optimizer step's wall time on the training thread (on the
// host there; with the step overlapped, Note [Overlapped host step], only preparing it:
// host_step_s is the step itself on the host's thread and step_wait_s what the next forwards
// waited for it); each also per step under "per_step" (seconds as milliseconds).
nlohmann::json OffloadStatsJson(const HostOffload::Stats& o, double optimizer_step_s,
                                int64_t steps);

}  // namespace fsdp
