#include "cli/checkpoint_command.h"

#include <algorithm>
#include <cctype>
#include <climits>
#include <filesystem>
#include <iostream>
#include <map>
#include <optional>

#include <fmt/format.h>

#include "checkpoint/format.h"
#include "checkpoint/safetensors.h"
#include "common/status.h"
#include "common/strings.h"
#include "engine/hf_llama.h"

namespace fsdp {
namespace {

// A checkpoint folder as given, or the newest one when given the folder that holds them.
std::string Resolve(const std::string& dir) {
  if (std::filesystem::exists(std::filesystem::path(dir) / ckpt::kMetadataFile)) return dir;
  absl::StatusOr<std::string> latest = ckpt::LatestCheckpoint(dir);
  return latest.ok() ? *latest : dir;
}

// Tensors holding NaN or inf (name: count), read in blocks of rows so that no tensor is
// held whole. A checkpoint can be complete and still useless: Note [Non-finite state is never
// saved] (engine/trainer.cc) keeps fsdp train from writing one, and this finds one written
// before that, or by another tool.
absl::StatusOr<std::vector<std::pair<std::string, int64_t>>> NonFiniteTensors(
    const ckpt::CheckpointReader& reader) {
  std::vector<std::pair<std::string, int64_t>> bad;
  for (const ckpt::TensorEntry& t : reader.metadata().tensors) {
    if (t.dtype[0] != 'F' && t.dtype != "BF16") continue;  // integers are always finite
    const int64_t rows = t.shape.empty() ? 1 : t.shape[0];
    int64_t row_numel = 1;
    for (size_t i = 1; i < t.shape.size(); ++i) row_numel *= t.shape[i];
    const int64_t block = std::max<int64_t>(1, (int64_t{16} << 20) / std::max<int64_t>(row_numel, 1));
    int64_t count = 0;
    for (int64_t begin = 0; begin < rows; begin += block) {
      at::Tensor rows_read;
      FSDP_RETURN_IF_ERROR(reader.ReadRows(t.name, begin, std::min(rows, begin + block), rows_read));
      count += rows_read.isfinite().logical_not().sum().item<int64_t>();
    }
    if (count > 0) bad.emplace_back(t.name, count);
  }
  return bad;
}

// "5GB", "500MB", "20KB", "123456" (bytes; decimal units as transformers' max_shard_size).
std::optional<int64_t> ParseByteSize(const std::string& text) {
  size_t digits = 0;
  while (digits < text.size() && std::isdigit(static_cast<unsigned char>(text[digits]))) ++digits;
  std::optional<int64_t> number = ParseInt<int64_t>(std::string_view(text).substr(0, digits));
  if (!number || *number < 1) return std::nullopt;
  const std::string unit = ToLower(std::string_view(text).substr(digits));
  const std::map<std::string, int64_t> units = {{"", 1},
                                                {"b", 1},
                                                {"kb", 1000},
                                                {"mb", 1000 * 1000},
                                                {"gb", 1000 * 1000 * 1000},
                                                {"kib", 1 << 10},
                                                {"mib", 1 << 20},
                                                {"gib", 1 << 30}};
  auto it = units.find(unit);
  if (it == units.end() || *number > INT64_MAX / it->second) return std::nullopt;
  return *number * it->second;
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
    absl::StatusOr<std::vector<std::pair<std::string, int64_t>>> bad = NonFiniteTensors(*reader);
    if (!bad.ok()) {
      std::cerr << "fsdp checkpoint inspect: " << bad.status().message() << "\n";
      std::cout << "complete: no\n";
      return 1;
    }
    if (!bad->empty()) {
      for (const auto& [name, count] : *bad) {
        std::cout << fmt::format("  non-finite  {} ({} NaN/inf elements)\n", name, count);
      }
      std::cout << "complete: yes, but " << bad->size() << " of " << m.tensors.size()
                << " tensors hold NaN or inf: do not resume from it\n";
      return 1;
    }
  }
  std::cout << "complete: yes"
            << (command.verify ? " (every file's CRC-32 verified, every tensor finite)" : "") << "\n";
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
  absl::Status status;
  if (command.format == "hf") {
    std::optional<int64_t> max_shard = ParseByteSize(command.max_shard_size);
    if (!max_shard) {
      std::cerr << "fsdp checkpoint export: --max-shard-size '" << command.max_shard_size
                << "': expected a size such as 5GB, 500MB, 20KB or a number of bytes\n";
      return 1;
    }
    status = ExportHfLlama(*reader, command.out, {.dtype = dtype, .max_shard_bytes = *max_shard});
  } else {
    status = ckpt::ExportSafetensors(*reader, "model/", command.out, dtype);
  }
  if (!status.ok()) {
    std::cerr << "fsdp checkpoint export: " << status.message() << "\n";
    return 1;
  }
  std::cout << "fsdp checkpoint export: " << dir << " (step " << reader->metadata().step
            << ") -> " << command.out << "\n";
  return 0;
}

}  // namespace fsdp
