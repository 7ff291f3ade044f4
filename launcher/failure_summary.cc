#include "launcher/failure_summary.h"

#include <stdlib.h>

#include <filesystem>
#include <system_error>

#include "common/strings.h"

namespace fsdp {
namespace {

// A failure that may be the first one: a rank's record, or a signal nobody recorded.
struct Candidate {
  int rank;
  int64_t time_ns;
  bool primary;
  std::string line;
  int code;
};

// A failing rank's own "<class>: <what>" from its record line ("rank R: <what>"), cut to a
// length that keeps the headline one readable line.
std::string OwnFailure(const FailureRecord& r) {
  constexpr size_t kMaxChars = 120;
  std::string what = r.line;
  const std::string prefix = StrCat("rank ", r.rank, ": ");
  if (StartsWith(what, prefix)) what = what.substr(prefix.size());
  if (what.size() > kMaxChars) what = what.substr(0, kMaxChars) + "...";
  return what;
}

// Every record, and every rank that died by a signal nobody recorded or sent.
std::vector<Candidate> FailureCandidates(const GroupResult& result,
                                         const std::vector<FailureRecord>& records) {
  std::vector<Candidate> candidates;
  for (const FailureRecord& r : records) {
    candidates.push_back({r.rank, r.time_ns,
                          FailureClassOfExitCode(r.exit_code) != FailureClass::kPeerLost, r.line,
                          r.exit_code});
  }
  for (const WorkerExit& e : result.exits) {
    bool recorded = false;
    for (const FailureRecord& r : records) recorded |= r.rank == e.rank;
    if (recorded || e.exited || e.killed_by_us) continue;  // a signal nobody recorded
    candidates.push_back({e.rank, e.exit_time_ns, true, StrCat("rank ", e.rank, " ", e.Describe()),
                          e.exited ? e.code : 128 + e.code});
  }
  return candidates;
}

// The earliest failure on its own account; without one, the earliest that only followed.
const Candidate* FirstFailure(const std::vector<Candidate>& candidates) {
  const Candidate* first = nullptr;
  for (bool want_primary : {true, false}) {
    for (const Candidate& c : candidates) {
      if (c.primary == want_primary && (first == nullptr || c.time_ns < first->time_ns)) first = &c;
    }
    if (first != nullptr) break;
  }
  return first;
}

// The headline's end after the first failure: "; rank 2 also failed: timeout: ..." for each
// other rank that failed on its own, then "; ranks 0,1 stopped after rank 3 failed" for those
// that only followed.
std::string OtherFailures(const GroupResult& result, const std::vector<FailureRecord>& records,
                          int first_rank, bool preempted) {
  std::vector<std::string> own;  // "rank 2 also failed: timeout: ..."
  std::vector<int> followers;
  for (const WorkerExit& e : result.exits) {
    if (e.rank == first_rank || e.ok()) continue;
    const FailureRecord* record = nullptr;
    for (const FailureRecord& r : records) {
      if (r.rank == e.rank) record = &r;
    }
    if (record != nullptr) {
      const FailureClass c = FailureClassOfExitCode(record->exit_code);
      if (c == FailureClass::kPeerLost || (preempted && c == FailureClass::kPreempted)) {
        followers.push_back(e.rank);
      } else {
        own.push_back(StrCat("rank ", e.rank, " also failed: ", OwnFailure(*record)));
      }
    } else if (e.killed_by_us) {
      followers.push_back(e.rank);
    } else {  // a signal nobody sent, or an exit without a record
      own.push_back(StrCat("rank ", e.rank, " ", e.Describe()));
    }
  }
  std::string text;
  for (const std::string& o : own) text += "; " + o;
  if (!followers.empty()) {
    text +=
        StrCat("; rank", followers.size() > 1 ? "s " : " ", StrJoin(followers, ","),
               preempted ? " stopped too" : StrCat(" stopped after rank ", first_rank, " failed"));
  }
  return text;
}

// The node whose report names the earliest failure on its own account; without one, the
// earliest that only followed a lost peer; -1 when no node failed.
int FirstFailingNode(const std::vector<std::optional<NodeReport>>& reports) {
  const int nnodes = static_cast<int>(reports.size());
  int first = -1;
  for (bool want_primary : {true, false}) {
    for (int n = 0; n < nnodes; ++n) {
      const auto& r = reports[n];
      if (!r || r->code <= 0 || r->primary != want_primary) continue;
      if (first < 0 || r->time_ns < reports[first]->time_ns) first = n;
    }
    if (first >= 0) break;
  }
  return first;
}

}  // namespace

// Note [The first failure]
// When one rank fails, the others fail soon after (a collective with a peer gone, a timeout
// naming it) or are stopped by the launcher; the first exit the launcher reaps is often one
// of those. So each failing rank leaves its one line with the time it failed in
// FSDP_FAILURE_DIR (common/failure.h), and the headline names the earliest failure that was
// not caused by another rank: a record with another code than 7 (peer lost), or a rank that
// died by a signal the launcher did not send (its time: when it was reaped). Every other rank
// that failed on its own account (its record's class is not peer lost, or a signal nobody
// sent) is named with its own class and what ("rank 2 also failed: collective timeout: ...":
// two ranks timing out in one collective both say so); ranks that only followed (peer lost,
// or stopped by the launcher) are summarised ("ranks 0,1,3 stopped after rank 2 failed").
FailureHeadline SummarizeFailures(const GroupResult& result,
                                  const std::vector<FailureRecord>& records) {
  const std::vector<Candidate> candidates = FailureCandidates(result, records);
  const Candidate* first = FirstFailure(candidates);
  FailureHeadline h;
  if (first == nullptr) {  // no record and no signal: the first exit reaped
    const WorkerExit& f = *result.first_failure;
    h.rank = f.rank;
    h.code = f.exited ? f.code : 128 + f.code;
    h.text = StrCat("rank ", f.rank, " ", f.Describe(), "; stopped the other local ranks");
    h.primary = !f.killed_by_us;
    h.time_ns = f.exit_time_ns;
    return h;
  }
  h.rank = first->rank;
  h.code = first->code;
  h.primary = first->primary;
  h.time_ns = first->time_ns;
  // Preempted ranks (exit 143 after a SIGTERM save, Note [Exit codes]) did not fail: they all
  // stopped at the same step, and one line says so.
  const bool preempted = FailureClassOfExitCode(h.code) == FailureClass::kPreempted;
  h.text =
      StrCat("rank ", first->rank, preempted ? " stopped first: " : " failed first: ", first->line);
  h.text += OtherFailures(result, records, h.rank, preempted);
  return h;
}

JobOutcome SummarizeNodeReports(const std::vector<std::optional<NodeReport>>& reports,
                                bool store_lost, std::chrono::milliseconds bound) {
  const int nnodes = static_cast<int>(reports.size());
  const int first = FirstFailingNode(reports);
  std::vector<int> missing, finished;
  std::vector<std::string> also;
  for (int n = 0; n < nnodes; ++n) {
    if (!reports[n]) {
      missing.push_back(n);
    } else if (reports[n]->code == 0) {
      finished.push_back(n);
    } else if (n != first && reports[n]->primary) {
      std::string t = reports[n]->text;
      if (t.size() > 160) t = t.substr(0, 160) + "...";
      also.push_back(StrCat("node ", n, " also failed: ", t));
    }
  }
  JobOutcome out;
  std::string headline = first >= 0 ? StrCat("node ", first, ": ", reports[first]->text) : "";
  std::string silent;
  if (!missing.empty()) {
    silent =
        StrCat("node", missing.size() > 1 ? "s " : " ", StrJoin(missing, ","), " sent no report",
               store_lost ? " (node 0's launcher, which holds the store, is gone)"
                          : StrCat(" within ", std::chrono::duration<double>(bound).count(),
                                   " s (was its launcher killed, or did it lose node 0?)"));
  }
  if (first < 0) {
    out.text = silent.empty() ? "a rank on another node failed" : silent;
  } else if (!silent.empty() && !reports[first]->primary) {
    out.text = StrCat(silent, "; ", headline);  // the silent node is the likelier cause
  } else {
    out.text = silent.empty() ? headline : StrCat(headline, "; ", silent);
  }
  for (const std::string& a : also) out.text += "; " + a;
  out.code = first >= 0 ? reports[first]->code : 1;
  out.silent_nodes = static_cast<int>(missing.size());
  out.restartable = missing.empty() && finished.empty();
  for (const auto& r : reports) out.restartable = out.restartable && r && r->restartable;
  if (!missing.empty()) {
    out.not_restarted = "a node is missing";
  } else if (!finished.empty()) {
    out.not_restarted = StrCat("the ranks of node", finished.size() > 1 ? "s " : " ",
                               StrJoin(finished, ","), " had already finished");
  }
  return out;
}

FailureDir::FailureDir() {
  std::string templ = "/tmp/fsdp-failures-XXXXXX";
  if (mkdtemp(templ.data()) != nullptr) path_ = templ;
}

FailureDir::~FailureDir() {
  std::error_code ec;
  if (!path_.empty()) std::filesystem::remove_all(path_, ec);
}

void FailureDir::Clear() const {
  if (path_.empty()) return;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(path_, ec)) {
    std::filesystem::remove(entry.path(), ec);
  }
}

std::vector<FailureRecord> FailureDir::Read() const {
  return path_.empty() ? std::vector<FailureRecord>() : ReadFailureRecords(path_);
}

}  // namespace fsdp
