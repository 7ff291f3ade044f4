// A GPT / Llama-style decoder in libtorch's C++ frontend, and the token-wise MLP model used by
// the smallest tests: the model families gpt, llama and mlp (models/registry.cc). Sizes and
// choices come from ModelArgs (models/model.h; the YAML `model` section):
//   token embedding, learned or rotary positions, LayerNorm or RMSNorm, GELU or SwiGLU MLP,
//   causal attention through scaled_dot_product_attention, optional tied output projection.
//
// FSDP units: one per transformer block (FsdpUnits()); the root unit holds the embeddings, the
// final norm and the head (the tied embedding/head pair must share a unit). Every forward goes
// through fsdp::UnitForward, so the model also runs unchanged in one process.
//
// Initialisation: parameters are created without memory (fsdp::DeferredTensor); values are
// then a function of (seed, name, element index) only (InitSpecFor + SeededInit): either each
// rank creates its shards when wrapping (FsdpOptions::param_init = ParamInit(seed)) or a single
// process materialises them all (MaterializeSeeded). Both give identical parameters.
//
//   Gpt model(ModelArgs{.vocab_size = 256, .dim = 128, .n_layers = 4, .n_heads = 4});
//   model->MaterializeSeeded(1234);                 // one process
//   torch::Tensor logits = model->forward(tokens);  // [batch, seq, vocab]
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/pimpl.h>

#include "models/model.h"
#include "sharding/deferred_init.h"

namespace fsdp {

// The arch decides two things: gpt (biases), llama (no biases), mlp (biases, no attention).
using GptConfig = ModelArgs;
bool HasAttention(const ModelArgs& c);
bool HasBiases(const ModelArgs& c);
// Whether model.kernels asks for the fused kernels (kernels/) on tensors like `x`: fused, or
// auto on a CUDA tensor.
bool UseFusedKernels(KernelMode mode, const at::Tensor& x);

// LayerNorm (weight, bias) or RMSNorm (weight) over the last dimension.
struct NormImpl : torch::nn::Module {
  NormImpl(const GptConfig& c);
  torch::Tensor forward(const torch::Tensor& x);
  // (x + residual, norm of it); RMSNorm with fused kernels does both in one pass.
  std::pair<torch::Tensor, torch::Tensor> AddAndNorm(const torch::Tensor& x,
                                                     const torch::Tensor& residual);
  // (x, norm of x), for an x that also feeds the residual stream: use the first output there.
  // RMSNorm with fused kernels adds that output's gradient to x's in its backward kernel
  // (kernels::ForkRmsNorm); otherwise it is x itself. See Note [Residual stream gradients].
  std::pair<torch::Tensor, torch::Tensor> ForkAndNorm(const torch::Tensor& x);
  KernelMode kernels;
  bool rms;
  double eps;
  torch::Tensor weight, bias;
};
TORCH_MODULE(Norm);

// Causal self-attention, multi-head or grouped-query: wq and wo are [dim, dim], wk and wv
// [kv_dim, dim] (n_kv_heads heads, each shared by n_heads / n_kv_heads consecutive query heads,
// as Llama's repeat_kv), biases likewise.
struct AttentionImpl : torch::nn::Module {
  explicit AttentionImpl(const GptConfig& c);
  // x: [batch, seq, dim]; rope: [seq_max, head_dim / 2] cos and sin tables, or undefined.
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);
  KernelMode kernels;
  int64_t n_heads, n_kv_heads, head_dim;
  torch::Tensor wq, wk, wv, wo, bq, bk, bv, bo;
};
TORCH_MODULE(Attention);

struct FeedForwardImpl : torch::nn::Module {
  explicit FeedForwardImpl(const GptConfig& c);
  // residual + the MLP of x (residual undefined: the MLP alone). SwiGLU with fused kernels:
  // one Linears for w1 and w3, one kernels::SwiGlu, and w2's GEMM adding the residual when w2
  // has no bias (fsdp::LinearAdd). See Note [Residual stream gradients].
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& residual = {});
  KernelMode kernels;
  bool swiglu;
  torch::Tensor w1, w2, w3, b1, b2;
};
TORCH_MODULE(FeedForward);

struct TransformerBlockImpl : torch::nn::Module {
  TransformerBlockImpl(const GptConfig& c, const torch::Tensor& cos, const torch::Tensor& sin);
  torch::Tensor forward(const torch::Tensor& x);  // an FSDP unit
  Norm attention_norm{nullptr}, ffn_norm{nullptr};
  Attention attention{nullptr};
  FeedForward feed_forward{nullptr};
  torch::Tensor cos, sin;  // shared rope tables (not registered here: the root's buffers)
};
TORCH_MODULE(TransformerBlock);

struct GptImpl : torch::nn::Module {
  explicit GptImpl(const GptConfig& config);
  // tokens: [batch, seq] int64 -> logits [batch, seq, vocab].
  torch::Tensor forward(const torch::Tensor& tokens);
  // Mean cross-entropy against targets [batch, seq] (0-dim fp32). With fused kernels the head
  // and the loss run in chunks of tokens (kernels/cross_entropy.h): no [batch, seq, vocab]
  // logits.
  torch::Tensor loss(const torch::Tensor& tokens, const torch::Tensor& targets);

  // The modules that become FSDP units (the transformer blocks).
  std::vector<std::shared_ptr<torch::nn::Module>> FsdpUnits() const;
  // How each parameter is initialised (by its state-dict name).
  InitSpec InitSpecFor(const std::string& name) const;
  // FsdpOptions::param_init for deferred parameters.
  ParamInitFn ParamInit(uint64_t seed) const;
  // Gives every deferred parameter its seeded values (single process, no sharding).
  void MaterializeSeeded(uint64_t seed);
  // Training FLOPs per token (forward + backward): 6 x matmul parameters + 12 x layers x
  // dim x seq_len for attention scores (the PaLM / nanoGPT estimate). See docs/models.md.
  double FlopsPerToken() const;
  int64_t NumParameters() const;  // each tensor once

  GptConfig config;
  // Embeddings, blocks and the final norm: [batch, seq, dim].
  torch::Tensor Trunk(const torch::Tensor& tokens);
  const torch::Tensor& HeadWeight() const { return output.defined() ? output : tok_embeddings; }

  torch::Tensor tok_embeddings, pos_embeddings, output;  // output undefined when tied
  torch::Tensor rope_cos, rope_sin;                      // buffers (rope only)
  torch::nn::ModuleList layers{nullptr};
  Norm norm{nullptr};
};
TORCH_MODULE(Gpt);

// The registry's entries for gpt, llama and mlp (models/registry.cc).
ModelFamily GptFamily(std::string arch, std::string description);
// Analytic counts (gpt_counts.cc); equal to Gpt(c)->NumParameters() and FlopsPerToken().
ModelCounts CountGpt(const ModelArgs& c);
// See Note [Activation bytes] (gpt_counts.cc).
BlockActivationBytes GptBlockActivationBytes(const ModelArgs& c, double compute_bytes);
double GptHeadBytesPerToken(const ModelArgs& c, double compute_bytes);

}  // namespace fsdp
