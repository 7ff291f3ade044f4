// `fsdp doctor` under `fsdp launch` on the meshes a user tries first, and its errors.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "common/strings.h"
#include "tests/multirank.h"

namespace fsdp {
namespace {

using testing::CommandResult;
using testing::FsdpBinary;
using testing::RunCommand;

struct DoctorCase {
  int ranks;
  std::string mesh;
  std::string expect;  // the mesh as doctor prints it
};

class DoctorTest : public ::testing::TestWithParam<DoctorCase> {};

TEST_P(DoctorTest, PassesOnCpu) {
  const DoctorCase c = GetParam();
  std::vector<std::string> argv = {FsdpBinary(), "launch", "--nproc-per-node", StrCat(c.ranks),
                                   "--", FsdpBinary(), "doctor", "--max-bytes", "64K",
                                   "--iters", "2"};
  if (!c.mesh.empty()) argv.insert(argv.end(), {"--mesh", c.mesh});
  CommandResult r = RunCommand(argv, {}, std::chrono::seconds(120));
  ASSERT_TRUE(r.exit.ok()) << r.Output();
  EXPECT_TRUE(r.StdoutHas("fsdp doctor: OK")) << r.Output();
  EXPECT_TRUE(r.StdoutHas(c.expect)) << r.Output();
  EXPECT_TRUE(r.StdoutHas("torch      2.11.0")) << r.Output();
  EXPECT_TRUE(r.StdoutHas("offload    host loops on ")) << r.Output();
  for (int rank = 0; rank < c.ranks; ++rank) {
    EXPECT_TRUE(r.StdoutHas(StrCat("[rank", rank, "]: rank ", rank, ": rank ", rank, " of ",
                                   c.ranks)))
        << r.Output();
  }
  // Three collectives x sizes 1K, 4K, 16K, 64K on each axis, each line with 0 wrong elements.
  int rows = 0;
  for (const std::string& line : r.stdout_lines) {
    if (line.find("all_reduce ") != std::string::npos ||
        line.find("all_gather ") != std::string::npos ||
        line.find("reduce_scatter ") != std::string::npos) {
      ++rows;
      EXPECT_TRUE(line.size() > 2 && line.substr(line.size() - 2) == " 0") << line;
    }
  }
  int axes = static_cast<int>(Split(c.expect, ",").size());
  EXPECT_EQ(rows, 3 * 4 * axes) << r.Output();
}

INSTANTIATE_TEST_SUITE_P(
    Meshes, DoctorTest,
    ::testing::Values(DoctorCase{1, "", "(shard=1)"}, DoctorCase{2, "", "(shard=2)"},
                      DoctorCase{3, "3", "(shard=3)"}, DoctorCase{4, "4", "(shard=4)"},
                      DoctorCase{4, "2,2", "(replicate=2, shard=2)"}),
    [](const ::testing::TestParamInfo<DoctorCase>& info) {
      return StrCat("Ranks", info.param.ranks, "_Axes", Split(info.param.expect, ",").size());
    });

TEST(DoctorErrors, MeshThatDoesNotFitListsEveryFactor) {
  CommandResult r = RunCommand({FsdpBinary(), "launch", "--nproc-per-node", "4", "--",
                                FsdpBinary(), "doctor", "--mesh", "3,2"});
  EXPECT_EQ(r.exit.code, 2) << r.Output();
  EXPECT_TRUE(r.StderrHas("mesh (replicate=3, shard=2) needs 3 x 2 = 6 ranks but the world size is 4"))
      << r.Output();
}

TEST(DoctorErrors, BadEnvironmentNamesTheVariable) {
  CommandResult r = RunCommand({FsdpBinary(), "doctor"}, {{"RANK", "4"}, {"WORLD_SIZE", "4"},
                                                          {"MASTER_ADDR", "127.0.0.1"},
                                                          {"MASTER_PORT", "29500"}});
  EXPECT_EQ(r.exit.code, 2) << r.Output();
  EXPECT_TRUE(r.StderrHas("RANK=4 is not below WORLD_SIZE=4")) << r.Output();
}

// 99999999999999999G x 2^30 used to wrap to about 1.5e18 bytes, and the doctor ran until it was
// killed; a size this machine cannot hold is refused before the rendezvous as well.
TEST(DoctorErrors, SizesThatCannotBeHeldAreRefused) {
  struct Case {
    std::vector<std::string> options;
    std::string message;
  };
  for (const Case& c : std::vector<Case>{
           {{"--max-bytes", "99999999999999999G"},
            "fsdp doctor: --max-bytes: '99999999999999999G' is too large (at most 8589934591G)"},
           {{"--min-bytes", "99999999999999999999"},
            "fsdp doctor: --min-bytes: '99999999999999999999' is too large (at most 8589934591G)"},
           {{"--max-bytes", "4T"},
            "fsdp doctor: --max-bytes: '4T' is not a size like 4096, 64K, 16M or 1G"},
           {{"--max-bytes", "8589934591G"}, "is more than this machine's memory"},
           {{"--iters", "0"}, "fsdp doctor: --iters: must be >= 1, got 0"},
       }) {
    std::vector<std::string> argv = {FsdpBinary(), "doctor", "--device", "cpu"};
    argv.insert(argv.end(), c.options.begin(), c.options.end());
    CommandResult r = RunCommand(argv, {}, std::chrono::seconds(30));
    EXPECT_FALSE(r.timed_out) << c.message;
    EXPECT_EQ(r.exit.code, 2) << r.Output();
    EXPECT_TRUE(r.StderrHas(c.message)) << r.Output();
  }
}

// Exit code 3 means the rendezvous or a collective failed; a GPU asked for on a machine without
// one is the environment (2), as `fsdp doctor --help` and the README say.
TEST(DoctorErrors, CudaWithoutAGpuIsABadEnvironment) {
  CommandResult r = RunCommand({FsdpBinary(), "doctor", "--device", "cuda"});  // no GPU visible
  EXPECT_EQ(r.exit.code, 2) << r.Output();
  EXPECT_TRUE(r.StderrHas("device 'cuda' was asked for but")) << r.Output();
  CommandResult help = RunCommand({FsdpBinary(), "doctor", "--help"});
  EXPECT_TRUE(help.StdoutHas("2 bad options or environment")) << help.Output();
}

TEST(DoctorErrors, HelpDescribesEveryOption) {
  CommandResult r = RunCommand({FsdpBinary(), "doctor", "--help"});
  EXPECT_EQ(r.exit.code, 0);
  for (const char* option : {"--mesh", "--device", "--backend", "--min-bytes", "--max-bytes",
                             "--iters", "--warmup", "--timeout"}) {
    EXPECT_TRUE(r.StdoutHas(option)) << option << "\n" << r.Output();
  }
  CommandResult launch = RunCommand({FsdpBinary(), "launch", "--help"});
  for (const char* option : {"--nproc-per-node", "--nnodes", "--node-rank", "--master-addr",
                             "--master-port", "--max-restarts"}) {
    EXPECT_TRUE(launch.StdoutHas(option)) << option << "\n" << launch.Output();
  }
}

}  // namespace
}  // namespace fsdp
