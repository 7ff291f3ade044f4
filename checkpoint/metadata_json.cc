// The JSON schemas of metadata.json and of the rank manifest (metadata.h).
#include <algorithm>
#include <limits>
#include <map>
#include <optional>
#include <utility>

#include "checkpoint/json_reader.h"
#include "checkpoint/metadata.h"
#include "checkpoint/tensor_layout.h"
#include "common/status.h"
#include "common/strings.h"

namespace fsdp::ckpt {
namespace {

constexpr const char* kFormatName = "fsdp.cpp-checkpoint";

// Whether a tensor's chunks must cover all its rows (metadata.json) or only lie within them
// (one rank's manifest).
enum class Tiling { kWhole, kPart };

nlohmann::json FileToJson(const FileEntry& f) {
  return {{"file", f.file}, {"size", f.size}, {"crc32", f.crc32}};
}

nlohmann::json TensorsToJson(const std::vector<TensorEntry>& entries) {
  nlohmann::json tensors = nlohmann::json::array();
  for (const TensorEntry& t : entries) {
    nlohmann::json chunks = nlohmann::json::array();
    for (const Chunk& c : t.chunks) {
      chunks.push_back({{"file", c.file},
                        {"offset", c.offset},
                        {"nbytes", c.nbytes},
                        {"rows", {c.row_begin, c.row_end}},
                        {"crc32", c.crc32}});
    }
    tensors.push_back({{"name", t.name},
                       {"dtype", t.dtype},
                       {"shape", nlohmann::json(t.shape)},
                       {"chunks", std::move(chunks)}});
  }
  return tensors;
}

// {"file", "size", "crc32"} at `path` (no trailing ".").
absl::StatusOr<FileEntry> FileFromJson(const JsonReader& in, const nlohmann::json& f,
                                       const std::string& path) {
  if (!f.is_object()) return in.Error(path, StrCat("expected an object, got ", f.type_name()));
  const std::string p = path + ".";
  FileEntry e;
  FSDP_ASSIGN_OR_RETURN(e.file, in.StringField(f, p, "file"));
  if (!IsPlainFileName(e.file)) {
    return in.Error(p + "file", StrCat("'", e.file, "' is not a plain file name"));
  }
  FSDP_ASSIGN_OR_RETURN(e.size, in.IntField(f, p, "size", 0));
  FSDP_ASSIGN_OR_RETURN(int64_t crc, in.IntField(f, p, "crc32", 0, 0xFFFFFFFFll));
  e.crc32 = static_cast<uint32_t>(crc);
  return e;
}

absl::StatusOr<Chunk> ChunkFromJson(const JsonReader& in, const nlohmann::json& j,
                                    const std::string& path,
                                    const std::map<std::string, int64_t>& file_sizes) {
  if (!j.is_object()) return in.Error(path, StrCat("expected an object, got ", j.type_name()));
  std::string p = path + ".";
  Chunk c;
  FSDP_ASSIGN_OR_RETURN(c.file, in.StringField(j, p, "file"));
  if (!IsPlainFileName(c.file)) {
    return in.Error(p + "file", StrCat("'", c.file, "' is not a plain file name"));
  }
  auto size = file_sizes.find(c.file);
  if (size == file_sizes.end()) {
    return in.Error(p + "file", StrCat("'", c.file, "' is not listed in files"));
  }
  FSDP_ASSIGN_OR_RETURN(c.offset, in.IntField(j, p, "offset", 0));
  FSDP_ASSIGN_OR_RETURN(c.nbytes, in.IntField(j, p, "nbytes", 0));
  if (c.offset > size->second || c.nbytes > size->second - c.offset) {
    return in.Error(p + "nbytes",
                    StrCat("bytes [", c.offset, ", ", c.offset + c.nbytes,
                           ") are beyond the end of ", c.file, " (", size->second, " bytes)"));
  }
  FSDP_ASSIGN_OR_RETURN(const nlohmann::json* rows,
                        in.TypedField(j, p, "rows", nlohmann::json::value_t::array));
  if (rows->size() != 2) return in.Error(p + "rows", "expected [begin, end]");
  FSDP_ASSIGN_OR_RETURN(c.row_begin, in.Int((*rows)[0], p + "rows[0]", 0));
  FSDP_ASSIGN_OR_RETURN(c.row_end, in.Int((*rows)[1], p + "rows[1]", 0));
  if (c.row_end <= c.row_begin) {
    return in.Error(p + "rows", StrCat("empty row range [", c.row_begin, ", ", c.row_end, ")"));
  }
  FSDP_ASSIGN_OR_RETURN(int64_t crc, in.IntField(j, p, "crc32", 0, 0xFFFFFFFFll));
  c.crc32 = static_cast<uint32_t>(crc);
  return c;
}

absl::StatusOr<TensorEntry> TensorFromJson(const JsonReader& in, const nlohmann::json& j,
                                           const std::string& path,
                                           const std::map<std::string, int64_t>& file_sizes,
                                           Tiling tiling) {
  if (!j.is_object()) return in.Error(path, StrCat("expected an object, got ", j.type_name()));
  std::string p = path + ".";
  TensorEntry t;
  FSDP_ASSIGN_OR_RETURN(t.name, in.StringField(j, p, "name"));
  if (t.name.empty()) return in.Error(p + "name", "empty");
  FSDP_ASSIGN_OR_RETURN(t.dtype, in.StringField(j, p, "dtype"));
  absl::StatusOr<c10::ScalarType> dtype = DtypeFromName(t.dtype);
  if (!dtype.ok()) return in.Error(p + "dtype", std::string(dtype.status().message()));
  FSDP_ASSIGN_OR_RETURN(const nlohmann::json* shape,
                        in.TypedField(j, p, "shape", nlohmann::json::value_t::array));
  for (size_t i = 0; i < shape->size(); ++i) {
    FSDP_ASSIGN_OR_RETURN(int64_t d, in.Int((*shape)[i], StrCat(p, "shape[", i, "]"), 0));
    t.shape.push_back(d);
  }
  std::optional<int64_t> row_numel = RowNumel(t.shape);
  int64_t row_bytes = 0;
  if (!row_numel || !ShapeFitsInTensor(t.shape, c10::elementSize(*dtype)) ||
      __builtin_mul_overflow(*row_numel, static_cast<int64_t>(c10::elementSize(*dtype)),
                             &row_bytes)) {
    return in.Error(p + "shape", StrCat(ShapeString(t.shape), " is too large"));
  }
  FSDP_ASSIGN_OR_RETURN(const nlohmann::json* chunks,
                        in.TypedField(j, p, "chunks", nlohmann::json::value_t::array));
  for (size_t i = 0; i < chunks->size(); ++i) {
    std::string cp = StrCat(p, "chunks[", i, "]");
    FSDP_ASSIGN_OR_RETURN(Chunk c, ChunkFromJson(in, (*chunks)[i], cp, file_sizes));
    int64_t expected = 0;
    if (__builtin_mul_overflow(c.row_end - c.row_begin, row_bytes, &expected) ||
        c.nbytes != expected) {
      return in.Error(cp + ".nbytes",
                      StrCat(c.nbytes, " bytes, but rows [", c.row_begin, ", ", c.row_end, ") of ",
                             t.dtype, " ", ShapeString(t.shape), " take ",
                             (c.row_end - c.row_begin), " x ", row_bytes, " bytes"));
    }
    t.chunks.push_back(std::move(c));
  }
  SortChunks(t);
  if (tiling == Tiling::kWhole) {
    if (std::optional<std::string> error = TilingError(t)) return in.Error(p + "chunks", *error);
  } else {
    for (size_t i = 0; i < t.chunks.size(); ++i) {
      if (t.chunks[i].row_end > NumRows(t.shape)) {
        return in.Error(
            p + "chunks",
            StrCat("rows [", t.chunks[i].row_begin, ", ", t.chunks[i].row_end, ") are beyond the ",
                   NumRows(t.shape), " rows of shape ", ShapeString(t.shape)));
      }
    }
  }
  return t;
}

// The root's "tensors" array; names must be unique.
absl::StatusOr<std::vector<TensorEntry>> TensorsFromJson(
    const JsonReader& in, const nlohmann::json& root,
    const std::map<std::string, int64_t>& file_sizes, Tiling tiling) {
  FSDP_ASSIGN_OR_RETURN(const nlohmann::json* tensors,
                        in.TypedField(root, "", "tensors", nlohmann::json::value_t::array));
  std::vector<TensorEntry> out;
  std::map<std::string, size_t> names;
  for (size_t i = 0; i < tensors->size(); ++i) {
    std::string p = StrCat("tensors[", i, "]");
    FSDP_ASSIGN_OR_RETURN(TensorEntry t, TensorFromJson(in, (*tensors)[i], p, file_sizes, tiling));
    auto [it, inserted] = names.emplace(t.name, i);
    if (!inserted) {
      return in.Error(p + ".name", StrCat("'", t.name, "' is also tensors[", it->second, "]"));
    }
    out.push_back(std::move(t));
  }
  return out;
}

}  // namespace

absl::StatusOr<nlohmann::json> ParseJson(std::string_view text, const std::string& source) {
  bool too_deep = false;
  nlohmann::json json;
  try {
    // Containers deeper than the limit are dropped while parsing (the parser itself does not
    // recurse), then refused.
    json = nlohmann::json::parse(
        text, [&](int depth, nlohmann::json::parse_event_t event, nlohmann::json&) {
          if ((event == nlohmann::json::parse_event_t::object_start ||
               event == nlohmann::json::parse_event_t::array_start) &&
              depth >= kMaxJsonDepth) {
            too_deep = true;
            return false;
          }
          return true;
        });
  } catch (const nlohmann::json::exception& e) {
    return absl::DataLossError(StrCat(source, ": not valid JSON: ", e.what()));
  }
  if (too_deep) {
    return absl::DataLossError(
        StrCat(source, ": not valid JSON: nested deeper than ", kMaxJsonDepth, " levels"));
  }
  return json;
}

nlohmann::json ToJson(const Metadata& metadata) {
  nlohmann::json files = nlohmann::json::array();
  for (const FileEntry& f : metadata.files) files.push_back(FileToJson(f));
  return {{"format", kFormatName},
          {"version", metadata.version},
          {"step", metadata.step},
          {"world_size", metadata.world_size},
          {"mesh", {{"axes", metadata.mesh_axes}, {"degrees", metadata.mesh_degrees}}},
          {"strategy", metadata.strategy},
          {"extra", metadata.extra.is_null() ? nlohmann::json::object() : metadata.extra},
          {"files", std::move(files)},
          {"tensors", TensorsToJson(metadata.tensors)}};
}

absl::StatusOr<Metadata> MetadataFromJson(const nlohmann::json& json, const std::string& source) {
  using VT = nlohmann::json::value_t;
  JsonReader in(source);
  if (!json.is_object())
    return in.Error("(root)", StrCat("expected an object, got ", json.type_name()));
  FSDP_ASSIGN_OR_RETURN(std::string format, in.StringField(json, "", "format"));
  if (format != kFormatName) {
    return in.Error("format", StrCat("'", format, "', expected '", kFormatName, "'"));
  }
  Metadata m;
  FSDP_ASSIGN_OR_RETURN(int64_t version, in.IntField(json, "", "version", 1));
  if (version > kFormatVersion) {
    return absl::UnimplementedError(StrCat(source, ": format version ", version,
                                           " is newer than this build reads (", kFormatVersion,
                                           ")"));
  }
  m.version = static_cast<int>(version);
  FSDP_ASSIGN_OR_RETURN(m.step, in.IntField(json, "", "step", 0));
  FSDP_ASSIGN_OR_RETURN(int64_t world_size,
                        in.IntField(json, "", "world_size", 1, std::numeric_limits<int>::max()));
  m.world_size = static_cast<int>(world_size);
  FSDP_ASSIGN_OR_RETURN(const nlohmann::json* mesh, in.TypedField(json, "", "mesh", VT::object));
  FSDP_ASSIGN_OR_RETURN(const nlohmann::json* axes,
                        in.TypedField(*mesh, "mesh.", "axes", VT::array));
  FSDP_ASSIGN_OR_RETURN(const nlohmann::json* degrees,
                        in.TypedField(*mesh, "mesh.", "degrees", VT::array));
  for (size_t i = 0; i < axes->size(); ++i) {
    if (!(*axes)[i].is_string()) return in.Error(StrCat("mesh.axes[", i, "]"), "expected a string");
    m.mesh_axes.push_back((*axes)[i].get<std::string>());
  }
  for (size_t i = 0; i < degrees->size(); ++i) {
    FSDP_ASSIGN_OR_RETURN(int64_t d, in.Int((*degrees)[i], StrCat("mesh.degrees[", i, "]"), 1,
                                            std::numeric_limits<int>::max()));
    m.mesh_degrees.push_back(static_cast<int>(d));
  }
  if (m.mesh_axes.size() != m.mesh_degrees.size()) {
    return in.Error("mesh",
                    StrCat(m.mesh_axes.size(), " axes but ", m.mesh_degrees.size(), " degrees"));
  }
  FSDP_ASSIGN_OR_RETURN(m.strategy, in.StringField(json, "", "strategy"));
  FSDP_ASSIGN_OR_RETURN(const nlohmann::json* extra, in.TypedField(json, "", "extra", VT::object));
  m.extra = *extra;

  FSDP_ASSIGN_OR_RETURN(const nlohmann::json* files, in.TypedField(json, "", "files", VT::array));
  std::map<std::string, int64_t> file_sizes;
  for (size_t i = 0; i < files->size(); ++i) {
    const nlohmann::json& f = (*files)[i];
    const std::string p = StrCat("files[", i, "]");
    FSDP_ASSIGN_OR_RETURN(FileEntry e, FileFromJson(in, f, p));
    if (!file_sizes.emplace(e.file, e.size).second) {
      return in.Error(p + ".file", StrCat("'", e.file, "' is listed twice"));
    }
    m.files.push_back(std::move(e));
  }

  FSDP_ASSIGN_OR_RETURN(m.tensors, TensorsFromJson(in, json, file_sizes, Tiling::kWhole));
  return m;
}

nlohmann::json RankManifestToJson(const RankManifest& manifest) {
  return {{"rank", manifest.rank},
          {"file", FileToJson(manifest.file)},
          {"tensors", TensorsToJson(manifest.tensors)}};
}

absl::StatusOr<RankManifest> RankManifestFromJson(const nlohmann::json& json,
                                                  const std::string& source) {
  using VT = nlohmann::json::value_t;
  JsonReader in(source);
  if (!json.is_object())
    return in.Error("(root)", StrCat("expected an object, got ", json.type_name()));
  RankManifest m;
  FSDP_ASSIGN_OR_RETURN(int64_t rank,
                        in.IntField(json, "", "rank", 0, std::numeric_limits<int>::max()));
  m.rank = static_cast<int>(rank);
  // A rank that held no rows wrote no file: its file entry is empty and it has no chunks.
  FSDP_ASSIGN_OR_RETURN(const nlohmann::json* file, in.TypedField(json, "", "file", VT::object));
  std::map<std::string, int64_t> file_sizes;
  if (file->value("file", nlohmann::json()) != "") {
    FSDP_ASSIGN_OR_RETURN(m.file, FileFromJson(in, *file, "file"));
    file_sizes.emplace(m.file.file, m.file.size);
  }
  FSDP_ASSIGN_OR_RETURN(m.tensors, TensorsFromJson(in, json, file_sizes, Tiling::kPart));
  return m;
}

}  // namespace fsdp::ckpt
