#include "kernels/cuda/cast.h"

#include <type_traits>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/multi_tensor.cuh"

namespace fsdp::kernels::cuda {
namespace {

// Note [Multi-tensor cast]
// One launch casts up to kCastTableSize pairs, a block per kChunk elements of a pair (See Note
// [Multi-tensor launches]); a thread of a vectorized pair moves whole packs, all its loads
// first, then its stores; the last chunk's tail, and any other pair, runs element by element.
// A pack is 32 bytes of the narrower dtype (16 elements with a bf16/fp16 side, 8 fp32 to fp32),
// moved in 16-byte accesses, bf16/fp16 ones as four 32-bit words of two elements each. nvcc
// 13.0 split other forms into 2- and 4-byte stores (the first 16-byte store at a thread's
// address when it was a lone one, or built from bf16/fp16 elements); these compile to one
// 128-bit load or store each (LDG/STG.E.128 in the sm_90 SASS, checked with cuobjdump).
// The values are those of ATen's copy_ on the GPU: every conversion there is c10's device one
// (float(x) of a bf16/fp16 is exact; BFloat16(float) and Half(float) round to nearest even,
// keep denormals, overflow to inf and return the conversion instruction's NaN), and a pair of
// one dtype keeps its bits (ATen copies them with cudaMemcpyAsync). Through fp32 is exact for
// bf16 <-> fp16 too: the only rounding is the last one, as in ATen's static_cast.

constexpr int kThreads = 256;
constexpr int64_t kChunk = 8192;  // elements per block: 2 packs of 16 (4 of 8) per thread

using Table = MultiTensorTable<void, kCastTableSize>;

// c10::BFloat16(float) as ATen's device code computes it: __float2bfloat16 (cvt.rn.bf16.f32)
// from sm_80 on; c10's round_to_nearest_even before (its NaN is 0x7FC0, the instruction's and
// __float2bfloat16's software path's 0x7FFF). The CPU emulator (no __CUDA_ARCH__) stands for
// sm_90: the CUDA headers' host __float2bfloat16, the instruction's values.
__device__ __forceinline__ __nv_bfloat16 AtenBFloat16(float x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  if (x != x) return __ushort_as_bfloat16(0x7FC0);
  const unsigned u = __float_as_uint(x);
  return __ushort_as_bfloat16(static_cast<unsigned short>((u + ((u >> 16) & 1u) + 0x7FFFu) >> 16));
#else
  return __float2bfloat16(x);
#endif
}

// c10's device conversions from fp32 (Half(float) is __float2half on every architecture).
template <typename D>
__device__ __forceinline__ D AtenFromFloat(float x);
template <>
__device__ __forceinline__ float AtenFromFloat<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __nv_bfloat16 AtenFromFloat<__nv_bfloat16>(float x) {
  return AtenBFloat16(x);
}
template <>
__device__ __forceinline__ __half AtenFromFloat<__half>(float x) {
  return __float2half(x);
}

template <typename D, typename S>
__device__ __forceinline__ D Convert(S x) {
  if constexpr (std::is_same<D, S>::value) {
    return x;  // the bits as they are
  } else {
    return AtenFromFloat<D>(ToFloat(x));
  }
}

// A bf16/fp16 element from or to the low 16 bits of a word.
template <typename T>
__device__ __forceinline__ T FromBits16(uint32_t bits);
template <>
__device__ __forceinline__ __half FromBits16<__half>(uint32_t bits) {
  __half_raw r;
  r.x = static_cast<unsigned short>(bits);
  return __half(r);
}
template <>
__device__ __forceinline__ __nv_bfloat16 FromBits16<__nv_bfloat16>(uint32_t bits) {
  __nv_bfloat16_raw r;
  r.x = static_cast<unsigned short>(bits);
  return __nv_bfloat16(r);
}
__device__ __forceinline__ uint32_t Bits16(__half x) { return static_cast<__half_raw>(x).x; }
__device__ __forceinline__ uint32_t Bits16(__nv_bfloat16 x) {
  return static_cast<__nv_bfloat16_raw>(x).x;
}

// kWidth consecutive elements at p (16-byte aligned) in 16-byte accesses.
template <int kWidth, typename T>
__device__ __forceinline__ void LoadElements(const T* p, T (&out)[kWidth]) {
  if constexpr (sizeof(T) == 2) {
#pragma unroll
    for (int i = 0; i < kWidth / 8; ++i) {
      const Pack<uint32_t, 4> w = LoadPack<4>(reinterpret_cast<const uint32_t*>(p + i * 8));
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        out[i * 8 + 2 * j] = FromBits16<T>(w.v[j] & 0xffffu);
        out[i * 8 + 2 * j + 1] = FromBits16<T>(w.v[j] >> 16);
      }
    }
  } else {
#pragma unroll
    for (int i = 0; i < kWidth / 4; ++i) {
      const Pack<T, 4> c = LoadPack<4>(p + i * 4);
#pragma unroll
      for (int e = 0; e < 4; ++e) out[i * 4 + e] = c.v[e];
    }
  }
}

// in[] converted to D, stored as kWidth consecutive elements at p (16-byte aligned) in 16-byte
// accesses.
template <int kWidth, typename D, typename S>
__device__ __forceinline__ void StoreConverted(D* p, const S (&in)[kWidth]) {
  if constexpr (sizeof(D) == 2) {
#pragma unroll
    for (int i = 0; i < kWidth / 8; ++i) {
      Pack<uint32_t, 4> w;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        w.v[j] = Bits16(Convert<D>(in[i * 8 + 2 * j])) |
                 (Bits16(Convert<D>(in[i * 8 + 2 * j + 1])) << 16);
      }
      StorePack<4>(reinterpret_cast<uint32_t*>(p + i * 8), w);
    }
  } else {
#pragma unroll
    for (int i = 0; i < kWidth / 4; ++i) {
      Pack<D, 4> c;
#pragma unroll
      for (int e = 0; e < 4; ++e) c.v[e] = Convert<D>(in[i * 4 + e]);
      StorePack<4>(p + i * 4, c);
    }
  }
}

// Elements per pack: 32 bytes of the narrower of the two dtypes.
template <typename D, typename S>
constexpr int kWidthOf = 32 / (sizeof(D) < sizeof(S) ? sizeof(D) : sizeof(S));

template <typename D, typename S>
__global__ void __launch_bounds__(kThreads) CastKernel(Table table) {
  const MultiTensorChunk chunk = FindChunk<kChunk>(table, blockIdx.x);
  const int64_t n = chunk.numel;
  D* dst = static_cast<D*>(table.dst[chunk.pair]) + chunk.begin;
  const S* src = static_cast<const S*>(table.src[chunk.pair]) + chunk.begin;
  int64_t done = 0;
  if (table.vectorized[chunk.pair]) {
    constexpr int kWidth = kWidthOf<D, S>;
    constexpr int kPacks = kChunk / (kThreads * kWidth);
    const int64_t packs = n / kWidth;
    S in[kPacks][kWidth];
#pragma unroll
    for (int k = 0; k < kPacks; ++k) {
      const int64_t p = threadIdx.x + int64_t{k} * kThreads;
      if (p < packs) LoadElements<kWidth>(src + p * kWidth, in[k]);
    }
#pragma unroll
    for (int k = 0; k < kPacks; ++k) {
      const int64_t p = threadIdx.x + int64_t{k} * kThreads;
      if (p < packs) StoreConverted<kWidth>(dst + p * kWidth, in[k]);
    }
    done = packs * kWidth;
  }
  for (int64_t i = done + threadIdx.x; i < n; i += kThreads) dst[i] = Convert<D>(src[i]);
}

template <typename D, typename S>
LaunchStatus Launch(const CastPair* pairs, int64_t count, cudaStream_t stream) {
  return LaunchInTables<kChunk, Table>(pairs, count, [&](const Table& table, dim3 grid) {
    CastKernel<D, S><<<grid, kThreads, 0, stream>>>(table);
    return LastLaunchStatus();
  });
}

}  // namespace

LaunchStatus CastInto(const CastPair* pairs, int64_t count, DType dst_dtype, DType src_dtype,
                      Stream stream) {
  if (count == 0) return 0;
  return FSDP_KERNELS_DISPATCH(dst_dtype, D, [&] {
    return FSDP_KERNELS_DISPATCH(src_dtype, S,
                                 [&] { return Launch<D, S>(pairs, count, AsCudaStream(stream)); });
  });
}

}  // namespace fsdp::kernels::cuda
