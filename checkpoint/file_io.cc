#include "checkpoint/file_io.h"

#include <algorithm>
#include <cerrno>

namespace fsdp::ckpt {

namespace {
constexpr size_t kMaxTransfer = size_t{1} << 30;  // per system call
}  // namespace

bool WriteFully(int fd, const void* data, size_t n) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    ssize_t w = ::write(fd, p, std::min(n, kMaxTransfer));
    if (w < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

int64_t PreadUpTo(int fd, void* data, size_t n, int64_t offset) {
  char* p = static_cast<char*>(data);
  size_t done = 0;
  while (done < n) {
    ssize_t r = ::pread(fd, p + done, std::min(n - done, kMaxTransfer),
                        static_cast<off_t>(offset + static_cast<int64_t>(done)));
    if (r < 0) {
      if (errno == EINTR) continue;
      return -1;
    }
    if (r == 0) break;
    done += static_cast<size_t>(r);
  }
  return static_cast<int64_t>(done);
}

}  // namespace fsdp::ckpt
