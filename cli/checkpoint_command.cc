#include "cli/checkpoint_command.h"

#include <filesystem>
#include <iostream>

#include <fmt/format.h>

#include "checkpoint/format.h"
#include "checkpoint/safetensors.h"
#include "common/strings.h"

namespace fsdp {
namespace {

// A checkpoint folder as given, or the newest one when given the folder that holds them.
std::string Resolve(const std::string& dir) {
  if (std::filesystem::exists(std::filesystem::path(dir) / ckpt::kMetadataFile)) return dir;
  absl::StatusOr<std::string> latest = ckpt::LatestCheckpoint(dir);
  return latest.ok() ? *latest : dir;
}

}  // namespace

int RunCheckpointInspect(const CheckpointCommand& command) {
  std::string dir = Resolve(command.dir);
  absl::StatusOr<ckpt::CheckpointReader> reader = ckpt::CheckpointReader::Open(dir);
  if (!reader.ok()) {
    std::cerr << "fsdp checkpoint inspect: " << reader.status().message() << "\n";
    std::cout << "complete: no\n";
    return 1;
  }
  const ckpt::Metadata& m = reader->metadata();
  int64_t bytes = 0;
  for (const ckpt::FileEntry& f : m.files) bytes += f.size;
  std::cout << "checkpoint " << dir << "\n"
            << "  step        " << m.step << "\n"
            << "  saved on    " << m.world_size << " rank(s), mesh (";
  for (size_t i = 0; i < m.mesh_axes.size(); ++i) {
    std::cout << (i ? ", " : "") << m.mesh_axes[i] << "=" << m.mesh_degrees[i];
  }
  std::cout << "), strategy " << m.strategy << "\n"
            << "  files       " << m.files.size() << ", " << bytes << " bytes\n"
            << "  tensors     " << m.tensors.size() << "\n";
  for (const ckpt::TensorEntry& t : m.tensors) {
    int64_t nbytes = 0;
    for (const ckpt::Chunk& c : t.chunks) nbytes += c.nbytes;
    std::cout << fmt::format("    {:<50} {:<5} [{}] {} chunk(s), {} bytes\n", t.name, t.dtype,
                             StrJoin(t.shape, ", "), t.chunks.size(), nbytes);
  }
  if (command.verify) {
    absl::Status verified = reader->VerifyFiles();
    if (!verified.ok()) {
      std::cerr << "fsdp checkpoint inspect: " << verified.message() << "\n";
      std::cout << "complete: no (a file does not match its checksum)\n";
      return 1;
    }
  }
  std::cout << "complete: yes" << (command.verify ? " (every file's CRC-32 verified)" : "") << "\n";
  return 0;
}

int RunCheckpointExport(const CheckpointCommand& command) {
  std::string dir = Resolve(command.dir);
  absl::StatusOr<ckpt::CheckpointReader> reader = ckpt::CheckpointReader::Open(dir);
  if (!reader.ok()) {
    std::cerr << "fsdp checkpoint export: " << reader.status().message() << "\n";
    return 1;
  }
  std::optional<c10::ScalarType> dtype;
  if (command.dtype == "bf16") dtype = at::kBFloat16;
  if (command.dtype == "fp16") dtype = at::kHalf;
  if (command.dtype == "fp32") dtype = at::kFloat;
  absl::Status status = ckpt::ExportSafetensors(*reader, "model/", command.out, dtype);
  if (!status.ok()) {
    std::cerr << "fsdp checkpoint export: " << status.message() << "\n";
    return 1;
  }
  std::cout << "fsdp checkpoint export: " << dir << " (step " << reader->metadata().step
            << ") -> " << command.out << "\n";
  return 0;
}

}  // namespace fsdp
