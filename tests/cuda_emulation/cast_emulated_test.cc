// The multi-tensor cast kernel (kernels/cuda/cast.cu), run by the CPU emulator, against
// at::Tensor::copy_ bit for bit: all nine (dst, src) pairs of fp32, bf16 and fp16, sizes that
// are not multiples of a pack or a chunk, more pairs than one launch's table holds, zero-size
// pairs, operands off a 16-byte boundary (the element path: a pack there fails the emulated
// launch, as it would fault on a GPU; and views 16 bytes in, which take the packs), and the
// values a conversion can get wrong: NaNs with payloads and signs, infinities, denormals,
// fp16 overflow, round-to-nearest-even ties. Then the library's CastInto through its CUDA
// branch: grouping by dtype pair, and the pairs it leaves to copy_.
//
// NaN: ATen's CUDA conversions (c10's device code) are the instructions the kernel uses too
// (Note [Multi-tensor cast]); under the emulator those are the CUDA headers' host versions,
// NVIDIA's model of the instructions, which return one NaN whatever the input's payload or
// sign: 0x7FFF for bf16 and fp16, 0x7FFFFFFF for fp32 from fp16, a bf16's bits shifted into an
// fp32 (that conversion is exact). ATen's CPU copy_ keeps payloads, so a NaN is compared with
// those values, every other element with the CPU's copy_. KernelsCastTest.CudaEqualsCopy*
// compares everything, NaNs included, with ATen on a GPU.
#include <cstdint>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "emulated/kernels/cast.h"
#include "emulated/kernels/cuda/cast.h"
#include "kernels/cast.h"
#include "tests/cuda_emulation/emulator.h"
#include "tests/cuda_emulation/multi_tensor_testing.h"

namespace fsdp::kernels {
namespace {

namespace emulated = ::fsdp::kernels_emulated::cuda;
using testing::Bits;
using testing::BitwiseEqual;
using testing::EmulatedDType;
using testing::ManySizes;
using testing::Place;
using testing::Schedules;
using testing::Versions;

const char* Name(at::ScalarType t) {
  return t == at::kFloat ? "fp32" : t == at::kBFloat16 ? "bf16" : "fp16";
}

// Bit patterns at the start of each source: what each conversion has to get exactly right.
std::vector<int64_t> Specials(at::ScalarType src) {
  if (src == at::kFloat) {
    return {
        0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FBFFFFF, 0x7FC12345,  // NaNs: quiet, -, signalling
        0x7F800000, 0xFF800000, 0x00000000, 0x80000000,              // inf, -inf, 0, -0
        0x00000001, 0x80000001, 0x007FFFFF, 0x00008000, 0x00018000,  // denormals, bf16 ties
        0x3F808000, 0x3F818000, 0x3F80FFFF, 0x3F808001, 0xBF818000,  // bf16 ties and near
        0x7F7FFFFF, 0x7F7F7FFF, 0xFF7FFFFF,                          // bf16 overflow to inf
        0x477FF000, 0x477FEFFF, 0xC77FF000, 0x47800000,              // fp16 overflow, 65504
        0x33000000, 0x33000001, 0x33C00000, 0x387FC000, 0x38800000,  // fp16 subnormal ties
        0x3F801000, 0x3F803000, 0x3F801001, 0xBF803000,              // fp16 ties and near
    };
  }
  if (src == at::kBFloat16) {
    return {0x7FC0, 0xFFC0, 0x7FC1, 0x7F81, 0xFFFF,  // NaNs
            0x7F80, 0xFF80, 0x0000, 0x8000,          // inf, -inf, 0, -0
            0x0001, 0x8001, 0x007F, 0x0080,          // denormals, smallest normal
            0x477F, 0x4780, 0xC780, 0x7F7F,          // fp16's range and beyond
            0x3380, 0x33C0, 0x3F81, 0x3F80};         // fp16 subnormals, 1 + 2^-7, 1
  }
  return {0x7E00, 0xFE00, 0x7E01, 0x7D00, 0x7FFF, 0xFFFF,  // NaNs
          0x7C00, 0xFC00, 0x0000, 0x8000,                  // inf, -inf, 0, -0
          0x0001, 0x8001, 0x03FF, 0x0400,                  // subnormals, smallest normal
          0x7BFF, 0xFBFF, 0x3C01, 0x3C03, 0x3C00};         // 65504, bf16 ties, 1
}

// n values of `dtype`: the specials first, then normal values (fp32 sources scaled so that
// some overflow fp16).
at::Tensor Source(int64_t n, at::ScalarType dtype) {
  at::Tensor t = (at::randn({n}) * (dtype == at::kFloat ? 3e4 : 1.0)).to(dtype);
  const std::vector<int64_t> specials = Specials(dtype);
  at::Tensor bits = t.view(Bits(dtype));
  for (int64_t i = 0; i < n && i < static_cast<int64_t>(specials.size()); ++i) {
    bits[i] = dtype == at::kFloat ? static_cast<int64_t>(static_cast<int32_t>(specials[i]))
                                  : static_cast<int64_t>(static_cast<int16_t>(specials[i]));
  }
  return t;
}

// What ATen's copy_ gives on a GPU: the CPU's copy_ but for NaNs (See the top of the file).
at::Tensor Expected(const at::Tensor& src, at::ScalarType dst) {
  at::Tensor out = at::empty(src.sizes(), src.options().dtype(dst));
  out.copy_(src);
  if (dst == src.scalar_type()) return out;  // a NaN keeps its bits
  const at::Tensor nan = src.isnan();
  at::Tensor bits = out.view(Bits(dst));
  if (dst != at::kFloat) {
    bits.masked_fill_(nan, 0x7FFF);
  } else if (src.scalar_type() == at::kHalf) {
    bits.masked_fill_(nan, 0x7FFFFFFF);
  } else {  // bf16: exact, the bits shifted
    bits.copy_(at::where(nan, src.view(at::kShort).to(at::kInt).bitwise_left_shift(16), bits));
  }
  return out;
}

// The first element whose bits differ, for the message.
std::string FirstDifference(const at::Tensor& a, const at::Tensor& e) {
  const at::Tensor ab = a.contiguous().view(Bits(a.scalar_type())).to(at::kLong);
  const at::Tensor eb = e.contiguous().view(Bits(e.scalar_type())).to(at::kLong);
  const at::Tensor diff = (ab != eb).nonzero();
  if (diff.numel() == 0) return "none";
  const int64_t i = diff[0][0].item<int64_t>();
  return "element " + std::to_string(i) + ": bits " + std::to_string(ab[i].item<int64_t>()) +
         ", expected " + std::to_string(eb[i].item<int64_t>());
}

struct Case {
  std::string name;
  at::ScalarType dst, src;
  std::vector<int64_t> sizes;
  int64_t dst_offset = 0, src_offset = 0;  // elements; on every other pair when set
  bool every_schedule = true;
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

class EmulatedCastTest : public ::testing::TestWithParam<Case> {};

TEST_P(EmulatedCastTest, EqualsCopyBitwise) {
  const Case c = GetParam();
  at::manual_seed(33);
  std::vector<at::Tensor> srcs, expected;
  for (size_t i = 0; i < c.sizes.size(); ++i) {
    srcs.push_back(Place(Source(c.sizes[i], c.src), i % 2 == 1 ? c.src_offset : 0));
    expected.push_back(Expected(srcs.back(), c.dst));
  }
  for (fsdp_emu::Schedule s : Schedules(c.every_schedule)) {
    fsdp_emu::SetSchedule(s);
    std::vector<at::Tensor> dsts;
    std::vector<emulated::CastPair> pairs;
    for (size_t i = 0; i < srcs.size(); ++i) {
      // Filled with a pattern no conversion produces here, so an element left out shows.
      dsts.push_back(Place(at::full({c.sizes[i]}, -3.25, at::TensorOptions().dtype(c.dst)),
                           i % 2 == 1 ? c.dst_offset : 0));
      pairs.push_back({dsts[i].data_ptr(), srcs[i].data_ptr(), srcs[i].numel()});
    }
    const int status = emulated::CastInto(pairs.data(), static_cast<int64_t>(pairs.size()),
                                          EmulatedDType(c.dst), EmulatedDType(c.src), nullptr);
    ASSERT_EQ(status, 0) << "launch failed: " << fsdp_emu::LastErrorMessage();
    for (size_t i = 0; i < dsts.size(); ++i) {
      EXPECT_TRUE(BitwiseEqual(dsts[i], expected[i]))
          << "pair " << i << " (" << c.sizes[i] << " elements, schedule " << static_cast<int>(s)
          << ") differs from copy_: " << FirstDifference(dsts[i], expected[i]);
    }
  }
  fsdp_emu::SetSchedule(fsdp_emu::Schedule::kForward);
}

// Sizes around a pack (16 or 8 elements), a chunk (8192) and two chunks; zero-size pairs.
const std::vector<int64_t> kOdd = {1, 7, 8, 9, 0, 15, 16, 17, 40, 1001, 8191, 8192, 8193, 0, 16389};

std::vector<Case> Cases() {
  const at::ScalarType dtypes[] = {at::kFloat, at::kBFloat16, at::kHalf};
  constexpr int64_t kOneElement = -1;
  struct Offsets {  // in bytes, on every other pair
    const char* name;
    int64_t dst, src;
    bool every_schedule;
  };
  // One element off a 16-byte boundary (the element path); 8 bytes off (word-aligned, not
  // pack-aligned: the element path); 16 bytes in (packs again).
  const Offsets offsets[] = {{"", 0, 0, true},
                             {"_dst_misaligned", kOneElement, 0, false},
                             {"_src_misaligned", 0, kOneElement, false},
                             {"_both_8_bytes_off", 8, 8, false},
                             {"_both_16_bytes_in", 16, 16, false}};
  auto elements = [&](int64_t bytes, at::ScalarType t) {
    return bytes == kOneElement ? 1 : bytes / static_cast<int64_t>(at::elementSize(t));
  };
  std::vector<Case> cases;
  for (at::ScalarType dst : dtypes) {
    for (at::ScalarType src : dtypes) {
      for (const Offsets& o : offsets) {
        cases.push_back({std::string(Name(dst)) + "_from_" + Name(src) + o.name, dst, src, kOdd,
                         elements(o.dst, dst), elements(o.src, src), o.every_schedule});
      }
    }
  }
  cases.push_back({"bf16_from_fp32_many", at::kBFloat16, at::kFloat, ManySizes()});
  cases.push_back({"fp32_from_bf16_many", at::kFloat, at::kBFloat16, ManySizes()});
  cases.push_back(
      {"fp16_from_fp32_many_misaligned", at::kHalf, at::kFloat, ManySizes(), 1, 0, false});
  cases.push_back({"zero_size_only", at::kBFloat16, at::kFloat, {0, 0, 0}});
  cases.push_back({"none", at::kBFloat16, at::kFloat, {}});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Cases, EmulatedCastTest, ::testing::ValuesIn(Cases()),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return info.param.name;
                         });

// The library function through its CUDA branch (dispatch_emulated.cc): dtype pairs mixed in one
// list (one launch each), shapes that differ between dst and src, and pairs it leaves to copy_
// (a strided src, a strided dst, an fp64 src, a negated view) in the same call; each dst's
// version counter moves.
TEST(EmulatedCastFunctionTest, MixedListEqualsTheCompositeBitwise) {
  at::manual_seed(34);
  auto finite = [](int64_t n, at::ScalarType t) { return (at::randn({n}) * 100).to(t); };
  std::vector<at::Tensor> dsts, srcs;
  auto add = [&](at::Tensor dst, at::Tensor src) {
    dsts.push_back(dst);
    srcs.push_back(src);
  };
  const auto bf16 = at::TensorOptions().dtype(at::kBFloat16);
  const auto fp16 = at::TensorOptions().dtype(at::kHalf);
  add(at::empty({6, 70}, bf16), finite(420, at::kFloat));
  add(at::empty({1001}), finite(1001, at::kHalf).view({7, 11, 13}));
  add(at::empty({9000, 1}, fp16), finite(9000, at::kBFloat16));
  add(at::empty({64}, bf16), finite(64, at::kBFloat16));  // one dtype: the bits as they are
  add(at::empty({3, 11}, bf16), finite(33, at::kFloat).view({11, 3}).t());  // strided src
  add(at::empty({11, 3}, fp16).t(), finite(33, at::kFloat).view({3, 11}));  // strided dst
  add(at::empty({17}, bf16), finite(17, at::kDouble));                      // fp64 src
  add(at::empty({17}), at::_neg_view(finite(17, at::kBFloat16)));           // negated view
  add(at::empty({0}, bf16), finite(0, at::kFloat));
  add(Place(at::empty({100}, fp16), 1), Place(finite(100, at::kFloat), 3));  // misaligned views
  add(at::empty({}, bf16), finite(1, at::kFloat).squeeze());                 // 0-dim

  std::vector<at::Tensor> expected;
  for (const at::Tensor& d : dsts) expected.push_back(at::zeros_like(d));
  fsdp::kernels::CastIntoComposite(expected, srcs);
  std::vector<at::Tensor> actual;
  for (const at::Tensor& d : dsts) actual.push_back(at::zeros_like(d));
  const std::vector<int64_t> versions = Versions(actual);
  fsdp::kernels_emulated::CastInto(actual, srcs);
  for (size_t i = 0; i < dsts.size(); ++i) {
    EXPECT_TRUE(BitwiseEqual(actual[i], expected[i]))
        << "pair " << i << ": " << FirstDifference(actual[i], expected[i]);
    EXPECT_GT(actual[i]._version(), versions[i]) << "pair " << i << ": modified in place";
  }
}

TEST(EmulatedCastFunctionTest, RejectsPairsOfDifferentNumelOrCount) {
  at::Tensor d = at::zeros({4});
  EXPECT_THROW(fsdp::kernels_emulated::CastInto({d}, {at::zeros({5})}), c10::Error);
  EXPECT_THROW(fsdp::kernels_emulated::CastInto({d, d}, {at::zeros({4})}), c10::Error);
}

}  // namespace
}  // namespace fsdp::kernels
