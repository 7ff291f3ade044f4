// Failures named at their source: the classes a rank can fail with, their exit codes, and the
// one line a failing rank writes.
//
// Every rank that fails writes exactly one line "rank R: <what>" to stderr (what names the
// file, tensor or peer involved) and exits with its class's code (Note [Exit codes]). Under
// `fsdp launch` / `fsdp train` it also leaves a record (time, code, line) in
// $FSDP_FAILURE_DIR/rank<R>.failure, from which the launcher names the FIRST rank to fail,
// not the first exit it happens to reap (Note [The first failure]).
//
//   absl::Status s = LoadCheckpoint(...);
//   if (!s.ok()) s = WithFailureClass(s, FailureClass::kCheckpoint);
//   ...
//   FailureClass c = ClassifyFailure(s);       // kCheckpoint
//   ReportFailure(rank, c, s.message());       // "rank 2: checkpoint: <message>"
//   return ExitCodeFor(c);                     // 3
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"

namespace fsdp {

// Note [Exit codes]
// `fsdp train` (each rank, and the launching process, which returns the first failed rank's
// code):
//   0  success
//   1  another error (a precondition, an unsupported setup)
//   2  configuration or command-line error (the key, file and line are named), and the data
//      a config names (a token file that is empty, malformed or has ids past the vocabulary)
//   3  checkpoint or load error (the folder, file or tensor is named)
//   4  I/O error (run.dir, metrics.jsonl: the path is named)
//   5  non-finite loss or gradient norm, or diverged training
//   6  collective timeout: a collective did not complete (the collective, unit, step and the
//      ranks that did not arrive are named); also a rendezvous deadline
//   7  a peer was lost or failed first: this rank stopped because another one did
//   8  out of memory: an allocation on the device or the host failed, or a tensor's size
//      overflowed (the allocator's message, and `fsdp plan` as the way to size the run)
//   70 internal error (an uncaught exception; a bug)
//  143 stopped by SIGTERM before training.steps (preempted), after saving the step when
//      checkpointing is on: what a rank killed by SIGTERM would report, so that a scheduler
//      tells a preempted run from a finished one whichever ranks got the signal
// A rank killed by a signal exits 128 + signal, as the shell reports it.
enum class FailureClass {
  kError,
  kConfig,
  kCheckpoint,
  kIo,
  kNonFinite,
  kCollectiveTimeout,
  kPeerLost,
  kInternal,
  kPreempted,
  kOutOfMemory,
};

int ExitCodeFor(FailureClass c);
// "config", "checkpoint", "io", "non-finite", "timeout", "peer lost", "internal", "preempted",
// "out of memory", "error".
std::string_view FailureClassName(FailureClass c);
// The class of an exit code (kError for codes not in Note [Exit codes]).
FailureClass FailureClassOfExitCode(int code);

// `status` with its class recorded (a payload), which ClassifyFailure returns.
absl::Status WithFailureClass(absl::Status status, FailureClass c);
// The recorded class, else by status code: kInvalidArgument -> kConfig, kDataLoss ->
// kCheckpoint, kDeadlineExceeded -> kCollectiveTimeout, kUnavailable / kAborted -> kPeerLost,
// kPermissionDenied / kResourceExhausted -> kIo, kInternal / kUnknown -> kInternal,
// anything else kError.
FailureClass ClassifyFailure(const absl::Status& status);

// The rank used in failure lines when a caller has none at hand (-1: unknown, the line then
// starts with "fsdp: "). Set once the rank is known (DistContext::Init).
void SetFailureRank(int rank);
int FailureRank();

// Writes "rank R: <what>" (newlines folded to "; ") to stderr and, when FSDP_FAILURE_DIR is
// set, the record <dir>/rank<R>.failure: "<unix time ns> <exit code>\n<line>\n". Only the
// first report of a process counts: later ones (a second thread failing too) are dropped, so
// a rank writes exactly one line. Returns the line written (or the first one).
std::string ReportFailure(int rank, FailureClass c, std::string_view what);
// ReportFailure, then std::_Exit(ExitCodeFor(c)): for a thread that cannot unwind the rank
// (the collective watchdog, a terminate handler). See Note [Exiting from a watchdog].
[[noreturn]] void FailAndExit(int rank, FailureClass c, std::string_view what);

// A record left in FSDP_FAILURE_DIR by a rank.
struct FailureRecord {
  int rank = -1;
  int64_t time_ns = 0;  // CLOCK_REALTIME when the rank reported
  int exit_code = 1;
  std::string line;  // "rank R: <what>"
};
// Every rank<R>.failure in `dir`, earliest first; unreadable files are skipped.
std::vector<FailureRecord> ReadFailureRecords(const std::string& dir);

}  // namespace fsdp
