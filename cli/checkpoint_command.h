// `fsdp checkpoint inspect DIR [--verify]` and `fsdp checkpoint export DIR --out F [--dtype]`.
#pragma once

#include <string>

namespace fsdp {

struct CheckpointCommand {
  std::string dir;
  bool verify = false;
  std::string out;
  std::string dtype;
};

int RunCheckpointInspect(const CheckpointCommand& command);
int RunCheckpointExport(const CheckpointCommand& command);

}  // namespace fsdp
