// Failures named at their source and hangs bounded, with real `fsdp train` runs:
// a corrupt rank file on resume, an unusable run.dir, a rank that stops mid-run (SIGSTOP), a
// rendezvous store that accepts and never answers. Each failure must be one line from the rank
// that failed, a documented exit code (common/failure.h, Note [Exit codes]) and a launcher
// headline naming the first rank to fail, never an abort ("terminate called", signal 6).
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/strings.h"
#include "tests/multirank.h"
#include "tests/train_run.h"

namespace fsdp {
namespace {

using testing::CommandResult;
using testing::FreshTempDir;
using testing::FsdpBinary;
using testing::RunCommand;
using testing::SourceDir;

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

// `fsdp train` of the tiny default model (2 layers) on `world` CPU ranks.
CommandResult Train(const std::string& dir, int world, std::vector<std::string> sets,
                    std::map<std::string, std::string> env = {}) {
  sets.insert(sets.begin(), {"training.log_interval=1", "training.eval_interval=0",
                             StrCat("parallelism.nproc=", world), "training.micro_batch_size=2",
                             "model.n_layers=2"});
  return testing::RunTrain(SourceDir() + "/configs/default.yaml", dir, sets, env,
                           std::chrono::seconds(120))
      .result;
}

// No rank may end through std::terminate / abort.
void ExpectNoAbort(const CommandResult& r) {
  const std::string out = r.Output();
  EXPECT_EQ(out.find("terminate called"), std::string::npos) << out;
  EXPECT_EQ(out.find("signal 6"), std::string::npos) << out;
  EXPECT_NE(r.exit.code, 134) << out;
}

// The launcher's headline line ("fsdp launch: ..."), or "".
std::string Headline(const CommandResult& r) {
  for (const std::string& line : r.stderr_lines) {
    if (StartsWith(line, "fsdp launch: rank")) return line;
  }
  return "";
}

// Note [One configuration on every rank]: two nodes whose config files disagree (a stale copy
// on one) trained two runs at once; with other training.steps the longer one's ranks hung in a
// collective after the shorter ones left. Now the rank that differs from rank 0 names the key
// with both values at start, on both nodes (each launcher prints the job's first failure).
// A run too large to allocate is out of memory (exit 8) with the allocator's message and the
// planner named, not an internal error: a sequence length whose position table overflows the
// tensor size computation (found by red-teaming: "internal: ... Storage size calculation
// overflowed"; a host allocation of 51 GB failed the same way).
TEST(FailSafeTest, ARunTooLargeToAllocateIsOutOfMemoryNamingThePlanner) {
  const std::string dir = FreshTempDir("oom");
  CommandResult r = RunCommand(
      {FsdpBinary(), "train", SourceDir() + "/configs/default.yaml", "--set",
       "run.dir=" + dir + "/run", "--set", "parallelism.nproc=1", "--set",
       "model.seq_len=4611686018427387904"},
      {}, std::chrono::seconds(120));
  ASSERT_FALSE(r.timed_out) << r.Output();
  EXPECT_EQ(r.exit.code, 8) << r.Output();
  EXPECT_TRUE(r.StderrHas("out of memory: ")) << r.Output();
  EXPECT_TRUE(r.StderrHas("configs/default.yaml` with the same --set options predicts each "
                          "rank's peak"))
      << r.Output();
  EXPECT_FALSE(r.StderrHas("internal")) << r.Output();
  fs::remove_all(dir);
}

TEST(FailSafeTest, NodesWithDifferentConfigsAreRefusedNamingTheKey) {
  const std::string dir = FreshTempDir("same-config");
  const int port = testing::FreePort();
  auto node = [&](int node_rank, int steps) {
    return StrCat(FsdpBinary(), " launch --nnodes 2 --node-rank ", node_rank,
                  " --nproc-per-node 1 --master-port ", port, " --rdzv-timeout 60 -- ",
                  FsdpBinary(), " train ", SourceDir(), "/configs/default.yaml --set run.dir=", dir,
                  "/run --set training.steps=", steps,
                  " --set training.eval_interval=0 --set model.n_layers=2 > ", dir, "/node",
                  node_rank, ".log 2>&1");
  };
  CommandResult r = RunCommand(
      {"/bin/sh", "-c",
       StrCat(node(0, 20), " & ", node(1, 30), "; b=$?; wait $!; a=$?; echo \"exit $a $b\"")},
      {}, std::chrono::seconds(120));
  ASSERT_FALSE(r.timed_out) << r.Output();
  auto read = [&](int n) {
    std::ifstream in(StrCat(dir, "/node", n, ".log"));
    return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  };
  const std::string log0 = read(0), log1 = read(1);
  EXPECT_TRUE(r.StdoutHas("exit 2 2")) << r.Output() << log0 << log1;
  for (const std::string& log : {log0, log1}) {
    EXPECT_NE(log.find("this rank's configuration differs from rank 0's: training.steps: 30 "
                       "here, 20 on rank 0 (every rank must"),
              std::string::npos)
        << log;
    EXPECT_EQ(log.find("step    1/"), std::string::npos) << "a step ran:\n" << log;
    EXPECT_EQ(log.find("terminate called"), std::string::npos) << log;
  }
  fs::remove_all(dir);
}

TEST(FailSafeTest, CorruptRankFileOnResumeIsNamedFirst) {
  const std::string dir = FreshTempDir("failsafe-corrupt");
  CommandResult saved = Train(dir, 4, {"training.steps=2", "checkpoint.enabled=true"});
  ASSERT_TRUE(saved.exit.ok()) << saved.Output();
  // Flip bytes in the middle of rank 2's shard file: its data, not its header.
  std::string file;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir + "/checkpoints", ec)) {
    if (StartsWith(e.path().filename().string(), "step_")) file = e.path() / "rank00002.bin";
  }
  ASSERT_TRUE(fs::exists(file)) << "layout changed? " << saved.Output();
  {
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    const std::streamoff at = static_cast<std::streamoff>(fs::file_size(file) / 2);
    for (int i = 0; i < 8; ++i) {
      f.seekg(at + i);
      char byte = 0;
      f.read(&byte, 1);
      f.seekp(at + i);
      byte = static_cast<char>(byte ^ 0x5a);
      f.write(&byte, 1);
    }
  }
  CommandResult load =
      Train(dir, 4, {"training.steps=4", "checkpoint.enabled=true", "checkpoint.load=latest"});
  ExpectNoAbort(load);
  EXPECT_EQ(load.exit.code, 3) << load.Output();  // checkpoint error
  const std::string headline = Headline(load);
  EXPECT_TRUE(StartsWith(headline, "fsdp launch: rank 2 failed first: rank 2: checkpoint: "))
      << load.Output();
  EXPECT_NE(headline.find("rank00002.bin"), std::string::npos) << headline;
  EXPECT_NE(headline.find("ranks 0,1,3 stopped after rank 2 failed"), std::string::npos)
      << headline;
  // Rank 2 wrote exactly one line of its own.
  int lines = 0;
  for (const std::string& l : load.stderr_lines) lines += StartsWith(l, "[rank2]: rank 2: ");
  EXPECT_EQ(lines, 1) << load.Output();
  fs::remove_all(dir);
}

TEST(FailSafeTest, UnusableRunDirIsNamedByRankZero) {
  const std::string dir = FreshTempDir("failsafe-rundir");
  std::ofstream(dir + "/a-file") << "not a folder\n";
  const std::string run_dir = dir + "/a-file/run";
  CommandResult r = Train(run_dir, 2, {"training.steps=2"});
  ExpectNoAbort(r);
  EXPECT_EQ(r.exit.code, 4) << r.Output();  // I/O error
  const std::string headline = Headline(r);
  EXPECT_TRUE(StartsWith(headline,
                         "fsdp launch: rank 0 failed first: rank 0: io: run.dir '" + run_dir + "'"))
      << r.Output();
  EXPECT_NE(headline.find("rank 1 stopped after rank 0 failed"), std::string::npos) << headline;
  fs::remove_all(dir);
}

// A checkpoint folder that cannot be one was found only by the first save, an interval of
// training later (and, async, reported one more interval late).
TEST(FailSafeTest, UnusableCheckpointDirIsNamedAtStart) {
  const std::string dir = FreshTempDir("failsafe-ckptdir");
  std::ofstream(dir + "/a-file") << "not a folder\n";
  CommandResult r = Train(dir + "/run", 2,
                          {"training.steps=2", "checkpoint.enabled=true",
                           "checkpoint.dir=" + dir + "/a-file"});
  ExpectNoAbort(r);
  EXPECT_EQ(r.exit.code, 4) << r.Output();  // I/O error
  EXPECT_TRUE(StartsWith(Headline(r), "fsdp launch: rank 0 failed first: rank 0: io: "
                                      "checkpoint.dir: the checkpoint folder '" +
                                          dir + "/a-file'"))
      << r.Output();
  EXPECT_FALSE(r.StdoutHas("step     1/2")) << r.Output();
  fs::remove_all(dir);
}

// Rank 1 of 3 stops itself (SIGSTOP) as step 3 begins, as a hung process would; ranks 0 and 2
// wait in step 3's first collective. The watchdog must name the collective, the unit, the step
// and rank 1, write the flight recorder, and the run must end within the timeout + seconds.
TEST(FailSafeTest, StoppedRankIsNamedByTheWatchdog) {
  const std::string dir = FreshTempDir("failsafe-hang");
  constexpr int kTimeoutS = 4;
  const auto start = Clock::now();
  CommandResult r =
      Train(dir, 3, {"training.steps=6", StrCat("parallelism.collective_timeout_s=", kTimeoutS)},
            {{"FSDP_TEST_SIGSTOP", "1@3"}});
  const double took = std::chrono::duration<double>(Clock::now() - start).count();
  ExpectNoAbort(r);
  EXPECT_FALSE(r.timed_out) << r.Output();
  EXPECT_EQ(r.exit.code, 6) << r.Output();  // collective timeout
  const std::string headline = Headline(r);
  EXPECT_NE(headline.find(": collective timeout: "), std::string::npos) << r.Output();
  EXPECT_NE(headline.find("step 3"), std::string::npos) << headline;
  EXPECT_NE(headline.find("unit '"), std::string::npos) << headline;
  EXPECT_NE(headline.find("rank(s) 1 did not arrive"), std::string::npos) << headline;
  EXPECT_TRUE(StartsWith(headline, "fsdp launch: rank 0 failed first") ||
              StartsWith(headline, "fsdp launch: rank 2 failed first"))
      << headline;
  // Both waiting ranks time out (each writes its flight record, below): the second is named
  // with its own failure, not as one that "stopped after" the first; rank 1, which
  // the launcher stopped, is.
  const int first = StartsWith(headline, "fsdp launch: rank 0 failed first") ? 0 : 2;
  EXPECT_NE(headline.find(StrCat("rank ", 2 - first, " also failed: collective timeout: ")),
            std::string::npos)
      << headline;
  EXPECT_NE(headline.find(StrCat("; rank 1 stopped after rank ", first, " failed")),
            std::string::npos)
      << headline;
  EXPECT_EQ(headline.find("ranks 1,2 stopped after"), std::string::npos) << headline;
  EXPECT_EQ(headline.find("ranks 0,1 stopped after"), std::string::npos) << headline;
  // Startup and two steps take a few seconds; then the timeout, the watchdog's look at the
  // heartbeats (2-3 s) and the launcher's failure grace (5 s) for the stopped rank.
  EXPECT_LT(took, kTimeoutS + 25.0) << r.Output();
  for (int rank : {0, 2}) {
    const std::string flight = StrCat(dir, "/flight/rank", rank, ".json");
    ASSERT_TRUE(fs::exists(flight)) << flight << "\n" << r.Output();
    std::ifstream in(flight);
    nlohmann::json json = nlohmann::json::parse(in);  // throws (fails the test) if malformed
    EXPECT_EQ(json["rank"], rank);
    ASSERT_FALSE(json["collectives"].empty());
    EXPECT_LE(json["collectives"].size(), 64u);
    int waiting_in_step3 = 0;  // the stuck one (a prefetched one after it is only "issued")
    for (const nlohmann::json& c : json["collectives"]) {
      waiting_in_step3 += c["state"] == "waiting" && c["step"] == 3;
    }
    EXPECT_EQ(waiting_in_step3, 1) << json.dump(1);
  }
  fs::remove_all(dir);
}

// A MASTER_PORT that accepts connections (the kernel completes the handshake of a listening
// socket) and never answers must not hang the rank past FSDP_RENDEZVOUS_TIMEOUT_S.
TEST(FailSafeTest, SilentRendezvousStoreFailsWithinTheDeadline) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(listen(fd, 16), 0);
  socklen_t len = sizeof(addr);
  ASSERT_EQ(getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  const int port = ntohs(addr.sin_port);
  const std::string dir = FreshTempDir("failsafe-rdzv");
  const auto start = Clock::now();
  CommandResult r = RunCommand(
      {FsdpBinary(), "train", SourceDir() + "/configs/default.yaml", "--set", "run.dir=" + dir,
       "--set", "metrics.progress_bar=off", "--set", "training.steps=1"},
      {{"RANK", "1"},
       {"WORLD_SIZE", "2"},
       {"LOCAL_RANK", "1"},
       {"LOCAL_WORLD_SIZE", "2"},
       {"MASTER_ADDR", "127.0.0.1"},
       {"MASTER_PORT", StrCat(port)},
       {"FSDP_RENDEZVOUS_TIMEOUT_S", "3"}},
      std::chrono::seconds(60));
  const double took = std::chrono::duration<double>(Clock::now() - start).count();
  close(fd);
  ExpectNoAbort(r);
  EXPECT_FALSE(r.timed_out) << r.Output();
  EXPECT_EQ(r.exit.code, 6) << r.Output();
  int lines = 0;
  for (const std::string& l : r.stderr_lines) {
    if (StartsWith(l, "rank 1: timeout: ")) {
      ++lines;
      EXPECT_NE(l.find(StrCat("127.0.0.1:", port)), std::string::npos) << l;
      EXPECT_NE(l.find("accepted the connection but did not answer"), std::string::npos) << l;
      // The line once named the rank twice ("rank 1: timeout: rank 1: rendezvous ...").
      EXPECT_TRUE(StartsWith(l, "rank 1: timeout: rendezvous timed out after ")) << l;
      EXPECT_EQ(l.find("rank 1", 1), std::string::npos) << l;
    }
  }
  EXPECT_EQ(lines, 1) << r.Output();
  EXPECT_LT(took, 3 + 10.0) << r.Output();
  fs::remove_all(dir);
}

}  // namespace
}  // namespace fsdp
