#include "kernels/accumulate.h"

#include <array>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/variable.h>

#include "kernels/cuda/accumulate.h"
#include "kernels/dispatch.h"
#include "kernels/multi_tensor.h"

namespace fsdp::kernels {
namespace {

constexpr const char* kName = "accumulate";

// Whether the kernel takes the pair (See the header's contract).
bool KernelTakes(const at::Tensor& dst, const at::Tensor& src) {
  const at::ScalarType s = src.scalar_type();
  return dst.scalar_type() == at::kFloat && dst.is_contiguous() && src.is_contiguous() &&
         (s == at::kFloat || s == at::kBFloat16 || s == at::kHalf);
}

void AddPair(const at::Tensor& dst, const at::Tensor& src) { dst.add_(src.reshape(dst.sizes())); }

}  // namespace

void AccumulateInto(at::TensorList dsts, at::TensorList srcs) {
  CheckPairs(dsts, srcs, kName, "+=");
  if (dsts.empty()) return;
  const at::Tensor& like = dsts[0];
  if (!OnCuda(like, kName)) {
    AccumulateIntoComposite(dsts, srcs);
    return;
  }
  // One launch per src dtype (kernels/cuda/types.h's DType codes index the groups).
  std::array<std::vector<cuda::AccumulatePair>, 3> groups;
  for (size_t i = 0; i < dsts.size(); ++i) {
    if (!KernelTakes(dsts[i], srcs[i])) {
      AddPair(dsts[i], srcs[i]);
      continue;
    }
    torch::autograd::impl::bump_version(dsts[i]);  // as at::add_ would
    if (dsts[i].numel() == 0) continue;
    groups[static_cast<int>(ToKernelDType(srcs[i], kName))].push_back(
        {dsts[i].data_ptr<float>(), srcs[i].const_data_ptr(), dsts[i].numel()});
  }
  for (int d = 0; d < 3; ++d) {
    if (groups[d].empty()) continue;
    FSDP_CUDA_LAUNCH(like, kName,
                     cuda::AccumulateInto(groups[d].data(), static_cast<int64_t>(groups[d].size()),
                                          static_cast<cuda::DType>(d), CurrentStream(like)));
  }
}

void AccumulateIntoComposite(at::TensorList dsts, at::TensorList srcs) {
  CheckPairCount(dsts, srcs, kName);
  for (size_t i = 0; i < dsts.size(); ++i) AddPair(dsts[i], srcs[i]);
}

}  // namespace fsdp::kernels
