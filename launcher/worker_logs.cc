#include "launcher/worker_logs.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <optional>

#include "common/strings.h"

namespace fsdp {
namespace {

constexpr char kValidStreams[] =
    "0 (none), 1 (stdout), 2 (stderr), 3 (both), or per local rank LOCAL_RANK:VALUE,... "
    "(e.g. 0:3,1:2)";

}  // namespace

absl::StatusOr<std::vector<int>> ParseStdStreams(std::string_view option, std::string_view text,
                                                 int nproc_per_node) {
  auto invalid = [&](std::string_view what) {
    return absl::InvalidArgumentError(
        StrCat(option, ": '", text, "' ", what, "; valid: ", kValidStreams));
  };
  auto value = [](std::string_view v) -> std::optional<int> {
    std::optional<int> x = ParseInt(v);
    if (!x || *x < 0 || *x > 3) return std::nullopt;
    return x;
  };
  if (text.find(':') == std::string_view::npos) {
    std::optional<int> all = value(text);
    if (!all) return invalid("is not a stream value");
    return std::vector<int>(nproc_per_node, *all);
  }
  std::vector<int> per_rank(nproc_per_node, 0);
  for (std::string_view item : Split(text, ",")) {
    std::vector<std::string_view> kv = Split(item, ":");
    if (kv.size() != 2) return invalid(StrCat("has '", item, "', not LOCAL_RANK:VALUE"));
    std::optional<int> rank = ParseInt(kv[0]);
    if (!rank || *rank < 0 || *rank >= nproc_per_node) {
      return invalid(StrCat("names local rank '", kv[0], "', not one of 0..", nproc_per_node - 1,
                            " (--nproc-per-node ", nproc_per_node, ")"));
    }
    std::optional<int> v = value(kv[1]);
    if (!v) return invalid(StrCat("gives local rank ", *rank, " '", kv[1], "'"));
    per_rank[*rank] = *v;
  }
  return per_rank;
}

absl::StatusOr<ConsoleStreams> ParseConsoleStreams(std::string_view redirects, std::string_view tee,
                                                   int nproc_per_node) {
  ConsoleStreams console(nproc_per_node, kStdOut | kStdErr);
  if (!redirects.empty()) {
    absl::StatusOr<std::vector<int>> r = ParseStdStreams("--redirects", redirects, nproc_per_node);
    if (!r.ok()) return r.status();
    for (int i = 0; i < nproc_per_node; ++i) console[i] &= ~(*r)[i];
  }
  if (!tee.empty()) {
    absl::StatusOr<std::vector<int>> t = ParseStdStreams("--tee", tee, nproc_per_node);
    if (!t.ok()) return t.status();
    for (int i = 0; i < nproc_per_node; ++i) console[i] |= (*t)[i];
  }
  return console;
}

WorkerLogs::WorkerLogs(std::string run_dir, ConsoleStreams console)
    : run_dir_(std::move(run_dir)), console_(std::move(console)) {}

WorkerLogs::~WorkerLogs() { CloseFiles(); }

absl::StatusOr<std::unique_ptr<WorkerLogs>> WorkerLogs::Create(const std::string& dir,
                                                               const std::string& run_id,
                                                               int node_rank, int nnodes,
                                                               ConsoleStreams console) {
  if (run_id.empty() || run_id == "." || run_id == ".." || run_id.find('/') != std::string::npos) {
    return absl::InvalidArgumentError(
        StrCat("--run-id '", run_id, "' names the logs' folder under --log-dir ", dir,
               ": it must be a folder name (no '/', not '.' or '..')"));
  }
  std::filesystem::path run_dir = std::filesystem::path(dir) / run_id;
  if (nnodes > 1) run_dir /= StrCat("node_", node_rank);
  std::error_code ec;
  std::filesystem::create_directories(run_dir, ec);
  if (ec) {
    return absl::InvalidArgumentError(
        StrCat("--log-dir ", dir, ": cannot create ", run_dir.string(), ": ", ec.message()));
  }
  if (access(run_dir.c_str(), W_OK | X_OK) != 0) {
    return absl::InvalidArgumentError(
        StrCat("--log-dir ", dir, ": cannot write to ", run_dir.string(), ": ", strerror(errno)));
  }
  return std::unique_ptr<WorkerLogs>(new WorkerLogs(run_dir.string(), std::move(console)));
}

void WorkerLogs::CloseFiles() {
  for (File& f : files_) {
    if (f.fd >= 0) close(f.fd);
  }
  files_.clear();
}

absl::Status WorkerLogs::StartAttempt(int attempt) {
  CloseFiles();
  attempt_dir_ = StrCat(run_dir_, "/attempt_", attempt);
  std::error_code ec;
  std::filesystem::remove_all(attempt_dir_, ec);  // an earlier run's, with the same --run-id
  for (size_t local_rank = 0; local_rank < console_.size(); ++local_rank) {
    std::filesystem::create_directories(StrCat(attempt_dir_, "/", local_rank), ec);
    if (ec) {
      return absl::InternalError(
          StrCat("cannot create ", attempt_dir_, "/", local_rank, ": ", ec.message()));
    }
    for (bool is_stderr : {false, true}) {
      const std::string path = Path(static_cast<int>(local_rank), is_stderr);
      const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_APPEND | O_CLOEXEC, 0644);
      if (fd < 0) return absl::InternalError(StrCat("cannot create ", path, ": ", strerror(errno)));
      files_.push_back({fd, false});
    }
  }
  return absl::OkStatus();
}

void WorkerLogs::Write(int local_rank, bool is_stderr, std::string_view line) {
  File& f = files_[2 * local_rank + (is_stderr ? 1 : 0)];
  if (f.failed) return;
  std::string buf;
  buf.reserve(line.size() + 1);
  buf.append(line).push_back('\n');
  for (size_t done = 0; done < buf.size();) {
    const ssize_t n = write(f.fd, buf.data() + done, buf.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      f.failed = true;
      std::cerr << "fsdp launch: cannot write " << Path(local_rank, is_stderr) << ": "
                << strerror(errno) << "; local rank " << local_rank
                << "'s further lines there are lost\n";
      return;
    }
    done += static_cast<size_t>(n);
  }
}

bool WorkerLogs::OnConsole(int local_rank, bool is_stderr) const {
  return (console_[local_rank] & (is_stderr ? kStdErr : kStdOut)) != 0;
}

std::string WorkerLogs::Path(int local_rank, bool is_stderr) const {
  return StrCat(attempt_dir_, "/", local_rank, is_stderr ? "/stderr.log" : "/stdout.log");
}

}  // namespace fsdp
