// CUDA / NCCL. Each test skips with a message when no GPU is visible (CI never has one); on the
// GPU machine they check NCCL at world size 1 and Gloo on CUDA tensors with two ranks (NCCL
// refuses two ranks on one GPU).
#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "device_mesh/cuda_support.h"
#include "device_mesh/device_mesh.h"
#include "tests/multirank.h"
#include "tests/parity.h"

namespace fsdp {
namespace {

#define FSDP_SKIP_WITHOUT_GPU()                                                           \
  if (CudaDeviceCount() == 0) {                                                           \
    GTEST_SKIP() << (IsCudaBuild() ? "no CUDA device visible on this machine"              \
                                   : "CPU-only build (CUDA toolkit did not match torch)"); \
  }

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

}  // namespace
}  // namespace fsdp
