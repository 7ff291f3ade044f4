// Hardware profiles (planner/hardware.cc) and `fsdp plan` itself (cli/plan_command.cc):
// the fsdp binary next to this one in the build's bin/ folder (skipped when it is not built).
#include <sys/wait.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "absl/strings/str_split.h"
#include "common/strings.h"
#include "models/gpt/gpt.h"
#include "planner/cost_model.h"
#include "planner/search.h"
#include "tests/planner_testing.h"

namespace fsdp::plan {
namespace {

using ::testing::HasSubstr;
TEST(HardwareJsonTest, BaseOverridesAndErrors) {
  absl::StatusOr<Hardware> hw = ParseHardwareJson(
      R"({"base": "h100", "name": "my-h100", "inter_node_bw": 20e9})", "x.json");
  ASSERT_TRUE(hw.ok()) << hw.status();
  EXPECT_EQ(hw->name, "my-h100");
  EXPECT_EQ(hw->inter_node_bw, 20e9);
  EXPECT_EQ(hw->peak_flops_bf16, HardwareByName("h100")->peak_flops_bf16);
  // Round trip.
  absl::StatusOr<Hardware> again = ParseHardwareJson(HardwareToJson(*hw), "y.json");
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->inter_node_bw, 20e9);
  EXPECT_EQ(again->memory_bytes, hw->memory_bytes);

  auto message = [](const std::string& text) {
    return std::string(ParseHardwareJson(text, "x.json").status().message());
  };
  EXPECT_THAT(message(R"({"base": "h100", "memroy_bytes": 1})"),
              HasSubstr("x.json: unknown key 'memroy_bytes'"));
  EXPECT_THAT(message(R"({"base": "tpu"})"), HasSubstr("base: --gpu 'tpu'"));
  EXPECT_THAT(message(R"({"base": "h100", "comm_overlap": 2})"), HasSubstr("<= 1"));
  EXPECT_THAT(message(R"({"peak_flops_fp32": 1e12})"), HasSubstr("memory_bytes"));
  EXPECT_THAT(message("[1, 2"), HasSubstr("x.json: not valid JSON"));
  EXPECT_THAT(message("[1, 2]"), HasSubstr("x.json: not a JSON object (array)"));
}

// Red team: {"base": "h100", "peak_flops_fp32": 0} with an fp32 run gave -nan step times and
// still a recommendation. Each number is checked against its range, an overflow is named as
// such, and the run's precision needs its peak rate.
TEST(HardwareJsonTest, RangesOverflowAndThePrecisionsPeakRate) {
  auto message = [](const std::string& text) {
    return std::string(ParseHardwareJson(text, "x.json").status().message());
  };
  EXPECT_THAT(message(R"({"base": "h100", "usable_memory_fraction": 0})"),
              HasSubstr("x.json: usable_memory_fraction: 0 is out of range (valid: > 0 and <= 1)"));
  EXPECT_THAT(message(R"({"base": "h100", "usable_memory_fraction": 1.5})"),
              HasSubstr("usable_memory_fraction: 1.5 is out of range"));
  EXPECT_THAT(message(R"({"base": "h100", "intra_node_latency_s": 1e300})"),
              HasSubstr("intra_node_latency_s: 1e+300 is out of range"));
  EXPECT_THAT(message(R"({"base": "h100", "inter_node_latency_s": -1e-6})"),
              HasSubstr("inter_node_latency_s: -1e-06 is out of range"));
  EXPECT_THAT(message(R"({"base": "h100", "memory_bw": 1e-300})"),
              HasSubstr("memory_bw: 1e-300 is out of range"));
  EXPECT_THAT(message(R"({"base": "h100", "compute_efficiency": 0})"),
              HasSubstr("compute_efficiency: 0 is out of range"));
  EXPECT_THAT(message(R"({"base": "h100", "intra_node_latency_s": 1e400})"),
              HasSubstr("x.json: not valid JSON: number overflow parsing '1e400'"));
  EXPECT_THAT(message(R"({"base": "h100", "memory_bytes": "80G"})"),
              HasSubstr("memory_bytes: expected a number, got \"80G\""));
  EXPECT_THAT(message(R"({"base": "h100", "cores_per_node": 10000000000})"),
              HasSubstr("cores_per_node: expected an integer >= 0 and <= 2147483647"));
  // The host loops' costs: 0 (the built-in) or a factor in [0.05, 100].
  EXPECT_THAT(message(R"({"base": "h100", "host_loop_cost": 0.01})"),
              HasSubstr("host_loop_cost: 0.01 is out of range (valid: 0 or >= 0.05 and <= 100)"));
  EXPECT_THAT(message(R"({"base": "h100", "host_add_loop_cost": -1})"),
              HasSubstr("host_add_loop_cost: -1 is out of range"));
  absl::StatusOr<Hardware> costs = ParseHardwareJson(
      R"({"base": "h100", "host_loop_cost": 1.5, "host_add_loop_cost": 0.9})", "x.json");
  ASSERT_TRUE(costs.ok()) << costs.status();
  EXPECT_EQ(costs->host_loop_cost, 1.5);
  EXPECT_EQ(ParseHardwareJson(HardwareToJson(*costs), "y.json")->host_add_loop_cost, 0.9);
  // Zero latency and a zero host link are valid (a profile without offload).
  EXPECT_TRUE(ParseHardwareJson(R"({"base": "h100", "intra_node_latency_s": 0, "host_link_bw": 0})",
                                "x.json")
                  .ok());

  // fp32 needs peak_flops_fp32; bf16 falls back to it only where the profile has no bf16 rate.
  const std::string path = ::testing::TempDir() + "/no_fp32.json";
  std::ofstream(path) << R"({"base": "h100", "peak_flops_fp32": 0})";
  absl::StatusOr<PlanRequest> r = MakePlanRequest(ConfigPath("default"), {}, 2, 2, "h100", path);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(r.status().message()),
              HasSubstr(StrCat("--hardware ", path,
                               ": peak_flops_fp32 must be > 0 for "
                               "training.mixed_precision fp32")));
  r = MakePlanRequest(ConfigPath("default"), {"training.mixed_precision=bf16"}, 2, 2, "h100", path);
  ASSERT_TRUE(r.ok()) << r.status();
  absl::StatusOr<Recommendation> rec = Recommend(*r);
  ASSERT_TRUE(rec.ok()) << rec.status();
  EXPECT_TRUE(std::isfinite(rec->best->time.step_s));
  // A profile built in code: an error, not NaN.
  PlanRequest fp32 = Request("default", 2, 2, "h100");
  fp32.hw.peak_flops_fp32 = 0;
  absl::StatusOr<Prediction> p = Predict(fp32, {Strategy::kFullShard, 1, 2});
  ASSERT_FALSE(p.ok());
  EXPECT_THAT(std::string(p.status().message()), HasSubstr("peak_flops_fp32"));
}

// `fsdp plan` itself (cli/plan_command.cc): the fsdp binary next to this one in the build's
// bin/ folder.
struct CliRun {
  int rc = -1;
  std::string output;  // stdout and stderr
};

std::string FsdpBinary() {
  return (std::filesystem::read_symlink("/proc/self/exe").parent_path() / "fsdp").string();
}

CliRun RunFsdp(const std::vector<std::string>& args) {
  std::string command = FsdpBinary();
  for (const std::string& a : args) {
    std::string quoted = "'";
    for (char c : a) quoted += c == '\'' ? std::string("'\\''") : std::string(1, c);
    command += " " + quoted + "'";
  }
  command += " 2>&1";
  CliRun run;
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return run;
  char buffer[4096];
  size_t got;
  while ((got = fread(buffer, 1, sizeof(buffer), pipe)) > 0) run.output.append(buffer, got);
  const int status = pclose(pipe);
  run.rc = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return run;
}

class PlanCliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!std::filesystem::exists(FsdpBinary())) {
      GTEST_SKIP() << FsdpBinary() << " is not built (cmake --build build --target fsdp)";
    }
    dir_ = std::filesystem::path(::testing::TempDir()) /
           ::testing::UnitTest::GetInstance()->current_test_info()->name();
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  CliRun Plan(std::vector<std::string> args) {
    args.insert(args.begin(), {"plan", ConfigPath("default"), "--world-size", "2"});
    return RunFsdp(args);
  }
  std::filesystem::path dir_;
};

// Red team: --out without --calibrate wrote nothing with exit 0, --json "" wrote nothing
// silently, --gpus-per-node 0 was taken for the default. Each is an error naming the option.
TEST_F(PlanCliTest, EveryOptionGivenIsUsedOrAnError) {
  const std::string out = (dir_ / "x.json").string();
  CliRun run = Plan({"--out", out});
  EXPECT_EQ(run.rc, 2) << run.output;
  EXPECT_THAT(run.output, HasSubstr("--out is the output of --calibrate"));
  EXPECT_FALSE(std::filesystem::exists(out));
  run = Plan({"--json", ""});
  EXPECT_EQ(run.rc, 2) << run.output;
  EXPECT_THAT(run.output, HasSubstr("--json"));
  run = Plan({"--gpus-per-node", "0"});
  EXPECT_EQ(run.rc, 2) << run.output;
  EXPECT_THAT(run.output, HasSubstr("--gpus-per-node"));
  EXPECT_THAT(run.output, ::testing::Not(HasSubstr("recommended")));
  run = RunFsdp({"plan", "--calibrate", "--json", out});
  EXPECT_EQ(run.rc, 2) << run.output;
  EXPECT_THAT(run.output, HasSubstr("--calibrate measures this machine and takes no --json"));
  run = RunFsdp({"plan", ConfigPath("default"), "--calibrate"});
  EXPECT_EQ(run.rc, 2) << run.output;
  EXPECT_THAT(run.output, HasSubstr("takes no CONFIG"));
}

// `fsdp plan --calibrate-host`: the named profile (--gpu or --hardware) with this machine's host
// figures, measured by `fsdp bench host`; a plan with it names them. Its options are checked
// before anything is measured.
TEST_F(PlanCliTest, CalibrateHostKeepsTheGpuAndMeasuresTheHost) {
  const std::string out = (dir_ / "host.json").string();
  CliRun run = RunFsdp({"plan", "--calibrate-host", "--gpu", "h200", "--out", out});
  ASSERT_EQ(run.rc, 0) << run.output;
  std::ifstream in(out);
  const nlohmann::json profile = nlohmann::json::parse(in);
  const Hardware h200 = *HardwareByName("h200");
  EXPECT_EQ(profile["peak_flops_bf16"].get<double>(), h200.peak_flops_bf16);
  EXPECT_EQ(profile["host_link_bw"].get<double>(), h200.host_link_bw);
  EXPECT_GT(profile["host_rank_bw"].get<double>(), 1e8) << run.output;
  EXPECT_NE(profile["host_rank_bw"].get<double>(), h200.host_rank_bw);
  EXPECT_GE(profile["host_memory_bw"].get<double>(), profile["host_rank_bw"].get<double>());
  EXPECT_GT(profile["host_memory_bytes"].get<double>(), 0);
  EXPECT_NE(profile["host_memory_bytes"].get<double>(), h200.host_memory_bytes);
  if (run.output.find("not available here") == std::string::npos) {
    EXPECT_GT(profile["host_loop_cost"].get<double>(), 0);
    EXPECT_GT(profile["host_add_loop_cost"].get<double>(), 0);
  }
  EXPECT_THAT(run.output, HasSubstr("fsdp plan --calibrate-host"));
  run = RunFsdp({"plan", ConfigPath("llama_1b"), "--world-size", "1", "--hardware", out, "--set",
                 "parallelism.offload=params"});
  ASSERT_EQ(run.rc, 0) << run.output;
  EXPECT_THAT(run.output, HasSubstr("host AdamW "));

  // A profile file as the base.
  const std::string base = (dir_ / "base.json").string();
  std::ofstream(base) << R"({"base": "a100-80gb", "name": "mine"})";
  run = RunFsdp({"plan", "--calibrate-host", "--hardware", base});
  ASSERT_EQ(run.rc, 0) << run.output;
  EXPECT_THAT(run.output, HasSubstr("\"name\": \"mine\""));

  run = RunFsdp({"plan", "--calibrate", "--calibrate-host"});
  EXPECT_EQ(run.rc, 2) << run.output;
  EXPECT_THAT(run.output, HasSubstr("are one or the other"));
  run = RunFsdp({"plan", ConfigPath("default"), "--calibrate-host", "--world-size", "2"});
  EXPECT_EQ(run.rc, 2) << run.output;
  EXPECT_THAT(run.output, HasSubstr("--calibrate-host measures this machine and takes no CONFIG, "
                                    "--world-size"));
  run = RunFsdp({"plan", "--calibrate-host", "--gpu", "tpu"});
  EXPECT_EQ(run.rc, 2) << run.output;
  EXPECT_THAT(run.output, HasSubstr("tpu"));
  EXPECT_THAT(run.output, ::testing::Not(HasSubstr("running:")));  // nothing measured
  run = RunFsdp({"plan", "--calibrate-host", "--out", "/nonexistent/x.json"});
  EXPECT_EQ(run.rc, 2) << run.output;
  EXPECT_THAT(run.output, ::testing::Not(HasSubstr("running:")));
}

// Red team: --json /nonexistent/x.json printed the whole plan, then failed; --calibrate --out
// to a missing folder calibrated first. The paths are checked before any work.
TEST_F(PlanCliTest, OutputFilesAreCheckedBeforeTheWork) {
  CliRun run = Plan({"--json", "/nonexistent/x.json"});
  EXPECT_EQ(run.rc, 2) << run.output;
  EXPECT_THAT(run.output,
              HasSubstr("--json /nonexistent/x.json: the folder /nonexistent does not exist"));
  EXPECT_THAT(run.output, ::testing::Not(HasSubstr("recommended")));
  run = Plan({"--json", dir_.string()});
  EXPECT_EQ(run.rc, 2) << run.output;
  EXPECT_THAT(run.output, HasSubstr("is a folder"));
  run = RunFsdp({"plan", "--calibrate", "--out", "/nonexistent/x.json"});
  EXPECT_EQ(run.rc, 2) << run.output;
  EXPECT_THAT(run.output,
              HasSubstr("--out /nonexistent/x.json: the folder /nonexistent does not exist"));
  EXPECT_THAT(run.output, ::testing::Not(HasSubstr("gemm")));  // nothing measured

  // A writable path: the plan, with every memory part in the JSON.
  const std::string json = (dir_ / "plan.json").string();
  run = RunFsdp(
      {"plan", ConfigPath("llama_1b"), "--world-size", "16", "--gpu", "a100-40gb", "--json", json});
  ASSERT_EQ(run.rc, 0) << run.output;
  EXPECT_THAT(run.output, HasSubstr("partial gradient sums"));
  std::ifstream in(json);
  const nlohmann::json plan = nlohmann::json::parse(in);
  for (const nlohmann::json& layout : plan["layouts"]) {
    const nlohmann::json& m = layout["memory_bytes"];
    const double parts = m["params"].get<double>() + m["grads"].get<double>() +
                         m["optimizer"].get<double>() + m["unsharded_units"].get<double>() +
                         m["activations"].get<double>() + m["padding"].get<double>() +
                         m["partial_grads"].get<double>();
    EXPECT_NEAR(parts, m["total"].get<double>(), 1e-6 * parts) << layout["runs_as"];
  }
}

// Inputs that crashed or gave NaN exit with 2 and the reason.
TEST_F(PlanCliTest, BadInputsExitWithTwo) {
  CliRun run = Plan({"--set", "parallelism.reshard_after_forward=3"});
  EXPECT_EQ(run.rc, 2) << run.output;
  EXPECT_THAT(run.output, HasSubstr("must divide the shard degree"));
  const std::string hw = (dir_ / "hw.json").string();
  std::ofstream(hw) << R"({"base": "h100", "peak_flops_fp32": 0})";
  run = Plan({"--hardware", hw});
  EXPECT_EQ(run.rc, 2) << run.output;
  EXPECT_THAT(run.output, HasSubstr("peak_flops_fp32 must be > 0"));
  EXPECT_THAT(run.output, ::testing::Not(HasSubstr("nan")));
}

}  // namespace
}  // namespace fsdp::plan
