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
using Operand = cuda::SwiGluOperand;

// A [rows, cols] matrix inside a contiguous tensor: its first element and row stride.
Operand At(const at::Tensor& t, int64_t offset, int64_t row_stride) {
  return {static_cast<char*>(t.data_ptr()) + offset * t.element_size(), row_stride};
}

// CPU reference: rows in parallel, fp32 arithmetic, one rounding to the output dtype.
void ForwardCpu(Operand gate, Operand up, Operand out, int64_t rows, int64_t cols,
                at::ScalarType dtype) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, kName, [&] {
    at::parallel_for(0, rows, std::max<int64_t>(1, 32768 / std::max<int64_t>(cols, 1)),
                     [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* g = static_cast<const scalar_t*>(gate.data) + r * gate.row_stride;
        const scalar_t* u = static_cast<const scalar_t*>(up.data) + r * up.row_stride;
        scalar_t* y = static_cast<scalar_t*>(out.data) + r * out.row_stride;
        for (int64_t c = 0; c < cols; ++c) {
          float gf = static_cast<float>(g[c]);
          y[c] = static_cast<scalar_t>(gf / (1.0f + std::exp(-gf)) * static_cast<float>(u[c]));
        }
      }
    });
  });
}

void BackwardCpu(Operand gate, Operand up, Operand grad_out, Operand grad_gate, Operand grad_up,
                 int64_t rows, int64_t cols, at::ScalarType dtype) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, kName, [&] {
    at::parallel_for(0, rows, std::max<int64_t>(1, 32768 / std::max<int64_t>(cols, 1)),
                     [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* g = static_cast<const scalar_t*>(gate.data) + r * gate.row_stride;
        const scalar_t* u = static_cast<const scalar_t*>(up.data) + r * up.row_stride;
        const scalar_t* d = static_cast<const scalar_t*>(grad_out.data) + r * grad_out.row_stride;
        scalar_t* dg = static_cast<scalar_t*>(grad_gate.data) + r * grad_gate.row_stride;
        scalar_t* du = static_cast<scalar_t*>(grad_up.data) + r * grad_up.row_stride;
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

// Runs the forward on the device of `like` (the tensor whose dtype and device rule).
void Forward(const at::Tensor& like, Operand gate, Operand up, Operand out, int64_t rows,
             int64_t cols) {
  if (OnCuda(like, kName)) {
    FSDP_CUDA_LAUNCH(like, kName,
                     cuda::SwiGluForward(gate, up, out, rows, cols, ToKernelDType(like, kName),
                                         CurrentStream(like)));
  } else {
    ForwardCpu(gate, up, out, rows, cols, like.scalar_type());
  }
}

void Backward(const at::Tensor& like, Operand gate, Operand up, Operand grad_out,
              Operand grad_gate, Operand grad_up, int64_t rows, int64_t cols) {
  if (OnCuda(like, kName)) {
    FSDP_CUDA_LAUNCH(like, kName,
                     cuda::SwiGluBackward(gate, up, grad_out, grad_gate, grad_up, rows, cols,
                                          ToKernelDType(like, kName), CurrentStream(like)));
  } else {
    BackwardCpu(gate, up, grad_out, grad_gate, grad_up, rows, cols, like.scalar_type());
  }
}

int64_t Rows(const at::Tensor& t, int64_t cols) { return cols == 0 ? 0 : t.numel() / cols; }

// gate and up as two tensors of one shape.
struct SwiGluFunction : torch::autograd::Function<SwiGluFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& gate,
                            const at::Tensor& up) {
    at::Tensor g = gate.contiguous(), u = up.contiguous();
    const int64_t cols = g.size(-1), rows = Rows(g, cols);
    at::Tensor out = at::empty_like(g);
    Forward(g, At(g, 0, cols), At(u, 0, cols), At(out, 0, cols), rows, cols);
    ctx->save_for_backward({g, u});
    return out;
  }
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    at::Tensor g = ctx->get_saved_variables()[0], u = ctx->get_saved_variables()[1];
    at::Tensor d = grads[0].contiguous().to(g.scalar_type());
    const int64_t cols = g.size(-1), rows = Rows(g, cols);
    at::Tensor dg = at::empty_like(g), du = at::empty_like(u);
    Backward(g, At(g, 0, cols), At(u, 0, cols), At(d, 0, cols), At(dg, 0, cols), At(du, 0, cols),
             rows, cols);
    return {dg, du};
  }
};

// gate and up as the two halves of the last dimension of one tensor.
struct SwiGluFusedFunction : torch::autograd::Function<SwiGluFusedFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& gate_up) {
    at::Tensor in = gate_up.contiguous();
    const int64_t cols = in.size(-1) / 2, rows = Rows(in, 2 * cols);
    std::vector<int64_t> shape(in.sizes().begin(), in.sizes().end());
    shape.back() = cols;
    at::Tensor out = at::empty(shape, in.options());
    Forward(in, At(in, 0, 2 * cols), At(in, cols, 2 * cols), At(out, 0, cols), rows, cols);
    ctx->save_for_backward({in});
    return out;
  }
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    at::Tensor in = ctx->get_saved_variables()[0];
    at::Tensor d = grads[0].contiguous().to(in.scalar_type());
    const int64_t cols = in.size(-1) / 2, rows = Rows(in, 2 * cols);
    at::Tensor grad = at::empty_like(in);
    Backward(in, At(in, 0, 2 * cols), At(in, cols, 2 * cols), At(d, 0, cols),
             At(grad, 0, 2 * cols), At(grad, cols, 2 * cols), rows, cols);
    return {grad};
  }
};

}  // namespace

at::Tensor SwiGlu(const at::Tensor& gate, const at::Tensor& up) {
  ToKernelDType(gate, kName);  // names the kernel for an unsupported dtype
  TORCH_CHECK(gate.sizes() == up.sizes() && gate.scalar_type() == up.scalar_type() &&
                  gate.device() == up.device(),
              "swiglu: gate ", gate.sizes(), " ", gate.scalar_type(), " and up ", up.sizes(), " ",
              up.scalar_type(), " must have one shape, dtype and device");
  TORCH_CHECK(gate.dim() >= 1, "swiglu: gate and up need a last dimension");
  return SwiGluFunction::apply(gate, up);
}

at::Tensor SwiGlu(const at::Tensor& gate_up) {
  ToKernelDType(gate_up, kName);
  TORCH_CHECK(gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0, "swiglu: the last dimension of "
              "gate_up (", gate_up.sizes(), ") must be even: gate and up halves");
  return SwiGluFusedFunction::apply(gate_up);
}

at::Tensor SwiGluComposite(const at::Tensor& gate, const at::Tensor& up) {
  return at::silu(gate) * up;
}

at::Tensor SwiGluComposite(const at::Tensor& gate_up) {
  auto halves = gate_up.chunk(2, -1);
  return SwiGluComposite(halves[0], halves[1]);
}

}  // namespace fsdp::kernels
