// Loops over host memory on threads of fsdp.cpp's own, for offload's host work (Note [Host
// loops] in host_loops.cc): a pool made once, and the bf16 / fp16 gradient's conversion and
// addition into an fp32 buffer as one loop.
//
//   HostParallelFor(n, /*min_part=*/1 << 16, [&](int64_t begin, int64_t end) { ... });
//   if (HostAddConvertedAvailable(HostNarrow::kBFloat16)) {
//     HostAddConverted(dst_fp32, src_bf16, HostNarrow::kBFloat16, n);  // dst += float(src)
//   }
#pragma once

#include <bit>
#include <cstdint>
#include <functional>

namespace at {
class Tensor;
}  // namespace at

namespace fsdp {

// Threads that run HostParallelFor's parts: the pool's and the calling thread. By default
// at::get_num_threads() at first use (FSDP_OFFLOAD_HOST_THREADS sets it for offload: Note [Host
// loops]).
int HostLoopThreads();
// Makes later calls use `threads` threads (>= 1; the pool grows when it has fewer); returns
// the number used before. For measuring (fsdp bench host) and the knob; not while a call runs.
int SetHostLoopThreads(int threads);

// fn(begin, end) over [0, n) in parts of at least `min_part` elements (a multiple of 16 that
// parts begin at), claimed one at a time by the pool's threads and the caller, so that a thread
// slowed by another process or by the training thread leaves its parts to the others. Returns
// when every part is done; one call at a time runs on the pool (a second caller waits).
void HostParallelFor(int64_t n, int64_t min_part, const std::function<void(int64_t, int64_t)>& fn);

enum class HostNarrow { kBFloat16, kHalf };

// Whether HostAddConverted runs here: an x86-64 CPU with AVX2 (and F16C for fp16).
bool HostAddConvertedAvailable(HostNarrow type);

// dst[i] += float(src[i]) for i in [0, n), each sum rounded once: bit for bit what
// dst.add_(src.to(at::kFloat)) gives, in one pass over 10 bytes per element (ATen's copy and
// add_ move 18, and its mixed-dtype add_ is not vectorised), on HostParallelFor's threads.
// Requires HostAddConvertedAvailable(type).
void HostAddConverted(float* dst, const uint16_t* src, HostNarrow type, int64_t n);

// The same sum with ATen's ops, for where the loop does not run (no AVX2, FSDP_OFFLOAD_HOST_PASS
// =off): dst (fp32) += src (bf16 / fp16, same numel), converted a chunk of scratch.numel()
// elements at a time into `scratch` (fp32) and added.
void AddConvertedInChunks(const at::Tensor& dst, const at::Tensor& src, const at::Tensor& scratch);

// A bf16 value's bits as the float it is (exact).
[[gnu::always_inline]] inline float Bf16ToFloat(uint16_t h) {
  return std::bit_cast<float>(static_cast<uint32_t>(h) << 16);
}

}  // namespace fsdp
