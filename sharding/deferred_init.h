// Deferred initialisation: build a model whose parameters have their full shapes but no
// memory, and let each rank create only its own shard from a seed, so that no rank ever
// materialises the whole model.
//
// Values are a pure function of (seed, parameter name, global element index), so every world
// size, mesh and strategy produces the same model, and a single process can produce the full
// tensor with the same call (first_row 0, all rows).
//
//   struct MyLinearImpl : torch::nn::Module {
//     MyLinearImpl(int64_t in, int64_t out, bool deferred) {
//       weight = register_parameter("weight", deferred ? fsdp::DeferredTensor({out, in})
//                                                      : torch::empty({out, in}));
//     }
//   };
//   FsdpOptions options;
//   options.param_init = fsdp::SeededInit(/*seed=*/42, [](const std::string& name) {
//     return name.ends_with(".bias") ? fsdp::InitSpec::Zeros() : fsdp::InitSpec::Normal(0.02);
//   });
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/TensorOptions.h>

namespace fsdp {

// A tensor of `shape` whose storage holds no bytes yet (a C++ stand-in for the meta device).
at::Tensor DeferredTensor(const std::vector<int64_t>& shape,
                          c10::TensorOptions options = c10::TensorOptions().dtype(c10::kFloat));
// True when `t` is such a tensor (its storage is smaller than its elements need).
bool IsDeferred(const at::Tensor& t);

struct InitSpec {
  enum class Kind { kConstant, kNormal, kUniform };
  Kind kind = Kind::kConstant;
  double a = 0, b = 0;  // constant: a; normal: mean a, std b; uniform: [a, b)
  static InitSpec Zeros() { return {Kind::kConstant, 0, 0}; }
  static InitSpec Ones() { return {Kind::kConstant, 1, 0}; }
  static InitSpec Normal(double std, double mean = 0) { return {Kind::kNormal, mean, std}; }
  static InitSpec Uniform(double lo, double hi) { return {Kind::kUniform, lo, hi}; }
};

// Fills `rows` (a [num_rows, ...] slice of parameter `name`, starting at global row
// `first_row`, `row_numel` elements per row) with the seeded values of those elements.
using ParamInitFn = std::function<void(const std::string& name, int64_t first_row,
                                       int64_t row_numel, at::Tensor& rows)>;

ParamInitFn SeededInit(uint64_t seed, std::function<InitSpec(const std::string& name)> spec_of);

// The whole parameter, as SeededInit would fill it across all shards (for references/tests).
at::Tensor SeededFull(uint64_t seed, const std::string& name, const std::vector<int64_t>& shape,
                      const InitSpec& spec);

}  // namespace fsdp
