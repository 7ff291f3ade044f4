// kernels::CastInto against at::Tensor::copy_, bit for bit: every (dst, src) pair of fp32,
// bf16 and fp16, NaNs with payloads and signs, infinities, denormals, fp16 overflow,
// round-to-nearest-even ties, odd sizes, more pairs than one launch's table, zero-size pairs,
// misaligned views, and the pairs left to copy_ (strided, fp64, a negated view). The CPU
// branch (copy_ itself: dispatch, fallbacks, errors, version counters) always; the CUDA kernel
// with a GPU, against copy_ on the GPU (NaNs included) and on the CPU (NaNs aside: ATen's CPU
// and GPU conversions return different NaNs).
#include "kernels/cast.h"

#include <cstdint>
#include <iterator>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/kernels_testing.h"
#include "tests/multi_tensor_testing.h"

namespace fsdp::kernels {
namespace {

using testing::Bits;
using testing::Clones;
using testing::Pairs;
using testing::Place;
using testing::Versions;

// fp32 bit patterns that conversions must get exactly right: NaNs, infinities, zeros,
// denormals, bf16 and fp16 round-to-nearest-even ties and their neighbours, overflow.
// clang-format off
const int32_t kSpecials[] = {
    0x7FC00000, static_cast<int32_t>(0xFFC00000), 0x7F800001, 0x7FC12345,
    0x7F800000, static_cast<int32_t>(0xFF800000), 0, static_cast<int32_t>(0x80000000),
    0x00000001, static_cast<int32_t>(0x80000001), 0x007FFFFF, 0x00008000, 0x00018000,
    0x3F808000, 0x3F818000, 0x3F80FFFF, 0x7F7FFFFF, 0x477FF000, 0x477FEFFF,
    static_cast<int32_t>(0xC77FF000), 0x33000000, 0x33000001, 0x33C00000, 0x3F801000,
    0x3F803000, 0x3F801001};
// clang-format on

// n values of `dtype`: the specials (converted, for bf16/fp16: the CPU keeps NaN payloads and
// rounds the rest) then normal values scaled so that some overflow fp16.
at::Tensor Values(int64_t n, at::ScalarType dtype, c10::Device device) {
  at::Tensor t = at::randn({n}) * 3e4;
  at::Tensor bits = t.view(at::kInt);
  for (int64_t i = 0; i < n && i < static_cast<int64_t>(std::size(kSpecials)); ++i) {
    bits[i] = kSpecials[i];
  }
  return t.to(dtype).to(device);
}

// Every dtype pair over 140 pairs (three tables of 48 for some pairs), odd sizes and empty
// ones, some views at an odd element offset; then the pairs the kernel leaves to copy_.
Pairs MakePairs(c10::Device device) {
  at::manual_seed(43);
  const at::ScalarType dtypes[] = {at::kFloat, at::kBFloat16, at::kHalf};
  Pairs p;
  for (int64_t i = 0; i < 140; ++i) {
    const int64_t n = i % 13 == 12 ? 0 : 1 + (97 * i) % 20011;
    const at::ScalarType dst_dtype = dtypes[i % 3], src_dtype = dtypes[(i / 3) % 3];
    at::Tensor dst = at::full({n}, -3.25, at::TensorOptions().dtype(dst_dtype).device(device));
    at::Tensor src = Values(n, src_dtype, device);
    if (i % 7 == 3) dst = Place(dst, 1);
    if (i % 5 == 2) src = Place(src, 1);
    p.dsts.push_back(dst);
    p.srcs.push_back(src);
  }
  const auto bf16 = at::TensorOptions().dtype(at::kBFloat16).device(device);
  // Shapes that differ; a strided src and dst; an fp64 src; a negated view; 0-dim.
  p.dsts.push_back(at::zeros({6, 70}, bf16));
  p.srcs.push_back(Values(420, at::kFloat, device).view({70, 6}).t());
  p.dsts.push_back(at::zeros({37, 9}, bf16).t());
  p.srcs.push_back(Values(333, at::kFloat, device));
  p.dsts.push_back(at::zeros({333}, bf16));
  p.srcs.push_back(Values(333, at::kDouble, device).view({9, 37}));
  p.dsts.push_back(at::zeros({50}, bf16));
  p.srcs.push_back(at::_neg_view(Values(50, at::kFloat, device)));
  p.dsts.push_back(at::zeros({}, bf16));
  p.srcs.push_back(Values(1, at::kHalf, device).view({1, 1}));
  return p;
}

// Bitwise equality per pair; with `nan_aside`, elements that are NaN in both are not compared.
void ExpectBitwise(const std::vector<at::Tensor>& actual, const std::vector<at::Tensor>& expected,
                   bool nan_aside, const char* what) {
  ASSERT_EQ(actual.size(), expected.size());
  for (size_t i = 0; i < actual.size(); ++i) {
    at::Tensor a = actual[i].cpu().contiguous(), e = expected[i].cpu().contiguous();
    at::Tensor ab = a.view(Bits(a.scalar_type())), eb = e.view(Bits(e.scalar_type()));
    at::Tensor differ = ab != eb;
    if (nan_aside) differ &= ~(a.isnan() & e.isnan());
    if (!differ.any().item<bool>()) continue;
    const int64_t k = differ.flatten().nonzero()[0][0].item<int64_t>();
    ADD_FAILURE() << what << ": pair " << i << " (" << a.scalar_type() << " of " << a.numel()
                  << "), element " << k << " has bits " << ab.flatten()[k].item<int64_t>()
                  << ", expected " << eb.flatten()[k].item<int64_t>();
  }
}

void CheckAgainstCopy(c10::Device device) {
  Pairs p = MakePairs(device);
  std::vector<at::Tensor> expected = Clones(p.dsts);
  for (size_t i = 0; i < expected.size(); ++i) {
    expected[i].copy_(p.srcs[i].reshape(expected[i].sizes()));
  }
  std::vector<at::Tensor> actual = Clones(p.dsts);
  const std::vector<int64_t> versions = Versions(actual);
  CastInto(actual, p.srcs);
  ExpectBitwise(actual, expected, /*nan_aside=*/false, "copy_ on the same device");
  for (size_t i = 0; i < actual.size(); ++i) {
    EXPECT_GT(actual[i]._version(), versions[i]) << "pair " << i << ": written in place";
  }
  if (device.is_cuda()) {  // and the CPU's copy_, NaNs aside
    std::vector<at::Tensor> cpu;
    for (size_t i = 0; i < p.dsts.size(); ++i) {
      cpu.push_back(p.dsts[i].cpu());
      cpu.back().copy_(p.srcs[i].cpu().reshape(cpu.back().sizes()));
    }
    ExpectBitwise(actual, cpu, /*nan_aside=*/true, "copy_ on the CPU");
  }
}

TEST(KernelsCastTest, CpuEqualsCopyBitwise) { CheckAgainstCopy(c10::kCPU); }

TEST(KernelsCastTest, CudaEqualsCopyBitwise) {
  FSDP_SKIP_WITHOUT_GPU();
  CheckAgainstCopy(c10::Device(c10::kCUDA, 0));
}

// A llama_1b unit's unshard at one shard: fp32 shards into bf16 parameters, one launch.
TEST(KernelsCastTest, CudaUnitShapesEqualCopyBitwise) {
  FSDP_SKIP_WITHOUT_GPU();
  at::manual_seed(44);
  const c10::Device cuda(c10::kCUDA, 0);
  std::vector<at::Tensor> shards, flats, expected;
  for (int64_t n : {2048L * 2048, 512L * 2048, 512L * 2048, 2048L * 2048, 8192L * 2048,
                    8192L * 2048, 2048L * 8192, 2048L, 2048L}) {
    shards.push_back(at::randn({n}, at::TensorOptions().device(cuda)) * 0.02);
    flats.push_back(at::empty({n}, at::TensorOptions().dtype(at::kBFloat16).device(cuda)));
    expected.push_back(shards.back().to(at::kBFloat16));
  }
  CastInto(flats, shards);
  ExpectBitwise(flats, expected, /*nan_aside=*/false, "Tensor::to on the GPU");
}

TEST(KernelsCastTest, RejectsPairsOfDifferentNumelCountOrDevice) {
  at::Tensor d = at::zeros({4});
  EXPECT_THAT([&] { CastInto({d}, {at::zeros({5})}); },
              ::testing::ThrowsMessage<c10::Error>(::testing::HasSubstr(
                  "cast: pair 0 ([4] on cpu = [5] on cpu) must have one numel, on cpu")));
  EXPECT_THAT(
      [&] {
        CastInto({d, d}, {at::zeros({4})});
      },
      ::testing::ThrowsMessage<c10::Error>(
          ::testing::HasSubstr("cast: 2 destinations but 1 sources")));
  EXPECT_THAT(
      [&] {
        CastInto({d, d}, {at::zeros({4}), at::empty({4}, at::kMeta)});
      },
      ::testing::ThrowsMessage<c10::Error>(::testing::HasSubstr("pair 1")));
  EXPECT_THROW(CastIntoComposite({d, d}, {at::zeros({4})}), c10::Error);
  CastInto({}, {});  // nothing to do
}

// The CPU branch is copy_ itself, pair by pair: other dtypes too (int, bool, fp64), as copy_
// converts them.
TEST(KernelsCastTest, CpuConvertsAnyDtypeAsCopy) {
  std::vector<at::Tensor> dsts = {at::zeros({3}, at::kInt), at::zeros({2, 2}, at::kDouble),
                                  at::zeros({2}, at::kBool)};
  std::vector<at::Tensor> srcs = {at::tensor({1.5f, -2.5f, 7.9f}), at::arange(4, at::kBFloat16),
                                  at::tensor({0.0, 3.0})};
  CastInto(dsts, srcs);
  EXPECT_TRUE(at::equal(dsts[0], at::tensor({1, -2, 7}, at::kInt)));
  EXPECT_TRUE(at::equal(dsts[1], at::arange(4, at::kDouble).view({2, 2})));
  EXPECT_TRUE(at::equal(dsts[2], at::tensor({0, 1}, at::kInt).to(at::kBool)));
}

}  // namespace
}  // namespace fsdp::kernels
