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

// Note [Vector accesses]
// Bandwidth-bound kernels move 16 bytes per load or store (4 floats, 8 bf16/fp16) where every
// address they touch is 16-byte aligned: the launcher checks the actual data pointers (operands
// may be views into a fused projection at an element offset) and that each row's length and
// stride are multiples of the vector width, and otherwise launches the same kernel with a width
// of 1 (or 2, RoPE's pairs). Pack<T, kWidth> is one such access: kWidth elements, aligned to
// their size. Under the CPU emulator (tests/cuda_emulation) every reinterpret_cast is checked
// for alignment, so a wrong launcher check fails the emulated tests as a GPU would fault.

// 16 bytes: 4 floats or 8 bf16/fp16.
template <typename T>
struct alignas(16) Vec16 {
  static constexpr int kSize = 16 / sizeof(T);
  T v[kSize];
};

// kWidth consecutive elements, loaded or stored as one access (kWidth * sizeof(T) <= 16).
template <typename T, int kWidth>
struct alignas(kWidth * sizeof(T)) Pack {
  static_assert(kWidth * sizeof(T) <= 16, "one access moves at most 16 bytes");
  T v[kWidth];
};

template <int kWidth, typename T>
__device__ __forceinline__ Pack<T, kWidth> LoadPack(const T* p) {
  return *reinterpret_cast<const Pack<T, kWidth>*>(p);
}

template <int kWidth, typename T>
__device__ __forceinline__ void StorePack(T* p, const Pack<T, kWidth>& pack) {
  *reinterpret_cast<Pack<T, kWidth>*>(p) = pack;
}

// kWidth elements at p as floats, in accesses of at most 16 bytes (two for 8 floats); p must
// be aligned to min(kWidth * sizeof(T), 16) bytes.
template <int kWidth, typename T>
__device__ __forceinline__ void LoadFloats(const T* p, float (&out)[kWidth]) {
  constexpr int kChunk = kWidth < Vec16<T>::kSize ? kWidth : Vec16<T>::kSize;
  static_assert(kWidth % kChunk == 0, "whole accesses");
#pragma unroll
  for (int i = 0; i < kWidth / kChunk; ++i) {
    const Pack<T, kChunk> c = LoadPack<kChunk>(p + i * kChunk);
#pragma unroll
    for (int e = 0; e < kChunk; ++e) out[i * kChunk + e] = ToFloat(c.v[e]);
  }
}

// The inverse: each float rounded once to T.
template <int kWidth, typename T>
__device__ __forceinline__ void StoreFloats(T* p, const float (&in)[kWidth]) {
  constexpr int kChunk = kWidth < Vec16<T>::kSize ? kWidth : Vec16<T>::kSize;
  static_assert(kWidth % kChunk == 0, "whole accesses");
#pragma unroll
  for (int i = 0; i < kWidth / kChunk; ++i) {
    Pack<T, kChunk> c;
#pragma unroll
    for (int e = 0; e < kChunk; ++e) c.v[e] = FromFloat<T>(in[i * kChunk + e]);
    StorePack<kChunk>(p + i * kChunk, c);
  }
}

// Host side: whether `p` (nullptr counts as aligned: an absent operand) is on `bytes`.
inline bool AlignedTo(const void* p, uintptr_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

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
