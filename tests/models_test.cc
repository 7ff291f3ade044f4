// The model zoo on one process: shapes, names, causality, seeded initialisation and FLOPs.
#include <torch/torch.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "models/gpt/gpt.h"
#include "tests/op_counts.h"

namespace fsdp {
namespace {

GptConfig Small(const std::string& arch) {
  GptConfig c;
  c.arch = arch;
  c.vocab_size = 50;
  c.dim = 32;
  c.n_layers = 2;
  c.n_heads = 4;
  c.seq_len = 12;
  if (arch == "llama") {
    c.norm = NormKind::kRmsNorm;
    c.activation = Activation::kSwiglu;
    c.positions = Positions::kRope;
    c.tie_embeddings = false;
  }
  return c;
}

class GptArchTest : public ::testing::TestWithParam<std::string> {};

TEST_P(GptArchTest, LogitsShapeAndCausality) {
  Gpt model(Small(GetParam()));
  model->MaterializeSeeded(1);
  torch::Tensor tokens = torch::randint(50, {3, 12});
  torch::Tensor logits = model->forward(tokens);
  EXPECT_EQ(logits.sizes(), (std::vector<int64_t>{3, 12, 50}));
  EXPECT_TRUE(logits.isfinite().all().item<bool>());
  // Changing the last token changes no earlier position's logits.
  torch::Tensor changed = tokens.clone();
  changed.select(1, 11).fill_(0).add_(tokens.select(1, 11).add(1).remainder(50));
  torch::Tensor other = model->forward(changed);
  EXPECT_TRUE(torch::allclose(logits.narrow(1, 0, 11), other.narrow(1, 0, 11), 1e-5, 1e-6));
  EXPECT_FALSE(torch::allclose(logits.select(1, 11), other.select(1, 11)));
}

TEST_P(GptArchTest, SeededValuesAreThoseOfThePerShardInitialiser) {
  Gpt a(Small(GetParam()));
  a->MaterializeSeeded(7);
  Gpt b(Small(GetParam()));
  ParamInitFn init = b->ParamInit(7);
  for (const auto& item : a->named_parameters()) {
    torch::Tensor full = item.value().detach();
    int64_t d0 = full.dim() == 0 ? 1 : full.size(0);
    int64_t row = full.numel() / d0;
    // Rows 1.. filled on their own (as a shard would be) equal the same rows of the whole.
    if (d0 < 2) continue;
    torch::Tensor rows = torch::empty({d0 - 1, row});
    init(item.key(), 1, row, rows);
    EXPECT_TRUE(torch::equal(rows, full.reshape({d0, row}).narrow(0, 1, d0 - 1))) << item.key();
  }
  Gpt c(Small(GetParam()));
  c->MaterializeSeeded(8);
  EXPECT_FALSE(torch::equal(a->tok_embeddings, c->tok_embeddings)) << "the seed matters";
}

INSTANTIATE_TEST_SUITE_P(Archs, GptArchTest, ::testing::Values("gpt", "llama", "mlp"));

TEST(GptTest, ParameterNamesAndUnits) {
  Gpt gpt(Small("gpt"));
  std::vector<std::string> names;
  for (const auto& item : gpt->named_parameters()) names.push_back(item.key());
  EXPECT_THAT(names, ::testing::Contains("tok_embeddings"));
  EXPECT_THAT(names, ::testing::Contains("pos_embeddings"));
  EXPECT_THAT(names, ::testing::Contains("layers.1.attention.wq"));
  EXPECT_THAT(names, ::testing::Contains("layers.0.feed_forward.b2"));
  EXPECT_THAT(names, ::testing::Contains("norm.bias"));
  EXPECT_THAT(names, ::testing::Not(::testing::Contains("output")));  // tied
  EXPECT_EQ(gpt->FsdpUnits().size(), 2u);
  Gpt llama(Small("llama"));
  names.clear();
  for (const auto& item : llama->named_parameters()) names.push_back(item.key());
  EXPECT_THAT(names, ::testing::Contains("output"));
  EXPECT_THAT(names, ::testing::Contains("layers.0.feed_forward.w3"));
  EXPECT_THAT(names, ::testing::Not(::testing::Contains("norm.bias")));
  EXPECT_THAT(names, ::testing::Not(::testing::Contains("pos_embeddings")));
}

TEST(GptTest, FlopsPerTokenFollowsTheEstimate) {
  GptConfig c = Small("llama");
  Gpt model(c);
  // Matmul parameters: everything except the untied input embedding.
  double matmul = static_cast<double>(model->NumParameters() - c.vocab_size * c.dim);
  EXPECT_DOUBLE_EQ(model->FlopsPerToken(), 6 * matmul + 12.0 * c.n_layers * c.dim * c.seq_len);
  GptConfig g = Small("gpt");
  Gpt tied(g);
  double tied_matmul = static_cast<double>(tied->NumParameters() - g.seq_len * g.dim);
  EXPECT_DOUBLE_EQ(tied->FlopsPerToken(), 6 * tied_matmul + 12.0 * g.n_layers * g.dim * g.seq_len);
  EXPECT_EQ((GptConfig{.dim = 2048, .activation = Activation::kSwiglu}).ffn(), 5504);
}

// A grouped-query model equals the multi-head model whose wk / wv (and bk / bv) rows are the
// grouped ones repeated for each query head of their group (Llama's repeat_kv), forward and
// backward (the gradient of a shared key/value row is the sum over its group).
class GroupedQueryTest : public ::testing::TestWithParam<std::string> {};

TEST_P(GroupedQueryTest, EqualsMultiHeadWithRepeatedKeyValueWeights) {
  GptConfig gqa_config = Small(GetParam());
  gqa_config.n_kv_heads = 2;  // 4 query heads, 2 per key/value head
  GptConfig mha_config = gqa_config;
  mha_config.n_kv_heads = 0;
  const int64_t group = gqa_config.n_heads / gqa_config.kv_heads();
  const int64_t head_dim = gqa_config.head_dim();
  Gpt gqa(gqa_config);
  gqa->MaterializeSeeded(3);
  Gpt mha(mha_config);
  // [kv_heads * head_dim, ...] -> [heads * head_dim, ...]
  auto repeat = [&](const torch::Tensor& w) {
    std::vector<int64_t> grouped = {gqa_config.kv_heads(), head_dim};
    for (int64_t i = 1; i < w.dim(); ++i) grouped.push_back(w.size(i));
    std::vector<int64_t> full = {gqa_config.n_heads * head_dim};
    for (int64_t i = 1; i < w.dim(); ++i) full.push_back(w.size(i));
    return w.reshape(grouped).repeat_interleave(group, 0).reshape(full);
  };
  auto is_kv = [](const std::string& name) {
    return name.ends_with(".wk") || name.ends_with(".wv") || name.ends_with(".bk") ||
           name.ends_with(".bv");
  };
  {
    torch::NoGradGuard no_grad;
    auto source = gqa->named_parameters();
    for (auto& item : mha->named_parameters()) {
      const torch::Tensor& from = source[item.key()];
      item.value().set_data(is_kv(item.key()) ? repeat(from).clone() : from.clone());
    }
  }
  EXPECT_EQ(gqa->layers[0]->as<TransformerBlockImpl>()->attention->wk.sizes(),
            (std::vector<int64_t>{gqa_config.kv_dim(), gqa_config.dim}));
  torch::Tensor tokens = torch::randint(50, {3, 12});
  torch::Tensor out_gqa = gqa->forward(tokens), out_mha = mha->forward(tokens);
  EXPECT_TRUE(torch::allclose(out_gqa, out_mha, 1e-5, 1e-5))
      << (out_gqa - out_mha).abs().max().item<float>();
  (out_gqa * out_gqa).sum().backward();
  (out_mha * out_mha).sum().backward();
  auto mha_params = mha->named_parameters();
  for (const auto& item : gqa->named_parameters()) {
    torch::Tensor expected = mha_params[item.key()].grad();
    if (is_kv(item.key())) {  // sum the repeated rows back into their group's row
      std::vector<int64_t> grouped = {gqa_config.kv_heads(), group, head_dim};
      for (int64_t i = 1; i < expected.dim(); ++i) grouped.push_back(expected.size(i));
      expected = expected.reshape(grouped).sum(1).reshape(item.value().sizes());
    }
    EXPECT_TRUE(torch::allclose(item.value().grad(), expected, 1e-4, 1e-5)) << item.key();
  }
}

INSTANTIATE_TEST_SUITE_P(Archs, GroupedQueryTest, ::testing::Values("gpt", "llama"));

TEST(GroupedQueryTest, CountsEqualTheBuiltModel) {
  for (int64_t kv_heads : {1, 2, 4}) {
    GptConfig c = Small("llama");
    c.n_kv_heads = kv_heads;
    Gpt model(c);
    ModelCounts counts = CountGpt(c);
    EXPECT_EQ(counts.params, model->NumParameters()) << kv_heads;
    EXPECT_DOUBLE_EQ(counts.flops_per_token, model->FlopsPerToken()) << kv_heads;
    int64_t block = 0;
    for (const auto& p : model->layers[0]->parameters()) block += p.numel();
    EXPECT_EQ(counts.unit_params[1], block);
    GptConfig biased = Small("gpt");
    biased.n_kv_heads = kv_heads;
    EXPECT_EQ(CountGpt(biased).params, Gpt(biased)->NumParameters()) << kv_heads;
  }
}

TEST(GroupedQueryTest, Llama3_8bHasItsPublishedParameterCount) {
  // Meta's Llama 3 / 3.1 8B: 8.03B parameters. Per block 4096^2 x 2 (wq, wo) + 1024 x 4096 x 2
  // (wk, wv: 8 key/value heads of 128) + 14336 x 4096 x 3 (SwiGLU) + 2 x 4096 (norms) =
  // 218,112,000; x 32, plus the untied embedding and output (128256 x 4096 each) and the norm.
  GptConfig c{.arch = "llama",
              .vocab_size = 128256,
              .dim = 4096,
              .n_layers = 32,
              .n_heads = 32,
              .n_kv_heads = 8,
              .seq_len = 8192,
              .ffn_hidden = 14336,
              .norm = NormKind::kRmsNorm,
              .activation = Activation::kSwiglu,
              .positions = Positions::kRope,
              .tie_embeddings = false};
  ModelCounts counts = CountGpt(c);
  EXPECT_EQ(counts.params, 8'030'261'248);
  EXPECT_EQ(counts.unit_params[1], 218'112'000);
  EXPECT_EQ(c.kv_dim(), 1024);
  // Grouped-query attention shrinks k and v in what a block keeps (Note [Activation bytes]).
  GptConfig mha = c;
  mha.n_kv_heads = 0;
  EXPECT_DOUBLE_EQ(GptBlockActivationBytes(mha, 2).none - GptBlockActivationBytes(c, 2).none,
                   2 * (4096 - 1024) * 2.0);
}

TEST(ActivationBytesTest, CheckpointingKeepsLess) {
  for (const std::string arch : {"gpt", "llama", "mlp"}) {
    GptConfig c = Small(arch);
    for (double cb : {2.0, 4.0}) {
      BlockActivationBytes b = GptBlockActivationBytes(c, cb);
      EXPECT_DOUBLE_EQ(b.full, c.dim * cb) << arch;  // the block's input
      EXPECT_LT(b.full, b.selective) << arch;
      EXPECT_LT(b.selective, b.none) << arch;
    }
  }
  // GPT-2 keeps 16 dim per token (Korthikanti et al. without dropout) plus the LayerNorm
  // statistics and the attention's log-sum-exp.
  GptConfig gpt2 = Small("gpt");
  EXPECT_NEAR(GptBlockActivationBytes(gpt2, 2).none, 16 * 32 * 2 + 2 * 2 * 4 + 4 * 4, 1e-9);
}

TEST(ActivationBytesTest, FusedKernelsKeepLessForLlamaAndTheSameForGpt2) {
  GptConfig llama = Small("llama");
  GptConfig fused = llama;
  fused.kernels = KernelMode::kFused;
  for (double cb : {2.0, 4.0}) {
    // RMSNorm keeps no fp32 copy (dim x 4 per norm, two norms), SwiGLU one ffn less.
    EXPECT_DOUBLE_EQ(GptBlockActivationBytes(llama, cb).none -
                         GptBlockActivationBytes(fused, cb).none,
                     2 * 4.0 * llama.dim + llama.ffn() * cb);
    // The head keeps the hidden's gradient instead of 16 bytes per vocabulary entry.
    EXPECT_LT(GptHeadBytesPerToken(fused, cb),
              GptHeadBytesPerToken(llama, cb) - 15.0 * llama.vocab_size);
  }
  GptConfig gpt2 = Small("gpt"), gpt2_fused = gpt2;
  gpt2_fused.kernels = KernelMode::kFused;
  EXPECT_DOUBLE_EQ(GptBlockActivationBytes(gpt2_fused, 2).none,
                   GptBlockActivationBytes(gpt2, 2).none);
}

// model.kernels=fused against composite on the CPU (the kernels' CPU references): same loss and
// gradients for every parameter, fp32: a GQA Llama, and GPT-2 and the MLP (biases, LayerNorm,
// GELU). The kernels' own tests compare each one with its composite; this checks how the model
// wires them (RMSNorm, the fork and add + norm passes, q/k/v and w1/w3 as one Linears each,
// RoPE in place, SwiGLU, w2's GEMM adding the residual, the chunked head and loss).
TEST(GptKernelsTest, FusedEqualsCompositeLossAndGradients) {
  for (const std::string arch : {"llama", "gpt", "mlp"}) {
    SCOPED_TRACE(arch);
    GptConfig c = Small(arch);
    if (arch == "llama") c.n_kv_heads = 2;
    torch::manual_seed(3);
    torch::Tensor tokens = torch::randint(50, {3, 12});
    torch::Tensor targets = torch::randint(50, {3, 12});
    std::vector<std::pair<std::string, torch::Tensor>> grads[2];
    double losses[2];
    for (int fused = 0; fused < 2; ++fused) {
      c.kernels = fused ? KernelMode::kFused : KernelMode::kComposite;
      c.loss_chunk_tokens = 5;  // chunks that do not divide the 36 tokens
      Gpt model(c);
      model->MaterializeSeeded(11);
      torch::Tensor loss = model->loss(tokens, targets);
      loss.backward();
      losses[fused] = loss.item<double>();
      for (const auto& item : model->named_parameters()) {
        grads[fused].emplace_back(item.key(), item.value().grad());
      }
      // Forward's logits are the head of the same trunk.
      torch::Tensor ce = torch::nn::functional::cross_entropy(model->forward(tokens).flatten(0, 1),
                                                              targets.flatten());
      EXPECT_NEAR(ce.item<double>(), losses[fused], 1e-5);
    }
    EXPECT_NEAR(losses[0], losses[1], 1e-5);
    ASSERT_EQ(grads[0].size(), grads[1].size());
    for (size_t i = 0; i < grads[0].size(); ++i) {
      ASSERT_TRUE(grads[1][i].second.defined()) << grads[1][i].first;
      EXPECT_TRUE(torch::allclose(grads[1][i].second, grads[0][i].second, 1e-4, 1e-6))
          << grads[0][i].first << " max diff "
          << (grads[1][i].second - grads[0][i].second).abs().max().item<double>();
    }
  }
}

// Note [Residual stream gradients]: with fused kernels a Llama block runs no add kernel, forward
// or backward (the composite's blocks run five each: see the note); bf16 as on a GPU.
TEST(GptKernelsTest, FusedLlamaBlocksRunNoAddKernels) {
  GptConfig c = Small("llama");
  c.n_kv_heads = 2;
  c.kernels = KernelMode::kFused;
  Gpt model(c);
  model->MaterializeSeeded(11);
  model->to(torch::kBFloat16);
  torch::manual_seed(3);
  torch::Tensor tokens = torch::randint(50, {3, 12});
  testing::OpCounts ops;
  torch::Tensor loss = model->loss(tokens, tokens);
  EXPECT_EQ(ops.Adds(), 0) << "forward";
  loss.backward();
  EXPECT_EQ(ops.Adds(), 0) << "backward";
  EXPECT_EQ(ops.Count("aten::addmm_"), c.n_layers * 3) << "x's gradients of q/k/v and w1/w3";
}

TEST(GptKernelsTest, AutoIsCompositeOnTheCpu) {
  torch::Tensor x = torch::zeros({2});
  EXPECT_FALSE(UseFusedKernels(KernelMode::kAuto, x));
  EXPECT_TRUE(UseFusedKernels(KernelMode::kFused, x));
  EXPECT_FALSE(UseFusedKernels(KernelMode::kComposite, x));
  // The rule itself, for the device a tensor or a plan is on.
  EXPECT_EQ(ResolveKernelMode(KernelMode::kAuto, /*on_cuda=*/true), KernelMode::kFused);
  EXPECT_EQ(ResolveKernelMode(KernelMode::kAuto, /*on_cuda=*/false), KernelMode::kComposite);
  EXPECT_EQ(ResolveKernelMode(KernelMode::kComposite, /*on_cuda=*/true), KernelMode::kComposite);
  EXPECT_EQ(ResolveKernelMode(KernelMode::kFused, /*on_cuda=*/false), KernelMode::kFused);
}

}  // namespace
}  // namespace fsdp
