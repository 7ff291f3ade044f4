// ShardWriter: one rank's file of a checkpoint (format.h).
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <future>
#include <thread>
#include <utility>

#include <ATen/ATen.h>
#include <fmt/format.h>

#include "checkpoint/crc32.h"
#include "checkpoint/file_io.h"
#include "checkpoint/format.h"
#include "checkpoint/tensor_layout.h"
#include "common/status.h"
#include "common/strings.h"

namespace fsdp::ckpt {
namespace {

static_assert(std::endian::native == std::endian::little,
              "the checkpoint format stores little-endian bytes; big-endian hosts need a swap");

constexpr int64_t kAlignment = 64;
// After ShardWriter::Finish: no more Add, no second Finish.
constexpr int kFinishedFd = -2;

// Chunks from this size on have their CRC computed beside the write (ShardWriter::Add).
constexpr int64_t kCrcAsideBytes = int64_t{4} << 20;

// Threads for a chunk's CRC: a quarter of the machine's, at most 4, so that an asynchronous
// save beside training takes little of the cores (one on a machine of up to 7).
int CrcThreads() {
  static const int threads =
      std::clamp(static_cast<int>(std::thread::hardware_concurrency()) / 4, 1, 4);
  return threads;
}

}  // namespace

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
  // A large chunk's checksum on other threads while this one writes the same bytes (the write
  // mostly copies them into the page cache): ~2 GB/s per thread for the CRC, so on one thread
  // it took longer than the write. A small one here: a thread costs more than its CRC.
  if (chunk.nbytes < kCrcAsideBytes) {
    chunk.crc32 = Crc32(0, cpu.const_data_ptr(), cpu.nbytes());
    FSDP_RETURN_IF_ERROR(WriteAll(fd_, cpu.const_data_ptr(), cpu.nbytes(), path));
  } else {
    std::future<uint32_t> crc = std::async(std::launch::async, [&cpu] {
      return Crc32Parallel(cpu.const_data_ptr(), cpu.nbytes(), CrcThreads());
    });
    const absl::Status written = WriteAll(fd_, cpu.const_data_ptr(), cpu.nbytes(), path);
    chunk.crc32 = crc.get();
    FSDP_RETURN_IF_ERROR(written);
  }
  // The file's CRC from the chunk's: one pass over the bytes, not two.
  file_crc_ = Crc32Combine(file_crc_, chunk.crc32, static_cast<uint64_t>(chunk.nbytes));
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

}  // namespace fsdp::ckpt
