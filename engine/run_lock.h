// One run per run.dir: rank 0 holds <run.dir>/.fsdp.lock for the run's lifetime.
//
// Two runs writing one folder interleave metrics.jsonl, overwrite config.yaml and prune each
// other's checkpoints. The lock file names its owner ("pid 1234 on host gpu7 since ..."); a
// second run refuses with that name. A lock left by a run that was killed (same host, process
// gone) is taken over with a warning; one from another host cannot be checked and is an error
// saying to remove it if that run is over.
//
//   FSDP_ASSIGN_OR_RETURN(std::unique_ptr<RunDirLock> lock, RunDirLock::Acquire("runs/x"));
//   ... train ...                         // the destructor removes the lock file
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace fsdp {

class RunDirLock {
 public:
  static constexpr const char* kFileName = ".fsdp.lock";
  // kFailedPrecondition naming the folder, the lock file and its owner when another live run
  // holds it, or when the file cannot be created.
  static absl::StatusOr<std::unique_ptr<RunDirLock>> Acquire(const std::string& run_dir);
  ~RunDirLock();
  RunDirLock(const RunDirLock&) = delete;
  RunDirLock& operator=(const RunDirLock&) = delete;

 private:
  explicit RunDirLock(std::string path) : path_(std::move(path)) {}
  std::string path_;
};

}  // namespace fsdp
