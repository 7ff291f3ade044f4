#include "kernels/cuda/swiglu.h"

#include <initializer_list>

#include "kernels/cuda/common.cuh"

namespace fsdp::kernels::cuda {
namespace {

// Note [SwiGLU kernel layout]
// 2-D, no index divided per element: blockIdx.y (striding by gridDim.y, at most 65535) picks
// the row, blockIdx.x * blockDim.x + threadIdx.x the pack of kWidth columns within it. A pack
// is 16 bytes (8 bf16/fp16, 4 floats) when cols is a multiple of that width and every
// operand's data pointer and row stride keep each row 16-byte aligned (gate and up are often
// the two halves of the fused w1/w3 projection: up = gate + cols), else one element (See Note
// [Vector accesses]). Each thread loads its packs of the inputs, computes in fp32, and stores
// its packs of the outputs: one read of each input, one write of each output, all coalesced.

constexpr int kThreads = 256;
constexpr int64_t kMaxGridY = 65535;

__device__ __forceinline__ float Sigmoid(float x) { return 1.0f / (1.0f + __expf(-x)); }

// A row-major matrix: its first element and row stride (elements).
template <typename T>
struct Matrix {
  T* data;
  int64_t stride;
  __device__ __forceinline__ T* Row(int64_t row) const { return data + row * stride; }
};

template <typename T>
Matrix<T> Typed(SwiGluOperand o) {
  return {static_cast<T*>(o.data), o.row_stride};
}

template <typename T, int kWidth>
__global__ void __launch_bounds__(kThreads)
    SwiGluForwardKernel(Matrix<const T> gate, Matrix<const T> up, Matrix<T> out, int64_t rows,
                        int64_t packs) {
  const int64_t p = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (p >= packs) return;  // no barriers below
  const int64_t col = p * kWidth;
  for (int64_t row = blockIdx.y; row < rows; row += gridDim.y) {
    float g[kWidth], u[kWidth], y[kWidth];
    LoadFloats<kWidth>(gate.Row(row) + col, g);
    LoadFloats<kWidth>(up.Row(row) + col, u);
#pragma unroll
    for (int e = 0; e < kWidth; ++e) y[e] = g[e] * Sigmoid(g[e]) * u[e];
    StoreFloats<kWidth>(out.Row(row) + col, y);
  }
}

template <typename T, int kWidth>
__global__ void __launch_bounds__(kThreads)
    SwiGluBackwardKernel(Matrix<const T> gate, Matrix<const T> up, Matrix<const T> grad_out,
                         Matrix<T> grad_gate, Matrix<T> grad_up, int64_t rows, int64_t packs) {
  const int64_t p = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (p >= packs) return;
  const int64_t col = p * kWidth;
  for (int64_t row = blockIdx.y; row < rows; row += gridDim.y) {
    float g[kWidth], u[kWidth], d[kWidth], dg[kWidth], du[kWidth];
    LoadFloats<kWidth>(gate.Row(row) + col, g);
    LoadFloats<kWidth>(up.Row(row) + col, u);
    LoadFloats<kWidth>(grad_out.Row(row) + col, d);
#pragma unroll
    for (int e = 0; e < kWidth; ++e) {
      const float s = Sigmoid(g[e]);
      dg[e] = d[e] * u[e] * s * (1.0f + g[e] * (1.0f - s));
      du[e] = d[e] * g[e] * s;
    }
    StoreFloats<kWidth>(grad_gate.Row(row) + col, dg);
    StoreFloats<kWidth>(grad_up.Row(row) + col, du);
  }
}

// 16-byte packs when every operand's rows start 16-byte aligned (Note [Vector accesses]).
template <typename T>
bool Vectorizable(int64_t cols, std::initializer_list<SwiGluOperand> operands) {
  constexpr int64_t kVector = Vec16<T>::kSize;
  if (cols % kVector != 0) return false;
  for (const SwiGluOperand& o : operands) {
    if (!AlignedTo(o.data, 16) || o.row_stride % kVector != 0) return false;
  }
  return true;
}

// The grid for rows x packs: x over a row's packs, y over rows (grid-stride beyond 65535).
struct Grid {
  dim3 blocks;
  int threads;
};

Grid GridFor(int64_t rows, int64_t packs) {
  const int64_t threads = packs < kThreads ? (packs + 31) / 32 * 32 : kThreads;
  const int64_t x = (packs + threads - 1) / threads;
  const int64_t y = rows < kMaxGridY ? rows : kMaxGridY;
  return {dim3(static_cast<unsigned>(x), static_cast<unsigned>(y)), static_cast<int>(threads)};
}

template <typename T, int kWidth>
LaunchStatus LaunchForward(SwiGluOperand gate, SwiGluOperand up, SwiGluOperand out, int64_t rows,
                           int64_t cols, cudaStream_t stream) {
  const int64_t packs = cols / kWidth;
  const Grid grid = GridFor(rows, packs);
  SwiGluForwardKernel<T, kWidth><<<grid.blocks, grid.threads, 0, stream>>>(
      Typed<const T>(gate), Typed<const T>(up), Typed<T>(out), rows, packs);
  return LastLaunchStatus();
}

template <typename T, int kWidth>
LaunchStatus LaunchBackward(SwiGluOperand gate, SwiGluOperand up, SwiGluOperand grad_out,
                            SwiGluOperand grad_gate, SwiGluOperand grad_up, int64_t rows,
                            int64_t cols, cudaStream_t stream) {
  const int64_t packs = cols / kWidth;
  const Grid grid = GridFor(rows, packs);
  SwiGluBackwardKernel<T, kWidth><<<grid.blocks, grid.threads, 0, stream>>>(
      Typed<const T>(gate), Typed<const T>(up), Typed<const T>(grad_out), Typed<T>(grad_gate),
      Typed<T>(grad_up), rows, packs);
  return LastLaunchStatus();
}

}  // namespace

LaunchStatus SwiGluForward(SwiGluOperand gate, SwiGluOperand up, SwiGluOperand out, int64_t rows,
                           int64_t cols, DType dtype, Stream stream) {
  if (rows == 0 || cols == 0) return 0;
  return FSDP_KERNELS_DISPATCH(dtype, T, [&] {
    if (Vectorizable<T>(cols, {gate, up, out})) {
      return LaunchForward<T, Vec16<T>::kSize>(gate, up, out, rows, cols, AsCudaStream(stream));
    }
    return LaunchForward<T, 1>(gate, up, out, rows, cols, AsCudaStream(stream));
  });
}

LaunchStatus SwiGluBackward(SwiGluOperand gate, SwiGluOperand up, SwiGluOperand grad_out,
                            SwiGluOperand grad_gate, SwiGluOperand grad_up, int64_t rows,
                            int64_t cols, DType dtype, Stream stream) {
  if (rows == 0 || cols == 0) return 0;
  return FSDP_KERNELS_DISPATCH(dtype, T, [&] {
    if (Vectorizable<T>(cols, {gate, up, grad_out, grad_gate, grad_up})) {
      return LaunchBackward<T, Vec16<T>::kSize>(gate, up, grad_out, grad_gate, grad_up, rows,
                                                cols, AsCudaStream(stream));
    }
    return LaunchBackward<T, 1>(gate, up, grad_out, grad_gate, grad_up, rows, cols,
                                AsCudaStream(stream));
  });
}

}  // namespace fsdp::kernels::cuda
