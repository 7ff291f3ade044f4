// The checkpoint format: see format.h and docs/checkpoint.md.
#include "checkpoint/format.h"

#include "checkpoint/file_io.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <system_error>
#include <utility>

#include <ATen/ATen.h>
#include <fmt/format.h>

#include "common/status.h"
#include "common/strings.h"

namespace fsdp::ckpt {
namespace {

static_assert(std::endian::native == std::endian::little,
              "the checkpoint format stores little-endian bytes; big-endian hosts need a swap");

namespace fs = std::filesystem;

constexpr int64_t kAlignment = 64;
constexpr const char* kFormatName = "fsdp.cpp-checkpoint";
constexpr std::pair<c10::ScalarType, const char*> kDtypes[] = {
    {at::kFloat, "F32"},  {at::kBFloat16, "BF16"}, {at::kHalf, "F16"},
    {at::kDouble, "F64"}, {at::kLong, "I64"},      {at::kInt, "I32"}};
// After ShardWriter::Finish: no more Add, no second Finish.
constexpr int kFinishedFd = -2;

// ---- CRC-32 (zlib / IEEE 802.3, reflected polynomial 0xEDB88320) ----

constexpr std::array<uint32_t, 256> MakeCrcTable() {
  std::array<uint32_t, 256> table{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
    table[i] = c;
  }
  return table;
}
constexpr std::array<uint32_t, 256> kCrcTable = MakeCrcTable();

// Like zlib's crc32(crc, data, n): Crc32(Crc32(0, a), b) == Crc32(0, a + b).
uint32_t Crc32(uint32_t crc, const void* data, size_t n) {
  const auto* p = static_cast<const unsigned char*>(data);
  crc = ~crc;
  for (size_t i = 0; i < n; ++i) crc = kCrcTable[(crc ^ p[i]) & 0xFF] ^ (crc >> 8);
  return ~crc;
}

std::string Hex(uint32_t v) { return fmt::format("0x{:08x}", v); }

// ---- POSIX helpers: every error names the path ----

absl::Status ErrnoError(const std::string& path, const char* op, int err) {
  return absl::Status(absl::ErrnoToStatusCode(err),
                      StrCat(path, ": ", op, ": ", std::generic_category().message(err)));
}

std::string JoinPath(const std::string& dir, const std::string& name) {
  if (dir.empty()) return name;
  return dir.back() == '/' ? dir + name : StrCat(dir, "/", name);
}

std::string ParentDir(const std::string& path) {
  std::string parent = fs::path(path).lexically_normal().parent_path().string();
  return parent.empty() ? "." : parent;
}

absl::Status WriteAll(int fd, const void* data, size_t n, const std::string& path) {
  if (!WriteFully(fd, data, n)) return ErrnoError(path, "write", errno);
  return absl::OkStatus();
}

// Reads up to `n` bytes at `offset`; returns how many were read (fewer only at end of file).
absl::StatusOr<size_t> PreadAll(int fd, void* data, size_t n, int64_t offset,
                                const std::string& path) {
  int64_t done = PreadUpTo(fd, data, n, offset);
  if (done < 0) return ErrnoError(path, "read", errno);
  return static_cast<size_t>(done);
}

absl::Status FsyncPath(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoError(path, "open for fsync", errno);
  FdCloser closer(fd);
  if (::fsync(fd) != 0) return ErrnoError(path, "fsync", errno);
  return absl::OkStatus();
}

absl::Status Rename(const std::string& from, const std::string& to) {
  if (::rename(from.c_str(), to.c_str()) != 0) {
    return ErrnoError(from, StrCat("rename to ", to).c_str(), errno);
  }
  return absl::OkStatus();
}

absl::Status RemoveAll(const std::string& path) {
  std::error_code ec;
  fs::remove_all(path, ec);
  if (ec) return ErrnoError(path, "remove", ec.value());
  return absl::OkStatus();
}

// Creates `dir` if missing and opens `path` (in it) for writing, truncated.
absl::StatusOr<int> CreateFile(const std::string& dir, const std::string& path) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return ErrnoError(dir, "create folder", ec.value());
  int fd = ::open(path.c_str(), O_CREAT | O_TRUNC | O_WRONLY | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoError(path, "open", errno);
  return fd;
}

bool IsFile(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

// ---- shapes and rows ----

std::string ShapeString(const std::vector<int64_t>& shape) {
  return StrCat("[", StrJoin(shape, ", "), "]");
}

// Rows of dim 0 (a scalar is one row).
int64_t NumRows(const std::vector<int64_t>& shape) { return shape.empty() ? 1 : shape[0]; }

// Elements per row, or nullopt on overflow.
std::optional<int64_t> RowNumel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (size_t i = 1; i < shape.size(); ++i) {
    if (__builtin_mul_overflow(n, shape[i], &n)) return std::nullopt;
  }
  return n;
}

// Why the chunks (sorted by row_begin) do not tile [0, rows) exactly once, or nullopt.
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

// A file name inside the checkpoint folder: no path separators, not "." or "..".
bool IsPlainFileName(const std::string& name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos &&
         name.find('\0') == std::string::npos;
}

// ---- JSON field access: kDataLoss "SOURCE: PATH: what" ----

class JsonReader {
 public:
  explicit JsonReader(const std::string& source) : source_(source) {}

  absl::Status Error(const std::string& path, const std::string& what) const {
    return absl::DataLossError(StrCat(source_, ": ", path, ": ", what));
  }

  absl::StatusOr<const nlohmann::json*> Field(const nlohmann::json& obj, const std::string& path,
                                              const char* key) const {
    auto it = obj.find(key);
    if (it == obj.end()) return Error(path, "missing");
    return &*it;
  }
  absl::StatusOr<int64_t> Int(const nlohmann::json& v, const std::string& path, int64_t min,
                              int64_t max = std::numeric_limits<int64_t>::max()) const {
    int64_t x = 0;
    if (v.is_number_integer() && !v.is_number_unsigned()) {
      x = v.get<int64_t>();
    } else if (v.is_number_unsigned()) {
      uint64_t u = v.get<uint64_t>();
      if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        return Error(path, StrCat(u, " is out of range"));
      }
      x = static_cast<int64_t>(u);
    } else {
      return Error(path, StrCat("expected an integer, got ", v.type_name()));
    }
    if (x < min || x > max)
      return Error(path, StrCat(x, " is out of range [", min, ", ", max, "]"));
    return x;
  }
  absl::StatusOr<int64_t> IntField(const nlohmann::json& obj, const std::string& path,
                                   const char* key, int64_t min,
                                   int64_t max = std::numeric_limits<int64_t>::max()) const {
    std::string p = StrCat(path, key);
    FSDP_ASSIGN_OR_RETURN(const nlohmann::json* v, Field(obj, p, key));
    return Int(*v, p, min, max);
  }
  absl::StatusOr<std::string> StringField(const nlohmann::json& obj, const std::string& path,
                                          const char* key) const {
    std::string p = StrCat(path, key);
    FSDP_ASSIGN_OR_RETURN(const nlohmann::json* v, Field(obj, p, key));
    if (!v->is_string()) return Error(p, StrCat("expected a string, got ", v->type_name()));
    return v->get<std::string>();
  }
  absl::StatusOr<const nlohmann::json*> TypedField(const nlohmann::json& obj,
                                                   const std::string& path, const char* key,
                                                   nlohmann::json::value_t type) const {
    std::string p = StrCat(path, key);
    FSDP_ASSIGN_OR_RETURN(const nlohmann::json* v, Field(obj, p, key));
    if (v->type() != type) {
      const char* want = type == nlohmann::json::value_t::array ? "an array" : "an object";
      return Error(p, StrCat("expected ", want, ", got ", v->type_name()));
    }
    return v;
  }

 private:
  const std::string& source_;
};

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
                                           const std::map<std::string, int64_t>& file_sizes) {
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
  if (!row_numel || __builtin_mul_overflow(
                        *row_numel, static_cast<int64_t>(c10::elementSize(*dtype)), &row_bytes)) {
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
  if (std::optional<std::string> error = TilingError(t)) return in.Error(p + "chunks", *error);
  return t;
}

}  // namespace

// ---- dtypes ----

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

// ---- merging and JSON ----

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

nlohmann::json ToJson(const Metadata& metadata) {
  nlohmann::json files = nlohmann::json::array();
  for (const FileEntry& f : metadata.files) {
    files.push_back({{"file", f.file}, {"size", f.size}, {"crc32", f.crc32}});
  }
  nlohmann::json tensors = nlohmann::json::array();
  for (const TensorEntry& t : metadata.tensors) {
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
  return {{"format", kFormatName},
          {"version", metadata.version},
          {"step", metadata.step},
          {"world_size", metadata.world_size},
          {"mesh", {{"axes", metadata.mesh_axes}, {"degrees", metadata.mesh_degrees}}},
          {"strategy", metadata.strategy},
          {"extra", metadata.extra.is_null() ? nlohmann::json::object() : metadata.extra},
          {"files", std::move(files)},
          {"tensors", std::move(tensors)}};
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
    std::string p = StrCat("files[", i, "]");
    if (!f.is_object()) return in.Error(p, StrCat("expected an object, got ", f.type_name()));
    p += ".";
    FileEntry e;
    FSDP_ASSIGN_OR_RETURN(e.file, in.StringField(f, p, "file"));
    if (!IsPlainFileName(e.file)) {
      return in.Error(p + "file", StrCat("'", e.file, "' is not a plain file name"));
    }
    FSDP_ASSIGN_OR_RETURN(e.size, in.IntField(f, p, "size", 0));
    FSDP_ASSIGN_OR_RETURN(int64_t crc, in.IntField(f, p, "crc32", 0, 0xFFFFFFFFll));
    e.crc32 = static_cast<uint32_t>(crc);
    if (!file_sizes.emplace(e.file, e.size).second) {
      return in.Error(p + "file", StrCat("'", e.file, "' is listed twice"));
    }
    m.files.push_back(std::move(e));
  }

  FSDP_ASSIGN_OR_RETURN(const nlohmann::json* tensors,
                        in.TypedField(json, "", "tensors", VT::array));
  std::map<std::string, size_t> names;
  for (size_t i = 0; i < tensors->size(); ++i) {
    std::string p = StrCat("tensors[", i, "]");
    FSDP_ASSIGN_OR_RETURN(TensorEntry t, TensorFromJson(in, (*tensors)[i], p, file_sizes));
    auto [it, inserted] = names.emplace(t.name, i);
    if (!inserted) {
      return in.Error(p + ".name", StrCat("'", t.name, "' is also tensors[", it->second, "]"));
    }
    m.tensors.push_back(std::move(t));
  }
  return m;
}

// ---- ShardWriter ----

std::string RankFileName(int rank) { return fmt::format("rank{:05d}.bin", rank); }

ShardWriter::ShardWriter(std::string dir, int rank)
    : dir_(std::move(dir)), rank_(rank), file_name_(RankFileName(rank)) {
  manifest_.rank = rank;
}

ShardWriter::ShardWriter(ShardWriter&& other) noexcept
    : dir_(std::move(other.dir_)),
      rank_(other.rank_),
      file_name_(std::move(other.file_name_)),
      fd_(std::exchange(other.fd_, kFinishedFd)),
      size_(other.size_),
      file_crc_(other.file_crc_),
      manifest_(std::move(other.manifest_)) {}

ShardWriter::~ShardWriter() {
  if (fd_ >= 0) ::close(fd_);
}

absl::Status ShardWriter::Add(const std::string& name, const at::Tensor& rows, int64_t row_begin,
                              const std::vector<int64_t>& global_shape) {
  const std::string path = JoinPath(dir_, file_name_);
  if (fd_ == kFinishedFd) {
    return absl::FailedPreconditionError(StrCat(path, ": Add(", name, ") after Finish"));
  }
  if (name.empty()) return absl::InvalidArgumentError(StrCat(path, ": empty tensor name"));
  if (!rows.defined()) return absl::InvalidArgumentError(StrCat(name, ": undefined tensor"));
  const char* dtype = DtypeName(rows.scalar_type());
  if (*dtype == '\0') {
    return absl::InvalidArgumentError(
        StrCat(name, ": dtype ", c10::toString(rows.scalar_type()), " is not supported"));
  }
  for (int64_t d : global_shape) {
    if (d < 0) {
      return absl::InvalidArgumentError(StrCat(name, ": bad shape ", ShapeString(global_shape)));
    }
  }
  std::vector<int64_t> local(rows.sizes().begin(), rows.sizes().end());
  int64_t num_rows = 1;
  if (global_shape.empty()) {
    if (rows.dim() != 0 || row_begin != 0) {
      return absl::InvalidArgumentError(
          StrCat(name, ": a scalar is stored as rows [0, 1) of a 0-dim tensor, got shape ",
                 ShapeString(local), " at row ", row_begin));
    }
  } else {
    num_rows = rows.dim() == 0 ? -1 : local[0];
    bool same_rest = rows.dim() == static_cast<int64_t>(global_shape.size()) &&
                     std::equal(local.begin() + 1, local.end(), global_shape.begin() + 1);
    if (!same_rest || row_begin < 0 || row_begin + num_rows > global_shape[0]) {
      return absl::InvalidArgumentError(
          StrCat(name, ": rows of shape ", ShapeString(local), " at row ", row_begin,
                 " do not fit the global shape ", ShapeString(global_shape)));
    }
  }

  // The tensor is listed even when this rank holds none of its rows.
  auto entry = std::find_if(manifest_.tensors.begin(), manifest_.tensors.end(),
                            [&](const TensorEntry& t) { return t.name == name; });
  if (entry == manifest_.tensors.end()) {
    manifest_.tensors.push_back(TensorEntry{name, dtype, global_shape, {}});
    entry = manifest_.tensors.end() - 1;
  } else if (entry->dtype != dtype || entry->shape != global_shape) {
    return absl::InvalidArgumentError(StrCat(name, ": added as ", entry->dtype, " ",
                                             ShapeString(entry->shape), " and as ", dtype, " ",
                                             ShapeString(global_shape)));
  }
  if (num_rows == 0) return absl::OkStatus();

  if (fd_ < 0) {
    FSDP_ASSIGN_OR_RETURN(fd_, CreateFile(dir_, path));
  }
  at::Tensor cpu = rows.to(at::kCPU).contiguous();
  static constexpr char kZeros[kAlignment] = {};
  int64_t pad = (kAlignment - size_ % kAlignment) % kAlignment;
  FSDP_RETURN_IF_ERROR(WriteAll(fd_, kZeros, static_cast<size_t>(pad), path));
  file_crc_ = Crc32(file_crc_, kZeros, static_cast<size_t>(pad));
  size_ += pad;

  Chunk chunk;
  chunk.file = file_name_;
  chunk.offset = size_;
  chunk.nbytes = static_cast<int64_t>(cpu.nbytes());
  chunk.row_begin = row_begin;
  chunk.row_end = row_begin + num_rows;
  chunk.crc32 = Crc32(0, cpu.const_data_ptr(), cpu.nbytes());
  FSDP_RETURN_IF_ERROR(WriteAll(fd_, cpu.const_data_ptr(), cpu.nbytes(), path));
  file_crc_ = Crc32(file_crc_, cpu.const_data_ptr(), cpu.nbytes());
  size_ += chunk.nbytes;
  entry->chunks.push_back(std::move(chunk));
  return absl::OkStatus();
}

absl::StatusOr<RankManifest> ShardWriter::Finish() {
  const std::string path = JoinPath(dir_, file_name_);
  if (fd_ == kFinishedFd) return absl::FailedPreconditionError(StrCat(path, ": Finish twice"));
  // Nothing added: the file exists, empty.
  if (fd_ < 0) {
    FSDP_ASSIGN_OR_RETURN(fd_, CreateFile(dir_, path));
  }
  int fd = std::exchange(fd_, kFinishedFd);
  if (::fsync(fd) != 0) {
    int err = errno;
    ::close(fd);
    return ErrnoError(path, "fsync", err);
  }
  if (::close(fd) != 0) return ErrnoError(path, "close", errno);
  manifest_.file = FileEntry{file_name_, size_, file_crc_};
  return std::move(manifest_);
}

// ---- metadata and commit ----

absl::Status WriteMetadata(const std::string& dir, const Metadata& metadata) {
  const std::string path = JoinPath(dir, kMetadataFile);
  nlohmann::json json = ToJson(metadata);
  absl::StatusOr<Metadata> valid = MetadataFromJson(json, path);
  if (!valid.ok()) {
    return absl::InternalError(
        StrCat("refusing to write invalid metadata: ", std::string(valid.status().message())));
  }
  std::string text;
  try {
    text = json.dump(1) + "\n";
  } catch (const nlohmann::json::exception& e) {
    return absl::InvalidArgumentError(StrCat(path, ": ", e.what()));
  }
  if (static_cast<int64_t>(text.size()) > kMaxMetadataBytes) {
    return absl::ResourceExhaustedError(
        StrCat(path, ": ", text.size(), " bytes, more than the limit of ", kMaxMetadataBytes));
  }
  const std::string tmp = path + ".tmp";
  FSDP_ASSIGN_OR_RETURN(int fd, CreateFile(dir, tmp));
  {
    FdCloser closer(fd);
    FSDP_RETURN_IF_ERROR(WriteAll(fd, text.data(), text.size(), tmp));
    if (::fsync(fd) != 0) return ErrnoError(tmp, "fsync", errno);
  }
  FSDP_RETURN_IF_ERROR(Rename(tmp, path));
  return FsyncPath(dir);
}

absl::Status CommitCheckpoint(const std::string& tmp_dir, const std::string& final_dir) {
  if (!IsFile(JoinPath(tmp_dir, kMetadataFile))) {
    return absl::FailedPreconditionError(
        StrCat(tmp_dir, ": no ", kMetadataFile, ": refusing to commit an incomplete checkpoint"));
  }
  FSDP_RETURN_IF_ERROR(FsyncPath(tmp_dir));
  const std::string parent = ParentDir(final_dir);
  const std::string old = final_dir + ".old";
  bool replacing = fs::exists(final_dir);
  if (replacing) {
    if (fs::exists(old)) FSDP_RETURN_IF_ERROR(RemoveAll(old));
    FSDP_RETURN_IF_ERROR(Rename(final_dir, old));
  }
  FSDP_RETURN_IF_ERROR(Rename(tmp_dir, final_dir));
  FSDP_RETURN_IF_ERROR(FsyncPath(parent));
  if (ParentDir(tmp_dir) != parent) FSDP_RETURN_IF_ERROR(FsyncPath(ParentDir(tmp_dir)));
  if (replacing) {
    FSDP_RETURN_IF_ERROR(RemoveAll(old));
    FSDP_RETURN_IF_ERROR(FsyncPath(parent));
  }
  return absl::OkStatus();
}

std::string StepDirName(int64_t step) { return fmt::format("step_{:09d}", step); }

namespace {

enum class DirKind { kCommitted, kTmp, kOld };
struct StepDir {
  int64_t step;
  DirKind kind;
  std::string path;
};

// "step_<digits>" with an optional ".tmp" / ".old" suffix.
std::optional<StepDir> ParseStepDir(const std::string& root, const std::string& name) {
  std::string_view s = name;
  if (!StartsWith(s, "step_")) return std::nullopt;
  s.remove_prefix(5);
  DirKind kind = DirKind::kCommitted;
  for (auto [suffix, k] : {std::pair{".tmp", DirKind::kTmp}, std::pair{".old", DirKind::kOld}}) {
    std::string_view sv = suffix;
    if (s.size() > sv.size() && s.substr(s.size() - sv.size()) == sv) {
      s.remove_suffix(sv.size());
      kind = k;
      break;
    }
  }
  if (s.empty() || !std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    return std::nullopt;
  }
  std::optional<int64_t> step = ParseInt<int64_t>(s);
  if (!step) return std::nullopt;
  return StepDir{*step, kind, JoinPath(root, name)};
}

absl::StatusOr<std::vector<StepDir>> ListStepDirs(const std::string& root) {
  std::vector<StepDir> dirs;
  std::error_code ec;
  fs::directory_iterator it(root, ec);
  if (ec) return ErrnoError(root, "list", ec.value());
  for (; it != fs::directory_iterator(); it.increment(ec)) {
    if (!it->is_directory(ec)) continue;
    std::optional<StepDir> d = ParseStepDir(root, it->path().filename().string());
    if (!d) continue;
    if (d->kind == DirKind::kCommitted && !IsFile(JoinPath(d->path, kMetadataFile))) continue;
    dirs.push_back(std::move(*d));
  }
  if (ec) return ErrnoError(root, "list", ec.value());
  std::sort(dirs.begin(), dirs.end(),
            [](const StepDir& a, const StepDir& b) { return a.step > b.step; });
  return dirs;
}

}  // namespace

absl::StatusOr<std::string> LatestCheckpoint(const std::string& root) {
  std::error_code ec;
  if (!fs::is_directory(root, ec))
    return absl::NotFoundError(StrCat(root, ": no checkpoint (no such folder)"));
  FSDP_ASSIGN_OR_RETURN(std::vector<StepDir> dirs, ListStepDirs(root));
  for (const StepDir& d : dirs) {
    if (d.kind == DirKind::kCommitted) return d.path;
  }
  return absl::NotFoundError(
      StrCat(root, ": no checkpoint (no step_<N> folder with a ", kMetadataFile, ")"));
}

absl::Status PruneCheckpoints(const std::string& root, int keep) {
  if (keep < 1) {
    return absl::InvalidArgumentError(StrCat("keep must be at least 1, got ", keep));
  }
  FSDP_ASSIGN_OR_RETURN(std::vector<StepDir> dirs, ListStepDirs(root));
  std::optional<int64_t> newest;
  std::map<int64_t, bool> committed;
  int kept = 0;
  for (const StepDir& d : dirs) {  // Newest first.
    if (d.kind != DirKind::kCommitted) continue;
    if (!newest) newest = d.step;
    committed[d.step] = true;
    if (++kept > keep) FSDP_RETURN_IF_ERROR(RemoveAll(d.path));
  }
  if (!newest) return absl::OkStatus();
  for (const StepDir& d : dirs) {
    // A .tmp at or below the newest committed step is a save that died; a .old next to its
    // committed step is what an interrupted re-save left behind.
    bool stale_tmp = d.kind == DirKind::kTmp && d.step <= *newest;
    bool stale_old = d.kind == DirKind::kOld && committed.count(d.step) > 0;
    if (stale_tmp || stale_old) FSDP_RETURN_IF_ERROR(RemoveAll(d.path));
  }
  return absl::OkStatus();
}

// ---- CheckpointReader ----

absl::StatusOr<CheckpointReader> CheckpointReader::Open(const std::string& dir) {
  const std::string path = JoinPath(dir, kMetadataFile);
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) {
      return absl::NotFoundError(StrCat(dir, ": no ", kMetadataFile,
                                        ": not a checkpoint, or a save that never completed"));
    }
    return ErrnoError(path, "open", errno);
  }
  FdCloser closer(fd);
  struct stat st;
  if (::fstat(fd, &st) != 0) return ErrnoError(path, "stat", errno);
  if (st.st_size > kMaxMetadataBytes) {
    return absl::DataLossError(
        StrCat(path, ": ", st.st_size, " bytes, more than the limit of ", kMaxMetadataBytes));
  }
  std::string text(static_cast<size_t>(st.st_size), '\0');
  FSDP_ASSIGN_OR_RETURN(size_t got, PreadAll(fd, text.data(), text.size(), 0, path));
  text.resize(got);
  nlohmann::json json;
  try {
    json = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    return absl::DataLossError(StrCat(path, ": not valid JSON: ", e.what()));
  }
  CheckpointReader reader;
  reader.dir_ = dir;
  FSDP_ASSIGN_OR_RETURN(reader.metadata_, MetadataFromJson(json, path));
  for (const FileEntry& f : reader.metadata_.files) {
    std::string file = JoinPath(dir, f.file);
    struct stat fst;
    if (::stat(file.c_str(), &fst) != 0) {
      if (errno == ENOENT) {
        return absl::DataLossError(
            StrCat(file, ": missing (", kMetadataFile, " lists it with ", f.size, " bytes)"));
      }
      return ErrnoError(file, "stat", errno);
    }
    if (!S_ISREG(fst.st_mode)) return absl::DataLossError(StrCat(file, ": not a regular file"));
    if (fst.st_size != f.size) {
      return absl::DataLossError(StrCat(file, ": ", fst.st_size < f.size ? "truncated: " : "",
                                        fst.st_size, " bytes, expected ", f.size));
    }
  }
  for (size_t i = 0; i < reader.metadata_.tensors.size(); ++i) {
    reader.index_[reader.metadata_.tensors[i].name] = i;
  }
  return reader;
}

const TensorEntry* CheckpointReader::Find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &metadata_.tensors[it->second];
}

absl::Status CheckpointReader::ReadRows(const std::string& name, int64_t row_begin, int64_t row_end,
                                        at::Tensor& out) const {
  const TensorEntry* t = Find(name);
  if (t == nullptr) return absl::NotFoundError(StrCat(dir_, ": no tensor ", name));
  FSDP_ASSIGN_OR_RETURN(c10::ScalarType dtype, DtypeFromName(t->dtype));
  int64_t rows = NumRows(t->shape);
  if (row_begin < 0 || row_begin > row_end || row_end > rows) {
    return absl::InvalidArgumentError(
        StrCat(name, ": rows [", row_begin, ", ", row_end, ") are not within [0, ", rows, ")"));
  }
  std::vector<int64_t> shape;
  if (t->shape.empty()) {
    if (row_begin != 0 || row_end != 1) {
      return absl::InvalidArgumentError(StrCat(name, ": a scalar is read as rows [0, 1)"));
    }
  } else {
    shape = t->shape;
    shape[0] = row_end - row_begin;
  }
  if (!out.defined()) {
    out = at::empty(shape, at::TensorOptions().dtype(dtype));
  } else if (!out.device().is_cpu() || out.scalar_type() != dtype || out.sizes() != shape ||
             !out.is_contiguous()) {
    std::vector<int64_t> got(out.sizes().begin(), out.sizes().end());
    return absl::InvalidArgumentError(
        StrCat(name, ": out is ", c10::toString(out.scalar_type()), " ", ShapeString(got), " on ",
               out.device().str(), (out.is_contiguous() ? "" : " (strided)"),
               ", expected a contiguous CPU ", t->dtype, " ", ShapeString(shape)));
  }
  const int64_t row_bytes = static_cast<int64_t>(*RowNumel(t->shape) * c10::elementSize(dtype));
  char* dst = static_cast<char*>(out.data_ptr());
  std::vector<char> buffer;
  for (const Chunk& c : t->chunks) {
    int64_t lo = std::max(row_begin, c.row_begin), hi = std::min(row_end, c.row_end);
    if (lo >= hi) continue;
    const std::string file = JoinPath(dir_, c.file);
    int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return ErrnoError(file, "open", errno);
    FdCloser closer(fd);
    buffer.resize(static_cast<size_t>(c.nbytes));
    FSDP_ASSIGN_OR_RETURN(size_t got, PreadAll(fd, buffer.data(), buffer.size(), c.offset, file));
    std::string where =
        StrCat("tensor ", name, " rows [", c.row_begin, ", ", c.row_end, ") at offset ", c.offset);
    if (got != buffer.size()) {
      return absl::DataLossError(
          StrCat(file, ": short read of ", where, ": ", got, " of ", c.nbytes, " bytes"));
    }
    uint32_t crc = Crc32(0, buffer.data(), buffer.size());
    if (crc != c.crc32) {
      return absl::DataLossError(StrCat(file, ": CRC mismatch in ", where, ": stored ",
                                        Hex(c.crc32), ", computed ", Hex(crc)));
    }
    std::memcpy(dst + (lo - row_begin) * row_bytes, buffer.data() + (lo - c.row_begin) * row_bytes,
                static_cast<size_t>((hi - lo) * row_bytes));
  }
  return absl::OkStatus();
}

absl::Status CheckpointReader::VerifyFiles() const {
  std::vector<char> buffer(1 << 20);
  for (const FileEntry& f : metadata_.files) {
    const std::string file = JoinPath(dir_, f.file);
    int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return ErrnoError(file, "open", errno);
    FdCloser closer(fd);
    uint32_t crc = 0;
    int64_t size = 0;
    while (true) {
      FSDP_ASSIGN_OR_RETURN(size_t got, PreadAll(fd, buffer.data(), buffer.size(), size, file));
      if (got == 0) break;
      crc = Crc32(crc, buffer.data(), got);
      size += static_cast<int64_t>(got);
    }
    if (size != f.size) {
      return absl::DataLossError(StrCat(file, ": ", size < f.size ? "truncated: " : "", size,
                                        " bytes, expected ", f.size));
    }
    if (crc != f.crc32) {
      return absl::DataLossError(
          StrCat(file, ": CRC mismatch: stored ", Hex(f.crc32), ", computed ", Hex(crc)));
    }
  }
  return absl::OkStatus();
}

}  // namespace fsdp::ckpt
