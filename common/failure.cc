#include "common/failure.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <mutex>

#include <fmt/format.h>

#include "common/env_knobs.h"
#include "common/strings.h"

namespace fsdp {
namespace {

constexpr char kPayloadUrl[] = "fsdp.cpp/failure_class";

std::atomic<int> g_rank{-1};
std::mutex g_report_mu;
bool g_reported = false;
std::string g_first_line;

void WriteAll(int fd, std::string_view text) {
  while (!text.empty()) {
    ssize_t n = write(fd, text.data(), text.size());
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    text.remove_prefix(static_cast<size_t>(n));
  }
}

}  // namespace

int ExitCodeFor(FailureClass c) {
  switch (c) {
    case FailureClass::kError:
      return 1;
    case FailureClass::kConfig:
      return 2;
    case FailureClass::kCheckpoint:
      return 3;
    case FailureClass::kIo:
      return 4;
    case FailureClass::kNonFinite:
      return 5;
    case FailureClass::kCollectiveTimeout:
      return 6;
    case FailureClass::kPeerLost:
      return 7;
    case FailureClass::kInternal:
      return 70;
    case FailureClass::kPreempted:
      return 128 + 15;  // SIGTERM
    case FailureClass::kOutOfMemory:
      return 8;
  }
  return 1;
}

std::string_view FailureClassName(FailureClass c) {
  switch (c) {
    case FailureClass::kError:
      return "error";
    case FailureClass::kConfig:
      return "config";
    case FailureClass::kCheckpoint:
      return "checkpoint";
    case FailureClass::kIo:
      return "io";
    case FailureClass::kNonFinite:
      return "non-finite";
    case FailureClass::kCollectiveTimeout:
      return "timeout";
    case FailureClass::kPeerLost:
      return "peer lost";
    case FailureClass::kInternal:
      return "internal";
    case FailureClass::kPreempted:
      return "preempted";
    case FailureClass::kOutOfMemory:
      return "out of memory";
  }
  return "error";
}

FailureClass FailureClassOfExitCode(int code) {
  for (FailureClass c : {FailureClass::kConfig, FailureClass::kCheckpoint, FailureClass::kIo,
                         FailureClass::kNonFinite, FailureClass::kCollectiveTimeout,
                         FailureClass::kPeerLost, FailureClass::kInternal,
                         FailureClass::kPreempted, FailureClass::kOutOfMemory}) {
    if (ExitCodeFor(c) == code) return c;
  }
  return FailureClass::kError;
}

absl::Status WithFailureClass(absl::Status status, FailureClass c) {
  if (status.ok()) return status;
  status.SetPayload(kPayloadUrl, absl::Cord(std::to_string(static_cast<int>(c))));
  return status;
}

FailureClass ClassifyFailure(const absl::Status& status) {
  if (auto payload = status.GetPayload(kPayloadUrl)) {
    if (std::optional<int> value = ParseInt(std::string(*payload))) {
      return static_cast<FailureClass>(*value);
    }
  }
  switch (status.code()) {
    case absl::StatusCode::kInvalidArgument:
      return FailureClass::kConfig;
    case absl::StatusCode::kDataLoss:
      return FailureClass::kCheckpoint;
    case absl::StatusCode::kDeadlineExceeded:
      return FailureClass::kCollectiveTimeout;
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kAborted:
      return FailureClass::kPeerLost;
    case absl::StatusCode::kPermissionDenied:
    case absl::StatusCode::kResourceExhausted:
      return FailureClass::kIo;
    case absl::StatusCode::kInternal:
    case absl::StatusCode::kUnknown:
      return FailureClass::kInternal;
    default:
      return FailureClass::kError;
  }
}

void SetFailureRank(int rank) { g_rank = rank; }
int FailureRank() { return g_rank; }

std::string ReportFailure(int rank, FailureClass c, std::string_view what) {
  std::lock_guard<std::mutex> lock(g_report_mu);
  if (g_reported) return g_first_line;
  g_reported = true;
  std::string text(what);
  for (size_t pos; (pos = text.find('\n')) != std::string::npos;) text.replace(pos, 1, "; ");
  std::string line = rank >= 0 ? fmt::format("rank {}: {}", rank, text) : StrCat("fsdp: ", text);
  g_first_line = line;
  WriteAll(STDERR_FILENO, line + "\n");
  if (std::optional<std::string> dir = GetEnvKnob(kFailureDir); dir && !dir->empty() && rank >= 0) {
    const int64_t now = std::chrono::duration_cast<std::chrono::nanoseconds>(
                            std::chrono::system_clock::now().time_since_epoch())
                            .count();
    const std::string path = fmt::format("{}/rank{}.failure", *dir, rank);
    const std::string tmp = path + ".tmp";
    int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd >= 0) {
      WriteAll(fd, fmt::format("{} {}\n{}\n", now, ExitCodeFor(c), line));
      close(fd);
      (void)rename(tmp.c_str(), path.c_str());
    }
  }
  return line;
}

void FailAndExit(int rank, FailureClass c, std::string_view what) {
  ReportFailure(rank, c, what);
  std::fflush(stdout);
  std::_Exit(ExitCodeFor(c));
}

std::vector<FailureRecord> ReadFailureRecords(const std::string& dir) {
  std::vector<FailureRecord> records;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (!StartsWith(name, "rank") || name.size() < 13 ||
        name.substr(name.size() - 8) != ".failure") {
      continue;
    }
    std::optional<int> rank = ParseInt(name.substr(4, name.size() - 12));
    std::ifstream in(entry.path());
    FailureRecord r;
    if (!rank || !(in >> r.time_ns >> r.exit_code)) continue;
    in.ignore(1);
    if (!std::getline(in, r.line)) continue;
    r.rank = *rank;
    records.push_back(std::move(r));
  }
  std::sort(records.begin(), records.end(), [](const FailureRecord& a, const FailureRecord& b) {
    return a.time_ns != b.time_ns ? a.time_ns < b.time_ns : a.rank < b.rank;
  });
  return records;
}

}  // namespace fsdp
