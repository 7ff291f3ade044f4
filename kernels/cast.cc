#include "kernels/cast.h"

#include <array>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/variable.h>

#include "kernels/cuda/cast.h"
#include "kernels/dispatch.h"
#include "kernels/multi_tensor.h"

namespace fsdp::kernels {
namespace {

constexpr const char* kName = "cast";

bool KernelDType(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
}

// Whether the kernel takes the pair (See the header's contract).
bool KernelTakes(const at::Tensor& dst, const at::Tensor& src) {
  return KernelDType(dst.scalar_type()) && KernelDType(src.scalar_type()) && dst.is_contiguous() &&
         src.is_contiguous() && !dst.is_neg() && !src.is_neg();
}

void CopyPair(const at::Tensor& dst, const at::Tensor& src) { dst.copy_(src.reshape(dst.sizes())); }

}  // namespace

void CastInto(at::TensorList dsts, at::TensorList srcs) {
  CheckPairs(dsts, srcs, kName, "=");
  if (dsts.empty()) return;
  const at::Tensor& like = dsts[0];
  if (!OnCuda(like, kName)) {
    CastIntoComposite(dsts, srcs);
    return;
  }
  // One launch per (dst dtype, src dtype): kernels/cuda/types.h's DType codes index the groups.
  std::array<std::vector<cuda::CastPair>, 9> groups;
  for (size_t i = 0; i < dsts.size(); ++i) {
    if (!KernelTakes(dsts[i], srcs[i])) {
      CopyPair(dsts[i], srcs[i]);
      continue;
    }
    torch::autograd::impl::bump_version(dsts[i]);  // as copy_ would
    if (dsts[i].numel() == 0) continue;
    const int d = static_cast<int>(ToKernelDType(dsts[i], kName));
    const int s = static_cast<int>(ToKernelDType(srcs[i], kName));
    groups[3 * d + s].push_back({dsts[i].data_ptr(), srcs[i].const_data_ptr(), dsts[i].numel()});
  }
  for (int g = 0; g < 9; ++g) {
    if (groups[g].empty()) continue;
    FSDP_CUDA_LAUNCH(like, kName,
                     cuda::CastInto(groups[g].data(), static_cast<int64_t>(groups[g].size()),
                                    static_cast<cuda::DType>(g / 3),
                                    static_cast<cuda::DType>(g % 3), CurrentStream(like)));
  }
}

void CastIntoComposite(at::TensorList dsts, at::TensorList srcs) {
  CheckPairCount(dsts, srcs, kName);
  for (size_t i = 0; i < dsts.size(); ++i) CopyPair(dsts[i], srcs[i]);
}

}  // namespace fsdp::kernels
