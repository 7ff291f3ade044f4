// Row arithmetic, dtype names and the merge of rank manifests (metadata.h, tensor_layout.h).
#include "checkpoint/tensor_layout.h"

#include <algorithm>
#include <map>
#include <utility>

#include "common/strings.h"

namespace fsdp::ckpt {
namespace {

constexpr std::pair<c10::ScalarType, const char*> kDtypes[] = {
    {c10::ScalarType::Float, "F32"}, {c10::ScalarType::BFloat16, "BF16"},
    {c10::ScalarType::Half, "F16"},  {c10::ScalarType::Double, "F64"},
    {c10::ScalarType::Long, "I64"},  {c10::ScalarType::Int, "I32"}};

}  // namespace

std::string ShapeString(const std::vector<int64_t>& shape) {
  return StrCat("[", StrJoin(shape, ", "), "]");
}

int64_t NumRows(const std::vector<int64_t>& shape) { return shape.empty() ? 1 : shape[0]; }

std::optional<int64_t> RowNumel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (size_t i = 1; i < shape.size(); ++i) {
    if (__builtin_mul_overflow(n, shape[i], &n)) return std::nullopt;
  }
  return n;
}

bool ShapeFitsInTensor(const std::vector<int64_t>& shape, int64_t element_size) {
  int64_t n = element_size;
  for (int64_t d : shape) {
    if (__builtin_mul_overflow(n, std::max<int64_t>(d, 1), &n)) return false;
  }
  return true;
}

std::optional<std::string> TilingError(const TensorEntry& t) {
  int64_t rows = NumRows(t.shape);
  int64_t next = 0;
  for (const Chunk& c : t.chunks) {
    if (c.row_end <= c.row_begin) {
      return StrCat("chunk in ", c.file, " has an empty row range [", c.row_begin, ", ", c.row_end,
                    ")");
    }
    if (c.row_begin > next)
      return StrCat("gap: rows [", next, ", ", c.row_begin, ") are in no chunk");
    if (c.row_begin < next) {
      return StrCat("overlap: rows [", c.row_begin, ", ", std::min(next, c.row_end),
                    ") are in more than one chunk (the second in ", c.file, ")");
    }
    if (c.row_end > rows) {
      return StrCat("chunk in ", c.file, " has rows [", c.row_begin, ", ", c.row_end,
                    ") beyond the ", rows, " rows of shape ", ShapeString(t.shape));
    }
    next = c.row_end;
  }
  if (next < rows) return StrCat("gap: rows [", next, ", ", rows, ") are in no chunk");
  return std::nullopt;
}

void SortChunks(TensorEntry& t) {
  std::stable_sort(t.chunks.begin(), t.chunks.end(),
                   [](const Chunk& a, const Chunk& b) { return a.row_begin < b.row_begin; });
}

bool IsPlainFileName(const std::string& name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos &&
         name.find('\0') == std::string::npos;
}

const char* DtypeName(c10::ScalarType dtype) {
  for (const auto& [type, name] : kDtypes) {
    if (type == dtype) return name;
  }
  return "";
}

absl::StatusOr<c10::ScalarType> DtypeFromName(const std::string& name) {
  for (const auto& [type, dtype_name] : kDtypes) {
    if (name == dtype_name) return type;
  }
  return absl::InvalidArgumentError(
      StrCat("unknown dtype '", name, "' (expected one of F32, BF16, F16, F64, I64, I32)"));
}

absl::StatusOr<std::vector<TensorEntry>> MergeManifests(const std::vector<RankManifest>& ranks) {
  std::vector<TensorEntry> merged;
  std::map<std::string, size_t> index;
  std::map<std::string, int> file_owner;
  for (const RankManifest& m : ranks) {
    auto [it, inserted] = file_owner.emplace(m.file.file, m.rank);
    if (!inserted) {
      return absl::InternalError(
          StrCat("ranks ", it->second, " and ", m.rank, " both report the file ", m.file.file));
    }
    for (const TensorEntry& t : m.tensors) {
      auto [pos, is_new] = index.emplace(t.name, merged.size());
      if (is_new) {
        merged.push_back(TensorEntry{t.name, t.dtype, t.shape, {}});
      }
      TensorEntry& entry = merged[pos->second];
      if (entry.dtype != t.dtype || entry.shape != t.shape) {
        return absl::InternalError(StrCat("tensor ", t.name, ": rank ", m.rank, " has ", t.dtype,
                                          " ", ShapeString(t.shape), ", another rank has ",
                                          entry.dtype, " ", ShapeString(entry.shape)));
      }
      entry.chunks.insert(entry.chunks.end(), t.chunks.begin(), t.chunks.end());
    }
  }
  for (TensorEntry& t : merged) {
    SortChunks(t);
    if (std::optional<std::string> error = TilingError(t)) {
      return absl::InternalError(StrCat("tensor ", t.name, ": ", *error));
    }
  }
  return merged;
}

}  // namespace fsdp::ckpt
