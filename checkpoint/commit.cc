// Writing metadata.json, committing a checkpoint folder, finding and pruning committed ones
// (format.h).
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <map>
#include <optional>
#include <system_error>
#include <utility>

#include <fmt/format.h>

#include "checkpoint/file_io.h"
#include "checkpoint/format.h"
#include "common/status.h"
#include "common/strings.h"

namespace fsdp::ckpt {

namespace fs = std::filesystem;

absl::Status WriteMetadata(const std::string& dir, const Metadata& metadata) {
  const std::string path = JoinPath(dir, kMetadataFile);
  const nlohmann::json json = ToJson(metadata);
  absl::StatusOr<Metadata> valid = MetadataFromJson(json, path);
  if (!valid.ok()) {
    return absl::InternalError(
        StrCat("refusing to write invalid metadata: ", std::string(valid.status().message())));
  }
  std::string text;
  try {
    text = json.dump(1) + "\n";
  } catch (const nlohmann::json::exception& e) {
    return absl::InvalidArgumentError(StrCat(path, ": ", e.what()));
  }
  if (static_cast<int64_t>(text.size()) > kMaxMetadataBytes) {
    return absl::ResourceExhaustedError(
        StrCat(path, ": ", text.size(), " bytes, more than the limit of ", kMaxMetadataBytes));
  }
  const std::string tmp = path + ".tmp";
  FSDP_ASSIGN_OR_RETURN(int fd, CreateFile(dir, tmp));
  {
    FdCloser closer(fd);
    FSDP_RETURN_IF_ERROR(WriteAll(fd, text.data(), text.size(), tmp));
    if (::fsync(fd) != 0) return ErrnoError(tmp, "fsync", errno);
  }
  FSDP_RETURN_IF_ERROR(Rename(tmp, path));
  return FsyncPath(dir);
}

absl::Status CommitCheckpoint(const std::string& tmp_dir, const std::string& final_dir) {
  if (!IsFile(JoinPath(tmp_dir, kMetadataFile))) {
    return absl::FailedPreconditionError(
        StrCat(tmp_dir, ": no ", kMetadataFile, ": refusing to commit an incomplete checkpoint"));
  }
  FSDP_RETURN_IF_ERROR(FsyncPath(tmp_dir));
  const std::string parent = ParentDir(final_dir);
  const std::string old = final_dir + ".old";
  bool replacing = fs::exists(final_dir);
  if (replacing) {
    if (fs::exists(old)) FSDP_RETURN_IF_ERROR(RemoveAll(old));
    FSDP_RETURN_IF_ERROR(Rename(final_dir, old));
  }
  FSDP_RETURN_IF_ERROR(Rename(tmp_dir, final_dir));
  FSDP_RETURN_IF_ERROR(FsyncPath(parent));
  if (ParentDir(tmp_dir) != parent) FSDP_RETURN_IF_ERROR(FsyncPath(ParentDir(tmp_dir)));
  if (replacing) {
    FSDP_RETURN_IF_ERROR(RemoveAll(old));
    FSDP_RETURN_IF_ERROR(FsyncPath(parent));
  }
  return absl::OkStatus();
}

std::string StepDirName(int64_t step) { return fmt::format("step_{:09d}", step); }

namespace {

enum class DirKind { kCommitted, kTmp, kOld };
struct StepDir {
  int64_t step;
  DirKind kind;
  std::string path;
};

// "step_<digits>" with an optional ".tmp" / ".old" suffix.
std::optional<StepDir> ParseStepDir(const std::string& root, const std::string& name) {
  std::string_view s = name;
  if (!StartsWith(s, "step_")) return std::nullopt;
  s.remove_prefix(5);
  DirKind kind = DirKind::kCommitted;
  for (auto [suffix, k] : {std::pair{".tmp", DirKind::kTmp}, std::pair{".old", DirKind::kOld}}) {
    std::string_view sv = suffix;
    if (s.size() > sv.size() && s.substr(s.size() - sv.size()) == sv) {
      s.remove_suffix(sv.size());
      kind = k;
      break;
    }
  }
  if (s.empty() || !std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    return std::nullopt;
  }
  std::optional<int64_t> step = ParseInt<int64_t>(s);
  if (!step) return std::nullopt;
  return StepDir{*step, kind, JoinPath(root, name)};
}

absl::StatusOr<std::vector<StepDir>> ListStepDirs(const std::string& root) {
  std::vector<StepDir> dirs;
  std::error_code ec;
  fs::directory_iterator it(root, ec);
  if (ec) return ErrnoError(root, "list", ec.value());
  for (; it != fs::directory_iterator(); it.increment(ec)) {
    if (!it->is_directory(ec)) continue;
    std::optional<StepDir> d = ParseStepDir(root, it->path().filename().string());
    if (!d) continue;
    if (d->kind == DirKind::kCommitted && !IsFile(JoinPath(d->path, kMetadataFile))) continue;
    dirs.push_back(std::move(*d));
  }
  if (ec) return ErrnoError(root, "list", ec.value());
  std::sort(dirs.begin(), dirs.end(),
            [](const StepDir& a, const StepDir& b) { return a.step > b.step; });
  return dirs;
}

}  // namespace

absl::StatusOr<std::string> LatestCheckpoint(const std::string& root) {
  std::error_code ec;
  if (!fs::is_directory(root, ec))
    return absl::NotFoundError(StrCat(root, ": no checkpoint (no such folder)"));
  FSDP_ASSIGN_OR_RETURN(std::vector<StepDir> dirs, ListStepDirs(root));
  for (const StepDir& d : dirs) {
    if (d.kind == DirKind::kCommitted) return d.path;
  }
  return absl::NotFoundError(
      StrCat(root, ": no checkpoint (no step_<N> folder with a ", kMetadataFile, ")"));
}

absl::Status PruneCheckpoints(const std::string& root, int keep,
                              std::optional<int64_t> committed_step) {
  if (keep < 1) {
    return absl::InvalidArgumentError(StrCat("keep must be at least 1, got ", keep));
  }
  FSDP_ASSIGN_OR_RETURN(std::vector<StepDir> dirs, ListStepDirs(root));
  std::optional<int64_t> newest;
  std::map<int64_t, bool> committed;
  int kept = 0;
  for (const StepDir& d : dirs) {  // Newest first.
    if (d.kind != DirKind::kCommitted) continue;
    if (!newest) newest = d.step;
    committed[d.step] = true;
    if (++kept > keep && d.step != committed_step) FSDP_RETURN_IF_ERROR(RemoveAll(d.path));
  }
  if (!newest) return absl::OkStatus();
  for (const StepDir& d : dirs) {
    // A .tmp at or below the newest committed step is a save that died; a .old next to its
    // committed step is what an interrupted re-save left behind.
    bool stale_tmp = d.kind == DirKind::kTmp && d.step <= *newest;
    bool stale_old = d.kind == DirKind::kOld && committed.count(d.step) > 0;
    if (stale_tmp || stale_old) FSDP_RETURN_IF_ERROR(RemoveAll(d.path));
  }
  return absl::OkStatus();
}

// See Note [A run that goes back] (format.h).
absl::StatusOr<std::vector<std::string>> SetAsideCheckpointsAfter(const std::string& root,
                                                                  int64_t step) {
  std::vector<std::string> moved;
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return moved;
  FSDP_ASSIGN_OR_RETURN(std::vector<StepDir> dirs, ListStepDirs(root));
  const std::string aside = JoinPath(root, kSupersededDir);
  for (auto it = dirs.rbegin(); it != dirs.rend(); ++it) {  // oldest first
    const StepDir& d = *it;
    if (d.kind != DirKind::kCommitted || d.step <= step) continue;
    fs::create_directories(aside, ec);
    if (ec) return ErrnoError(aside, "create", ec.value());
    const std::string name = fs::path(d.path).filename().string();
    std::string dst = JoinPath(aside, name);
    for (int n = 2; fs::exists(dst, ec); ++n) dst = JoinPath(aside, StrCat(name, ".", n));
    FSDP_RETURN_IF_ERROR(Rename(d.path, dst));
    moved.push_back(dst);
  }
  if (!moved.empty()) {
    FSDP_RETURN_IF_ERROR(FsyncPath(aside));
    FSDP_RETURN_IF_ERROR(FsyncPath(root));
  }
  return moved;
}

}  // namespace fsdp::ckpt
