// POSIX file helpers shared by the checkpoint and safetensors code: a scoped descriptor and
// write / pread loops that retry on EINTR and short transfers. Errors are reported through
// errno; callers turn them into a Status naming their file.
#pragma once

#include <sys/types.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <utility>

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

}  // namespace fsdp::ckpt
