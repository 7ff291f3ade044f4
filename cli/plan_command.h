// `fsdp plan CONFIG.yaml [--set k=v ...] --world-size N [--gpus-per-node G] [--gpu NAME |
// --hardware FILE.json] [--top K] [--json FILE]`: predicts memory and step time of every
// data-parallel layout (planner/cost_model.h) and recommends the fastest that fits.
// `fsdp plan --calibrate [--out FILE.json]` measures this machine's CPU profile instead;
// `fsdp plan --calibrate-host [--gpu NAME | --hardware FILE.json] [--out FILE.json]` that GPU
// profile with this machine's host figures (run on the GPU node: offload's host side).
//
//   fsdp plan configs/llama_1b.yaml --world-size 64 --gpus-per-node 8 --gpu h100
//   ...
//   recommended: hybrid_shard 8x8: --set parallelism.strategy=hybrid_shard ...
//
// Exit codes: 0 a plan (or a calibration) printed, 2 bad options or configuration (checked,
// output files included, before any work), 1 the calibration failed.
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace fsdp {

struct PlanCommand {
  std::string config_path;
  std::vector<std::string> overrides;
  int world_size = 0;
  // Unset: the world size up to 8, else 8. An option given is checked (>= 1; an empty file name
  // is an error), not taken for unset.
  std::optional<int> gpus_per_node;
  std::string gpu = "h100";
  std::string hardware_file;  // a JSON profile (wins over gpu)
  int top = 0;                // 0: every layout
  std::optional<std::string> json_out;  // a plan only
  bool calibrate = false;
  bool calibrate_host = false;
  std::optional<std::string> calibrate_out;  // --out: --calibrate or --calibrate-host only
};

int RunPlanCommand(const PlanCommand& command);

}  // namespace fsdp
