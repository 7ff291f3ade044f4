#include "engine/freeze.h"

#include <fnmatch.h>

#include <unordered_set>

#include <torch/nn/module.h>

#include "common/strings.h"

namespace fsdp {

bool MatchesGlob(const std::string& pattern, const std::string& name) {
  return fnmatch(pattern.c_str(), name.c_str(), /*flags=*/0) == 0;
}

absl::StatusOr<FreezeSummary> FreezeParameters(torch::nn::Module& module,
                                               const std::vector<std::string>& patterns) {
  FreezeSummary summary;
  if (patterns.empty()) return summary;
  const auto named = module.named_parameters(/*recurse=*/true);
  std::vector<bool> used(patterns.size(), false);
  std::unordered_set<const void*> frozen;  // TensorImpls: a tied tensor has several names
  for (const auto& item : named) {
    for (size_t i = 0; i < patterns.size(); ++i) {
      if (!MatchesGlob(patterns[i], item.key())) continue;
      used[i] = true;
      frozen.insert(item.value().unsafeGetTensorImpl());
    }
  }
  for (size_t i = 0; i < patterns.size(); ++i) {
    if (used[i]) continue;
    std::vector<std::string> examples;
    for (const auto& item : named) {
      if (examples.size() == 4) break;
      examples.push_back(item.key());
    }
    return absl::InvalidArgumentError(StrCat(
        "model.freeze: pattern '", patterns[i], "' matches no parameter (patterns are globs over ",
        "the parameter names, e.g. ", StrJoin(examples, ", "), ", ...; '*' matches dots too)"));
  }
  std::unordered_set<const void*> seen;
  for (const auto& item : named) {
    at::Tensor p = item.value();
    if (!seen.insert(p.unsafeGetTensorImpl()).second) continue;
    const bool freeze = frozen.count(p.unsafeGetTensorImpl()) > 0;
    if (freeze) p.set_requires_grad(false);
    (p.requires_grad() ? summary.trainable_params : summary.frozen_params) += 1;
    (p.requires_grad() ? summary.trainable_numel : summary.frozen_numel) += p.numel();
  }
  if (summary.trainable_params == 0) {
    return absl::InvalidArgumentError(
        StrCat("model.freeze: [", StrJoin(patterns, ", "),
               "] freezes every parameter; nothing would train (freeze a subset, e.g. "
               "\"tok_embeddings.*\")"));
  }
  return summary;
}

}  // namespace fsdp
