// POSIX file helpers shared by the checkpoint and safetensors code: a scoped descriptor,
// write / pread loops that retry on EINTR and short transfers (errors through errno), and
// Status-returning wrappers whose errors name the path and the operation.
//
//   FSDP_ASSIGN_OR_RETURN(int fd, CreateFile(dir, JoinPath(dir, "x.tmp")));
//   FdCloser closer(fd);
//   FSDP_RETURN_IF_ERROR(WriteAll(fd, text.data(), text.size(), path));
//   FSDP_RETURN_IF_ERROR(Rename(JoinPath(dir, "x.tmp"), JoinPath(dir, "x")));
//   FSDP_RETURN_IF_ERROR(FsyncPath(dir));
#pragma once

#include <sys/types.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace fsdp::ckpt {

// Closes a file descriptor at scope exit (or earlier with Close()).
class FdCloser {
 public:
  explicit FdCloser(int fd) : fd_(fd) {}
  ~FdCloser() {
    if (fd_ >= 0) ::close(fd_);
  }
  FdCloser(const FdCloser&) = delete;
  FdCloser& operator=(const FdCloser&) = delete;
  // Closes now; false (errno set) when close fails.
  bool Close() {
    int fd = std::exchange(fd_, -1);
    return fd < 0 || ::close(fd) == 0;
  }

 private:
  int fd_;
};

// Writes all `n` bytes; false with errno set on an error.
bool WriteFully(int fd, const void* data, size_t n);
// Reads up to `n` bytes at `offset`, fewer only at end of file; -1 with errno set on an error.
int64_t PreadUpTo(int fd, void* data, size_t n, int64_t offset);

// ---- Status-returning wrappers: every error is "PATH: OP: strerror" ----

// The Status for errno value `err` (code from absl::ErrnoToStatusCode).
absl::Status ErrnoError(const std::string& path, const char* op, int err);
// `dir` + "/" + `name` (no doubled separator; `name` alone when `dir` is empty).
std::string JoinPath(const std::string& dir, const std::string& name);
// The folder holding `path` ("." for a bare name).
std::string ParentDir(const std::string& path);
// WriteFully, naming `path` on an error.
absl::Status WriteAll(int fd, const void* data, size_t n, const std::string& path);
// PreadUpTo: how many bytes were read (fewer only at end of file), naming `path` on an error.
absl::StatusOr<size_t> PreadAll(int fd, void* data, size_t n, int64_t offset,
                                const std::string& path);
// Opens `path` (a file or a folder) and fsyncs it.
absl::Status FsyncPath(const std::string& path);
absl::Status Rename(const std::string& from, const std::string& to);
// Removes `path` and everything below it; a missing path is fine.
absl::Status RemoveAll(const std::string& path);
// Creates `dir` if missing and opens `path` (in it) for writing, truncated.
absl::StatusOr<int> CreateFile(const std::string& dir, const std::string& path);
// True when `path` is a regular file.
bool IsFile(const std::string& path);

}  // namespace fsdp::ckpt
