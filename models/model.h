// What the engine, the planner and the benchmarks need of a model, and the registry that finds
// a model family by the YAML key `model.arch`.
//
// A model family is one folder under models/ (models/gpt/ builds gpt, llama and mlp) and one
// line in models/registry.cc. It provides:
//   - Build: the libtorch module behind the `Model` interface (forward, its FSDP units, seeded
//     initialisation, FLOPs per token). The module routes each unit's forward through
//     fsdp::UnitForward (sharding/unit_forward.h) and knows nothing else of the engine.
//   - Count: parameter counts and dim-0 shapes per unit, without building anything, so that
//     `fsdp plan` answers for 175B parameters in microseconds.
//   - activation and head bytes per token, for the planner's memory model (per activation
//     checkpointing mode: sharding/options.h ActivationCheckpointing).
//
//   const ModelFamily* family = FindModelFamily("llama");
//   std::unique_ptr<Model> model = family->build(ModelArgs{.arch = "llama", .dim = 256});
//   model->MaterializeSeeded(1234);
//   at::Tensor logits = model->Forward(tokens);          // [batch, seq, vocab]
//   at::Tensor loss = model->Loss(tokens, targets);      // 0-dim fp32, what training minimises
//   ModelCounts counts = family->count(args);             // == model->NumParameters()
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "sharding/deferred_init.h"

namespace torch::nn {
class Module;
}

namespace fsdp {

enum class NormKind { kLayerNorm, kRmsNorm };
enum class Activation { kGelu, kSwiglu };
enum class Positions { kLearned, kRope };
// model.kernels: how a model's elementwise work runs (kernels/: RMSNorm, residual-add + RMSNorm,
// RoPE, SwiGLU, the chunked LM head + cross-entropy):
//   auto       the fused kernels on CUDA tensors, ATen's composite ops on the CPU;
//   fused      the fused kernels everywhere (on the CPU, their reference implementations);
//   composite  ATen's composite ops everywhere (the arithmetic of the PyTorch eager model).
enum class KernelMode { kAuto, kFused, kComposite };
const char* KernelModeName(KernelMode mode);
// What `mode` means for work on a GPU (`on_cuda`) or on the CPU: fused or composite. The one place
// auto is decided: the model's layers (per tensor), the start line and the planner all ask here.
KernelMode ResolveKernelMode(KernelMode mode, bool on_cuda);

// The YAML `model` section's shape keys, typed (engine/config.cc parses the names).
struct ModelArgs {
  std::string arch = "gpt";  // a registered family (ModelArchs())
  int64_t vocab_size = 256;
  int64_t dim = 128;
  int64_t n_layers = 4;
  int64_t n_heads = 4;
  // Key/value heads (grouped-query attention: each serves n_heads / n_kv_heads query heads);
  // 0: n_heads (multi-head attention).
  int64_t n_kv_heads = 0;
  int64_t seq_len = 64;
  int64_t ffn_hidden = 0;  // 0: 4 x dim (gelu) or 8/3 x dim rounded up to 64 (swiglu)
  NormKind norm = NormKind::kLayerNorm;
  Activation activation = Activation::kGelu;
  Positions positions = Positions::kLearned;
  bool tie_embeddings = true;
  double norm_eps = 1e-5;
  double rope_theta = 10000.0;
  double init_std = 0.02;
  KernelMode kernels = KernelMode::kAuto;
  // Tokens per chunk of the fused LM head + cross-entropy (kernels/cross_entropy.h); 0: chosen
  // from the vocabulary and dim (kernels::DefaultChunkTokens).
  int64_t loss_chunk_tokens = 0;

  int64_t head_dim() const { return dim / n_heads; }
  int64_t kv_heads() const { return n_kv_heads > 0 ? n_kv_heads : n_heads; }
  // Rows of wk and wv: kv_heads x head_dim (= dim without grouped-query attention).
  int64_t kv_dim() const { return kv_heads() * head_dim(); }
  int64_t ffn() const;
};

// Analytic sizes (no tensors): what `fsdp plan` and the benchmarks' theory lines count.
struct ModelCounts {
  int64_t params = 0;
  std::vector<int64_t> unit_params;  // root first, then the units in forward order
  // Per unit (same order), every parameter as (dim0 rows, elements per row): the padding of
  // dim-0 sharding depends on it.
  std::vector<std::vector<std::pair<int64_t, int64_t>>> unit_shapes;
  double flops_per_token = 0;
  double block_flops_per_token = 0;  // one non-root unit's share (the planner's overlap model)
  // The part of block_flops_per_token in the attention core (softmax(QK^T)V, no projections):
  // what selective activation checkpointing recomputes besides elementwise ops.
  double block_attention_flops_per_token = 0;
};

// Bytes per token one non-root unit keeps for its backward, by how it is checkpointed (Note
// [Activation checkpointing] in sharding/checkpoint_unit.h).
struct BlockActivationBytes {
  double none = 0;       // everything autograd saves; also what a recompute materialises
  double full = 0;       // the unit's input only
  double selective = 0;  // the input and the output of every matmul
  // At the unit's backward, beyond `none` (Note [Recompute and backward bytes] in
  // models/gpt/gpt_counts.cc): the backward's own transient gradients (T), and for a
  // checkpointed unit (X) the recomputed output, the input where `none` does not keep it, and,
  // selective, the matmul outputs `none` does not keep.
  double backward_transient = 0;
  double recompute_output = 0;
  double recompute_input_unkept = 0;
  double selective_unkept = 0;
};

// A built model, as the trainer drives it.
class Model {
 public:
  virtual ~Model() = default;
  // The module to wrap (its parameters are deferred until MaterializeSeeded or sharding).
  virtual std::shared_ptr<torch::nn::Module> module() const = 0;
  // tokens [batch, seq] int64 -> logits [batch, seq, vocab].
  virtual at::Tensor Forward(const at::Tensor& tokens) = 0;
  // The training loss: mean next-token cross-entropy of `tokens` [batch, seq] against
  // `targets` [batch, seq] int64, a 0-dim fp32 tensor. The default computes it from Forward's
  // logits in fp32 (ATen's cross_entropy); a model may override it to never hold the whole
  // batch's logits (the GPT family's fused head: kernels/cross_entropy.h).
  virtual at::Tensor Loss(const at::Tensor& tokens, const at::Tensor& targets);
  // The submodules that become FSDP units (the root unit holds the rest).
  virtual std::vector<std::shared_ptr<torch::nn::Module>> FsdpUnits() const = 0;
  // FsdpOptions::param_init: each rank creates only its shards' values.
  virtual ParamInitFn ParamInit(uint64_t seed) const = 0;
  // Gives every deferred parameter its seeded values (one process, no sharding).
  virtual void MaterializeSeeded(uint64_t seed) = 0;
  // Training FLOPs per token (forward + backward), for MFU. See docs/models.md.
  virtual double FlopsPerToken() const = 0;
  virtual int64_t NumParameters() const = 0;  // each tensor once
};

struct ModelFamily {
  std::string arch;         // the `model.arch` value
  std::string description;  // one line, for `fsdp plan` and docs
  std::function<std::unique_ptr<Model>(const ModelArgs&)> build;
  std::function<ModelCounts(const ModelArgs&)> count;  // equals the built model's
  // Bytes per token one non-root unit keeps until its backward, `compute_bytes` per element of
  // the compute dtype.
  std::function<BlockActivationBytes(const ModelArgs&, double compute_bytes)>
      block_activation_bytes;
  // Bytes per token of the head and loss (logits, fp32 loss copies), `compute_bytes` per element.
  std::function<double(const ModelArgs&, double compute_bytes)> head_bytes_per_token;
};

// The family registered under `arch`, or null.
const ModelFamily* FindModelFamily(std::string_view arch);
// Every registered arch, in registry order (for "valid: ..." messages).
std::vector<std::string> ModelArchs();

}  // namespace fsdp
