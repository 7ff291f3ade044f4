#include "kernels/cuda/accumulate.h"

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/multi_tensor.cuh"

namespace fsdp::kernels::cuda {
namespace {

// Note [Multi-tensor accumulation]
// One launch adds up to kAccumulateTableSize pairs, a block per kChunk elements of a pair (See
// Note [Multi-tensor launches]). Within its chunk a thread of a vectorized pair reads kPacks
// 16-byte packs of src (8 bf16/fp16, 4 floats) and the matching floats of dst first, then adds
// and stores them: all its loads in flight at once; the last chunk's tail, and any other pair,
// runs element by element. The sum is a + float(b) in fp32, rounded once: what at::add_
// computes for an fp32 tensor and a bf16/fp16/fp32 one (alpha 1).

constexpr int kThreads = 256;
constexpr int64_t kChunk = 8192;  // elements per block: 4 packs of 8, or 8 of 4, per thread

using Table = MultiTensorTable<float, kAccumulateTableSize>;

template <typename T>
__global__ void __launch_bounds__(kThreads) AccumulateKernel(Table table) {
  const MultiTensorChunk chunk = FindChunk<kChunk>(table, blockIdx.x);
  const int64_t n = chunk.numel;
  float* dst = table.dst[chunk.pair] + chunk.begin;
  const T* src = static_cast<const T*>(table.src[chunk.pair]) + chunk.begin;
  int64_t done = 0;
  if (table.vectorized[chunk.pair]) {
    constexpr int kWidth = Vec16<T>::kSize;
    constexpr int kPacks = kChunk / (kThreads * kWidth);
    const int64_t packs = n / kWidth;
    float a[kPacks][kWidth], b[kPacks][kWidth];
#pragma unroll
    for (int k = 0; k < kPacks; ++k) {
      const int64_t p = threadIdx.x + int64_t{k} * kThreads;
      if (p < packs) {
        LoadFloats<kWidth>(dst + p * kWidth, a[k]);
        LoadFloats<kWidth>(src + p * kWidth, b[k]);
      }
    }
#pragma unroll
    for (int k = 0; k < kPacks; ++k) {
      const int64_t p = threadIdx.x + int64_t{k} * kThreads;
      if (p < packs) {
#pragma unroll
        for (int e = 0; e < kWidth; ++e) a[k][e] = __fadd_rn(a[k][e], b[k][e]);
        StoreFloats<kWidth>(dst + p * kWidth, a[k]);
      }
    }
    done = packs * kWidth;
  }
  for (int64_t i = done + threadIdx.x; i < n; i += kThreads) {
    dst[i] = __fadd_rn(dst[i], ToFloat(src[i]));
  }
}

template <typename T>
LaunchStatus Launch(const AccumulatePair* pairs, int64_t count, cudaStream_t stream) {
  return LaunchInTables<kChunk, Table>(pairs, count, [&](const Table& table, dim3 grid) {
    AccumulateKernel<T><<<grid, kThreads, 0, stream>>>(table);
    return LastLaunchStatus();
  });
}

}  // namespace

LaunchStatus AccumulateInto(const AccumulatePair* pairs, int64_t count, DType src_dtype,
                            Stream stream) {
  if (count == 0) return 0;
  return FSDP_KERNELS_DISPATCH(src_dtype, T,
                               [&] { return Launch<T>(pairs, count, AsCudaStream(stream)); });
}

}  // namespace fsdp::kernels::cuda
