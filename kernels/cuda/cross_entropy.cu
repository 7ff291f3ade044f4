#include "kernels/cuda/cross_entropy.h"

#include <climits>
#include <cstdio>

#include "kernels/cuda/common.cuh"

namespace fsdp::kernels::cuda {
namespace {

constexpr int kThreads = 512;

// Vec16 (common.cuh): 16 bytes of logits, 4 floats or 8 bf16/fp16, one load or store.

// Online max / sum of exp over one thread's elements. A -inf element adds nothing (and would
// give inf - inf against a -inf running max); NaN and +inf propagate as in log_softmax.
struct Online {
  float max = -INFINITY, sum = 0.0f;
  __device__ __forceinline__ void Add(float v) {
    if (v > max) {
      sum = sum * expf(max - v) + 1.0f;
      max = v;
    } else if (v != -INFINITY) {
      sum += expf(v - max);
    }
  }
};

__device__ __forceinline__ float Gradient(float v, int64_t j, int64_t target, float lse,
                                          float scale) {
  return (expf(v - lse) - (j == target ? 1.0f : 0.0f)) * scale;
}

// One block per row, grid-stride over rows (so any number of rows on the x axis). Every branch
// that contains a barrier depends only on the row's target, the same for the whole block.
// The row is read twice (the second read mostly from L2, as in llm.c) and, with write_grad,
// overwritten by the second pass: the only other read of the row, the target's logit, happens
// before the barriers inside BlockMax/BlockSum, so no thread reads what another has written.
template <typename T, bool kVector>
__global__ void __launch_bounds__(kThreads)
    SoftmaxCrossEntropyKernel(T* logits, const int64_t* __restrict__ targets,
                              float* __restrict__ losses, const float* __restrict__ grad_scale,
                              int64_t rows, int64_t vocab, int64_t ignore_index, bool write_grad) {
  __shared__ float scratch[32];
  using V = Vec16<T>;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    T* x = logits + row * vocab;
    const int64_t target = targets[row];
    if (target == ignore_index) {
      if (threadIdx.x == 0) losses[row] = 0.0f;
      if (write_grad) {
        for (int64_t j = threadIdx.x; j < vocab; j += blockDim.x) x[j] = FromFloat<T>(0.0f);
      }
      continue;
    }
    if (target < 0 || target >= vocab) {
      // A device-side assert, as ATen's cross_entropy: the kernel stops and the CUDA context
      // reports an error from then on. One thread prints; the others leave (no barrier waits).
      if (threadIdx.x != 0) return;
      printf(
          "fsdp kernel linear_cross_entropy: target %lld of row %lld is out of range for "
          "vocab %lld (valid: 0..%lld, or ignore_index %lld)\n",
          static_cast<long long>(target), static_cast<long long>(row),
          static_cast<long long>(vocab), static_cast<long long>(vocab - 1),
          static_cast<long long>(ignore_index));
      __assert_fail("target in [0, vocab) or ignore_index", __FILE__, __LINE__, __func__);
      __trap();
    }
    const float target_logit = threadIdx.x == 0 ? ToFloat(x[target]) : 0.0f;

    Online acc;
    if constexpr (kVector) {
      const int64_t n = vocab / V::kSize;
      const V* xv = reinterpret_cast<const V*>(x);
      for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
        V packed = xv[i];
#pragma unroll
        for (int e = 0; e < V::kSize; ++e) acc.Add(ToFloat(packed.v[e]));
      }
    } else {
      for (int64_t j = threadIdx.x; j < vocab; j += blockDim.x) acc.Add(ToFloat(x[j]));
    }
    const float row_max = BlockMax(acc.max, scratch);
    const float scaled = acc.max == -INFINITY ? 0.0f : acc.sum * expf(acc.max - row_max);
    const float lse = row_max + logf(BlockSum(scaled, scratch));
    if (threadIdx.x == 0) losses[row] = lse - target_logit;
    if (!write_grad) continue;

    const float scale = *grad_scale;
    if constexpr (kVector) {
      const int64_t n = vocab / V::kSize;
      V* xv = reinterpret_cast<V*>(x);
      for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
        V packed = xv[i];
#pragma unroll
        for (int e = 0; e < V::kSize; ++e) {
          packed.v[e] =
              FromFloat<T>(Gradient(ToFloat(packed.v[e]), i * V::kSize + e, target, lse, scale));
        }
        xv[i] = packed;
      }
    } else {
      for (int64_t j = threadIdx.x; j < vocab; j += blockDim.x) {
        x[j] = FromFloat<T>(Gradient(ToFloat(x[j]), j, target, lse, scale));
      }
    }
  }
}

}  // namespace

LaunchStatus SoftmaxCrossEntropy(void* logits, const int64_t* targets, float* losses,
                                 const float* grad_scale, int64_t rows, int64_t vocab,
                                 int64_t ignore_index, bool write_grad, DType dtype,
                                 Stream stream) {
  if (rows == 0) return 0;
  const int blocks = static_cast<int>(rows < INT_MAX ? rows : INT_MAX);
  return FSDP_KERNELS_DISPATCH(dtype, T, [&] {
    // Vector loads when every row starts on 16 bytes: an aligned base and a row size that is
    // a multiple of 16 bytes.
    const bool vector = reinterpret_cast<uintptr_t>(logits) % 16 == 0 &&
                        (vocab * static_cast<int64_t>(sizeof(T))) % 16 == 0;
    if (vector) {
      SoftmaxCrossEntropyKernel<T, true><<<blocks, kThreads, 0, AsCudaStream(stream)>>>(
          static_cast<T*>(logits), targets, losses, grad_scale, rows, vocab, ignore_index,
          write_grad);
    } else {
      SoftmaxCrossEntropyKernel<T, false><<<blocks, kThreads, 0, AsCudaStream(stream)>>>(
          static_cast<T*>(logits), targets, losses, grad_scale, rows, vocab, ignore_index,
          write_grad);
    }
    return LastLaunchStatus();
  });
}

}  // namespace fsdp::kernels::cuda
