// `fsdp train CONFIG.yaml [--set section.key=value ...]`.
//
// Under a launcher (RANK/SLURM/MPI variables set) it trains as that rank. Run directly, it
// validates the configuration, then starts parallelism.nproc local ranks of itself through
// `fsdp launch`'s machinery (as torchrun --standalone would): nproc 0 means one rank per GPU,
// or 2 CPU ranks without one.
#pragma once

#include <string>
#include <vector>

namespace fsdp {

struct TrainCommand {
  std::string config_path;
  std::vector<std::string> overrides;
  // More local ranks than the node's GPUs (CUDA) or 4 x its cores (CPU) is refused unless set.
  bool oversubscribe = false;
  // No start-up chatter: the configuration dump (metrics.print_config), the run summary, the
  // launcher's line. Errors and the step lines stay.
  bool quiet = false;
};

int RunTrainCommand(const TrainCommand& command, int argc, char** argv);

}  // namespace fsdp
