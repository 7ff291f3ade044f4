// WorkerGroup: starts local worker processes, streams their output line by line, and stops
// them all when one fails. The engine of `fsdp launch` and of the multi-rank test harness.
//
// Each worker runs in its own process group and dies with the supervisor (PR_SET_PDEATHSIG),
// so no worker outlives the process that started it.
//
//   std::vector<WorkerSpec> specs = ...;           // argv + extra environment per worker
//   WorkerGroup group([](const OutputLine& l) { std::cout << "[rank" << l.rank << "]: " << l.text << "\n"; });
//   absl::Status started = group.Start(specs);
//   GroupResult result = group.Wait({.deadline = ..., .stop_requested = ...});
//   if (!result.ok()) std::cerr << result.Summary() << "\n";   // "rank 1 exited with code 3"
#pragma once

#include <sys/types.h>

#include <chrono>
#include <deque>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"

namespace fsdp {

struct WorkerSpec {
  int rank = 0;  // global rank, used in messages and output prefixes
  std::vector<std::string> argv;
  // Set on top of the supervisor's environment; an empty value removes the variable.
  std::map<std::string, std::string> env;
};

struct OutputLine {
  int rank;
  bool is_stderr;
  std::string_view text;  // without the trailing newline
};

struct WorkerExit {
  int rank = 0;
  bool exited = false;     // normal exit: `code` is its status
  int code = 0;            // exit status, or the signal number when !exited
  bool killed_by_us = false;  // stopped by the supervisor after another worker failed
  int64_t exit_time_ns = 0;   // CLOCK_REALTIME when the supervisor saw it end
  std::deque<std::string> tail;  // last lines of its output (stdout and stderr interleaved)

  bool ok() const { return exited && code == 0; }
  // "exited with code 3" / "was killed by signal 9 (Killed)"
  std::string Describe() const;
};

struct GroupResult {
  enum class Outcome { kSucceeded, kWorkerFailed, kTimedOut, kStopped };
  Outcome outcome = Outcome::kSucceeded;
  std::optional<WorkerExit> first_failure;  // for kWorkerFailed
  std::vector<WorkerExit> exits;            // every worker, in spec order
  bool ok() const { return outcome == Outcome::kSucceeded; }
  // One line naming the failed rank and how it ended (or the timeout / stop reason).
  std::string Summary() const;
};

struct WaitOptions {
  // Stop everything (kTimedOut) if the group has not finished by then.
  std::optional<std::chrono::steady_clock::time_point> deadline;
  // Polled a few times a second; returning true stops everything (kStopped).
  std::function<bool()> stop_requested;
  // Time a worker gets between SIGTERM and SIGKILL when the group is stopped (a stop request,
  // a deadline): e.g. long enough for a SIGTERM checkpoint.
  std::chrono::milliseconds grace{std::chrono::seconds(5)};
  // The same after a worker failed: the others cannot finish a collective without it, so they
  // get only the time to report their own state.
  std::chrono::milliseconds failure_grace{std::chrono::seconds(5)};
  // Lines kept per worker for WorkerExit::tail.
  size_t tail_lines = 40;
};

class WorkerGroup {
 public:
  explicit WorkerGroup(std::function<void(const OutputLine&)> sink);
  ~WorkerGroup();  // kills whatever still runs
  WorkerGroup(const WorkerGroup&) = delete;
  WorkerGroup& operator=(const WorkerGroup&) = delete;

  // Starts every worker. On failure, workers already started are killed.
  absl::Status Start(const std::vector<WorkerSpec>& specs);
  // Runs until all workers exit, one fails, the deadline passes or a stop is requested.
  GroupResult Wait(const WaitOptions& options);
  // Sends `signal` to every running worker's process group.
  void SignalAll(int signal);

 private:
  struct Worker;
  void Pump(int timeout_ms, size_t tail_lines);
  void Reap(size_t tail_lines);
  void StopAll(std::chrono::milliseconds grace, size_t tail_lines);
  bool AllExited() const;

  std::function<void(const OutputLine&)> sink_;
  std::vector<Worker> workers_;
};

// Installs SIGINT/SIGTERM/SIGHUP handlers that only record the signal (for supervisors that
// forward it to their workers); returns the last signal received, or 0.
void InstallStopSignalHandlers();
int ReceivedStopSignal();

}  // namespace fsdp
