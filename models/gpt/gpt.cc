#include "models/gpt/gpt.h"

#include <cmath>
#include <optional>
#include <tuple>
#include <set>

#include <ATen/ATen.h>
#include <torch/nn/functional/activation.h>
#include <torch/nn/functional/linear.h>

#include "kernels/cross_entropy.h"
#include "kernels/linear.h"
#include "kernels/rms_norm.h"
#include "kernels/rope.h"
#include "kernels/swiglu.h"
#include "sharding/unit_forward.h"

namespace fsdp {
namespace {

torch::Tensor Param(torch::nn::Module& m, const std::string& name, std::vector<int64_t> shape) {
  return m.register_parameter(name, DeferredTensor(shape));
}

// Projections call fsdp::Linear, Linears or LinearAdd (unit_forward.h): selective activation
// checkpointing keeps their outputs.

// Rotary embedding on pairs of the last dimension: x [batch, seq, heads, head_dim].
torch::Tensor Rotate(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  int64_t t = x.size(1);
  auto c = cos.narrow(0, 0, t).view({1, t, 1, -1}).to(x.scalar_type());
  auto s = sin.narrow(0, 0, t).view({1, t, 1, -1}).to(x.scalar_type());
  auto pairs = x.unflatten(-1, {-1, 2});
  auto x1 = pairs.select(-1, 0), x2 = pairs.select(-1, 1);
  return torch::stack({x1 * c - x2 * s, x1 * s + x2 * c}, -1).flatten(-2);
}

}  // namespace

bool HasAttention(const ModelArgs& c) { return c.arch != "mlp"; }
bool HasBiases(const ModelArgs& c) { return c.arch == "gpt" || c.arch == "mlp"; }

bool UseFusedKernels(KernelMode mode, const at::Tensor& x) {
  return ResolveKernelMode(mode, x.is_cuda()) == KernelMode::kFused;
}

NormImpl::NormImpl(const GptConfig& c)
    : kernels(c.kernels), rms(c.norm == NormKind::kRmsNorm), eps(c.norm_eps) {
  weight = Param(*this, "weight", {c.dim});
  if (!rms) bias = Param(*this, "bias", {c.dim});
}

torch::Tensor NormImpl::forward(const torch::Tensor& x) {
  if (!rms) return at::layer_norm(x, {x.size(-1)}, weight, bias, eps);
  if (UseFusedKernels(kernels, x)) return kernels::RmsNorm(x, weight, eps);
  auto xf = x.to(at::kFloat);
  auto y = xf * at::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return y.to(x.scalar_type()) * weight;
}

std::pair<torch::Tensor, torch::Tensor> NormImpl::AddAndNorm(const torch::Tensor& x,
                                                             const torch::Tensor& residual) {
  if (rms && UseFusedKernels(kernels, x)) return kernels::AddRmsNorm(x, residual, weight, eps);
  torch::Tensor h = residual + x;
  return {h, forward(h)};
}

std::pair<torch::Tensor, torch::Tensor> NormImpl::ForkAndNorm(const torch::Tensor& x) {
  if (rms && UseFusedKernels(kernels, x)) return kernels::ForkRmsNorm(x, weight, eps);
  return {x, forward(x)};
}

AttentionImpl::AttentionImpl(const GptConfig& c)
    : kernels(c.kernels), n_heads(c.n_heads), n_kv_heads(c.kv_heads()), head_dim(c.head_dim()) {
  wq = Param(*this, "wq", {c.dim, c.dim});
  wk = Param(*this, "wk", {c.kv_dim(), c.dim});
  wv = Param(*this, "wv", {c.kv_dim(), c.dim});
  wo = Param(*this, "wo", {c.dim, c.dim});
  if (HasBiases(c)) {
    bq = Param(*this, "bq", {c.dim});
    bk = Param(*this, "bk", {c.kv_dim()});
    bv = Param(*this, "bv", {c.kv_dim()});
    bo = Param(*this, "bo", {c.dim});
  }
}

torch::Tensor AttentionImpl::forward(const torch::Tensor& x, const torch::Tensor& cos,
                                     const torch::Tensor& sin) {
  int64_t b = x.size(0), t = x.size(1);
  const bool fused = UseFusedKernels(kernels, x);
  // Fused: one node for the three projections. See Note [Residual stream gradients].
  std::vector<torch::Tensor> qkv =
      fused ? Linears(x, {wq, wk, wv}, {bq, bk, bv})
            : std::vector<torch::Tensor>{Linear(x, wq, bq), Linear(x, wk, bk), Linear(x, wv, bv)};
  auto q = qkv[0].view({b, t, n_heads, head_dim});
  auto k = qkv[1].view({b, t, n_kv_heads, head_dim});
  auto v = qkv[2].view({b, t, n_kv_heads, head_dim});
  if (cos.defined() && fused) {
    // In place on the projections' memory, unless selective checkpointing keeps those outputs
    // for the recompute (then they must stay as the matmul wrote them).
    if (KeepsMatmulOutputs()) {
      std::tie(q, k) = kernels::Rope(q, k, cos, sin);
    } else {
      kernels::RopeInPlace(q, k, cos, sin);
    }
  } else if (cos.defined()) {
    q = Rotate(q, cos, sin);
    k = Rotate(k, cos, sin);
  }
  // Grouped-query: SDPA maps query head h to key/value head h / (n_heads / n_kv_heads) itself
  // (enable_gqa), so autograd keeps k and v at kv_dim, not repeated to dim. The CPU flash
  // kernel does this natively (tests/models_test.cc checks it against repeated K/V); where a
  // CUDA kernel cannot, SDPA picks one that can or its math path, which repeats internally.
  // The flag only matters when the head counts differ.
  auto y = at::scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                            {}, 0.0, /*is_causal=*/true,
                                            /*scale=*/std::nullopt,
                                            /*enable_gqa=*/n_kv_heads != n_heads);
  return Linear(y.transpose(1, 2).reshape({b, t, n_heads * head_dim}), wo, bo);
}

FeedForwardImpl::FeedForwardImpl(const GptConfig& c)
    : kernels(c.kernels), swiglu(c.activation == Activation::kSwiglu) {
  w1 = Param(*this, "w1", {c.ffn(), c.dim});
  w2 = Param(*this, "w2", {c.dim, c.ffn()});
  if (swiglu) w3 = Param(*this, "w3", {c.ffn(), c.dim});
  if (HasBiases(c)) {
    b1 = Param(*this, "b1", {c.ffn()});
    b2 = Param(*this, "b2", {c.dim});
  }
}

torch::Tensor FeedForwardImpl::forward(const torch::Tensor& x, const torch::Tensor& residual) {
  // Note [SwiGLU projections]
  // The fused SwiGLU kernel also reads one fused projection [..., 2F] (one GEMM against
  // [w1; w3]), but w1 and w3 are separate parameters here (checkpoint and Hugging Face names):
  // stacking them per call would copy 2 x ffn x dim weights and keep that copy, saved by the
  // matmul, from the forward to the backward in every block (46 MB a block for llama_1b in
  // bf16, 235 MB for Llama 3 8B), after FSDP freed the parameters themselves. So two GEMMs in
  // one Linears node (one gradient of x), one kernel.
  if (UseFusedKernels(kernels, x)) {
    torch::Tensor act;
    if (swiglu) {
      std::vector<torch::Tensor> gate_up = Linears(x, {w1, w3}, {b1, torch::Tensor()});
      act = kernels::SwiGlu(gate_up[0], gate_up[1]);
    } else {
      act = torch::gelu(Linear(x, w1, b1), "tanh");
    }
    if (residual.defined() && !b2.defined()) return LinearAdd(residual, act, w2);
    torch::Tensor out = Linear(act, w2, b2);
    return residual.defined() ? residual + out : out;
  }
  torch::Tensor h = swiglu ? torch::silu(Linear(x, w1, b1)) * Linear(x, w3, torch::Tensor())
                           : torch::gelu(Linear(x, w1, b1), "tanh");
  torch::Tensor out = Linear(h, w2, b2);
  return residual.defined() ? residual + out : out;
}

TransformerBlockImpl::TransformerBlockImpl(const GptConfig& c, const torch::Tensor& cos,
                                           const torch::Tensor& sin)
    : cos(cos), sin(sin) {
  if (HasAttention(c)) {
    attention_norm = register_module("attention_norm", Norm(c));
    attention = register_module("attention", Attention(c));
  }
  ffn_norm = register_module("ffn_norm", Norm(c));
  feed_forward = register_module("feed_forward", FeedForward(c));
}

// Note [Residual stream gradients]
// A block's input and its h (input + attention) each feed a norm and the residual stream, and
// the norm's output feeds several projections (wq, wk, wv; w1, w3). Autograd sums the
// gradients of a tensor with several consumers with an add kernel per extra consumer (3 passes
// over the tensor's size each): in backward, two for the attention norm's output, one for the
// ffn norm's and one for the block's input (AddRmsNorm already sums h's two inside its
// kernel); in forward the block ends with an add, h + the MLP. With fused kernels:
//  - the projections of one input are one fsdp::Linears node (kernels::MultiLinear), whose
//    GEMMs accumulate the input's gradient (in-place addmm_, beta = 1): no add for q/k/v and
//    w1/w3;
//  - the input reaches the residual stream through the attention norm (ForkAndNorm,
//    kernels::ForkRmsNorm) and h through the ffn norm (AddAndNorm, kernels::AddRmsNorm): each
//    norm's backward kernel adds the residual's gradient to its own while writing it;
//  - h + the MLP is w2's GEMM adding h (fsdp::LinearAdd, at::addmm: its backward hands h the
//    gradient itself) when w2 has no bias. ATen copies h into the output before the GEMM
//    (Note [Residual addmm] in kernels/linear.h): a memcpy instead of the add kernel, the same
//    bytes; selective checkpointing then keeps the block's output as w2's.
// No add kernel is left in a Llama block (GptKernelsTest.FusedLlamaBlocksRunNoAddKernels). The
// composite path runs the ops it always ran (the first outputs of ForkAndNorm are the input
// itself): CPU parity with earlier runs stays bitwise.
torch::Tensor TransformerBlockImpl::forward(const torch::Tensor& x) {
  return UnitForward(this, x, [&](const torch::Tensor& input) {
    if (!attention) {
      auto [residual, normed] = ffn_norm->ForkAndNorm(input);
      return feed_forward->forward(normed, residual);
    }
    auto [residual, normed] = attention_norm->ForkAndNorm(input);
    auto [h, normed2] = ffn_norm->AddAndNorm(attention->forward(normed, cos, sin), residual);
    return feed_forward->forward(normed2, h);
  });
}

GptImpl::GptImpl(const GptConfig& c) : config(c) {
  tok_embeddings = Param(*this, "tok_embeddings", {c.vocab_size, c.dim});
  if (HasAttention(c) && c.positions == Positions::kLearned) {
    pos_embeddings = Param(*this, "pos_embeddings", {c.seq_len, c.dim});
  }
  if (HasAttention(c) && c.positions == Positions::kRope) {
    int64_t half = c.head_dim() / 2;
    auto inv = torch::pow(c.rope_theta, -torch::arange(half, torch::kDouble) * 2.0 / c.head_dim());
    auto angles = torch::outer(torch::arange(c.seq_len, torch::kDouble), inv);
    rope_cos = register_buffer("rope_cos", angles.cos().to(torch::kFloat));
    rope_sin = register_buffer("rope_sin", angles.sin().to(torch::kFloat));
  }
  layers = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < c.n_layers; ++i) layers->push_back(TransformerBlock(c, rope_cos, rope_sin));
  norm = register_module("norm", Norm(c));
  if (!c.tie_embeddings) output = Param(*this, "output", {c.vocab_size, c.dim});
}

torch::Tensor GptImpl::Trunk(const torch::Tensor& tokens) {
  torch::Tensor h = at::embedding(tok_embeddings, tokens);
  if (pos_embeddings.defined()) h = h + pos_embeddings.narrow(0, 0, tokens.size(1));
  for (const auto& layer : *layers) h = layer->as<TransformerBlockImpl>()->forward(h);
  return norm->forward(h);
}

torch::Tensor GptImpl::forward(const torch::Tensor& tokens) {
  return UnitForward(this, tokens, [&](const torch::Tensor& t) {
    return torch::nn::functional::linear(Trunk(t), HeadWeight());
  });
}

torch::Tensor GptImpl::loss(const torch::Tensor& tokens, const torch::Tensor& targets) {
  return UnitForward(this, tokens, [&](const torch::Tensor& t) {
    torch::Tensor h = Trunk(t);
    if (UseFusedKernels(config.kernels, h)) {
      const int64_t tokens = h.numel() / h.size(-1);
      const int64_t chunk =
          config.loss_chunk_tokens > 0
              ? config.loss_chunk_tokens
              : kernels::DefaultChunkTokens(tokens, config.vocab_size, config.dim);
      return kernels::LinearCrossEntropy(h.reshape({tokens, h.size(-1)}), HeadWeight(),
                                         targets.reshape({tokens}), chunk);
    }
    return at::cross_entropy_loss(
        torch::nn::functional::linear(h, HeadWeight()).flatten(0, 1).to(at::kFloat),
        targets.flatten());
  });
}

std::vector<std::shared_ptr<torch::nn::Module>> GptImpl::FsdpUnits() const {
  std::vector<std::shared_ptr<torch::nn::Module>> units;
  for (const auto& layer : *layers) units.push_back(layer);
  return units;
}

InitSpec GptImpl::InitSpecFor(const std::string& name) const {
  auto ends_with = [&](const std::string& suffix) { return name.ends_with(suffix); };
  if (name.find("norm.") != std::string::npos) {
    return ends_with(".weight") ? InitSpec::Ones() : InitSpec::Zeros();
  }
  if (ends_with(".bq") || ends_with(".bk") || ends_with(".bv") || ends_with(".bo") ||
      ends_with(".b1") || ends_with(".b2")) {
    return InitSpec::Zeros();
  }
  // Projections into the residual stream are scaled down with depth (GPT-2).
  if (ends_with(".wo") || ends_with(".w2")) {
    return InitSpec::Normal(config.init_std / std::sqrt(2.0 * config.n_layers));
  }
  if (name == "pos_embeddings") return InitSpec::Normal(config.init_std / 2);
  return InitSpec::Normal(config.init_std);
}

ParamInitFn GptImpl::ParamInit(uint64_t seed) const {
  return SeededInit(seed, [this](const std::string& name) { return InitSpecFor(name); });
}

void GptImpl::MaterializeSeeded(uint64_t seed) {
  torch::NoGradGuard no_grad;
  for (auto& item : named_parameters()) {
    if (!IsDeferred(item.value())) continue;
    std::vector<int64_t> shape(item.value().sizes().begin(), item.value().sizes().end());
    item.value().set_data(SeededFull(seed, item.key(), shape, InitSpecFor(item.key())));
  }
}

int64_t GptImpl::NumParameters() const {
  std::set<const void*> seen;
  int64_t n = 0;
  for (const auto& p : parameters()) {
    if (seen.insert(p.unsafeGetTensorImpl()).second) n += p.numel();
  }
  return n;
}

double GptImpl::FlopsPerToken() const {
  // Matmul parameters: everything but the input embedding lookup (counted once when tied,
  // since the head multiplies by it) and the learned positions.
  double matmul = static_cast<double>(NumParameters());
  if (!config.tie_embeddings) matmul -= static_cast<double>(tok_embeddings.numel());
  if (pos_embeddings.defined()) matmul -= static_cast<double>(pos_embeddings.numel());
  double attention = HasAttention(config)
                         ? 12.0 * config.n_layers * config.dim * config.seq_len
                         : 0.0;
  return 6.0 * matmul + attention;
}

namespace {

// The Model interface over a Gpt module.
class GptModel final : public Model {
 public:
  explicit GptModel(const ModelArgs& args) : gpt_(args) {}
  std::shared_ptr<torch::nn::Module> module() const override { return gpt_.ptr(); }
  at::Tensor Forward(const at::Tensor& tokens) override { return gpt_->forward(tokens); }
  at::Tensor Loss(const at::Tensor& tokens, const at::Tensor& targets) override {
    return gpt_->loss(tokens, targets);
  }
  std::vector<std::shared_ptr<torch::nn::Module>> FsdpUnits() const override {
    return gpt_->FsdpUnits();
  }
  ParamInitFn ParamInit(uint64_t seed) const override { return gpt_->ParamInit(seed); }
  void MaterializeSeeded(uint64_t seed) override { gpt_->MaterializeSeeded(seed); }
  double FlopsPerToken() const override { return gpt_->FlopsPerToken(); }
  int64_t NumParameters() const override { return gpt_->NumParameters(); }

 private:
  Gpt gpt_;
};

}  // namespace

ModelFamily GptFamily(std::string arch, std::string description) {
  return {.arch = std::move(arch),
          .description = std::move(description),
          .build = [](const ModelArgs& args) -> std::unique_ptr<Model> {
            return std::make_unique<GptModel>(args);
          },
          .count = CountGpt,
          .block_activation_bytes = GptBlockActivationBytes,
          .head_bytes_per_token = GptHeadBytesPerToken};
}

}  // namespace fsdp
