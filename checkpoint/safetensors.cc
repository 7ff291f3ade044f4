#include "checkpoint/safetensors.h"

#include "checkpoint/file_io.h"
#include "checkpoint/tensor_layout.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <functional>
#include <map>
#include <set>
#include <utility>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include "common/status.h"
#include "common/strings.h"

namespace fsdp::ckpt {
namespace {

static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian; big-endian hosts are not supported");

constexpr int64_t kMaxHeaderBytes = int64_t{100} << 20;
constexpr const char* kMetadataKey = "__metadata__";

// Product of `shape` from dimension `first` on; false on overflow.
bool CheckedNumel(const std::vector<int64_t>& shape, size_t first, int64_t& numel) {
  numel = 1;
  for (size_t i = first; i < shape.size(); ++i) {
    if (__builtin_mul_overflow(numel, shape[i], &numel)) return false;
  }
  return true;
}

bool WriteAll(int fd, const void* data, int64_t size) {
  return WriteFully(fd, data, static_cast<size_t>(size));
}

// Reads exactly `size` bytes at `offset`; false on an error or end of file (errno 0 then).
bool PReadAll(int fd, void* data, int64_t size, int64_t offset) {
  int64_t got = PreadUpTo(fd, data, static_cast<size_t>(size), offset);
  if (got == size) return true;
  if (got >= 0) errno = 0;
  return false;
}

std::string ErrnoString() { return errno == 0 ? "unexpected end of file" : std::strerror(errno); }

// A non-negative JSON integer that fits in int64.
bool GetNonNegative(const nlohmann::json& value, int64_t& out) {
  if (value.is_number_unsigned()) {
    uint64_t v = value.get<uint64_t>();
    if (v > static_cast<uint64_t>(INT64_MAX)) return false;
    out = static_cast<int64_t>(v);
    return true;
  }
  if (value.is_number_integer()) {
    out = value.get<int64_t>();
    return out >= 0;
  }
  return false;
}

// One tensor of a file being written: its name, dtype and shape, and how to get its values.
struct WriteItem {
  c10::ScalarType dtype;
  std::vector<int64_t> shape;
  int64_t nbytes = 0;
  std::function<absl::StatusOr<at::Tensor>()> values;  // called once, in name order
};

absl::Status WriteTensors(const std::string& header, const std::map<std::string, WriteItem>& items,
                          int fd, const std::string& tmp_path) {
  if (!WriteAll(fd, header.data(), static_cast<int64_t>(header.size()))) {
    return absl::FailedPreconditionError(
        StrCat("cannot write ", tmp_path, ": ", std::strerror(errno)));
  }
  for (const auto& [name, item] : items) {
    if (item.nbytes == 0) continue;
    FSDP_ASSIGN_OR_RETURN(at::Tensor tensor, item.values());
    tensor = tensor.to(at::kCPU).to(item.dtype).contiguous();
    if (static_cast<int64_t>(tensor.nbytes()) != item.nbytes) {
      return absl::InternalError(StrCat("tensor ", name, " has ", tensor.nbytes(),
                                        " bytes, expected ", item.nbytes, " (writing ", tmp_path,
                                        ")"));
    }
    if (!WriteAll(fd, tensor.data_ptr(), item.nbytes)) {
      return absl::FailedPreconditionError(
          StrCat("cannot write ", tmp_path, ": ", std::strerror(errno)));
    }
  }
  if (::fsync(fd) != 0) {
    return absl::FailedPreconditionError(
        StrCat("cannot fsync ", tmp_path, ": ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

// Writes `items` (safetensors orders the data by name) to a temp file renamed to `out_path`.
absl::Status WriteFile(const std::map<std::string, WriteItem>& items, const std::string& out_path) {
  nlohmann::json header_json = nlohmann::json::object();
  int64_t offset = 0;
  for (const auto& [name, item] : items) {
    header_json[name] = {{"dtype", DtypeName(item.dtype)},
                         {"shape", item.shape},
                         {"data_offsets", {offset, offset + item.nbytes}}};
    offset += item.nbytes;
  }
  header_json[kMetadataKey] = {{"format", "pt"}, {"source", "fsdp.cpp"}};
  std::string json_text = header_json.dump();
  json_text.append((8 - json_text.size() % 8) % 8, ' ');  // data starts 8-aligned
  std::string header(8, '\0');
  uint64_t length = json_text.size();
  std::memcpy(header.data(), &length, sizeof(length));  // little-endian host
  header += json_text;

  std::string tmp_path = out_path + ".tmp";
  int fd = ::open(tmp_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    return absl::FailedPreconditionError(
        StrCat("cannot create ", tmp_path, ": ", std::strerror(errno)));
  }
  FdCloser closer(fd);
  absl::Status status = WriteTensors(header, items, fd, tmp_path);
  if (status.ok() && !closer.Close()) {
    status = absl::FailedPreconditionError(
        StrCat("cannot close ", tmp_path, ": ", std::strerror(errno)));
  }
  if (status.ok() && ::rename(tmp_path.c_str(), out_path.c_str()) != 0) {
    status = absl::FailedPreconditionError(
        StrCat("cannot rename ", tmp_path, " to ", out_path, ": ", std::strerror(errno)));
  }
  if (!status.ok()) {
    closer.Close();
    ::unlink(tmp_path.c_str());
  }
  return status;
}

// Checks a tensor name and computes numel x element size; kInvalidArgument if it overflows.
absl::StatusOr<int64_t> ByteSize(const std::string& name, const std::vector<int64_t>& shape,
                                 c10::ScalarType dtype) {
  int64_t numel = 0;
  int64_t nbytes = 0;
  if (!CheckedNumel(shape, 0, numel) ||
      __builtin_mul_overflow(numel, static_cast<int64_t>(c10::elementSize(dtype)), &nbytes)) {
    return absl::InvalidArgumentError(
        StrCat("tensor '", name, "' of shape ", ShapeString(shape), " is too large"));
  }
  return nbytes;
}

}  // namespace

absl::Status ExportSafetensors(const CheckpointReader& checkpoint, const std::string& prefix,
                               const std::string& out_path, std::optional<c10::ScalarType> dtype) {
  // Select, rename and size every tensor; each is read only when its turn comes.
  std::map<std::string, WriteItem> items;
  for (const TensorEntry& entry : checkpoint.metadata().tensors) {
    if (!StartsWith(entry.name, prefix)) continue;
    std::string name = entry.name.substr(prefix.size());
    if (name.empty() || name == kMetadataKey) {
      return absl::InvalidArgumentError(StrCat("tensor '", entry.name, "' of ", checkpoint.dir(),
                                               " cannot be exported to ", out_path,
                                               " under the name '", name, "'"));
    }
    FSDP_ASSIGN_OR_RETURN(c10::ScalarType source, DtypeFromName(entry.dtype));
    c10::ScalarType target = dtype && c10::isFloatingType(source) ? *dtype : source;
    FSDP_ASSIGN_OR_RETURN(int64_t nbytes, ByteSize(entry.name, entry.shape, target));
    auto values = [&checkpoint, &entry]() -> absl::StatusOr<at::Tensor> {
      at::Tensor tensor;
      int64_t rows = entry.shape.empty() ? 1 : entry.shape[0];
      FSDP_RETURN_IF_ERROR(checkpoint.ReadRows(entry.name, 0, rows, tensor));
      return tensor;
    };
    items.emplace(std::move(name), WriteItem{target, entry.shape, nbytes, values});
  }
  if (items.empty()) {
    return absl::InvalidArgumentError(StrCat("no tensor of checkpoint ", checkpoint.dir(),
                                             " has a name starting with '", prefix, "' (exporting ",
                                             out_path, ")"));
  }
  return WriteFile(items, out_path);
}

absl::Status SaveSafetensors(const std::map<std::string, at::Tensor>& tensors,
                             const std::string& out_path) {
  std::map<std::string, WriteItem> items;
  for (const auto& [name, tensor] : tensors) {
    if (name.empty() || name == kMetadataKey) {
      return absl::InvalidArgumentError(
          StrCat("a tensor cannot be saved under the name '", name, "' (", out_path, ")"));
    }
    std::vector<int64_t> shape(tensor.sizes().begin(), tensor.sizes().end());
    FSDP_ASSIGN_OR_RETURN(int64_t nbytes, ByteSize(name, shape, tensor.scalar_type()));
    items.emplace(name, WriteItem{tensor.scalar_type(), shape, nbytes,
                                  [tensor = tensor]() -> absl::StatusOr<at::Tensor> { return tensor; }});
  }
  return WriteFile(items, out_path);
}

absl::Status WriteLazySafetensors(const std::map<std::string, LazyTensor>& tensors,
                                  const std::string& out_path) {
  std::map<std::string, WriteItem> items;
  for (const auto& [name, tensor] : tensors) {
    if (name.empty() || name == kMetadataKey) {
      return absl::InvalidArgumentError(
          StrCat("a tensor cannot be saved under the name '", name, "' (", out_path, ")"));
    }
    FSDP_ASSIGN_OR_RETURN(int64_t nbytes, ByteSize(name, tensor.shape, tensor.dtype));
    items.emplace(name, WriteItem{tensor.dtype, tensor.shape, nbytes, tensor.values});
  }
  return WriteFile(items, out_path);
}

// Note [Safetensors spec]: Open accepts exactly what the reference library (huggingface/
// safetensors) accepts, so that a file it would refuse cannot load here with shifted or made-up
// data: a regular file; a header that is a JSON object (trailing spaces allowed) with unique
// keys; an optional "__metadata__" mapping strings to strings; every other entry a tensor whose
// byte range matches dtype x shape; and the byte ranges, sorted, tile the data section exactly:
// the first starts at 0, each starts where the previous ended (no hole, no overlap) and the last
// ends at the end of the file (no trailing bytes). A header length a few bytes short leaves
// bytes after the last tensor, so it is caught instead of shifting every tensor.
absl::StatusOr<SafetensorsFile> SafetensorsFile::Open(const std::string& path) {
  // Non-blocking: opening a FIFO for reading would otherwise wait for a writer forever.
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    std::string message = StrCat("cannot open safetensors file ", path, ": ", std::strerror(errno));
    if (errno == ENOENT) return absl::NotFoundError(message);
    return absl::FailedPreconditionError(message);
  }
  FdCloser closer(fd);
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    return absl::FailedPreconditionError(
        StrCat("cannot stat safetensors file ", path, ": ", std::strerror(errno)));
  }
  if (!S_ISREG(st.st_mode)) {
    return absl::FailedPreconditionError(StrCat(
        path, ": not a regular file (", S_ISDIR(st.st_mode) ? "a directory" : S_ISFIFO(st.st_mode) ? "a FIFO" : "a device or socket",
        "); a safetensors file must be a regular file"));
  }
  const int64_t file_size = st.st_size;
  if (file_size < 8) {
    return absl::DataLossError(StrCat(path, ": truncated safetensors file: ", file_size,
                                      " bytes, less than the 8-byte header length"));
  }
  uint64_t length = 0;
  if (!PReadAll(fd, &length, 8, 0)) {
    return absl::DataLossError(StrCat(path, ": cannot read the header length: ", ErrnoString()));
  }
  if (length > static_cast<uint64_t>(kMaxHeaderBytes)) {
    return absl::DataLossError(StrCat(path, ": safetensors header length ", length,
                                      " exceeds the limit of ", kMaxHeaderBytes, " bytes"));
  }
  const int64_t header_size = static_cast<int64_t>(length);
  if (8 + header_size > file_size) {
    return absl::DataLossError(StrCat(path, ": safetensors header length ", header_size,
                                      " runs beyond the end of the file (", file_size, " bytes)"));
  }
  std::string text(static_cast<size_t>(header_size), '\0');
  if (!PReadAll(fd, text.data(), header_size, 8)) {
    return absl::DataLossError(StrCat(path, ": cannot read the header: ", ErrnoString()));
  }
  nlohmann::json header;
  std::set<std::string> top_keys;
  std::string duplicate;
  bool too_deep = false;
  try {
    // nlohmann keeps the last of duplicate keys; the reference library refuses them.
    header = nlohmann::json::parse(
        text, [&](int depth, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
          if (depth == 1 && event == nlohmann::json::parse_event_t::key && parsed.is_string() &&
              !top_keys.insert(parsed.get<std::string>()).second && duplicate.empty()) {
            duplicate = parsed.get<std::string>();
          }
          if ((event == nlohmann::json::parse_event_t::object_start ||
               event == nlohmann::json::parse_event_t::array_start) &&
              depth >= kMaxJsonDepth) {
            too_deep = true;  // dropped, then refused (see kMaxJsonDepth)
            return false;
          }
          return true;
        });
  } catch (const nlohmann::json::parse_error& e) {
    return absl::DataLossError(
        StrCat(path, ": safetensors header is not valid JSON (parse error at byte ", e.byte, ")"));
  } catch (const nlohmann::json::exception& e) {  // e.g. out_of_range: a number such as 1e400
    return absl::DataLossError(
        StrCat(path, ": safetensors header is not valid JSON (", e.what(), ")"));
  }
  if (too_deep) {
    return absl::DataLossError(StrCat(path, ": safetensors header is nested deeper than ",
                                      kMaxJsonDepth, " levels"));
  }
  if (!header.is_object()) {
    return absl::DataLossError(StrCat(path, ": safetensors header is not a JSON object"));
  }
  if (!duplicate.empty()) {
    return absl::DataLossError(
        StrCat(path, ": safetensors header names '", duplicate, "' more than once"));
  }
  if (auto meta = header.find(kMetadataKey); meta != header.end()) {
    bool strings = meta->is_object();
    for (auto it = strings ? meta->begin() : meta->end(); strings && it != meta->end(); ++it) {
      strings = it->is_string();
    }
    if (!strings) {
      return absl::DataLossError(StrCat(path, ": safetensors ", kMetadataKey,
                                        " must map strings to strings, got ", meta->dump()));
    }
  }

  SafetensorsFile file;
  file.path_ = path;
  file.data_start_ = 8 + header_size;
  const int64_t data_size = file_size - file.data_start_;
  auto bad = [&](const std::string& name, const std::string& what) {
    return absl::DataLossError(StrCat(path, ": safetensors tensor '", name, "': ", what));
  };
  for (const auto& [name, value] : header.items()) {
    if (name == kMetadataKey) continue;
    if (!value.is_object()) return bad(name, "entry is not an object");
    Entry entry;
    auto dtype_it = value.find("dtype");
    if (dtype_it == value.end() || !dtype_it->is_string()) {
      return bad(name, "dtype is missing or not a string");
    }
    entry.dtype = dtype_it->get<std::string>();
    absl::StatusOr<c10::ScalarType> scalar_type = DtypeFromName(entry.dtype);
    if (!scalar_type.ok()) return bad(name, StrCat("unsupported dtype '", entry.dtype, "'"));
    auto shape_it = value.find("shape");
    if (shape_it == value.end() || !shape_it->is_array()) {
      return bad(name, "shape is missing or not an array");
    }
    for (const nlohmann::json& dim : *shape_it) {
      int64_t d = 0;
      if (!GetNonNegative(dim, d)) return bad(name, "shape holds a non-integer or negative size");
      entry.shape.push_back(d);
    }
    auto offsets_it = value.find("data_offsets");
    if (offsets_it == value.end() || !offsets_it->is_array() || offsets_it->size() != 2 ||
        !GetNonNegative((*offsets_it)[0], entry.begin) ||
        !GetNonNegative((*offsets_it)[1], entry.end) || entry.begin > entry.end) {
      return bad(name, "data_offsets must be [begin, end] with 0 <= begin <= end");
    }
    if (entry.end > data_size) {
      return bad(name, StrCat("data_offsets [", entry.begin, ", ", entry.end,
                              ") run beyond the data section (", data_size, " bytes)"));
    }
    int64_t numel = 0;
    int64_t nbytes = 0;
    const bool overflow = !CheckedNumel(entry.shape, 0, numel) ||
                          __builtin_mul_overflow(
                              numel, static_cast<int64_t>(c10::elementSize(*scalar_type)), &nbytes);
    if (!ShapeFitsInTensor(entry.shape, static_cast<int64_t>(c10::elementSize(*scalar_type)))) {
      return bad(name, StrCat("shape ", ShapeString(entry.shape), " is too large for a tensor"));
    }
    if (overflow || nbytes != entry.end - entry.begin) {
      return bad(name, StrCat("data_offsets [", entry.begin, ", ", entry.end, ") hold ",
                              entry.end - entry.begin, " bytes but shape ",
                              ShapeString(entry.shape), " of ", entry.dtype, " needs ",
                              overflow ? std::string("more") : StrCat(nbytes)));
    }
    file.entries_.emplace(name, std::move(entry));
  }

  // The byte ranges tile the data section (Note [Safetensors spec]).
  std::vector<std::pair<const std::string*, const Entry*>> by_offset;
  for (const auto& [name, entry] : file.entries_) by_offset.emplace_back(&name, &entry);
  std::sort(by_offset.begin(), by_offset.end(), [](const auto& a, const auto& b) {
    return std::pair(a.second->begin, a.second->end) < std::pair(b.second->begin, b.second->end);
  });
  int64_t expected = 0;
  const std::string* previous = nullptr;
  for (const auto& [name, entry] : by_offset) {
    if (entry->begin < expected) {
      return bad(*name, StrCat("data_offsets [", entry->begin, ", ", entry->end,
                               ") overlap those of tensor '", *previous, "'"));
    }
    if (entry->begin > expected) {
      return bad(*name, StrCat("data_offsets [", entry->begin, ", ", entry->end,
                               ") leave a hole of ", entry->begin - expected, " bytes after ",
                               previous ? StrCat("tensor '", *previous, "'") : "the header"));
    }
    expected = entry->end;
    previous = name;
  }
  if (expected != data_size) {
    return absl::DataLossError(StrCat(
        path, ": safetensors data section has ", data_size - expected,
        " bytes after the last tensor (", data_size, " bytes, tensors end at ", expected,
        "); a header length that is too short or bytes appended to the file"));
  }
  return file;
}

absl::Status SafetensorsFile::ReadRows(const std::string& name, int64_t row_begin, int64_t row_end,
                                       at::Tensor& out) const {
  auto it = entries_.find(name);
  if (it == entries_.end()) {
    return absl::NotFoundError(StrCat(path_, ": no tensor named '", name, "'"));
  }
  const Entry& entry = it->second;
  const bool scalar = entry.shape.empty();
  const int64_t rows = scalar ? 1 : entry.shape[0];
  if (row_begin < 0 || row_begin > row_end || row_end > rows) {
    return absl::InvalidArgumentError(StrCat(path_, ": rows [", row_begin, ", ", row_end,
                                             ") are out of range for tensor '", name, "' with ",
                                             rows, " rows"));
  }
  FSDP_ASSIGN_OR_RETURN(c10::ScalarType dtype, DtypeFromName(entry.dtype));
  std::vector<int64_t> shape = entry.shape;
  if (scalar) {
    if (row_end == row_begin) shape = {0};
  } else {
    shape[0] = row_end - row_begin;
  }
  out = at::empty(shape, at::TensorOptions().dtype(dtype).device(at::kCPU));
  int64_t row_numel = 0;
  CheckedNumel(entry.shape, 1, row_numel);  // validated by Open
  const int64_t row_bytes = row_numel * static_cast<int64_t>(c10::elementSize(dtype));
  const int64_t nbytes = (row_end - row_begin) * row_bytes;
  if (nbytes == 0) return absl::OkStatus();

  int fd = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    return absl::FailedPreconditionError(
        StrCat("cannot open safetensors file ", path_, ": ", std::strerror(errno)));
  }
  FdCloser closer(fd);
  if (!PReadAll(fd, out.data_ptr(), nbytes, data_start_ + entry.begin + row_begin * row_bytes)) {
    return absl::DataLossError(StrCat(path_, ": cannot read rows [", row_begin, ", ", row_end,
                                      ") of tensor '", name, "': ", ErrnoString()));
  }
  return absl::OkStatus();
}

}  // namespace fsdp::ckpt
