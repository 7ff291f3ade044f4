// Who am I? Reading rank, world size and rendezvous address from any common launcher.
//
// Recognised, in this order (the first whose rank variable is set wins; Note [Which launcher
// started this process], launch_env.cc):
//   torchrun / plain  RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR,
//                     MASTER_PORT, TORCHELASTIC_USE_AGENT_STORE, TORCHELASTIC_RESTART_COUNT
//   Open MPI mpirun   OMPI_COMM_WORLD_RANK / _SIZE / _LOCAL_RANK / _LOCAL_SIZE
//   MPICH / Hydra     PMI_RANK, PMI_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS
//   SLURM srun        SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NTASKS_PER_NODE /
//                     SLURM_TASKS_PER_NODE, SLURM_NODEID, SLURM_JOB_NODELIST, SLURM_JOB_ID
//   nothing           a single process (rank 0 of 1).
// MASTER_ADDR / MASTER_PORT override what a scheduler-derived default would be. A missing or
// inconsistent variable is kInvalidArgument naming it.
//
//   absl::StatusOr<LaunchEnv> env = ParseLaunchEnv(ProcessEnv());
//   if (!env.ok()) { std::cerr << env.status() << "\n"; return 2; }
//   std::cout << env->Describe();   // "rank 1 of 4 (local 1 of 4, node 0) via torchrun ..."
//
// Pure functions of the environment: no sockets, no processes. See dist_context.h for the
// rendezvous itself.
#pragma once

#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "common/env.h"

namespace fsdp {

struct LaunchEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  int node_rank = 0;
  std::string master_addr;  // empty only for a single process started without a launcher
  int master_port = 0;
  // torchrun's agent hosts the TCPStore: every rank is a client, under the key prefix
  // "/worker/attempt_<restart_count>".
  bool use_agent_store = false;
  int restart_count = 0;
  std::string source;  // "torchrun", "env", "slurm", "openmpi", "mpich", "single-process"

  std::string Describe() const;
};

absl::StatusOr<LaunchEnv> ParseLaunchEnv(const EnvLookup& env);

// First host of a SLURM host list: "node[01-04,07],gpu5" -> "node01". kInvalidArgument on
// malformed input (unbalanced brackets, empty list).
absl::StatusOr<std::string> FirstSlurmHost(std::string_view node_list);

// TORCHELASTIC_USE_AGENT_STORE and similar booleans: "1", "true", "True", "yes".
bool IsTruthy(std::string_view value);

}  // namespace fsdp
