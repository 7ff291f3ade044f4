#include "kernels/cuda/rms_norm.h"

#include <initializer_list>

#include "kernels/cuda/common.cuh"

namespace fsdp::kernels::cuda {
namespace {

// Note [RMSNorm kernel layout]
// One block per row, blocks striding over rows (blockIdx.x, + gridDim.x, ...), so every thread
// of a block is on the same row and the __syncthreads in BlockSum is reached by all of them;
// rows can be any number. A row is cut into packs of kWidth elements: 16 bytes (8 bf16/fp16,
// 4 floats) when every row of every operand starts 16-byte aligned, else single elements (See
// Note [Vector accesses]). Thread t owns packs t, t + T, t + 2T, ... (T = blockDim.x) of every
// row it visits, so a warp's accesses are consecutive 16-byte packs (coalesced).
//
// Rows of up to kCachedThreads * kPacks packs (8192 bf16 / 4096 fp32 columns vectorised, 2048
// columns element-wise) are held in registers: each thread loads its at most kPacks packs of
// each input once, up front (all loads in flight together), the block reduces the sum of
// squares (forward) or of grad_y * weight * xhat (backward) with warp shuffles and one
// 32-float exchange through shared memory, and the outputs are computed from the registers.
// DRAM sees each input read once and each output written once; the weight (one row, shared by
// all rows) comes from L1/L2. The block is sized to the row, ceil(packs / kPacks) threads
// rounded up to a warp (64 threads for 2048 bf16 columns), so that many rows are in flight per
// SM. Longer rows take the *LongRow kernels: the same packs, 1024 threads at most, the row read
// a second time after the reduction (from L2: a row of 8192 bf16 is 16 KiB).
//
// Note [RMSNorm weight gradient]
// grad_weight[c] = sum over rows of grad_y[r, c] * xhat[r, c] is a reduction over rows, done in
// fp32 in two deterministic steps (no atomics): RmsNormBackward's block b accumulates the rows
// it visits into its own partial row, partials[b, :], then ColumnSumKernel sums the partial
// rows per column in a fixed order and rounds once to the weight's dtype. Because thread t owns
// the same columns on every row, the partial row needs no synchronisation: it lives in the
// thread's registers (kPacks * kWidth floats) in the cached kernel and is written once at the
// end, or is accumulated in place in the global scratch row (L2-resident) in the long-row
// kernel. The number of blocks, RmsNormBackwardPartials, depends only on the sizes: at least
// kMinRowsPerBlock rows per block, at most kMaxBackwardBlocks blocks (1024 blocks of 4 rows for
// 4096 rows: 12 KiB of each block's row in flight per SM slot, the partial rows 8 MiB of fp32
// at dim 2048, which stay in L2 until ColumnSumKernel reads them).

constexpr int kCachedThreads = 256;  // the cached kernels' largest block (register budget)
constexpr int kLongRowThreads = 1024;
constexpr int kMinRowsPerBlock = 8;
constexpr int64_t kMaxBackwardBlocks = 1024;
constexpr int64_t kMaxForwardBlocks = 1 << 20;  // then blocks stride over rows

// Packs held in registers per thread: 16-byte packs, or single elements.
template <int kWidth>
constexpr int CachedPacks() {
  return kWidth == 1 ? 8 : 4;
}

int RoundUpToWarp(int64_t threads) {
  int64_t t = (threads + 31) / 32 * 32;
  return static_cast<int>(t < 32 ? 32 : t);
}

// The cached kernels' block: each thread at most kPacks packs (packs <= kCachedThreads * kPacks).
int CachedThreads(int64_t packs, int packs_per_thread) {
  return RoundUpToWarp((packs + packs_per_thread - 1) / packs_per_thread);
}

// The long-row kernels' block: about 8 packs per thread, 1024 threads at most.
int LongRowThreads(int64_t packs) {
  int t = RoundUpToWarp((packs + 7) / 8);
  return t > kLongRowThreads ? kLongRowThreads : t;
}

// See Note [RMSNorm kernel layout]. x, residual, h, y: rows x cols; residual and h nullptr
// without the fused add. cols = packs * kWidth <= kCachedThreads * kPacks * kWidth.
template <typename T, typename W, int kWidth, int kPacks>
__global__ void __launch_bounds__(kCachedThreads)
    RmsNormForwardKernel(const T* __restrict__ x, const T* __restrict__ residual,
                         const W* __restrict__ weight, T* __restrict__ h, T* __restrict__ y,
                         float* __restrict__ rstd, int64_t rows, int cols, float eps) {
  using P = Pack<T, kWidth>;
  __shared__ float scratch[32];
  const int packs = cols / kWidth;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t base = row * cols;
    P v[kPacks];
#pragma unroll
    for (int j = 0; j < kPacks; ++j) {
      const int p = static_cast<int>(threadIdx.x + j * blockDim.x);
      if (p < packs) v[j] = LoadPack<kWidth>(x + base + p * kWidth);
    }
    if (residual != nullptr) {
      P r[kPacks];
#pragma unroll
      for (int j = 0; j < kPacks; ++j) {
        const int p = static_cast<int>(threadIdx.x + j * blockDim.x);
        if (p < packs) r[j] = LoadPack<kWidth>(residual + base + p * kWidth);
      }
#pragma unroll
      for (int j = 0; j < kPacks; ++j) {
        const int p = static_cast<int>(threadIdx.x + j * blockDim.x);
        if (p < packs) {
#pragma unroll
          for (int e = 0; e < kWidth; ++e) {
            v[j].v[e] = FromFloat<T>(ToFloat(v[j].v[e]) + ToFloat(r[j].v[e]));
          }
          StorePack<kWidth>(h + base + p * kWidth, v[j]);
        }
      }
    }
    float sum_sq = 0.0f;  // of v = x, or of the rounded h (what the backward reads)
#pragma unroll
    for (int j = 0; j < kPacks; ++j) {
      const int p = static_cast<int>(threadIdx.x + j * blockDim.x);
      if (p < packs) {
#pragma unroll
        for (int e = 0; e < kWidth; ++e) {
          const float f = ToFloat(v[j].v[e]);
          sum_sq += f * f;
        }
      }
    }
    const float r = rsqrtf(BlockSum(sum_sq, scratch) / static_cast<float>(cols) + eps);
    if (threadIdx.x == 0) rstd[row] = r;
#pragma unroll
    for (int j = 0; j < kPacks; ++j) {
      const int p = static_cast<int>(threadIdx.x + j * blockDim.x);
      if (p < packs) {
        float w[kWidth], out[kWidth];
        LoadFloats<kWidth>(weight + p * kWidth, w);
#pragma unroll
        for (int e = 0; e < kWidth; ++e) out[e] = ToFloat(v[j].v[e]) * r * w[e];
        StoreFloats<kWidth>(y + base + p * kWidth, out);
      }
    }
  }
}

// Rows too long for registers: the same packs, the row (x, or h that this thread wrote itself)
// read again after the reduction.
template <typename T, typename W, int kWidth>
__global__ void __launch_bounds__(kLongRowThreads)
    RmsNormForwardLongRowKernel(const T* __restrict__ x, const T* __restrict__ residual,
                                const W* __restrict__ weight, T* __restrict__ h,
                                T* __restrict__ y, float* __restrict__ rstd, int64_t rows,
                                int64_t cols, float eps) {
  using P = Pack<T, kWidth>;
  __shared__ float scratch[32];
  const int64_t packs = cols / kWidth;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t base = row * cols;
    float sum_sq = 0.0f;
    for (int64_t p = threadIdx.x; p < packs; p += blockDim.x) {
      P v = LoadPack<kWidth>(x + base + p * kWidth);
      if (residual != nullptr) {
        const P r = LoadPack<kWidth>(residual + base + p * kWidth);
#pragma unroll
        for (int e = 0; e < kWidth; ++e) v.v[e] = FromFloat<T>(ToFloat(v.v[e]) + ToFloat(r.v[e]));
        StorePack<kWidth>(h + base + p * kWidth, v);
      }
#pragma unroll
      for (int e = 0; e < kWidth; ++e) {
        const float f = ToFloat(v.v[e]);
        sum_sq += f * f;
      }
    }
    const float r = rsqrtf(BlockSum(sum_sq, scratch) / static_cast<float>(cols) + eps);
    if (threadIdx.x == 0) rstd[row] = r;
    for (int64_t p = threadIdx.x; p < packs; p += blockDim.x) {
      // With a residual: the h elements that this thread wrote itself (program order).
      const P v = residual != nullptr ? LoadPack<kWidth>(h + base + p * kWidth)
                                      : LoadPack<kWidth>(x + base + p * kWidth);
      float w[kWidth], out[kWidth];
      LoadFloats<kWidth>(weight + p * kWidth, w);
#pragma unroll
      for (int e = 0; e < kWidth; ++e) out[e] = ToFloat(v.v[e]) * r * w[e];
      StoreFloats<kWidth>(y + base + p * kWidth, out);
    }
  }
}

// See Note [RMSNorm kernel layout] and Note [RMSNorm weight gradient]. partials == nullptr: no
// weight gradient; else this block's partial row is partials[blockIdx.x, :].
template <typename T, typename W, int kWidth, int kPacks>
__global__ void __launch_bounds__(kCachedThreads)
    RmsNormBackwardKernel(const T* __restrict__ v, const float* __restrict__ rstd,
                          const W* __restrict__ weight, const T* __restrict__ grad_y,
                          const T* __restrict__ grad_h, T* __restrict__ grad_x,
                          float* __restrict__ partials, int64_t rows, int cols) {
  using P = Pack<T, kWidth>;
  __shared__ float scratch[32];
  const int packs = cols / kWidth;
  const float inv_cols = 1.0f / static_cast<float>(cols);
  float acc[kPacks][kWidth];  // this thread's columns of the partial row
#pragma unroll
  for (int j = 0; j < kPacks; ++j) {
#pragma unroll
    for (int e = 0; e < kWidth; ++e) acc[j][e] = 0.0f;
  }
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t base = row * cols;
    const float r = rstd[row];
    P xs[kPacks], dys[kPacks], dhs[kPacks];
#pragma unroll
    for (int j = 0; j < kPacks; ++j) {
      const int p = static_cast<int>(threadIdx.x + j * blockDim.x);
      if (p < packs) {
        xs[j] = LoadPack<kWidth>(v + base + p * kWidth);
        dys[j] = LoadPack<kWidth>(grad_y + base + p * kWidth);
        if (grad_h != nullptr) dhs[j] = LoadPack<kWidth>(grad_h + base + p * kWidth);
      }
    }
    float dot = 0.0f;  // sum of (grad_y * weight) * xhat over the row
#pragma unroll
    for (int j = 0; j < kPacks; ++j) {
      const int p = static_cast<int>(threadIdx.x + j * blockDim.x);
      if (p < packs) {
        float w[kWidth];
        LoadFloats<kWidth>(weight + p * kWidth, w);
#pragma unroll
        for (int e = 0; e < kWidth; ++e) {
          const float xhat = ToFloat(xs[j].v[e]) * r, dy = ToFloat(dys[j].v[e]);
          dot += dy * w[e] * xhat;
          acc[j][e] += dy * xhat;
        }
      }
    }
    const float mean_dot = BlockSum(dot, scratch) * inv_cols;
#pragma unroll
    for (int j = 0; j < kPacks; ++j) {
      const int p = static_cast<int>(threadIdx.x + j * blockDim.x);
      if (p < packs) {
        float w[kWidth], dx[kWidth];
        LoadFloats<kWidth>(weight + p * kWidth, w);
#pragma unroll
        for (int e = 0; e < kWidth; ++e) {
          const float xhat = ToFloat(xs[j].v[e]) * r;
          const float g = ToFloat(dys[j].v[e]) * w[e];
          dx[e] = r * (g - xhat * mean_dot);
          if (grad_h != nullptr) dx[e] += ToFloat(dhs[j].v[e]);
        }
        StoreFloats<kWidth>(grad_x + base + p * kWidth, dx);
      }
    }
  }
  if (partials != nullptr) {
    float* mine = partials + blockIdx.x * static_cast<int64_t>(cols);
#pragma unroll
    for (int j = 0; j < kPacks; ++j) {
      const int p = static_cast<int>(threadIdx.x + j * blockDim.x);
      if (p < packs) StoreFloats<kWidth>(mine + p * kWidth, acc[j]);
    }
  }
}

// Rows too long for registers: the partial row accumulated in place in global memory (each
// thread its own columns), the row read again after the reduction.
template <typename T, typename W, int kWidth>
__global__ void __launch_bounds__(kLongRowThreads)
    RmsNormBackwardLongRowKernel(const T* __restrict__ v, const float* __restrict__ rstd,
                                 const W* __restrict__ weight, const T* __restrict__ grad_y,
                                 const T* __restrict__ grad_h, T* __restrict__ grad_x,
                                 float* __restrict__ partials, int64_t rows, int64_t cols) {
  using P = Pack<T, kWidth>;
  __shared__ float scratch[32];
  const int64_t packs = cols / kWidth;
  const float inv_cols = 1.0f / static_cast<float>(cols);
  float* acc = partials == nullptr ? nullptr : partials + blockIdx.x * cols;
  if (acc != nullptr) {
    float zeros[kWidth];
#pragma unroll
    for (int e = 0; e < kWidth; ++e) zeros[e] = 0.0f;
    for (int64_t p = threadIdx.x; p < packs; p += blockDim.x) {
      StoreFloats<kWidth>(acc + p * kWidth, zeros);
    }
  }
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t base = row * cols;
    const float r = rstd[row];
    float dot = 0.0f;
    for (int64_t p = threadIdx.x; p < packs; p += blockDim.x) {
      const P xs = LoadPack<kWidth>(v + base + p * kWidth);
      const P dys = LoadPack<kWidth>(grad_y + base + p * kWidth);
      float w[kWidth], a[kWidth] = {};
      LoadFloats<kWidth>(weight + p * kWidth, w);
      if (acc != nullptr) LoadFloats<kWidth>(acc + p * kWidth, a);
#pragma unroll
      for (int e = 0; e < kWidth; ++e) {
        const float xhat = ToFloat(xs.v[e]) * r, dy = ToFloat(dys.v[e]);
        dot += dy * w[e] * xhat;
        a[e] += dy * xhat;  // only this thread touches these columns
      }
      if (acc != nullptr) StoreFloats<kWidth>(acc + p * kWidth, a);
    }
    const float mean_dot = BlockSum(dot, scratch) * inv_cols;
    for (int64_t p = threadIdx.x; p < packs; p += blockDim.x) {
      const P xs = LoadPack<kWidth>(v + base + p * kWidth);
      const P dys = LoadPack<kWidth>(grad_y + base + p * kWidth);
      float w[kWidth], dx[kWidth], dh[kWidth] = {};
      LoadFloats<kWidth>(weight + p * kWidth, w);
      if (grad_h != nullptr) LoadFloats<kWidth>(grad_h + base + p * kWidth, dh);
#pragma unroll
      for (int e = 0; e < kWidth; ++e) {
        const float xhat = ToFloat(xs.v[e]) * r;
        const float g = ToFloat(dys.v[e]) * w[e];
        dx[e] = r * (g - xhat * mean_dot);
        if (grad_h != nullptr) dx[e] += dh[e];
      }
      StoreFloats<kWidth>(grad_x + base + p * kWidth, dx);
    }
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

// The vector width for T when every operand allows 16-byte packs (Note [Vector accesses]):
// all rows start 16-byte aligned (aligned bases, cols a multiple of the width); else 1.
template <typename T>
int PackWidth(int64_t cols, std::initializer_list<const void*> operands) {
  constexpr int kVector = Vec16<T>::kSize;
  if (cols % kVector != 0) return 1;
  for (const void* p : operands) {
    if (!AlignedTo(p, 16)) return 1;
  }
  return kVector;
}

template <typename T, typename W, int kWidth>
LaunchStatus LaunchForwardWidth(const void* x, const void* residual, const void* weight, void* h,
                                void* y, float* rstd, int64_t rows, int64_t cols, float eps,
                                cudaStream_t stream) {
  constexpr int kPacks = CachedPacks<kWidth>();
  const int64_t packs = cols / kWidth;
  const int blocks = static_cast<int>(rows < kMaxForwardBlocks ? rows : kMaxForwardBlocks);
  if (packs <= int64_t{kCachedThreads} * kPacks) {
    RmsNormForwardKernel<T, W, kWidth, kPacks><<<blocks, CachedThreads(packs, kPacks), 0, stream>>>(
        static_cast<const T*>(x), static_cast<const T*>(residual), static_cast<const W*>(weight),
        static_cast<T*>(h), static_cast<T*>(y), rstd, rows, static_cast<int>(cols), eps);
  } else {
    RmsNormForwardLongRowKernel<T, W, kWidth><<<blocks, LongRowThreads(packs), 0, stream>>>(
        static_cast<const T*>(x), static_cast<const T*>(residual), static_cast<const W*>(weight),
        static_cast<T*>(h), static_cast<T*>(y), rstd, rows, cols, eps);
  }
  return LastLaunchStatus();
}

template <typename T, typename W>
LaunchStatus LaunchForward(const void* x, const void* residual, const void* weight, void* h,
                           void* y, float* rstd, int64_t rows, int64_t cols, float eps,
                           cudaStream_t stream) {
  if (PackWidth<T>(cols, {x, residual, weight, h, y}) > 1) {
    return LaunchForwardWidth<T, W, Vec16<T>::kSize>(x, residual, weight, h, y, rstd, rows, cols,
                                                     eps, stream);
  }
  return LaunchForwardWidth<T, W, 1>(x, residual, weight, h, y, rstd, rows, cols, eps, stream);
}

template <typename T, typename W, int kWidth>
LaunchStatus LaunchBackwardWidth(const void* v, const float* rstd, const void* weight,
                                 const void* grad_y, const void* grad_h, void* grad_x,
                                 float* partials, int64_t rows, int64_t cols,
                                 cudaStream_t stream) {
  constexpr int kPacks = CachedPacks<kWidth>();
  const int64_t packs = cols / kWidth;
  const int blocks = static_cast<int>(RmsNormBackwardPartials(rows, cols));
  if (packs <= int64_t{kCachedThreads} * kPacks) {
    RmsNormBackwardKernel<T, W, kWidth, kPacks>
        <<<blocks, CachedThreads(packs, kPacks), 0, stream>>>(
            static_cast<const T*>(v), rstd, static_cast<const W*>(weight),
            static_cast<const T*>(grad_y), static_cast<const T*>(grad_h), static_cast<T*>(grad_x),
            partials, rows, static_cast<int>(cols));
  } else {
    RmsNormBackwardLongRowKernel<T, W, kWidth><<<blocks, LongRowThreads(packs), 0, stream>>>(
        static_cast<const T*>(v), rstd, static_cast<const W*>(weight),
        static_cast<const T*>(grad_y), static_cast<const T*>(grad_h), static_cast<T*>(grad_x),
        partials, rows, cols);
  }
  return LastLaunchStatus();
}

template <typename T, typename W>
LaunchStatus LaunchBackward(const void* v, const float* rstd, const void* weight,
                            const void* grad_y, const void* grad_h, void* grad_x, void* grad_weight,
                            float* partials, int64_t rows, int64_t cols, cudaStream_t stream) {
  const bool want_weight = grad_weight != nullptr;
  float* acc = want_weight ? partials : nullptr;
  LaunchStatus status =
      PackWidth<T>(cols, {v, weight, grad_y, grad_h, grad_x, acc}) > 1
          ? LaunchBackwardWidth<T, W, Vec16<T>::kSize>(v, rstd, weight, grad_y, grad_h, grad_x,
                                                       acc, rows, cols, stream)
          : LaunchBackwardWidth<T, W, 1>(v, rstd, weight, grad_y, grad_h, grad_x, acc, rows, cols,
                                         stream);
  if (status != 0 || !want_weight) return status;
  ColumnSumKernel<W><<<static_cast<unsigned>((cols + 31) / 32), dim3(32, 32), 0, stream>>>(
      partials, RmsNormBackwardPartials(rows, cols), cols, static_cast<W*>(grad_weight));
  return LastLaunchStatus();
}

}  // namespace

int64_t RmsNormBackwardPartials(int64_t rows, int64_t /*cols*/) {
  int64_t blocks = (rows + kMinRowsPerBlock - 1) / kMinRowsPerBlock;
  if (blocks > kMaxBackwardBlocks) blocks = kMaxBackwardBlocks;
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
