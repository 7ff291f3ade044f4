// kernels::SwiGlu against silu(gate) * up in ATen ops: forward and backward, fp32 and bf16,
// sizes that are not multiples of any block size. CPU reference always; CUDA kernel with a GPU.
#include "kernels/swiglu.h"

#include <cstdint>
#include <vector>

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
          {{4, 2 * 4096}, at::kBFloat16, 1e-2, 1e-2},
          {{5, 2 * 333}, at::kHalf, 1e-2, 1e-2}};
}

TEST(KernelsSwiGluTest, CpuMatchesComposite) {
  for (const Case& c : Cases()) CheckAgainstComposite(c, c10::kCPU);
}

TEST(KernelsSwiGluTest, CudaMatchesComposite) {
  FSDP_SKIP_WITHOUT_GPU();
  for (const Case& c : Cases()) CheckAgainstComposite(c, c10::Device(c10::kCUDA, 0));
}

TEST(KernelsSwiGluTest, RejectsOddWidthMismatchedHalvesAndIntegerInput) {
  EXPECT_THROW(SwiGlu(torch::zeros({2, 3})), c10::Error);
  EXPECT_THROW(SwiGlu(torch::zeros({2, 4}, torch::kInt)), c10::Error);
  EXPECT_THROW(SwiGlu(torch::zeros({2, 4}), torch::zeros({2, 5})), c10::Error);
  EXPECT_THROW(SwiGlu(torch::zeros({2, 4}), torch::zeros({2, 4}, torch::kDouble)), c10::Error);
}

// Non-contiguous inputs and upstream gradient, F odd: gate_up as a transposed view, gate and
// up as column slices of one [rows, 3F] buffer (row stride 3F, up not on an even element):
// forward and gradients against the composite in fp32 on the same values.
void CheckNonContiguous(at::ScalarType dtype, c10::Device device) {
  SCOPED_TRACE(::testing::Message() << dtype << " on " << device);
  torch::manual_seed(19);
  const double rtol = dtype == at::kFloat ? 1e-5 : 1e-2, atol = dtype == at::kFloat ? 1e-6 : 1e-2;
  const int64_t rows = 37, f = 65;
  at::Tensor gate_up0 = (torch::randn({2 * f, rows}) * 3).to(device, dtype).t();  // [rows, 2F]
  at::Tensor buffer = (torch::randn({rows, 3 * f}) * 3).to(device, dtype);
  at::Tensor dy = torch::randn({f, rows}).to(device, dtype).t();  // [rows, F], not contiguous
  ASSERT_FALSE(gate_up0.is_contiguous() || dy.is_contiguous());
  {
    at::Tensor in = gate_up0.clone().requires_grad_(true);
    at::Tensor ref = gate_up0.to(at::kFloat).requires_grad_(true);
    at::Tensor y = SwiGlu(in), y_ref = SwiGluComposite(ref);
    EXPECT_TRUE(AllClose(y, y_ref, rtol, atol, "gate_up: forward"));
    y.backward(dy);
    y_ref.backward(dy.to(at::kFloat));
    EXPECT_TRUE(AllClose(in.grad(), ref.grad(), rtol, atol, "gate_up: gradient"));
  }
  {
    at::Tensor b = buffer.clone().requires_grad_(true);
    at::Tensor b_ref = buffer.to(at::kFloat).requires_grad_(true);
    at::Tensor y = SwiGlu(b.narrow(1, 0, f), b.narrow(1, f + 1, f));
    at::Tensor y_ref = SwiGluComposite(b_ref.narrow(1, 0, f), b_ref.narrow(1, f + 1, f));
    EXPECT_TRUE(AllClose(y, y_ref, rtol, atol, "two slices: forward"));
    y.backward(dy);
    y_ref.backward(dy.to(at::kFloat));
    EXPECT_TRUE(AllClose(b.grad(), b_ref.grad(), rtol, atol, "two slices: gradients"));
  }
}

TEST(KernelsSwiGluTest, NonContiguousInputsAndGradients) {
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    CheckNonContiguous(dtype, c10::kCPU);
  }
}

TEST(KernelsSwiGluTest, CudaNonContiguousInputsAndGradients) {
  FSDP_SKIP_WITHOUT_GPU();
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    CheckNonContiguous(dtype, c10::Device(c10::kCUDA, 0));
  }
}

// The CUDA kernels' other paths against the CPU reference on the same values (Note [SwiGLU
// kernel layout]): rows past the 65535 of a grid's y (blocks stride over rows), the llama_1b
// width (5632: 704 packs of 8, three blocks of a row), a width that is a multiple of the fp32
// but not of the bf16 vector, and gate_up / the upstream gradient as contiguous views one
// element past a 16-byte boundary (the element path).
TEST(KernelsSwiGluTest, CudaMatchesCpuReferenceOnEveryPath) {
  FSDP_SKIP_WITHOUT_GPU();
  c10::Device cuda(c10::kCUDA, 0);
  struct PathCase {
    int64_t rows, cols;
    at::ScalarType dtype;
    bool misaligned;
  };
  const std::vector<PathCase> cases = {{70001, 8, at::kBFloat16, false},
                                       {3, 5632, at::kBFloat16, false},
                                       {2, 4100, at::kFloat, false},
                                       {2, 4100, at::kBFloat16, false},
                                       {5, 2056, at::kHalf, false},
                                       {1, 8, at::kFloat, false},
                                       {7, 5632, at::kBFloat16, true},
                                       {7, 64, at::kFloat, true}};
  for (const PathCase& c : cases) {
    SCOPED_TRACE(::testing::Message() << c.rows << " x " << c.cols << " " << c.dtype
                                      << (c.misaligned ? " misaligned" : ""));
    torch::manual_seed(23);
    at::Tensor x = (torch::randn({c.rows, 2 * c.cols}) * 3).to(c.dtype);
    at::Tensor dy = torch::randn({c.rows, c.cols}).to(c.dtype);
    std::vector<at::Tensor> results;
    for (c10::Device device : {c10::Device(c10::kCPU), cuda}) {
      auto place = [&](const at::Tensor& t) {
        if (!(c.misaligned && device.is_cuda())) return t.to(device).clone();
        at::Tensor buffer = at::empty({t.numel() + 1}, t.options().device(device));
        return buffer.narrow(0, 1, t.numel()).view(t.sizes()).copy_(t);
      };
      at::Tensor in = place(x).requires_grad_(true);
      if (c.misaligned && device.is_cuda()) {
        ASSERT_NE(reinterpret_cast<uintptr_t>(in.const_data_ptr()) % 16, 0u);
      }
      at::Tensor y = SwiGlu(in);
      y.backward(place(dy));
      results.push_back(y.detach().cpu());
      results.push_back(in.grad().cpu());
    }
    const double tol = c.dtype == at::kFloat ? 1e-5 : 1e-2;
    EXPECT_TRUE(AllClose(results[2], results[0], tol, tol, "forward"));
    EXPECT_TRUE(AllClose(results[3], results[1], tol, tol, "grad of gate_up"));
  }
}

}  // namespace
}  // namespace fsdp::kernels
