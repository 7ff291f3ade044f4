#include "kernels/cuda/swiglu.h"

#include "kernels/cuda/common.cuh"

namespace fsdp::kernels::cuda {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float Sigmoid(float x) { return 1.0f / (1.0f + __expf(-x)); }

template <typename T>
struct Operand {
  T* data;
  int64_t stride;
  __device__ __forceinline__ T& at(int64_t row, int64_t col) const { return data[row * stride + col]; }
};

template <typename T>
Operand<T> Typed(SwiGluOperand o) {
  return {static_cast<T*>(o.data), o.row_stride};
}

// One thread per element, grid-stride; rows x cols may exceed the grid.
template <typename T>
__global__ void SwiGluForwardKernel(Operand<T> gate, Operand<T> up, Operand<T> out, int64_t rows,
                                    int64_t cols) {
  int64_t n = rows * cols;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    int64_t row = i / cols, col = i - row * cols;
    float g = ToFloat(gate.at(row, col)), u = ToFloat(up.at(row, col));
    out.at(row, col) = FromFloat<T>(g * Sigmoid(g) * u);
  }
}

template <typename T>
__global__ void SwiGluBackwardKernel(Operand<T> gate, Operand<T> up, Operand<T> grad_out,
                                     Operand<T> grad_gate, Operand<T> grad_up, int64_t rows,
                                     int64_t cols) {
  int64_t n = rows * cols;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    int64_t row = i / cols, col = i - row * cols;
    float g = ToFloat(gate.at(row, col)), u = ToFloat(up.at(row, col));
    float d = ToFloat(grad_out.at(row, col));
    float s = Sigmoid(g);
    grad_gate.at(row, col) = FromFloat<T>(d * u * s * (1.0f + g * (1.0f - s)));
    grad_up.at(row, col) = FromFloat<T>(d * g * s);
  }
}

int Blocks(int64_t n) {
  int64_t blocks = (n + kThreads - 1) / kThreads;
  const int64_t max_blocks = 65536 * 8;
  return static_cast<int>(blocks < max_blocks ? (blocks > 0 ? blocks : 1) : max_blocks);
}

}  // namespace

LaunchStatus SwiGluForward(SwiGluOperand gate, SwiGluOperand up, SwiGluOperand out, int64_t rows,
                           int64_t cols, DType dtype, Stream stream) {
  if (rows * cols == 0) return 0;
  return FSDP_KERNELS_DISPATCH(dtype, T, [&] {
    SwiGluForwardKernel<T><<<Blocks(rows * cols), kThreads, 0, AsCudaStream(stream)>>>(
        Typed<T>(gate), Typed<T>(up), Typed<T>(out), rows, cols);
    return LastLaunchStatus();
  });
}

LaunchStatus SwiGluBackward(SwiGluOperand gate, SwiGluOperand up, SwiGluOperand grad_out,
                            SwiGluOperand grad_gate, SwiGluOperand grad_up, int64_t rows,
                            int64_t cols, DType dtype, Stream stream) {
  if (rows * cols == 0) return 0;
  return FSDP_KERNELS_DISPATCH(dtype, T, [&] {
    SwiGluBackwardKernel<T><<<Blocks(rows * cols), kThreads, 0, AsCudaStream(stream)>>>(
        Typed<T>(gate), Typed<T>(up), Typed<T>(grad_out), Typed<T>(grad_gate), Typed<T>(grad_up),
        rows, cols);
    return LastLaunchStatus();
  });
}

}  // namespace fsdp::kernels::cuda
