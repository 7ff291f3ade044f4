#include "kernels/rms_norm.h"

#include <algorithm>
#include <cmath>

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/core/DeviceGuard.h>
#include <torch/csrc/autograd/custom_function.h>

#include "kernels/cuda/rms_norm.h"
#include "kernels/dispatch.h"

namespace fsdp::kernels {
namespace {

// Note [CUDA launchers in a CPU build]
// kernels/cuda/*.cu are compiled only in a CUDA build (FSDP_WITH_CUDA), so the calls to the
// cuda:: launchers are compiled only there too: otherwise fsdp_kernels would not link. Without
// them the CUDA branch is empty, and never taken: OnCuda throws for a CUDA tensor.

constexpr const char* kName = "rms_norm";
constexpr const char* kAddName = "add_rms_norm";
constexpr const char* kForkName = "fork_rms_norm";

// The CPU backward's weight-gradient partial rows: one per chunk of this many rows, a fixed
// split (not one per thread) so that the result does not depend on the thread count.
constexpr int64_t kCpuRowsPerChunk = 64;

int64_t Rows(const at::Tensor& x) {
  int64_t rows = 1;
  for (int64_t d = 0; d + 1 < x.dim(); ++d) rows *= x.size(d);
  return rows;
}

int64_t Grain(int64_t cols) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(cols, 1)); }

void CheckArgs(const at::Tensor& x, const at::Tensor& weight, const char* kernel) {
  TORCH_CHECK(x.dim() >= 1, "fsdp kernel ", kernel, ": x must have at least one dimension");
  ToKernelDType(x, kernel);  // names the kernel for an unsupported dtype
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1), "fsdp kernel ", kernel,
              ": weight has sizes ", weight.sizes(), " but x ", x.sizes(),
              " is normalised over its last dimension, of size ", x.size(-1), ": weight must be [",
              x.size(-1), "]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() || weight.scalar_type() == at::kFloat,
              "fsdp kernel ", kernel, ": weight is ", weight.scalar_type(), ", x ", x.scalar_type(),
              ": weight must be x's dtype or float32");
  TORCH_CHECK(weight.device() == x.device(), "fsdp kernel ", kernel, ": weight is on ",
              weight.device(), ", x on ", x.device());
}

// Sum of f(c) for c in [0, n) in fp32, over 8 independent accumulators (vectorisable, and a
// shorter chain of roundings than one running sum).
template <typename F>
float Sum(int64_t n, F f) {
  float acc[8] = {};
  int64_t c = 0;
  for (; c + 8 <= n; c += 8) {
    for (int k = 0; k < 8; ++k) acc[k] += f(c + k);
  }
  for (int k = 0; c < n; ++c, ++k) acc[k] += f(c);
  return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

// CPU reference of cuda::RmsNormForward: rows in parallel, fp32, one rounding of y.
template <typename T, typename W>
void ForwardCpu(const T* x, const T* residual, const W* weight, T* h, T* y, float* rstd,
                int64_t rows, int64_t cols, float eps) {
  at::parallel_for(0, rows, Grain(cols), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * cols;
      T* yr = y + r * cols;
      const T* v = xr;
      if (residual != nullptr) {
        const T* rr = residual + r * cols;
        T* hr = h + r * cols;
        for (int64_t c = 0; c < cols; ++c) {
          hr[c] = static_cast<T>(static_cast<float>(xr[c]) + static_cast<float>(rr[c]));
        }
        v = hr;  // the rounded h, as the backward will read it
      }
      float sum_sq = Sum(cols, [&](int64_t c) {
        float f = static_cast<float>(v[c]);
        return f * f;
      });
      float rs = 1.0f / std::sqrt(sum_sq / static_cast<float>(cols) + eps);
      rstd[r] = rs;
      for (int64_t c = 0; c < cols; ++c) {
        yr[c] = static_cast<T>(static_cast<float>(v[c]) * rs * static_cast<float>(weight[c]));
      }
    }
  });
}

// CPU reference of cuda::RmsNormBackward: grad_h (or nullptr) added in fp32, one rounding of
// grad_x. partials: [chunks, cols] fp32, or nullptr when no weight gradient is wanted; chunk k
// sums the rows [k * kCpuRowsPerChunk, ...) into row k.
template <typename T, typename W>
void BackwardCpu(const T* v, const float* rstd, const W* weight, const T* grad_y, const T* grad_h,
                 T* grad_x, float* partials, int64_t rows, int64_t cols) {
  int64_t chunks = (rows + kCpuRowsPerChunk - 1) / kCpuRowsPerChunk;
  int64_t chunk_grain = std::max<int64_t>(1, Grain(cols) / kCpuRowsPerChunk);
  at::parallel_for(0, chunks, chunk_grain, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) {
      float* acc = partials == nullptr ? nullptr : partials + k * cols;
      if (acc != nullptr) std::fill(acc, acc + cols, 0.0f);
      int64_t row_end = std::min(rows, (k + 1) * kCpuRowsPerChunk);
      for (int64_t r = k * kCpuRowsPerChunk; r < row_end; ++r) {
        const T* vr = v + r * cols;
        const T* dy = grad_y + r * cols;
        T* dx = grad_x + r * cols;
        const float rs = rstd[r];
        float dot = Sum(cols, [&](int64_t c) {
          return static_cast<float>(dy[c]) * static_cast<float>(weight[c]) *
                 (static_cast<float>(vr[c]) * rs);
        });
        float mean_dot = dot / static_cast<float>(cols);
        for (int64_t c = 0; c < cols; ++c) {
          float xhat = static_cast<float>(vr[c]) * rs, d = static_cast<float>(dy[c]);
          float g = rs * (d * static_cast<float>(weight[c]) - xhat * mean_dot);
          if (grad_h != nullptr) g += static_cast<float>(grad_h[r * cols + c]);
          dx[c] = static_cast<T>(g);
          if (acc != nullptr) acc[c] += d * xhat;
        }
      }
    }
  });
}

// Calls body.template operator()<T, W>() with T x's C++ type and W the weight's.
template <typename Body>
void DispatchCpu(const at::Tensor& x, const at::Tensor& weight, Body body) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm_cpu", [&] {
    if (weight.scalar_type() == x.scalar_type()) {
      body.template operator()<scalar_t, scalar_t>();
    } else {
      body.template operator()<scalar_t, float>();
    }
  });
}

struct ForwardOut {
  at::Tensor h;     // x + residual, x's shape and dtype; undefined without a residual
  at::Tensor y;     // x's shape and dtype
  at::Tensor rstd;  // [rows] fp32
};

// x, residual (or undefined), weight: contiguous, checked.
ForwardOut Forward(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                   double eps, const char* kernel) {
  int64_t cols = x.size(-1), rows = Rows(x);
  ForwardOut out;
  out.y = at::empty(x.sizes(), x.options());
  if (residual.defined()) out.h = at::empty(x.sizes(), x.options());
  out.rstd = at::empty({rows}, x.options().dtype(at::kFloat));
  if (OnCuda(x, kernel)) {
#ifdef FSDP_WITH_CUDA  // See Note [CUDA launchers in a CPU build]
    c10::DeviceGuard guard(x.device());
    CheckLaunch(cuda::RmsNormForward(x.const_data_ptr(),
                                     residual.defined() ? residual.const_data_ptr() : nullptr,
                                     weight.const_data_ptr(),
                                     residual.defined() ? out.h.mutable_data_ptr() : nullptr,
                                     out.y.mutable_data_ptr(), out.rstd.mutable_data_ptr<float>(),
                                     rows, cols, static_cast<float>(eps), ToKernelDType(x, kernel),
                                     ToKernelDType(weight, kernel), CurrentStream(x)),
                kernel);
#endif
  } else if (rows > 0 && cols > 0) {
    DispatchCpu(x, weight, [&]<typename T, typename W>() {
      ForwardCpu<T, W>(
          x.const_data_ptr<T>(), residual.defined() ? residual.const_data_ptr<T>() : nullptr,
          weight.const_data_ptr<W>(), residual.defined() ? out.h.mutable_data_ptr<T>() : nullptr,
          out.y.mutable_data_ptr<T>(), out.rstd.mutable_data_ptr<float>(), rows, cols,
          static_cast<float>(eps));
    });
  }
  return out;
}

// v: the normalised input (x, or h); grad_y defined; grad_h, undefined or a gradient of v to
// add to the norm's in the same pass (AddRmsNorm's of h, ForkRmsNorm's of the passed-through
// x). Returns (grad of v, grad of weight, undefined unless want_weight).
std::pair<at::Tensor, at::Tensor> Backward(const at::Tensor& v, const at::Tensor& rstd,
                                           const at::Tensor& weight, const at::Tensor& grad_y,
                                           const at::Tensor& grad_h, bool want_weight,
                                           const char* kernel) {
  int64_t cols = v.size(-1), rows = Rows(v);
  at::Tensor dy = grad_y.contiguous().to(v.scalar_type());
  at::Tensor dh = grad_h.defined() ? grad_h.contiguous().to(v.scalar_type()) : at::Tensor();
  at::Tensor dx = at::empty(v.sizes(), v.options());
  at::Tensor dw;
  if (want_weight) {
    dw = rows == 0 || cols == 0 ? at::zeros({cols}, weight.options())
                                : at::empty({cols}, weight.options());
  }
  if (rows == 0 || cols == 0) return {dx, dw};
  if (OnCuda(v, kernel)) {
#ifdef FSDP_WITH_CUDA  // See Note [CUDA launchers in a CPU build]
    c10::DeviceGuard guard(v.device());
    at::Tensor partials;
    if (want_weight) {
      partials = at::empty({cuda::RmsNormBackwardPartials(rows, cols), cols},
                           v.options().dtype(at::kFloat));
    }
    CheckLaunch(cuda::RmsNormBackward(
                    v.const_data_ptr(), rstd.const_data_ptr<float>(), weight.const_data_ptr(),
                    dy.const_data_ptr(), dh.defined() ? dh.const_data_ptr() : nullptr,
                    dx.mutable_data_ptr(), dw.defined() ? dw.mutable_data_ptr() : nullptr,
                    partials.defined() ? partials.mutable_data_ptr<float>() : nullptr, rows, cols,
                    ToKernelDType(v, kernel), ToKernelDType(weight, kernel), CurrentStream(v)),
                kernel);
#endif
  } else {
    at::Tensor partials;
    if (want_weight) {
      partials = at::empty({(rows + kCpuRowsPerChunk - 1) / kCpuRowsPerChunk, cols},
                           v.options().dtype(at::kFloat));
    }
    DispatchCpu(v, weight, [&]<typename T, typename W>() {
      BackwardCpu<T, W>(v.const_data_ptr<T>(), rstd.const_data_ptr<float>(),
                        weight.const_data_ptr<W>(), dy.const_data_ptr<T>(),
                        dh.defined() ? dh.const_data_ptr<T>() : nullptr, dx.mutable_data_ptr<T>(),
                        partials.defined() ? partials.mutable_data_ptr<float>() : nullptr, rows,
                        cols);
    });
    if (want_weight) dw.copy_(partials.sum(0));  // fp32 sum, one rounding to weight's dtype
  }
  return {dx, dw};
}

using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

struct RmsNormFunction : torch::autograd::Function<RmsNormFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            double eps) {
    at::Tensor xc = x.contiguous(), wc = weight.contiguous();
    ForwardOut out = Forward(xc, at::Tensor(), wc, eps, kName);
    ctx->save_for_backward({xc, wc, out.rstd});
    ctx->set_materialize_grads(false);
    return out.y;
  }
  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    if (!grads[0].defined()) return {at::Tensor(), at::Tensor(), at::Tensor()};
    auto saved = ctx->get_saved_variables();
    auto [dx, dw] = Backward(saved[0], saved[2], saved[1], grads[0], at::Tensor(),
                             ctx->needs_input_grad(1), kName);
    return {dx, dw, at::Tensor()};
  }
};

struct AddRmsNormFunction : torch::autograd::Function<AddRmsNormFunction> {
  static tensor_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& residual,
                             const at::Tensor& weight, double eps) {
    at::Tensor wc = weight.contiguous();
    ForwardOut out = Forward(x.contiguous(), residual.contiguous(), wc, eps, kAddName);
    ctx->save_for_backward({out.h, wc, out.rstd});
    ctx->set_materialize_grads(false);
    return {out.h, out.y};
  }
  // grads: (of h, of y), either undefined when unused. x and residual get the same gradient.
  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    const at::Tensor& grad_h = grads[0];
    const at::Tensor& grad_y = grads[1];
    if (!grad_y.defined()) {
      // h's gradient passes through to both inputs; the weight had no effect on the loss.
      return {grad_h, grad_h, at::Tensor(), at::Tensor()};
    }
    auto saved = ctx->get_saved_variables();
    auto [dx, dw] =
        Backward(saved[0], saved[2], saved[1], grad_y, grad_h, ctx->needs_input_grad(2), kAddName);
    return {dx, dx, dw, at::Tensor()};
  }
};

// (x, RmsNorm(x)): x passed through, its gradient added to the norm's input gradient by the
// backward kernel (its grad_h), as AddRmsNorm's gradient of h.
struct ForkRmsNormFunction : torch::autograd::Function<ForkRmsNormFunction> {
  static tensor_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                             double eps) {
    at::Tensor xc = x.contiguous(), wc = weight.contiguous();
    ForwardOut out = Forward(xc, at::Tensor(), wc, eps, kForkName);
    ctx->save_for_backward({xc, wc, out.rstd});
    ctx->set_materialize_grads(false);
    return {x, out.y};  // autograd returns x as a view of itself with this node as grad_fn
  }
  // grads: (of the passed-through x, of y), either undefined when unused.
  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    const at::Tensor& grad_x = grads[0];
    const at::Tensor& grad_y = grads[1];
    if (!grad_y.defined()) return {grad_x, at::Tensor(), at::Tensor()};
    auto saved = ctx->get_saved_variables();
    auto [dx, dw] =
        Backward(saved[0], saved[2], saved[1], grad_y, grad_x, ctx->needs_input_grad(1), kForkName);
    return {dx, dw, at::Tensor()};
  }
};

}  // namespace

at::Tensor RmsNorm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  CheckArgs(x, weight, kName);
  return RmsNormFunction::apply(x, weight, eps);
}

std::pair<at::Tensor, at::Tensor> AddRmsNorm(const at::Tensor& x, const at::Tensor& residual,
                                             const at::Tensor& weight, double eps) {
  CheckArgs(x, weight, kAddName);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type() &&
                  residual.device() == x.device(),
              "fsdp kernel ", kAddName, ": residual (", residual.sizes(), ", ",
              residual.scalar_type(), ", ", residual.device(), ") must match x (", x.sizes(), ", ",
              x.scalar_type(), ", ", x.device(), ")");
  tensor_list out = AddRmsNormFunction::apply(x, residual, weight, eps);
  return {out[0], out[1]};
}

std::pair<at::Tensor, at::Tensor> ForkRmsNorm(const at::Tensor& x, const at::Tensor& weight,
                                              double eps) {
  CheckArgs(x, weight, kForkName);
  tensor_list out = ForkRmsNormFunction::apply(x, weight, eps);
  return {out[0], out[1]};
}

at::Tensor RmsNormComposite(const at::Tensor& x, const at::Tensor& weight, double eps) {
  at::Tensor xf = x.to(at::kFloat);
  at::Tensor y = xf * at::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return y.to(x.scalar_type()) * weight;
}

std::pair<at::Tensor, at::Tensor> AddRmsNormComposite(const at::Tensor& x,
                                                      const at::Tensor& residual,
                                                      const at::Tensor& weight, double eps) {
  at::Tensor h = x + residual;
  return {h, RmsNormComposite(h, weight, eps)};
}

}  // namespace fsdp::kernels
