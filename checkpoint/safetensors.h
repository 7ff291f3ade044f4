// Safetensors files (https://github.com/huggingface/safetensors format: 8-byte little-endian
// header length, a JSON header {name: {dtype, shape, data_offsets}, "__metadata__": {...}},
// then the raw bytes): export of a checkpoint's model tensors, and reading for init_from.
//
//   ExportSafetensors(reader, "model/", "model.safetensors", at::kBFloat16);   // streaming
//   SaveSafetensors({{"w", weight}}, "init.safetensors");                       // in memory
//   absl::StatusOr<SafetensorsFile> f = SafetensorsFile::Open("model.safetensors");
//   f->ReadRows("layers.0.attention.wq", 0, 16, out);
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "checkpoint/format.h"

namespace fsdp::ckpt {

// Writes every tensor whose name starts with `prefix` (the prefix stripped) into one file,
// one tensor at a time: memory stays bounded by the largest tensor. `dtype` converts floating
// tensors (e.g. to bf16). Written to a temp file and renamed.
absl::Status ExportSafetensors(const CheckpointReader& checkpoint, const std::string& prefix,
                               const std::string& out_path,
                               std::optional<c10::ScalarType> dtype = std::nullopt);

// Writes `tensors` (any device and dtype; saved as they are, moved to the CPU one at a time)
// into one file, through a temp file and a rename.
absl::Status SaveSafetensors(const std::map<std::string, at::Tensor>& tensors,
                             const std::string& out_path);

// A tensor to write whose values are produced only when its turn comes (streaming exports):
// `values` must return `shape` (any dtype, converted to `dtype`).
struct LazyTensor {
  c10::ScalarType dtype;
  std::vector<int64_t> shape;
  std::function<absl::StatusOr<at::Tensor>()> values;
};
// Writes `tensors` into one file, calling each `values` once, in name order: memory stays
// bounded by the largest tensor. Through a temp file and a rename.
absl::Status WriteLazySafetensors(const std::map<std::string, LazyTensor>& tensors,
                                  const std::string& out_path);

class SafetensorsFile {
 public:
  struct Entry {
    std::string dtype;
    std::vector<int64_t> shape;
    int64_t begin = 0, end = 0;  // byte offsets after the header
  };
  // Validates the header (bounded length, JSON, offsets in the file, sizes match dtype x
  // shape): kDataLoss / kNotFound naming the path.
  static absl::StatusOr<SafetensorsFile> Open(const std::string& path);
  const std::map<std::string, Entry>& entries() const { return entries_; }
  // Rows [row_begin, row_end) of a tensor into `out` (CPU, the file's dtype), reading only them.
  absl::Status ReadRows(const std::string& name, int64_t row_begin, int64_t row_end,
                        at::Tensor& out) const;

 private:
  std::string path_;
  int64_t data_start_ = 0;
  std::map<std::string, Entry> entries_;
};

}  // namespace fsdp::ckpt
