// `fsdp checkpoint inspect DIR [--verify]` and
// `fsdp checkpoint export DIR --out F [--dtype] [--format safetensors|hf] [--max-shard-size]`.
#pragma once

#include <string>

namespace fsdp {

struct CheckpointCommand {
  std::string dir;
  bool verify = false;
  std::string out;
  std::string dtype;
  std::string format = "safetensors";  // safetensors: one file, our names | hf: a Llama folder
  std::string max_shard_size = "5GB";  // hf: bytes per file, e.g. 5GB, 500MB, 20KB, 123456
};

int RunCheckpointInspect(const CheckpointCommand& command);
int RunCheckpointExport(const CheckpointCommand& command);

}  // namespace fsdp
