// CUDA / NCCL. Each test skips with a message when no GPU is visible (CI never has one); on the
// GPU machine they check NCCL at world size 1 and Gloo on CUDA tensors with two ranks (NCCL
// refuses two ranks on one GPU), and `fsdp bench compare` on CUDA.
#include <filesystem>
#include <fstream>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "device_mesh/cuda_support.h"
#include "device_mesh/device_mesh.h"
#include "models/gpt/gpt.h"
#include "tests/multirank.h"
#include "tests/parity.h"

namespace fsdp {
namespace {

TEST(GpuTest, NcclAllReduceWorldSizeOne) {
  FSDP_SKIP_WITHOUT_GPU();
  DistOptions options = testing::TestDistOptions();
  options.device = "cuda";
  options.cuda_backend = "nccl";
  absl::StatusOr<std::shared_ptr<DistContext>> ctx =
      DistContext::Init(*ParseLaunchEnv(MapEnv({})), options);
  ASSERT_TRUE(ctx.ok()) << ctx.status();
  ASSERT_TRUE((*ctx)->device().is_cuda());
  at::Tensor t = at::full({1024}, 3.0, at::TensorOptions().device((*ctx)->device()));
  (*ctx)->world().AllReduce(t)->wait();
  EXPECT_EQ(t.sum().item<float>(), 3.0f * 1024);
  at::Tensor out = at::empty({1024}, t.options());
  (*ctx)->world().AllGatherInto(out, t)->wait();
  EXPECT_TRUE(out.eq(3.0).all().item<bool>());
}

TEST(GpuTest, GlooOnCudaTensorsTwoRanks) {
  FSDP_SKIP_WITHOUT_GPU();
  testing::RunOnRanks(2, [](int rank) {
    DistOptions options = testing::TestDistOptions();
    options.device = "cuda";
    options.cuda_backend = "gloo";
    std::shared_ptr<DistContext> ctx = testing::InitDist(options);
    ASSERT_TRUE(ctx->device().is_cuda());
    at::Tensor t = at::full({256}, rank + 1.0, at::TensorOptions().device(ctx->device()));
    ctx->world().AllReduce(t)->wait();
    EXPECT_TRUE(t.eq(3.0).all().item<bool>());
    at::Tensor out = at::empty({512}, t.options());
    at::Tensor mine = at::full({256}, static_cast<double>(rank), t.options());
    ctx->world().AllGatherInto(out, mine)->wait();
    EXPECT_EQ(out.sum().item<float>(), 256.0f);
  });
}

TEST(GpuTest, NcclRefusedClearlyWithoutAGpuOrInCpuBuild) {
  if (CudaDeviceCount() > 0) GTEST_SKIP() << "a GPU is visible; this checks the no-GPU error";
  DistOptions options = testing::TestDistOptions();
  options.device = "cuda";
  absl::StatusOr<std::shared_ptr<DistContext>> ctx =
      DistContext::Init(*ParseLaunchEnv(MapEnv({})), options);
  ASSERT_FALSE(ctx.ok());
  EXPECT_EQ(ctx.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(ctx.status().message()),
              ::testing::HasSubstr("device 'cuda' was asked for but"));
}

// The engine's parity on the GPU: world size 1 on NCCL, 2 on Gloo with CUDA tensors (NCCL
// refuses two ranks on one GPU), fp32 and bf16 compute with fp32 reduction.
class GpuParityTest : public ::testing::TestWithParam<testing::ParityCase> {};

TEST_P(GpuParityTest, MatchesSingleProcessReference) {
  FSDP_SKIP_WITHOUT_GPU();
  const testing::ParityCase c = GetParam();
  testing::RunOnRanks(c.world, [&](int rank) { testing::RunParity(c, rank); });
}

std::vector<testing::ParityCase> GpuCases() {
  std::vector<testing::ParityCase> cases;
  for (bool bf16 : {false, true}) {
    testing::ParityCase nccl{"full_shard", 1};
    nccl.bf16 = bf16;
    nccl.device = "cuda";
    nccl.cuda_backend = "nccl";
    cases.push_back(nccl);
    testing::ParityCase gloo{"full_shard", 2};
    gloo.bf16 = bf16;
    gloo.device = "cuda";
    gloo.cuda_backend = "gloo";
    cases.push_back(gloo);
  }
  testing::ParityCase hsdp{"hybrid_shard", 2, 2};
  hsdp.bf16 = true;
  hsdp.device = "cuda";
  hsdp.cuda_backend = "gloo";
  cases.push_back(hsdp);
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Cuda, GpuParityTest, ::testing::ValuesIn(GpuCases()),
                         [](const ::testing::TestParamInfo<testing::ParityCase>& info) {
                           return info.param.Name();
                         });

// `fsdp bench compare` on the GPU: fsdp.cpp (NCCL, world size 1), the default reference modes
// (fsdp2, eager, compile), fsdp2-parity and the unwrapped model in bf16 from the same weights
// and batches; the report has the allocator's peak and MFU, and every mode's loss check passes.
TEST(GpuBenchTest, CompareOneRankWithTheUnwrappedModel) {
  FSDP_SKIP_WITHOUT_GPU();
  std::string dir = testing::FreshTempDir("gpu-compare");
  testing::CommandResult r = testing::RunCommand(
      {testing::FsdpBinary(), "bench", "compare", testing::SourceDir() + "/configs/default.yaml",
       "--nproc", "1", "--steps", "6", "--warmup", "2", "--no-plot", "--out", dir, "--set",
       "training.device=cuda", "--set", "training.mixed_precision=bf16", "--reference",
       "fsdp2,eager,compile,fsdp2-parity"},
      testing::WithGpus(), std::chrono::seconds(300));
  ASSERT_TRUE(r.exit.ok()) << r.Output();
  std::ifstream in(dir + "/compare.json");
  nlohmann::json report = nlohmann::json::parse(in);
  EXPECT_EQ(report["memory_kind"], "allocated (CUDA)");
  for (const char* engine : {"fsdp.cpp", "fsdp2", "eager", "compile", "fsdp2-parity", "unwrapped"}) {
    const nlohmann::json& e = report["engines"][engine];
    EXPECT_GT(e["peak_memory_bytes"].get<int64_t>(), 0) << engine;
    EXPECT_GT(e["mfu"].get<double>(), 0) << engine;
  }
  // bf16 compute, fp32 masters and reductions in all three: agreement to bf16 rounding.
  EXPECT_LT(report["max_loss_rel_diff"].get<double>(), 1e-2) << report.dump(1);
  for (const char* mode : {"fsdp2", "eager", "compile", "fsdp2-parity"}) {
    EXPECT_EQ(report["references"][mode]["loss_check"], "PASS") << mode << " " << report.dump(1);
  }
  for (const char* engine : {"fsdp.cpp", "fsdp2", "fsdp2-parity"}) {
    EXPECT_LT(report["vs_unwrapped"][engine]["max_loss_rel_diff"].get<double>(), 1e-2)
        << engine << " " << report.dump(1);
  }
  std::filesystem::remove_all(dir);
}

// training.deterministic on CUDA: two runs of the same configuration give the same losses and
// gradient norms to the bit (bf16, fused kernels, the attention backend the mode allows), as the
// README promises. Without the mode, cuDNN attention's and the embedding backward's atomics may
// differ in the last bits from the second step on.
TEST(GpuDeterminismTest, RepeatedRunsAreBitwiseEqualOnCuda) {
  FSDP_SKIP_WITHOUT_GPU();
  std::vector<std::vector<std::pair<double, double>>> runs;
  for (int repeat = 0; repeat < 2; ++repeat) {
    std::string dir = testing::FreshTempDir("gpu-deterministic");
    testing::CommandResult r = testing::RunCommand(
        {testing::FsdpBinary(), "train", testing::SourceDir() + "/configs/default.yaml", "--quiet",
         "--set", "training.device=cuda", "--set", "training.mixed_precision=bf16", "--set",
         "training.deterministic=true", "--set", "parallelism.nproc=1", "--set",
         "training.steps=8", "--set", "training.log_interval=1", "--set",
         "training.eval_interval=0", "--set", "checkpoint.enabled=false", "--set",
         "run.dir=" + dir},
        testing::WithGpus(), std::chrono::seconds(300));
    ASSERT_TRUE(r.exit.ok()) << r.Output();
    std::ifstream in(dir + "/metrics.jsonl");
    std::vector<std::pair<double, double>>& steps = runs.emplace_back();
    for (std::string line; std::getline(in, line);) {
      nlohmann::json record = nlohmann::json::parse(line);
      if (!record.contains("loss") || !record.contains("grad_norm")) continue;
      steps.emplace_back(record["loss"].get<double>(), record["grad_norm"].get<double>());
    }
    std::filesystem::remove_all(dir);
  }
  ASSERT_EQ(runs[0].size(), 8u);
  EXPECT_EQ(runs[0], runs[1]);
}

// model.kernels=fused on CUDA (the CUDA kernels) against composite on CUDA: a GQA Llama's loss
// and every gradient, fp32 (tight) and bf16 (bf16 rounding).
TEST(GpuKernelsTest, FusedModelEqualsCompositeOnCuda) {
  FSDP_SKIP_WITHOUT_GPU();
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    GptConfig c;
    c.arch = "llama";
    c.vocab_size = 1000;
    c.dim = 256;
    c.n_layers = 2;
    c.n_heads = 8;
    c.n_kv_heads = 2;
    c.seq_len = 130;
    c.norm = NormKind::kRmsNorm;
    c.activation = Activation::kSwiglu;
    c.positions = Positions::kRope;
    c.tie_embeddings = false;
    c.loss_chunk_tokens = 97;
    at::manual_seed(5);
    c10::Device cuda(c10::kCUDA, 0);
    at::Tensor tokens = at::randint(1000, {3, 130}).to(cuda);
    at::Tensor targets = at::randint(1000, {3, 130}).to(cuda);
    double losses[2];
    std::vector<at::Tensor> grads[2];
    for (int fused = 0; fused < 2; ++fused) {
      c.kernels = fused ? KernelMode::kFused : KernelMode::kComposite;
      Gpt model(c);
      model->MaterializeSeeded(3);
      model->to(cuda, dtype);
      at::Tensor loss = model->loss(tokens, targets);
      loss.backward();
      losses[fused] = loss.item<double>();
      for (const auto& p : model->parameters()) grads[fused].push_back(p.grad().to(at::kFloat));
    }
    const bool bf16 = dtype == at::kBFloat16;
    EXPECT_NEAR(losses[1], losses[0], (bf16 ? 2e-2 : 1e-5) * std::abs(losses[0])) << dtype;
    for (size_t i = 0; i < grads[0].size(); ++i) {
      double scale = grads[0][i].abs().max().item<double>();
      double diff = (grads[1][i] - grads[0][i]).abs().max().item<double>();
      EXPECT_LE(diff, (bf16 ? 5e-2 : 1e-4) * scale + 1e-6) << dtype << " parameter " << i;
    }
  }
}

}  // namespace
}  // namespace fsdp
