// Gradient clipping (ClipGradientsByNorm, sharding/fsdp_model.h) on the CPU: the norm against
// one computed here in double, the coefficient torch.nn.utils.clip_grad_norm_ uses, and
// kNoClipping, which computes the norm and leaves the gradients as they are.
#include <cmath>
#include <limits>
#include <vector>

#include <ATen/ATen.h>

#include "gtest/gtest.h"
#include "sharding/fsdp_model.h"

namespace fsdp {
namespace {

const c10::Device kCpu(c10::kCPU);

// fp32 and bf16 gradients of a few shapes, as a model's mixed .grads.
std::vector<at::Tensor> SomeGradients() {
  at::manual_seed(7);
  return {at::randn({3, 5}), at::randn({17}), at::randn({4, 4}).to(at::kBFloat16),
          at::randn({1})};
}

std::vector<at::Tensor> Clones(const std::vector<at::Tensor>& grads) {
  std::vector<at::Tensor> copies;
  for (const at::Tensor& g : grads) copies.push_back(g.clone());
  return copies;
}

double NormInDouble(const std::vector<at::Tensor>& grads) {
  double sum = 0;
  for (const at::Tensor& g : grads) sum += g.to(at::kDouble).pow(2).sum().item<double>();
  return std::sqrt(sum);
}

TEST(ClipTest, ScalesToTheMaxNormWithTorchsCoefficient) {
  std::vector<at::Tensor> grads = SomeGradients();
  const std::vector<at::Tensor> before = Clones(grads);
  const double norm = NormInDouble(grads);
  const double max_norm = norm / 4;
  const at::Tensor got = ClipGradientsByNorm(grads, max_norm, kCpu, nullptr);
  EXPECT_EQ(got.scalar_type(), at::kFloat);
  EXPECT_NEAR(got.item<double>(), norm, 1e-5 * norm);
  const double coef = max_norm / (got.item<double>() + 1e-6);
  for (size_t i = 0; i < grads.size(); ++i) {
    const at::Tensor expected = (before[i].to(at::kFloat) * coef).to(before[i].scalar_type());
    EXPECT_TRUE(at::allclose(grads[i].to(at::kFloat), expected.to(at::kFloat), 1e-5, 1e-6))
        << "gradient " << i;
  }
  EXPECT_NEAR(NormInDouble(grads), max_norm, 1e-2 * max_norm);  // bf16's rounding

  // Below the max norm: a coefficient of 1, the values unchanged.
  std::vector<at::Tensor> small = SomeGradients();
  ClipGradientsByNorm(small, norm * 2, kCpu, nullptr);
  for (size_t i = 0; i < small.size(); ++i) EXPECT_TRUE(at::equal(small[i], before[i]));
}

TEST(ClipTest, NoClippingGivesTheNormAndTouchesNothing) {
  std::vector<at::Tensor> grads = SomeGradients();
  const std::vector<at::Tensor> before = Clones(grads);
  std::vector<const void*> storage;
  for (const at::Tensor& g : grads) storage.push_back(g.data_ptr());
  const int64_t version = grads[0]._version();

  const at::Tensor norm = ClipGradientsByNorm(grads, kNoClipping, kCpu, nullptr);
  // The same norm as clipping computes, to the bit.
  std::vector<at::Tensor> clipped = Clones(before);
  EXPECT_TRUE(at::equal(norm, ClipGradientsByNorm(clipped, 1e30, kCpu, nullptr)));
  EXPECT_NEAR(norm.item<double>(), NormInDouble(before), 1e-5 * NormInDouble(before));
  for (size_t i = 0; i < grads.size(); ++i) {
    EXPECT_TRUE(at::equal(grads[i], before[i])) << "gradient " << i;
    EXPECT_EQ(grads[i].data_ptr(), storage[i]);
  }
  EXPECT_EQ(grads[0]._version(), version) << "no in-place op ran on the gradients";

  const ClipNorm terms = ClipNormFromTerms(ClipNormTerms(before), kNoClipping, kCpu, nullptr);
  EXPECT_FALSE(terms.coef.defined());
  EXPECT_TRUE(at::equal(terms.norm, norm));
}

// A non-finite gradient with clipping off: the norm says so and the other gradients keep their
// values (a coefficient from max_norm / inf would have zeroed them).
TEST(ClipTest, NoClippingLeavesFiniteGradientsBesideAnInfiniteOne) {
  std::vector<at::Tensor> grads = SomeGradients();
  grads[1][3] = std::numeric_limits<float>::infinity();
  const std::vector<at::Tensor> before = Clones(grads);
  const at::Tensor norm = ClipGradientsByNorm(grads, kNoClipping, kCpu, nullptr);
  EXPECT_TRUE(std::isinf(norm.item<float>()));
  for (size_t i = 0; i < grads.size(); ++i) EXPECT_TRUE(at::equal(grads[i], before[i]));
}

}  // namespace
}  // namespace fsdp
