// model.freeze: glob patterns over parameter names whose parameters do not train.
//
// Applied to the whole module before it is wrapped, so that the sharding layer sees the
// parameters as frozen (requires_grad false): FsdpModel::parameters() leaves them out of the
// optimizer, a unit reduce-scatters only its trainable parameters and a unit with none skips
// the reduce-scatter, and checkpoints still save and load them (without optimizer state).
// Patterns are fnmatch(3) globs matched against the state-dict names ("layers.0.attn.wq.weight"):
// '*' matches any characters, dots included, '?' one character, "[...]" a set. A tied tensor
// is frozen when any of its names matches.
//
//   FSDP_ASSIGN_OR_RETURN(FreezeSummary frozen,
//                         FreezeParameters(*model->module(), {"tok_embeddings.*", "layers.0.*"}));
//   // frozen.frozen_params == 4, frozen.frozen_numel == ...
//
// Every rank must apply the same patterns (the trainer applies the config's on every rank);
// errors name the pattern: one that matches no parameter (with examples of the names), or a
// set of patterns that leaves nothing to train.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace torch::nn {
class Module;
}

namespace fsdp {

// Whether `name` matches the glob `pattern` (the whole name).
bool MatchesGlob(const std::string& pattern, const std::string& name);

struct FreezeSummary {
  int64_t frozen_params = 0, trainable_params = 0;  // distinct tensors
  int64_t frozen_numel = 0, trainable_numel = 0;
};

// Sets requires_grad false on every parameter of `module` whose name matches one of `patterns`.
// kInvalidArgument naming the pattern when one matches nothing, or when nothing would train.
absl::StatusOr<FreezeSummary> FreezeParameters(torch::nn::Module& module,
                                               const std::vector<std::string>& patterns);

}  // namespace fsdp
