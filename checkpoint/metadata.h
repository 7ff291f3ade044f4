// What a checkpoint records about its tensors, and its JSON schemas: metadata.json (the index
// of a committed checkpoint) and the rank manifest (what one rank wrote, sent to rank 0 before
// the commit). Both readers validate every field and answer kDataLoss naming the source and the
// field path ("step_000000120/metadata.json: tensors[3].chunks[0].nbytes: ..."): nothing from
// a file or another rank reaches the caller unchecked, and no JSON exception escapes.
//
//   FSDP_ASSIGN_OR_RETURN(nlohmann::json json, ParseJson(text, "rank 3's manifest"));
//   FSDP_ASSIGN_OR_RETURN(RankManifest m, RankManifestFromJson(json, "rank 3's manifest"));
//   FSDP_ASSIGN_OR_RETURN(std::vector<TensorEntry> merged, MergeManifests({m0, m1}));
//   nlohmann::json index = ToJson(metadata);                  // MetadataFromJson reads it back
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <c10/core/ScalarType.h>
#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace fsdp::ckpt {

constexpr int kFormatVersion = 1;
constexpr const char* kMetadataFile = "metadata.json";
constexpr int64_t kMaxMetadataBytes = 256 << 20;
// Deepest nesting of arrays and objects a JSON reader accepts (metadata.json, manifests, the
// safetensors header): nlohmann's copy, compare and dump recurse per level, so a file of
// `[[[[...` would overflow the stack.
constexpr int kMaxJsonDepth = 128;

struct Chunk {
  std::string file;       // file name inside the checkpoint folder, e.g. "rank00001.bin"
  int64_t offset = 0;     // byte offset in the file
  int64_t nbytes = 0;
  int64_t row_begin = 0;  // dim-0 rows [row_begin, row_end) of the global tensor
  int64_t row_end = 0;
  uint32_t crc32 = 0;     // of the chunk's bytes
};

struct TensorEntry {
  std::string name;
  std::string dtype;            // "F32", "BF16", "F16", "F64", "I64", "I32" (safetensors names)
  std::vector<int64_t> shape;   // global shape; a scalar is [] and stored as one row
  std::vector<Chunk> chunks;    // ordered by row_begin; together they cover every row once
};

struct FileEntry {
  std::string file;
  int64_t size = 0;
  uint32_t crc32 = 0;  // of the whole file
};

// What one rank wrote.
struct RankManifest {
  int rank = 0;
  std::vector<TensorEntry> tensors;  // only this rank's chunks
  FileEntry file;                    // file.file is empty when the rank wrote no file
};

struct Metadata {
  int version = kFormatVersion;
  int64_t step = 0;
  int world_size = 1;
  std::vector<std::string> mesh_axes;
  std::vector<int> mesh_degrees;
  std::string strategy;
  nlohmann::json extra;  // trainer state: data position, RNG states, resolved config, ...
  std::vector<TensorEntry> tensors;  // merged: every tensor with all its chunks
  std::vector<FileEntry> files;
};

// Merges the ranks' manifests: chunks of one tensor from several ranks are combined and must
// tile its rows exactly once (kInternal naming the tensor otherwise).
absl::StatusOr<std::vector<TensorEntry>> MergeManifests(const std::vector<RankManifest>& ranks);

// Parses JSON text; kDataLoss "SOURCE: not valid JSON: ..." instead of an exception, also for
// nesting deeper than kMaxJsonDepth.
absl::StatusOr<nlohmann::json> ParseJson(std::string_view text, const std::string& source);

nlohmann::json ToJson(const Metadata& metadata);
// Validates every field (types, ranges, chunks within their files, rows tiling the shape);
// kDataLoss naming `source` and the field otherwise.
absl::StatusOr<Metadata> MetadataFromJson(const nlohmann::json& json, const std::string& source);

// {"rank": 3, "file": {"file", "size", "crc32"}, "tensors": [...as in metadata.json...]}.
nlohmann::json RankManifestToJson(const RankManifest& manifest);
// Validates every field like MetadataFromJson, except that a rank's chunks need not tile their
// tensor (only lie within its rows and in the rank's own file); kDataLoss naming `source` and
// the field otherwise.
absl::StatusOr<RankManifest> RankManifestFromJson(const nlohmann::json& json,
                                                  const std::string& source);

const char* DtypeName(c10::ScalarType dtype);  // at::kFloat -> "F32"; "" if not supported
absl::StatusOr<c10::ScalarType> DtypeFromName(const std::string& name);

}  // namespace fsdp::ckpt
