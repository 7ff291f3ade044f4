// `fsdp launch` as a user runs it: real processes, real exit codes and signals, restarts,
// two launchers forming one job across "nodes", and our programs under the real torchrun.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>
#include <thread>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "common/strings.h"
#include "launcher/launch.h"
#include "launcher/worker_group.h"
#include "tests/multirank.h"

namespace fsdp {
namespace {

using testing::CommandResult;
using testing::FsdpBinary;
using testing::RunCommand;

CommandResult Launch(std::vector<std::string> launch_args, const std::string& script,
                     std::chrono::seconds timeout = std::chrono::seconds(60)) {
  std::vector<std::string> argv = {FsdpBinary(), "launch"};
  argv.insert(argv.end(), launch_args.begin(), launch_args.end());
  argv.insert(argv.end(), {"--", "/bin/sh", "-c", script});
  return RunCommand(argv, {}, timeout);
}

TEST(LaunchTest, SetsTorchrunEnvironmentAndPrefixesEveryLine) {
  CommandResult r = Launch({"--nproc-per-node", "3"},
                           "echo \"rank=$RANK local=$LOCAL_RANK world=$WORLD_SIZE "
                           "lws=$LOCAL_WORLD_SIZE group=$GROUP_RANK restart=$TORCHELASTIC_RESTART_COUNT "
                           "agent=$TORCHELASTIC_USE_AGENT_STORE addr=$MASTER_ADDR\"; "
                           "echo second line from $RANK; echo to-stderr-$RANK >&2");
  ASSERT_TRUE(r.exit.ok()) << r.Output();
  for (int rank = 0; rank < 3; ++rank) {
    EXPECT_TRUE(r.StdoutHas(StrCat("[rank", rank, "]: rank=", rank, " local=", rank,
                                   " world=3 lws=3 group=0 restart=0 agent=True addr=127.0.0.1")))
        << r.Output();
    EXPECT_TRUE(r.StdoutHas(StrCat("[rank", rank, "]: second line from ", rank))) << r.Output();
    EXPECT_TRUE(r.StderrHas(StrCat("[rank", rank, "]: to-stderr-", rank))) << r.Output();
  }
  // Every stdout line carries a rank prefix.
  for (const std::string& line : r.stdout_lines) EXPECT_TRUE(StartsWith(line, "[rank")) << line;
}

TEST(LaunchTest, PicksAFreePortAndSetsOmpThreads) {
  CommandResult r = Launch({"--nproc-per-node", "2"}, "echo port=$MASTER_PORT omp=$OMP_NUM_THREADS");
  ASSERT_TRUE(r.exit.ok()) << r.Output();
  ASSERT_FALSE(r.stdout_lines.empty());
  std::string line = r.stdout_lines[0];
  std::string port = line.substr(line.find("port=") + 5, line.find(' ', line.find("port=")) -
                                                            line.find("port=") - 5);
  EXPECT_GT(ParseInt(port).value_or(0), 0) << line;
  EXPECT_NE(port, "29500");  // chosen, not a fixed default another run may hold
  EXPECT_THAT(line, ::testing::HasSubstr("omp="));
}

TEST(LaunchTest, FailingRankStopsTheOthersAndIsNamed) {
  auto start = std::chrono::steady_clock::now();
  CommandResult r = Launch({"--nproc-per-node", "3", "--grace", "2"},
                           "if [ \"$RANK\" = 1 ]; then echo rank one fails >&2; exit 3; fi; "
                           "sleep 60");
  double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_FALSE(r.timed_out);
  EXPECT_TRUE(r.exit.exited);
  EXPECT_EQ(r.exit.code, 3) << r.Output();
  EXPECT_TRUE(r.StderrHas("fsdp launch: rank 1 exited with code 3")) << r.Output();
  EXPECT_TRUE(r.StderrHas("[rank1]: rank one fails")) << r.Output();
  EXPECT_LT(took, 30.0) << "the sleeping ranks were not stopped";
}

TEST(LaunchTest, RankKilledBySignalIsNamed) {
  CommandResult r = Launch({"--nproc-per-node", "2", "--grace", "1"},
                           "if [ \"$RANK\" = 0 ]; then kill -9 $$; fi; sleep 60");
  EXPECT_TRUE(r.exit.exited);
  EXPECT_EQ(r.exit.code, 128 + SIGKILL) << r.Output();
  EXPECT_TRUE(r.StderrHas("rank 0 was killed by signal 9")) << r.Output();
}

TEST(LaunchTest, RestartsTheGroupWithAnIncrementedRestartCount) {
  CommandResult r = Launch({"--nproc-per-node", "2", "--max-restarts", "2", "--grace", "1"},
                           "echo attempt $TORCHELASTIC_RESTART_COUNT; "
                           "if [ \"$TORCHELASTIC_RESTART_COUNT\" -lt 2 ] && [ \"$RANK\" = 1 ]; "
                           "then exit 5; fi; sleep 0.2");
  ASSERT_TRUE(r.exit.ok()) << r.Output();
  EXPECT_TRUE(r.StderrHas("restarting the local group (restart 1 of 2)")) << r.Output();
  EXPECT_TRUE(r.StderrHas("restarting the local group (restart 2 of 2)")) << r.Output();
  EXPECT_TRUE(r.StdoutHas("[rank1]: attempt 2")) << r.Output();
}

TEST(LaunchTest, GivesUpAfterMaxRestarts) {
  CommandResult r = Launch({"--nproc-per-node", "2", "--max-restarts", "1", "--grace", "1"},
                           "if [ \"$RANK\" = 0 ]; then exit 7; fi; sleep 60");
  EXPECT_EQ(r.exit.code, 7) << r.Output();
  EXPECT_TRUE(r.StderrHas("rank 0 exited with code 7; stopped the other local ranks (1 restarts used)"))
      << r.Output();
}

TEST(LaunchTest, MissingProgramIsExplained) {
  CommandResult r = Launch({"--nproc-per-node", "1"}, "true");
  ASSERT_TRUE(r.exit.ok());
  CommandResult missing =
      RunCommand({FsdpBinary(), "launch", "--nproc-per-node", "2", "--", "/no/such/program"});
  EXPECT_EQ(missing.exit.code, 127) << missing.Output();
  EXPECT_TRUE(missing.StderrHas("cannot execute '/no/such/program': No such file or directory"))
      << missing.Output();
  CommandResult none = RunCommand({FsdpBinary(), "launch", "--nproc-per-node", "2"});
  EXPECT_EQ(none.exit.code, 2);
  EXPECT_TRUE(none.StderrHas("no program given")) << none.Output();
  CommandResult bad_node = RunCommand(
      {FsdpBinary(), "launch", "--nproc-per-node", "2", "--nnodes", "2", "--node-rank", "2",
       "--master-port", "29999", "--", "true"});
  EXPECT_EQ(bad_node.exit.code, 2);
  EXPECT_TRUE(bad_node.StderrHas("--node-rank=2 must be in 0..1")) << bad_node.Output();
  CommandResult no_port = RunCommand(
      {FsdpBinary(), "launch", "--nproc-per-node", "2", "--nnodes", "2", "--", "true"});
  EXPECT_EQ(no_port.exit.code, 2);
  EXPECT_TRUE(no_port.StderrHas("--master-port is required with --nnodes > 1")) << no_port.Output();
}

// Options a rank or the store could not use are refused before anything starts, with one line
// naming the option and exit code 2: a zero --rdzv-timeout used to reach c10d (a stack trace
// and "port already in use?"), an empty --master-addr waited 300 s for a store at "".
TEST(LaunchTest, OptionsAreCheckedBeforeAnythingStarts) {
  struct Case {
    std::vector<std::string> options;
    std::string message;
  };
  for (const Case& c : std::vector<Case>{
           {{"--nproc-per-node", "0"}, "fsdp launch: --nproc-per-node: must be >= 1, got 0"},
           {{"--nproc-per-node", "abc"},
            "fsdp launch: --nproc-per-node: 'abc' is not an integer (must be >= 1)"},
           {{"--nproc-per-node", "2", "--nnodes", "0"},
            "fsdp launch: --nnodes: must be >= 1, got 0"},
           {{"--nproc-per-node", "2", "--master-port", "70000"},
            "fsdp launch: --master-port: must be in 0..65535, got 70000"},
           {{"--nproc-per-node", "2", "--rdzv-timeout", "0"},
            "fsdp launch: --rdzv-timeout: must be >= 1, got 0"},
           {{"--nproc-per-node", "2", "--rdzv-timeout", "-5"},
            "fsdp launch: --rdzv-timeout: must be >= 1, got -5"},
           {{"--nproc-per-node", "2", "--grace", "-1"},
            "fsdp launch: --grace: must be >= 0, got -1"},
           {{"--nproc-per-node", "2", "--master-addr", ""},
            "fsdp launch: --master-addr is empty: give node 0's host name or address (default "
            "127.0.0.1)"},
       }) {
    std::vector<std::string> argv = {FsdpBinary(), "launch"};
    argv.insert(argv.end(), c.options.begin(), c.options.end());
    argv.insert(argv.end(), {"--", "/bin/true"});
    CommandResult r = RunCommand(argv, {}, std::chrono::seconds(30));
    EXPECT_FALSE(r.timed_out) << c.message;
    EXPECT_EQ(r.exit.code, 2) << r.Output();
    EXPECT_THAT(r.stderr_lines, ::testing::ElementsAre(c.message)) << r.Output();
  }
}

TEST(LaunchOptionsTest, ValidateNamesTheOption) {
  LaunchOptions o;
  o.program = {"/bin/true"};
  EXPECT_TRUE(o.Validate().ok());
  o.rendezvous_timeout = std::chrono::seconds(0);
  EXPECT_THAT(std::string(o.Validate().message()), ::testing::HasSubstr("--rdzv-timeout=0"));
  o.rendezvous_timeout = std::chrono::seconds(1);
  o.grace = std::chrono::milliseconds(-1);
  EXPECT_THAT(std::string(o.Validate().message()), ::testing::HasSubstr("--grace"));
  o.grace = std::chrono::milliseconds(0);
  o.master_addr = "";
  EXPECT_THAT(std::string(o.Validate().message()), ::testing::HasSubstr("--master-addr is empty"));
}

// "port already in use? choose another --master-port" only when the port is taken: a store that
// cannot be reached for another reason gets no such advice.
TEST(LaunchTest, PortHintOnlyWhenThePortIsTaken) {
  int listener = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(listener, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(listen(listener, 1), 0);
  socklen_t len = sizeof(addr);
  ASSERT_EQ(getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  CommandResult taken =
      RunCommand({FsdpBinary(), "launch", "--nproc-per-node", "1", "--master-port",
                  StrCat(ntohs(addr.sin_port)), "--", "/bin/true"},
                 {}, std::chrono::seconds(60));
  close(listener);
  EXPECT_EQ(taken.exit.code, 1) << taken.Output();
  EXPECT_TRUE(taken.StderrHas("(port already in use? choose another --master-port)"))
      << taken.Output();
  CommandResult unreachable =
      RunCommand({FsdpBinary(), "launch", "--nproc-per-node", "1", "--master-addr",
                  "no-such-host.invalid", "--rdzv-timeout", "1", "--", "/bin/true"},
                 {}, std::chrono::seconds(60));
  EXPECT_EQ(unreachable.exit.code, 1) << unreachable.Output();
  EXPECT_TRUE(unreachable.StderrHas("fsdp launch: cannot host the rendezvous store"))
      << unreachable.Output();
  EXPECT_FALSE(unreachable.StderrHas("port already in use")) << unreachable.Output();
}

TEST(LaunchTest, HelpHasOneUsageLine) {
  CommandResult r = RunCommand({FsdpBinary(), "launch", "--help"});
  EXPECT_EQ(r.exit.code, 0) << r.Output();
  int usage = 0;
  for (const std::string& line : r.stdout_lines) usage += line.find("Usage:") != std::string::npos;
  EXPECT_EQ(usage, 1) << r.Output();
  EXPECT_TRUE(r.StdoutHas("Usage: fsdp launch [OPTIONS] -- PROGRAM [ARGS...]")) << r.Output();
}

TEST(LaunchTest, InterruptedLauncherStopsItsRanks) {
  // The launcher gets SIGTERM while its ranks sleep: it must stop them and exit 128+15.
  std::string marker = StrCat("/tmp/fsdp-launch-test-", getpid());
  std::vector<std::string> argv = {FsdpBinary(), "launch", "--nproc-per-node", "2", "--grace",
                                   "1", "--", "/bin/sh", "-c",
                                   StrCat("echo started; sleep 60; touch ", marker)};
  std::vector<std::string> lines;
  WorkerGroup group([&](const OutputLine& l) { lines.emplace_back(l.text); });
  ASSERT_TRUE(group.Start({WorkerSpec{0, argv, {}}}).ok());
  WaitOptions wait;
  auto start = std::chrono::steady_clock::now();
  int started = 0;
  wait.stop_requested = [&] {
    started = 0;
    for (const auto& l : lines) started += l.find("started") != std::string::npos;
    if (started == 2) group.SignalAll(SIGTERM);
    return std::chrono::steady_clock::now() - start > std::chrono::seconds(30);
  };
  GroupResult result = group.Wait(wait);
  ASSERT_EQ(result.exits.size(), 1u);
  EXPECT_TRUE(result.exits[0].exited);
  EXPECT_EQ(result.exits[0].code, 128 + SIGTERM);
  EXPECT_FALSE(std::filesystem::exists(marker)) << "a rank outlived its launcher";
}

// Ranks that outlive --grace after the launcher was interrupted are killed, and the launcher
// says so: a SIGTERM checkpoint that needs longer was lost without a word ("workers stopped").
TEST(LaunchTest, InterruptedLauncherNamesTheRanksItHadToKill) {
  std::vector<std::string> argv = {
      FsdpBinary(), "launch", "--nproc-per-node", "2",  "--grace",
      "1",          "--",     "/bin/sh",          "-c", "trap '' TERM; echo started; sleep 30"};
  std::string out;
  std::mutex mu;
  WorkerGroup group([&](const OutputLine& l) {
    std::lock_guard<std::mutex> lock(mu);
    out += std::string(l.text) + "\n";
  });
  ASSERT_TRUE(group.Start({WorkerSpec{0, argv, {}}}).ok());
  WaitOptions wait;
  wait.deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  bool sent = false;
  wait.stop_requested = [&] {
    std::lock_guard<std::mutex> lock(mu);
    if (!sent && out.find("[rank0]: started") != std::string::npos &&
        out.find("[rank1]: started") != std::string::npos) {
      group.SignalAll(SIGTERM);
      sent = true;
    }
    return false;
  };
  GroupResult result = group.Wait(wait);
  ASSERT_EQ(result.exits.size(), 1u);
  EXPECT_EQ(result.exits[0].code, 128 + SIGTERM) << out;
  EXPECT_THAT(out, ::testing::HasSubstr(
                       "fsdp launch: interrupted by signal 15; workers stopped; ranks 0,1 did not "
                       "stop within --grace 1 s and were killed (a SIGTERM checkpoint needs a "
                       "longer --grace)"));
}

TEST(LaunchTest, TwoNodesOnOneMachineFormOneJob) {
  int port = testing::FreePort();
  auto node = [&](int node_rank) {
    return WorkerSpec{node_rank,
                      {FsdpBinary(), "launch", "--nproc-per-node", "2", "--nnodes", "2",
                       "--node-rank", StrCat(node_rank), "--master-port", StrCat(port), "--",
                       FsdpBinary(), "doctor", "--max-bytes", "4K", "--mesh", "2,2", "--timeout",
                       "60"},
                      {}};
  };
  std::vector<std::string> out;
  std::mutex mu;
  WorkerGroup group([&](const OutputLine& l) {
    std::lock_guard<std::mutex> lock(mu);
    out.emplace_back(l.text);
  });
  ASSERT_TRUE(group.Start({node(0), node(1)}).ok());
  WaitOptions wait;
  wait.deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  GroupResult result = group.Wait(wait);
  std::string all;
  for (const auto& l : out) all += l + "\n";
  ASSERT_TRUE(result.ok()) << result.Summary() << "\n" << all;
  EXPECT_THAT(all, ::testing::HasSubstr("[rank3]: rank 3: rank 3 of 4 (local 1 of 2, node 1)"));
  EXPECT_THAT(all, ::testing::HasSubstr("fsdp doctor: OK"));
}

TEST(LaunchTest, OurProgramsRunUnderRealTorchrun) {
  std::string torchrun = FSDP_TORCHRUN_PATH;
  if (!std::filesystem::exists(torchrun)) GTEST_SKIP() << "torchrun not found at " << torchrun;
  CommandResult r = RunCommand({torchrun, "--no-python", "--standalone", "--nproc-per-node", "2",
                                FsdpBinary(), "doctor", "--max-bytes", "4K"},
                               {}, std::chrono::seconds(120));
  ASSERT_TRUE(r.exit.ok()) << r.Output();
  std::string all = r.Output();
  EXPECT_THAT(all, ::testing::HasSubstr("via torchrun, agent store"));
  EXPECT_THAT(all, ::testing::HasSubstr("fsdp doctor: OK"));
}

TEST(LaunchTest, OurProgramsRunUnderRealMpirun) {
  std::string mpirun = "/usr/bin/mpirun";
  if (!std::filesystem::exists(mpirun)) GTEST_SKIP() << "mpirun not installed (openmpi-bin)";
  CommandResult r = RunCommand({mpirun, "--oversubscribe", "-np", "3", FsdpBinary(), "doctor",
                                "--max-bytes", "4K"},
                               {{"OMPI_ALLOW_RUN_AS_ROOT", "1"},
                                {"OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"},
                                {"MASTER_PORT", StrCat(testing::FreePort())}},
                               std::chrono::seconds(120));
  ASSERT_TRUE(r.exit.ok()) << r.Output();
  std::string all = r.Output();
  EXPECT_THAT(all, ::testing::HasSubstr("rank 2: rank 2 of 3 (local 2 of 3, node 0) via openmpi"));
  EXPECT_THAT(all, ::testing::HasSubstr("fsdp doctor: OK"));
}

// ---- Launchers across nodes (Note [Launchers across nodes], node_rendezvous.h) ----------------

std::vector<std::string> NodeLauncher(int port, int node_rank, int nproc_per_node,
                                      const std::string& script,
                                      std::vector<std::string> extra = {}) {
  std::vector<std::string> argv = {FsdpBinary(),           "launch",          "--nproc-per-node",
                                   StrCat(nproc_per_node), "--nnodes",        "2",
                                   "--node-rank",          StrCat(node_rank), "--master-port",
                                   StrCat(port),           "--grace",         "1"};
  argv.insert(argv.end(), extra.begin(), extra.end());
  argv.insert(argv.end(), {"--", "/bin/sh", "-c", script});
  return argv;
}

// Output of a group of launchers, one string per launcher (its stdout and stderr lines).
struct LauncherOutput {
  std::mutex mu;
  std::map<int, std::string> text;
  std::function<void(const OutputLine&)> Sink() {
    return [this](const OutputLine& l) {
      std::lock_guard<std::mutex> lock(mu);
      text[l.rank] += std::string(l.text) + "\n";
    };
  }
  std::string Of(int launcher) {
    std::lock_guard<std::mutex> lock(mu);
    return text[launcher];
  }
  std::string All() {
    std::lock_guard<std::mutex> lock(mu);
    std::string all;
    for (const auto& [n, t] : text) all += StrCat("--- launcher ", n, ":\n", t);
    return all;
  }
};

// Runs each command to its own end at the same time (a WorkerGroup would stop the others when
// one fails).
std::vector<CommandResult> RunTogether(const std::vector<std::vector<std::string>>& commands) {
  std::vector<CommandResult> results(commands.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < commands.size(); ++i) {
    threads.emplace_back(
        [&, i] { results[i] = RunCommand(commands[i], {}, std::chrono::seconds(120)); });
  }
  for (std::thread& t : threads) t.join();
  return results;
}

// A third launcher claiming a node rank of a running job is refused before it starts anything,
// and the job runs on. It used to start its ranks, which failed the rendezvous ("two processes
// claim RANK=1"), and its failure stopped the healthy job on both nodes.
TEST(LaunchNodesTest, ATakenNodeRankIsRefusedAndTheJobRunsOn) {
  const int port = testing::FreePort();
  const std::string dir = testing::FreshTempDir("taken-node");
  const std::string release = dir + "/release";
  // Each rank goes through the job's rendezvous, then waits for the test.
  const std::string script =
      StrCat(FsdpBinary(), " doctor --max-bytes 1K --timeout 60 && while [ ! -e ", release,
             " ]; do sleep 0.1; done");
  LauncherOutput out;
  WorkerGroup job(out.Sink());
  ASSERT_TRUE(job.Start({{0, NodeLauncher(port, 0, 1, script), {}},
                         {1, NodeLauncher(port, 1, 1, script), {}}})
                  .ok());
  std::optional<CommandResult> intruder;
  WaitOptions wait;
  wait.deadline = std::chrono::steady_clock::now() + std::chrono::seconds(180);
  wait.stop_requested = [&] {
    if (intruder || out.Of(0).find("fsdp doctor: OK") == std::string::npos) return false;
    intruder = RunCommand(NodeLauncher(port, 1, 1, script), {}, std::chrono::seconds(60));
    std::ofstream(release) << "go\n";
    return false;
  };
  GroupResult result = job.Wait(wait);
  ASSERT_TRUE(intruder.has_value()) << out.All();
  EXPECT_EQ(intruder->exit.code, 2) << intruder->Output();
  EXPECT_TRUE(intruder->StderrHas("fsdp launch: node 1: --node-rank 1 is already taken in the job"))
      << intruder->Output();
  EXPECT_TRUE(intruder->StderrHas("the running job was left alone")) << intruder->Output();
  EXPECT_TRUE(result.ok()) << result.Summary() << "\n" << out.All();
  std::filesystem::remove_all(dir);
}

// Nodes started with different --nproc-per-node are refused on both, naming both values. They
// used to start (a program that does not meet its peers even succeeded); ours failed with a
// rank collision that blamed an innocent rank.
TEST(LaunchNodesTest, NodesWithOtherOptionsAreRefusedOnBothNodes) {
  const int port = testing::FreePort();
  std::vector<CommandResult> r = RunTogether(
      {NodeLauncher(port, 0, 2, "echo started"), NodeLauncher(port, 1, 1, "echo started")});
  for (const CommandResult& c : r) {
    EXPECT_EQ(c.exit.code, 2) << c.Output();
    EXPECT_FALSE(c.StdoutHas("started")) << c.Output();
  }
  EXPECT_TRUE(
      r[0].StderrHas("has --nnodes 2 --nproc-per-node 1 --max-restarts 0, this launcher "
                     "(node 0) has --nnodes 2 --nproc-per-node 2 --max-restarts 0: every node "
                     "must be started with the same --nnodes, --nproc-per-node and "
                     "--max-restarts"))
      << r[0].Output();
  EXPECT_TRUE(
      r[1].StderrHas("has --nnodes 2 --nproc-per-node 2 --max-restarts 0, this launcher "
                     "(node 1) has --nnodes 2 --nproc-per-node 1 --max-restarts 0"))
      << r[1].Output();
  // Other --max-restarts: one node would restart its ranks while the other had stopped.
  const int port2 = testing::FreePort();
  r = RunTogether({NodeLauncher(port2, 0, 1, "echo started", {"--max-restarts", "1"}),
                   NodeLauncher(port2, 1, 1, "echo started")});
  for (const CommandResult& c : r) {
    EXPECT_EQ(c.exit.code, 2) << c.Output();
    EXPECT_FALSE(c.StdoutHas("started")) << c.Output();
  }
  EXPECT_TRUE(r[1].StderrHas("--max-restarts 1, this launcher (node 1) has --nnodes 2 "
                             "--nproc-per-node 1 --max-restarts 0"))
      << r[1].Output();
}

// A node that never comes is named by node 0 within --rdzv-timeout, before any rank starts.
TEST(LaunchNodesTest, ANodeThatNeverJoinsIsNamedWithinTheRendezvousTimeout) {
  const int port = testing::FreePort();
  CommandResult r = RunCommand(NodeLauncher(port, 0, 1, "echo started", {"--rdzv-timeout", "2"}),
                               {}, std::chrono::seconds(60));
  EXPECT_FALSE(r.timed_out);
  EXPECT_EQ(r.exit.code, 1) << r.Output();
  EXPECT_TRUE(
      r.StderrHas("fsdp launch: node 0: node 1 of 2 did not join within 2 s (--rdzv-timeout)"))
      << r.Output();
  EXPECT_FALSE(r.StdoutHas("started")) << r.Output();
}

// A failure record as a rank of ours leaves it (common/failure.h), from a shell.
std::string WriteRecord(int code, const std::string& line) {
  return StrCat("printf '%s %s\\n%s\\n' $(date +%s%N) ", code, " '", line,
                "' > $FSDP_FAILURE_DIR/rank$RANK.failure");
}

// Both nodes print the job's first failure, whichever node it was on: node 0's rank only saw
// its peer go ("peer lost"), which node 0 used to name as the first failure (exit 7).
TEST(LaunchNodesTest, EveryNodeNamesTheFirstFailureWhicheverNodeItWasOn) {
  const int port = testing::FreePort();
  const std::string dir = testing::FreshTempDir("first-failure");
  const std::string marker = dir + "/rank1-failed";
  const std::string script = StrCat(
      "if [ \"$RANK\" = 1 ]; then ", WriteRecord(3, "rank 1: checkpoint: the disk is on fire"),
      "; touch ", marker, "; exec sleep 60; fi; while [ ! -e ", marker, " ]; do sleep 0.1; done; ",
      WriteRecord(7, "rank 0: peer lost: rank 1 closed the connection"), "; exit 7");
  std::vector<CommandResult> r =
      RunTogether({NodeLauncher(port, 0, 1, script), NodeLauncher(port, 1, 1, script)});
  for (int node : {0, 1}) {
    EXPECT_EQ(r[node].exit.code, 3) << r[node].Output();
    EXPECT_TRUE(r[node].StderrHas(
        "fsdp launch: node 1: rank 1 failed first: rank 1: checkpoint: the disk is on fire"))
        << r[node].Output();
  }
  std::filesystem::remove_all(dir);
}

// A node whose launcher was killed sends no report; the other node names it, first, since its
// own ranks only lost a peer.
TEST(LaunchNodesTest, ANodeWhoseLauncherWasKilledIsNamed) {
  const int port = testing::FreePort();
  const std::string dir = testing::FreshTempDir("killed-node");
  const std::string marker = dir + "/node1-killed";
  const std::string script =
      StrCat("echo started; if [ \"$RANK\" = 1 ]; then exec sleep 60; fi; while [ ! -e ", marker,
             " ]; do sleep 0.1; done; ",
             WriteRecord(7, "rank 0: peer lost: rank 1 closed the connection"), "; exit 7");
  LauncherOutput out0, out1;
  WorkerGroup node0(out0.Sink()), node1(out1.Sink());
  ASSERT_TRUE(node0.Start({{0, NodeLauncher(port, 0, 1, script), {}}}).ok());
  ASSERT_TRUE(node1.Start({{1, NodeLauncher(port, 1, 1, script), {}}}).ok());
  WaitOptions wait;
  wait.deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  bool killed = false;
  wait.stop_requested = [&] {
    if (!killed && out0.Of(0).find("[rank0]: started") != std::string::npos) {
      node1.SignalAll(SIGKILL);  // node 1's launcher (its rank dies with it)
      killed = true;
      std::ofstream(marker) << "killed\n";
    }
    return false;
  };
  GroupResult result = node0.Wait(wait);
  ASSERT_EQ(result.exits.size(), 1u);
  EXPECT_TRUE(result.exits[0].exited && result.exits[0].code == 7)
      << result.exits[0].Describe() << "\n"
      << out0.All();
  EXPECT_THAT(out0.Of(0), ::testing::HasSubstr(
                              "fsdp launch: node 1 sent no report within 11 s (was its launcher "
                              "killed, or did it lose node 0?); node 0: rank 0 failed first: rank "
                              "0: peer lost: rank 1 closed the connection"))
      << out0.All();
  std::filesystem::remove_all(dir);
}

// Note [A rank outlives its launcher]: ranks behind a wrapper, their output in files, are
// orphaned when the launcher is SIGKILLed. They used to train on alone (for ever); they now
// stop within seconds, naming the launcher's store.
TEST(LaunchTest, RanksBehindAWrapperStopWhenTheirLauncherIsKilled) {
  const std::string dir = testing::FreshTempDir("orphans");
  const std::string script =
      StrCat(FsdpBinary(), " train ", testing::SourceDir(),
             "/configs/default.yaml --set training.steps=1000000 ",
             "--set training.eval_interval=0 --set run.dir=", dir, "/run > ", dir,
             "/rank$RANK.log 2>&1 & echo $! > ", dir, "/pid$RANK; wait");
  std::vector<std::string> argv = {FsdpBinary(), "launch", "--nproc-per-node", "2", "--", "/bin/sh",
                                   "-c",         script};
  WorkerGroup launcher([](const OutputLine&) {});
  ASSERT_TRUE(launcher.Start({{0, argv, {}}}).ok());
  auto read = [](const std::string& path) {
    std::ifstream in(path);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  };
  // Training has begun on both ranks (rank 0 logs the steps of both).
  auto until = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (read(dir + "/rank0.log").find("step ") == std::string::npos &&
         std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ASSERT_THAT(read(dir + "/rank0.log"), ::testing::HasSubstr("step ")) << read(dir + "/rank0.log");
  launcher.SignalAll(SIGKILL);
  std::vector<pid_t> ranks;
  for (int r : {0, 1})
    ranks.push_back(ParseInt<pid_t>(Split(read(StrCat(dir, "/pid", r)), "\n")[0]).value_or(-1));
  auto alive = [](pid_t pid) {  // not a zombie: an orphan's new parent may not reap at once
    std::string stat;
    std::ifstream(StrCat("/proc/", pid, "/stat")) >> stat >> stat >> stat;
    return !stat.empty() && stat != "Z";
  };
  until = std::chrono::steady_clock::now() + std::chrono::seconds(90);
  while ((alive(ranks[0]) || alive(ranks[1])) && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  for (int r : {0, 1}) {
    EXPECT_FALSE(alive(ranks[r])) << "rank " << r << " trains on without its launcher";
    if (ranks[r] > 0) kill(ranks[r], SIGKILL);
    EXPECT_THAT(read(StrCat(dir, "/rank", r, ".log")),
                ::testing::HasSubstr(
                    StrCat("rank ", r, ": peer lost: the launcher's store at 127.0.0.1:")));
  }
  std::filesystem::remove_all(dir);
}

// Note [The first failure]: each rank that failed on its own is named with its own class and
// what; only the ranks that followed (peer lost, stopped by the launcher) are summarised.
TEST(LaunchHeadlineTest, EachRankThatFailedOnItsOwnIsNamed) {
  GroupResult result;
  result.outcome = GroupResult::Outcome::kWorkerFailed;
  auto exit = [](int rank, bool exited, int code, bool killed_by_us) {
    WorkerExit e;
    e.rank = rank;
    e.exited = exited;
    e.code = code;
    e.killed_by_us = killed_by_us;
    return e;
  };
  result.exits = {exit(0, true, 6, false), exit(1, false, 9, true), exit(2, true, 6, false),
                  exit(3, true, 7, false), exit(4, true, 0, false)};
  result.first_failure = result.exits[2];
  std::vector<FailureRecord> records = {
      {2, 200, 6, "rank 2: collective timeout: all_gather #7 (unit 'b', step 3) did not complete"},
      {0, 100, 6, "rank 0: collective timeout: all_gather #7 (unit 'b', step 3) did not complete"},
      {3, 50, 7, "rank 3: peer lost: rank 0 closed the connection"},
  };
  FailureHeadline h = SummarizeFailures(result, records);
  EXPECT_EQ(h.rank, 0);
  EXPECT_EQ(h.code, 6);
  EXPECT_EQ(h.text,
            "rank 0 failed first: rank 0: collective timeout: all_gather #7 (unit 'b', step 3) did "
            "not complete; rank 2 also failed: collective timeout: all_gather #7 (unit 'b', step "
            "3) did not complete; ranks 1,3 stopped after rank 0 failed");

  // A long line is cut; a rank killed by a signal nobody sent is named with it.
  records[0].line = "rank 2: timeout: " + std::string(300, 'x');
  result.exits[1] = exit(1, false, 11, false);
  result.exits[1].exit_time_ns = 300;
  h = SummarizeFailures(result, records);
  EXPECT_THAT(h.text, ::testing::HasSubstr("complete; rank 1 was killed by signal 11 ("));
  EXPECT_THAT(h.text, ::testing::HasSubstr("; rank 2 also failed: timeout: xxx"));
  EXPECT_THAT(h.text, ::testing::EndsWith("xxx...; rank 3 stopped after rank 0 failed"));
}

// Ranks that stopped on SIGTERM (exit 143) did not fail: one line, the others "stopped too".
TEST(LaunchHeadlineTest, PreemptedRanksAreOneStop) {
  GroupResult result;
  result.outcome = GroupResult::Outcome::kWorkerFailed;
  for (int rank : {0, 1, 2}) {
    WorkerExit e;
    e.rank = rank;
    e.exited = true;
    e.code = 143;
    result.exits.push_back(e);
  }
  result.first_failure = result.exits[0];
  std::vector<FailureRecord> records = {
      {0, 200, 143, "rank 0: preempted: stopped by SIGTERM after step 3 of 20"},
      {1, 100, 143, "rank 1: preempted: stopped by SIGTERM after step 3 of 20"},
      {2, 300, 143, "rank 2: preempted: stopped by SIGTERM after step 3 of 20"},
  };
  FailureHeadline h = SummarizeFailures(result, records);
  EXPECT_EQ(h.rank, 1);
  EXPECT_EQ(h.code, 143);
  EXPECT_EQ(h.text,
            "rank 1 stopped first: rank 1: preempted: stopped by SIGTERM after step 3 of 20; "
            "ranks 0,2 stopped too");
}

}  // namespace
}  // namespace fsdp
