#include "kernels/cuda/accumulate.h"

#include "kernels/cuda/common.cuh"

namespace fsdp::kernels::cuda {
namespace {

// Note [Multi-tensor accumulation]
// One launch adds up to kAccumulateTableSize pairs. Each pair is cut into chunks of kChunk
// elements, one block per chunk; the pairs' pointers, sizes and first blocks travel in the
// kernel's arguments (a Table, under the 4 KiB a launch's parameters may take), and a block
// finds its pair by binary search over the first blocks (at most 6 steps). Within its chunk a
// thread reads kPacks 16-byte packs of src (8 bf16/fp16, 4 floats) and the matching floats of
// dst first, then adds and stores them: all its loads in flight at once. A pair whose dst and
// src both start 16-byte aligned takes the packs (chunks start at multiples of kChunk, so every
// pack stays aligned) and finishes its last chunk's tail element by element; any other pair
// runs element by element (See Note [Vector accesses]). Pairs of zero elements get no block.
// The sum is a + float(b) in fp32, rounded once: what at::add_ computes for an fp32 tensor and
// a bf16/fp16/fp32 one (alpha 1).

constexpr int kThreads = 256;
constexpr int64_t kChunk = 8192;  // elements per block: 4 packs of 8, or 8 of 4, per thread
constexpr int64_t kMaxBlocks = 2147483647;  // gridDim.x

struct Table {
  float* dst[kAccumulateTableSize];
  const void* src[kAccumulateTableSize];
  int64_t numel[kAccumulateTableSize];
  int64_t first_block[kAccumulateTableSize];
  bool vectorized[kAccumulateTableSize];
  int count;
};
static_assert(sizeof(Table) <= 4096, "kernel parameters are limited to 4 KiB");

template <typename T>
__global__ void __launch_bounds__(kThreads) AccumulateKernel(Table table) {
  const int64_t block = blockIdx.x;
  int lo = 0, hi = table.count - 1;  // the last pair whose first block is <= this one
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (table.first_block[mid] <= block) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  const int64_t begin = (block - table.first_block[lo]) * kChunk;
  const int64_t rest = table.numel[lo] - begin;
  const int64_t n = rest < kChunk ? rest : kChunk;
  float* dst = table.dst[lo] + begin;
  const T* src = static_cast<const T*>(table.src[lo]) + begin;
  int64_t done = 0;
  if (table.vectorized[lo]) {
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
  Table table;
  table.count = 0;
  int64_t blocks = 0;
  auto flush = [&]() -> LaunchStatus {
    if (table.count == 0) return 0;
    AccumulateKernel<T><<<dim3(static_cast<unsigned>(blocks)), kThreads, 0, stream>>>(table);
    table.count = 0;
    blocks = 0;
    return LastLaunchStatus();
  };
  for (int64_t i = 0; i < count; ++i) {
    const AccumulatePair& pair = pairs[i];
    if (pair.numel == 0) continue;
    const int64_t need = (pair.numel + kChunk - 1) / kChunk;
    if (need > kMaxBlocks) return static_cast<LaunchStatus>(cudaErrorInvalidValue);
    if (table.count == kAccumulateTableSize || blocks + need > kMaxBlocks) {
      if (LaunchStatus status = flush(); status != 0) return status;
    }
    const int c = table.count++;
    table.dst[c] = pair.dst;
    table.src[c] = pair.src;
    table.numel[c] = pair.numel;
    table.first_block[c] = blocks;
    table.vectorized[c] = AlignedTo(pair.dst, 16) && AlignedTo(pair.src, 16);
    blocks += need;
  }
  return flush();
}

}  // namespace

LaunchStatus AccumulateInto(const AccumulatePair* pairs, int64_t count, DType src_dtype,
                            Stream stream) {
  if (count == 0) return 0;
  return FSDP_KERNELS_DISPATCH(src_dtype, T,
                               [&] { return Launch<T>(pairs, count, AsCudaStream(stream)); });
}

}  // namespace fsdp::kernels::cuda
