#include "kernels/cuda/swiglu.h"

#include "kernels/cuda/common.cuh"

namespace fsdp::kernels::cuda {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float Sigmoid(float x) { return 1.0f / (1.0f + __expf(-x)); }

// One thread per output element, grid-stride. Each row reads its gate and up halves once.
template <typename T>
__global__ void SwiGluForwardKernel(const T* __restrict__ gate_up, T* __restrict__ out,
                                    int64_t rows, int64_t cols) {
  int64_t n = rows * cols;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    int64_t row = i / cols, col = i - row * cols;
    const T* in = gate_up + row * 2 * cols;
    float g = ToFloat(in[col]), u = ToFloat(in[cols + col]);
    out[i] = FromFloat<T>(g * Sigmoid(g) * u);
  }
}

template <typename T>
__global__ void SwiGluBackwardKernel(const T* __restrict__ gate_up, const T* __restrict__ grad_out,
                                     T* __restrict__ grad_gate_up, int64_t rows, int64_t cols) {
  int64_t n = rows * cols;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    int64_t row = i / cols, col = i - row * cols;
    const T* in = gate_up + row * 2 * cols;
    T* grad = grad_gate_up + row * 2 * cols;
    float g = ToFloat(in[col]), u = ToFloat(in[cols + col]), d = ToFloat(grad_out[i]);
    float s = Sigmoid(g);
    float silu = g * s;
    grad[col] = FromFloat<T>(d * u * s * (1.0f + g * (1.0f - s)));
    grad[cols + col] = FromFloat<T>(d * silu);
  }
}

int Blocks(int64_t n) {
  int64_t blocks = (n + kThreads - 1) / kThreads;
  return static_cast<int>(blocks < 65536 * 8 ? (blocks > 0 ? blocks : 1) : 65536 * 8);
}

}  // namespace

LaunchStatus SwiGluForward(const void* gate_up, void* out, int64_t rows, int64_t cols, DType dtype,
                           Stream stream) {
  if (rows * cols == 0) return 0;
  return FSDP_KERNELS_DISPATCH(dtype, T, [&] {
    SwiGluForwardKernel<T><<<Blocks(rows * cols), kThreads, 0, AsCudaStream(stream)>>>(
        static_cast<const T*>(gate_up), static_cast<T*>(out), rows, cols);
    return LastLaunchStatus();
  });
}

LaunchStatus SwiGluBackward(const void* gate_up, const void* grad_out, void* grad_gate_up,
                            int64_t rows, int64_t cols, DType dtype, Stream stream) {
  if (rows * cols == 0) return 0;
  return FSDP_KERNELS_DISPATCH(dtype, T, [&] {
    SwiGluBackwardKernel<T><<<Blocks(rows * cols), kThreads, 0, AsCudaStream(stream)>>>(
        static_cast<const T*>(gate_up), static_cast<const T*>(grad_out),
        static_cast<T*>(grad_gate_up), rows, cols);
    return LastLaunchStatus();
  });
}

}  // namespace fsdp::kernels::cuda
