// The model zoo on one process: shapes, names, causality, seeded initialisation and FLOPs.
#include <torch/torch.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "models/gpt/gpt.h"

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

}  // namespace
}  // namespace fsdp
