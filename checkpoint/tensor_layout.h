// Internal to checkpoint/: the row arithmetic of stored tensors (a tensor is stored as dim-0
// row ranges, "chunks"; a scalar is one row) and the checks that chunks tile a tensor.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/metadata.h"

namespace fsdp::ckpt {

// "[2, 3]".
std::string ShapeString(const std::vector<int64_t>& shape);
// Rows of dim 0 (a scalar is one row).
int64_t NumRows(const std::vector<int64_t>& shape);
// Elements per row, or nullopt on overflow.
std::optional<int64_t> RowNumel(const std::vector<int64_t>& shape);
// Why the chunks (sorted by row_begin) do not tile [0, rows) exactly once, or nullopt.
std::optional<std::string> TilingError(const TensorEntry& t);
// Sorts the chunks by row_begin (stable).
void SortChunks(TensorEntry& t);
// A file name inside the checkpoint folder: no path separators, not "." or "..".
bool IsPlainFileName(const std::string& name);

}  // namespace fsdp::ckpt
