// SwiGLU launchers (kernels/cuda/swiglu.cu). `rows` x `cols` elements; each operand is a
// row-major matrix with its own row stride (in elements, >= cols), so that gate and up may be
// two tensors or the two halves of one fused projection [rows, 2 * cols] (strides 2 * cols,
// up = gate + cols). One dtype; fp32 arithmetic.
#pragma once

#include <cstdint>

#include "kernels/cuda/types.h"

namespace fsdp::kernels::cuda {

struct SwiGluOperand {
  void* data;
  int64_t row_stride;
};

// out = silu(gate) * up
LaunchStatus SwiGluForward(SwiGluOperand gate, SwiGluOperand up, SwiGluOperand out, int64_t rows,
                           int64_t cols, DType dtype, Stream stream);
// grad_gate = grad_out * up * silu'(gate), grad_up = grad_out * silu(gate)
LaunchStatus SwiGluBackward(SwiGluOperand gate, SwiGluOperand up, SwiGluOperand grad_out,
                            SwiGluOperand grad_gate, SwiGluOperand grad_up, int64_t rows,
                            int64_t cols, DType dtype, Stream stream);

}  // namespace fsdp::kernels::cuda
