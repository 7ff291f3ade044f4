// model.attention (engine/attention.h): the backend chosen at start on this machine's CPU, and
// the errors for one that cannot run. CUDA choices are exercised by `fsdp train` on a GPU.
#include "engine/attention.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

namespace fsdp {
namespace {

using ::testing::HasSubstr;

ModelArgs Llama() {
  return ModelArgs{.arch = "llama", .dim = 64, .n_heads = 4, .n_kv_heads = 2, .seq_len = 16};
}

// Whatever is selected, SDPA afterwards uses it and only it.
TEST(AttentionBackendTest, AutoOnTheCpuIsItsFlashKernelAndIsHeld) {
  auto chosen = SelectAttentionBackend(AttentionBackend::kAuto, Llama(), at::kFloat, c10::kCPU,
                                       /*deterministic=*/false);
  ASSERT_TRUE(chosen.ok()) << chosen.status();
  EXPECT_EQ(*chosen, AttentionBackend::kFlash);
  EXPECT_TRUE(at::globalContext().userEnabledFlashSDP());
  EXPECT_FALSE(at::globalContext().userEnabledMathSDP());
  EXPECT_FALSE(at::globalContext().userEnabledCuDNNSDP());
}

TEST(AttentionBackendTest, MathIsAvailableEverywhere) {
  auto chosen = SelectAttentionBackend(AttentionBackend::kMath, Llama(), at::kFloat, c10::kCPU,
                                       false);
  ASSERT_TRUE(chosen.ok()) << chosen.status();
  EXPECT_EQ(*chosen, AttentionBackend::kMath);
  EXPECT_TRUE(at::globalContext().userEnabledMathSDP());
  EXPECT_FALSE(at::globalContext().userEnabledFlashSDP());
  // And attention still runs (on the math path).
  auto q = torch::randn({1, 4, 16, 16});
  EXPECT_EQ(at::scaled_dot_product_attention(q, q, q, {}, 0.0, true).sizes(), q.sizes());
}

TEST(AttentionBackendTest, ABackendThatCannotRunIsAConfigErrorNamingTheOnesThatCan) {
  auto chosen = SelectAttentionBackend(AttentionBackend::kCudnn, Llama(), at::kFloat, c10::kCPU,
                                       false);
  ASSERT_FALSE(chosen.ok());
  EXPECT_EQ(chosen.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(chosen.status().message(), HasSubstr("model.attention: cudnn cannot run"));
  EXPECT_THAT(chosen.status().message(), HasSubstr("backends that can: flash, math"));
}

TEST(AttentionBackendTest, DeterministicModeRefusesEfficientAndCudnn) {
  auto chosen = SelectAttentionBackend(AttentionBackend::kEfficient, Llama(), at::kFloat,
                                       c10::kCPU, /*deterministic=*/true);
  ASSERT_FALSE(chosen.ok());
  EXPECT_THAT(chosen.status().message(), HasSubstr("not deterministic"));
  auto automatic = SelectAttentionBackend(AttentionBackend::kAuto, Llama(), at::kFloat, c10::kCPU,
                                          /*deterministic=*/true);
  ASSERT_TRUE(automatic.ok());
  EXPECT_EQ(*automatic, AttentionBackend::kFlash);
}

}  // namespace
}  // namespace fsdp
