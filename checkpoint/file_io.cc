#include "checkpoint/file_io.h"

#include <fcntl.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <system_error>

#include "common/strings.h"

namespace fsdp::ckpt {

namespace {
namespace fs = std::filesystem;
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

}  // namespace fsdp::ckpt
