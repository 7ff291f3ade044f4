// kernels::AccumulateInto against at::add_, bit for bit: fp32 sums plus bf16, fp16 and fp32
// gradients, odd sizes, more pairs than one launch's table, zero-size pairs, misaligned views
// and strided pairs. CPU reference always; the CUDA kernel with a GPU (against at::add_ on the
// GPU and on the CPU).
#include "kernels/accumulate.h"

#include <cstdint>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "tests/kernels_testing.h"
#include "tests/multi_tensor_testing.h"

namespace fsdp::kernels {
namespace {

using testing::Clones;
using testing::Pairs;
using testing::Place;

// A list of pairs: sums [n] fp32 (large, so most additions round) and gradients of `dtype`,
// some at an odd element offset in their buffer, some strided, some empty.
Pairs MakePairs(c10::Device device) {
  at::manual_seed(41);
  Pairs p;
  const at::ScalarType dtypes[] = {at::kBFloat16, at::kHalf, at::kFloat};
  for (int64_t i = 0; i < 130; ++i) {
    const int64_t n = i % 13 == 12 ? 0 : 1 + (97 * i) % 20011;
    at::Tensor dst = (at::randn({n}) * 1000).to(device);
    at::Tensor src = at::randn({n}).to(device, dtypes[i % 3]);
    if (i % 7 == 3) dst = Place(dst, 1);
    if (i % 5 == 2) src = Place(src, 1);
    p.dsts.push_back(dst);
    p.srcs.push_back(src);
  }
  // Shapes that differ; a strided source; a non-fp32 source.
  p.dsts.push_back((at::randn({6, 70}) * 100).to(device));
  p.srcs.push_back(at::randn({70, 6}).to(device, at::kBFloat16).t());
  p.dsts.push_back((at::randn({333}) * 100).to(device));
  p.srcs.push_back(at::randn({9, 37}).to(device, at::kDouble));
  return p;
}

void ExpectBitwise(const std::vector<at::Tensor>& actual, const std::vector<at::Tensor>& expected,
                   const char* what) {
  ASSERT_EQ(actual.size(), expected.size());
  for (size_t i = 0; i < actual.size(); ++i) {
    at::Tensor a = actual[i].cpu().contiguous(), e = expected[i].cpu().contiguous();
    EXPECT_TRUE(at::equal(a.view(at::kInt), e.view(at::kInt)))
        << what << ": pair " << i << " " << testing::AllClose(a, e, 0, 0, what).message();
  }
}

void CheckAgainstAtAdd(c10::Device device) {
  Pairs p = MakePairs(device);
  std::vector<at::Tensor> expected = Clones(p.dsts);
  for (size_t i = 0; i < expected.size(); ++i) {
    expected[i].add_(p.srcs[i].reshape(expected[i].sizes()));
  }
  std::vector<at::Tensor> actual = Clones(p.dsts);
  AccumulateInto(actual, p.srcs);
  ExpectBitwise(actual, expected, "at::add_ on the same device");
  if (device.is_cuda()) {  // and the CPU's at::add_
    std::vector<at::Tensor> cpu;
    for (size_t i = 0; i < p.dsts.size(); ++i) {
      cpu.push_back(p.dsts[i].cpu());
      cpu.back().add_(p.srcs[i].cpu().reshape(cpu.back().sizes()));
    }
    ExpectBitwise(actual, cpu, "at::add_ on the CPU");
  }
}

TEST(KernelsAccumulateTest, CpuEqualsAtAddBitwise) { CheckAgainstAtAdd(c10::kCPU); }

TEST(KernelsAccumulateTest, CudaEqualsAtAddBitwise) {
  FSDP_SKIP_WITHOUT_GPU();
  CheckAgainstAtAdd(c10::Device(c10::kCUDA, 0));
}

TEST(KernelsAccumulateTest, RejectsPairsOfDifferentNumelOrCount) {
  at::Tensor d = at::zeros({4});
  EXPECT_THROW(AccumulateInto({d}, {at::zeros({5})}), c10::Error);
  EXPECT_THROW(AccumulateInto({d, d}, {at::zeros({4})}), c10::Error);
  AccumulateInto({}, {});  // nothing to do
}

}  // namespace
}  // namespace fsdp::kernels
