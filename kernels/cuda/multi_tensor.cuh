// The launch structure shared by the multi-tensor kernels (kernels/cuda/accumulate.cu,
// kernels/cuda/cast.cu): a table of (dst, src, numel) pairs in the kernel's arguments, one
// block per chunk of a pair, and the host loop that fills tables and launches each
// (Note [Multi-tensor launches]). What a block does with its chunk is the kernel's own.
//
//   using Table = MultiTensorTable<float, kAccumulateTableSize>;
//   __global__ void Kernel(Table table) {
//     const MultiTensorChunk c = FindChunk<kChunk>(table, blockIdx.x);
//     float* dst = table.dst[c.pair] + c.begin;  // c.numel elements; packs if vectorized[c.pair]
//   }
//   return LaunchInTables<kChunk, Table>(pairs, count, [&](const Table& table, dim3 grid) {
//     Kernel<<<grid, kThreads, 0, stream>>>(table);
//     return LastLaunchStatus();
//   });
#pragma once

#include <cstdint>

#include "kernels/cuda/common.cuh"

namespace fsdp::kernels::cuda {

// Note [Multi-tensor launches]
// One launch covers up to kPairs pairs. Each pair is cut into chunks of kChunk elements, one
// block per chunk; the pairs' pointers, sizes and first blocks travel in the kernel's arguments
// (a MultiTensorTable, under the 4 KiB a launch's parameters may take), and a block finds its
// pair by binary search over the first blocks (at most 6 steps for 48 pairs). A pair whose dst
// and src both start 16-byte aligned is marked `vectorized`: chunks start at multiples of
// kChunk, so the kernel may move whole 16-byte packs from its chunk's start and finish the last
// chunk's tail element by element; any other pair runs element by element (See Note [Vector
// accesses]). Pairs of zero elements get no block. A table is launched when it is full, when
// the next pair's blocks would pass gridDim.x's limit, and after the last pair.

constexpr int64_t kMaxGridBlocks = 2147483647;  // gridDim.x

// One launch's pairs; Dst is the dst element type (void where the kernel's template picks it).
template <typename Dst, int kPairs>
struct MultiTensorTable {
  static constexpr int kSize = kPairs;
  Dst* dst[kPairs];
  const void* src[kPairs];
  int64_t numel[kPairs];
  int64_t first_block[kPairs];
  bool vectorized[kPairs];  // both pointers 16-byte aligned
  int count;
};

// The part of a pair that one block covers.
struct MultiTensorChunk {
  int pair;       // index into the table
  int64_t begin;  // the chunk's first element in the pair
  int64_t numel;  // kChunk, or fewer in the pair's last chunk
};

template <int64_t kChunk, typename Table>
__device__ __forceinline__ MultiTensorChunk FindChunk(const Table& table, int64_t block) {
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
  return {lo, begin, rest < kChunk ? rest : kChunk};
}

// Host side: fills Tables with `pairs` (each with .dst, .src and .numel) in order and calls
// launch(table, grid) for each, grid one block per kChunk elements of its pairs. Returns the
// first launch's error (the pairs after it are not launched), or cudaErrorInvalidValue for a
// pair of more than kMaxGridBlocks chunks.
template <int64_t kChunk, typename Table, typename Pair, typename LaunchTable>
LaunchStatus LaunchInTables(const Pair* pairs, int64_t count, LaunchTable launch) {
  static_assert(sizeof(Table) <= 4096, "kernel parameters are limited to 4 KiB");
  Table table;
  table.count = 0;
  int64_t blocks = 0;
  auto flush = [&]() -> LaunchStatus {
    if (table.count == 0) return 0;
    const LaunchStatus status = launch(table, dim3(static_cast<unsigned>(blocks)));
    table.count = 0;
    blocks = 0;
    return status;
  };
  for (int64_t i = 0; i < count; ++i) {
    const Pair& pair = pairs[i];
    if (pair.numel == 0) continue;
    const int64_t need = (pair.numel + kChunk - 1) / kChunk;
    if (need > kMaxGridBlocks) return static_cast<LaunchStatus>(cudaErrorInvalidValue);
    if (table.count == Table::kSize || blocks + need > kMaxGridBlocks) {
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

}  // namespace fsdp::kernels::cuda
