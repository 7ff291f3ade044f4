// Shared by the multi-tensor kernels' tests (tests/kernels_accumulate_test.cc,
// tests/kernels_cast_test.cc and their emulated twins in tests/cuda_emulation/): lists of
// pairs, operands placed off a 16-byte boundary, copies, version counters, bitwise comparison.
//
//   Pairs p;
//   p.dsts.push_back(Place(at::zeros({n}), 1));  // one element in: the kernel's element path
//   p.srcs.push_back(at::randn({n}).to(at::kBFloat16));
//   std::vector<at::Tensor> actual = Clones(p.dsts);
//   const std::vector<int64_t> versions = Versions(actual);
//   AccumulateInto(actual, p.srcs);  // then BitwiseEqual(actual[i], expected[i]), versions grew
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/ATen.h>

namespace fsdp::kernels::testing {

// A call's operands: (dsts[i], srcs[i]) is pair i.
struct Pairs {
  std::vector<at::Tensor> dsts, srcs;
};

// `fill` (its shape and values) copied into a fresh buffer at element `offset` (1: off every
// 16-byte boundary, as fp32/bf16/fp16 elements are narrower than 16 bytes).
inline at::Tensor Place(const at::Tensor& fill, int64_t offset) {
  at::Tensor buffer = at::empty({fill.numel() + offset}, fill.options());
  return buffer.narrow(0, offset, fill.numel()).view(fill.sizes()).copy_(fill);
}

inline std::vector<at::Tensor> Clones(const std::vector<at::Tensor>& ts) {
  std::vector<at::Tensor> out;
  for (const at::Tensor& t : ts) out.push_back(t.clone());
  return out;
}

// Each tensor's version counter, to check that a call modified it in place.
inline std::vector<int64_t> Versions(const std::vector<at::Tensor>& ts) {
  std::vector<int64_t> out;
  for (const at::Tensor& t : ts) out.push_back(t._version());
  return out;
}

// The integer type of a dtype's width, to compare and build bit patterns.
inline at::ScalarType Bits(at::ScalarType t) {
  return t == at::kFloat ? at::kInt : t == at::kDouble ? at::kLong : at::kShort;
}

// One dtype, one shape, the same bits (NaNs included).
inline bool BitwiseEqual(const at::Tensor& a, const at::Tensor& b) {
  return a.scalar_type() == b.scalar_type() && a.sizes() == b.sizes() &&
         at::equal(a.contiguous().view(Bits(a.scalar_type())),
                   b.contiguous().view(Bits(b.scalar_type())));
}

}  // namespace fsdp::kernels::testing
