// The switches users expect that need no processes: training.grad_sync and model.freeze in the
// config (parsing, errors, the resolved YAML read back), FreezeParameters on a real model from
// the registry (globs, patterns matching nothing), and what `fsdp plan` predicts for
// grad_sync: last (fewer reductions, every unit's unsharded gradients in memory).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <torch/nn/module.h>

#include "engine/config.h"
#include "engine/freeze.h"
#include "models/model.h"
#include "planner/cost_model.h"
#include "tests/status_matchers.h"

namespace fsdp {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using testing::InvalidArgumentWith;

absl::StatusOr<RunConfig> Parse(const std::string& yaml, std::vector<std::string> overrides = {}) {
  return ParseRunConfig(yaml, "t.yaml", overrides);
}

TEST(GradSyncConfigTest, DefaultsToEveryAndParsesLast) {
  absl::StatusOr<RunConfig> c = Parse("");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->training.grad_sync, GradSync::kEvery);
  c = Parse("training:\n  grad_sync: last\n");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->training.grad_sync, GradSync::kLast);
  EXPECT_EQ(c->Value("training.grad_sync"), "last");
  c = Parse("", {"training.grad_sync=every"});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->training.grad_sync, GradSync::kEvery);
}

TEST(GradSyncConfigTest, BadValueNamesKeyLineAndChoices) {
  EXPECT_THAT(Parse("training:\n  grad_sync: lst\n"),
              InvalidArgumentWith(HasSubstr(
                  "t.yaml:2: training.grad_sync: 'lst' is not valid; did you mean 'last'? "
                  "valid: every, last")));
}

TEST(FreezeConfigTest, ListsAndSingleStringsParseAndRoundTrip) {
  absl::StatusOr<RunConfig> c = Parse("model:\n  freeze: [\"tok_embeddings\", \"*.bq\"]\n");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_THAT(c->model.freeze, ElementsAre("tok_embeddings", "*.bq"));
  // The resolved YAML (config.yaml in the run folder) reads back to the same list.
  absl::StatusOr<RunConfig> again = Parse(c->ToYaml());
  ASSERT_TRUE(again.ok()) << again.status() << "\n" << c->ToYaml();
  EXPECT_EQ(again->model.freeze, c->model.freeze);
  // --set takes a YAML list, or one pattern.
  c = Parse("", {"model.freeze=[layers.0.*, norm.*]"});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_THAT(c->model.freeze, ElementsAre("layers.0.*", "norm.*"));
  c = Parse("", {"model.freeze=layers.1.*"});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_THAT(c->model.freeze, ElementsAre("layers.1.*"));
  // The default is an empty list, written as [].
  c = Parse("");
  ASSERT_TRUE(c.ok());
  EXPECT_TRUE(c->model.freeze.empty());
  EXPECT_THAT(c->ToYaml(), HasSubstr("  freeze: []\n"));
}

TEST(FreezeConfigTest, NonStringItemsAndEmptyPatternsAreErrors) {
  EXPECT_THAT(Parse("model:\n  freeze: {a: 1}\n"),
              InvalidArgumentWith(HasSubstr("t.yaml:2: model.freeze: expected a list of strings, "
                                            "got a map")));
  EXPECT_THAT(Parse("model:\n  freeze: [[a]]\n"),
              InvalidArgumentWith(HasSubstr("model.freeze: expected a list of strings")));
  EXPECT_THAT(Parse("model:\n  freeze: [\"\"]\n"),
              InvalidArgumentWith(HasSubstr("t.yaml:2: model.freeze: a pattern is empty")));
}

TEST(FreezeTest, GlobsMatchWholeNamesDotsIncluded) {
  EXPECT_TRUE(MatchesGlob("layers.0.*", "layers.0.attention.wq"));
  EXPECT_FALSE(MatchesGlob("layers.0.*", "layers.10.attention.wq"));
  EXPECT_TRUE(MatchesGlob("*.bq", "layers.3.attention.bq"));
  EXPECT_TRUE(MatchesGlob("layers.[01].*", "layers.1.ffn_norm.weight"));
  EXPECT_TRUE(MatchesGlob("tok_embeddings", "tok_embeddings"));
  EXPECT_FALSE(MatchesGlob("tok_embeddings", "tok_embeddings_extra"));
}

std::unique_ptr<Model> TinyGpt() {
  ModelArgs args;
  args.arch = "gpt";
  args.vocab_size = 32;
  args.dim = 16;
  args.n_layers = 2;
  args.n_heads = 2;
  args.seq_len = 8;
  args.tie_embeddings = true;
  return FindModelFamily("gpt")->build(args);
}

TEST(FreezeTest, FreezesMatchingParametersOnly) {
  std::unique_ptr<Model> model = TinyGpt();
  absl::StatusOr<FreezeSummary> frozen =
      FreezeParameters(*model->module(), {"tok_embeddings", "layers.0.*"});
  ASSERT_TRUE(frozen.ok()) << frozen.status();
  int64_t frozen_params = 0, trainable = 0;
  for (const auto& item : model->module()->named_parameters()) {
    const bool expect_frozen =
        item.key() == "tok_embeddings" || item.key().rfind("layers.0.", 0) == 0;
    EXPECT_EQ(item.value().requires_grad(), !expect_frozen) << item.key();
    (expect_frozen ? frozen_params : trainable) += 1;
  }
  EXPECT_EQ(frozen->frozen_params, frozen_params);
  EXPECT_EQ(frozen->trainable_params, trainable);
  EXPECT_GT(frozen->frozen_numel, 0);
  EXPECT_GT(frozen->trainable_numel, 0);
}

TEST(FreezeTest, PatternMatchingNothingIsAnErrorNamingIt) {
  std::unique_ptr<Model> model = TinyGpt();
  EXPECT_THAT(FreezeParameters(*model->module(), {"layers.0.*", "layers.9.*"}),
              InvalidArgumentWith(HasSubstr(
                  "model.freeze: pattern 'layers.9.*' matches no parameter (patterns are globs "
                  "over the parameter names, e.g. tok_embeddings")));
}

TEST(FreezeTest, FreezingEverythingIsAnError) {
  std::unique_ptr<Model> model = TinyGpt();
  EXPECT_THAT(FreezeParameters(*model->module(), {"*"}),
              InvalidArgumentWith(HasSubstr("model.freeze: [*] freezes every parameter")));
}

plan::PlanRequest PlanFor(const std::string& grad_sync) {
  absl::StatusOr<plan::PlanRequest> r = plan::MakePlanRequest(
      std::string(FSDP_SOURCE_DIR) + "/configs/default.yaml",
      {"training.grad_accum_steps=4", "training.grad_sync=" + grad_sync}, 8, 8, "h100", "");
  EXPECT_TRUE(r.ok()) << r.status();
  return *r;
}

TEST(GradSyncPlanTest, LastReducesOncePerStepAndHoldsUnshardedGradients) {
  const plan::PlanRequest every = PlanFor("every"), last = PlanFor("last");
  const double params = static_cast<double>(plan::CountModel(every.config.model).params);
  for (plan::Layout layout :
       {plan::Layout{Strategy::kFullShard, 1, 8}, plan::Layout{Strategy::kNoShard, 8, 1}}) {
    SCOPED_TRACE(StrategyName(layout.strategy));
    absl::StatusOr<plan::Prediction> a = plan::Predict(every, layout),
                                     b = plan::Predict(last, layout);
    ASSERT_TRUE(a.ok() && b.ok());
    // One reduction per step instead of one per micro-batch; gathers unchanged.
    EXPECT_NEAR(b->time.reduce_scatter_s, a->time.reduce_scatter_s / 4, 1e-15);
    EXPECT_NEAR(b->time.all_reduce_s, a->time.all_reduce_s / 4, 1e-15);
    EXPECT_DOUBLE_EQ(b->time.all_gather_s, a->time.all_gather_s);
    EXPECT_LT(b->time.exposed_comm_s, a->time.exposed_comm_s);
    // Every parameter's unsharded fp32 gradient, on every rank.
    EXPECT_DOUBLE_EQ(b->memory.grads - a->memory.grads, params * 4);
    if (layout.strategy == Strategy::kNoShard) {
      // DDP accumulates whole fp32 gradients either way: no extra memory.
      EXPECT_DOUBLE_EQ(b->memory.total, a->memory.total);
    } else {
      EXPECT_GT(b->memory.total, a->memory.total);
    }
  }
}

}  // namespace
}  // namespace fsdp
