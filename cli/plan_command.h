// `fsdp plan CONFIG.yaml [--set k=v ...] --world-size N [--gpus-per-node G] [--gpu NAME |
// --hardware FILE.json] [--top K] [--json FILE]`: predicts memory and step time of every
// data-parallel layout (planner/cost_model.h) and recommends the fastest that fits.
// `fsdp plan --calibrate [--out FILE.json]` measures this machine's CPU profile instead.
//
//   fsdp plan configs/llama_1b.yaml --world-size 64 --gpus-per-node 8 --gpu h100
//   ...
//   recommended: hybrid_shard 8x8: --set parallelism.strategy=hybrid_shard ...
//
// Exit codes: 0 a plan (or a calibration) printed, 2 bad options or configuration, 1 the
// calibration failed.
#pragma once

#include <string>
#include <vector>

namespace fsdp {

struct PlanCommand {
  std::string config_path;
  std::vector<std::string> overrides;
  int world_size = 0;
  int gpus_per_node = 0;  // 0: the world size up to 8, else 8
  std::string gpu = "h100";
  std::string hardware_file;  // a JSON profile (wins over gpu)
  int top = 0;                // 0: every layout
  std::string json_out;
  bool calibrate = false;
  std::string calibrate_out;
};

int RunPlanCommand(const PlanCommand& command);

}  // namespace fsdp
