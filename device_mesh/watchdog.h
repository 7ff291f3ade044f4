// Hangs bounded: a flight recorder of the last collectives of this process, and a watchdog
// thread that turns a collective that does not complete into one named failure.
//
// FlightRecorder (one per process) keeps the last kCapacity collectives issued through
// ProcessGroup: op, group, unit (CollectiveTag), step (SetStep), bytes, issue / wait / end
// times and state. ProcessGroup records every collective it issues; nothing else needs to.
// A collective whose wait() returns before it has run (NCCL: wait() only makes the current
// stream wait) stays watched "on device" until the backend reports it completed: Note [Device
// collectives are watched to completion].
//
// Watchdog (started by DistContext when DistOptions::watchdog is set) publishes this rank's
// progress to the store every heartbeat ("fsdp/<gen>/progress/<rank>": step, collectives
// issued and completed, a heartbeat counter) and checks the recorder: when a wait on a
// collective has lasted longer than the timeout, it asks the store which ranks of that
// collective's group did not arrive (fewer collectives issued, or a heartbeat that did not move
// in 2.5 s), dumps the recorder to <flight_dir>/rank<R>.json and ends the rank with exit code 6
// and one line naming the collective, the unit, the step and the missing ranks. See Note
// [Exiting from a watchdog].
//
// Cross-rank contract: the comparison of collective counts assumes every rank issues the same
// collectives in the same order (SPMD), which FSDP does.
//
//   DistOptions dist;
//   dist.watchdog = true;
//   dist.collective_timeout = std::chrono::seconds(300);
//   dist.flight_dir = "runs/x/flight";
//   auto ctx = DistContext::InitFromEnvironment(dist);
//   FlightRecorder::Get().SetStep(1);
//   { CollectiveTag unit("layers.0"); group.AllReduce(t)->wait(); }  // recorded, watched
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

namespace fsdp {

// kOnDevice: wait() returned but the collective has not run yet (queued on a GPU stream).
enum class CollectiveState { kIssued, kWaiting, kOnDevice, kCompleted, kFailed };
std::string_view CollectiveStateName(CollectiveState s);

struct CollectiveRecord {
  int64_t seq = 0;           // 1, 2, ...: this process's collectives in issue order
  std::string op;            // "all_reduce", "all_gather", "reduce_scatter", ...
  std::string group;         // the process group's name
  std::vector<int> ranks;    // the group's global ranks
  std::string tag;           // the unit ("layers.3") or "" outside any CollectiveTag
  int64_t step = 0;          // FlightRecorder::step() when issued
  int64_t bytes = 0;         // of the full buffer
  double issued_s = 0;       // seconds since the recorder started
  double wait_start_s = -1;  // -1: not waited on yet; the watchdog's clock starts here
  double end_s = -1;         // -1: not finished
  CollectiveState state = CollectiveState::kIssued;
};

class FlightRecorder {
 public:
  static constexpr size_t kCapacity = 64;
  static FlightRecorder& Get();

  // Records an issued collective; returns its seq.
  int64_t Issue(std::string_view op, const std::string& group, const std::vector<int>& ranks,
                int64_t bytes);
  void WaitBegins(int64_t seq);
  // `device_done`, when given and false right away, is how the watchdog learns later that the
  // collective ran: the record stays kOnDevice (and watched) until a PollDevice sees it true.
  void WaitEnds(int64_t seq, bool ok, std::function<bool()> device_done = nullptr);
  // Completes the kOnDevice collectives whose device_done says so (the watchdog's thread).
  void PollDevice();
  // The training step the next collectives belong to (1-based). Also the FSDP_TEST_SIGSTOP
  // fault injection point (common/env_knobs.h).
  void SetStep(int64_t step);

  int64_t step() const { return step_; }
  int64_t issued() const { return issued_; }
  int64_t completed() const { return completed_; }
  double Now() const;
  // The collective waited on for the longest time, if any is being waited on or still on the
  // device (also one that has left the ring since).
  std::optional<CollectiveRecord> OldestWaiting() const;
  size_t on_device() const;  // collectives waited on that have not run yet
  std::vector<CollectiveRecord> Snapshot() const;
  // {"rank", "step", "issued", "completed", "now_s", "collectives": [...oldest first]}.
  std::string ToJson(int rank) const;

 private:
  FlightRecorder();
  CollectiveRecord* Find(int64_t seq);  // under mu_

  const std::chrono::steady_clock::time_point start_;
  mutable std::mutex mu_;
  std::deque<CollectiveRecord> ring_;
  // The kOnDevice collectives by seq, each with its record (it may leave the ring first: a host
  // can queue hundreds of collectives behind one that never runs) and its completion query.
  struct OnDevice {
    CollectiveRecord record;
    std::function<bool()> done;
  };
  std::map<int64_t, OnDevice> on_device_;
  std::atomic<int64_t> step_{0};
  std::atomic<int64_t> issued_{0};
  std::atomic<int64_t> completed_{0};
};

// Names the unit (or phase) of the collectives this thread issues while it lives; nestable.
class CollectiveTag {
 public:
  explicit CollectiveTag(std::string tag);
  ~CollectiveTag();
  CollectiveTag(const CollectiveTag&) = delete;
  CollectiveTag& operator=(const CollectiveTag&) = delete;
  static const std::string& Current();

 private:
  std::string previous_;
};

// `work` recorded in the FlightRecorder: its wait() marks the record waiting, then completed
// or failed. Every other call is forwarded.
c10::intrusive_ptr<c10d::Work> RecordCollective(std::string_view op, const std::string& group,
                                                const std::vector<int>& ranks, int64_t bytes,
                                                c10::intrusive_ptr<c10d::Work> work);

struct WatchdogOptions {
  std::chrono::milliseconds timeout{std::chrono::minutes(10)};
  std::chrono::milliseconds heartbeat{std::chrono::seconds(1)};
  std::string key_prefix = "fsdp/progress/";  // + rank
  std::string flight_dir;  // where rank<R>.json goes on a timeout; empty: not written
};

// Note [Exiting from a watchdog]
// A collective that does not complete blocks its thread inside the backend (Gloo's recv, or
// a future) where nothing can interrupt it, and the backend's own timeout would surface as an
// exception from deep inside autograd, with a generic message. So the watchdog thread itself
// ends the rank, after writing the one failure line (common/failure.h): std::_Exit, no
// destructors (the blocked thread holds the process group's locks; tearing it down would
// hang). This is the one place below cli/ that ends the process. When the watchdog runs, the
// backend's timeout is set later than the watchdog's (DistContext), so the named failure wins.
class Watchdog {
 public:
  // Starts the thread; `store` is cloned (its own connection, so a wait on the main
  // connection never delays the heartbeat).
  static std::unique_ptr<Watchdog> Start(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                         int world_size, WatchdogOptions options);
  ~Watchdog();  // stops and joins the thread
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

 private:
  Watchdog() = default;
  void Loop();
  void Publish(int64_t beat);
  [[noreturn]] void Fire(const CollectiveRecord& stuck);

  c10::intrusive_ptr<c10d::Store> store_;
  int rank_ = 0;
  int world_size_ = 1;
  WatchdogOptions options_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace fsdp
