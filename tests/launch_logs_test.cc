// `fsdp launch --log-dir / --redirects / --tee` (launcher/worker_logs.h) as a user runs it: real
// ranks, their files read back, the console beside them.
#include <signal.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "common/strings.h"
#include "launcher/worker_group.h"
#include "launcher/worker_logs.h"
#include "tests/multirank.h"

namespace fsdp {
namespace {

using testing::CommandResult;
using ::testing::ElementsAre;
using testing::FsdpBinary;
using ::testing::HasSubstr;
using testing::RunCommand;

CommandResult Launch(std::vector<std::string> launch_args, const std::string& script) {
  std::vector<std::string> argv = {FsdpBinary(), "launch"};
  argv.insert(argv.end(), launch_args.begin(), launch_args.end());
  argv.insert(argv.end(), {"--", "/bin/sh", "-c", script});
  return RunCommand(argv, {}, std::chrono::seconds(60));
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// DIR/<run_id>/attempt_<attempt>/<local_rank>/<stream>.log
std::string LogFile(const std::string& dir, const std::string& run_id, int attempt, int local_rank,
                    const std::string& stream) {
  return StrCat(dir, "/", run_id, "/attempt_", attempt, "/", local_rank, "/", stream, ".log");
}

// Each rank writes 200 numbered lines on stdout and one on stderr.
constexpr char kChatty[] =
    "i=0; while [ $i -lt 200 ]; do echo \"rank $RANK line $i\"; i=$((i+1)); done; "
    "echo \"rank $RANK to stderr\" >&2";

std::string ChattyStdout(int rank) {
  std::string s;
  for (int i = 0; i < 200; ++i) s += StrCat("rank ", rank, " line ", i, "\n");
  return s;
}

// Each rank's files hold its own lines, whole and in order, and no other rank's; the console
// is as without --log-dir (every line, prefixed).
TEST(LaunchLogsTest, EachRankHasItsOwnFilesAndTheConsoleStillShowsEveryLine) {
  const std::string dir = testing::FreshTempDir("logs-tee");
  CommandResult r = Launch({"--nproc-per-node", "2", "--log-dir", dir, "--run-id", "job"}, kChatty);
  ASSERT_TRUE(r.exit.ok()) << r.Output();
  EXPECT_TRUE(r.StderrHas(StrCat("logs in ", dir, "/job"))) << r.Output();
  for (int rank : {0, 1}) {
    EXPECT_EQ(ReadFile(LogFile(dir, "job", 0, rank, "stdout")), ChattyStdout(rank));
    EXPECT_EQ(ReadFile(LogFile(dir, "job", 0, rank, "stderr")),
              StrCat("rank ", rank, " to stderr\n"));
    EXPECT_TRUE(r.StdoutHas(StrCat("[rank", rank, "]: rank ", rank, " line 199"))) << r.Output();
    EXPECT_TRUE(r.StderrHas(StrCat("[rank", rank, "]: rank ", rank, " to stderr"))) << r.Output();
  }
  EXPECT_EQ(r.stdout_lines.size(), 400u) << r.Output();
  std::filesystem::remove_all(dir);
}

// --redirects takes streams off the console, into the files only; --tee puts them back, per
// local rank too (Note [Log files and the console]).
TEST(LaunchLogsTest, RedirectsLeaveTheLinesInTheFilesOnly) {
  const std::string dir = testing::FreshTempDir("logs-redirects");
  CommandResult r = Launch(
      {"--nproc-per-node", "2", "--log-dir", dir, "--run-id", "all", "--redirects", "3"}, kChatty);
  ASSERT_TRUE(r.exit.ok()) << r.Output();
  EXPECT_TRUE(r.stdout_lines.empty()) << r.Output();
  EXPECT_FALSE(r.StderrHas("[rank")) << r.Output();
  EXPECT_TRUE(r.StderrHas("fsdp launch: all 2 workers exited with code 0")) << r.Output();
  for (int rank : {0, 1}) {
    EXPECT_EQ(ReadFile(LogFile(dir, "all", 0, rank, "stdout")), ChattyStdout(rank));
    EXPECT_EQ(ReadFile(LogFile(dir, "all", 0, rank, "stderr")),
              StrCat("rank ", rank, " to stderr\n"));
  }

  // stdout off the console, stderr kept; then everything off but local rank 0's.
  r = Launch({"--nproc-per-node", "2", "--log-dir", dir, "--run-id", "out", "-r", "1"}, kChatty);
  ASSERT_TRUE(r.exit.ok()) << r.Output();
  EXPECT_TRUE(r.stdout_lines.empty()) << r.Output();
  EXPECT_TRUE(r.StderrHas("[rank1]: rank 1 to stderr")) << r.Output();
  r = Launch({"--nproc-per-node", "2", "--log-dir", dir, "--run-id", "rank0", "--redirects", "3",
              "--tee", "0:3"},
             kChatty);
  ASSERT_TRUE(r.exit.ok()) << r.Output();
  EXPECT_EQ(r.stdout_lines.size(), 200u) << r.Output();
  EXPECT_TRUE(r.StderrHas("[rank0]: rank 0 to stderr")) << r.Output();
  EXPECT_FALSE(r.StderrHas("[rank1]")) << r.Output();
  EXPECT_EQ(ReadFile(LogFile(dir, "rank0", 0, 1, "stdout")), ChattyStdout(1));
  std::filesystem::remove_all(dir);
}

// A restart writes into a new attempt folder; the failure line names the failed rank's
// stderr.log. Rank 1 fails only once rank 0's line is in its log (else the launcher may stop
// rank 0 before its echo ran: seen once on a loaded 2-core machine).
TEST(LaunchLogsTest, ARestartGetsItsOwnAttemptFolder) {
  const std::string dir = testing::FreshTempDir("logs-restart");
  const std::string rank0_first = LogFile(dir, "job", 0, 0, "stdout");
  CommandResult r = Launch({"--nproc-per-node", "2", "--max-restarts", "1", "--grace", "1",
                            "--log-dir", dir, "--run-id", "job"},
                           StrCat("echo attempt $TORCHELASTIC_RESTART_COUNT; "
                                  "if [ $TORCHELASTIC_RESTART_COUNT = 0 ] && [ $RANK = 1 ]; then "
                                  "for i in $(seq 200); do grep -q attempt ", rank0_first,
                                  " 2>/dev/null && break; sleep 0.05; done; "
                                  "echo rank one fails >&2; exit 3; fi; sleep 0.2"));
  ASSERT_TRUE(r.exit.ok()) << r.Output();
  const std::string failed_log = LogFile(dir, "job", 0, 1, "stderr");
  EXPECT_TRUE(
      r.StderrHas(StrCat("fsdp launch: rank 1 exited with code 3; stopped the other "
                         "local ranks; rank 1's stderr: ",
                         failed_log, "; restarting the local group (restart 1 of 1)")))
      << r.Output();
  EXPECT_EQ(ReadFile(failed_log), "rank one fails\n");
  for (int attempt : {0, 1}) {
    for (int rank : {0, 1}) {
      EXPECT_EQ(ReadFile(LogFile(dir, "job", attempt, rank, "stdout")),
                StrCat("attempt ", attempt, "\n"))
          << "attempt " << attempt << " rank " << rank;
    }
  }
  EXPECT_EQ(ReadFile(LogFile(dir, "job", 1, 1, "stderr")), "");
  std::filesystem::remove_all(dir);
}

// Two nodes' launchers sharing a --log-dir (one file system) write under node_<N>: local
// rank 0 of each node has its own files.
TEST(LaunchLogsTest, EachNodeHasItsOwnFolder) {
  const std::string dir = testing::FreshTempDir("logs-nodes");
  const int port = testing::FreePort();
  std::vector<CommandResult> r(2);
  std::vector<std::thread> nodes;
  for (int node : {0, 1}) {
    nodes.emplace_back([&, node] {
      r[node] = Launch({"--nproc-per-node", "1", "--nnodes", "2", "--node-rank", StrCat(node),
                        "--master-port", StrCat(port), "--log-dir", dir, "--run-id", "job"},
                       "echo rank $RANK");
    });
  }
  for (std::thread& t : nodes) t.join();
  for (int node : {0, 1}) {
    ASSERT_TRUE(r[node].exit.ok()) << r[node].Output();
    EXPECT_EQ(ReadFile(StrCat(dir, "/job/node_", node, "/attempt_0/0/stdout.log")),
              StrCat("rank ", node, "\n"));
  }
  std::filesystem::remove_all(dir);
}

// The files grow line by line while the ranks run: a launcher killed then leaves whole lines.
TEST(LaunchLogsTest, LinesAreInTheFileAsTheyArrive) {
  const std::string dir = testing::FreshTempDir("logs-live");
  std::vector<std::string> argv = {FsdpBinary(), "launch",    "--nproc-per-node",
                                   "1",          "--log-dir", dir,
                                   "--run-id",   "job",       "--",
                                   "/bin/sh",    "-c",        "echo first; printf half; sleep 60"};
  WorkerGroup launcher([](const OutputLine&) {});
  ASSERT_TRUE(launcher.Start({{0, argv, {}}}).ok());
  const std::string log = LogFile(dir, "job", 0, 0, "stdout");
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (ReadFile(log).empty() && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  WaitOptions wait;
  wait.stop_requested = [] { return true; };
  launcher.SignalAll(SIGKILL);
  launcher.Wait(wait);
  EXPECT_EQ(ReadFile(log), "first\n");  // the half line was not written
  std::filesystem::remove_all(dir);
}

// Bad values are usage errors (exit 2), one line naming the option, before any rank starts.
TEST(LaunchLogsTest, BadValuesAreRefusedBeforeAnythingStarts) {
  const std::string dir = testing::FreshTempDir("logs-bad");
  const std::string file = dir + "/a-file";
  std::ofstream(file) << "not a folder\n";
  struct Case {
    std::vector<std::string> options;
    std::string message;
  };
  for (const Case& c : std::vector<Case>{
           {{"--log-dir", dir, "--redirects", "7"},
            "fsdp launch: --redirects: '7' is not a stream value; valid: 0 (none), 1 (stdout), "
            "2 (stderr), 3 (both), or per local rank LOCAL_RANK:VALUE,... (e.g. 0:3,1:2)"},
           {{"--log-dir", dir, "--tee", "0:3,2:1"},
            "fsdp launch: --tee: '0:3,2:1' names local rank '2', not one of 0..1 "
            "(--nproc-per-node 2); valid: 0 (none), 1 (stdout), 2 (stderr), 3 (both), or per "
            "local rank LOCAL_RANK:VALUE,... (e.g. 0:3,1:2)"},
           {{"--redirects", "3"},
            "fsdp launch: --redirects 3 needs --log-dir DIR: it chooses which of the ranks' "
            "lines, kept in files under DIR, the console shows too"},
           {{"--log-dir", file + "/logs", "--run-id", "job"},
            StrCat("fsdp launch: --log-dir ", file, "/logs: cannot create ", file,
                   "/logs/job: Not a directory")},
           {{"--log-dir", dir, "--run-id", "../job"},
            StrCat("fsdp launch: --run-id '../job' names the logs' folder under --log-dir ", dir,
                   ": it must be a folder name (no '/', not '.' or '..')")},
       }) {
    std::vector<std::string> options = {"--nproc-per-node", "2"};
    options.insert(options.end(), c.options.begin(), c.options.end());
    CommandResult r = Launch(options, "echo started");
    EXPECT_EQ(r.exit.code, 2) << r.Output();
    EXPECT_THAT(r.stderr_lines, ElementsAre(c.message)) << r.Output();
    EXPECT_TRUE(r.stdout_lines.empty()) << r.Output();
  }
  std::filesystem::remove_all(dir);
}

// torchrun's values: what the console shows per local rank is (~redirects | tee).
TEST(ConsoleStreamsTest, TorchrunsValuesPerLocalRank) {
  EXPECT_THAT(*ParseConsoleStreams("", "", 2), ElementsAre(3, 3));
  EXPECT_THAT(*ParseConsoleStreams("3", "", 2), ElementsAre(0, 0));
  EXPECT_THAT(*ParseConsoleStreams("1", "", 2), ElementsAre(kStdErr, kStdErr));
  EXPECT_THAT(*ParseConsoleStreams("3", "0:3", 3), ElementsAre(3, 0, 0));
  EXPECT_THAT(*ParseConsoleStreams("0:3,2:2", "2:1", 3), ElementsAre(0, 3, kStdOut));
  EXPECT_THAT(*ParseConsoleStreams("", "1", 2), ElementsAre(3, 3));  // tee adds, never removes
  for (const char* bad : {"4", "-1", "", "x", "0:", ":1", "0:1:2", "0:1,", "2:1", "0:4"}) {
    absl::StatusOr<std::vector<int>> parsed = ParseStdStreams("--tee", bad, 2);
    EXPECT_FALSE(parsed.ok()) << bad;
    EXPECT_THAT(std::string(parsed.status().message()), HasSubstr("--tee: '")) << bad;
  }
}

}  // namespace
}  // namespace fsdp
