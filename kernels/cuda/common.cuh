// Shared by the CUDA kernels (kernels/cuda/*.cu): dtype codes, loads and stores in fp32, launch
// checks, warp and block reductions. No torch headers here (nvcc compiles these files alone).
#pragma once

#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "kernels/cuda/types.h"

namespace fsdp::kernels::cuda {

inline cudaStream_t AsCudaStream(Stream s) { return static_cast<cudaStream_t>(s); }

// A launcher's result: the launch's error (cudaGetLastError after it), as LaunchStatus.
inline LaunchStatus LastLaunchStatus() { return static_cast<LaunchStatus>(cudaGetLastError()); }

__device__ __forceinline__ float ToFloat(float x) { return x; }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float ToFloat(__half x) { return __half2float(x); }

template <typename T>
__device__ __forceinline__ T FromFloat(float x);
template <>
__device__ __forceinline__ float FromFloat<float>(float x) { return x; }
template <>
__device__ __forceinline__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float x) {
  return __float2bfloat16(x);  // round to nearest even, as ATen's casts
}
template <>
__device__ __forceinline__ __half FromFloat<__half>(float x) { return __float2half(x); }

__device__ __forceinline__ float WarpSum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

__device__ __forceinline__ float WarpMax(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
// `scratch` holds 32 floats of shared memory.
__device__ __forceinline__ float BlockSum(float v, float* scratch) {
  int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  v = WarpSum(v);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < warps ? scratch[lane] : 0.0f;
  return WarpSum(v);
}

__device__ __forceinline__ float BlockMax(float v, float* scratch) {
  int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  v = WarpMax(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < warps ? scratch[lane] : -INFINITY;
  return WarpMax(v);
}

// Instantiates `body` with T the C++ type of `dtype` (float, __nv_bfloat16, __half).
#define FSDP_KERNELS_DISPATCH(dtype, T, ...)                            \
  [&]() -> LaunchStatus {                                                \
    switch (dtype) {                                                    \
      case ::fsdp::kernels::cuda::DType::kFloat: {                      \
        using T = float;                                                \
        return __VA_ARGS__();                                           \
      }                                                                 \
      case ::fsdp::kernels::cuda::DType::kBFloat16: {                   \
        using T = __nv_bfloat16;                                        \
        return __VA_ARGS__();                                           \
      }                                                                 \
      case ::fsdp::kernels::cuda::DType::kHalf: {                       \
        using T = __half;                                               \
        return __VA_ARGS__();                                           \
      }                                                                 \
    }                                                                   \
    return static_cast<LaunchStatus>(cudaErrorInvalidValue);                                       \
  }()

}  // namespace fsdp::kernels::cuda
