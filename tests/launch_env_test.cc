#include "device_mesh/launch_env.h"

#include <map>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "common/env.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/status_matchers.h"

namespace fsdp {

// Outside the anonymous namespace so that gtest finds it by argument-dependent lookup.
static void PrintTo(const absl::StatusOr<LaunchEnv>& env, std::ostream* os) {
  testing::PrintStatusOr(env, os, [](const LaunchEnv& value) { return value.Describe(); });
}

namespace {

using testing::InvalidArgumentWith;
using testing::IsOkAndHolds;

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

using Vars = std::map<std::string, std::string>;

absl::StatusOr<LaunchEnv> Parse(Vars vars) { return ParseLaunchEnv(MapEnv(std::move(vars))); }

// Parses an environment that must be valid; a failure is reported and yields a default LaunchEnv.
LaunchEnv ParseOk(Vars vars) {
  absl::StatusOr<LaunchEnv> env = Parse(std::move(vars));
  EXPECT_TRUE(env.ok()) << env.status();
  return env.ok() ? *env : LaunchEnv{};
}

// {rank, world_size, local_rank, local_world_size, node_rank}
std::vector<int> Ranks(const LaunchEnv& env) {
  return {env.rank, env.world_size, env.local_rank, env.local_world_size, env.node_rank};
}

// `base` with `changes` applied; an empty value unsets a variable (EnvLookup treats it as unset).
Vars With(Vars base, const Vars& changes) {
  for (const auto& [name, value] : changes) base[name] = value;
  return base;
}

// What torchrun exports for one rank of a 2-node x 4-process job.
Vars Torchrun() {
  return {{"RANK", "5"},
          {"WORLD_SIZE", "8"},
          {"LOCAL_RANK", "1"},
          {"LOCAL_WORLD_SIZE", "4"},
          {"GROUP_RANK", "1"},
          {"MASTER_ADDR", "node01"},
          {"MASTER_PORT", "29400"},
          {"TORCHELASTIC_RUN_ID", "job"}};
}

TEST(IsTruthyTest, AcceptsCommonTrueSpellings) {
  for (const char* v : {"1", "true", "True", "TRUE", "yes", "Yes", "YES", "on", "ON"}) {
    EXPECT_TRUE(IsTruthy(v)) << v;
  }
  for (const char* v : {"", "0", "false", "False", "no", "off", "2", " 1", "1 ", "y", "t"}) {
    EXPECT_FALSE(IsTruthy(v)) << "'" << v << "'";
  }
}

TEST(FirstSlurmHostTest, ExpandsTheFirstHost) {
  struct Case {
    const char* list;
    const char* want;
  };
  for (const Case& c :
       {Case{"host", "host"}, Case{"a,b", "a"}, Case{"node[01-04,07],gpu5", "node01"},
        Case{"node[07,01-04]", "node07"}, Case{"node[3]", "node3"},
        Case{"gpu5,node[01-04]", "gpu5"}, Case{"n[01-04,07]x[1-2]", "n01x1"},
        Case{"rack[1-2]-n[5-6]", "rack1-n5"}, Case{"a-b.example.com,c", "a-b.example.com"}}) {
    absl::StatusOr<std::string> host = FirstSlurmHost(c.list);
    ASSERT_TRUE(host.ok()) << c.list << ": " << host.status();
    EXPECT_EQ(*host, c.want) << c.list;
  }
}

TEST(FirstSlurmHostTest, RejectsMalformedLists) {
  EXPECT_THAT(FirstSlurmHost("node[01-04").status(),
              InvalidArgumentWith(AllOf(HasSubstr("SLURM_JOB_NODELIST='node[01-04'"),
                                        HasSubstr("unbalanced brackets"))));
  EXPECT_THAT(FirstSlurmHost("node]01[").status(),
              InvalidArgumentWith(HasSubstr("unbalanced brackets")));
  EXPECT_THAT(FirstSlurmHost("node[[1]").status(),
              InvalidArgumentWith(HasSubstr("unbalanced brackets")));
  EXPECT_THAT(FirstSlurmHost("").status(), InvalidArgumentWith(HasSubstr("names no host")));
  EXPECT_THAT(FirstSlurmHost(",a").status(), InvalidArgumentWith(HasSubstr("names no host")));
}

TEST(FirstSlurmHostTest, RejectsUnbalancedBracketsAfterTheFirstHost) {
  EXPECT_THAT(FirstSlurmHost("a,b[1-2").status(),
              InvalidArgumentWith(HasSubstr("unbalanced brackets")));
}

TEST(ParseLaunchEnvTest, NoEnvironmentIsASingleProcess) {
  LaunchEnv env = ParseOk({});
  EXPECT_THAT(Ranks(env), ElementsAre(0, 1, 0, 1, 0));
  EXPECT_EQ(env.master_addr, "");
  EXPECT_FALSE(env.use_agent_store);
  EXPECT_EQ(env.restart_count, 0);
  EXPECT_EQ(env.source, "single-process");
  EXPECT_EQ(env.Describe(),
            "rank 0 of 1 (local 0 of 1, node 0) via single-process, in-process store");
}

TEST(ParseLaunchEnvTest, EmptyValuesCountAsUnset) {
  EXPECT_EQ(ParseOk({{"RANK", ""}, {"SLURM_PROCID", ""}, {"PMI_RANK", ""}}).source,
            "single-process");
}

TEST(ParseLaunchEnvTest, Torchrun) {
  LaunchEnv env = ParseOk(Torchrun());
  EXPECT_THAT(Ranks(env), ElementsAre(5, 8, 1, 4, 1));
  EXPECT_EQ(env.master_addr, "node01");
  EXPECT_EQ(env.master_port, 29400);
  EXPECT_FALSE(env.use_agent_store);
  EXPECT_EQ(env.restart_count, 0);
  EXPECT_EQ(env.source, "torchrun");
  EXPECT_EQ(env.Describe(),
            "rank 5 of 8 (local 1 of 4, node 1) via torchrun, rank-0 store at node01:29400");
}

TEST(ParseLaunchEnvTest, TorchrunWithAgentStoreAndRestarts) {
  LaunchEnv env = ParseOk(With(
      Torchrun(), {{"TORCHELASTIC_USE_AGENT_STORE", "True"}, {"TORCHELASTIC_RESTART_COUNT", "3"}}));
  EXPECT_TRUE(env.use_agent_store);
  EXPECT_EQ(env.restart_count, 3);
  EXPECT_THAT(env.Describe(), HasSubstr("agent store at node01:29400"));

  EXPECT_FALSE(
      ParseOk(With(Torchrun(), {{"TORCHELASTIC_USE_AGENT_STORE", "False"}})).use_agent_store);
}

TEST(ParseLaunchEnvTest, AgentStoreNeedsMasterAddrAndPort) {
  for (const char* missing : {"MASTER_ADDR", "MASTER_PORT"}) {
    EXPECT_THAT(Parse(With(Torchrun(), {{"TORCHELASTIC_USE_AGENT_STORE", "1"}, {missing, ""}})),
                InvalidArgumentWith(AllOf(HasSubstr("TORCHELASTIC_USE_AGENT_STORE"),
                                          HasSubstr("MASTER_ADDR and MASTER_PORT"))))
        << missing;
  }
}

TEST(ParseLaunchEnvTest, TorchrunDefaultsLocalRankAndNodeFromRank) {
  LaunchEnv env =
      ParseOk(With(Torchrun(), {{"LOCAL_RANK", ""}, {"GROUP_RANK", ""}, {"RANK", "6"}}));
  EXPECT_THAT(Ranks(env), ElementsAre(6, 8, 2, 4, 1));
  EXPECT_EQ(env.source, "torchrun") << "TORCHELASTIC_RUN_ID still marks torchrun";
}

TEST(ParseLaunchEnvTest, PlainEnv) {
  LaunchEnv env = ParseOk(
      {{"RANK", "2"}, {"WORLD_SIZE", "3"}, {"MASTER_ADDR", "10.0.0.1"}, {"MASTER_PORT", "1234"}});
  EXPECT_THAT(Ranks(env), ElementsAre(2, 3, 2, 3, 0));
  EXPECT_EQ(env.source, "env");
  EXPECT_EQ(env.Describe(),
            "rank 2 of 3 (local 2 of 3, node 0) via env, rank-0 store at 10.0.0.1:1234");
}

TEST(ParseLaunchEnvTest, PlainEnvOfOneNeedsNoMaster) {
  LaunchEnv env = ParseOk({{"RANK", "0"}, {"WORLD_SIZE", "1"}});
  EXPECT_THAT(Ranks(env), ElementsAre(0, 1, 0, 1, 0));
  EXPECT_EQ(env.master_addr, "");
  EXPECT_EQ(env.master_port, 29500);
  EXPECT_EQ(env.source, "env");
}

TEST(ParseLaunchEnvTest, RankAndWorldSizeMustComeTogether) {
  EXPECT_THAT(Parse({{"RANK", "0"}}),
              InvalidArgumentWith(HasSubstr("RANK is set but WORLD_SIZE is not")));
  EXPECT_THAT(Parse({{"WORLD_SIZE", "4"}}),
              InvalidArgumentWith(HasSubstr("WORLD_SIZE is set but RANK is not")));
}

TEST(ParseLaunchEnvTest, RejectsRankOutOfRange) {
  EXPECT_THAT(Parse(With(Torchrun(), {{"RANK", "8"}})),
              InvalidArgumentWith(HasSubstr("RANK=8 is not below WORLD_SIZE=8")));
  EXPECT_THAT(Parse(With(Torchrun(), {{"RANK", "-1"}})),
              InvalidArgumentWith(HasSubstr("RANK=-1 is out of range")));
  EXPECT_THAT(Parse(With(Torchrun(), {{"WORLD_SIZE", "0"}})),
              InvalidArgumentWith(HasSubstr("WORLD_SIZE=0 is out of range")));
}

TEST(ParseLaunchEnvTest, RejectsInconsistentLocalValues) {
  EXPECT_THAT(Parse(With(Torchrun(), {{"LOCAL_WORLD_SIZE", "16"}})),
              InvalidArgumentWith(HasSubstr("LOCAL_WORLD_SIZE=16 is larger than WORLD_SIZE=8")));
  EXPECT_THAT(Parse(With(Torchrun(), {{"LOCAL_RANK", "4"}})),
              InvalidArgumentWith(HasSubstr("LOCAL_RANK=4 is not below LOCAL_WORLD_SIZE=4")));
}

TEST(ParseLaunchEnvTest, RejectsNonIntegers) {
  for (const char* name : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                           "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT"}) {
    EXPECT_THAT(Parse(With(Torchrun(), {{name, "1.5"}})),
                InvalidArgumentWith(AllOf(HasSubstr(name), HasSubstr("'1.5' is not an integer"))))
        << name;
  }
}

TEST(ParseLaunchEnvTest, AcceptsSurroundingWhitespaceInIntegers) {
  EXPECT_EQ(ParseOk(With(Torchrun(), {{"RANK", " 5 "}})).rank, 5);
}

TEST(ParseLaunchEnvTest, MasterPortRangeAndPresence) {
  for (const char* port : {"0", "65536", "-1", "70000"}) {
    EXPECT_THAT(Parse(With(Torchrun(), {{"MASTER_PORT", port}})),
                InvalidArgumentWith(AllOf(HasSubstr("MASTER_PORT="), HasSubstr("out of range"),
                                          HasSubstr("1..65535"))))
        << port;
  }
  for (int port : {1, 65535}) {
    EXPECT_EQ(ParseOk(With(Torchrun(), {{"MASTER_PORT", std::to_string(port)}})).master_port, port);
  }
  EXPECT_THAT(
      Parse(With(Torchrun(), {{"MASTER_PORT", ""}})),
      InvalidArgumentWith(AllOf(HasSubstr("MASTER_PORT is not set"), HasSubstr("1..65535"))));
}

TEST(ParseLaunchEnvTest, MultiProcessTorchrunNeedsMasterAddr) {
  EXPECT_THAT(Parse(With(Torchrun(), {{"MASTER_ADDR", ""}})),
              InvalidArgumentWith(HasSubstr("MASTER_ADDR is not set")));
}

// Rank 5 of `srun -N2 --ntasks-per-node=4`.
Vars Slurm() {
  return {{"SLURM_PROCID", "5"},    {"SLURM_NTASKS", "8"},
          {"SLURM_LOCALID", "1"},   {"SLURM_TASKS_PER_NODE", "4(x2)"},
          {"SLURM_NODEID", "1"},    {"SLURM_JOB_NODELIST", "node[01-04,07],gpu5"},
          {"SLURM_JOB_ID", "45678"}};
}

TEST(ParseLaunchEnvTest, Slurm) {
  LaunchEnv env = ParseOk(Slurm());
  EXPECT_THAT(Ranks(env), ElementsAre(5, 8, 1, 4, 1));
  EXPECT_EQ(env.master_addr, "node01");
  EXPECT_EQ(env.master_port, 20000 + 45678 % 20000);
  EXPECT_EQ(env.source, "slurm");
  EXPECT_EQ(env.Describe(),
            "rank 5 of 8 (local 1 of 4, node 1) via slurm, rank-0 store at node01:25678");
}

TEST(ParseLaunchEnvTest, SlurmTasksPerNodeForms) {
  struct Case {
    Vars extra;
    int want_local_world;
  };
  for (const Case& c :
       {Case{{{"SLURM_TASKS_PER_NODE", "4(x2)"}}, 4},
        // Rank 5 is the second of node 1's three tasks (ranks 4-6), then the first of node 2's.
        Case{{{"SLURM_TASKS_PER_NODE", "4,3"}}, 3}, Case{{{"SLURM_TASKS_PER_NODE", "2(x3),1"}}, 2},
        Case{{{"SLURM_TASKS_PER_NODE", "2"}}, 2},  // 2 tasks in all, rank 5: the first count
        Case{{{"SLURM_TASKS_PER_NODE", "garbage"}}, 8}, Case{{{"SLURM_TASKS_PER_NODE", "0"}}, 8},
        Case{{{"SLURM_TASKS_PER_NODE", "4(x0)"}}, 8}, Case{{{"SLURM_TASKS_PER_NODE", "4(2)"}}, 8},
        Case{{{"SLURM_TASKS_PER_NODE", "4,"}}, 8},
        Case{{{"SLURM_NTASKS_PER_NODE", "2"}, {"SLURM_TASKS_PER_NODE", "4(x2)"}}, 2},
        Case{{}, 8}}) {
    LaunchEnv env =
        ParseOk(With(With(Slurm(), {{"SLURM_TASKS_PER_NODE", ""}, {"SLURM_NODEID", ""}}), c.extra));
    EXPECT_EQ(env.local_world_size, c.want_local_world);
  }
}

TEST(ParseLaunchEnvTest, SlurmUnevenNodesTakeTheirOwnCount) {
  // srun -n7 -N4: "2(x3),1". The last node's only task has local world 1, by SLURM_NODEID or,
  // without it, by where rank 6 falls; node 1 has 2.
  Vars last = With(Slurm(), {{"SLURM_PROCID", "6"}, {"SLURM_NTASKS", "7"}, {"SLURM_LOCALID", "0"},
                             {"SLURM_TASKS_PER_NODE", "2(x3),1"}, {"SLURM_NODEID", "3"}});
  EXPECT_THAT(Ranks(ParseOk(last)), ElementsAre(6, 7, 0, 1, 3));
  EXPECT_THAT(Ranks(ParseOk(With(last, {{"SLURM_NODEID", ""}}))), ElementsAre(6, 7, 0, 1, 3));
  Vars second = With(last, {{"SLURM_PROCID", "3"}, {"SLURM_LOCALID", "1"}, {"SLURM_NODEID", ""}});
  EXPECT_THAT(Ranks(ParseOk(second)), ElementsAre(3, 7, 1, 2, 1));
  // A local id beyond its node's count is refused, naming both.
  EXPECT_THAT(Parse(With(last, {{"SLURM_LOCALID", "1"}})),
              InvalidArgumentWith(HasSubstr("SLURM_LOCALID=1 is not below tasks per node=1")));
}

TEST(ParseLaunchEnvTest, SlurmPortAndAddressFallbacks) {
  EXPECT_EQ(ParseOk(With(Slurm(), {{"SLURM_JOB_ID", "12345"}})).master_port, 32345);
  EXPECT_EQ(ParseOk(With(Slurm(), {{"SLURM_JOB_ID", "40000"}})).master_port, 20000);
  EXPECT_EQ(ParseOk(With(Slurm(), {{"SLURM_JOB_ID", ""}})).master_port, 29500);

  LaunchEnv env = ParseOk(With(Slurm(), {{"MASTER_PORT", "1234"}, {"MASTER_ADDR", "login1"}}));
  EXPECT_EQ(env.master_port, 1234);
  EXPECT_EQ(env.master_addr, "login1");

  Vars vars = With(Slurm(), {{"SLURM_JOB_NODELIST", ""}, {"SLURM_NODELIST", "a,b"}});
  EXPECT_EQ(ParseOk(vars).master_addr, "a");
  EXPECT_EQ(ParseOk(With(vars, {{"SLURM_JOB_NODELIST", "host"}})).master_addr, "host");
}

TEST(ParseLaunchEnvTest, SlurmErrors) {
  EXPECT_THAT(Parse(With(Slurm(), {{"SLURM_JOB_NODELIST", ""}})),
              InvalidArgumentWith(
                  AllOf(HasSubstr("MASTER_ADDR is not set"), HasSubstr("SLURM_JOB_NODELIST"))));
  EXPECT_THAT(Parse(With(Slurm(), {{"SLURM_JOB_NODELIST", "node[01-04"}})),
              InvalidArgumentWith(HasSubstr("unbalanced brackets")));
  EXPECT_THAT(Parse(With(Slurm(), {{"SLURM_PROCID", "8"}})),
              InvalidArgumentWith(HasSubstr("SLURM_PROCID=8 is not below SLURM_NTASKS=8")));
  EXPECT_THAT(Parse(With(Slurm(), {{"SLURM_NTASKS", ""}})),
              InvalidArgumentWith(HasSubstr("SLURM_NTASKS is not set")));
  EXPECT_THAT(Parse(With(Slurm(), {{"SLURM_LOCALID", ""}})),
              InvalidArgumentWith(HasSubstr("SLURM_LOCALID is not set")));
  EXPECT_THAT(Parse(With(Slurm(), {{"SLURM_LOCALID", "4"}})),
              InvalidArgumentWith(HasSubstr("SLURM_LOCALID=4 is not below tasks per node=4")));
  EXPECT_THAT(Parse(With(Slurm(), {{"SLURM_JOB_ID", "x1"}})),
              InvalidArgumentWith(HasSubstr("SLURM_JOB_ID='x1' is not an integer")));
}

TEST(ParseLaunchEnvTest, TorchrunVariablesWinOverSlurm) {
  LaunchEnv env = ParseOk(With(Slurm(), Torchrun()));
  EXPECT_EQ(env.source, "torchrun");
  EXPECT_EQ(env.master_port, 29400);
}

Vars OpenMpi(int rank, int size, int local_rank, int local_size) {
  return {{"OMPI_COMM_WORLD_RANK", std::to_string(rank)},
          {"OMPI_COMM_WORLD_SIZE", std::to_string(size)},
          {"OMPI_COMM_WORLD_LOCAL_RANK", std::to_string(local_rank)},
          {"OMPI_COMM_WORLD_LOCAL_SIZE", std::to_string(local_size)}};
}

TEST(ParseLaunchEnvTest, OpenMpiSingleNodeDefaultsToLoopback) {
  LaunchEnv env = ParseOk(OpenMpi(3, 4, 3, 4));
  EXPECT_THAT(Ranks(env), ElementsAre(3, 4, 3, 4, 0));
  EXPECT_EQ(env.master_addr, "127.0.0.1");
  EXPECT_EQ(env.master_port, 29500);
  EXPECT_EQ(env.source, "openmpi");
  EXPECT_EQ(env.Describe(),
            "rank 3 of 4 (local 3 of 4, node 0) via openmpi, rank-0 store at 127.0.0.1:29500");
}

TEST(ParseLaunchEnvTest, OpenMpiMultiNode) {
  EXPECT_THAT(Parse(OpenMpi(3, 4, 1, 2)),
              InvalidArgumentWith(AllOf(HasSubstr("MASTER_ADDR is not set"),
                                        HasSubstr("OMPI_COMM_WORLD_LOCAL_SIZE=2"),
                                        HasSubstr("OMPI_COMM_WORLD_SIZE=4"))));
  LaunchEnv env =
      ParseOk(With(OpenMpi(3, 4, 1, 2), {{"MASTER_ADDR", "host0"}, {"MASTER_PORT", "4000"}}));
  EXPECT_THAT(Ranks(env), ElementsAre(3, 4, 1, 2, 1));
  EXPECT_EQ(env.master_addr, "host0");
  EXPECT_EQ(env.master_port, 4000);
}

TEST(ParseLaunchEnvTest, OpenMpiLocalDefaultsAndErrors) {
  LaunchEnv env = ParseOk({{"OMPI_COMM_WORLD_RANK", "2"}, {"OMPI_COMM_WORLD_SIZE", "3"}});
  EXPECT_THAT(Ranks(env), ElementsAre(2, 3, 2, 3, 0));
  EXPECT_EQ(env.master_addr, "127.0.0.1");

  EXPECT_THAT(Parse({{"OMPI_COMM_WORLD_RANK", "0"}}),
              InvalidArgumentWith(HasSubstr("OMPI_COMM_WORLD_SIZE is not set")));
  EXPECT_THAT(
      Parse(OpenMpi(4, 4, 0, 4)),
      InvalidArgumentWith(HasSubstr("OMPI_COMM_WORLD_RANK=4 is not below OMPI_COMM_WORLD_SIZE=4")));
  EXPECT_THAT(Parse(OpenMpi(1, 4, 2, 2)),
              InvalidArgumentWith(HasSubstr(
                  "OMPI_COMM_WORLD_LOCAL_RANK=2 is not below OMPI_COMM_WORLD_LOCAL_SIZE=2")));
}

TEST(ParseLaunchEnvTest, RejectsMpiLocalSizeAboveWorldSize) {
  EXPECT_THAT(Parse(With(OpenMpi(0, 2, 0, 4), {{"MASTER_ADDR", "host0"}})),
              InvalidArgumentWith(HasSubstr("OMPI_COMM_WORLD_LOCAL_SIZE=4")));
}

TEST(ParseLaunchEnvTest, SchedulerVariablesWinOverAStrayWorldSize) {
  LaunchEnv env = ParseOk(With(OpenMpi(0, 2, 0, 2), {{"WORLD_SIZE", "2"}}));
  EXPECT_EQ(env.source, "openmpi");
}

// Note [Which launcher started this process]: an sbatch script's batch step exports
// SLURM_PROCID=0 and its SLURM_NTASKS; mpirun inside the script starts every process with them
// and with its own OMPI_* / PMI_* variables, which win. Read first, SLURM made every process
// rank 0 (with SLURM_NTASKS=1, two single-rank runs that both exited 0).
TEST(ParseLaunchEnvTest, MpiVariablesWinOverAnEnclosingSlurmBatchStep) {
  const Vars batch = {{"SLURM_PROCID", "0"},  {"SLURM_NTASKS", "1"},
                      {"SLURM_LOCALID", "0"}, {"SLURM_NODEID", "0"},
                      {"SLURM_JOB_ID", "77"}, {"SLURM_JOB_NODELIST", "node01"}};
  LaunchEnv env = ParseOk(With(batch, OpenMpi(1, 2, 1, 2)));
  EXPECT_EQ(env.source, "openmpi");
  EXPECT_THAT(Ranks(env), ElementsAre(1, 2, 1, 2, 0));
  env = ParseOk(With(batch, {{"PMI_RANK", "1"}, {"PMI_SIZE", "2"}}));
  EXPECT_EQ(env.source, "mpich");
  EXPECT_THAT(Ranks(env), ElementsAre(1, 2, 1, 2, 0));
  // srun alone: SLURM's own variables.
  EXPECT_EQ(ParseOk(Slurm()).source, "slurm");
  // srun --mpi=pmi2 sets PMI_RANK / PMI_SIZE (not MPICH's local ones) that agree with SLURM's:
  // SLURM's, which know the nodes, are read (the MPI ones would make every rank node 0's).
  env = ParseOk(With(Slurm(), {{"PMI_RANK", "5"}, {"PMI_SIZE", "8"}}));
  EXPECT_EQ(env.source, "slurm");
  EXPECT_THAT(Ranks(env), ElementsAre(5, 8, 1, 4, 1));
  EXPECT_EQ(env.master_addr, "node01");
}

TEST(ParseLaunchEnvTest, Mpich) {
  LaunchEnv env = ParseOk({{"PMI_RANK", "5"},
                           {"PMI_SIZE", "6"},
                           {"MPI_LOCALRANKID", "2"},
                           {"MPI_LOCALNRANKS", "3"},
                           {"MASTER_ADDR", "h0"}});
  EXPECT_THAT(Ranks(env), ElementsAre(5, 6, 2, 3, 1));
  EXPECT_EQ(env.master_addr, "h0");
  EXPECT_EQ(env.master_port, 29500);
  EXPECT_EQ(env.source, "mpich");

  EXPECT_EQ(ParseOk({{"PMI_RANK", "0"}, {"PMI_SIZE", "1"}}).master_addr, "127.0.0.1");
  EXPECT_THAT(Parse({{"PMI_RANK", "5"}, {"PMI_SIZE", "6"}, {"MPI_LOCALNRANKS", "3"}}),
              InvalidArgumentWith(
                  AllOf(HasSubstr("MASTER_ADDR"), HasSubstr("MPI_LOCALNRANKS=3 < PMI_SIZE=6"))));
  EXPECT_THAT(Parse({{"PMI_RANK", "6"}, {"PMI_SIZE", "6"}}),
              InvalidArgumentWith(HasSubstr("PMI_RANK=6 is not below PMI_SIZE=6")));
  EXPECT_THAT(Parse({{"PMI_RANK", "a"}, {"PMI_SIZE", "6"}}),
              InvalidArgumentWith(HasSubstr("PMI_RANK='a' is not an integer")));
}

}  // namespace
}  // namespace fsdp
