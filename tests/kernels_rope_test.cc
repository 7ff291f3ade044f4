// kernels::RopeInPlace and kernels::Rope against the model's composite rotation (RopeComposite,
// gpt.cc's Rotate()): forward and backward through the projections that produce q and k, fp32
// and bf16, odd sizes, tables longer than the sequence, q and k as strided views of one fused
// projection, and the autograd contract of the in-place form (Note [RoPE in place under
// autograd]). CPU reference always; CUDA kernel with a GPU.
#include "kernels/rope.h"

#include <cmath>
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
  int64_t batch, seq, heads, kv_heads, head_dim, seq_max;
  at::ScalarType dtype;
  bool fused;  // q and k: views of one [b, t, (heads + 2 kv_heads) * head_dim] projection
  double rtol, atol;
};

// The model's tables (gpt.cc): theta 10000, angles t * theta^(-2i / head_dim).
std::pair<at::Tensor, at::Tensor> Tables(int64_t seq_max, int64_t head_dim, c10::Device device) {
  auto inv = torch::pow(10000.0, -torch::arange(head_dim / 2, torch::kDouble) * 2.0 / head_dim);
  auto angles = torch::outer(torch::arange(seq_max, torch::kDouble), inv);
  return {angles.cos().to(device, torch::kFloat), angles.sin().to(device, torch::kFloat)};
}

// q and k from x through the projection(s), as the model makes them; `outputs`: the
// projections' outputs (gradients retained), whose gradients are the rotation's backward.
struct Projected {
  at::Tensor q, k;
  std::vector<at::Tensor> outputs;
};

Projected Project(const Case& c, const at::Tensor& x, const at::Tensor& w) {
  const int64_t q_width = c.heads * c.head_dim, kv_width = c.kv_heads * c.head_dim;
  Projected r;
  if (c.fused) {  // strided views of one [b, t, (heads + 2 kv_heads) * head_dim] output
    at::Tensor p = at::linear(x, w);
    r.q = p.narrow(-1, 0, q_width).view({c.batch, c.seq, c.heads, c.head_dim});
    r.k = p.narrow(-1, q_width, kv_width).view({c.batch, c.seq, c.kv_heads, c.head_dim});
    r.outputs = {p};
  } else {  // separate projections: contiguous views of their own outputs
    at::Tensor pq = at::linear(x, w.narrow(0, 0, q_width));
    at::Tensor pk = at::linear(x, w.narrow(0, q_width, kv_width));
    r.q = pq.view({c.batch, c.seq, c.heads, c.head_dim});
    r.k = pk.view({c.batch, c.seq, c.kv_heads, c.head_dim});
    r.outputs = {pq, pk};
  }
  for (at::Tensor& out : r.outputs) out.retain_grad();
  return r;
}

enum class Form { kInPlace, kOutOfPlace };

// Forward, the gradients of the projections' outputs (what the rotation's backward wrote) and,
// in fp32, of x and w, against the composite on fp32 copies of the same inputs. (In bf16 the
// gradients of x and w also carry the bf16 matmuls' error, not the rotation's: not compared.)
void CheckAgainstComposite(const Case& c, Form form, c10::Device device) {
  SCOPED_TRACE(::testing::Message()
               << "b " << c.batch << " t " << c.seq << " heads " << c.heads << "/" << c.kv_heads
               << " head_dim " << c.head_dim << " seq_max " << c.seq_max << " " << c.dtype
               << (c.fused ? " fused" : " separate")
               << (form == Form::kInPlace ? " in place" : " out of place"));
  torch::manual_seed(11);
  const int64_t dim = 16, width = (c.heads + 2 * c.kv_heads) * c.head_dim;
  at::Tensor x0 = torch::randn({c.batch, c.seq, dim}).to(device, c.dtype);
  at::Tensor w0 = (torch::randn({width, dim}) / 4).to(device, c.dtype);
  auto [cos, sin] = Tables(c.seq_max, c.head_dim, device);
  at::Tensor dq = torch::randn({c.batch, c.seq, c.heads, c.head_dim}).to(device, c.dtype);
  at::Tensor dk = torch::randn({c.batch, c.seq, c.kv_heads, c.head_dim}).to(device, c.dtype);

  at::Tensor x = x0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
  Projected f = Project(c, x, w);
  if (form == Form::kInPlace) {
    RopeInPlace(f.q, f.k, cos, sin);
  } else {
    std::tie(f.q, f.k) = Rope(f.q, f.k, cos, sin);
  }
  EXPECT_EQ(f.q.scalar_type(), c.dtype);
  EXPECT_EQ(f.k.scalar_type(), c.dtype);
  ((f.q * dq).sum() + (f.k * dk).sum()).backward();  // upstream gradients dq and dk

  at::Tensor xr = x0.to(at::kFloat).requires_grad_(true);
  at::Tensor wr = w0.to(at::kFloat).requires_grad_(true);
  Projected r = Project(c, xr, wr);
  r.q = RopeComposite(r.q, cos, sin);
  r.k = RopeComposite(r.k, cos, sin);
  ((r.q * dq.to(at::kFloat)).sum() + (r.k * dk.to(at::kFloat)).sum()).backward();
  EXPECT_TRUE(AllClose(f.q, r.q, c.rtol, c.atol, "rotated q"));
  EXPECT_TRUE(AllClose(f.k, r.k, c.rtol, c.atol, "rotated k"));
  for (size_t i = 0; i < f.outputs.size(); ++i) {
    EXPECT_TRUE(AllClose(f.outputs[i].grad(), r.outputs[i].grad(), c.rtol, c.atol,
                         "grad of projection output " + std::to_string(i)));
  }
  if (c.dtype == at::kFloat) {
    EXPECT_TRUE(AllClose(w.grad(), wr.grad(), c.rtol, c.atol, "grad of the projection weight"));
    EXPECT_TRUE(AllClose(x.grad(), xr.grad(), c.rtol, c.atol, "grad of x"));
  }
}

std::vector<Case> Cases() {
  // fp32: the same arithmetic as the composite, bitwise equal (the CUDA kernel rounds each
  // product with __fmul_rn, so nvcc cannot contract them into FMAs).
  // bf16: ours rounds once from fp32 arithmetic; against the fp32 composite on the same bf16
  // inputs the difference is the bf16 projection output's rounding plus ours (measured on CPU:
  // at most 0.6% of the value).
  return {
      {2, 7, 3, 1, 6, 16, at::kFloat, true, 1e-6, 1e-6},
      {1, 1, 1, 1, 2, 4, at::kFloat, false, 1e-6, 1e-6},
      {2, 129, 4, 2, 64, 160, at::kFloat, true, 1e-6, 1e-6},
      {1, 33, 3, 3, 128, 33, at::kFloat, false, 1e-6, 1e-6},
      {3, 7, 3, 1, 6, 7, at::kFloat, false, 1e-6, 1e-6},
      {2, 7, 3, 1, 6, 16, at::kBFloat16, true, 1e-2, 1e-2},
      {2, 129, 4, 2, 64, 160, at::kBFloat16, true, 1e-2, 1e-2},
      {1, 33, 1, 1, 128, 40, at::kBFloat16, false, 1e-2, 1e-2},
  };
}

TEST(KernelsRopeTest, CpuInPlaceMatchesComposite) {
  for (const Case& c : Cases()) CheckAgainstComposite(c, Form::kInPlace, c10::kCPU);
}

TEST(KernelsRopeTest, CpuOutOfPlaceMatchesComposite) {
  for (const Case& c : Cases()) CheckAgainstComposite(c, Form::kOutOfPlace, c10::kCPU);
}

TEST(KernelsRopeTest, CudaInPlaceMatchesComposite) {
  FSDP_SKIP_WITHOUT_GPU();
  for (const Case& c : Cases()) {
    CheckAgainstComposite(c, Form::kInPlace, c10::Device(c10::kCUDA, 0));
  }
}

TEST(KernelsRopeTest, CudaOutOfPlaceMatchesComposite) {
  FSDP_SKIP_WITHOUT_GPU();
  for (const Case& c : Cases()) {
    CheckAgainstComposite(c, Form::kOutOfPlace, c10::Device(c10::kCUDA, 0));
  }
}

// bf16 against the composite run in bf16 itself (the model's arithmetic today, which rounds
// cos/sin and each product to bf16 before the sum, so where the two products cancel its
// absolute error is an ulp of the inputs' magnitude, not of the result's): within 2 ulps of
// inputs of magnitude up to about 4.
void CheckAgainstBf16Composite(c10::Device device) {
  torch::manual_seed(3);
  auto [cos, sin] = Tables(64, 64, device);
  at::Tensor q = torch::randn({2, 64, 4, 64}).to(device, at::kBFloat16);
  at::Tensor k = torch::randn({2, 64, 2, 64}).to(device, at::kBFloat16);
  at::Tensor q_ref = RopeComposite(q, cos, sin), k_ref = RopeComposite(k, cos, sin);
  RopeInPlace(q, k, cos, sin);
  EXPECT_TRUE(AllClose(q, q_ref, 3e-2, 3e-2, "q vs bf16 composite"));
  EXPECT_TRUE(AllClose(k, k_ref, 3e-2, 3e-2, "k vs bf16 composite"));
}

TEST(KernelsRopeTest, CpuBf16CloseToBf16Composite) { CheckAgainstBf16Composite(c10::kCPU); }

TEST(KernelsRopeTest, CudaBf16CloseToBf16Composite) {
  FSDP_SKIP_WITHOUT_GPU();
  CheckAgainstBf16Composite(c10::Device(c10::kCUDA, 0));
}

// Operands that the pair (two-element) loads cannot take: q at an odd element offset of its
// projection (not 2-element aligned), k with a dim stride other than 1 (a transposed view),
// and upstream gradients that are non-contiguous and held by the caller (rotated into a new
// tensor through their strides). Forward, both forms, and the gradients of the projections.
void CheckStridedOperands(at::ScalarType dtype, Form form, c10::Device device) {
  SCOPED_TRACE(::testing::Message()
               << dtype << (form == Form::kInPlace ? " in place" : " out of place"));
  torch::manual_seed(13);
  const int64_t b = 2, t = 9, heads = 3, kv_heads = 2, head_dim = 10, dim = 8;
  auto [cos, sin] = Tables(12, head_dim, device);
  at::Tensor x0 = torch::randn({b, t, dim}).to(device, dtype);
  at::Tensor wq0 = (torch::randn({1 + heads * head_dim, dim}) / 3).to(device, dtype);
  at::Tensor wk0 = (torch::randn({head_dim * kv_heads, dim}) / 3).to(device, dtype);
  // Non-contiguous upstream gradients: transposed views of [b, t, head_dim, heads].
  at::Tensor gq = torch::randn({b, t, head_dim, heads}).to(device, dtype).transpose(2, 3);
  at::Tensor gk = torch::randn({b, t, head_dim, kv_heads}).to(device, dtype).transpose(2, 3);
  const at::Tensor gq_copy = gq.clone(), gk_copy = gk.clone();
  auto run = [&](bool fused, at::ScalarType compute) {
    at::Tensor x = x0.to(compute);
    at::Tensor wq = wq0.to(compute, /*non_blocking=*/false, /*copy=*/true).requires_grad_(true);
    at::Tensor wk = wk0.to(compute, /*non_blocking=*/false, /*copy=*/true).requires_grad_(true);
    at::Tensor pq = at::linear(x, wq), pk = at::linear(x, wk);
    pq.retain_grad();
    pk.retain_grad();
    at::Tensor q = pq.narrow(-1, 1, heads * head_dim).view({b, t, heads, head_dim});
    at::Tensor k = pk.view({b, t, head_dim, kv_heads}).transpose(2, 3);
    // The layouts this test is about: q not on a 2-element boundary, k's dim stride not 1.
    EXPECT_NE(reinterpret_cast<uintptr_t>(q.const_data_ptr()) % (2 * q.element_size()), 0u);
    EXPECT_NE(k.stride(3), 1);
    if (!fused) {
      q = RopeComposite(q, cos, sin);
      k = RopeComposite(k, cos, sin);
    } else if (form == Form::kInPlace) {
      RopeInPlace(q, k, cos, sin);
    } else {
      std::tie(q, k) = Rope(q, k, cos, sin);
    }
    torch::autograd::backward({q, k}, {gq.to(compute), gk.to(compute)});
    return std::vector<at::Tensor>{q.detach(), k.detach(), pq.grad(), pk.grad()};
  };
  std::vector<at::Tensor> fused = run(true, dtype), ref = run(false, at::kFloat);
  const double tol = dtype == at::kFloat ? 1e-6 : 1e-2;
  const char* names[] = {"rotated q", "rotated k", "grad of q's projection",
                         "grad of k's projection"};
  for (size_t i = 0; i < fused.size(); ++i) {
    EXPECT_EQ(fused[i].scalar_type(), dtype) << names[i];
    EXPECT_TRUE(AllClose(fused[i], ref[i], tol, tol, names[i]));
  }
  EXPECT_TRUE(at::equal(gq, gq_copy) && at::equal(gk, gk_copy)) << "caller's gradient modified";
}

TEST(KernelsRopeTest, CpuStridedOperandsMatchComposite) {
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    for (Form form : {Form::kInPlace, Form::kOutOfPlace}) {
      CheckStridedOperands(dtype, form, c10::kCPU);
    }
  }
}

TEST(KernelsRopeTest, CudaStridedOperandsMatchComposite) {
  FSDP_SKIP_WITHOUT_GPU();
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    for (Form form : {Form::kInPlace, Form::kOutOfPlace}) {
      CheckStridedOperands(dtype, form, c10::Device(c10::kCUDA, 0));
    }
  }
}

// Layouts that decide the CUDA kernel's unit (Note [RoPE kernel layout]): q and k 16-byte
// aligned (8 bf16 or 4 fp32 elements per access), q two elements past a 16-byte boundary in
// its projection (pair accesses), cos and sin tables one float past a 16-byte boundary (pair
// accesses), head_dim 12 in bf16 (not a multiple of 8) and many tokens. Forward and inverse
// (the backward), out of place, against the composite in fp32 on the same values.
TEST(KernelsRopeTest, CudaUnitsMatchComposite) {
  FSDP_SKIP_WITHOUT_GPU();
  c10::Device cuda(c10::kCUDA, 0);
  struct UnitCase {
    int64_t batch, seq, heads, kv_heads, head_dim;
    at::ScalarType dtype;
    int64_t q_offset;     // elements before q in its projection row
    bool table_offset;    // cos and sin one float past a 16-byte boundary
  };
  const std::vector<UnitCase> cases = {{2, 33, 16, 16, 128, at::kBFloat16, 0, false},
                                       {2, 33, 16, 16, 128, at::kBFloat16, 2, false},
                                       {2, 33, 16, 16, 128, at::kBFloat16, 0, true},
                                       {1, 17, 5, 3, 12, at::kFloat, 0, false},
                                       {1, 17, 5, 3, 12, at::kBFloat16, 0, false},
                                       {2, 9, 32, 8, 64, at::kHalf, 0, false},
                                       {4, 1025, 2, 1, 16, at::kBFloat16, 0, false}};
  for (const UnitCase& c : cases) {
    SCOPED_TRACE(::testing::Message() << c.dtype << " head_dim " << c.head_dim << " heads "
                                      << c.heads << "/" << c.kv_heads << " q offset "
                                      << c.q_offset << (c.table_offset ? " table offset" : ""));
    torch::manual_seed(29);
    const int64_t q_width = c.heads * c.head_dim, kv_width = c.kv_heads * c.head_dim;
    const int64_t width = c.q_offset + q_width + kv_width;
    auto [cos0, sin0] = Tables(c.seq, c.head_dim, cuda);
    at::Tensor cos = cos0, sin = sin0;
    if (c.table_offset) {
      auto shifted = [&](const at::Tensor& t) {
        at::Tensor buffer = at::empty({t.numel() + 1}, t.options());
        return buffer.narrow(0, 1, t.numel()).view(t.sizes()).copy_(t);
      };
      cos = shifted(cos0);
      sin = shifted(sin0);
      ASSERT_NE(reinterpret_cast<uintptr_t>(cos.const_data_ptr()) % 16, 0u);
    }
    at::Tensor p0 = torch::randn({c.batch, c.seq, width}).to(cuda, c.dtype);
    at::Tensor dq = torch::randn({c.batch, c.seq, c.heads, c.head_dim}).to(cuda, c.dtype);
    at::Tensor dk = torch::randn({c.batch, c.seq, c.kv_heads, c.head_dim}).to(cuda, c.dtype);
    auto views = [&](const at::Tensor& p) {
      return std::pair{
          p.narrow(-1, c.q_offset, q_width).view({c.batch, c.seq, c.heads, c.head_dim}),
          p.narrow(-1, c.q_offset + q_width, kv_width)
              .view({c.batch, c.seq, c.kv_heads, c.head_dim})};
    };
    at::Tensor p = p0.clone().requires_grad_(true);
    auto [q, k] = views(p);
    auto [q_rot, k_rot] = Rope(q, k, cos, sin);
    torch::autograd::backward({q_rot, k_rot}, {dq, dk});
    at::Tensor p_ref = p0.to(at::kFloat).requires_grad_(true);
    auto [q_ref, k_ref] = views(p_ref);
    at::Tensor q_ref_rot = RopeComposite(q_ref, cos0, sin0);
    at::Tensor k_ref_rot = RopeComposite(k_ref, cos0, sin0);
    torch::autograd::backward({q_ref_rot, k_ref_rot}, {dq.to(at::kFloat), dk.to(at::kFloat)});
    const double tol = c.dtype == at::kFloat ? 1e-6 : 1e-2;
    EXPECT_TRUE(AllClose(q_rot, q_ref_rot, tol, tol, "rotated q"));
    EXPECT_TRUE(AllClose(k_rot, k_ref_rot, tol, tol, "rotated k"));
    EXPECT_TRUE(AllClose(p.grad(), p_ref.grad(), tol, tol, "grad of the projection"));
  }
}

// The model's use (gpt.cc AttentionImpl::forward): q, k, v from their projections, the
// rotation, grouped-query causal SDPA over transposed views, the output projection.
TEST(KernelsRopeTest, CpuAttentionBlockMatchesComposite) {
  torch::manual_seed(4);
  const int64_t b = 2, t = 9, heads = 4, kv_heads = 2, head_dim = 8, dim = heads * head_dim;
  auto [cos, sin] = Tables(16, head_dim, c10::kCPU);
  at::Tensor x0 = torch::randn({b, t, dim});
  at::Tensor wq0 = torch::randn({dim, dim}) / 6, wk0 = torch::randn({kv_heads * head_dim, dim}) / 6;
  at::Tensor wv0 = torch::randn({kv_heads * head_dim, dim}) / 6, wo0 = torch::randn({dim, dim}) / 6;
  auto run = [&](bool fused) {
    at::Tensor x = x0.clone().requires_grad_(true), wq = wq0.clone().requires_grad_(true);
    at::Tensor wk = wk0.clone().requires_grad_(true), wv = wv0.clone().requires_grad_(true);
    at::Tensor q = at::linear(x, wq).view({b, t, heads, head_dim});
    at::Tensor k = at::linear(x, wk).view({b, t, kv_heads, head_dim});
    at::Tensor v = at::linear(x, wv).view({b, t, kv_heads, head_dim});
    if (fused) {
      RopeInPlace(q, k, cos, sin);
    } else {
      q = RopeComposite(q, cos, sin);
      k = RopeComposite(k, cos, sin);
    }
    at::Tensor y =
        at::scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         {}, 0.0, true, std::nullopt, /*enable_gqa=*/true);
    at::Tensor out = at::linear(y.transpose(1, 2).reshape({b, t, dim}), wo0);
    (out * out).sum().backward();
    return std::vector<at::Tensor>{out, x.grad(), wq.grad(), wk.grad(), wv.grad()};
  };
  std::vector<at::Tensor> fused = run(true), ref = run(false);
  const char* names[] = {"output", "grad of x", "grad of wq", "grad of wk", "grad of wv"};
  for (size_t i = 0; i < fused.size(); ++i) {
    EXPECT_TRUE(AllClose(fused[i], ref[i], 1e-5, 1e-5, names[i]));
  }
}

// In place means the projection's memory: the old handle reads the rotated values, the
// version counter moved, and the data pointer is the projection's.
TEST(KernelsRopeTest, RotatesTheProjectionsMemory) {
  auto [cos, sin] = Tables(8, 4, c10::kCPU);
  at::Tensor p = torch::randn({1, 8, 3 * 4}).requires_grad_(true) * 1;  // non-leaf
  at::Tensor q = p.narrow(-1, 0, 8).view({1, 8, 2, 4});
  at::Tensor k = p.narrow(-1, 8, 4).view({1, 8, 1, 4});
  at::Tensor old_q = q;
  at::Tensor expected_q = RopeComposite(q.detach().clone(), cos, sin);
  const void* q_data = q.const_data_ptr();
  const int64_t version = p._version();
  RopeInPlace(q, k, cos, sin);
  EXPECT_EQ(q.const_data_ptr(), q_data);
  EXPECT_GT(p._version(), version);
  EXPECT_TRUE(AllClose(old_q, expected_q, 1e-6, 1e-6, "old handle"));
  EXPECT_TRUE(
      AllClose(p.narrow(-1, 0, 8).reshape({1, 8, 2, 4}), expected_q, 1e-6, 1e-6, "projection"));
  EXPECT_TRUE(q.requires_grad());
}

// A tensor saved for backward before the rotation is caught, as after any in-place op.
TEST(KernelsRopeTest, SavedProjectionOutputIsCaught) {
  auto [cos, sin] = Tables(8, 4, c10::kCPU);
  at::Tensor x = torch::randn({1, 8, 5}).requires_grad_(true);
  at::Tensor w = torch::randn({12, 5}).requires_grad_(true);
  at::Tensor p = at::linear(x, w);
  at::Tensor square = p * p;  // saves p
  at::Tensor q = p.narrow(-1, 0, 8).view({1, 8, 2, 4});
  at::Tensor k = p.narrow(-1, 8, 4).view({1, 8, 1, 4});
  RopeInPlace(q, k, cos, sin);
  EXPECT_THROW((square.sum() + q.sum() + k.sum()).backward(), c10::Error);
}

TEST(KernelsRopeTest, RefusesLeafThatRequiresGrad) {
  auto [cos, sin] = Tables(8, 4, c10::kCPU);
  at::Tensor q = torch::randn({1, 8, 2, 4}).requires_grad_(true);
  at::Tensor k = torch::randn({1, 8, 1, 4});
  EXPECT_THROW(RopeInPlace(q, k, cos, sin), c10::Error);
  torch::NoGradGuard no_grad;  // as for any in-place op, allowed without grad mode
  at::Tensor expected = RopeComposite(q.detach(), cos, sin);
  RopeInPlace(q, k, cos, sin);
  EXPECT_TRUE(AllClose(q, expected, 1e-6, 1e-6, "no-grad leaf"));
}

// A gradient the caller passes to backward() is read, never rotated in place; so is one that
// reaches two consumers (q's and k's grads here are the same tensor).
TEST(KernelsRopeTest, CallersGradientIsNotModified) {
  auto [cos, sin] = Tables(8, 4, c10::kCPU);
  at::Tensor p = torch::randn({1, 8, 12}).requires_grad_(true);
  at::Tensor q = (p * 1).narrow(-1, 0, 4).view({1, 8, 1, 4});
  at::Tensor k = (p * 1).narrow(-1, 4, 4).view({1, 8, 1, 4});
  RopeInPlace(q, k, cos, sin);
  at::Tensor g = torch::randn({1, 8, 1, 4});
  at::Tensor g_copy = g.clone();
  torch::autograd::backward({q, k}, {g, g});
  EXPECT_TRUE(at::equal(g, g_copy));
  at::Tensor expected = RopeComposite(g, cos, -sin);  // the inverse rotation
  EXPECT_TRUE(
      AllClose(p.grad().narrow(-1, 0, 4).reshape({1, 8, 1, 4}), expected, 1e-6, 1e-6, "grad of q"));
  EXPECT_TRUE(
      AllClose(p.grad().narrow(-1, 4, 4).reshape({1, 8, 1, 4}), expected, 1e-6, 1e-6, "grad of k"));
}

// The usual case: the gradient reaching the rotation is a fresh tensor nobody else holds, and
// the backward rotates it where it lies (the projection's gradient is that memory).
TEST(KernelsRopeTest, BackwardRotatesAFreshGradientInPlace) {
  auto [cos, sin] = Tables(8, 4, c10::kCPU);
  at::Tensor x = torch::randn({1, 8, 5});
  at::Tensor wq = torch::randn({8, 5}).requires_grad_(true);
  at::Tensor wk = torch::randn({4, 5}).requires_grad_(true);
  at::Tensor pq = at::linear(x, wq), pk = at::linear(x, wk);
  at::Tensor q = pq.view({1, 8, 2, 4}), k = pk.view({1, 8, 1, 4});
  RopeInPlace(q, k, cos, sin);
  const void* arriving = nullptr;
  const void* leaving = nullptr;
  q.register_hook([&](const at::Tensor& g) { arriving = g.const_data_ptr(); });
  pq.register_hook([&](const at::Tensor& g) { leaving = g.const_data_ptr(); });
  ((q * torch::randn({1, 8, 2, 4})).sum() + k.sum()).backward();
  ASSERT_NE(arriving, nullptr);
  EXPECT_EQ(arriving, leaving);
}

TEST(KernelsRopeTest, RejectsBadShapes) {
  auto [cos, sin] = Tables(8, 4, c10::kCPU);
  at::Tensor q = torch::randn({1, 8, 2, 4}), k = torch::randn({1, 8, 1, 4});
  at::Tensor odd = torch::randn({1, 8, 1, 3});
  EXPECT_THROW(RopeInPlace(odd, odd, cos, sin), c10::Error);  // odd head_dim
  at::Tensor short_cos = cos.narrow(0, 0, 4), short_sin = sin.narrow(0, 0, 4);
  EXPECT_THROW(RopeInPlace(q, k, short_cos, short_sin), c10::Error);  // table shorter than seq
  at::Tensor k6 = torch::randn({1, 8, 1, 6});
  EXPECT_THROW(RopeInPlace(q, k6, cos, sin), c10::Error);  // head_dims differ
  at::Tensor qi = torch::zeros({1, 8, 2, 4}, torch::kInt),
             ki = torch::zeros({1, 8, 1, 4}, torch::kInt);
  EXPECT_THROW(RopeInPlace(qi, ki, cos, sin), c10::Error);  // integer dtype
}

}  // namespace
}  // namespace fsdp::kernels
