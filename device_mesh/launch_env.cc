#include "device_mesh/launch_env.h"

#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_split.h"
#include "common/status.h"
#include "common/strings.h"

namespace fsdp {
namespace {

constexpr int kDefaultMasterPort = 29500;

bool IsLoopbackOnly(int world_size, int local_world_size) {
  return world_size == local_world_size;
}

// Fills master_addr/master_port from MASTER_ADDR/MASTER_PORT, or from the given defaults.
// An empty default address means "required when the job spans several nodes".
absl::Status ResolveMaster(const EnvLookup& env, LaunchEnv& out, std::string default_addr,
                           int default_port, std::string_view why_required) {
  if (auto addr = env("MASTER_ADDR")) {
    out.master_addr = *addr;
  } else if (!default_addr.empty()) {
    out.master_addr = default_addr;
  } else if (out.world_size > 1) {
    return absl::InvalidArgumentError(
        StrCat("environment variable MASTER_ADDR is not set; ", why_required));
  }
  FSDP_ASSIGN_OR_RETURN(std::optional<int> port,
                        GetOptionalIntEnv(env, "MASTER_PORT", 1, 65535));
  out.master_port = port.value_or(default_port);
  return absl::OkStatus();
}

absl::Status CheckRankBelow(std::string_view rank_name, int rank, std::string_view size_name,
                            int size) {
  if (rank >= size) {
    return absl::InvalidArgumentError(StrCat(rank_name, "=", rank, " is not below ",
                                                   size_name, "=", size,
                                                   " (ranks count from 0)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<LaunchEnv> FromTorchrun(const EnvLookup& env) {
  LaunchEnv out;
  FSDP_ASSIGN_OR_RETURN(out.rank, GetIntEnv(env, "RANK"));
  if (!env("WORLD_SIZE")) {
    return absl::InvalidArgumentError(
        "environment variable RANK is set but WORLD_SIZE is not; set both (torchrun does)");
  }
  FSDP_ASSIGN_OR_RETURN(out.world_size, GetIntEnv(env, "WORLD_SIZE", 1));
  FSDP_RETURN_IF_ERROR(CheckRankBelow("RANK", out.rank, "WORLD_SIZE", out.world_size));
  FSDP_ASSIGN_OR_RETURN(std::optional<int> lws,
                        GetOptionalIntEnv(env, "LOCAL_WORLD_SIZE", 1));
  out.local_world_size = lws.value_or(out.world_size);
  if (out.local_world_size > out.world_size) {
    return absl::InvalidArgumentError(
        StrCat("LOCAL_WORLD_SIZE=", out.local_world_size, " is larger than WORLD_SIZE=",
                     out.world_size));
  }
  FSDP_ASSIGN_OR_RETURN(std::optional<int> lr, GetOptionalIntEnv(env, "LOCAL_RANK"));
  // Without LOCAL_RANK, assume ranks are packed node by node (what every launcher does).
  out.local_rank = lr.value_or(out.rank % out.local_world_size);
  FSDP_RETURN_IF_ERROR(
      CheckRankBelow("LOCAL_RANK", out.local_rank, "LOCAL_WORLD_SIZE", out.local_world_size));
  FSDP_ASSIGN_OR_RETURN(std::optional<int> group_rank, GetOptionalIntEnv(env, "GROUP_RANK"));
  out.node_rank = group_rank.value_or(out.rank / out.local_world_size);

  out.use_agent_store = IsTruthy(env("TORCHELASTIC_USE_AGENT_STORE").value_or(""));
  FSDP_ASSIGN_OR_RETURN(std::optional<int> restarts,
                        GetOptionalIntEnv(env, "TORCHELASTIC_RESTART_COUNT"));
  out.restart_count = restarts.value_or(0);
  out.source = env("TORCHELASTIC_RUN_ID") || env("GROUP_RANK") ? "torchrun" : "env";

  std::string why = "it must name the host of rank 0 (or of the launcher's store)";
  if (out.use_agent_store) {
    if (!env("MASTER_ADDR") || !env("MASTER_PORT")) {
      return absl::InvalidArgumentError(
          "TORCHELASTIC_USE_AGENT_STORE is set, so MASTER_ADDR and MASTER_PORT must name the "
          "agent's store; at least one of them is not set");
    }
  }
  if (out.world_size > 1 && !env("MASTER_PORT")) {
    return absl::InvalidArgumentError(
        "environment variable MASTER_PORT is not set; with RANK/WORLD_SIZE it must be the port "
        "rank 0 listens on (1..65535)");
  }
  FSDP_RETURN_IF_ERROR(ResolveMaster(env, out, "", kDefaultMasterPort, why));
  return out;
}

// SLURM_TASKS_PER_NODE: the tasks on each node of the step, in node order, compressed as
// "4(x2)", "4,3" or "2(x3),1". nullopt when it is not of that form.
std::optional<std::vector<int>> ParseTasksPerNode(const std::string& value) {
  std::vector<int> counts;
  std::vector<std::string> items = absl::StrSplit(value, ',');
  for (const std::string& item : items) {
    int repeat = 1;
    std::string count = item;
    if (size_t open = item.find('('); open != std::string::npos) {
      if (item.size() < open + 4 || item.compare(open, 2, "(x") != 0 || item.back() != ')') {
        return std::nullopt;
      }
      std::optional<int> r = ParseInt(item.substr(open + 2, item.size() - open - 3));
      if (!r || *r < 1) return std::nullopt;
      repeat = *r;
      count = item.substr(0, open);
    }
    std::optional<int> c = ParseInt(count);
    if (!c || *c < 1) return std::nullopt;
    counts.insert(counts.end(), repeat, *c);
  }
  return counts;
}

absl::StatusOr<LaunchEnv> FromSlurm(const EnvLookup& env) {
  LaunchEnv out;
  out.source = "slurm";
  FSDP_ASSIGN_OR_RETURN(out.rank, GetIntEnv(env, "SLURM_PROCID"));
  FSDP_ASSIGN_OR_RETURN(out.world_size, GetIntEnv(env, "SLURM_NTASKS", 1));
  FSDP_RETURN_IF_ERROR(CheckRankBelow("SLURM_PROCID", out.rank, "SLURM_NTASKS", out.world_size));
  FSDP_ASSIGN_OR_RETURN(out.local_rank, GetIntEnv(env, "SLURM_LOCALID"));
  // SLURM_NTASKS_PER_NODE is only set with --ntasks-per-node; otherwise SLURM_TASKS_PER_NODE
  // has each node's count (ParseTasksPerNode), and this node's is the one at SLURM_NODEID or,
  // without it, that of the node holding this rank when ranks fill the nodes in order (srun's
  // default block distribution).
  FSDP_ASSIGN_OR_RETURN(std::optional<int> per_node,
                        GetOptionalIntEnv(env, "SLURM_NTASKS_PER_NODE", 1));
  FSDP_ASSIGN_OR_RETURN(std::optional<int> node, GetOptionalIntEnv(env, "SLURM_NODEID"));
  if (!per_node) {
    std::optional<std::vector<int>> counts;
    if (auto tpn = env("SLURM_TASKS_PER_NODE")) counts = ParseTasksPerNode(*tpn);
    if (counts && !node) {
      for (int i = 0, first = 0; i < static_cast<int>(counts->size()); ++i) {
        first += (*counts)[i];
        if (out.rank < first) {
          node = i;
          break;
        }
      }
    }
    if (counts && node && *node < static_cast<int>(counts->size())) {
      per_node = (*counts)[*node];
    } else if (counts) {
      per_node = counts->front();  // fewer tasks than ranks: not a layout srun writes
    }
  }
  out.local_world_size = per_node.value_or(out.world_size);
  FSDP_RETURN_IF_ERROR(CheckRankBelow("SLURM_LOCALID", out.local_rank, "tasks per node",
                                      out.local_world_size));
  out.node_rank = node.value_or(out.rank / out.local_world_size);

  std::string default_addr;
  if (auto list = env("SLURM_JOB_NODELIST") ? env("SLURM_JOB_NODELIST") : env("SLURM_NODELIST")) {
    FSDP_ASSIGN_OR_RETURN(default_addr, FirstSlurmHost(*list));
  }
  // A port derived from the job id keeps two jobs sharing a node apart.
  FSDP_ASSIGN_OR_RETURN(std::optional<int> job, GetOptionalIntEnv(env, "SLURM_JOB_ID"));
  int default_port = job ? 20000 + *job % 20000 : kDefaultMasterPort;
  FSDP_RETURN_IF_ERROR(ResolveMaster(
      env, out, default_addr, default_port,
      "SLURM_JOB_NODELIST is not set either, so the host of rank 0 is unknown"));
  return out;
}

absl::StatusOr<LaunchEnv> FromMpi(const EnvLookup& env, std::string source,
                                  std::string_view rank_var, std::string_view size_var,
                                  std::string_view local_rank_var,
                                  std::string_view local_size_var) {
  LaunchEnv out;
  out.source = std::move(source);
  FSDP_ASSIGN_OR_RETURN(out.rank, GetIntEnv(env, rank_var));
  FSDP_ASSIGN_OR_RETURN(out.world_size, GetIntEnv(env, size_var, 1));
  FSDP_RETURN_IF_ERROR(CheckRankBelow(rank_var, out.rank, size_var, out.world_size));
  FSDP_ASSIGN_OR_RETURN(std::optional<int> local_size,
                        GetOptionalIntEnv(env, local_size_var, 1));
  out.local_world_size = local_size.value_or(out.world_size);
  if (out.local_world_size > out.world_size) {
    return absl::InvalidArgumentError(StrCat(local_size_var, "=", out.local_world_size,
                                             " is larger than ", size_var, "=",
                                             out.world_size));
  }
  FSDP_ASSIGN_OR_RETURN(std::optional<int> local_rank, GetOptionalIntEnv(env, local_rank_var));
  out.local_rank = local_rank.value_or(out.rank % out.local_world_size);
  FSDP_RETURN_IF_ERROR(
      CheckRankBelow(local_rank_var, out.local_rank, local_size_var, out.local_world_size));
  out.node_rank = out.rank / out.local_world_size;
  // On one node rank 0 is on this host; across nodes the user must say where it is
  // (`mpirun -x MASTER_ADDR=host0 ...`).
  std::string default_addr =
      IsLoopbackOnly(out.world_size, out.local_world_size) ? "127.0.0.1" : "";
  FSDP_RETURN_IF_ERROR(ResolveMaster(
      env, out, default_addr, kDefaultMasterPort,
      StrCat("the job spans several nodes (", local_size_var, "=", out.local_world_size,
                   " < ", size_var, "=", out.world_size,
                   "); export the host of rank 0, e.g. mpirun -x MASTER_ADDR=<host>")));
  return out;
}

}  // namespace

bool IsTruthy(std::string_view value) {
  std::string v = ToLower(value);
  return v == "1" || v == "true" || v == "yes" || v == "on";
}

absl::StatusOr<std::string> FirstSlurmHost(std::string_view node_list) {
  // The first top-level item: commas inside brackets do not separate hosts.
  int depth = 0;
  size_t end = std::string_view::npos;
  for (size_t i = 0; i < node_list.size() && depth >= 0; ++i) {
    char c = node_list[i];
    if (c == '[') ++depth;
    if (c == ']') --depth;
    if (c == ',' && depth == 0 && end == std::string_view::npos) end = i;
  }
  if (end == std::string_view::npos) end = node_list.size();
  if (depth != 0) {
    return absl::InvalidArgumentError(
        StrCat("SLURM_JOB_NODELIST='", node_list, "' has unbalanced brackets"));
  }
  std::string item(node_list.substr(0, end));
  // Expand each bracket group to its first element: "n[01-04,07]x[1-2]" -> "n01x1".
  std::string host;
  for (size_t i = 0; i < item.size();) {
    if (item[i] != '[') {
      host += item[i++];
      continue;
    }
    size_t close = item.find(']', i);
    std::string_view group(item.data() + i + 1, close - i - 1);
    host += std::string(group.substr(0, group.find_first_of(",-")));
    i = close + 1;
  }
  if (host.empty()) {
    return absl::InvalidArgumentError(
        StrCat("SLURM_JOB_NODELIST='", node_list, "' names no host"));
  }
  return host;
}

// Note [Which launcher started this process]
// The launcher closest to the process wins: torchrun (or `fsdp launch`) sets RANK for each
// process it starts, and so does mpirun (OMPI_COMM_WORLD_RANK, PMI_RANK). SLURM_PROCID comes
// last: an sbatch script's environment can hold the batch step's SLURM_PROCID=0 and its
// SLURM_NTASKS, which every process that mpirun starts inside the script inherits; read first,
// it made all of them rank 0 (with SLURM_NTASKS=1, each a single-rank run of its own, exit 0).
// Under srun, which starts the processes itself, the MPI variables are either absent or agree
// with SLURM's: `srun --mpi=pmi2` sets PMI_RANK and PMI_SIZE but not MPICH's local-rank
// variables, so where SLURM_PROCID and SLURM_NTASKS agree with the MPI rank and size, SLURM's
// variables (which know the nodes) are read.
absl::StatusOr<LaunchEnv> ParseLaunchEnv(const EnvLookup& env) {
  if (env("RANK")) return FromTorchrun(env);
  auto slurm_agrees = [&](const char* rank_var, const char* size_var) {
    auto same = [&](const char* a, const char* b) {
      std::optional<std::string> x = env(a), y = env(b);
      return x && y && *x == *y;
    };
    return same("SLURM_PROCID", rank_var) && same("SLURM_NTASKS", size_var);
  };
  if (slurm_agrees("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE") ||
      slurm_agrees("PMI_RANK", "PMI_SIZE")) {
    return FromSlurm(env);
  }
  if (env("OMPI_COMM_WORLD_RANK")) {
    return FromMpi(env, "openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                   "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE");
  }
  if (env("PMI_RANK")) {
    return FromMpi(env, "mpich", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS");
  }
  if (env("SLURM_PROCID")) return FromSlurm(env);
  if (env("WORLD_SIZE")) {
    return absl::InvalidArgumentError(
        "environment variable WORLD_SIZE is set but RANK is not; set both (torchrun does)");
  }
  LaunchEnv single;
  single.source = "single-process";
  return single;
}

std::string LaunchEnv::Describe() const {
  std::string where = master_addr.empty()
                          ? std::string("in-process store")
                          : fmt::format("{} store at {}:{}",
                                            use_agent_store ? "agent" : "rank-0", master_addr,
                                            master_port);
  return fmt::format("rank {} of {} (local {} of {}, node {}) via {}, {}", rank, world_size,
                         local_rank, local_world_size, node_rank, source, where);
}

}  // namespace fsdp
