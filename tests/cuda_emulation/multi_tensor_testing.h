// Shared by the emulated multi-tensor kernels' tests (accumulate_emulated_test.cc,
// cast_emulated_test.cc), beside tests/multi_tensor_testing.h: the launchers' dtype codes, the
// pair sizes that take several launches, the emulator's schedules.
//
//   for (fsdp_emu::Schedule s : Schedules(/*every=*/true)) {
//     fsdp_emu::SetSchedule(s);
//     emulated::AccumulateInto(pairs.data(), pairs.size(), EmulatedDType(at::kBFloat16), nullptr);
//   }
//   fsdp_emu::SetSchedule(fsdp_emu::Schedule::kForward);
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "emulated/kernels/cuda/types.h"
#include "tests/cuda_emulation/emulator.h"
#include "tests/multi_tensor_testing.h"

namespace fsdp::kernels::testing {

// The emulated launchers' code for an fp32, bf16 or fp16 dtype (a test failure otherwise).
inline kernels_emulated::cuda::DType EmulatedDType(at::ScalarType t) {
  using kernels_emulated::cuda::DType;
  switch (t) {
    case at::kFloat:
      return DType::kFloat;
    case at::kBFloat16:
      return DType::kBFloat16;
    case at::kHalf:
      return DType::kHalf;
    default:
      break;
  }
  ADD_FAILURE() << "no kernel dtype for " << t;
  return DType::kFloat;
}

// 100 pair sizes: three launches of the 48-pair table, zero-size pairs among them.
inline std::vector<int64_t> ManySizes() {
  std::vector<int64_t> sizes;
  for (int64_t i = 0; i < 100; ++i) sizes.push_back(i % 10 == 9 ? 0 : 1 + 37 * i % 301);
  sizes[50] = 8192 * 2 + 5;  // three chunks in the middle of the second table
  return sizes;
}

// The emulator's thread schedules: kForward alone, or all four.
inline std::vector<fsdp_emu::Schedule> Schedules(bool every) {
  if (!every) return {fsdp_emu::Schedule::kForward};
  return {fsdp_emu::Schedule::kForward, fsdp_emu::Schedule::kReverse, fsdp_emu::Schedule::kShuffled,
          fsdp_emu::Schedule::kWarpByWarp};
}

}  // namespace fsdp::kernels::testing
