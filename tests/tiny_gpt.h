// A small GPT for the engine's tests: token embedding tied with the output head, a frozen
// positional table, a buffer, N blocks (each an FSDP unit) with a one-element parameter (so
// that most shards of it are empty), and odd sizes so that 3 and 4 ranks shard unevenly.
#pragma once

#include <torch/torch.h>

#include "sharding/unit_forward.h"

namespace fsdp::testing {

struct TinyGptConfig {
  int64_t vocab = 37;
  int64_t dim = 20;
  int64_t heads = 2;
  int64_t seq = 8;
  int64_t layers = 3;
};

struct BlockImpl : torch::nn::Module {
  BlockImpl(const TinyGptConfig& c) : heads(c.heads) {
    ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.dim})));
    // No qkv bias: the key bias has an exactly zero gradient, which Adam turns into +-lr
    // updates of pure rounding noise, meaningless to compare.
    qkv = register_module("qkv",
                          torch::nn::Linear(torch::nn::LinearOptions(c.dim, 3 * c.dim).bias(false)));
    proj = register_module("proj", torch::nn::Linear(c.dim, c.dim));
    ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.dim})));
    fc = register_module("fc", torch::nn::Linear(c.dim, 3 * c.dim + 1));
    out = register_module("out", torch::nn::Linear(3 * c.dim + 1, c.dim));
    gate = register_parameter("gate", torch::full({1}, 0.9));
  }

  torch::Tensor Attention(const torch::Tensor& x) {
    int64_t b = x.size(0), t = x.size(1), d = x.size(2), hd = d / heads;
    auto parts = qkv->forward(x).view({b, t, 3, heads, hd}).permute({2, 0, 3, 1, 4});
    auto y = at::scaled_dot_product_attention(parts[0], parts[1], parts[2], {}, 0.0,
                                              /*is_causal=*/true);
    return proj->forward(y.transpose(1, 2).reshape({b, t, d}));
  }

  torch::Tensor forward(const torch::Tensor& x) {
    return fsdp::UnitForward(this, x, [&](const torch::Tensor& h) {
      torch::Tensor y = h + Attention(ln1->forward(h));
      return y + gate * out->forward(torch::gelu(fc->forward(ln2->forward(y))));
    });
  }

  int64_t heads;
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  torch::nn::Linear qkv{nullptr}, proj{nullptr}, fc{nullptr}, out{nullptr};
  torch::Tensor gate;
};
TORCH_MODULE(Block);

// The output projection, registering the embedding's tensor under its own name (tying).
struct TiedHeadImpl : torch::nn::Module {
  explicit TiedHeadImpl(torch::Tensor w) { weight = register_parameter("weight", w); }
  torch::Tensor forward(const torch::Tensor& x) { return torch::nn::functional::linear(x, weight); }
  torch::Tensor weight;
};
TORCH_MODULE(TiedHead);

struct TinyGptImpl : torch::nn::Module {
  explicit TinyGptImpl(const TinyGptConfig& c) {
    tok_emb = register_module("tok_emb", torch::nn::Embedding(c.vocab, c.dim));
    pos_emb = register_parameter("pos_emb", torch::randn({c.seq, c.dim}) * 0.1,
                                 /*requires_grad=*/false);
    pos_ids = register_buffer("pos_ids", torch::arange(c.seq));
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int64_t i = 0; i < c.layers; ++i) blocks->push_back(Block(c));
    ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.dim})));
    head = register_module("head", TiedHead(tok_emb->weight));
  }

  torch::Tensor forward(const torch::Tensor& tokens) {
    return fsdp::UnitForward(this, tokens, [&](const torch::Tensor& t) {
      torch::Tensor h = tok_emb->forward(t) + pos_emb.index_select(0, pos_ids.narrow(0, 0, t.size(1)));
      for (const auto& block : *blocks) h = block->as<BlockImpl>()->forward(h);
      return head->forward(ln_f->forward(h));
    });
  }

  torch::nn::Embedding tok_emb{nullptr};
  torch::Tensor pos_emb, pos_ids;
  torch::nn::ModuleList blocks{nullptr};
  torch::nn::LayerNorm ln_f{nullptr};
  TiedHead head{nullptr};
};
TORCH_MODULE(TinyGpt);

// Each tensor once (tied ones too), trainable only: what an optimizer should get.
inline std::vector<torch::Tensor> UniqueTrainable(torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  std::set<const void*> seen;
  for (const auto& p : m.parameters()) {
    if (p.requires_grad() && seen.insert(p.unsafeGetTensorImpl()).second) out.push_back(p);
  }
  return out;
}

}  // namespace fsdp::testing
