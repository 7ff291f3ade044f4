// training.profile: the kernel classes and the window (pure), and `fsdp train` writing a Kineto
// trace per rank with the trainer's phase ranges in it, plus the printed summary.
#include <filesystem>
#include <fstream>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "engine/profiler.h"
#include "tests/multirank.h"

namespace fsdp {
namespace {

using ::testing::HasSubstr;
using testing::CommandResult;
using testing::FreshTempDir;
using testing::FsdpBinary;
using testing::RunCommand;
using testing::SourceDir;

TEST(ProfileWindowTest, Parses) {
  EXPECT_FALSE(ParseProfileWindow("none")->enabled());
  std::optional<ProfileWindow> w = ParseProfileWindow("10:3");
  ASSERT_TRUE(w.has_value());
  EXPECT_EQ(w->start, 10);
  EXPECT_EQ(w->steps, 3);
  EXPECT_EQ(w->ToString(), "10:3");
  for (const char* bad : {"", "10", "10:0", "-1:2", "a:b", "3:", ":3", "1:2:3"}) {
    EXPECT_FALSE(ParseProfileWindow(bad).has_value()) << bad;
  }
}

TEST(KernelClassTest, NamesOfCudaKernelsAndAtenOperators) {
  const std::pair<const char*, const char*> cases[] = {
      {"sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm"},
      {"nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTT", "gemm"},
      {"aten::mm", "gemm"},
      {"aten::addmm", "gemm"},
      {"void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128>>", "attention"},
      {"aten::_scaled_dot_product_flash_attention_for_cpu", "attention"},
      {"void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>",
       "optimizer"},
      {"aten::_fused_adamw_", "optimizer"},
      {"ncclDevKernel_AllGather_RING_LL", "communication"},
      {"c10d::allgather_", "communication"},
      {"fsdp::comm_wait", "communication"},
      {"aten::_fused_rms_norm", "norm"},
      {"void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>",
       "elementwise"},
      {"aten::silu", "elementwise"},
      {"aten::mul", "elementwise"},
      {"void at::native::reduce_kernel<512, 1>", "reduction"},
      {"Memcpy DtoH (Device -> Pinned)", "copy/cast"},
      {"aten::copy_", "copy/cast"},
      {"aten::_log_softmax", "loss"},
      {"aten::view", "other"},
  };
  for (const auto& [name, kernel_class] : cases) EXPECT_EQ(KernelClassOf(name), kernel_class) << name;
}

TEST(KernelClassTest, SummaryIsPerStepLargestFirst) {
  std::string s = FormatKernelSummary({{"elementwise", 40, 2'000'000}, {"gemm", 20, 6'000'000}}, 2,
                                      "t.json");
  EXPECT_LT(s.find("gemm"), s.find("elementwise")) << s;
  EXPECT_THAT(s, HasSubstr("3.000")) << s;   // gemm: 6 ms over 2 steps
  EXPECT_THAT(s, HasSubstr("75.0%")) << s;
  EXPECT_THAT(s, HasSubstr("4.000   trace: t.json")) << s;  // total ms per step
}

// Phase ranges (Note: engine/trainer.cc RECORD_FUNCTION) that a profiled step must contain.
TEST(ProfileTrainTest, WritesATracePerRankWithThePhaseRanges) {
  const std::string dir = FreshTempDir("profile");
  CommandResult r = RunCommand(
      {FsdpBinary(), "train", SourceDir() + "/configs/default.yaml", "--set", "run.dir=" + dir,
       "--set", "training.device=cpu", "--set", "parallelism.nproc=2", "--set",
       "training.steps=4", "--set", "training.eval_interval=0", "--set",
       "metrics.progress_bar=off", "--set", "training.profile=1:2"},
      {}, std::chrono::seconds(240));
  ASSERT_TRUE(r.exit.ok()) << r.Output();
  EXPECT_TRUE(r.StdoutHas("profile of steps 2-3 on rank 0")) << r.Output();
  EXPECT_TRUE(r.StdoutHas("  gemm ")) << r.Output();
  for (int rank : {0, 1}) {
    const std::string trace = dir + "/profile/rank" + std::to_string(rank) + ".json";
    std::ifstream in(trace);
    ASSERT_TRUE(in.good()) << trace << "\n" << r.Output();
    nlohmann::json json = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
    ASSERT_FALSE(json.is_discarded()) << trace << " is not JSON";
    ASSERT_TRUE(json.contains("traceEvents")) << trace;
    int steps = 0, forwards = 0, optimizer_steps = 0;
    for (const nlohmann::json& e : json["traceEvents"]) {
      const std::string name = e.value("name", "");
      steps += name == "fsdp::train_step";
      forwards += name == "fsdp::forward";
      optimizer_steps += name == "fsdp::optimizer_step";
    }
    EXPECT_EQ(steps, 2) << trace;  // the window, not the steps around it
    EXPECT_GE(forwards, 2) << trace;
    EXPECT_EQ(optimizer_steps, 2) << trace;
    EXPECT_TRUE(std::filesystem::exists(dir + "/profile/rank" + std::to_string(rank) +
                                        "_summary.txt"));
  }
  std::filesystem::remove_all(dir);

  CommandResult bad = RunCommand({FsdpBinary(), "train", SourceDir() + "/configs/default.yaml",
                                  "--set", "training.steps=4", "--set", "training.profile=3:2"});
  EXPECT_EQ(bad.exit.code, 2) << bad.Output();
  EXPECT_TRUE(bad.StderrHas("training.profile: '3:2' ends after step 5 of a run of 4 steps"))
      << bad.Output();
}

// A profile folder that cannot be made is an I/O error at start (was: "peer lost", exit 7,
// after the profiled steps); a trace that kineto could not write is an error (was: exit 0).
TEST(ProfileTest, UnwritableProfileOutputIsAnIoError) {
  const std::string dir = FreshTempDir("profile-bad");
  std::ofstream(dir + "/a-file") << "x\n";
  auto train = [&](const std::string& profile_dir) {
    return RunCommand({FsdpBinary(), "train", SourceDir() + "/configs/default.yaml", "--set",
                       "run.dir=" + dir + "/run", "--set", "training.steps=3", "--set",
                       "training.profile=1:1", "--set", "training.profile_dir=" + profile_dir,
                       "--set", "parallelism.nproc=1", "--set", "metrics.progress_bar=off"});
  };
  CommandResult file = train(dir + "/a-file");
  EXPECT_EQ(file.exit.code, 4) << file.Output();
  EXPECT_TRUE(file.StderrHas("io: training.profile_dir: cannot create the profile folder '" + dir +
                             "/a-file'"))
      << file.Output();
  EXPECT_FALSE(file.StdoutHas("step      1/3")) << file.Output();
  std::filesystem::create_directories(dir + "/prof/rank0.json/x");  // the trace's name is taken
  CommandResult taken = train(dir + "/prof");
  EXPECT_EQ(taken.exit.code, 4) << taken.Output();
  EXPECT_TRUE(taken.StderrHas("training.profile: cannot write the trace '" + dir +
                              "/prof/rank0.json'"))
      << taken.Output();
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace fsdp
