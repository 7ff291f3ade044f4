#include "device_mesh/watchdog.h"

#include <signal.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <optional>

#include <fmt/format.h>

#include "common/env_knobs.h"
#include "common/failure.h"
#include "common/strings.h"
#include "device_mesh/cuda_support.h"

namespace fsdp {
namespace {

thread_local std::string t_tag;

std::string JsonString(std::string_view s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      out += fmt::format("\\u{:04x}", static_cast<int>(c));
    } else {
      out += c;
    }
  }
  return out + "\"";
}

// A Work whose wait() is recorded in the FlightRecorder.
class RecordedWork : public c10d::Work {
 public:
  RecordedWork(c10::intrusive_ptr<c10d::Work> inner, int64_t seq)
      : c10d::Work(-1, inner->retrieveOpType()), inner_(std::move(inner)), seq_(seq) {}

  bool wait(std::chrono::milliseconds timeout) override {
    FlightRecorder::Get().WaitBegins(seq_);
    bool done = false;
    try {
      done = inner_->wait(timeout);
    } catch (...) {
      FlightRecorder::Get().WaitEnds(seq_, false);
      throw;
    }
    // NCCL's wait() returns once the current stream waits on the collective: an event behind
    // it on that stream tells the watchdog when it has run (Note [Device collectives are
    // watched to completion]).
    FlightRecorder::Get().WaitEnds(seq_, true,
                                   inner_->isCompleted() ? nullptr : MarkCurrentCudaStream());
    return done;
  }
  bool isCompleted() override { return inner_->isCompleted(); }
  bool isSuccess() const override { return inner_->isSuccess(); }
  std::exception_ptr exception() const override { return inner_->exception(); }
  int sourceRank() const override { return inner_->sourceRank(); }
  std::vector<at::Tensor> result() override { return inner_->result(); }
  void synchronize() override { inner_->synchronize(); }
  void blockCurrentStream() override { inner_->blockCurrentStream(); }
  void abort() override { inner_->abort(); }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return inner_->getFuture(); }

 private:
  c10::intrusive_ptr<c10d::Work> inner_;
  int64_t seq_;
};

// FSDP_TEST_SIGSTOP and FSDP_TEST_SIGTERM, parsed once.
std::pair<int, int64_t> SigstopAt() {
  static const std::pair<int, int64_t> at = GetRankAtStepKnob(kTestSigstop);
  return at;
}
std::pair<int, int64_t> SigtermAt() {
  static const std::pair<int, int64_t> at = GetRankAtStepKnob(kTestSigterm);
  return at;
}

struct Progress {
  int64_t step = 0, issued = 0, completed = 0, beat = 0;
};

std::optional<Progress> ParseProgress(const std::vector<uint8_t>& v) {
  const std::string text(v.begin(), v.end());  // the pieces below are views into it
  std::vector<std::string_view> parts = Split(text, " ");
  if (parts.size() != 4) return std::nullopt;
  Progress p;
  int64_t* fields[] = {&p.step, &p.issued, &p.completed, &p.beat};
  for (int i = 0; i < 4; ++i) {
    std::optional<int64_t> x = ParseInt<int64_t>(parts[i]);
    if (!x) return std::nullopt;
    *fields[i] = *x;
  }
  return p;
}

}  // namespace

std::string_view CollectiveStateName(CollectiveState s) {
  switch (s) {
    case CollectiveState::kIssued:
      return "issued";
    case CollectiveState::kWaiting:
      return "waiting";
    case CollectiveState::kOnDevice:
      return "on_device";
    case CollectiveState::kCompleted:
      return "completed";
    case CollectiveState::kFailed:
      return "failed";
  }
  return "?";
}

// ---- FlightRecorder --------------------------------------------------------------------------

FlightRecorder::FlightRecorder() : start_(std::chrono::steady_clock::now()) {}

FlightRecorder& FlightRecorder::Get() {
  static FlightRecorder* recorder = new FlightRecorder();  // never destroyed: threads use it
  return *recorder;
}

double FlightRecorder::Now() const {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
}

int64_t FlightRecorder::Issue(std::string_view op, const std::string& group,
                              const std::vector<int>& ranks, int64_t bytes) {
  CollectiveRecord r;
  r.op = std::string(op);
  r.group = group;
  r.ranks = ranks;
  r.tag = CollectiveTag::Current();
  r.step = step_;
  r.bytes = bytes;
  r.issued_s = Now();
  std::lock_guard<std::mutex> lock(mu_);
  r.seq = ++issued_;
  ring_.push_back(std::move(r));
  while (ring_.size() > kCapacity) ring_.pop_front();
  return ring_.back().seq;
}

CollectiveRecord* FlightRecorder::Find(int64_t seq) {
  if (ring_.empty() || seq < ring_.front().seq || seq > ring_.back().seq) return nullptr;
  return &ring_[static_cast<size_t>(seq - ring_.front().seq)];
}

void FlightRecorder::WaitBegins(int64_t seq) {
  std::lock_guard<std::mutex> lock(mu_);
  if (CollectiveRecord* r = Find(seq); r != nullptr && r->state == CollectiveState::kIssued) {
    r->state = CollectiveState::kWaiting;
    r->wait_start_s = Now();
  }
}

// Note [Device collectives are watched to completion]
// With Gloo, wait() returns when the collective is done, so "waiting too long" is the whole
// test. With NCCL, wait() returns at once (the current stream now waits on the collective's
// stream) and a peer that never arrives leaves the collective queued on the GPU while the host
// runs ahead, queueing more work, until something reads a result and blocks in a CUDA
// synchronize no watchdog of ours sees. So a wait() that returns before its work has completed
// leaves the record kOnDevice, with a query of a CUDA event recorded on the current stream right
// after the wait (the stream passes it only once the collective has run; the event holds no
// tensor, where keeping the Work would keep its output buffers alive). The watchdog thread polls
// those every few hundred ms; the timeout counts from the wait's start as for a host wait, and a
// stuck one fires the same named failure. Only works not complete when wait() returns get an
// event, so Gloo pays one isCompleted() per wait and nothing after.
void FlightRecorder::WaitEnds(int64_t seq, bool ok, std::function<bool()> device_done) {
  const bool on_device = ok && device_done && !device_done();
  std::lock_guard<std::mutex> lock(mu_);
  CollectiveRecord* r = Find(seq);
  if (r == nullptr || r->state != CollectiveState::kWaiting) return;
  if (on_device) {
    r->state = CollectiveState::kOnDevice;
    on_device_[seq] = {*r, std::move(device_done)};
    return;
  }
  r->state = ok ? CollectiveState::kCompleted : CollectiveState::kFailed;
  r->end_s = Now();
  ++completed_;
}

void FlightRecorder::PollDevice() {
  std::vector<std::pair<int64_t, std::function<bool()>>> pending;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [seq, d] : on_device_) pending.emplace_back(seq, d.done);
  }
  std::vector<int64_t> done;  // queried without the lock: a CUDA event query may take a while
  for (const auto& [seq, query] : pending) {
    if (query()) done.push_back(seq);
  }
  std::lock_guard<std::mutex> lock(mu_);
  for (int64_t seq : done) {
    on_device_.erase(seq);
    if (CollectiveRecord* r = Find(seq); r != nullptr && r->state == CollectiveState::kOnDevice) {
      r->state = CollectiveState::kCompleted;
      r->end_s = Now();
    }
    ++completed_;
  }
}

size_t FlightRecorder::on_device() const {
  std::lock_guard<std::mutex> lock(mu_);
  return on_device_.size();
}

void FlightRecorder::SetStep(int64_t step) {
  step_ = step;
  if (auto [rank, at] = SigstopAt(); rank >= 0 && rank == FailureRank() && step == at) {
    raise(SIGSTOP);  // fault injection: this rank hangs here until it is killed
  }
  if (auto [rank, at] = SigtermAt(); rank >= 0 && rank == FailureRank() && step == at) {
    raise(SIGTERM);  // fault injection: a preemption that reaches this rank only
  }
}

std::optional<CollectiveRecord> FlightRecorder::OldestWaiting() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::optional<CollectiveRecord> oldest;
  for (const CollectiveRecord& r : ring_) {
    if (r.state == CollectiveState::kWaiting &&
        (!oldest || r.wait_start_s < oldest->wait_start_s)) {
      oldest = r;
    }
  }
  for (const auto& [seq, d] : on_device_) {
    if (!oldest || d.record.wait_start_s < oldest->wait_start_s) oldest = d.record;
  }
  return oldest;
}

std::vector<CollectiveRecord> FlightRecorder::Snapshot() const {
  std::lock_guard<std::mutex> lock(mu_);
  return {ring_.begin(), ring_.end()};
}

std::string FlightRecorder::ToJson(int rank) const {
  std::string out = fmt::format(
      "{{\"rank\": {}, \"step\": {}, \"issued\": {}, \"completed\": {}, \"now_s\": {:.6f}, "
      "\"collectives\": [",
      rank, step_.load(), issued_.load(), completed_.load(), Now());
  bool first = true;
  for (const CollectiveRecord& r : Snapshot()) {
    out += fmt::format(
        "{}\n  {{\"seq\": {}, \"op\": {}, \"group\": {}, \"ranks\": [{}], \"unit\": {}, "
        "\"step\": {}, \"bytes\": {}, \"issued_s\": {:.6f}, \"wait_start_s\": {:.6f}, "
        "\"end_s\": {:.6f}, \"state\": {}}}",
        first ? "" : ",", r.seq, JsonString(r.op), JsonString(r.group), StrJoin(r.ranks, ", "),
        JsonString(r.tag), r.step, r.bytes, r.issued_s, r.wait_start_s, r.end_s,
        JsonString(CollectiveStateName(r.state)));
    first = false;
  }
  return out + "\n]}\n";
}

CollectiveTag::CollectiveTag(std::string tag) : previous_(std::move(t_tag)) {
  t_tag = std::move(tag);
}
CollectiveTag::~CollectiveTag() { t_tag = std::move(previous_); }
const std::string& CollectiveTag::Current() { return t_tag; }

c10::intrusive_ptr<c10d::Work> RecordCollective(std::string_view op, const std::string& group,
                                                const std::vector<int>& ranks, int64_t bytes,
                                                c10::intrusive_ptr<c10d::Work> work) {
  int64_t seq = FlightRecorder::Get().Issue(op, group, ranks, bytes);
  return c10::make_intrusive<RecordedWork>(std::move(work), seq);
}

// ---- Watchdog --------------------------------------------------------------------------------

std::unique_ptr<Watchdog> Watchdog::Start(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                          int world_size, WatchdogOptions options) {
  std::unique_ptr<Watchdog> w(new Watchdog());
  w->store_ = store->clone();
  w->rank_ = rank;
  w->world_size_ = world_size;
  w->options_ = std::move(options);
  w->Publish(0);
  w->thread_ = std::thread([raw = w.get()] { raw->Loop(); });
  return w;
}

Watchdog::~Watchdog() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void Watchdog::Publish(int64_t beat) {
  const FlightRecorder& fr = FlightRecorder::Get();
  std::string value = fmt::format("{} {} {} {}", fr.step(), fr.issued(), fr.completed(), beat);
  try {
    store_->set(StrCat(options_.key_prefix, rank_),
                std::vector<uint8_t>(value.begin(), value.end()));
  } catch (const std::exception&) {
    // The store is gone (the launcher ended): the rank's own collectives will say so.
  }
}

void Watchdog::Loop() {
  const auto poll =
      std::min<std::chrono::milliseconds>(options_.heartbeat, std::chrono::milliseconds(200));
  auto next_beat = std::chrono::steady_clock::now() + options_.heartbeat;
  int64_t beat = 0;
  int64_t published_issued = 0;
  std::unique_lock<std::mutex> lock(mu_);
  while (!cv_.wait_for(lock, poll, [this] { return stop_; })) {
    // A beat every heartbeat, and sooner when the rank issued collectives since the last one,
    // so that the progress a peer reads is at most one poll old (one small store write).
    const int64_t issued = FlightRecorder::Get().issued();
    if (std::chrono::steady_clock::now() >= next_beat || issued != published_issued) {
      Publish(++beat);
      published_issued = issued;
      next_beat = std::chrono::steady_clock::now() + options_.heartbeat;
    }
    FlightRecorder::Get().PollDevice();
    std::optional<CollectiveRecord> stuck = FlightRecorder::Get().OldestWaiting();
    const double timeout_s = std::chrono::duration<double>(options_.timeout).count();
    if (stuck && FlightRecorder::Get().Now() - stuck->wait_start_s > timeout_s) Fire(*stuck);
  }
}

void Watchdog::Fire(const CollectiveRecord& stuck) {
  // Which ranks of the group did not arrive: read their progress twice, a few heartbeats apart;
  // a rank with fewer collectives issued has not reached this one, a rank whose heartbeat did
  // not move is not running (stopped, or blocked with its watchdog).
  auto read_all = [&] {
    std::map<int, std::optional<Progress>> all;
    for (int r : stuck.ranks) {
      if (r == rank_) continue;
      std::optional<Progress> p;
      try {
        std::string key = StrCat(options_.key_prefix, r);
        if (store_->check({key})) p = ParseProgress(store_->get(key));
      } catch (const std::exception&) {
      }
      all[r] = p;
    }
    return all;
  };
  std::map<int, std::optional<Progress>> before = read_all();
  // Keep beating meanwhile: a peer that timed out on the same collective is looking too.
  const auto look_until =
      std::chrono::steady_clock::now() + 2 * options_.heartbeat + std::chrono::milliseconds(500);
  int64_t beat = 1 << 20;  // beyond the loop's count, still moving
  while (std::chrono::steady_clock::now() < look_until) {
    Publish(++beat);
    std::this_thread::sleep_for(std::min<std::chrono::milliseconds>(
        options_.heartbeat / 2,
        std::chrono::duration_cast<std::chrono::milliseconds>(
            look_until - std::chrono::steady_clock::now())));
  }
  std::map<int, std::optional<Progress>> after = read_all();
  std::vector<int> missing;
  std::vector<std::string> details;
  for (const auto& [r, p] : after) {
    const std::optional<Progress>& earlier = before[r];
    if (!p) {
      missing.push_back(r);
      details.push_back(fmt::format("rank {} never reported progress", r));
      continue;
    }
    const bool behind = p->issued < stuck.seq;
    const bool silent = earlier && earlier->beat == p->beat;
    if (behind || silent) {
      missing.push_back(r);
      // The heartbeat's figures are the last one received (it beats about once a second), not
      // necessarily where the rank stopped: said so.
      details.push_back(fmt::format("rank {}{}, last heard at step {} after {} collective(s)", r,
                                    silent ? " is not responding (heartbeat stopped)" : "", p->step,
                                    p->issued));
    }
  }
  std::string flight;
  if (!options_.flight_dir.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(options_.flight_dir, ec);
    const std::string path = fmt::format("{}/rank{}.json", options_.flight_dir, rank_);
    std::ofstream out(path);
    out << FlightRecorder::Get().ToJson(rank_);
    flight = out.flush()
                 ? fmt::format("; last {} collectives in {}", FlightRecorder::kCapacity, path)
                 : fmt::format("; could not write {}", path);
  }
  const std::string unit = stuck.tag.empty() ? "no unit" : fmt::format("unit '{}'", stuck.tag);
  const std::string who = missing.empty()
                              ? "every rank of the group reports progress (a backend problem?)"
                              : fmt::format("rank(s) {} did not arrive ({})", StrJoin(missing, ","),
                                            StrJoin(details, "; "));
  FailAndExit(rank_, FailureClass::kCollectiveTimeout,
              fmt::format("collective timeout: {} #{} ({}, step {}, {} bytes, group {} [{}]) did "
                          "not complete within {:g} s{}; {}{}",
                          stuck.op, stuck.seq, unit, stuck.step, stuck.bytes, stuck.group,
                          StrJoin(stuck.ranks, ","),
                          std::chrono::duration<double>(options_.timeout).count(),
                          stuck.state == CollectiveState::kOnDevice
                              ? " (queued on the device, never ran)"
                              : "",
                          who, flight));
}

}  // namespace fsdp
