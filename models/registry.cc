// The model registry: every family `model.arch` can name. A new model is a folder under models/
// with a function returning its ModelFamily, and one line here.
#include <vector>

#include <ATen/ATen.h>

#include "models/gpt/gpt.h"
#include "models/model.h"

namespace fsdp {
namespace {

const std::vector<ModelFamily>& Families() {
  static const std::vector<ModelFamily> families = {
      GptFamily("gpt", "GPT-2-style decoder: biases, learned positions or rope"),
      GptFamily("llama", "Llama-style decoder: no biases (rmsnorm, swiglu, rope in its configs)"),
      GptFamily("mlp", "token-wise MLP blocks, no attention (the smallest tests)"),
  };
  return families;
}

}  // namespace

int64_t ModelArgs::ffn() const {
  if (ffn_hidden > 0) return ffn_hidden;
  if (activation == Activation::kSwiglu) return (8 * dim / 3 + 63) / 64 * 64;
  return 4 * dim;
}

const char* KernelModeName(KernelMode mode) {
  switch (mode) {
    case KernelMode::kAuto: return "auto";
    case KernelMode::kFused: return "fused";
    case KernelMode::kComposite: return "composite";
  }
  return "?";
}

KernelMode ResolveKernelMode(KernelMode mode, bool on_cuda) {
  if (mode != KernelMode::kAuto) return mode;
  return on_cuda ? KernelMode::kFused : KernelMode::kComposite;
}

at::Tensor Model::Loss(const at::Tensor& tokens, const at::Tensor& targets) {
  at::Tensor logits = Forward(tokens);
  return at::cross_entropy_loss(logits.flatten(0, 1).to(at::kFloat), targets.flatten());
}

const ModelFamily* FindModelFamily(std::string_view arch) {
  for (const ModelFamily& family : Families()) {
    if (family.arch == arch) return &family;
  }
  return nullptr;
}

std::vector<std::string> ModelArchs() {
  std::vector<std::string> archs;
  for (const ModelFamily& family : Families()) archs.push_back(family.arch);
  return archs;
}

}  // namespace fsdp
