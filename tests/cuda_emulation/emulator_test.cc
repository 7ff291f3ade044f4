// The CPU emulator of CUDA's execution model (emulator.h) on small kernels written here: it
// must compute what a GPU computes for correct kernels and refuse or expose the incorrect ones
// (bad launches, divergent barriers, missing barriers), or the kernel tests built on it prove
// nothing.
#include "tests/cuda_emulation/prelude.h"

#include <numeric>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace {

using fsdp_emu::Schedule;

// Per block: the sum of in[block * n .. + n) through a shared array, a tree with barriers.
void TreeSumKernel(const float* in, float* out, int n) {
  float* partial = static_cast<float*>(fsdp_emu::DynamicShared());
  const int t = static_cast<int>(threadIdx.x);
  partial[t] = t < n ? in[blockIdx.x * n + t] : 0.0f;
  __syncthreads();
  for (int stride = static_cast<int>(blockDim.x) / 2; stride > 0; stride /= 2) {
    if (t < stride) partial[t] += partial[t + stride];
    __syncthreads();
  }
  if (t == 0) out[blockIdx.x] = partial[0];
}

// The same with the barriers left out: each thread reads a neighbour's slot whenever it runs.
void RacyShiftKernel(float* out) {
  float* slot = static_cast<float*>(fsdp_emu::DynamicShared());
  const int t = static_cast<int>(threadIdx.x);
  slot[t] = static_cast<float>(t);
  out[t] = slot[(t + 1) % blockDim.x];  // missing __syncthreads before this read
}

void WarpXorKernel(int* out, int lane_mask) {
  out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, static_cast<int>(threadIdx.x), lane_mask);
}

// A barrier only the even threads reach.
void DivergentBarrierKernel(int* out) {
  if (threadIdx.x % 2 == 0) __syncthreads();
  out[threadIdx.x] = 1;
}

// Threads that return early do not hold up the barrier of the others.
void EarlyReturnKernel(int* out) {
  if (threadIdx.x >= 16) return;
  __syncthreads();
  out[threadIdx.x] = static_cast<int>(blockDim.x);
}

void IndexKernel(int* out) {
  const int block = static_cast<int>(blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z));
  const int threads = static_cast<int>(blockDim.x * blockDim.y * blockDim.z);
  const int t = static_cast<int>(threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z));
  out[block * threads + t] += block * 1000 + t;
}

void TrapKernel(int* out) {
  if (threadIdx.x == 3) __trap();
  out[threadIdx.x] = 1;
}

// Two block sums in a row through one 32-float scratch array, as kernels/cuda/common.cuh's
// BlockSum, with or without the barrier that keeps the second sum's writes from overtaking the
// first sum's reads.
template <bool kFirstBarrier>
float BlockSumOnce(float v, float* scratch) {
  const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  if (kFirstBarrier) __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < warps ? scratch[lane] : 0.0f;
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

template <bool kFirstBarrier>
void TwoSumsKernel(float* out) {
  float* scratch = static_cast<float*>(fsdp_emu::DynamicShared());
  float a = BlockSumOnce<kFirstBarrier>(1.0f, scratch);
  float b = BlockSumOnce<kFirstBarrier>(2.0f, scratch);  // other per-warp sums than a's
  out[threadIdx.x] = a * 1000 + b;
}

// A 16-byte vector load at `offset` floats into the buffer.
struct alignas(16) Float4 {
  float v[4];
};
void VectorLoadKernel(const float* in, float* out, int offset) {
  Float4 packed = *fsdp_emu::CheckedCast<const Float4*>(in + offset);
  out[threadIdx.x] = packed.v[threadIdx.x % 4];
}

class EmulatorTest : public ::testing::TestWithParam<Schedule> {
 protected:
  void SetUp() override {
    fsdp_emu::SetSchedule(GetParam());
    fsdp_emu::GetLastError();  // clear
  }
  void TearDown() override { fsdp_emu::SetSchedule(Schedule::kForward); }
};

TEST_P(EmulatorTest, BarriersOrderSharedMemoryUnderEverySchedule) {
  const int blocks = 3, n = 100;
  std::vector<float> in(blocks * n);
  std::iota(in.begin(), in.end(), 1.0f);
  std::vector<float> out(blocks, -1.0f);
  fsdp_emu::Launch(TreeSumKernel, fsdp_emu::Config(blocks, 128, 128 * sizeof(float)))(
      in.data(), out.data(), n);
  ASSERT_EQ(fsdp_emu::GetLastError(), 0) << fsdp_emu::LastErrorMessage();
  for (int b = 0; b < blocks; ++b) {
    float expected = 0;
    for (int i = 0; i < n; ++i) expected += in[b * n + i];
    EXPECT_EQ(out[b], expected) << "block " << b;
  }
}

TEST_P(EmulatorTest, EveryThreadOfA3dGridRunsOnceWithItsIndices) {
  const dim3 grid(3, 2, 2), block(4, 3, 2);
  const int threads = 24, total = 12 * threads;
  std::vector<int> out(total, 0);
  fsdp_emu::Launch(IndexKernel, fsdp_emu::Config(grid, block))(out.data());
  ASSERT_EQ(fsdp_emu::GetLastError(), 0) << fsdp_emu::LastErrorMessage();
  for (int i = 0; i < total; ++i) EXPECT_EQ(out[i], (i / threads) * 1000 + i % threads) << i;
}

TEST_P(EmulatorTest, WarpShuffleExchangesBetweenLanes) {
  for (int mask : {1, 2, 16}) {
    std::vector<int> out(64, -1);
    fsdp_emu::Launch(WarpXorKernel, fsdp_emu::Config(1, 64))(out.data(), mask);
    ASSERT_EQ(fsdp_emu::GetLastError(), 0) << fsdp_emu::LastErrorMessage();
    for (int t = 0; t < 64; ++t) EXPECT_EQ(out[t], t ^ mask) << "lane " << t << " mask " << mask;
  }
}

TEST_P(EmulatorTest, ThreadsThatReturnedDoNotHoldUpABarrier) {
  std::vector<int> out(64, 0);
  fsdp_emu::Launch(EarlyReturnKernel, fsdp_emu::Config(1, 64))(out.data());
  ASSERT_EQ(fsdp_emu::GetLastError(), 0) << fsdp_emu::LastErrorMessage();
  EXPECT_EQ(out[15], 64);
  EXPECT_EQ(out[16], 0);
}

TEST_P(EmulatorTest, ADivergentBarrierIsADeadlock) {
  std::vector<int> out(64, 0);
  fsdp_emu::Launch(DivergentBarrierKernel, fsdp_emu::Config(1, 64))(out.data());
  // Odd threads return without the barrier, so the even ones are released: legal on sm_70+.
  EXPECT_EQ(fsdp_emu::GetLastError(), 0);
  // A barrier in a loop some threads leave earlier than others, with the others still live:
  auto uneven = +[](int* o) {
    for (unsigned i = 0; i <= threadIdx.x % 2; ++i) __syncthreads();
    __shfl_xor_sync(0xffffffffu, 1, 1);  // even lanes wait here, odd ones at a 2nd barrier
    o[threadIdx.x] = 1;
  };
  fsdp_emu::Launch(uneven, fsdp_emu::Config(1, 64))(out.data());
  EXPECT_EQ(fsdp_emu::GetLastError(), fsdp_emu::kDeadlock);
  EXPECT_THAT(fsdp_emu::LastErrorMessage(), ::testing::HasSubstr("deadlock in block (0, 0, 0)"));
}

TEST_P(EmulatorTest, InvalidLaunchesFailWithoutRunning) {
  std::vector<int> out(2048, 0);
  fsdp_emu::Launch(IndexKernel, fsdp_emu::Config(1, 1025))(out.data());
  EXPECT_EQ(fsdp_emu::GetLastError(), fsdp_emu::kInvalidConfiguration);
  EXPECT_THAT(fsdp_emu::LastErrorMessage(), ::testing::HasSubstr("exceeds 1024 threads"));
  fsdp_emu::Launch(IndexKernel, fsdp_emu::Config(1, dim3(32, 32, 2)))(out.data());
  EXPECT_EQ(fsdp_emu::GetLastError(), fsdp_emu::kInvalidConfiguration);
  fsdp_emu::Launch(IndexKernel, fsdp_emu::Config(0, 32))(out.data());
  EXPECT_EQ(fsdp_emu::GetLastError(), fsdp_emu::kInvalidConfiguration);
  fsdp_emu::Launch(IndexKernel, fsdp_emu::Config(1, 32, 48 * 1024 + 4))(out.data());
  EXPECT_EQ(fsdp_emu::GetLastError(), fsdp_emu::kInvalidConfiguration);
  EXPECT_EQ(std::accumulate(out.begin(), out.end(), 0), 0) << "a refused launch ran";
  EXPECT_EQ(fsdp_emu::GetLastError(), 0) << "the error is cleared once read";
}

TEST_P(EmulatorTest, AMisalignedVectorAccessFailsTheLaunch) {
  alignas(16) float in[8] = {0, 1, 2, 3, 4, 5, 6, 7};
  std::vector<float> out(4, -1.0f);
  fsdp_emu::Launch(VectorLoadKernel, fsdp_emu::Config(1, 4))(in, out.data(), 4);
  ASSERT_EQ(fsdp_emu::GetLastError(), 0) << fsdp_emu::LastErrorMessage();
  EXPECT_EQ(out[1], 5.0f);
  fsdp_emu::Launch(VectorLoadKernel, fsdp_emu::Config(1, 4))(in, out.data(), 2);
  EXPECT_EQ(fsdp_emu::GetLastError(), fsdp_emu::kMisalignedAddress);
  EXPECT_THAT(fsdp_emu::LastErrorMessage(), ::testing::HasSubstr("aligned to 16 bytes"));
}

TEST_P(EmulatorTest, ATrapFailsTheLaunch) {
  std::vector<int> out(32, 0);
  fsdp_emu::Launch(TrapKernel, fsdp_emu::Config(1, 32))(out.data());
  EXPECT_EQ(fsdp_emu::GetLastError(), fsdp_emu::kLaunchFailure);
}

INSTANTIATE_TEST_SUITE_P(Schedules, EmulatorTest,
                         ::testing::Values(Schedule::kForward, Schedule::kReverse,
                                           Schedule::kShuffled, Schedule::kWarpByWarp),
                         [](const ::testing::TestParamInfo<Schedule>& info) {
                           switch (info.param) {
                             case Schedule::kForward: return "Forward";
                             case Schedule::kReverse: return "Reverse";
                             case Schedule::kShuffled: return "Shuffled";
                             case Schedule::kWarpByWarp: return "WarpByWarp";
                           }
                           return "";
                         });

// A missing barrier: the values read depend on which thread ran first, which the schedules
// vary; with the forward order each thread reads its neighbour's slot before the neighbour
// wrote it (0xff bytes: NaN), with the reverse order after.
TEST(EmulatorRaceTest, AMissingBarrierGivesScheduleDependentResults) {
  std::vector<std::vector<float>> results;
  for (Schedule s : {Schedule::kForward, Schedule::kReverse}) {
    fsdp_emu::SetSchedule(s);
    std::vector<float> out(64, 0.0f);
    fsdp_emu::Launch(RacyShiftKernel, fsdp_emu::Config(1, 64, 64 * sizeof(float)))(out.data());
    ASSERT_EQ(fsdp_emu::GetLastError(), 0);
    results.push_back(out);
  }
  fsdp_emu::SetSchedule(Schedule::kForward);
  EXPECT_TRUE(std::isnan(results[0][0])) << "forward: thread 0 read slot 1 before it was written";
  EXPECT_EQ(results[1][0], 1.0f) << "reverse: slot 1 was written first";
}

// The race of a scratch array reused without a barrier: hidden when every thread reads right
// after the barrier (all read before any warp can go on), exposed when warp 0 runs ahead.
TEST(EmulatorRaceTest, AWarpRunningAheadExposesAMissingBarrierBetweenReductions) {
  const float expected = 128 * 1000 + 256;
  for (Schedule s : {Schedule::kForward, Schedule::kWarpByWarp}) {
    fsdp_emu::SetSchedule(s);
    std::vector<float> with(128), without(128);
    fsdp_emu::Launch(TwoSumsKernel<true>, fsdp_emu::Config(1, 128, 32 * sizeof(float)))(with.data());
    fsdp_emu::Launch(TwoSumsKernel<false>, fsdp_emu::Config(1, 128, 32 * sizeof(float)))(
        without.data());
    ASSERT_EQ(fsdp_emu::GetLastError(), 0) << fsdp_emu::LastErrorMessage();
    EXPECT_EQ(with[127], expected) << "schedule " << static_cast<int>(s);
    if (s == Schedule::kForward) {
      EXPECT_EQ(without[127], expected);
    } else {
      EXPECT_NE(without[127], expected) << "race not exposed";
    }
  }
  fsdp_emu::SetSchedule(Schedule::kForward);
}

}  // namespace
