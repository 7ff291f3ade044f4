// Multi-tensor accumulation launcher (kernels/cuda/accumulate.cu): dst_i += src_i for a list
// of (fp32 dst, src) pairs, each a contiguous run of `numel` elements, all sources of one
// dtype, in one launch per kAccumulateTableSize pairs. fp32 arithmetic, one rounding:
// dst + float(src), bit for bit at::add_.
#pragma once

#include <cstdint>

#include "kernels/cuda/types.h"

namespace fsdp::kernels::cuda {

struct AccumulatePair {
  float* dst;
  const void* src;  // `dtype` elements
  int64_t numel;
};

// Pairs per launch: their pointers and sizes travel in the kernel's arguments.
constexpr int kAccumulateTableSize = 48;

// No two pairs may share or overlap a dst, and no src may overlap a dst.
LaunchStatus AccumulateInto(const AccumulatePair* pairs, int64_t count, DType src_dtype,
                            Stream stream);

}  // namespace fsdp::kernels::cuda
