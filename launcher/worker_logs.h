// WorkerLogs: every local rank's stdout and stderr in files, in torchrun's --log-dir layout,
// and which of those lines the launcher's console also shows (torchrun's --redirects / --tee).
//
//   DIR/<run_id>/attempt_<restart>/<local_rank>/stdout.log
//   DIR/<run_id>/attempt_<restart>/<local_rank>/stderr.log
//
// With several nodes the launcher of node N writes under DIR/<run_id>/node_<N>/attempt_...: on a
// shared file system two nodes' local rank 0 would otherwise write into one file. (torchrun
// makes a fresh DIR/<run_id>_<random>/ per launcher instead.) Each attempt (--max-restarts)
// gets its own folder; an earlier run's folder of the same attempt is replaced, as torchrun's.
//
// Note [Log files and the console]
// Both streams of every rank always go to their files; --redirects and --tee take torchrun's
// values and choose only what the console shows besides: 0 none, 1 stdout, 2 stderr, 3 both,
// for every local rank, or per local rank as "LOCAL_RANK:VALUE,..." (ranks not named: 0). As in
// torchrun, a stream in --redirects is left off the console, unless it is in --tee too: the
// console shows (~redirects | tee). So --log-dir alone keeps the console as it was (every
// stream in the files and on the console: tee 3), --redirects 3 leaves it without the ranks'
// lines, and --redirects 3 --tee 0:3 shows local rank 0 only. (torchrun writes a stream in
// neither option to the console only; here it is in its file too.)
//
// A line is one write(2) of the line and its newline, made when the launcher reads it from the
// rank's pipe: nothing is buffered in the launcher, so a killed launcher leaves whole lines.
//
//   absl::StatusOr<ConsoleStreams> console = ParseConsoleStreams("3", "0:3", 4);
//   // only local rank 0 on the console, every rank in its files
//   auto logs = WorkerLogs::Create("logs", "run1", /*node_rank=*/0, /*nnodes=*/1, *console);
//   (*logs)->StartAttempt(0);                    // logs/run1/attempt_0/{0,1,2,3}/std{out,err}.log
//   (*logs)->Write(1, /*is_stderr=*/true, "loss is NaN");
//   bool shown = (*logs)->OnConsole(1, true);    // false
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace fsdp {

// torchrun's Std flags.
inline constexpr int kStdOut = 1;
inline constexpr int kStdErr = 2;

// Per local rank, the streams (kStdOut | kStdErr) the console shows.
using ConsoleStreams = std::vector<int>;

// Parses one --redirects / --tee value ("0".."3", or "LOCAL_RANK:VALUE,...") into a value per
// local rank. kInvalidArgument naming `option` and what would be valid.
absl::StatusOr<std::vector<int>> ParseStdStreams(std::string_view option, std::string_view text,
                                                 int nproc_per_node);

// What the console shows from the --redirects and --tee texts ("" when not given); see
// Note [Log files and the console].
absl::StatusOr<ConsoleStreams> ParseConsoleStreams(std::string_view redirects, std::string_view tee,
                                                   int nproc_per_node);

class WorkerLogs {
 public:
  // Makes DIR/<run_id> (and node_<N> with several nodes). kInvalidArgument naming --log-dir
  // when it cannot be made or written to, or --run-id when it is not a folder name.
  static absl::StatusOr<std::unique_ptr<WorkerLogs>> Create(const std::string& dir,
                                                            const std::string& run_id,
                                                            int node_rank, int nnodes,
                                                            ConsoleStreams console);
  ~WorkerLogs();
  WorkerLogs(const WorkerLogs&) = delete;
  WorkerLogs& operator=(const WorkerLogs&) = delete;

  // The folder of this launcher's attempts: DIR/<run_id>[/node_<N>].
  const std::string& run_dir() const { return run_dir_; }
  // Closes the previous attempt's files and creates this attempt's, empty, for every local
  // rank. Call before the ranks start.
  absl::Status StartAttempt(int attempt);
  // Appends `line` and a newline to the local rank's file of that stream. A failed write is
  // reported once per file on the launcher's stderr; the rank runs on.
  void Write(int local_rank, bool is_stderr, std::string_view line);
  bool OnConsole(int local_rank, bool is_stderr) const;
  // The file of the local rank's stream in the current attempt.
  std::string Path(int local_rank, bool is_stderr) const;

 private:
  WorkerLogs(std::string run_dir, ConsoleStreams console);
  void CloseFiles();

  struct File {
    int fd = -1;
    bool failed = false;  // a write failed (reported once)
  };
  std::string run_dir_;
  ConsoleStreams console_;
  std::string attempt_dir_;
  std::vector<File> files_;  // 2 per local rank: stdout, stderr
};

}  // namespace fsdp
