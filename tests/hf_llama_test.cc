// engine/hf_llama without processes: the RoPE row permutation, the name map, config.json
// against the YAML (ParseRunConfig), and filling row ranges from a folder written here (one
// file and sharded). tests/hf_llama_e2e_test.cc checks the same against transformers itself.
#include "engine/hf_llama.h"

#include <filesystem>
#include <fstream>
#include <set>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "checkpoint/safetensors.h"
#include "common/status.h"
#include "common/strings.h"
#include "engine/config.h"
#include "models/gpt/gpt.h"

namespace fsdp {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

TEST(HfRopeRowTest, InterleavedPairsMapToHalves) {
  // Head dim 8: our rows (0,1) (2,3) (4,5) (6,7) are pairs; theirs (0,4) (1,5) (2,6) (3,7).
  std::vector<int64_t> got;
  for (int64_t r = 0; r < 16; ++r) got.push_back(HfRopeRow(r, 8));
  EXPECT_EQ(got, (std::vector<int64_t>{0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15}));
  // A bijection for other sizes, within each head.
  for (int64_t head_dim : {2, 6, 64}) {
    std::set<int64_t> seen;
    for (int64_t r = 0; r < 3 * head_dim; ++r) {
      const int64_t hf = HfRopeRow(r, head_dim);
      EXPECT_EQ(hf / head_dim, r / head_dim);
      seen.insert(hf);
    }
    EXPECT_EQ(seen.size(), static_cast<size_t>(3 * head_dim));
  }
}

TEST(HfNameOfTest, EveryLlamaParameterHasOneName) {
  ModelArgs args{.arch = "llama",
                 .vocab_size = 32,
                 .dim = 16,
                 .n_layers = 2,
                 .n_heads = 4,
                 .n_kv_heads = 2,
                 .norm = NormKind::kRmsNorm,
                 .activation = Activation::kSwiglu,
                 .positions = Positions::kRope,
                 .tie_embeddings = false};
  Gpt model(args);
  std::set<std::string> names;
  for (const auto& p : model->named_parameters()) {
    std::optional<std::string> hf = HfNameOf(p.key());
    ASSERT_TRUE(hf.has_value()) << p.key();
    names.insert(*hf);
  }
  EXPECT_EQ(names.size(), model->named_parameters().size());
  EXPECT_EQ(*HfNameOf("layers.1.attention.wk"), "model.layers.1.self_attn.k_proj.weight");
  EXPECT_EQ(*HfNameOf("layers.0.feed_forward.w1"), "model.layers.0.mlp.gate_proj.weight");
  EXPECT_EQ(*HfNameOf("layers.0.feed_forward.w3"), "model.layers.0.mlp.up_proj.weight");
  EXPECT_EQ(*HfNameOf("layers.0.ffn_norm.weight"),
            "model.layers.0.post_attention_layernorm.weight");
  EXPECT_EQ(*HfNameOf("output"), "lm_head.weight");
  EXPECT_FALSE(HfNameOf("layers.0.attention.bq").has_value());  // gpt's biases
  EXPECT_FALSE(HfNameOf("pos_embeddings").has_value());
}

// A folder with a tiny Llama config.json (and, on request, tensors).
class HfFolderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = StrCat(fs::temp_directory_path().string(), "/fsdp-hf-", ::getpid(), "-",
                  ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    config_ = {{"architectures", {"LlamaForCausalLM"}},
               {"model_type", "llama"},
               {"vocab_size", 40},
               {"hidden_size", 24},
               {"intermediate_size", 40},
               {"num_hidden_layers", 1},
               {"num_attention_heads", 6},
               {"num_key_value_heads", 3},
               {"max_position_embeddings", 32},
               {"rms_norm_eps", 1e-5},
               {"rope_parameters", {{"rope_theta", 500.0}, {"rope_type", "default"}}},
               {"tie_word_embeddings", true},
               {"hidden_act", "silu"},
               {"attention_bias", false}};
  }
  void TearDown() override { fs::remove_all(dir_); }
  void WriteConfig() { std::ofstream(dir_ + "/config.json") << config_.dump(); }
  absl::StatusOr<RunConfig> Parse(const std::string& model_yaml) {
    WriteConfig();
    return ParseRunConfig(StrCat("model:\n  init_from: ", dir_, "\n", model_yaml), "test.yaml", {});
  }
  std::string dir_;
  nlohmann::json config_;
};

TEST_F(HfFolderTest, ShapeComesFromConfigJson) {
  absl::StatusOr<RunConfig> c = Parse("  seq_len: 16\n");
  ASSERT_TRUE(c.ok()) << c.status();
  const ModelArgs& m = c->model;
  EXPECT_EQ(m.arch, "llama");
  EXPECT_EQ(m.vocab_size, 40);
  EXPECT_EQ(m.dim, 24);
  EXPECT_EQ(m.n_heads, 6);
  EXPECT_EQ(m.n_kv_heads, 3);
  EXPECT_EQ(m.ffn_hidden, 40);
  EXPECT_EQ(m.rope_theta, 500.0);
  EXPECT_EQ(m.norm_eps, 1e-5);
  EXPECT_TRUE(m.tie_embeddings);
  EXPECT_EQ(m.norm, NormKind::kRmsNorm);
  EXPECT_EQ(m.activation, Activation::kSwiglu);
  EXPECT_EQ(m.positions, Positions::kRope);
  EXPECT_EQ(m.seq_len, 16);
  // A key set to config.json's value is fine; the default seq_len (64) is capped to 32.
  c = Parse("  dim: 24\n  n_kv_heads: 3\n");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->model.seq_len, 32);
}

TEST_F(HfFolderTest, DisagreementsNameBothValues) {
  absl::StatusOr<RunConfig> c = Parse("  vocab_size: 100\n");
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(c.status().message()),
              HasSubstr(StrCat("test.yaml:3: model.vocab_size = 100 disagrees with ", dir_,
                               "/config.json: vocab_size = 40")));
  c = Parse("  arch: gpt\n");
  EXPECT_THAT(std::string(c.status().message()), HasSubstr("model.arch = gpt disagrees"));
  c = Parse("  seq_len: 33\n");
  EXPECT_THAT(std::string(c.status().message()),
              HasSubstr("model.seq_len = 33 exceeds " + dir_ +
                        "/config.json: max_position_embeddings = 32"));
  WriteConfig();
  c = ParseRunConfig(StrCat("model:\n  init_from: ", dir_, "\n"), "test.yaml",
                     {"model.n_kv_heads=2"});
  EXPECT_THAT(std::string(c.status().message()),
              HasSubstr("--set model.n_kv_heads=2: model.n_kv_heads = 2 disagrees with"));
}

TEST_F(HfFolderTest, WhatLlamaCannotRepresentIsRefused) {
  struct Case {
    std::string key;
    nlohmann::json value;
    std::string message;
  };
  for (const Case& k : std::vector<Case>{
           {"architectures", {"MistralForCausalLM"}, "'architectures' is [\"MistralForCausalLM\"]"},
           {"model_type", "mistral", "'model_type' is 'mistral'"},
           {"rope_parameters", {{"rope_type", "llama3"}, {"factor", 8.0}}, "rope_type 'llama3'"},
           {"rope_scaling", {{"type", "linear"}, {"factor", 2.0}}, "rope_type 'linear'"},
           {"attention_bias", true, "'attention_bias' is true"},
           {"head_dim", 8, "'head_dim' is 8"},
           {"hidden_act", "gelu", "'hidden_act' is 'gelu'"}}) {
    nlohmann::json saved = config_;
    config_[k.key] = k.value;
    absl::StatusOr<RunConfig> c = Parse("");
    config_ = saved;
    ASSERT_FALSE(c.ok()) << k.key;
    EXPECT_THAT(std::string(c.status().message()), HasSubstr(dir_ + "/config.json: '"));
    EXPECT_THAT(std::string(c.status().message()), HasSubstr(k.message)) << k.key;
  }
  fs::remove(dir_ + "/config.json");
  absl::StatusOr<RunConfig> c =
      ParseRunConfig(StrCat("model:\n  init_from: ", dir_, "\n"), "test.yaml", {});
  EXPECT_THAT(std::string(c.status().message()), HasSubstr("is a folder without config.json"));
}

// Our layout of a q/k projection from theirs: row r of ours is row HfRopeRow(r) of theirs.
at::Tensor FromHf(const at::Tensor& hf, int64_t head_dim) {
  at::Tensor index = at::empty({hf.size(0)}, at::kLong);
  for (int64_t r = 0; r < hf.size(0); ++r) index[r] = HfRopeRow(r, head_dim);
  return hf.index_select(0, index);
}

TEST_F(HfFolderTest, FillsRowRangesOneFileOrShardedAndNamesAMissingTensor) {
  WriteConfig();
  absl::StatusOr<RunConfig> c = Parse("");
  ASSERT_TRUE(c.ok()) << c.status();
  Gpt model(c->model);
  at::manual_seed(3);
  std::map<std::string, at::Tensor> ours, theirs;  // full tensors, by our name / their name
  for (const auto& p : model->named_parameters()) {
    at::Tensor t = at::randn(p.value().sizes());
    ours[p.key()] = t;
    const std::string hf = *HfNameOf(p.key());
    const bool rope = hf.ends_with("q_proj.weight") || hf.ends_with("k_proj.weight");
    // Theirs such that FromHf(theirs) == ours.
    at::Tensor their = at::empty_like(t);
    for (int64_t r = 0; r < t.size(0) && rope; ++r) their[HfRopeRow(r, 4)] = t[r];
    theirs[hf] = rope ? their : t;
    if (rope) {
      ASSERT_TRUE(FromHf(their, 4).equal(t));
    }
  }
  ASSERT_TRUE(ckpt::SaveSafetensors(theirs, dir_ + "/model.safetensors").ok());
  // Two "ranks": rows split unevenly, 7 rows first (mid-head for q/k).
  auto fill = [&]() -> absl::StatusOr<std::map<std::string, at::Tensor>> {
    std::map<std::string, at::Tensor> got;
    std::vector<InitTarget> targets;
    for (const auto& [name, t] : ours) {
      got[name] = at::zeros_like(t);
      const int64_t split = std::min<int64_t>(7, t.size(0));
      targets.push_back({name, t.sizes().vec(), 0, got[name].narrow(0, 0, split)});
      targets.push_back(
          {name, t.sizes().vec(), split, got[name].narrow(0, split, t.size(0) - split)});
    }
    FSDP_RETURN_IF_ERROR(FillFromHfLlama(dir_, targets));
    return got;
  };
  absl::StatusOr<std::map<std::string, at::Tensor>> got = fill();
  ASSERT_TRUE(got.ok()) << got.status();
  for (const auto& [name, t] : ours) EXPECT_TRUE((*got)[name].equal(t)) << name;

  // Sharded: two files and an index.
  fs::remove(dir_ + "/model.safetensors");
  std::map<std::string, at::Tensor> a, b;
  nlohmann::json map = nlohmann::json::object();
  for (const auto& [name, t] : theirs) {
    const bool first = name.find("layers.0.mlp") == std::string::npos;
    (first ? a : b)[name] = t;
    map[name] = first ? "model-00001-of-00002.safetensors" : "model-00002-of-00002.safetensors";
  }
  ASSERT_TRUE(ckpt::SaveSafetensors(a, dir_ + "/model-00001-of-00002.safetensors").ok());
  ASSERT_TRUE(ckpt::SaveSafetensors(b, dir_ + "/model-00002-of-00002.safetensors").ok());
  std::ofstream(dir_ + "/model.safetensors.index.json")
      << nlohmann::json{{"metadata", {{"total_size", 0}}}, {"weight_map", map}}.dump();
  got = fill();
  ASSERT_TRUE(got.ok()) << got.status();
  for (const auto& [name, t] : ours) EXPECT_TRUE((*got)[name].equal(t)) << name;

  // A tensor the index does not list.
  map.erase("model.layers.0.mlp.up_proj.weight");
  std::ofstream(dir_ + "/model.safetensors.index.json")
      << nlohmann::json{{"weight_map", map}}.dump();
  got = fill();
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(std::string(got.status().message()),
            StrCat("model.init_from '", dir_,
                   "': no tensor 'model.layers.0.mlp.up_proj.weight' "
                   "(the model's 'layers.0.feed_forward.w3') in ",
                   dir_, "/model.safetensors.index.json"));
}

}  // namespace
}  // namespace fsdp
