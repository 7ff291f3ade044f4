// CheckpointReader: opening a checkpoint and reading any rows of its tensors (format.h).
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include <ATen/ATen.h>

#include "checkpoint/crc32.h"
#include "checkpoint/file_io.h"
#include "checkpoint/format.h"
#include "checkpoint/tensor_layout.h"
#include "common/status.h"
#include "common/strings.h"

namespace fsdp::ckpt {

absl::StatusOr<CheckpointReader> CheckpointReader::Open(const std::string& dir) {
  const std::string path = JoinPath(dir, kMetadataFile);
  // O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer (forever); a
  // regular file reads the same with it.
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
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
  if (!S_ISREG(st.st_mode)) {
    return absl::DataLossError(StrCat(path, ": not a regular file (",
                                      S_ISDIR(st.st_mode)    ? "a directory"
                                      : S_ISFIFO(st.st_mode) ? "a FIFO"
                                                             : "a device or socket",
                                      "); ", kMetadataFile, " must be a file"));
  }
  if (st.st_size > kMaxMetadataBytes) {
    return absl::DataLossError(
        StrCat(path, ": ", st.st_size, " bytes, more than the limit of ", kMaxMetadataBytes));
  }
  std::string text(static_cast<size_t>(st.st_size), '\0');
  FSDP_ASSIGN_OR_RETURN(size_t got, PreadAll(fd, text.data(), text.size(), 0, path));
  text.resize(got);
  FSDP_ASSIGN_OR_RETURN(nlohmann::json json, ParseJson(text, path));
  CheckpointReader reader;
  reader.dir_ = dir;
  FSDP_ASSIGN_OR_RETURN(reader.metadata_, MetadataFromJson(json, path));
  // A committed folder's name and its metadata must agree on the step (the name is what
  // load=latest and pruning go by; the metadata is what a resume continues from).
  std::string_view name = dir;
  while (name.size() > 1 && name.back() == '/') name.remove_suffix(1);
  name = name.substr(name.rfind('/') == std::string_view::npos ? 0 : name.rfind('/') + 1);
  if (StartsWith(name, "step_") && name.size() > 5 &&
      std::all_of(name.begin() + 5, name.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    std::optional<int64_t> named = ParseInt<int64_t>(name.substr(5));
    if (named && *named != reader.metadata_.step) {
      return absl::DataLossError(StrCat(path, ": step ", reader.metadata_.step,
                                        ", but the folder is ", name, " (step ", *named, ")"));
    }
  }
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
                                        CrcHex(c.crc32), ", computed ", CrcHex(crc)));
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
          StrCat(file, ": CRC mismatch: stored ", CrcHex(f.crc32), ", computed ", CrcHex(crc)));
    }
  }
  return absl::OkStatus();
}

}  // namespace fsdp::ckpt
