// kernels::RmsNorm, kernels::AddRmsNorm and kernels::ForkRmsNorm against the model's composite
// in ATen ops: forward and backward (x, residual, weight; the extra gradient of h or of the
// passed-through x), fp32 and bf16, an fp32 weight with bf16 x, sizes that are not multiples of
// any block size (D = 1, 33, 1000, 4099; rows = 1, 7, 513), no rows, bad weights. CPU
// reference always; the CUDA kernels with a GPU, against the composite and against the CPU
// reference.
#include "kernels/rms_norm.h"

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "tests/kernels_testing.h"
#include "tests/op_counts.h"

namespace fsdp::kernels {
namespace {

using testing::AllClose;
using ::testing::HasSubstr;

constexpr double kEps = 1e-5;

struct Case {
  std::vector<int64_t> shape;  // of x; the last dimension is D
  at::ScalarType dtype;
  at::ScalarType weight_dtype;
  double rtol, atol;  // y and the gradients of x and residual; the weight's: see WeightTol

  std::string Name() const {
    return std::string(c10::toString(dtype)) + " x, " + c10::toString(weight_dtype) +
           " weight, shape " + c10::str(at::IntArrayRef(shape));
  }
};

// The weight's gradient sums rows: its error grows with the sum's scale, not each element's.
double WeightAtol(const Case& c, const at::Tensor& expected) {
  return c.atol * std::max(1.0, expected.abs().max().item<double>());
}

std::vector<Case> Cases() {
  std::vector<Case> cases;
  for (int64_t d : {1, 33, 1000, 4099}) {
    for (int64_t rows : {1, 7, 513}) {
      cases.push_back({{rows, d}, at::kFloat, at::kFloat, 1e-5, 1e-5});
      cases.push_back({{rows, d}, at::kBFloat16, at::kBFloat16, 1e-2, 1e-2});
      cases.push_back({{rows, d}, at::kBFloat16, at::kFloat, 1e-2, 1e-2});
    }
  }
  cases.push_back({{3, 5, 129}, at::kFloat, at::kFloat, 1e-5, 1e-5});
  cases.push_back({{2, 9, 257}, at::kHalf, at::kHalf, 1e-2, 1e-2});
  return cases;
}

struct Inputs {
  at::Tensor x, residual, weight, dy, dh;  // in the case's dtypes, on the device
};

Inputs MakeInputs(const Case& c, c10::Device device) {
  torch::manual_seed(11);
  int64_t d = c.shape.back();
  Inputs in;
  in.x = (torch::randn(c.shape) * 2).to(device, c.dtype);
  in.residual = torch::randn(c.shape).to(device, c.dtype);
  in.weight = (1 + 0.5 * torch::randn({d})).to(device, c.weight_dtype);
  in.dy = torch::randn(c.shape).to(device, c.dtype);
  in.dh = torch::randn(c.shape).to(device, c.dtype);
  return in;
}

at::Tensor Leaf(const at::Tensor& t, at::ScalarType dtype) {
  return t.to(dtype).clone().requires_grad_(true);
}

// RmsNorm against the composite run in fp32 on the same (rounded) inputs.
void CheckRmsNorm(const Case& c, c10::Device device) {
  SCOPED_TRACE(c.Name());
  Inputs in = MakeInputs(c, device);
  at::Tensor x = Leaf(in.x, c.dtype), w = Leaf(in.weight, c.weight_dtype);
  at::Tensor x_ref = Leaf(in.x, at::kFloat), w_ref = Leaf(in.weight, at::kFloat);
  at::Tensor y = RmsNorm(x, w, kEps);
  at::Tensor y_ref = RmsNormComposite(x_ref, w_ref, kEps);
  EXPECT_EQ(y.scalar_type(), c.dtype);
  EXPECT_TRUE(AllClose(y, y_ref, c.rtol, c.atol, "y"));
  y.backward(in.dy);
  y_ref.backward(in.dy.to(at::kFloat));
  EXPECT_EQ(x.grad().scalar_type(), c.dtype);
  EXPECT_EQ(w.grad().scalar_type(), c.weight_dtype);
  EXPECT_TRUE(AllClose(x.grad(), x_ref.grad(), c.rtol, c.atol, "grad of x"));
  EXPECT_TRUE(
      AllClose(w.grad(), w_ref.grad(), c.rtol, WeightAtol(c, w_ref.grad()), "grad of weight"));
}

// AddRmsNorm against the composite in fp32: with gradients for y only, or for h and y.
void CheckAddRmsNorm(const Case& c, c10::Device device, bool grad_of_h) {
  SCOPED_TRACE(c.Name() + (grad_of_h ? ", gradients of h and y" : ", gradient of y"));
  Inputs in = MakeInputs(c, device);
  at::Tensor x = Leaf(in.x, c.dtype), r = Leaf(in.residual, c.dtype);
  at::Tensor w = Leaf(in.weight, c.weight_dtype);
  at::Tensor x_ref = Leaf(in.x, at::kFloat), r_ref = Leaf(in.residual, at::kFloat);
  at::Tensor w_ref = Leaf(in.weight, at::kFloat);
  auto [h, y] = AddRmsNorm(x, r, w, kEps);
  auto [h_ref, y_ref] = AddRmsNormComposite(x_ref, r_ref, w_ref, kEps);
  EXPECT_EQ(h.scalar_type(), c.dtype);
  EXPECT_EQ(y.scalar_type(), c.dtype);
  // h is exactly ATen's add in the dtype.
  EXPECT_TRUE(at::equal(h.detach(), in.x + in.residual)) << "h is not x + residual";
  EXPECT_TRUE(AllClose(y, y_ref, c.rtol, c.atol, "y"));
  if (grad_of_h) {
    torch::autograd::backward({h, y}, {in.dh, in.dy});
    torch::autograd::backward({h_ref, y_ref}, {in.dh.to(at::kFloat), in.dy.to(at::kFloat)});
  } else {
    y.backward(in.dy);
    y_ref.backward(in.dy.to(at::kFloat));
  }
  EXPECT_TRUE(AllClose(x.grad(), x_ref.grad(), c.rtol, c.atol, "grad of x"));
  EXPECT_TRUE(AllClose(r.grad(), r_ref.grad(), c.rtol, c.atol, "grad of residual"));
  EXPECT_TRUE(
      AllClose(w.grad(), w_ref.grad(), c.rtol, WeightAtol(c, w_ref.grad()), "grad of weight"));
}

// ForkRmsNorm against {x, the composite} in fp32: gradients for y only, for the passed-through
// x only, or both (the norm's backward adds the latter to x's gradient).
enum class ForkGrads { kY, kPassedThrough, kBoth };

void CheckForkRmsNorm(const Case& c, c10::Device device, ForkGrads grads) {
  SCOPED_TRACE(c.Name() + (grads == ForkGrads::kY               ? ", gradient of y"
                           : grads == ForkGrads::kPassedThrough ? ", gradient of x's copy"
                                                                : ", gradients of both"));
  Inputs in = MakeInputs(c, device);
  at::Tensor x = Leaf(in.x, c.dtype), w = Leaf(in.weight, c.weight_dtype);
  at::Tensor x_ref = Leaf(in.x, at::kFloat), w_ref = Leaf(in.weight, at::kFloat);
  auto [x_out, y] = ForkRmsNorm(x, w, kEps);
  at::Tensor y_ref = RmsNormComposite(x_ref, w_ref, kEps);
  EXPECT_TRUE(at::equal(x_out.detach(), x.detach())) << "the first output is not x";
  EXPECT_EQ(x_out.const_data_ptr(), x.const_data_ptr()) << "the first output is a copy";
  EXPECT_EQ(y.scalar_type(), c.dtype);
  EXPECT_TRUE(AllClose(y, y_ref, c.rtol, c.atol, "y"));
  std::vector<at::Tensor> outs, outs_ref, g, g_ref;
  if (grads != ForkGrads::kPassedThrough) {
    outs = {y}, outs_ref = {y_ref}, g = {in.dy}, g_ref = {in.dy.to(at::kFloat)};
  }
  if (grads != ForkGrads::kY) {
    outs.push_back(x_out);
    outs_ref.push_back(x_ref);  // the composite passes x itself
    g.push_back(in.dh);
    g_ref.push_back(in.dh.to(at::kFloat));
  }
  torch::autograd::backward(outs, g);
  torch::autograd::backward(outs_ref, g_ref);
  EXPECT_EQ(x.grad().scalar_type(), c.dtype);
  EXPECT_TRUE(AllClose(x.grad(), x_ref.grad(), c.rtol, c.atol, "grad of x"));
  if (grads == ForkGrads::kPassedThrough) {
    EXPECT_TRUE(at::equal(x.grad(), in.dh)) << "x's copy's gradient does not pass through";
    EXPECT_FALSE(w.grad().defined() && w.grad().abs().max().item<float>() != 0);
  } else {
    EXPECT_TRUE(
        AllClose(w.grad(), w_ref.grad(), c.rtol, WeightAtol(c, w_ref.grad()), "grad of weight"));
  }
}

void CheckAll(c10::Device device) {
  for (const Case& c : Cases()) {
    CheckRmsNorm(c, device);
    CheckAddRmsNorm(c, device, /*grad_of_h=*/false);
    CheckAddRmsNorm(c, device, /*grad_of_h=*/true);
    for (ForkGrads g : {ForkGrads::kY, ForkGrads::kPassedThrough, ForkGrads::kBoth}) {
      CheckForkRmsNorm(c, device, g);
    }
  }
}

// The point of ForkRmsNorm and AddRmsNorm: x's (h's) two gradients are summed by the norm's
// backward kernel, not by an add kernel of autograd's (the composite runs one each).
void CheckNoAdds(c10::Device device) {
  torch::manual_seed(4);
  auto options = torch::TensorOptions().device(device).dtype(at::kBFloat16);
  at::Tensor x = torch::randn({7, 64}, options).requires_grad_(true);
  at::Tensor r = torch::randn({7, 64}, options).requires_grad_(true);
  at::Tensor w = torch::randn({64}, options).requires_grad_(true);
  at::Tensor dy = torch::randn({7, 64}, options), dh = torch::randn({7, 64}, options);
  {
    auto [x_out, y] = ForkRmsNorm(x, w, kEps);
    fsdp::testing::OpCounts ops;
    torch::autograd::backward({x_out, y}, {dh, dy});
    EXPECT_EQ(ops.Adds(), 0);
  }
  x.mutable_grad().reset();  // fresh leaves: no accumulation into a .grad
  w.mutable_grad().reset();
  {
    auto [h, y] = AddRmsNorm(x, r, w, kEps);
    fsdp::testing::OpCounts ops;
    torch::autograd::backward({h, y}, {dh, dy});
    EXPECT_EQ(ops.Adds(), 0);
  }
}

TEST(KernelsRmsNormTest, NoAddKernels) { CheckNoAdds(c10::kCPU); }

TEST(KernelsRmsNormTest, CudaNoAddKernels) {
  FSDP_SKIP_WITHOUT_GPU();
  CheckNoAdds(c10::Device(c10::kCUDA, 0));
}

// The composite in the dtype itself rounds twice (normalised x, then times weight): the kernel
// is within about one bf16 rounding of it.
void CheckAgainstCompositeInDtype(c10::Device device) {
  torch::manual_seed(3);
  at::Tensor x = torch::randn({7, 1000}).to(device, at::kBFloat16);
  at::Tensor w = (1 + 0.5 * torch::randn({1000})).to(device, at::kBFloat16);
  EXPECT_TRUE(AllClose(RmsNorm(x, w, kEps), RmsNormComposite(x, w, kEps), 1e-2, 1e-2, "bf16"));
}

TEST(KernelsRmsNormTest, CpuMatchesComposite) { CheckAll(c10::kCPU); }

TEST(KernelsRmsNormTest, CudaMatchesComposite) {
  FSDP_SKIP_WITHOUT_GPU();
  CheckAll(c10::Device(c10::kCUDA, 0));
}

TEST(KernelsRmsNormTest, CpuWithinOneRoundingOfBf16Composite) {
  CheckAgainstCompositeInDtype(c10::kCPU);
}

TEST(KernelsRmsNormTest, CudaWithinOneRoundingOfBf16Composite) {
  FSDP_SKIP_WITHOUT_GPU();
  CheckAgainstCompositeInDtype(c10::Device(c10::kCUDA, 0));
}

// A contiguous copy of `t` on `device` that starts one element past an aligned address (a view
// into a larger buffer): the CUDA kernels must take their element-wise path for it.
at::Tensor Misaligned(const at::Tensor& t, c10::Device device) {
  at::Tensor buffer = at::empty({t.numel() + 1}, t.options().device(device));
  return buffer.narrow(0, 1, t.numel()).view(t.sizes()).copy_(t);
}

// The two implementations agree closely on the same inputs, including sizes that take the
// CUDA kernels' other paths (Note [RMSNorm kernel layout]): rows far past the number of blocks
// (and many rows per backward block), a single row, rows of one 16-byte pack, the longest row
// held in registers (8192 bf16) and longer ones (16-byte packs, or single elements, read
// twice), columns that are not a multiple of the vector width, fp16, and (misaligned) operands
// that start one element past a 16-byte boundary.
TEST(KernelsRmsNormTest, CudaMatchesCpuReference) {
  FSDP_SKIP_WITHOUT_GPU();
  c10::Device cuda(c10::kCUDA, 0);
  std::vector<Case> cases = {{{70001, 8}, at::kFloat, at::kFloat, 1e-5, 1e-5},
                             {{17, 13000}, at::kFloat, at::kFloat, 1e-5, 1e-5},
                             {{4096, 2048}, at::kBFloat16, at::kBFloat16, 1e-2, 1e-2},
                             {{33, 4099}, at::kBFloat16, at::kFloat, 1e-2, 1e-2},
                             {{1, 2048}, at::kBFloat16, at::kFloat, 1e-2, 1e-2},
                             {{5, 4}, at::kFloat, at::kFloat, 1e-5, 1e-5},
                             {{300, 8}, at::kBFloat16, at::kBFloat16, 1e-2, 1e-2},
                             {{3, 8192}, at::kBFloat16, at::kFloat, 1e-2, 1e-2},
                             {{5, 8200}, at::kBFloat16, at::kBFloat16, 1e-2, 1e-2},
                             {{4, 2051}, at::kHalf, at::kFloat, 1e-2, 1e-2},
                             {{9, 2056}, at::kHalf, at::kHalf, 1e-2, 1e-2},
                             {{65, 4096}, at::kBFloat16, at::kFloat, 1e-2, 1e-2}};
  for (bool misaligned : {false, true}) {
    for (const Case& c : cases) {
      SCOPED_TRACE(c.Name() + (misaligned ? ", misaligned" : ""));
      Inputs in = MakeInputs(c, c10::kCPU);
      std::vector<at::Tensor> results;
      for (c10::Device device : {c10::Device(c10::kCPU), cuda}) {
        auto place = [&](const at::Tensor& t, at::ScalarType dtype) {
          at::Tensor v = t.to(dtype);  // a fresh leaf on `device` each call
          return misaligned && device.is_cuda() ? Misaligned(v, device) : v.to(device).clone();
        };
        at::Tensor x = place(in.x, c.dtype).requires_grad_(true);
        at::Tensor r = place(in.residual, c.dtype).requires_grad_(true);
        at::Tensor w = place(in.weight, c.weight_dtype).requires_grad_(true);
        if (misaligned && device.is_cuda()) {
          ASSERT_NE(reinterpret_cast<uintptr_t>(x.const_data_ptr()) % 16, 0u);
          ASSERT_TRUE(x.is_contiguous());  // so that the kernel gets this pointer
        }
        auto [h, y] = AddRmsNorm(x, r, w, kEps);
        at::Tensor dh = place(in.dh, c.dtype), dy = place(in.dy, c.dtype);
        torch::autograd::backward({h, y}, {dh, dy});
        for (const at::Tensor& t : {h, y, x.grad(), w.grad()}) results.push_back(t.detach().cpu());
        // RmsNorm without the residual, on the same operands.
        at::Tensor x2 = place(in.x, c.dtype).requires_grad_(true);
        at::Tensor y2 = RmsNorm(x2, w.detach(), kEps);
        y2.backward(dy);
        for (const at::Tensor& t : {y2, x2.grad()}) results.push_back(t.detach().cpu());
        // ForkRmsNorm, with a gradient of the passed-through x (the kernel's extra gradient
        // without a residual).
        at::Tensor x3 = place(in.x, c.dtype).requires_grad_(true);
        auto [x3_out, y3] = ForkRmsNorm(x3, w.detach(), kEps);
        torch::autograd::backward({x3_out, y3}, {dh, dy});
        for (const at::Tensor& t : {y3, x3.grad()}) results.push_back(t.detach().cpu());
      }
      const char* names[] = {"h",         "y",
                             "grad of x", "grad of weight",
                             "plain: y",  "plain: grad of x",
                             "fork: y",   "fork: grad of x"};
      constexpr int kResults = 8;
      for (int i = 0; i < kResults; ++i) {
        double atol = i == 3 ? WeightAtol(c, results[i]) : c.atol;
        EXPECT_TRUE(AllClose(results[kResults + i], results[i], c.rtol, atol, names[i]));
      }
    }
  }
}

TEST(KernelsRmsNormTest, GradientOfHOnlyPassesThrough) {
  at::Tensor x = torch::randn({5, 33}, torch::requires_grad());
  at::Tensor r = torch::randn({5, 33}, torch::requires_grad());
  at::Tensor w = torch::randn({33}, torch::requires_grad());
  auto [h, y] = AddRmsNorm(x, r, w, kEps);
  at::Tensor dh = torch::randn({5, 33});
  h.backward(dh);
  EXPECT_TRUE(at::equal(x.grad(), dh));
  EXPECT_TRUE(at::equal(r.grad(), dh));
  EXPECT_FALSE(w.grad().defined() && w.grad().abs().max().item<float>() != 0);
}

TEST(KernelsRmsNormTest, WeightWithoutGradient) {
  at::Tensor x = torch::randn({7, 33}, torch::requires_grad());
  at::Tensor x_ref = x.detach().clone().requires_grad_(true);
  at::Tensor w = torch::randn({33});
  at::Tensor dy = torch::randn({7, 33});
  RmsNorm(x, w, kEps).backward(dy);
  RmsNormComposite(x_ref, w, kEps).backward(dy);
  EXPECT_TRUE(AllClose(x.grad(), x_ref.grad(), 1e-5, 1e-5, "grad of x"));
}

// No rows (and no weight-gradient rows to sum): empty outputs, a zero weight gradient.
void CheckNoRows(c10::Device device) {
  for (std::vector<int64_t> shape : {std::vector<int64_t>{0, 16}, {2, 0, 16}}) {
    auto options = torch::TensorOptions().device(device).requires_grad(true);
    at::Tensor x = torch::randn(shape, options), r = torch::randn(shape, options);
    at::Tensor w = torch::randn({16}, options);
    at::Tensor y = RmsNorm(x, w, kEps);
    EXPECT_EQ(y.sizes(), x.sizes());
    y.sum().backward();
    EXPECT_EQ(x.grad().sizes(), x.sizes());
    EXPECT_TRUE(at::equal(w.grad().cpu(), torch::zeros({16})));
    auto [h, y2] = AddRmsNorm(x, r, w, kEps);
    (h.sum() + y2.sum()).backward();
    EXPECT_EQ(r.grad().sizes(), x.sizes());
  }
}

TEST(KernelsRmsNormTest, NoRows) { CheckNoRows(c10::kCPU); }

TEST(KernelsRmsNormTest, CudaNoRows) {
  FSDP_SKIP_WITHOUT_GPU();
  CheckNoRows(c10::Device(c10::kCUDA, 0));
}

TEST(KernelsRmsNormTest, WrongWeightSizeNamesBoth) {
  at::Tensor x = torch::randn({4, 999});
  try {
    RmsNorm(x, torch::ones({1000}), kEps);
    ADD_FAILURE() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("rms_norm: weight has sizes [1000] but x [4, 999]"));
    EXPECT_THAT(e.what(), HasSubstr("weight must be [999]"));
  }
  EXPECT_THROW(AddRmsNorm(x, x, torch::ones({4, 999}), kEps), c10::Error);
}

TEST(KernelsRmsNormTest, RejectsBadDtypesAndResiduals) {
  at::Tensor x = torch::randn({2, 8});
  EXPECT_THROW(RmsNorm(x.to(at::kInt), torch::ones({8}, at::kInt), kEps), c10::Error);
  EXPECT_THROW(RmsNorm(x, torch::ones({8}, at::kBFloat16), kEps), c10::Error);
  EXPECT_THROW(AddRmsNorm(x, x.to(at::kBFloat16), torch::ones({8}), kEps), c10::Error);
  EXPECT_THROW(AddRmsNorm(x, torch::randn({2, 1, 8}), torch::ones({8}), kEps), c10::Error);
}

// Non-contiguous x and residual (transposed views, so the kernels get contiguous copies) and
// a non-contiguous upstream gradient, D odd: forward and the gradients against the composite
// in fp32 on the same values.
void CheckNonContiguous(at::ScalarType dtype, c10::Device device) {
  SCOPED_TRACE(::testing::Message() << dtype << " on " << device);
  torch::manual_seed(17);
  const double tol = dtype == at::kFloat ? 1e-5 : 1e-2;
  at::Tensor x0 = torch::randn({33, 70}).to(device, dtype).t();  // [70, 33], strides (1, 70)
  at::Tensor r0 = torch::randn({33, 70}).to(device, dtype).t();
  at::Tensor w0 = (1 + 0.5 * torch::randn({33})).to(device, dtype);
  at::Tensor dy = torch::randn({33, 70}).to(device, dtype).t();
  ASSERT_FALSE(x0.is_contiguous() || dy.is_contiguous());
  {
    at::Tensor x = x0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
    at::Tensor xr = Leaf(x0, at::kFloat), wr = Leaf(w0, at::kFloat);
    at::Tensor y = RmsNorm(x, w, kEps), yr = RmsNormComposite(xr, wr, kEps);
    EXPECT_TRUE(AllClose(y, yr, tol, tol, "y"));
    y.backward(dy);
    yr.backward(dy.to(at::kFloat));
    EXPECT_TRUE(AllClose(x.grad(), xr.grad(), tol, tol, "grad of x"));
    EXPECT_TRUE(AllClose(w.grad(), wr.grad(), tol, tol * wr.grad().abs().max().item<double>(),
                         "grad of weight"));
  }
  {
    at::Tensor x = x0.clone().requires_grad_(true), r = r0.clone().requires_grad_(true);
    at::Tensor w = w0.clone().requires_grad_(true);
    at::Tensor xr = Leaf(x0, at::kFloat), rr = Leaf(r0, at::kFloat), wr = Leaf(w0, at::kFloat);
    auto [h, y] = AddRmsNorm(x, r, w, kEps);
    auto [hr, yr] = AddRmsNormComposite(xr, rr, wr, kEps);
    EXPECT_TRUE(at::equal(h.detach(), x0 + r0)) << "h is not x + residual";
    EXPECT_TRUE(AllClose(y, yr, tol, tol, "add: y"));
    torch::autograd::backward({h, y}, {dy, dy});
    torch::autograd::backward({hr, yr}, {dy.to(at::kFloat), dy.to(at::kFloat)});
    EXPECT_TRUE(AllClose(x.grad(), xr.grad(), tol, tol, "add: grad of x"));
    EXPECT_TRUE(AllClose(r.grad(), rr.grad(), tol, tol, "add: grad of residual"));
    EXPECT_TRUE(AllClose(w.grad(), wr.grad(), tol, tol * wr.grad().abs().max().item<double>(),
                         "add: grad of weight"));
  }
  {
    at::Tensor x = x0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
    at::Tensor xr = Leaf(x0, at::kFloat), wr = Leaf(w0, at::kFloat);
    auto [x_out, y] = ForkRmsNorm(x, w, kEps);
    at::Tensor yr = RmsNormComposite(xr, wr, kEps);
    EXPECT_EQ(x_out.strides(), x.strides()) << "the passed-through x is not x";
    EXPECT_TRUE(AllClose(y, yr, tol, tol, "fork: y"));
    torch::autograd::backward({x_out, y}, {dy, dy});
    torch::autograd::backward({xr, yr}, {dy.to(at::kFloat), dy.to(at::kFloat)});
    EXPECT_TRUE(AllClose(x.grad(), xr.grad(), tol, tol, "fork: grad of x"));
    EXPECT_TRUE(AllClose(w.grad(), wr.grad(), tol, tol * wr.grad().abs().max().item<double>(),
                         "fork: grad of weight"));
  }
  // x and residual one tensor (both kernel inputs read the same memory).
  EXPECT_TRUE(AllClose(
      AddRmsNorm(x0, x0, w0, kEps).second,
      AddRmsNormComposite(x0.to(at::kFloat), x0.to(at::kFloat), w0.to(at::kFloat), kEps).second,
      tol, tol, "add, x as its own residual"));
}

TEST(KernelsRmsNormTest, NonContiguousInputsAndGradients) {
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    CheckNonContiguous(dtype, c10::kCPU);
  }
}

TEST(KernelsRmsNormTest, CudaNonContiguousInputsAndGradients) {
  FSDP_SKIP_WITHOUT_GPU();
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    CheckNonContiguous(dtype, c10::Device(c10::kCUDA, 0));
  }
}

}  // namespace
}  // namespace fsdp::kernels
