#include "engine/hf_llama.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "checkpoint/metadata.h"
#include "checkpoint/safetensors.h"
#include "common/status.h"
#include "common/strings.h"
#include "engine/config.h"

namespace fsdp {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// Note [Hugging Face names]
// transformers' LlamaForCausalLM and models/gpt's llama arch hold the same tensors with the
// same shapes ([out, in] for every projection), under other names:
//   model.embed_tokens.weight                       tok_embeddings
//   model.layers.N.self_attn.{q,k,v,o}_proj.weight  layers.N.attention.{wq,wk,wv,wo}
//   model.layers.N.mlp.gate_proj.weight             layers.N.feed_forward.w1  (silu(x W1^T))
//   model.layers.N.mlp.up_proj.weight               layers.N.feed_forward.w3  (the product's)
//   model.layers.N.mlp.down_proj.weight             layers.N.feed_forward.w2
//   model.layers.N.input_layernorm.weight           layers.N.attention_norm.weight
//   model.layers.N.post_attention_layernorm.weight  layers.N.ffn_norm.weight
//   model.norm.weight                               norm.weight
//   lm_head.weight                                  output (absent when tie_word_embeddings)
// Nothing is fused on either side, so each of our tensors comes from exactly one file tensor;
// only q_proj and k_proj have their rows permuted (Note [RoPE layouts]). A folder may also
// hold rotary_emb.inv_freq buffers (older transformers) and lm_head.weight of a tied model:
// both are ignored, anything else the model does not have is an error.
struct NamePair {
  const char* ours;
  const char* hf;
};
constexpr NamePair kBlockNames[] = {
    {"attention.wq", "self_attn.q_proj.weight"},
    {"attention.wk", "self_attn.k_proj.weight"},
    {"attention.wv", "self_attn.v_proj.weight"},
    {"attention.wo", "self_attn.o_proj.weight"},
    {"feed_forward.w1", "mlp.gate_proj.weight"},
    {"feed_forward.w3", "mlp.up_proj.weight"},
    {"feed_forward.w2", "mlp.down_proj.weight"},
    {"attention_norm.weight", "input_layernorm.weight"},
    {"ffn_norm.weight", "post_attention_layernorm.weight"},
};

// Whether `hf` (a Hugging Face name) is a q or k projection, whose rows are permuted.
bool IsRopeProjection(const std::string& hf) {
  return hf.ends_with("self_attn.q_proj.weight") || hf.ends_with("self_attn.k_proj.weight");
}

// What the llama arch needs of config.json.
struct HfLlamaConfig {
  std::string path;  // <dir>/config.json, for messages
  int64_t vocab_size = 0, hidden_size = 0, num_layers = 0, num_heads = 0, num_kv_heads = 0;
  int64_t intermediate_size = 0, max_positions = 0;
  double rms_norm_eps = 1e-6, rope_theta = 10000.0;
  bool tie = false;
  int64_t head_dim() const { return hidden_size / num_heads; }
};

absl::StatusOr<json> ReadJsonFile(const std::string& path, const std::string& what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::NotFoundError(StrCat(what, ": cannot read ", path));
  }
  std::stringstream text;
  text << in.rdbuf();
  // The checkpoint layer's parser: nesting is bounded (a hostile config.json cannot overflow
  // the stack), errors name the file.
  absl::StatusOr<json> value = ckpt::ParseJson(text.str(), StrCat(what, ": ", path));
  if (!value.ok() || !value->is_object()) {
    return absl::InvalidArgumentError(StrCat(what, ": ", path, " is not a JSON object"));
  }
  return value;
}

absl::Status BadKey(const std::string& path, const std::string& key, const std::string& what) {
  return absl::InvalidArgumentError(StrCat(path, ": '", key, "' ", what));
}

// A positive integer field (`fallback` when absent and fallback > 0).
absl::StatusOr<int64_t> PositiveInt(const HfLlamaConfig& c, const json& j, const std::string& key,
                                    int64_t fallback = 0) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) {
    if (fallback > 0) return fallback;
    return BadKey(c.path, key, "is missing (a Llama config.json has it)");
  }
  if (!it->is_number_integer() || it->get<int64_t>() < 1) {
    return BadKey(c.path, key, StrCat("must be a positive integer, got ", it->dump()));
  }
  return it->get<int64_t>();
}

absl::StatusOr<double> PositiveNumber(const HfLlamaConfig& c, const json& j, const std::string& key,
                                      double fallback) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return fallback;
  if (!it->is_number() || !(it->get<double>() > 0)) {
    return BadKey(c.path, key, StrCat("must be a positive number, got ", it->dump()));
  }
  return it->get<double>();
}

// A RoPE description that plain rotary embedding (rope_type default) represents: absent,
// null, or {"rope_type" or "type": "default", ...}. Its rope_theta, if any, into `theta`.
absl::Status CheckRope(const HfLlamaConfig& c, const json& j, const std::string& key,
                       double& theta) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return absl::OkStatus();
  if (!it->is_object()) return BadKey(c.path, key, StrCat("must be an object, got ", it->dump()));
  std::string type = it->value("rope_type", it->value("type", std::string("default")));
  if (type != "default") {
    return BadKey(c.path, key,
                  StrCat("has rope_type '", type,
                         "': the llama arch implements plain rotary "
                         "embeddings only (rope_type default); scaled RoPE (llama3, linear, "
                         "dynamic, yarn) cannot be loaded"));
  }
  if (auto t = it->find("rope_theta"); t != it->end()) {
    if (!t->is_number() || !(t->get<double>() > 0)) {
      return BadKey(c.path, key + ".rope_theta",
                    StrCat("must be a positive number, got ", t->dump()));
    }
    theta = t->get<double>();
  }
  return absl::OkStatus();
}

// Reads and checks <dir>/config.json (see ApplyHfLlamaConfig for what is refused).
absl::StatusOr<HfLlamaConfig> ReadHfLlamaConfig(const std::string& dir) {
  HfLlamaConfig c;
  c.path = (fs::path(dir) / kHfConfigFile).string();
  if (!fs::exists(c.path)) {
    return absl::InvalidArgumentError(
        StrCat("model.init_from '", dir, "' is a folder without ", kHfConfigFile,
               ": a Hugging Face checkpoint folder holds config.json and model.safetensors (or "
               "model-0000N-of-0000M.safetensors with ",
               kHfIndexFile,
               "); a file of our own names is "
               "given as the .safetensors path"));
  }
  FSDP_ASSIGN_OR_RETURN(json j, ReadJsonFile(c.path, "model.init_from"));
  const std::string model_type = j.value("model_type", std::string());
  if (model_type != "llama") {
    return BadKey(c.path, "model_type",
                  StrCat("is '", model_type,
                         "'; only Hugging Face Llama checkpoints (model_type "
                         "llama, LlamaForCausalLM) can be loaded"));
  }
  if (auto a = j.find("architectures"); a != j.end() && !a->is_null()) {
    if (!a->is_array() || a->size() != 1 || !(*a)[0].is_string() ||
        (*a)[0].get<std::string>() != "LlamaForCausalLM") {
      return BadKey(c.path, "architectures",
                    StrCat("is ", a->dump(), "; only [\"LlamaForCausalLM\"] can be loaded"));
    }
  }
  if (std::string act = j.value("hidden_act", std::string("silu")); act != "silu") {
    return BadKey(c.path, "hidden_act",
                  StrCat("is '", act, "'; the llama arch uses silu (SwiGLU)"));
  }
  for (const char* key : {"attention_bias", "mlp_bias"}) {
    if (auto b = j.find(key); b != j.end() && !(b->is_boolean() && !b->get<bool>())) {
      return BadKey(c.path, key, StrCat("is ", b->dump(), "; the llama arch has no biases"));
    }
  }
  FSDP_ASSIGN_OR_RETURN(c.vocab_size, PositiveInt(c, j, "vocab_size"));
  FSDP_ASSIGN_OR_RETURN(c.hidden_size, PositiveInt(c, j, "hidden_size"));
  FSDP_ASSIGN_OR_RETURN(c.num_layers, PositiveInt(c, j, "num_hidden_layers"));
  FSDP_ASSIGN_OR_RETURN(c.num_heads, PositiveInt(c, j, "num_attention_heads"));
  FSDP_ASSIGN_OR_RETURN(c.num_kv_heads, PositiveInt(c, j, "num_key_value_heads", c.num_heads));
  FSDP_ASSIGN_OR_RETURN(c.intermediate_size, PositiveInt(c, j, "intermediate_size"));
  FSDP_ASSIGN_OR_RETURN(c.max_positions, PositiveInt(c, j, "max_position_embeddings", 2048));
  FSDP_ASSIGN_OR_RETURN(c.rms_norm_eps, PositiveNumber(c, j, "rms_norm_eps", 1e-6));
  FSDP_ASSIGN_OR_RETURN(c.rope_theta, PositiveNumber(c, j, "rope_theta", 10000.0));
  // transformers 4 says rope_scaling (null for plain RoPE), 5 says rope_parameters.
  FSDP_RETURN_IF_ERROR(CheckRope(c, j, "rope_scaling", c.rope_theta));
  FSDP_RETURN_IF_ERROR(CheckRope(c, j, "rope_parameters", c.rope_theta));
  if (auto t = j.find("tie_word_embeddings"); t != j.end() && !t->is_null()) {
    if (!t->is_boolean()) return BadKey(c.path, "tie_word_embeddings", "must be true or false");
    c.tie = t->get<bool>();
  }
  if (c.hidden_size % c.num_heads != 0 || c.num_heads % c.num_kv_heads != 0) {
    return BadKey(c.path, "num_attention_heads",
                  StrCat("= ", c.num_heads, " must divide hidden_size = ", c.hidden_size,
                         " and be a multiple of num_key_value_heads = ", c.num_kv_heads));
  }
  if (auto h = j.find("head_dim"); h != j.end() && !h->is_null() &&
                                   !(h->is_number_integer() && h->get<int64_t>() == c.head_dim())) {
    return BadKey(c.path, "head_dim",
                  StrCat("is ", h->dump(),
                         "; the llama arch needs hidden_size / "
                         "num_attention_heads = ",
                         c.head_dim()));
  }
  return c;
}

// Ours -> Hugging Face for q/k rows: see Note [RoPE layouts].
at::Tensor ToHfRopeLayout(const at::Tensor& ours, int64_t head_dim) {
  const int64_t heads = ours.size(0) / head_dim;
  return ours.reshape({heads, head_dim / 2, 2, ours.size(1)})
      .transpose(1, 2)
      .reshape(ours.sizes())
      .contiguous();
}

// Rows [first, first + count) of our layout of the q/k projection `name`, read from the
// Hugging Face layout: the rows they come from, sorted, in contiguous runs (two per head at
// most), then put in our order.
absl::Status ReadRopeRows(const ckpt::SafetensorsFile& file, const std::string& name, int64_t first,
                          int64_t count, int64_t head_dim, at::Tensor& out) {
  std::vector<int64_t> source(static_cast<size_t>(count));
  for (int64_t r = 0; r < count; ++r) source[r] = HfRopeRow(first + r, head_dim);
  std::vector<int64_t> sorted = source;
  std::sort(sorted.begin(), sorted.end());
  std::vector<at::Tensor> parts;
  for (size_t begin = 0; begin < sorted.size();) {
    size_t end = begin + 1;
    while (end < sorted.size() && sorted[end] == sorted[end - 1] + 1) ++end;
    at::Tensor part;
    FSDP_RETURN_IF_ERROR(file.ReadRows(name, sorted[begin], sorted[end - 1] + 1, part));
    parts.push_back(std::move(part));
    begin = end;
  }
  at::Tensor index = at::empty({count}, at::kLong);
  int64_t* position = index.data_ptr<int64_t>();
  for (int64_t r = 0; r < count; ++r) {
    position[r] = std::lower_bound(sorted.begin(), sorted.end(), source[r]) - sorted.begin();
  }
  out = at::cat(parts).index_select(0, index);
  return absl::OkStatus();
}

}  // namespace

// Note [RoPE layouts]
// Both sides rotate pairs of a head's q/k features by the angle position * theta^(-2i/d),
// i < d/2, with the same formula (x1 cos - x2 sin, x1 sin + x2 cos); they differ in which
// features pair up. models/gpt pairs adjacent features (2i, 2i + 1) (Meta's original layout);
// transformers pairs the two halves (i, i + d/2) ("rotate_half"). Attention scores are dot
// products of q and k within a head, which do not change when the same permutation reorders
// the features of both, so a checkpoint converts by permuting the rows of q_proj and k_proj
// within each head: our row 2i + c is Hugging Face row c * d/2 + i (c = 0, 1). This is the
// permutation Meta -> Hugging Face conversion scripts apply; loading applies its inverse. v and
// o are not permuted (the scores do not depend on their order, and o consumes v's order).
// tests/hf_llama_e2e_test.cc checks both directions against transformers' losses.
int64_t HfRopeRow(int64_t row, int64_t head_dim) {
  const int64_t head = row / head_dim, j = row % head_dim;
  return head * head_dim + (j % 2) * (head_dim / 2) + j / 2;
}

std::optional<std::string> HfNameOf(const std::string& ours) {
  if (ours == "tok_embeddings") return "model.embed_tokens.weight";
  if (ours == "norm.weight") return "model.norm.weight";
  if (ours == "output") return "lm_head.weight";
  if (!StartsWith(ours, "layers.")) return std::nullopt;
  const size_t dot = ours.find('.', 7);
  if (dot == std::string::npos || !ParseInt<int64_t>(std::string_view(ours).substr(7, dot - 7))) {
    return std::nullopt;
  }
  const std::string rest = ours.substr(dot + 1);
  for (const NamePair& pair : kBlockNames) {
    if (rest == pair.ours) return StrCat("model.", ours.substr(0, dot), ".", pair.hf);
  }
  return std::nullopt;
}

bool IsHfCheckpointDir(const std::string& path) {
  std::error_code ec;
  return !path.empty() && fs::is_directory(path, ec);
}

absl::Status ApplyHfLlamaConfig(const std::string& dir,
                                const std::function<std::string(const std::string&)>& set_at,
                                ModelArgs& model) {
  FSDP_ASSIGN_OR_RETURN(HfLlamaConfig c, ReadHfLlamaConfig(dir));
  const ModelArgs user = model;
  auto disagree = [&](const std::string& key, const std::string& ours, const std::string& hf_key,
                      const std::string& hf) {
    return absl::InvalidArgumentError(StrCat(
        set_at(key), ": ", key, " = ", ours, " disagrees with ", c.path, ": ", hf_key, " = ", hf,
        " (model.init_from is a Hugging Face folder: its config.json sets the model's shape; "
        "leave ",
        key, " out or set it to ", hf, ")"));
  };
  auto check = [&](const std::string& key, bool same, const std::string& ours,
                   const std::string& hf_key, const std::string& hf) -> absl::Status {
    if (set_at(key).empty() || same) return absl::OkStatus();
    return disagree(key, ours, hf_key, hf);
  };
  auto close = [](double a, double b) {
    return std::abs(a - b) <= 1e-12 * std::max(std::abs(a), std::abs(b));
  };

  FSDP_RETURN_IF_ERROR(check("model.arch", user.arch == "llama", user.arch, "model_type", "llama"));
  FSDP_RETURN_IF_ERROR(check("model.vocab_size", user.vocab_size == c.vocab_size,
                             StrCat(user.vocab_size), "vocab_size", StrCat(c.vocab_size)));
  FSDP_RETURN_IF_ERROR(check("model.dim", user.dim == c.hidden_size, StrCat(user.dim),
                             "hidden_size", StrCat(c.hidden_size)));
  FSDP_RETURN_IF_ERROR(check("model.n_layers", user.n_layers == c.num_layers, StrCat(user.n_layers),
                             "num_hidden_layers", StrCat(c.num_layers)));
  FSDP_RETURN_IF_ERROR(check("model.n_heads", user.n_heads == c.num_heads, StrCat(user.n_heads),
                             "num_attention_heads", StrCat(c.num_heads)));
  // n_kv_heads 0 means n_heads (config.json's, or the user's, checked above).
  FSDP_RETURN_IF_ERROR(check(
      "model.n_kv_heads", (user.n_kv_heads > 0 ? user.n_kv_heads : c.num_heads) == c.num_kv_heads,
      StrCat(user.n_kv_heads), "num_key_value_heads", StrCat(c.num_kv_heads)));
  FSDP_RETURN_IF_ERROR(check("model.norm", user.norm == NormKind::kRmsNorm, "layernorm",
                             "model_type", "llama (rmsnorm)"));
  FSDP_RETURN_IF_ERROR(check("model.activation", user.activation == Activation::kSwiglu, "gelu",
                             "hidden_act", "silu (swiglu)"));
  FSDP_RETURN_IF_ERROR(check("model.positions", user.positions == Positions::kRope, "learned",
                             "model_type", "llama (rope)"));
  FSDP_RETURN_IF_ERROR(check("model.tie_embeddings", user.tie_embeddings == c.tie,
                             user.tie_embeddings ? "true" : "false", "tie_word_embeddings",
                             c.tie ? "true" : "false"));
  FSDP_RETURN_IF_ERROR(check("model.norm_eps", close(user.norm_eps, c.rms_norm_eps),
                             StrCat(user.norm_eps), "rms_norm_eps", StrCat(c.rms_norm_eps)));
  FSDP_RETURN_IF_ERROR(check("model.rope_theta", close(user.rope_theta, c.rope_theta),
                             StrCat(user.rope_theta), "rope_theta", StrCat(c.rope_theta)));
  model.arch = "llama";
  model.vocab_size = c.vocab_size;
  model.dim = c.hidden_size;
  model.n_layers = c.num_layers;
  model.n_heads = c.num_heads;
  model.n_kv_heads = c.num_kv_heads;
  model.norm = NormKind::kRmsNorm;
  model.activation = Activation::kSwiglu;
  model.positions = Positions::kRope;
  model.tie_embeddings = c.tie;
  model.norm_eps = c.rms_norm_eps;
  model.rope_theta = c.rope_theta;
  // ffn_hidden 0 means "derived from dim": compare what it derives for this dim.
  ModelArgs derived = model;
  derived.ffn_hidden = user.ffn_hidden;
  FSDP_RETURN_IF_ERROR(
      check("model.ffn_hidden", derived.ffn() == c.intermediate_size,
            StrCat(user.ffn_hidden, user.ffn_hidden == 0 ? StrCat(" (", derived.ffn(), ")") : ""),
            "intermediate_size", StrCat(c.intermediate_size)));
  model.ffn_hidden = c.intermediate_size;
  // seq_len is the training length: anything up to the positions the model was trained for.
  if (model.seq_len > c.max_positions) {
    if (!set_at("model.seq_len").empty()) {
      return absl::InvalidArgumentError(
          StrCat(set_at("model.seq_len"), ": model.seq_len = ", model.seq_len, " exceeds ", c.path,
                 ": max_position_embeddings = ", c.max_positions,
                 "; set model.seq_len <= ", c.max_positions));
    }
    model.seq_len = c.max_positions;
  }
  return absl::OkStatus();
}

absl::Status FillFromHfLlama(const std::string& dir, const std::vector<InitTarget>& targets) {
  FSDP_ASSIGN_OR_RETURN(HfLlamaConfig c, ReadHfLlamaConfig(dir));
  const std::string where = StrCat("model.init_from '", dir, "'");
  // Which file holds each tensor.
  std::map<std::string, std::string> weight_map;
  std::map<std::string, ckpt::SafetensorsFile> files;
  const fs::path index_path = fs::path(dir) / kHfIndexFile;
  const fs::path single_path = fs::path(dir) / kHfSingleFile;
  std::string listed_in;  // the file that says which tensors exist
  if (fs::exists(index_path)) {
    listed_in = index_path.string();
    FSDP_ASSIGN_OR_RETURN(json index, ReadJsonFile(listed_in, where));
    auto map = index.find("weight_map");
    if (map == index.end() || !map->is_object()) {
      return absl::DataLossError(StrCat(listed_in, ": no \"weight_map\" object"));
    }
    for (const auto& [name, file] : map->items()) {
      if (!file.is_string() || file.get<std::string>().find('/') != std::string::npos) {
        return absl::DataLossError(StrCat(listed_in, ": weight_map[\"", name,
                                          "\"] must be a file name in the folder, got ",
                                          file.dump()));
      }
      weight_map[name] = file.get<std::string>();
    }
  } else if (fs::exists(single_path)) {
    listed_in = single_path.string();
    FSDP_ASSIGN_OR_RETURN(ckpt::SafetensorsFile file, ckpt::SafetensorsFile::Open(listed_in));
    for (const auto& [name, entry] : file.entries()) weight_map[name] = kHfSingleFile;
    files.emplace(kHfSingleFile, std::move(file));
  } else {
    return absl::NotFoundError(
        StrCat(where, ": neither ", kHfSingleFile, " nor ", kHfIndexFile, " in the folder"));
  }
  auto open = [&](const std::string& name) -> absl::StatusOr<const ckpt::SafetensorsFile*> {
    auto it = files.find(name);
    if (it == files.end()) {
      FSDP_ASSIGN_OR_RETURN(ckpt::SafetensorsFile file,
                            ckpt::SafetensorsFile::Open((fs::path(dir) / name).string()));
      it = files.emplace(name, std::move(file)).first;
    }
    return &it->second;
  };

  at::NoGradGuard no_grad;
  std::set<std::string> used;
  for (const InitTarget& t : targets) {
    std::optional<std::string> hf = HfNameOf(t.name);
    if (!hf) {
      return absl::FailedPreconditionError(
          StrCat(where, ": the model's parameter '", t.name,
                 "' has no Hugging Face Llama "
                 "counterpart (a Hugging Face folder loads into model.arch llama only)"));
    }
    auto mapped = weight_map.find(*hf);
    if (mapped == weight_map.end()) {
      return absl::FailedPreconditionError(
          StrCat(where, ": no tensor '", *hf, "' (the model's '", t.name, "') in ", listed_in));
    }
    used.insert(*hf);
    FSDP_ASSIGN_OR_RETURN(const ckpt::SafetensorsFile* file, open(mapped->second));
    const std::string file_path = (fs::path(dir) / mapped->second).string();
    auto entry = file->entries().find(*hf);
    if (entry == file->entries().end()) {
      return absl::DataLossError(StrCat(listed_in, " places tensor '", *hf, "' in ", file_path,
                                        ", which does not hold it"));
    }
    if (entry->second.shape != t.shape) {
      return absl::FailedPreconditionError(
          StrCat(where, ": tensor '", *hf, "' in ", file_path, " has shape [",
                 StrJoin(entry->second.shape, ", "), "], the model's '", t.name, "' is [",
                 StrJoin(t.shape, ", "), "] (from ", c.path, ")"));
    }
    const int64_t rows = t.dst.dim() == 0 ? 1 : t.dst.size(0);
    if (rows == 0) continue;
    at::Tensor data;
    if (IsRopeProjection(*hf)) {
      FSDP_RETURN_IF_ERROR(ReadRopeRows(*file, *hf, t.first_row, rows, c.head_dim(), data));
    } else {
      FSDP_RETURN_IF_ERROR(file->ReadRows(*hf, t.first_row, t.first_row + rows, data));
    }
    at::Tensor dst = t.dst;
    dst.copy_(data.reshape(dst.sizes()));
  }
  std::vector<std::string> unexpected;
  for (const auto& [name, file] : weight_map) {
    if (used.count(name) || name.ends_with("rotary_emb.inv_freq") ||
        (c.tie && name == "lm_head.weight")) {
      continue;
    }
    unexpected.push_back(name);
  }
  if (!unexpected.empty()) {
    const size_t shown = std::min<size_t>(unexpected.size(), 5);
    return absl::FailedPreconditionError(StrCat(
        where, ": ", unexpected.size(), " tensor(s) in ", listed_in, " the model does not have (",
        StrJoin(std::vector<std::string>(unexpected.begin(), unexpected.begin() + shown), ", "),
        unexpected.size() > shown ? ", ..." : "", ")"));
  }
  return absl::OkStatus();
}

namespace {

// Tensors in the order transformers lists them: embeddings, layers by number, norm, head.
std::pair<int64_t, std::string> ExportOrder(const std::string& hf) {
  if (hf == "model.embed_tokens.weight") return {-1, hf};
  if (StartsWith(hf, "model.layers.")) {
    const size_t dot = hf.find('.', 13);
    return {ParseInt<int64_t>(std::string_view(hf).substr(13, dot - 13)).value_or(0), hf};
  }
  return {INT64_MAX, hf};
}

const char* HfDtypeName(c10::ScalarType t) {
  switch (t) {
    case at::kBFloat16:
      return "bfloat16";
    case at::kHalf:
      return "float16";
    default:
      return "float32";
  }
}

absl::Status WriteJson(const fs::path& path, const json& value) {
  const std::string tmp = path.string() + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out << value.dump(2) << "\n";
    if (!out.flush()) return absl::FailedPreconditionError(StrCat("cannot write ", tmp));
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec) return absl::FailedPreconditionError(StrCat("cannot rename ", tmp, ": ", ec.message()));
  return absl::OkStatus();
}

}  // namespace

absl::Status ExportHfLlama(const ckpt::CheckpointReader& checkpoint, const std::string& out_dir,
                           const HfExportOptions& options) {
  const ckpt::Metadata& meta = checkpoint.metadata();
  const std::string source = StrCat(checkpoint.dir(), "/", ckpt::kMetadataFile);
  if (!meta.extra.contains("config") || !meta.extra["config"].is_string()) {
    return absl::FailedPreconditionError(
        StrCat(source, ": no run configuration recorded, so the model's shape is unknown"));
  }
  // The recorded config is resolved: init_from (maybe a folder gone since) is not read again.
  FSDP_ASSIGN_OR_RETURN(RunConfig config,
                        ParseRunConfig(meta.extra["config"].get<std::string>(),
                                       StrCat(source, " (config)"), {"model.init_from="}));
  const ModelArgs& m = config.model;
  if (m.arch != "llama" || m.norm != NormKind::kRmsNorm || m.activation != Activation::kSwiglu ||
      m.positions != Positions::kRope) {
    return absl::FailedPreconditionError(StrCat(
        checkpoint.dir(), " holds a model.arch '", m.arch, "' model (", config.Value("model.norm"),
        ", ", config.Value("model.activation"), ", ", config.Value("model.positions"),
        " positions); --format hf writes Llama models only (model.arch llama with rmsnorm, "
        "swiglu, rope): use --format safetensors"));
  }
  std::error_code ec;
  if (fs::exists(out_dir, ec) && !fs::is_empty(out_dir, ec)) {
    return absl::FailedPreconditionError(
        StrCat(out_dir, " exists and is not empty; export into a new folder"));
  }
  fs::create_directories(out_dir, ec);
  if (ec)
    return absl::FailedPreconditionError(StrCat("cannot create ", out_dir, ": ", ec.message()));

  // Every model tensor, renamed, in transformers' order, with its size as written.
  struct Item {
    std::string hf;
    ckpt::LazyTensor tensor;
    int64_t nbytes = 0;
  };
  std::vector<Item> items;
  c10::ScalarType written = at::kFloat;
  for (const ckpt::TensorEntry& entry : meta.tensors) {
    if (!StartsWith(entry.name, "model/")) continue;
    const std::string ours = entry.name.substr(6);
    std::optional<std::string> hf = HfNameOf(ours);
    if (!hf) {
      return absl::FailedPreconditionError(
          StrCat(checkpoint.dir(), ": tensor '", entry.name, "' has no Hugging Face Llama name"));
    }
    FSDP_ASSIGN_OR_RETURN(c10::ScalarType saved, ckpt::DtypeFromName(entry.dtype));
    c10::ScalarType dtype = options.dtype && c10::isFloatingType(saved) ? *options.dtype : saved;
    if (c10::isFloatingType(dtype)) written = dtype;
    const bool rope = IsRopeProjection(*hf);
    const int64_t head_dim = m.head_dim();
    auto values = [&checkpoint, entry, rope, head_dim]() -> absl::StatusOr<at::Tensor> {
      at::Tensor tensor;
      FSDP_RETURN_IF_ERROR(checkpoint.ReadRows(entry.name, 0, entry.shape[0], tensor));
      return rope ? ToHfRopeLayout(tensor, head_dim) : tensor;
    };
    int64_t numel = 1;
    for (int64_t d : entry.shape) numel *= d;
    items.push_back(
        {*hf, {dtype, entry.shape, values}, numel * static_cast<int64_t>(c10::elementSize(dtype))});
  }
  std::sort(items.begin(), items.end(),
            [](const Item& a, const Item& b) { return ExportOrder(a.hf) < ExportOrder(b.hf); });
  // Shards: consecutive tensors up to max_shard_bytes (a larger tensor gets a file of its own).
  std::vector<std::map<std::string, ckpt::LazyTensor>> shards;
  int64_t shard_bytes = 0, total_bytes = 0;
  for (Item& item : items) {
    if (shards.empty() ||
        (shard_bytes > 0 && shard_bytes + item.nbytes > options.max_shard_bytes)) {
      shards.emplace_back();
      shard_bytes = 0;
    }
    shards.back().emplace(item.hf, std::move(item.tensor));
    shard_bytes += item.nbytes;
    total_bytes += item.nbytes;
  }
  if (shards.size() == 1) {
    FSDP_RETURN_IF_ERROR(
        ckpt::WriteLazySafetensors(shards[0], (fs::path(out_dir) / kHfSingleFile).string()));
  } else {
    json weight_map = json::object();
    for (size_t i = 0; i < shards.size(); ++i) {
      const std::string name =
          fmt::format("model-{:05d}-of-{:05d}.safetensors", i + 1, shards.size());
      FSDP_RETURN_IF_ERROR(
          ckpt::WriteLazySafetensors(shards[i], (fs::path(out_dir) / name).string()));
      for (const auto& [hf, tensor] : shards[i]) weight_map[hf] = name;
    }
    FSDP_RETURN_IF_ERROR(
        WriteJson(fs::path(out_dir) / kHfIndexFile,
                  {{"metadata", {{"total_size", total_bytes}}}, {"weight_map", weight_map}}));
  }
  const json hf_config = {{"architectures", {"LlamaForCausalLM"}},
                          {"model_type", "llama"},
                          {"vocab_size", m.vocab_size},
                          {"hidden_size", m.dim},
                          {"intermediate_size", m.ffn()},
                          {"num_hidden_layers", m.n_layers},
                          {"num_attention_heads", m.n_heads},
                          {"num_key_value_heads", m.kv_heads()},
                          {"head_dim", m.head_dim()},
                          {"hidden_act", "silu"},
                          {"max_position_embeddings", m.seq_len},
                          {"rms_norm_eps", m.norm_eps},
                          {"rope_theta", m.rope_theta},
                          {"rope_scaling", nullptr},
                          {"tie_word_embeddings", m.tie_embeddings},
                          {"attention_bias", false},
                          {"attention_dropout", 0.0},
                          {"mlp_bias", false},
                          {"initializer_range", m.init_std},
                          {"torch_dtype", HfDtypeName(written)},
                          {"use_cache", true}};
  FSDP_RETURN_IF_ERROR(
      WriteJson(fs::path(out_dir) / "generation_config.json", {{"_from_model_config", true}}));
  return WriteJson(fs::path(out_dir) / kHfConfigFile, hf_config);
}

}  // namespace fsdp
