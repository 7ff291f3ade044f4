#include "engine/run_lock.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <fmt/format.h>

#include "common/env.h"
#include "common/logging.h"
#include "common/strings.h"

namespace fsdp {
namespace {

// "pid 1234 on host h since 2026-11-23 14:00:00 UTC", as the file's one line.
std::string OwnerLine() {
  std::time_t now = std::time(nullptr);
  char when[64];
  std::strftime(when, sizeof(when), "%Y-%m-%d %H:%M:%S UTC", std::gmtime(&now));
  return fmt::format("pid {} on host {} since {}", getpid(), HostName(), when);
}

// Creates `path` exclusively with the owner line; false with errno EEXIST if it exists.
bool CreateExclusive(const std::string& path) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return false;
  std::string line = OwnerLine() + "\n";
  bool ok = ::write(fd, line.data(), line.size()) == static_cast<ssize_t>(line.size());
  ::close(fd);
  if (!ok) {
    ::unlink(path.c_str());
    errno = EIO;
  }
  return ok;
}

}  // namespace

absl::StatusOr<std::unique_ptr<RunDirLock>> RunDirLock::Acquire(const std::string& run_dir) {
  const std::string path = (std::filesystem::path(run_dir) / kFileName).string();
  for (int attempt = 0; attempt < 2; ++attempt) {
    if (CreateExclusive(path)) return std::unique_ptr<RunDirLock>(new RunDirLock(path));
    if (errno != EEXIST) {
      return absl::FailedPreconditionError(
          StrCat("run.dir '", run_dir, "': cannot create the lock file ", path, ": ",
                 std::strerror(errno)));
    }
    std::string owner;
    std::getline(std::ifstream(path), owner);
    long pid = 0;
    char host[256] = {};
    const bool parsed = std::sscanf(owner.c_str(), "pid %ld on host %255s", &pid, host) == 2;
    const bool same_host = parsed && HostName() == host;
    if (same_host && pid > 0 && ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) {
      FSDP_LOG_WARN("run.dir '{}': taking over the lock of a run that is gone ({})", run_dir, owner);
      std::filesystem::remove(path);
      continue;
    }
    return absl::FailedPreconditionError(StrCat(
        "run.dir '", run_dir, "' is in use by another fsdp train (", owner.empty() ? "unknown owner" : owner,
        "; lock file ", path, "): use another run.dir, or remove the lock file if that run is over"));
  }
  return absl::FailedPreconditionError(StrCat("run.dir '", run_dir, "': cannot take the lock ", path));
}

RunDirLock::~RunDirLock() { ::unlink(path_.c_str()); }

}  // namespace fsdp
