#include "kernels/swiglu.h"

#include <cmath>

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/custom_function.h>

#include "kernels/cuda/swiglu.h"
#include "kernels/dispatch.h"

namespace fsdp::kernels {
namespace {

constexpr const char* kName = "swiglu";

// CPU reference: rows in parallel, fp32 arithmetic, one rounding to the output dtype.
void ForwardCpu(const at::Tensor& gate_up, at::Tensor& out, int64_t rows, int64_t cols) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), kName, [&] {
    const scalar_t* in = gate_up.const_data_ptr<scalar_t>();
    scalar_t* o = out.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, rows, std::max<int64_t>(1, 32768 / std::max<int64_t>(cols, 1)),
                     [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* g = in + r * 2 * cols;
        const scalar_t* u = g + cols;
        scalar_t* y = o + r * cols;
        for (int64_t c = 0; c < cols; ++c) {
          float gf = static_cast<float>(g[c]);
          y[c] = static_cast<scalar_t>(gf / (1.0f + std::exp(-gf)) * static_cast<float>(u[c]));
        }
      }
    });
  });
}

void BackwardCpu(const at::Tensor& gate_up, const at::Tensor& grad_out, at::Tensor& grad_gate_up,
                 int64_t rows, int64_t cols) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), kName, [&] {
    const scalar_t* in = gate_up.const_data_ptr<scalar_t>();
    const scalar_t* dout = grad_out.const_data_ptr<scalar_t>();
    scalar_t* din = grad_gate_up.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, rows, std::max<int64_t>(1, 32768 / std::max<int64_t>(cols, 1)),
                     [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* g = in + r * 2 * cols;
        const scalar_t* u = g + cols;
        const scalar_t* d = dout + r * cols;
        scalar_t* dg = din + r * 2 * cols;
        scalar_t* du = dg + cols;
        for (int64_t c = 0; c < cols; ++c) {
          float gf = static_cast<float>(g[c]), uf = static_cast<float>(u[c]);
          float df = static_cast<float>(d[c]);
          float s = 1.0f / (1.0f + std::exp(-gf));
          dg[c] = static_cast<scalar_t>(df * uf * s * (1.0f + gf * (1.0f - s)));
          du[c] = static_cast<scalar_t>(df * gf * s);
        }
      }
    });
  });
}

at::Tensor Forward(const at::Tensor& gate_up) {
  int64_t two_f = gate_up.size(-1);
  TORCH_CHECK(two_f % 2 == 0, "swiglu: the last dimension of gate_up (", two_f,
              ") must be even: gate and up halves");
  int64_t cols = two_f / 2, rows = cols == 0 ? 0 : gate_up.numel() / two_f;
  std::vector<int64_t> shape(gate_up.sizes().begin(), gate_up.sizes().end());
  shape.back() = cols;
  at::Tensor out = at::empty(shape, gate_up.options());
  if (OnCuda(gate_up, kName)) {
#ifdef FSDP_WITH_CUDA  // else OnCuda has thrown: the launchers are not built
    CheckLaunch(cuda::SwiGluForward(gate_up.const_data_ptr(), out.mutable_data_ptr(), rows, cols,
                                    ToKernelDType(gate_up, kName), CurrentStream(gate_up)),
                kName);
#endif
  } else {
    ForwardCpu(gate_up, out, rows, cols);
  }
  return out;
}

at::Tensor Backward(const at::Tensor& gate_up, const at::Tensor& grad_out) {
  int64_t cols = gate_up.size(-1) / 2, rows = cols == 0 ? 0 : gate_up.numel() / (2 * cols);
  at::Tensor grad = grad_out.contiguous().to(gate_up.scalar_type());
  at::Tensor grad_gate_up = at::empty_like(gate_up);
  if (OnCuda(gate_up, kName)) {
#ifdef FSDP_WITH_CUDA  // else OnCuda has thrown: the launchers are not built
    CheckLaunch(cuda::SwiGluBackward(gate_up.const_data_ptr(), grad.const_data_ptr(),
                                     grad_gate_up.mutable_data_ptr(), rows, cols,
                                     ToKernelDType(gate_up, kName), CurrentStream(gate_up)),
                kName);
#endif
  } else {
    BackwardCpu(gate_up, grad, grad_gate_up, rows, cols);
  }
  return grad_gate_up;
}

struct SwiGluFunction : torch::autograd::Function<SwiGluFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& gate_up) {
    at::Tensor in = gate_up.contiguous();
    ctx->save_for_backward({in});
    return Forward(in);
  }
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    return {Backward(ctx->get_saved_variables()[0], grads[0])};
  }
};

}  // namespace

at::Tensor SwiGlu(const at::Tensor& gate_up) {
  ToKernelDType(gate_up, kName);  // names the kernel for an unsupported dtype
  return SwiGluFunction::apply(gate_up);
}

at::Tensor SwiGluComposite(const at::Tensor& gate_up) {
  auto halves = gate_up.chunk(2, -1);
  return at::silu(halves[0]) * halves[1];
}

}  // namespace fsdp::kernels
