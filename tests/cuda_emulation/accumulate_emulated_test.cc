// The multi-tensor accumulation kernel (kernels/cuda/accumulate.cu), run by the CPU emulator,
// against at::add_ bit for bit: fp32 sums plus bf16, fp16 and fp32 sources, sizes that are
// not multiples of a pack or a chunk, more pairs than one launch's table holds, zero-size
// pairs, and operands one element off a 16-byte boundary (the element path: a pack there fails
// the emulated launch, as it would fault on a GPU). Then the library's AccumulateInto through
// its CUDA branch: grouping by dtype, and the pairs it leaves to at::add_.
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "emulated/kernels/accumulate.h"
#include "emulated/kernels/cuda/accumulate.h"
#include "kernels/accumulate.h"
#include "tests/cuda_emulation/emulator.h"
#include "tests/cuda_emulation/multi_tensor_testing.h"

namespace fsdp::kernels {
namespace {

namespace emulated = ::fsdp::kernels_emulated::cuda;
using testing::BitwiseEqual;
using testing::Clones;
using testing::EmulatedDType;
using testing::ManySizes;
using testing::Place;
using testing::Schedules;
using testing::Versions;

// Sums large against the sources, so that most additions round; and the values whose sum
// has a sign or class to get right.
at::Tensor Sums(int64_t n) {
  at::Tensor t = at::randn({n}) * 1000;
  const float specials[] = {-0.0f, 0.0f, std::numeric_limits<float>::infinity(), 1e30f, -1e-30f};
  for (int64_t i = 0; i < n && i < 5; ++i) t[i] = specials[i];
  return t;
}

at::Tensor Sources(int64_t n, at::ScalarType dtype) {
  at::Tensor t = at::randn({n});
  const float specials[] = {-0.0f, -0.0f, -1.0f, 1e30f, 1e-30f};
  for (int64_t i = 0; i < n && i < 5; ++i) t[i] = specials[i];
  return t.to(dtype);
}

struct Case {
  std::string name;
  at::ScalarType dtype;
  std::vector<int64_t> sizes;
  int64_t dst_offset = 0, src_offset = 0;  // elements; 1 on every other pair when set
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

class EmulatedAccumulateTest : public ::testing::TestWithParam<Case> {};

TEST_P(EmulatedAccumulateTest, EqualsAtAddBitwiseUnderEverySchedule) {
  const Case c = GetParam();
  at::manual_seed(31);
  std::vector<at::Tensor> sums, srcs;
  for (size_t i = 0; i < c.sizes.size(); ++i) {
    const int64_t n = c.sizes[i];
    const bool odd = i % 2 == 1;  // offsets on every other pair: both paths in one launch
    sums.push_back(Place(Sums(n), odd ? c.dst_offset : 0));
    srcs.push_back(Place(Sources(n, c.dtype), odd ? c.src_offset : 0));
  }
  std::vector<at::Tensor> expected;
  for (size_t i = 0; i < sums.size(); ++i) expected.push_back(sums[i].clone().add_(srcs[i]));

  for (fsdp_emu::Schedule s : Schedules(/*every=*/true)) {
    fsdp_emu::SetSchedule(s);
    std::vector<at::Tensor> dsts;
    std::vector<emulated::AccumulatePair> pairs;
    for (size_t i = 0; i < sums.size(); ++i) {
      dsts.push_back(Place(sums[i], (i % 2 == 1) ? c.dst_offset : 0));
      pairs.push_back({dsts[i].data_ptr<float>(), srcs[i].data_ptr(), srcs[i].numel()});
    }
    const int status = emulated::AccumulateInto(pairs.data(), static_cast<int64_t>(pairs.size()),
                                                EmulatedDType(c.dtype), nullptr);
    ASSERT_EQ(status, 0) << "launch failed: " << fsdp_emu::LastErrorMessage();
    for (size_t i = 0; i < dsts.size(); ++i) {
      EXPECT_TRUE(BitwiseEqual(dsts[i], expected[i]))
          << "pair " << i << " (" << c.sizes[i] << " elements, schedule " << static_cast<int>(s)
          << ") differs from at::add_: max |diff| "
          << (dsts[i] - expected[i]).abs().nan_to_num(0).max().item<float>();
    }
  }
  fsdp_emu::SetSchedule(fsdp_emu::Schedule::kForward);
}

// Sizes around a pack (8 or 4), a chunk (8192 elements) and two chunks; zero-size pairs.
const std::vector<int64_t> kOdd = {1, 7, 8, 9, 0, 1001, 8191, 8192, 8193, 0, 16389};

INSTANTIATE_TEST_SUITE_P(
    Cases, EmulatedAccumulateTest,
    ::testing::Values(Case{"bf16", at::kBFloat16, kOdd}, Case{"fp16", at::kHalf, kOdd},
                      Case{"fp32", at::kFloat, kOdd}, Case{"bf16_many", at::kBFloat16, ManySizes()},
                      Case{"fp32_many", at::kFloat, ManySizes()},
                      Case{"bf16_dst_misaligned", at::kBFloat16, kOdd, 1, 0},
                      Case{"bf16_src_misaligned", at::kBFloat16, kOdd, 0, 1},
                      Case{"fp16_src_misaligned", at::kHalf, kOdd, 0, 1},
                      // 8 bytes off: enough for a float2, not for a 16-byte pack.
                      Case{"fp32_both_misaligned", at::kFloat, kOdd, 2, 2},
                      Case{"zero_size_only", at::kBFloat16, {0, 0, 0}},
                      Case{"none", at::kBFloat16, {}}),
    [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

// The library function through its CUDA branch (dispatch_emulated.cc): dtypes mixed in one
// list (one launch each), shapes that differ between dst and src, and pairs it leaves to
// at::add_ (a strided src, a strided dst, an fp64 src) in the same call.
TEST(EmulatedAccumulateFunctionTest, MixedListEqualsTheCompositeBitwise) {
  at::manual_seed(32);
  std::vector<at::Tensor> dsts, srcs;
  auto add = [&](at::Tensor dst, at::Tensor src) {
    dsts.push_back(dst);
    srcs.push_back(src);
  };
  add(Sums(6 * 70).view({6, 70}), Sources(420, at::kBFloat16));
  add(Sums(1001), Sources(1001, at::kHalf).view({7, 11, 13}));
  add(Sums(9000).view({9000, 1}), Sources(9000, at::kFloat));
  add(Sums(33).view({3, 11}), Sources(33, at::kBFloat16).view({11, 3}).t());  // strided src
  add(Sums(33).view({11, 3}).t(), Sources(33, at::kBFloat16).view({3, 11}));  // strided dst
  add(Sums(17), Sources(17, at::kDouble));
  add(Sums(0), Sources(0, at::kBFloat16));
  add(Place(Sums(100), 1), Place(Sources(100, at::kBFloat16), 3));    // misaligned views
  add(at::scalar_tensor(0.5f), Sources(1, at::kBFloat16).squeeze());  // 0-dim

  std::vector<at::Tensor> expected = Clones(dsts);
  fsdp::kernels::AccumulateIntoComposite(expected, srcs);
  std::vector<at::Tensor> actual = Clones(dsts);
  const std::vector<int64_t> versions = Versions(actual);
  fsdp::kernels_emulated::AccumulateInto(actual, srcs);
  for (size_t i = 0; i < dsts.size(); ++i) {
    EXPECT_TRUE(BitwiseEqual(actual[i], expected[i])) << "pair " << i;
    EXPECT_GT(actual[i]._version(), versions[i]) << "pair " << i << ": modified in place";
  }
}

TEST(EmulatedAccumulateFunctionTest, RejectsPairsOfDifferentNumelOrCount) {
  at::Tensor d = at::zeros({4});
  EXPECT_THROW(fsdp::kernels_emulated::AccumulateInto({d}, {at::zeros({5})}), c10::Error);
  EXPECT_THROW(fsdp::kernels_emulated::AccumulateInto({d, d}, {at::zeros({4})}), c10::Error);
}

}  // namespace
}  // namespace fsdp::kernels
