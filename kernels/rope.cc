#include "kernels/rope.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/variable.h>

#include "kernels/cuda/rope.h"
#include "kernels/dispatch.h"

namespace fsdp::kernels {
namespace {

constexpr const char* kName = "rope";

// Checks the shapes of RopeInPlace / Rope and returns the tables as contiguous float32.
std::pair<at::Tensor, at::Tensor> CheckedTables(const at::Tensor& q, const at::Tensor& k,
                                                const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4, kName,
              ": q and k must be [batch, seq, heads, head_dim], got ", q.sizes(), " and ",
              k.sizes());
  TORCH_CHECK(q.size(0) == k.size(0) && q.size(1) == k.size(1) && q.size(3) == k.size(3), kName,
              ": q ", q.sizes(), " and k ", k.sizes(), " differ in batch, seq or head_dim");
  TORCH_CHECK(q.size(3) % 2 == 0, kName, ": head_dim ", q.size(3), " must be even (pairs)");
  TORCH_CHECK(q.scalar_type() == k.scalar_type(), kName, ": q is ", q.scalar_type(), ", k is ",
              k.scalar_type());
  ToKernelDType(q, kName);  // names the kernel for an unsupported dtype
  TORCH_CHECK(q.device() == k.device() && cos.device() == q.device() && sin.device() == q.device(),
              kName, ": q, k, cos and sin must be on one device");
  const int64_t seq = q.size(1), half = q.size(3) / 2;
  TORCH_CHECK(
      cos.dim() == 2 && sin.sizes() == cos.sizes() && cos.size(0) >= seq && cos.size(1) == half,
      kName, ": cos and sin must be [>= seq (", seq, "), head_dim / 2 (", half, ")], got ",
      cos.sizes(), " and ", sin.sizes());
  return {cos.to(at::kFloat).contiguous(), sin.to(at::kFloat).contiguous()};
}

cuda::RopeOperand Operand(const at::Tensor& in, const at::Tensor& out) {
  cuda::RopeOperand op;
  op.in = in.const_data_ptr();
  op.out = out.mutable_data_ptr();
  op.heads = in.size(2);
  for (int d = 0; d < 4; ++d) {
    op.in_stride[d] = in.stride(d);
    op.out_stride[d] = out.stride(d);
  }
  return op;
}

// CPU reference: tokens in parallel, the kernel's arithmetic (fp32, one rounding). `sign`: +1
// forward, -1 inverse.
template <typename scalar_t>
void RotateCpu(const cuda::RopeOperand& op, int64_t b, int64_t t, const float* c, const float* s,
               float sign, int64_t half) {
  for (int64_t h = 0; h < op.heads; ++h) {
    const scalar_t* in = static_cast<const scalar_t*>(op.in) + b * op.in_stride[0] +
                         t * op.in_stride[1] + h * op.in_stride[2];
    scalar_t* out = static_cast<scalar_t*>(op.out) + b * op.out_stride[0] + t * op.out_stride[1] +
                    h * op.out_stride[2];
    for (int64_t i = 0; i < half; ++i) {
      const float x0 = static_cast<float>(in[2 * i * op.in_stride[3]]);
      const float x1 = static_cast<float>(in[(2 * i + 1) * op.in_stride[3]]);
      const float si = sign * s[i];
      out[2 * i * op.out_stride[3]] = static_cast<scalar_t>(x0 * c[i] - x1 * si);
      out[(2 * i + 1) * op.out_stride[3]] = static_cast<scalar_t>(x0 * si + x1 * c[i]);
    }
  }
}

void RopeCpu(const cuda::RopeOperand& q, const cuda::RopeOperand& k, const at::Tensor& cos,
             const at::Tensor& sin, int64_t batch, int64_t seq, int64_t half, bool inverse,
             at::ScalarType dtype) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, kName, [&] {
    const float* cos_data = cos.const_data_ptr<float>();
    const float* sin_data = sin.const_data_ptr<float>();
    const float sign = inverse ? -1.0f : 1.0f;
    auto tokens = [&](int64_t begin, int64_t end) {
      for (int64_t token = begin; token < end; ++token) {
        const int64_t b = token / seq, t = token % seq;
        const float* c = cos_data + t * half;
        const float* s = sin_data + t * half;
        RotateCpu<scalar_t>(q, b, t, c, s, sign, half);
        RotateCpu<scalar_t>(k, b, t, c, s, sign, half);
      }
    };
    const int64_t work = std::max<int64_t>(1, (q.heads + k.heads) * half);
    at::parallel_for(0, batch * seq, std::max<int64_t>(1, 16384 / work), tokens);
  });
}

// Rotates q_in into q_out and k_in into k_out (each pair may be the same tensor: in place).
void Run(const at::Tensor& q_in, const at::Tensor& q_out, const at::Tensor& k_in,
         const at::Tensor& k_out, const at::Tensor& cos, const at::Tensor& sin, bool inverse) {
  const int64_t batch = q_in.size(0), seq = q_in.size(1), head_dim = q_in.size(3);
  cuda::RopeOperand q = Operand(q_in, q_out), k = Operand(k_in, k_out);
  if (OnCuda(q_in, kName)) {
#ifdef FSDP_WITH_CUDA  // else OnCuda has thrown: the launchers are not built
    c10::DeviceGuard guard(q_in.device());  // the launch goes to the current device
    CheckLaunch(cuda::Rope(q, k, cos.const_data_ptr<float>(), sin.const_data_ptr<float>(), batch,
                           seq, head_dim, inverse, ToKernelDType(q_in, kName), CurrentStream(q_in)),
                kName);
#endif
  } else {
    RopeCpu(q, k, cos, sin, batch, seq, head_dim / 2, inverse, q_in.scalar_type());
  }
}

// Whether nothing but the autograd engine's own input list can see `grad`: then the backward
// rotates it in place. Its TensorImpl has one owner (not the tensor a caller passed to
// backward(), nor one that another node also received), its storage has no other tensor over
// it (not a view of a gradient that someone else holds), and no two elements share memory.
bool Exclusive(const at::Tensor& grad) {
  return grad.use_count() == 1 && grad.storage().use_count() == 1 &&
         grad.is_non_overlapping_and_dense();
}

at::Tensor NewLike(const at::Tensor& x) {
  return at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
}

// See Note [RoPE in place under autograd] (kernels/rope.h).
struct RopeFunction : torch::autograd::Function<RopeFunction> {
  static torch::autograd::tensor_list forward(torch::autograd::AutogradContext* ctx,
                                              const at::Tensor& q, const at::Tensor& k,
                                              const at::Tensor& cos, const at::Tensor& sin,
                                              bool in_place) {
    ctx->saved_data["cos"] = cos;
    ctx->saved_data["sin"] = sin;
    if (in_place) {
      // Before the kernel: an inference tensor outside InferenceMode is refused unmodified.
      torch::autograd::impl::bump_version(q);
      torch::autograd::impl::bump_version(k);
      Run(q, q, k, k, cos, sin, /*inverse=*/false);
      // Returned as they are: autograd hands back views of them (view_as) with this node as
      // grad_fn, as for any input a Function returns unmodified in its eyes.
      return {q, k};
    }
    at::Tensor q_out = NewLike(q), k_out = NewLike(k);
    Run(q, q_out, k, k_out, cos, sin, /*inverse=*/false);
    return {q_out, k_out};
  }

  // `grads` by reference: the engine's own list, so that Exclusive() counts its owners right.
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list& grads) {
    const at::Tensor cos = ctx->saved_data["cos"].toTensor();
    const at::Tensor sin = ctx->saved_data["sin"].toTensor();
    const at::Tensor& grad_q = grads[0];
    const at::Tensor& grad_k = grads[1];
    at::Tensor dq = Exclusive(grad_q) ? grad_q : NewLike(grad_q);
    at::Tensor dk = Exclusive(grad_k) ? grad_k : NewLike(grad_k);
    Run(grad_q, dq, grad_k, dk, cos, sin, /*inverse=*/true);
    return {dq, dk, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

void RopeInPlace(at::Tensor& q, at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin) {
  auto [c, s] = CheckedTables(q, k, cos, sin);
  if (at::GradMode::is_enabled()) {
    TORCH_CHECK(!(q.is_leaf() && q.requires_grad()) && !(k.is_leaf() && k.requires_grad()), kName,
                ": q or k is a leaf that requires grad, which cannot be modified in "
                "place; use Rope (out of place)");
  }
  auto out = RopeFunction::apply(q, k, c, s, /*in_place=*/true);
  q = std::move(out[0]);
  k = std::move(out[1]);
}

std::pair<at::Tensor, at::Tensor> Rope(const at::Tensor& q, const at::Tensor& k,
                                       const at::Tensor& cos, const at::Tensor& sin) {
  auto [c, s] = CheckedTables(q, k, cos, sin);
  auto out = RopeFunction::apply(q, k, c, s, /*in_place=*/false);
  return {std::move(out[0]), std::move(out[1])};
}

at::Tensor RopeComposite(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t t = x.size(1);
  at::Tensor c = cos.narrow(0, 0, t).view({1, t, 1, -1}).to(x.scalar_type());
  at::Tensor s = sin.narrow(0, 0, t).view({1, t, 1, -1}).to(x.scalar_type());
  at::Tensor pairs = x.unflatten(-1, {-1, 2});
  at::Tensor x0 = pairs.select(-1, 0), x1 = pairs.select(-1, 1);
  return at::stack({x0 * c - x1 * s, x0 * s + x1 * c}, -1).flatten(-2);
}

}  // namespace fsdp::kernels
