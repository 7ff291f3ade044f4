// kernels::MultiLinear and kernels::LinearAdd against their composites (at::linear per weight;
// residual + at::linear): forward and the gradients of x, every weight, every bias and the
// residual, fp32 and bf16, odd sizes, 2-D and 3-D inputs, biases on none, all or some of the
// weights; gradients for subsets of the inputs and outputs; the replayed backward of
// SetMultiLinearBackward; and the point of both: no add kernel where the composite has one.
// CPU always; the same on a GPU (tests named *Cuda*).
#include "kernels/linear.h"

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

enum class Biases { kNone, kAll, kFirst };

struct Case {
  std::vector<int64_t> x_shape;  // the last size is K
  std::vector<int64_t> outs;     // N of each weight
  Biases biases;
  at::ScalarType dtype;

  std::string Name() const {
    return std::string(c10::toString(dtype)) + " x " + c10::str(at::IntArrayRef(x_shape)) +
           ", outputs " + c10::str(at::IntArrayRef(outs)) + ", biases " +
           (biases == Biases::kNone  ? "none"
            : biases == Biases::kAll ? "all"
                                     : "first");
  }
  double Tol() const { return dtype == at::kFloat ? 1e-5 : 1e-2; }
};

std::vector<Case> Cases() {
  std::vector<Case> cases;
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    for (Biases b : {Biases::kNone, Biases::kAll, Biases::kFirst}) {
      cases.push_back({{7, 33}, {17, 5, 40}, b, dtype});    // three projections, odd sizes
      cases.push_back({{3, 5, 32}, {32, 8, 8}, b, dtype});  // q, k, v of a GQA block
      cases.push_back({{2, 9, 24}, {88, 88}, b, dtype});    // w1, w3
    }
    cases.push_back({{1, 1, 9}, {3}, Biases::kAll, dtype});  // one weight, one row
    cases.push_back({{33}, {4, 6}, Biases::kNone, dtype});   // 1-D x, as at::linear takes
  }
  return cases;
}

struct Inputs {
  at::Tensor x;
  std::vector<at::Tensor> weights, biases, grads;  // biases: undefined where none
};

// Values in the case's dtype on `device` (not leaves).
Inputs MakeInputs(const Case& c, c10::Device device) {
  torch::manual_seed(5);
  auto make = [&](std::vector<int64_t> shape, double scale) {
    return (torch::randn(shape) * scale).to(device, c.dtype);
  };
  Inputs in;
  in.x = make(c.x_shape, 1.0);
  for (size_t i = 0; i < c.outs.size(); ++i) {
    const int64_t n = c.outs[i], k = c.x_shape.back();
    in.weights.push_back(make({n, k}, 1.0 / std::sqrt(static_cast<double>(k))));
    const bool bias = c.biases == Biases::kAll || (c.biases == Biases::kFirst && i == 0);
    in.biases.push_back(bias ? make({n}, 1.0) : at::Tensor());
    std::vector<int64_t> y_shape = c.x_shape;
    y_shape.back() = n;
    in.grads.push_back(make(y_shape, 1.0));
  }
  return in;
}

at::Tensor Leaf(const at::Tensor& t, at::ScalarType dtype) {
  return t.defined() ? t.to(dtype).clone().requires_grad_(true) : at::Tensor();
}

struct Result {
  std::vector<at::Tensor> ys;
  at::Tensor grad_x;
  std::vector<at::Tensor> grad_w, grad_b;
};

// Forward and backward of `f` (MultiLinear or its composite) on leaves of `dtype`.
template <typename F>
Result RunOn(F f, const Inputs& in, at::ScalarType dtype) {
  at::Tensor x = Leaf(in.x, dtype);
  std::vector<at::Tensor> w, b, g;
  for (size_t i = 0; i < in.weights.size(); ++i) {
    w.push_back(Leaf(in.weights[i], dtype));
    b.push_back(Leaf(in.biases[i], dtype));
    g.push_back(in.grads[i].to(dtype));
  }
  Result r;
  r.ys = f(x, w, b);
  torch::autograd::backward(r.ys, g);
  r.grad_x = x.grad();
  for (size_t i = 0; i < w.size(); ++i) {
    r.grad_w.push_back(w[i].grad());
    r.grad_b.push_back(b[i].defined() ? b[i].grad() : at::Tensor());
  }
  return r;
}

std::vector<at::Tensor> Fused(const at::Tensor& x, const std::vector<at::Tensor>& w,
                              const std::vector<at::Tensor>& b) {
  return MultiLinear(x, w, b);
}
std::vector<at::Tensor> Composite(const at::Tensor& x, const std::vector<at::Tensor>& w,
                                  const std::vector<at::Tensor>& b) {
  return MultiLinearComposite(x, w, b);
}

// Sums over rows (a weight or bias gradient, a long dot product): their error follows the
// largest magnitude, not each element's.
double Scaled(double tol, const at::Tensor& expected) {
  return tol * std::max(1.0, expected.abs().max().item<double>());
}

// MultiLinear against the composite run in fp32 on the same (rounded) values; in fp32 also
// against the composite itself: the forward and the weight and bias gradients are the same
// ATen calls, so bitwise equal on the CPU.
void CheckAgainstComposite(const Case& c, c10::Device device) {
  SCOPED_TRACE(c.Name());
  Inputs in = MakeInputs(c, device);
  Result fused = RunOn(Fused, in, c.dtype);
  Result ref = RunOn(Composite, in, at::kFloat);
  Result same = RunOn(Composite, in, c.dtype);
  const double tol = c.Tol();
  for (size_t i = 0; i < c.outs.size(); ++i) {
    SCOPED_TRACE(i);
    EXPECT_EQ(fused.ys[i].scalar_type(), c.dtype);
    EXPECT_FALSE(fused.ys[i].is_view());
    EXPECT_TRUE(AllClose(fused.ys[i], ref.ys[i], tol, Scaled(tol, ref.ys[i]), "y"));
    EXPECT_TRUE(AllClose(fused.grad_w[i], ref.grad_w[i], tol, Scaled(tol, ref.grad_w[i]),
                         "grad of weight"));
    ASSERT_EQ(fused.grad_b[i].defined(), in.biases[i].defined());
    if (in.biases[i].defined()) {
      EXPECT_TRUE(AllClose(fused.grad_b[i], ref.grad_b[i], tol, Scaled(tol, ref.grad_b[i]),
                           "grad of bias"));
    }
    if (device.is_cpu()) {
      EXPECT_TRUE(at::equal(fused.ys[i], same.ys[i])) << "y is not at::linear's";
      EXPECT_TRUE(at::equal(fused.grad_w[i], same.grad_w[i])) << "grad of weight";
      if (in.biases[i].defined()) {
        EXPECT_TRUE(at::equal(fused.grad_b[i], same.grad_b[i])) << "grad of bias";
      }
    }
  }
  EXPECT_EQ(fused.grad_x.sizes(), in.x.sizes());
  EXPECT_EQ(fused.grad_x.scalar_type(), c.dtype);
  EXPECT_TRUE(AllClose(fused.grad_x, ref.grad_x, tol, Scaled(tol, ref.grad_x), "grad of x"));
}

TEST(KernelsLinearTest, MultiLinearMatchesCompositeOnCpu) {
  for (const Case& c : Cases()) CheckAgainstComposite(c, c10::kCPU);
}

TEST(KernelsLinearTest, CudaMultiLinearMatchesComposite) {
  FSDP_SKIP_WITHOUT_GPU();
  for (const Case& c : Cases()) CheckAgainstComposite(c, c10::Device(c10::kCUDA, 0));
}

// The point: the composite's backward sums x's gradients with n - 1 add kernels; MultiLinear's
// GEMMs accumulate them (one mm, then addmm_), and its forward and backward run no add.
void CheckNoAdds(c10::Device device) {
  Case c{{3, 5, 32}, {32, 8, 8}, Biases::kNone, at::kBFloat16};
  Inputs in = MakeInputs(c, device);
  for (bool fused : {false, true}) {
    SCOPED_TRACE(fused ? "MultiLinear" : "composite");
    fsdp::testing::OpCounts ops;
    RunOn(fused ? Fused : Composite, in, c.dtype);
    if (fused) {
      EXPECT_EQ(ops.Adds(), 0);
      EXPECT_EQ(ops.Count("aten::addmm_"), 2);  // grad of x: q's mm, then k's and v's
    } else {
      EXPECT_EQ(ops.Adds(), 2);
    }
  }
}

TEST(KernelsLinearTest, NoAddKernels) { CheckNoAdds(c10::kCPU); }

TEST(KernelsLinearTest, CudaNoAddKernels) {
  FSDP_SKIP_WITHOUT_GPU();
  CheckNoAdds(c10::Device(c10::kCUDA, 0));
}

// Gradients only for what needs them: x alone, the weights alone, one weight; and outputs
// that the loss does not use. Each against the composite on the same subset (fp32).
TEST(KernelsLinearTest, GradientsOfSubsetsOfInputsAndOutputs) {
  Case c{{2, 7, 33}, {17, 5, 40}, Biases::kAll, at::kFloat};
  Inputs in = MakeInputs(c, c10::kCPU);
  struct Subset {
    std::string name;
    bool x;
    std::vector<bool> weights, outputs;  // which weights (and their biases) need gradients;
                                         // which outputs the loss uses
  };
  const std::vector<Subset> subsets = {
      {"x only", true, {false, false, false}, {true, true, true}},
      {"weights only", false, {true, true, true}, {true, true, true}},
      {"one weight", false, {false, true, false}, {true, true, true}},
      {"first output unused", true, {true, true, true}, {false, true, true}},
      {"one output", true, {true, true, true}, {false, false, true}},
  };
  for (const Subset& s : subsets) {
    SCOPED_TRACE(s.name);
    std::vector<Result> runs;
    int64_t mms[2] = {0, 0};
    for (bool fused : {false, true}) {
      at::Tensor x = in.x.clone().requires_grad_(s.x);
      std::vector<at::Tensor> w, b;
      for (size_t i = 0; i < 3; ++i) {
        w.push_back(in.weights[i].clone().requires_grad_(s.weights[i]));
        b.push_back(in.biases[i].clone().requires_grad_(s.weights[i]));
      }
      std::vector<at::Tensor> ys = fused ? MultiLinear(x, w, b) : MultiLinearComposite(x, w, b);
      at::Tensor loss = at::zeros({}, at::kFloat);
      for (size_t i = 0; i < 3; ++i) {
        if (s.outputs[i]) loss = loss + (ys[i] * in.grads[i]).sum();
      }
      fsdp::testing::OpCounts ops;
      loss.backward();
      mms[fused] = ops.Count("aten::mm") + ops.Count("aten::addmm_");
      Result r;
      r.grad_x = x.grad();
      for (size_t i = 0; i < 3; ++i) {
        r.grad_w.push_back(w[i].grad());
        r.grad_b.push_back(b[i].grad());
      }
      runs.push_back(r);
    }
    // The GEMMs that run: x's gradient per used output when x needs it, a weight's when it
    // does and its output is used.
    int64_t expected_mms = 0;
    for (size_t i = 0; i < 3; ++i) {
      expected_mms += s.outputs[i] * (s.x + s.weights[i]);
    }
    EXPECT_EQ(mms[1], expected_mms);
    auto same = [](const at::Tensor& a, const at::Tensor& e, const std::string& what) {
      ASSERT_EQ(a.defined(), e.defined()) << what;
      if (a.defined()) {
        EXPECT_TRUE(AllClose(a, e, 1e-5, Scaled(1e-5, e), what));
      }
    };
    same(runs[1].grad_x, runs[0].grad_x, "grad of x");
    for (size_t i = 0; i < 3; ++i) {
      same(runs[1].grad_w[i], runs[0].grad_w[i], "grad of weight " + std::to_string(i));
      same(runs[1].grad_b[i], runs[0].grad_b[i], "grad of bias " + std::to_string(i));
    }
  }
}

// Outputs computed without autograd (as selective activation checkpointing keeps them) and
// given MultiLinear's backward afterwards: the same gradients as MultiLinear's own.
TEST(KernelsLinearTest, SetMultiLinearBackwardGivesTheSameGradients) {
  Case c{{3, 5, 33}, {17, 40}, Biases::kFirst, at::kBFloat16};
  Inputs in = MakeInputs(c, c10::kCPU);
  Result direct = RunOn(Fused, in, c.dtype);
  Result replayed = RunOn(
      [](const at::Tensor& x, const std::vector<at::Tensor>& w, const std::vector<at::Tensor>& b) {
        std::vector<at::Tensor> ys;
        {
          at::NoGradGuard no_grad;
          ys = MultiLinear(x, w, b);
        }
        for (at::Tensor& y : ys) y = y.detach();
        SetMultiLinearBackward(ys, x, w, b);
        return ys;
      },
      in, c.dtype);
  EXPECT_TRUE(at::equal(replayed.grad_x, direct.grad_x));
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_TRUE(at::equal(replayed.ys[i], direct.ys[i]));
    EXPECT_TRUE(at::equal(replayed.grad_w[i], direct.grad_w[i]));
  }
  EXPECT_TRUE(at::equal(replayed.grad_b[0], direct.grad_b[0]));
  // Outputs that already have a history, or are views, are refused.
  at::Tensor x = in.x.clone().requires_grad_(true);
  std::vector<at::Tensor> w = {in.weights[0], in.weights[1]};
  std::vector<at::Tensor> ys = MultiLinear(x, w);
  EXPECT_THROW(SetMultiLinearBackward(ys, x, w), c10::Error);
  std::vector<at::Tensor> views = {ys[0].detach().view({15, 17}).view({3, 5, 17}), ys[1].detach()};
  EXPECT_THROW(SetMultiLinearBackward(views, x, w), c10::Error);
}

TEST(KernelsLinearTest, NoRows) {
  at::Tensor x = torch::randn({0, 8}, torch::requires_grad());
  at::Tensor w = torch::randn({3, 8}, torch::requires_grad());
  at::Tensor b = torch::randn({3}, torch::requires_grad());
  std::vector<at::Tensor> ys = MultiLinear(x, {w, w}, {b, at::Tensor()});
  EXPECT_EQ(ys[0].sizes(), at::IntArrayRef({0, 3}));
  (ys[0].sum() + ys[1].sum()).backward();
  EXPECT_EQ(x.grad().sizes(), x.sizes());
  EXPECT_TRUE(at::equal(w.grad(), torch::zeros({3, 8})));
  EXPECT_TRUE(at::equal(b.grad(), torch::zeros({3})));
}

TEST(KernelsLinearTest, RejectsBadShapesAndDtypes) {
  at::Tensor x = torch::randn({4, 8});
  EXPECT_THROW(MultiLinear(x, {}), c10::Error);
  EXPECT_THROW(MultiLinear(x, {torch::randn({3, 9})}), c10::Error);
  EXPECT_THROW(MultiLinear(x, {torch::randn({3, 8}).to(at::kBFloat16)}), c10::Error);
  EXPECT_THROW(MultiLinear(x, {torch::randn({3, 8})}, {torch::randn({3}), torch::randn({3})}),
               c10::Error);
  EXPECT_THROW(MultiLinear(x, {torch::randn({3, 8})}, {torch::randn({4})}), c10::Error);
  EXPECT_THROW(LinearAdd(torch::randn({4, 2}), x, torch::randn({3, 8})), c10::Error);
}

// LinearAdd against residual + at::linear: the residual's gradient is the incoming one itself;
// x's and w's are linear's; the forward rounds once (fp32 and bf16, 2-D and 3-D).
void CheckLinearAdd(c10::Device device) {
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    for (std::vector<int64_t> lead : {std::vector<int64_t>{7}, {3, 5}}) {
      SCOPED_TRACE(::testing::Message() << dtype << " leading " << at::IntArrayRef(lead));
      const double tol = dtype == at::kFloat ? 1e-5 : 1e-2;
      torch::manual_seed(9);
      std::vector<int64_t> x_shape = lead, r_shape = lead;
      x_shape.push_back(88);
      r_shape.push_back(33);
      at::Tensor x0 = torch::randn(x_shape).to(device, dtype);
      at::Tensor r0 = torch::randn(r_shape).to(device, dtype);
      at::Tensor w0 = (torch::randn({33, 88}) / std::sqrt(88.0)).to(device, dtype);
      at::Tensor g = torch::randn(r_shape).to(device, dtype);
      at::Tensor results[2][4];
      for (int fused = 0; fused < 2; ++fused) {
        at::ScalarType t = fused ? dtype : at::kFloat;
        at::Tensor x = Leaf(x0, t), r = Leaf(r0, t), w = Leaf(w0, t);
        at::Tensor y = fused ? LinearAdd(r, x, w) : LinearAddComposite(r, x, w);
        if (fused) {
          EXPECT_FALSE(y.is_view());
          EXPECT_EQ(y.sizes(), r.sizes());
        }
        y.backward(g.to(t));
        results[fused][0] = y.detach();
        results[fused][1] = r.grad();
        results[fused][2] = x.grad();
        results[fused][3] = w.grad();
      }
      EXPECT_TRUE(at::equal(results[1][1], g)) << "grad of residual is not the incoming one";
      const char* names[] = {"y", "grad of residual", "grad of x", "grad of weight"};
      for (int i : {0, 2, 3}) {
        EXPECT_TRUE(
            AllClose(results[1][i], results[0][i], tol, Scaled(tol, results[0][i]), names[i]));
      }
      // No add kernel, forward or backward (the composite: one, forward).
      at::Tensor x = Leaf(x0, dtype), r = Leaf(r0, dtype), w = Leaf(w0, dtype);
      fsdp::testing::OpCounts ops;
      LinearAdd(r, x, w).backward(g);
      EXPECT_EQ(ops.Adds(), 0);
    }
  }
}

TEST(KernelsLinearTest, LinearAddMatchesComposite) { CheckLinearAdd(c10::kCPU); }

TEST(KernelsLinearTest, CudaLinearAddMatchesComposite) {
  FSDP_SKIP_WITHOUT_GPU();
  CheckLinearAdd(c10::Device(c10::kCUDA, 0));
}

}  // namespace
}  // namespace fsdp::kernels
