// The fsdp command line's own errors, through the binary: every mistake in the words typed is
// one line naming the flag or word and what is valid, and exit code 2 (Note [Exit codes]);
// --help still exits 0.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "common/strings.h"
#include "tests/multirank.h"

namespace fsdp {
namespace {

using testing::CommandResult;
using testing::FsdpBinary;
using testing::RunCommand;
using testing::SourceDir;

struct CliCase {
  std::vector<std::string> args;
  std::string message;  // the whole stderr line
};

// CLI11's defaults said "Value 0 not in range 0.000000 to 1797693134862315708145..." (exit 105),
// "Could not convert" (104), "A subcommand is required" for a misspelt one (106) and so on.
TEST(CommandLineErrors, OneLineAndExitCodeTwo) {
  const std::string config = SourceDir() + "/configs/default.yaml";
  for (const CliCase& c : std::vector<CliCase>{
           {{"bogus"},
            "fsdp: unknown subcommand 'bogus' (valid: launch, doctor, train, checkpoint, plan, "
            "bench)"},
           {{},
            "fsdp: a subcommand is required (valid: launch, doctor, train, checkpoint, plan, "
            "bench)"},
           {{"checkpoint", "bogus"},
            "fsdp checkpoint: unknown subcommand 'bogus' (valid: inspect, export)"},
           {{"checkpoint"}, "fsdp checkpoint: a subcommand is required (valid: inspect, export)"},
           {{"bench", "bogus"},
            "fsdp bench: unknown subcommand 'bogus' (valid: compare, kernels, sweep)"},
           {{"plan", config, "--top", "-1"}, "fsdp plan: --top: must be >= 0, got -1"},
           {{"plan", config, "--world-size", "abc"},
            "fsdp plan: --world-size: 'abc' is not an integer (must be >= 1)"},
           {{"plan", config, "--world-size", "99999999999"},
            "fsdp plan: --world-size: '99999999999' is out of range (must be in 1..2147483647)"},
           {{"doctor", "extra_positional"},
            "fsdp doctor: the following argument was not expected: extra_positional"},
           {{"bench", "compare", config, "--steps", "0"},
            "fsdp bench compare: --steps: must be >= 1, got 0"},
           {{"bench", "compare", config, "--repeats", "0"},
            "fsdp bench compare: --repeats: must be >= 1, got 0"},
           {{"bench", "compare", config, "--nproc", "-1"},
            "fsdp bench compare: --nproc: must be >= 0, got -1"},
           {{"bench", "kernels", config, "--repeats", "0"},
            "fsdp bench kernels: --repeats: must be >= 1, got 0"},
           {{"bench", "kernels", config, "--warmup", "-1"},
            "fsdp bench kernels: --warmup: must be >= 0, got -1"},
           {{"bench", "kernels", config, "--tokens", "-5"},
            "fsdp bench kernels: --tokens: must be >= 1, got -5"},
           {{"bench", "sweep", "--steps", "0"}, "fsdp bench sweep: --steps: must be >= 1, got 0"},
           {{"bench", "sweep", "--world-sizes", "1,x"},
            "fsdp bench sweep: --world-sizes: 'x' is not an integer (must be >= 1)"},
       }) {
    std::vector<std::string> argv = {FsdpBinary()};
    argv.insert(argv.end(), c.args.begin(), c.args.end());
    CommandResult r = RunCommand(argv, {}, std::chrono::seconds(30));
    EXPECT_EQ(r.exit.code, 2) << StrJoin(c.args, " ") << "\n" << r.Output();
    EXPECT_THAT(r.stderr_lines, ::testing::ElementsAre(c.message)) << r.Output();
    EXPECT_TRUE(r.stdout_lines.empty()) << r.Output();
  }
}

TEST(CommandLineErrors, HelpStillExitsZero) {
  for (std::vector<std::string> args :
       std::vector<std::vector<std::string>>{{"--help"},
                                             {"bench", "--help"},
                                             {"checkpoint", "--help"},
                                             {"plan", "--help"},
                                             {"bench", "kernels", "--help"}}) {
    args.insert(args.begin(), FsdpBinary());
    CommandResult r = RunCommand(args);
    EXPECT_EQ(r.exit.code, 0) << r.Output();
    EXPECT_TRUE(r.StdoutHas("Usage:")) << r.Output();
    EXPECT_FALSE(r.StdoutHas("179769313")) << r.Output();  // DBL_MAX, CLI11's range text
  }
}

}  // namespace
}  // namespace fsdp
