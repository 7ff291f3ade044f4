// Hugging Face Llama checkpoints in and out: a folder that transformers' LlamaForCausalLM reads
// and writes (config.json, and model.safetensors or model-0000N-of-0000M.safetensors with
// model.safetensors.index.json), mapped to and from the llama arch of models/gpt.
//
//   - In: `model.init_from: <folder>` takes the model's shape from config.json
//     (ApplyHfLlamaConfig, called by the config parser: keys the user set must agree, the rest
//     take config.json's values) and fills the parameters from the safetensors files
//     (FillFromHfLlama, called by FillFromSafetensors for a folder). Every rank reads only the
//     rows of its own shards: no rank holds the whole model.
//   - Out: `fsdp checkpoint export DIR --out FOLDER --format hf` (ExportHfLlama) streams a
//     checkpoint's model tensors, one at a time, into such a folder.
// See Note [Hugging Face names] and Note [RoPE layouts] (hf_llama.cc) for the mapping.
//
// No collectives: each rank calls FillFromHfLlama on its own targets, in any order.
//
//   ModelArgs args;                                       // the YAML's model section
//   auto set_at = [](const std::string& key) { return std::string(); };  // no key set
//   FSDP_RETURN_IF_ERROR(ApplyHfLlamaConfig("llama-hf", set_at, args));  // shape: config.json
//   ... build and shard the model; then each rank, for its shards' rows:
//   FSDP_RETURN_IF_ERROR(FillFromHfLlama("llama-hf", targets));  // InitTarget per shard
//
//   FSDP_ASSIGN_OR_RETURN(ckpt::CheckpointReader reader, ckpt::CheckpointReader::Open(dir));
//   FSDP_RETURN_IF_ERROR(ExportHfLlama(reader, "out-hf", {.max_shard_bytes = 5'000'000'000}));
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <c10/core/ScalarType.h>

#include "absl/status/status.h"
#include "checkpoint/format.h"
#include "engine/checkpointing.h"
#include "models/model.h"

namespace fsdp {

inline constexpr const char* kHfConfigFile = "config.json";
inline constexpr const char* kHfSingleFile = "model.safetensors";
inline constexpr const char* kHfIndexFile = "model.safetensors.index.json";

// Whether model.init_from names a folder (a Hugging Face checkpoint) rather than a file.
bool IsHfCheckpointDir(const std::string& path);

// Reads <dir>/config.json into `model`. `set_at(key)` says where the user set a model key
// ("model.dim") or "" when it was left at its default: a key set that disagrees with
// config.json is kInvalidArgument naming both values; the others take config.json's. Also
// kInvalidArgument for what the llama arch cannot represent (another model_type or
// architecture, rope scaling, biases, a head_dim other than hidden_size / heads, an activation
// other than silu), naming the key and config.json.
absl::Status ApplyHfLlamaConfig(const std::string& dir,
                                const std::function<std::string(const std::string&)>& set_at,
                                ModelArgs& model);

// Fills each target (our parameter names, rows [first_row, first_row + rows)) from the
// folder's safetensors files, reading only those rows. Errors name the folder, the file and the
// tensor: a missing tensor, a shape that disagrees, or a tensor the model does not have.
absl::Status FillFromHfLlama(const std::string& dir, const std::vector<InitTarget>& targets);

struct HfExportOptions {
  std::optional<c10::ScalarType> dtype;     // floating tensors converted to it; none: as saved
  int64_t max_shard_bytes = 5'000'000'000;  // 5GB (the CLI default); above it: several files
};
// Writes the checkpoint's model tensors as a Hugging Face Llama folder `out_dir` (created):
// config.json, generation_config.json, and one or more safetensors files. kFailedPrecondition
// for a checkpoint of another arch, naming it.
absl::Status ExportHfLlama(const ckpt::CheckpointReader& checkpoint, const std::string& out_dir,
                           const HfExportOptions& options);

// The name map (Note [Hugging Face names]): our parameter name -> the Hugging Face one
// ("layers.3.attention.wq" -> "model.layers.3.self_attn.q_proj.weight"), nullopt when there
// is none.
std::optional<std::string> HfNameOf(const std::string& ours);
// Note [RoPE layouts]: the Hugging Face row holding our row `row` of a q or k projection whose
// heads are `head_dim` rows each (a bijection on [0, heads * head_dim)).
int64_t HfRopeRow(int64_t row, int64_t head_dim);

}  // namespace fsdp
