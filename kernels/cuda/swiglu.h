// SwiGLU launchers (kernels/cuda/swiglu.cu). gate_up: rows x (2 * cols), the gate (w1's output)
// in the first `cols` columns of each row and the up projection (w3's) in the last; out and
// grad_out: rows x cols; grad_gate_up like gate_up. Contiguous, one dtype; fp32 arithmetic.
#pragma once

#include <cstdint>

#include "kernels/cuda/types.h"

namespace fsdp::kernels::cuda {

// out = silu(gate) * up
LaunchStatus SwiGluForward(const void* gate_up, void* out, int64_t rows, int64_t cols, DType dtype,
                           Stream stream);
// grad_gate = grad_out * up * silu'(gate), grad_up = grad_out * silu(gate)
LaunchStatus SwiGluBackward(const void* gate_up, const void* grad_out, void* grad_gate_up,
                            int64_t rows, int64_t cols, DType dtype, Stream stream);

}  // namespace fsdp::kernels::cuda
