// kernels::SwiGlu against silu(gate) * up in ATen ops: forward and backward, fp32 and bf16,
// sizes that are not multiples of any block size. CPU reference always; CUDA kernel with a GPU.
#include "kernels/swiglu.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "tests/kernels_testing.h"

namespace fsdp::kernels {
namespace {

using testing::AllClose;

struct Case {
  std::vector<int64_t> shape;  // of gate_up
  at::ScalarType dtype;
  double rtol, atol;
};

// The fused result against the composite one in fp32 (the composite in bf16 rounds twice;
// ours once), and both gradients.
void CheckAgainstComposite(const Case& c, c10::Device device) {
  torch::manual_seed(7);
  at::Tensor x = (torch::randn(c.shape, torch::kFloat) * 3).to(device, c.dtype);
  at::Tensor fused_in = x.clone().requires_grad_(true);
  at::Tensor ref_in = x.to(at::kFloat).clone().requires_grad_(true);
  at::Tensor y = SwiGlu(fused_in);
  at::Tensor y_ref = SwiGluComposite(ref_in);
  EXPECT_EQ(y.scalar_type(), c.dtype);
  EXPECT_TRUE(AllClose(y, y_ref, c.rtol, c.atol, "forward"));
  at::Tensor dy = torch::randn(y.sizes(), torch::kFloat).to(device, c.dtype);
  y.backward(dy);
  y_ref.backward(dy.to(at::kFloat));
  EXPECT_TRUE(AllClose(fused_in.grad(), ref_in.grad(), c.rtol, c.atol, "grad of gate_up"));

  // The two-tensor form on the same values: the same results.
  auto halves = x.chunk(2, -1);
  at::Tensor gate = halves[0].clone().requires_grad_(true);
  at::Tensor up = halves[1].clone().requires_grad_(true);
  at::Tensor y2 = SwiGlu(gate, up);
  EXPECT_TRUE(AllClose(y2, y, 0, 0, "two tensors: forward"));
  y2.backward(dy);
  auto grad_halves = fused_in.grad().chunk(2, -1);
  EXPECT_TRUE(AllClose(gate.grad(), grad_halves[0], 0, 0, "two tensors: grad of gate"));
  EXPECT_TRUE(AllClose(up.grad(), grad_halves[1], 0, 0, "two tensors: grad of up"));
}

std::vector<Case> Cases() {
  return {{{3, 5, 2 * 129}, at::kFloat, 1e-5, 1e-6},
          {{1, 2 * 1}, at::kFloat, 1e-5, 1e-6},
          {{7, 2 * 1000}, at::kFloat, 1e-5, 1e-6},
          {{2, 33, 2 * 257}, at::kBFloat16, 1e-2, 1e-2},
          {{4, 2 * 4096}, at::kBFloat16, 1e-2, 1e-2}};
}

TEST(KernelsSwiGluTest, CpuMatchesComposite) {
  for (const Case& c : Cases()) CheckAgainstComposite(c, c10::kCPU);
}

TEST(KernelsSwiGluTest, CudaMatchesComposite) {
  FSDP_REQUIRE_CUDA();
  for (const Case& c : Cases()) CheckAgainstComposite(c, c10::Device(c10::kCUDA, 0));
}

TEST(KernelsSwiGluTest, RejectsOddWidthMismatchedHalvesAndIntegerInput) {
  EXPECT_THROW(SwiGlu(torch::zeros({2, 3})), c10::Error);
  EXPECT_THROW(SwiGlu(torch::zeros({2, 4}, torch::kInt)), c10::Error);
  EXPECT_THROW(SwiGlu(torch::zeros({2, 4}), torch::zeros({2, 5})), c10::Error);
  EXPECT_THROW(SwiGlu(torch::zeros({2, 4}), torch::zeros({2, 4}, torch::kDouble)), c10::Error);
}

TEST(KernelsSwiGluTest, NonContiguousInputIsRead) {
  at::Tensor base = torch::randn({6, 8});
  at::Tensor strided = base.t();  // [8, 6], not contiguous
  EXPECT_TRUE(AllClose(SwiGlu(strided), SwiGluComposite(strided), 1e-5, 1e-6, "strided"));
}

}  // namespace
}  // namespace fsdp::kernels
