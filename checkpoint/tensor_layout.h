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
// Whether at::empty(shape) of elements of `element_size` bytes can exist: the product of the
// dims, each counted as at least 1 (as libtorch computes strides), times the element size fits
// in int64. Readers refuse other shapes when they open a file ([0, 2^62, 2^62] holds 0 bytes,
// but at::empty throws on it).
bool ShapeFitsInTensor(const std::vector<int64_t>& shape, int64_t element_size);
// Why the chunks (sorted by row_begin) do not tile [0, rows) exactly once, or nullopt.
std::optional<std::string> TilingError(const TensorEntry& t);
// Sorts the chunks by row_begin (stable).
void SortChunks(TensorEntry& t);
// A file name inside the checkpoint folder: no path separators, not "." or "..".
bool IsPlainFileName(const std::string& name);

}  // namespace fsdp::ckpt
