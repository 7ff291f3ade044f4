// Our CUDA kernels (kernels/cuda/*.cu), compiled for the host by translate.cmake and run by
// the CPU emulator (emulator.h), against the CPU references of kernels/*.h: the launchers'
// grid and block sizes, the kernels' indexing, strides, vector paths, barriers, warp
// reductions and shared-memory layouts execute here, on every CI run, without a GPU. The
// second half runs the public autograd functions of the emulated copy of the library, whose
// CUDA branches (dispatch_emulated.cc) call those launchers: the buffers, strides and
// arguments that kernels/*.cc hand to the kernels, forward and backward.
//
// Each launch also runs under the reverse and a shuffled thread order and with each warp running
// ahead of the next, and its outputs must be bitwise identical to the forward order's: a result
// that depends on which thread ran first is a missing barrier. Tolerances are those of the GPU tests (tests/kernels_*_test.cc) or
// tighter; the host's expf and sqrt stand in for the device's __expf and rsqrtf (see
// prelude.h), so a GPU differs in the last bits.
#include <functional>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>
#include <gtest/gtest.h>

// The emulated copies (namespace fsdp::kernels_emulated): launchers and autograd functions.
#include "emulated/kernels/cross_entropy.h"
#include "emulated/kernels/cuda/cross_entropy.h"
#include "emulated/kernels/cuda/rms_norm.h"
#include "emulated/kernels/cuda/rope.h"
#include "emulated/kernels/cuda/swiglu.h"
#include "emulated/kernels/rms_norm.h"
#include "emulated/kernels/rope.h"
#include "emulated/kernels/swiglu.h"
// The real library: the CPU references.
#include "kernels/cross_entropy.h"
#include "kernels/rms_norm.h"
#include "kernels/rope.h"
#include "kernels/swiglu.h"
#include "tests/cuda_emulation/emulator.h"
#include "tests/kernels_testing.h"

namespace fsdp::kernels {
namespace {

namespace emulated = ::fsdp::kernels_emulated::cuda;
using ::fsdp::kernels::testing::AllClose;

emulated::DType Dt(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return emulated::DType::kFloat;
    case at::kBFloat16: return emulated::DType::kBFloat16;
    case at::kHalf: return emulated::DType::kHalf;
    default: break;
  }
  ADD_FAILURE() << "no kernel dtype for " << t;
  return emulated::DType::kFloat;
}

void* Ptr(const at::Tensor& t) { return t.defined() ? t.data_ptr() : nullptr; }

// Runs `launch` (which writes into the tensors it returns, from fresh inputs each call) under
// each schedule; the outputs must be bitwise equal to the forward schedule's, which it returns.
std::vector<at::Tensor> UnderEverySchedule(
    const std::function<std::vector<at::Tensor>()>& launch) {
  std::vector<at::Tensor> first;
  for (fsdp_emu::Schedule s : {fsdp_emu::Schedule::kForward, fsdp_emu::Schedule::kReverse,
                               fsdp_emu::Schedule::kShuffled, fsdp_emu::Schedule::kWarpByWarp}) {
    fsdp_emu::SetSchedule(s);
    std::vector<at::Tensor> out = launch();
    if (first.empty()) {
      first = out;
      continue;
    }
    for (size_t i = 0; i < out.size(); ++i) {
      if (!out[i].defined()) continue;
      EXPECT_TRUE(at::equal(out[i].view(at::kByte), first[i].view(at::kByte)))
          << "output " << i << " depends on the thread schedule (" << static_cast<int>(s)
          << "): a missing barrier";
    }
  }
  fsdp_emu::SetSchedule(fsdp_emu::Schedule::kForward);
  return first;
}

void ExpectLaunched(int status) {
  EXPECT_EQ(status, 0) << "launch failed: " << fsdp_emu::LastErrorMessage();
}

std::string DtypeName(at::ScalarType t) { return c10::toString(t); }

// ---- RMSNorm ---------------------------------------------------------------------------------

// Operands placed one element past a 16-byte boundary (a view into a larger buffer), so that
// the launcher must take the element-wise path: a vector access to one of them fails the
// emulated launch (CheckedCast), as it would fault on a GPU.
enum Misaligned : int {
  kNone = 0, kX = 1, kResidual = 2, kH = 4, kY = 8, kGradY = 16, kGradH = 32, kGradX = 64,
  kWeight = 128
};

struct RmsCase {
  int64_t rows, cols;
  at::ScalarType dtype, weight_dtype;
  bool residual, weight_grad;
  int misaligned = kNone;
  // ForkRmsNorm's backward: no residual, but an extra gradient (grad_h: the passed-through x's)
  // added to grad_x. With a residual, grad_h is always there (AddRmsNorm's gradient of h).
  bool fork = false;
};

// A rows x cols tensor (or cols when rows is 0) of `dtype`, at an odd element offset in its
// buffer when `offset`; `fill` gives its values.
at::Tensor Place(const at::Tensor& fill, bool offset) {
  if (!offset) return fill.clone();
  at::Tensor buffer = at::empty({fill.numel() + 1}, fill.options());
  return buffer.narrow(0, 1, fill.numel()).view(fill.sizes()).copy_(fill);
}

class EmulatedRmsNormTest : public ::testing::TestWithParam<RmsCase> {};

TEST_P(EmulatedRmsNormTest, ForwardAndBackwardMatchTheCpuReference) {
  const RmsCase c = GetParam();
  const double eps = 1e-5;
  at::manual_seed(11);
  const int m = c.misaligned;
  at::Tensor x = Place(at::randn({c.rows, c.cols}).to(c.dtype), m & kX);
  at::Tensor res =
      c.residual ? Place(at::randn({c.rows, c.cols}).to(c.dtype), m & kResidual) : at::Tensor();
  at::Tensor w = Place((1 + 0.1 * at::randn({c.cols})).to(c.weight_dtype), m & kWeight);
  at::Tensor gy = Place(at::randn({c.rows, c.cols}).to(c.dtype), m & kGradY);
  at::Tensor gh = c.residual || c.fork ? Place(at::randn({c.rows, c.cols}).to(c.dtype), m & kGradH)
                                       : at::Tensor();
  auto output = [&](bool offset) { return Place(at::zeros({c.rows, c.cols}, c.dtype), offset); };

  std::vector<at::Tensor> fwd = UnderEverySchedule([&] {
    at::Tensor h = c.residual ? output(m & kH) : at::Tensor();
    at::Tensor y = output(m & kY);
    at::Tensor rstd = at::empty({c.rows}, at::kFloat);
    ExpectLaunched(emulated::RmsNormForward(Ptr(x), Ptr(res), Ptr(w), Ptr(h), Ptr(y),
                                            rstd.data_ptr<float>(), c.rows, c.cols,
                                            static_cast<float>(eps), Dt(c.dtype),
                                            Dt(c.weight_dtype), nullptr));
    return std::vector<at::Tensor>{h, y, rstd};
  });
  const at::Tensor& h = fwd[0];
  const at::Tensor& rstd = fwd[2];
  std::vector<at::Tensor> bwd = UnderEverySchedule([&] {
    at::Tensor gx = output(m & kGradX);
    at::Tensor gw = c.weight_grad ? at::empty_like(w) : at::Tensor();
    at::Tensor partials = at::empty(
        {emulated::RmsNormBackwardPartials(c.rows, c.cols), c.cols}, at::kFloat);
    ExpectLaunched(emulated::RmsNormBackward(
        Ptr(c.residual ? h : x), rstd.data_ptr<float>(), Ptr(w), Ptr(gy), Ptr(gh), Ptr(gx),
        Ptr(gw), partials.data_ptr<float>(), c.rows, c.cols, Dt(c.dtype), Dt(c.weight_dtype),
        nullptr));
    return std::vector<at::Tensor>{gx, gw};
  });

  // The CPU reference, forward and autograd backward.
  at::Tensor xr = x.clone().requires_grad_(), wr = w.clone().requires_grad_();
  at::Tensor rr = c.residual ? res.clone().requires_grad_() : at::Tensor();
  at::Tensor h_ref, y_ref;
  if (c.residual) {
    std::tie(h_ref, y_ref) = AddRmsNorm(xr, rr, wr, eps);
    torch::autograd::backward({y_ref, h_ref}, {gy, gh});
  } else if (c.fork) {
    at::Tensor x_out;
    std::tie(x_out, y_ref) = ForkRmsNorm(xr, wr, eps);
    torch::autograd::backward({y_ref, x_out}, {gy, gh});
  } else {
    y_ref = RmsNorm(xr, wr, eps);
    torch::autograd::backward({y_ref}, {gy});
  }
  const bool low = c.dtype != at::kFloat;
  const double tol = low ? 1e-2 : 1e-5;
  SCOPED_TRACE(DtypeName(c.dtype) + " weight " + DtypeName(c.weight_dtype));
  if (c.residual) {
    EXPECT_TRUE(at::equal(h, h_ref.detach())) << "h = x + residual, rounded once";
  }
  EXPECT_TRUE(AllClose(fwd[1], y_ref, tol, tol, "y"));
  at::Tensor hf = (c.residual ? h : x).to(at::kDouble);
  at::Tensor rstd_ref = (hf.pow(2).mean(-1) + eps).rsqrt();
  EXPECT_TRUE(AllClose(rstd, rstd_ref, 1e-6, 1e-6, "rstd"));
  EXPECT_TRUE(AllClose(bwd[0], xr.grad(), tol, tol, "grad x"));
  if (c.weight_grad) {
    const double scale = wr.grad().abs().max().item<double>();
    EXPECT_TRUE(AllClose(bwd[1], wr.grad(), low ? 0.0 : 1e-5, tol * scale, "grad weight"));
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, EmulatedRmsNormTest,
    ::testing::Values(RmsCase{5, 100, at::kFloat, at::kFloat, false, true},
                      RmsCase{7, 1000, at::kBFloat16, at::kFloat, true, true},
                      RmsCase{4, 257, at::kBFloat16, at::kBFloat16, false, true},
                      RmsCase{33, 64, at::kHalf, at::kFloat, true, true},  // rows per block > 1
                      RmsCase{19, 40, at::kFloat, at::kFloat, true, false},
                      // Beyond kSmemCols: the partial rows accumulate in global memory.
                      RmsCase{3, 13000, at::kFloat, at::kFloat, true, true},
                      // The model shapes: llama_1b (dim 2048), Llama 3 8B (dim 4096).
                      RmsCase{4, 2048, at::kBFloat16, at::kFloat, true, true},
                      RmsCase{2, 4096, at::kBFloat16, at::kFloat, true, true},
                      // The largest row held in registers (256 threads x 4 packs of 8), and
                      // longer rows: 16-byte packs, then single elements, read twice.
                      RmsCase{2, 8192, at::kBFloat16, at::kFloat, true, true},
                      RmsCase{2, 8200, at::kBFloat16, at::kBFloat16, true, true},
                      RmsCase{3, 2051, at::kHalf, at::kFloat, true, true},
                      // Blocks striding over rows: 70 rows over 9 blocks (7 or 8 rows each).
                      RmsCase{70, 24, at::kFloat, at::kFloat, true, true},
                      // One operand off its 16-byte boundary at a time: the element path.
                      RmsCase{3, 64, at::kBFloat16, at::kFloat, true, true, kX},
                      RmsCase{3, 64, at::kBFloat16, at::kFloat, true, true, kResidual},
                      RmsCase{3, 64, at::kBFloat16, at::kFloat, true, true, kH},
                      RmsCase{3, 64, at::kBFloat16, at::kFloat, true, true, kY},
                      RmsCase{3, 64, at::kBFloat16, at::kFloat, true, true, kGradY},
                      RmsCase{3, 64, at::kBFloat16, at::kFloat, true, true, kGradH},
                      RmsCase{3, 64, at::kBFloat16, at::kFloat, true, true, kGradX},
                      RmsCase{3, 64, at::kBFloat16, at::kBFloat16, true, true, kWeight},
                      RmsCase{3, 64, at::kFloat, at::kFloat, false, true, kX},
                      // ForkRmsNorm: the extra gradient without a residual, on the vector and
                      // element paths, cached and long rows, and each of its operands off its
                      // 16-byte boundary.
                      RmsCase{5, 100, at::kFloat, at::kFloat, false, true, kNone, true},
                      RmsCase{4, 257, at::kBFloat16, at::kBFloat16, false, true, kNone, true},
                      RmsCase{19, 40, at::kFloat, at::kFloat, false, false, kNone, true},
                      RmsCase{4, 2048, at::kBFloat16, at::kFloat, false, true, kNone, true},
                      RmsCase{3, 13000, at::kFloat, at::kFloat, false, true, kNone, true},
                      RmsCase{2, 8200, at::kBFloat16, at::kBFloat16, false, true, kNone, true},
                      RmsCase{3, 64, at::kBFloat16, at::kFloat, false, true, kX, true},
                      RmsCase{3, 64, at::kBFloat16, at::kFloat, false, true, kGradH, true},
                      RmsCase{3, 64, at::kBFloat16, at::kFloat, false, true, kGradX, true}),
    [](const ::testing::TestParamInfo<RmsCase>& info) {
      const RmsCase& c = info.param;
      return std::to_string(c.rows) + "x" + std::to_string(c.cols) + "_" + DtypeName(c.dtype) +
             "_w" + DtypeName(c.weight_dtype) + (c.residual ? "_residual" : "") +
             (c.fork ? "_fork" : "") + (c.weight_grad ? "" : "_no_weight_grad") +
             (c.misaligned ? "_misaligned" + std::to_string(c.misaligned) : "");
    });

// ---- SwiGLU ----------------------------------------------------------------------------------

class EmulatedSwiGluTest : public ::testing::TestWithParam<std::tuple<at::ScalarType, bool>> {};

TEST_P(EmulatedSwiGluTest, ForwardAndBackwardMatchTheCpuReference) {
  const auto [dtype, fused] = GetParam();
  const int64_t rows = 17, cols = 333;
  at::manual_seed(3);
  // Two tensors, or the fused projection [rows, 2 * cols] (gate then up, row stride 2 * cols).
  at::Tensor gate_up = at::randn({rows, 2 * cols}).mul(3).to(dtype);
  at::Tensor gate = fused ? gate_up.narrow(1, 0, cols) : at::randn({rows, cols}).mul(3).to(dtype);
  at::Tensor up = fused ? gate_up.narrow(1, cols, cols) : at::randn({rows, cols}).to(dtype);
  at::Tensor gout = at::randn({rows, cols}).to(dtype);
  auto operand = [](const at::Tensor& t) {
    return emulated::SwiGluOperand{t.data_ptr(), t.stride(0)};
  };
  std::vector<at::Tensor> out = UnderEverySchedule([&] {
    at::Tensor y = at::empty({rows, cols}, dtype);
    at::Tensor g_gate_up = at::empty({rows, 2 * cols}, dtype);
    at::Tensor g_gate = fused ? g_gate_up.narrow(1, 0, cols) : at::empty({rows, cols}, dtype);
    at::Tensor g_up = fused ? g_gate_up.narrow(1, cols, cols) : at::empty({rows, cols}, dtype);
    ExpectLaunched(emulated::SwiGluForward(operand(gate), operand(up), operand(y), rows, cols,
                                           Dt(dtype), nullptr));
    ExpectLaunched(emulated::SwiGluBackward(operand(gate), operand(up), operand(gout),
                                            operand(g_gate), operand(g_up), rows, cols,
                                            Dt(dtype), nullptr));
    return std::vector<at::Tensor>{y, g_gate.contiguous(), g_up.contiguous()};
  });
  at::Tensor gr = gate.detach().clone().requires_grad_(), ur = up.detach().clone().requires_grad_();
  at::Tensor y_ref = SwiGlu(gr, ur);
  torch::autograd::backward({y_ref}, {gout});
  const double tol = dtype == at::kFloat ? 1e-5 : 1e-2;
  SCOPED_TRACE(DtypeName(dtype) + (fused ? " fused" : " two tensors"));
  EXPECT_TRUE(AllClose(out[0], y_ref, tol, tol, "silu(gate) * up"));
  EXPECT_TRUE(AllClose(out[1], gr.grad(), tol, tol, "grad gate"));
  EXPECT_TRUE(AllClose(out[2], ur.grad(), tol, tol, "grad up"));
}

INSTANTIATE_TEST_SUITE_P(Cases, EmulatedSwiGluTest,
                         ::testing::Combine(::testing::Values(at::kFloat, at::kBFloat16),
                                            ::testing::Bool()),
                         [](const auto& info) {
                           return DtypeName(std::get<0>(info.param)) +
                                  (std::get<1>(info.param) ? "_fused" : "_two_tensors");
                         });

// The 16-byte path (cols a multiple of 8 bf16 / 4 fp32, gate and up 16-byte aligned, also as
// the two halves of one projection) and the element path forced by one operand at an odd
// element offset (misaligned: 0 none, 1 gate, 2 up, 3 out and grad_gate). Forward and backward.
struct SwiGluCase {
  int64_t rows, cols;
  at::ScalarType dtype;
  bool fused;
  int misaligned;
};

class EmulatedSwiGluPathsTest : public ::testing::TestWithParam<SwiGluCase> {};

TEST_P(EmulatedSwiGluPathsTest, ForwardAndBackwardMatchTheCpuReference) {
  const SwiGluCase c = GetParam();
  const int64_t rows = c.rows, cols = c.cols;
  const at::ScalarType dtype = c.dtype;
  at::manual_seed(4);
  // [rows, 2 * cols + pad]: pad 8 keeps the row stride a multiple of the vector width; an
  // operand starting at column 1 is off its 16-byte boundary.
  at::Tensor buffer = at::randn({rows, 2 * cols + 8}).mul(3).to(dtype);
  const int64_t gate_at = c.misaligned == 1 ? 1 : 0;
  const int64_t up_at = c.fused ? cols : (c.misaligned == 2 ? cols + 1 : cols + 8);
  at::Tensor gate = buffer.narrow(1, gate_at, cols), up = buffer.narrow(1, up_at, cols);
  at::Tensor gout = at::randn({rows, cols}).to(dtype);
  auto operand = [](const at::Tensor& t) {
    return emulated::SwiGluOperand{t.data_ptr(), t.stride(0)};
  };
  auto fresh = [&](bool offset) {
    return at::zeros({rows, cols + 8}, dtype).narrow(1, offset ? 1 : 0, cols);
  };
  std::vector<at::Tensor> out = UnderEverySchedule([&] {
    at::Tensor y = fresh(c.misaligned == 3), g_gate = fresh(c.misaligned == 3), g_up = fresh(false);
    ExpectLaunched(emulated::SwiGluForward(operand(gate), operand(up), operand(y), rows, cols,
                                           Dt(dtype), nullptr));
    ExpectLaunched(emulated::SwiGluBackward(operand(gate), operand(up), operand(gout),
                                            operand(g_gate), operand(g_up), rows, cols,
                                            Dt(dtype), nullptr));
    return std::vector<at::Tensor>{y.contiguous(), g_gate.contiguous(), g_up.contiguous()};
  });
  at::Tensor gr = gate.detach().clone().requires_grad_(), ur = up.detach().clone().requires_grad_();
  at::Tensor y_ref = SwiGlu(gr, ur);
  torch::autograd::backward({y_ref}, {gout});
  const double tol = dtype == at::kFloat ? 1e-5 : 1e-2;
  EXPECT_TRUE(AllClose(out[0], y_ref, tol, tol, "silu(gate) * up"));
  EXPECT_TRUE(AllClose(out[1], gr.grad(), tol, tol, "grad gate"));
  EXPECT_TRUE(AllClose(out[2], ur.grad(), tol, tol, "grad up"));
}

INSTANTIATE_TEST_SUITE_P(
    Cases, EmulatedSwiGluPathsTest,
    ::testing::Values(SwiGluCase{9, 336, at::kBFloat16, true, 0},   // 42 packs of 8
                      SwiGluCase{9, 336, at::kBFloat16, false, 0},
                      SwiGluCase{5, 1100, at::kFloat, true, 0},     // 275 packs: 2 x-blocks
                      SwiGluCase{3, 2064, at::kHalf, false, 0},     // 258 packs: 2 x-blocks
                      SwiGluCase{4, 64, at::kBFloat16, false, 1},
                      SwiGluCase{4, 64, at::kBFloat16, false, 2},
                      SwiGluCase{4, 64, at::kFloat, false, 3}),
    [](const ::testing::TestParamInfo<SwiGluCase>& info) {
      const SwiGluCase& c = info.param;
      return std::to_string(c.rows) + "x" + std::to_string(c.cols) + "_" + DtypeName(c.dtype) +
             (c.fused ? "_fused" : "") +
             (c.misaligned ? "_misaligned" + std::to_string(c.misaligned) : "");
    });

// ---- RoPE ------------------------------------------------------------------------------------

struct RopeCase {
  int64_t batch, seq, q_heads, k_heads, head_dim;
  at::ScalarType dtype;
  bool strided;    // q and k are views with odd strides: the element-wise (not pair) path
  bool in_place;
};

class EmulatedRopeTest : public ::testing::TestWithParam<RopeCase> {};

emulated::RopeOperand Operand(const at::Tensor& in, const at::Tensor& out) {
  emulated::RopeOperand op;
  op.in = in.data_ptr();
  op.out = out.data_ptr();
  op.heads = in.size(2);
  for (int d = 0; d < 4; ++d) {
    op.in_stride[d] = in.stride(d);
    op.out_stride[d] = out.stride(d);
  }
  return op;
}

TEST_P(EmulatedRopeTest, RotationAndInverseEqualTheCpuReferenceBitwise) {
  const RopeCase c = GetParam();
  const int64_t half = c.head_dim / 2, seq_max = c.seq + 3;
  at::manual_seed(7);
  at::Tensor angles = at::arange(seq_max, at::kFloat).unsqueeze(1) *
                      at::pow(10000.0, -at::arange(half, at::kFloat) / half).unsqueeze(0);
  at::Tensor cos = angles.cos(), sin = angles.sin();
  auto make = [&](int64_t heads) {
    if (!c.strided) return at::randn({c.batch, c.seq, heads, c.head_dim}).to(c.dtype);
    // Odd strides: each head padded by one element, so pairs are not 2-element aligned.
    return at::randn({c.batch, c.seq, heads, c.head_dim + 1})
        .to(c.dtype)
        .narrow(3, 0, c.head_dim);
  };
  const at::Tensor q = make(c.q_heads), k = make(c.k_heads);
  const at::Tensor gq = make(c.q_heads), gk = make(c.k_heads);
  auto rotate = [&](const at::Tensor& a, const at::Tensor& b, bool inverse) {
    // Fresh copies of the inputs, in the case's layout (the kernel may write them in place).
    at::Tensor a_in = c.strided ? make(a.size(2)).copy_(a) : a.clone();
    at::Tensor b_in = c.strided ? make(b.size(2)).copy_(b) : b.clone();
    at::Tensor a_out = c.in_place ? a_in : at::empty(a.sizes(), a.options());
    at::Tensor b_out = c.in_place ? b_in : at::empty(b.sizes(), b.options());
    ExpectLaunched(emulated::Rope(Operand(a_in, a_out), Operand(b_in, b_out),
                                  cos.data_ptr<float>(), sin.data_ptr<float>(), c.batch, c.seq,
                                  c.head_dim, inverse, Dt(c.dtype), nullptr));
    return std::vector<at::Tensor>{a_out.contiguous(), b_out.contiguous()};
  };
  std::vector<at::Tensor> fwd = UnderEverySchedule([&] { return rotate(q, k, false); });
  std::vector<at::Tensor> bwd = UnderEverySchedule([&] { return rotate(gq, gk, true); });

  at::Tensor qr = q.detach().clone().requires_grad_(), kr = k.detach().clone().requires_grad_();
  auto [q_ref, k_ref] = Rope(qr, kr, cos, sin);
  torch::autograd::backward({q_ref, k_ref}, {gq, gk});
  SCOPED_TRACE(DtypeName(c.dtype) + (c.strided ? " strided" : " contiguous") +
               (c.in_place ? " in place" : ""));
  EXPECT_TRUE(at::equal(fwd[0], q_ref.detach())) << AllClose(fwd[0], q_ref, 0, 0, "q").message();
  EXPECT_TRUE(at::equal(fwd[1], k_ref.detach())) << AllClose(fwd[1], k_ref, 0, 0, "k").message();
  EXPECT_TRUE(at::equal(bwd[0], qr.grad())) << AllClose(bwd[0], qr.grad(), 0, 0, "grad q").message();
  EXPECT_TRUE(at::equal(bwd[1], kr.grad())) << AllClose(bwd[1], kr.grad(), 0, 0, "grad k").message();
}

INSTANTIATE_TEST_SUITE_P(
    Cases, EmulatedRopeTest,
    ::testing::Values(RopeCase{2, 5, 4, 2, 16, at::kFloat, false, true},
                      RopeCase{2, 5, 4, 2, 16, at::kBFloat16, false, false},
                      RopeCase{1, 3, 32, 8, 64, at::kFloat, false, false},  // pairs > threads
                      RopeCase{2, 4, 3, 1, 10, at::kFloat, true, true},
                      RopeCase{2, 4, 3, 3, 10, at::kHalf, true, false},
                      // The model shapes: llama_1b (16 heads of 128), Llama 3 8B (32 / 8 kv).
                      RopeCase{1, 3, 16, 16, 128, at::kBFloat16, false, true},
                      RopeCase{1, 2, 32, 8, 128, at::kBFloat16, false, true},
                      // head_dim not a multiple of the 16-byte width: one pair per access.
                      RopeCase{2, 3, 4, 2, 12, at::kBFloat16, false, true},
                      RopeCase{2, 3, 3, 1, 10, at::kFloat, false, false},
                      // 16-byte units in fp32 (2 pairs) and fp16, odd head counts.
                      RopeCase{2, 3, 5, 3, 12, at::kFloat, false, true},
                      RopeCase{1, 4, 3, 1, 32, at::kHalf, false, false}),
    [](const ::testing::TestParamInfo<RopeCase>& info) {
      const RopeCase& c = info.param;
      return "h" + std::to_string(c.q_heads) + "kv" + std::to_string(c.k_heads) + "d" +
             std::to_string(c.head_dim) + "_" + DtypeName(c.dtype) +
             (c.strided ? "_strided" : "") + (c.in_place ? "_in_place" : "");
    });

// ---- Softmax cross-entropy (the per-chunk kernel of LinearCrossEntropy) ----------------------

struct CeCase {
  int64_t vocab;
  at::ScalarType dtype;
};

class EmulatedCrossEntropyTest : public ::testing::TestWithParam<CeCase> {};

TEST_P(EmulatedCrossEntropyTest, LossesAndGradientsMatchFp64) {
  const CeCase c = GetParam();
  const int64_t rows = 6, ignore = -100;
  at::manual_seed(5);
  at::Tensor logits = (at::randn({rows, c.vocab}) * 4).to(c.dtype);
  // Row 2 has masked entries (-inf) including a run at the start of a vector.
  logits[2].narrow(0, 0, 9).fill_(-std::numeric_limits<float>::infinity());
  at::Tensor targets = at::randint(c.vocab, {rows}, at::kLong);
  targets[2] = c.vocab - 1;
  targets[4] = ignore;
  at::Tensor scale = at::full({1}, 1.0f / (rows - 1), at::kFloat);
  std::vector<at::Tensor> out = UnderEverySchedule([&] {
    at::Tensor grad = logits.clone();  // the kernel overwrites the logits with the gradient
    at::Tensor losses = at::empty({rows}, at::kFloat);
    ExpectLaunched(emulated::SoftmaxCrossEntropy(Ptr(grad), targets.data_ptr<int64_t>(),
                                                 losses.data_ptr<float>(),
                                                 scale.data_ptr<float>(), rows, c.vocab, ignore,
                                                 /*write_grad=*/true, Dt(c.dtype), nullptr));
    at::Tensor untouched = logits.clone();
    at::Tensor losses_only = at::empty({rows}, at::kFloat);
    ExpectLaunched(emulated::SoftmaxCrossEntropy(Ptr(untouched), targets.data_ptr<int64_t>(),
                                                 losses_only.data_ptr<float>(), nullptr, rows,
                                                 c.vocab, ignore, /*write_grad=*/false,
                                                 Dt(c.dtype), nullptr));
    EXPECT_TRUE(at::equal(untouched, logits)) << "write_grad=false wrote the logits";
    EXPECT_TRUE(at::equal(losses_only, losses)) << "the loss depends on write_grad";
    return std::vector<at::Tensor>{losses, grad};
  });

  at::Tensor x = logits.to(at::kDouble);
  at::Tensor lse = x.logsumexp(1);
  at::Tensor valid = targets.ne(ignore);
  at::Tensor safe_targets = targets.clamp_min(0);
  at::Tensor loss_ref = (lse - x.gather(1, safe_targets.unsqueeze(1)).squeeze(1)) * valid;
  at::Tensor grad_ref = (x - lse.unsqueeze(1)).exp();
  grad_ref.scatter_add_(1, safe_targets.unsqueeze(1), -at::ones({rows, 1}, at::kDouble));
  grad_ref = grad_ref * (1.0 / (rows - 1)) * valid.unsqueeze(1);
  const bool low = c.dtype != at::kFloat;
  SCOPED_TRACE(DtypeName(c.dtype) + " vocab " + std::to_string(c.vocab));
  EXPECT_TRUE(AllClose(out[0], loss_ref, 1e-5, 1e-5, "losses"));
  // Gradients are at most 1 / (rows - 1) in magnitude: rounding to the dtype dominates.
  EXPECT_TRUE(AllClose(out[1], grad_ref, low ? 1e-2 : 1e-5, 1e-7, "gradient"));
  EXPECT_TRUE(out[1][4].eq(0).all().item<bool>()) << "the ignored row's gradient is zero";
  EXPECT_EQ(out[0][4].item<float>(), 0.0f) << "the ignored row's loss is zero";
}

INSTANTIATE_TEST_SUITE_P(Cases, EmulatedCrossEntropyTest,
                         ::testing::Values(CeCase{1000, at::kFloat},      // vector loads
                                           CeCase{1000, at::kBFloat16},   // vector loads
                                           CeCase{50257, at::kBFloat16},  // element loads
                                           CeCase{32003, at::kFloat},     // element loads
                                           CeCase{32000, at::kHalf},
                                           CeCase{32000, at::kBFloat16},   // llama_1b
                                           CeCase{128256, at::kBFloat16}), // Llama 3
                         [](const ::testing::TestParamInfo<CeCase>& info) {
                           return DtypeName(info.param.dtype) + "_vocab" +
                                  std::to_string(info.param.vocab);
                         });

// ---- The autograd functions, through their CUDA branches ------------------------------------

// Forward and the gradients of `inputs` for a gradient `grad` of the output, by `f`.
template <typename F>
std::vector<at::Tensor> ValueAndGrads(F f, std::vector<at::Tensor> inputs, const at::Tensor& grad) {
  for (at::Tensor& t : inputs) t = t.detach().clone().requires_grad_();
  at::Tensor out = f(inputs);
  torch::autograd::backward({out}, {grad});
  std::vector<at::Tensor> result{out.detach()};
  for (const at::Tensor& t : inputs) result.push_back(t.grad());
  return result;
}

void ExpectAllClose(const std::vector<at::Tensor>& actual, const std::vector<at::Tensor>& expected,
                    double tol, const std::vector<std::string>& names) {
  ASSERT_EQ(actual.size(), expected.size());
  for (size_t i = 0; i < actual.size(); ++i) {
    EXPECT_TRUE(AllClose(actual[i], expected[i], tol, tol, names[i]));
  }
}

class EmulatedFunctionTest : public ::testing::TestWithParam<at::ScalarType> {
 protected:
  double Tol() const { return GetParam() == at::kFloat ? 1e-5 : 1e-2; }
};

TEST_P(EmulatedFunctionTest, RmsNormsOnA3dNonContiguousInput) {
  const at::ScalarType dtype = GetParam();
  at::manual_seed(21);
  // [b, t, D] views of a [t, b, D] buffer: not contiguous, so the functions copy first.
  at::Tensor x = at::randn({9, 2, 96}).to(dtype).transpose(0, 1);
  at::Tensor res = at::randn({2, 9, 96}).to(dtype);
  at::Tensor w = (1 + 0.1 * at::randn({96})).to(at::kFloat);
  at::Tensor gy = at::randn({2, 9, 96}).to(dtype);
  auto run = [&](auto add_rms_norm) {
    return ValueAndGrads(
        [&](const std::vector<at::Tensor>& in) {
          auto [h, y] = add_rms_norm(in[0], in[1], in[2], 1e-5);
          return (h.to(at::kFloat) * 0.5 + y.to(at::kFloat)).to(dtype);  // both outputs used
        },
        {x, res, w}, gy);
  };
  ExpectAllClose(run(fsdp::kernels_emulated::AddRmsNorm), run(fsdp::kernels::AddRmsNorm),
                 Tol(), {"h / 2 + y", "grad x", "grad residual", "grad weight"});
  auto run_plain = [&](auto rms_norm) {
    return ValueAndGrads(
        [&](const std::vector<at::Tensor>& in) { return rms_norm(in[0], in[1], 1e-5); },
        {x, w.to(dtype)}, gy);
  };
  ExpectAllClose(run_plain(fsdp::kernels_emulated::RmsNorm), run_plain(fsdp::kernels::RmsNorm),
                 Tol(), {"y", "grad x", "grad weight"});
  auto run_fork = [&](auto fork_rms_norm) {
    return ValueAndGrads(
        [&](const std::vector<at::Tensor>& in) {
          auto [x_out, y] = fork_rms_norm(in[0], in[1], 1e-5);
          return (x_out.to(at::kFloat) * 0.5 + y.to(at::kFloat)).to(dtype);  // both outputs used
        },
        {x, w}, gy);
  };
  ExpectAllClose(run_fork(fsdp::kernels_emulated::ForkRmsNorm),
                 run_fork(fsdp::kernels::ForkRmsNorm), Tol(),
                 {"fork: x / 2 + y", "fork: grad x", "fork: grad weight"});
}

TEST_P(EmulatedFunctionTest, SwiGluTwoTensorsAndFusedProjection) {
  const at::ScalarType dtype = GetParam();
  at::manual_seed(22);
  at::Tensor gate = at::randn({3, 5, 70}).mul(2).to(dtype), up = at::randn({3, 5, 70}).to(dtype);
  at::Tensor gate_up = at::randn({3, 5, 140}).mul(2).to(dtype);
  at::Tensor g = at::randn({3, 5, 70}).to(dtype);
  auto two = [&](auto swiglu) {
    return ValueAndGrads([&](const std::vector<at::Tensor>& in) { return swiglu(in[0], in[1]); },
                         {gate, up}, g);
  };
  auto fused = [&](auto swiglu) {
    return ValueAndGrads([&](const std::vector<at::Tensor>& in) { return swiglu(in[0]); },
                         {gate_up}, g);
  };
  using Two = at::Tensor (*)(const at::Tensor&, const at::Tensor&);
  using One = at::Tensor (*)(const at::Tensor&);
  ExpectAllClose(two(static_cast<Two>(fsdp::kernels_emulated::SwiGlu)),
                 two(static_cast<Two>(fsdp::kernels::SwiGlu)), Tol(),
                 {"silu(gate) * up", "grad gate", "grad up"});
  ExpectAllClose(fused(static_cast<One>(fsdp::kernels_emulated::SwiGlu)),
                 fused(static_cast<One>(fsdp::kernels::SwiGlu)), Tol(),
                 {"fused: silu(gate) * up", "fused: grad gate_up"});
}

TEST_P(EmulatedFunctionTest, RopeInPlaceOnProjectionViewsEqualsTheCpuReferenceBitwise) {
  const at::ScalarType dtype = GetParam();
  at::manual_seed(23);
  const int64_t b = 2, t = 6, heads = 4, kv_heads = 2, hd = 16;
  at::Tensor angles = at::arange(t + 2, at::kFloat).unsqueeze(1) *
                      at::pow(10000.0, -at::arange(hd / 2, at::kFloat) / (hd / 2)).unsqueeze(0);
  at::Tensor cos = angles.cos(), sin = angles.sin();
  at::Tensor x = at::randn({b, t, 32}).to(dtype);
  at::Tensor wq = at::randn({heads * hd, 32}).to(dtype), wk = at::randn({kv_heads * hd, 32}).to(dtype);
  at::Tensor gq = at::randn({b, t, heads, hd}).to(dtype), gk = at::randn({b, t, kv_heads, hd}).to(dtype);
  // As the model: q and k are views of the projections' outputs, rotated in place.
  auto run = [&](auto rope_in_place) {
    at::Tensor xr = x.clone().requires_grad_();
    at::Tensor q = at::linear(xr, wq).view({b, t, heads, hd});
    at::Tensor k = at::linear(xr, wk).view({b, t, kv_heads, hd});
    rope_in_place(q, k, cos, sin);
    torch::autograd::backward({q, k}, {gq, gk});
    return std::vector<at::Tensor>{q.detach().clone(), k.detach().clone(), xr.grad()};
  };
  std::vector<at::Tensor> emulated = run(fsdp::kernels_emulated::RopeInPlace);
  std::vector<at::Tensor> reference = run(fsdp::kernels::RopeInPlace);
  const char* names[] = {"q", "k", "grad x"};
  for (int i = 0; i < 3; ++i) {
    EXPECT_TRUE(at::equal(emulated[i], reference[i]))
        << AllClose(emulated[i], reference[i], 0, 0, names[i]).message();
  }
}

TEST_P(EmulatedFunctionTest, LinearCrossEntropyInChunks) {
  const at::ScalarType dtype = GetParam();
  at::manual_seed(24);
  const int64_t n = 37, d = 24, vocab = 1003;
  at::Tensor hidden = at::randn({n, d}).to(dtype), weight = (0.2 * at::randn({vocab, d})).to(dtype);
  at::Tensor targets = at::randint(vocab, {n}, at::kLong);
  targets[3] = fsdp::kernels::kIgnoreIndex;
  targets[30] = fsdp::kernels::kIgnoreIndex;
  for (int64_t chunk : {int64_t{n}, int64_t{10}}) {  // one chunk; four, the last one short
    auto run = [&](auto ce) {
      return ValueAndGrads(
          [&](const std::vector<at::Tensor>& in) { return ce(in[0], in[1], targets, chunk); },
          {hidden, weight}, at::full({}, 1.0f));
    };
    SCOPED_TRACE("chunk " + std::to_string(chunk));
    ExpectAllClose(run(fsdp::kernels_emulated::LinearCrossEntropy),
                   run(fsdp::kernels::LinearCrossEntropy), Tol(),
                   {"loss", "grad hidden", "grad weight"});
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, EmulatedFunctionTest,
                         ::testing::Values(at::kFloat, at::kBFloat16),
                         [](const ::testing::TestParamInfo<at::ScalarType>& info) {
                           return DtypeName(info.param);
                         });

}  // namespace
}  // namespace fsdp::kernels
