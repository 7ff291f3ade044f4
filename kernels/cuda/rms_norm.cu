#include "kernels/cuda/rms_norm.h"

#include "kernels/cuda/common.cuh"

namespace fsdp::kernels::cuda {
namespace {

// Note [RMSNorm kernel layout]
// One block per row, its threads striding over the columns: thread t owns columns t, t + T,
// t + 2T, ... of every row it visits, in both kernels. A row is read twice (the sum of squares,
// then the output); the second read hits L1/L2 (a row of 2048 bf16 is 4 KiB), so DRAM sees one
// read of each input and one write of each output. Blocks stride over rows (blockIdx.x,
// + gridDim.x, ...), so every thread of a block is on the same row and the __syncthreads in
// BlockSum is reached by all of them; rows can be any number.
//
// Note [RMSNorm weight gradient]
// grad_weight[c] = sum over rows of grad_y[r, c] * xhat[r, c] is a reduction over rows, done in
// fp32 in two deterministic steps (no atomics): RmsNormBackwardKernel's block b accumulates the
// rows it visits into its own partial row, partials[b, :], then ColumnSumKernel sums the
// partial rows per column and rounds once to the weight's dtype. Because thread t owns the same
// columns on every row, the partial row needs no synchronisation: it lives in shared memory
// when it fits (cols <= kSmemCols) and is copied out at the end, or is accumulated in place in
// the global scratch row otherwise (L2-resident for any realistic size). The number of blocks,
// RmsNormBackwardPartials, depends only on (rows, cols): at least kMinRowsPerBlock rows per
// block, so the partial rows cost a fraction of the row traffic, and at most about 2^18 threads
// in flight (1024 blocks of 256 for cols 2048: one wave of 8 blocks per SM on an H100).

constexpr int kMinRowsPerBlock = 8;
constexpr int kMaxThreadsInFlight = 1 << 18;
constexpr int kMaxForwardBlocks = 1 << 20;  // then blocks stride over rows
// Dynamic shared memory without an opt-in is 48 KiB: 32 floats of BlockSum scratch + the row.
constexpr int64_t kSmemCols = 48 * 1024 / sizeof(float) - 32;

// About 8 columns per thread, one warp at least, 1024 threads at most; a multiple of 32.
int Threads(int64_t cols) {
  int64_t t = ((cols + 7) / 8 + 31) / 32 * 32;
  return static_cast<int>(t < 32 ? 32 : (t > 1024 ? 1024 : t));
}

template <typename T, typename W>
__global__ void RmsNormForwardKernel(const T* __restrict__ x, const T* __restrict__ residual,
                                     const W* __restrict__ weight, T* __restrict__ h,
                                     T* __restrict__ y, float* __restrict__ rstd, int64_t rows,
                                     int64_t cols, float eps) {
  __shared__ float scratch[32];
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t base = row * cols;
    float sum_sq = 0.0f;
    if (residual != nullptr) {
      for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
        T hv = FromFloat<T>(ToFloat(x[base + c]) + ToFloat(residual[base + c]));
        h[base + c] = hv;
        float v = ToFloat(hv);  // the rounded h: what the backward reads
        sum_sq += v * v;
      }
    } else {
      for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
        float v = ToFloat(x[base + c]);
        sum_sq += v * v;
      }
    }
    float r = rsqrtf(BlockSum(sum_sq, scratch) / static_cast<float>(cols) + eps);
    if (threadIdx.x == 0) rstd[row] = r;
    if (residual != nullptr) {
      // This thread rereads the h elements that it wrote itself (program order).
      for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
        y[base + c] = FromFloat<T>(ToFloat(h[base + c]) * r * ToFloat(weight[c]));
      }
    } else {
      for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
        y[base + c] = FromFloat<T>(ToFloat(x[base + c]) * r * ToFloat(weight[c]));
      }
    }
  }
}

// See Note [RMSNorm weight gradient]. partials == nullptr: no weight gradient. Dynamic shared
// memory: 32 floats, + cols floats when the partial row is kept there (acc_in_smem).
template <typename T, typename W>
__global__ void RmsNormBackwardKernel(const T* __restrict__ v, const float* __restrict__ rstd,
                                      const W* __restrict__ weight, const T* __restrict__ grad_y,
                                      const T* __restrict__ grad_h, T* __restrict__ grad_x,
                                      float* __restrict__ partials, int64_t rows, int64_t cols,
                                      bool acc_in_smem) {
  extern __shared__ float smem[];
  float* scratch = smem;
  float* acc = partials == nullptr ? nullptr
               : acc_in_smem       ? smem + 32
                                   : partials + blockIdx.x * cols;
  if (acc != nullptr) {
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) acc[c] = 0.0f;
  }
  const float inv_cols = 1.0f / static_cast<float>(cols);
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t base = row * cols;
    const float r = rstd[row];
    float dot = 0.0f;  // sum of (grad_y * weight) * xhat over the row
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
      float xhat = ToFloat(v[base + c]) * r, dy = ToFloat(grad_y[base + c]);
      dot += dy * ToFloat(weight[c]) * xhat;
      if (acc != nullptr) acc[c] += dy * xhat;  // only this thread touches column c
    }
    const float mean_dot = BlockSum(dot, scratch) * inv_cols;
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
      float xhat = ToFloat(v[base + c]) * r;
      float g = ToFloat(grad_y[base + c]) * ToFloat(weight[c]);
      float dx = r * (g - xhat * mean_dot);
      if (grad_h != nullptr) dx += ToFloat(grad_h[base + c]);
      grad_x[base + c] = FromFloat<T>(dx);
    }
  }
  if (acc != nullptr && acc_in_smem) {
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x)
      partials[blockIdx.x * cols + c] = acc[c];
  }
}

// out[c] = sum over p of partials[p, c], rounded once. Blocks of 32 x 32: threadIdx.x picks
// the column (coalesced), threadIdx.y strides over the partial rows; then the first warp sums
// the 32 column totals in a fixed order.
template <typename W>
__global__ void ColumnSumKernel(const float* __restrict__ partials, int64_t num_partials,
                                int64_t cols, W* __restrict__ out) {
  __shared__ float sums[32][32];  // [y][x]: each warp writes, and the first reads, whole rows
  const int64_t c = blockIdx.x * int64_t{32} + threadIdx.x;
  float s = 0.0f;
  if (c < cols) {
    for (int64_t p = threadIdx.y; p < num_partials; p += 32) s += partials[p * cols + c];
  }
  sums[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    float total = 0.0f;
    for (int k = 0; k < 32; ++k) total += sums[k][threadIdx.x];
    out[c] = FromFloat<W>(total);
  }
}

template <typename T, typename W>
LaunchStatus LaunchForward(const void* x, const void* residual, const void* weight, void* h,
                           void* y, float* rstd, int64_t rows, int64_t cols, float eps,
                           cudaStream_t stream) {
  int blocks = static_cast<int>(rows < kMaxForwardBlocks ? rows : kMaxForwardBlocks);
  RmsNormForwardKernel<T, W><<<blocks, Threads(cols), 0, stream>>>(
      static_cast<const T*>(x), static_cast<const T*>(residual), static_cast<const W*>(weight),
      static_cast<T*>(h), static_cast<T*>(y), rstd, rows, cols, eps);
  return LastLaunchStatus();
}

template <typename T, typename W>
LaunchStatus LaunchBackward(const void* v, const float* rstd, const void* weight,
                            const void* grad_y, const void* grad_h, void* grad_x, void* grad_weight,
                            float* partials, int64_t rows, int64_t cols, cudaStream_t stream) {
  int64_t blocks = RmsNormBackwardPartials(rows, cols);
  bool want_weight = grad_weight != nullptr;
  bool acc_in_smem = want_weight && cols <= kSmemCols;
  size_t smem = (32 + (acc_in_smem ? cols : 0)) * sizeof(float);
  RmsNormBackwardKernel<T, W><<<static_cast<int>(blocks), Threads(cols), smem, stream>>>(
      static_cast<const T*>(v), rstd, static_cast<const W*>(weight), static_cast<const T*>(grad_y),
      static_cast<const T*>(grad_h), static_cast<T*>(grad_x), want_weight ? partials : nullptr,
      rows, cols, acc_in_smem);
  LaunchStatus status = LastLaunchStatus();
  if (status != 0 || !want_weight) return status;
  ColumnSumKernel<W><<<static_cast<unsigned>((cols + 31) / 32), dim3(32, 32), 0, stream>>>(
      partials, blocks, cols, static_cast<W*>(grad_weight));
  return LastLaunchStatus();
}

}  // namespace

int64_t RmsNormBackwardPartials(int64_t rows, int64_t cols) {
  int64_t by_rows = (rows + kMinRowsPerBlock - 1) / kMinRowsPerBlock;
  int64_t by_threads = kMaxThreadsInFlight / Threads(cols);
  int64_t blocks = by_rows < by_threads ? by_rows : by_threads;
  return blocks > 0 ? blocks : 1;
}

LaunchStatus RmsNormForward(const void* x, const void* residual, const void* weight, void* h,
                            void* y, float* rstd, int64_t rows, int64_t cols, float eps,
                            DType dtype, DType weight_dtype, Stream stream) {
  if (rows == 0 || cols == 0) return 0;
  return FSDP_KERNELS_DISPATCH(dtype, T, [&] {
    if (weight_dtype == DType::kFloat) {
      return LaunchForward<T, float>(x, residual, weight, h, y, rstd, rows, cols, eps,
                                     AsCudaStream(stream));
    }
    if (weight_dtype != dtype) return static_cast<LaunchStatus>(cudaErrorInvalidValue);
    return LaunchForward<T, T>(x, residual, weight, h, y, rstd, rows, cols, eps,
                               AsCudaStream(stream));
  });
}

LaunchStatus RmsNormBackward(const void* v, const float* rstd, const void* weight,
                             const void* grad_y, const void* grad_h, void* grad_x,
                             void* grad_weight, float* partials, int64_t rows, int64_t cols,
                             DType dtype, DType weight_dtype, Stream stream) {
  if (rows == 0 || cols == 0) return 0;  // the caller zero-fills grad_weight
  if (grad_weight != nullptr && partials == nullptr) {
    return static_cast<LaunchStatus>(cudaErrorInvalidValue);
  }
  return FSDP_KERNELS_DISPATCH(dtype, T, [&] {
    if (weight_dtype == DType::kFloat) {
      return LaunchBackward<T, float>(v, rstd, weight, grad_y, grad_h, grad_x, grad_weight,
                                      partials, rows, cols, AsCudaStream(stream));
    }
    if (weight_dtype != dtype) return static_cast<LaunchStatus>(cudaErrorInvalidValue);
    return LaunchBackward<T, T>(v, rstd, weight, grad_y, grad_h, grad_x, grad_weight, partials,
                                rows, cols, AsCudaStream(stream));
  });
}

}  // namespace fsdp::kernels::cuda
