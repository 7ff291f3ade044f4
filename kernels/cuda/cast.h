// Multi-tensor cast launcher (kernels/cuda/cast.cu): dst_i = src_i converted, for a list of
// pairs that all have one (dst dtype, src dtype), each a contiguous run of `numel` elements,
// in one launch per kCastTableSize pairs. Bit for bit ATen's copy_ on a GPU: each element
// through fp32 (exact), rounded once to the dst dtype by c10's device conversion; a pair of one
// dtype is copied as is (NaN payloads too).
#pragma once

#include <cstdint>

#include "kernels/cuda/types.h"

namespace fsdp::kernels::cuda {

struct CastPair {
  void* dst;        // `dst_dtype` elements
  const void* src;  // `src_dtype` elements
  int64_t numel;
};

// Pairs per launch: their pointers and sizes travel in the kernel's arguments.
constexpr int kCastTableSize = 48;

// No two pairs may share or overlap a dst, and no src may overlap a dst.
LaunchStatus CastInto(const CastPair* pairs, int64_t count, DType dst_dtype, DType src_dtype,
                      Stream stream);

}  // namespace fsdp::kernels::cuda
