// The flight recorder (device_mesh/watchdog.h) without processes: the ring keeps the last
// kCapacity collectives with their states, the oldest wait is found, the JSON dump parses.
#include <atomic>
#include <optional>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "device_mesh/watchdog.h"

namespace fsdp {
namespace {

TEST(FlightRecorderTest, KeepsTheLastCollectivesWithTheirStates) {
  FlightRecorder& fr = FlightRecorder::Get();
  fr.SetStep(7);
  const int64_t completed_before = fr.completed();
  int64_t first = 0, stuck = 0;
  {
    CollectiveTag unit("layers.\"1\"");  // quotes must be escaped in the dump
    for (int i = 0; i < 70; ++i) {
      int64_t seq = fr.Issue("all_gather", "g", {0, 1, 2}, 1024);
      if (i == 0) first = seq;
      if (i == 68) stuck = seq;
      fr.WaitBegins(seq);
      if (i != 68) fr.WaitEnds(seq, /*ok=*/i != 3);
    }
  }
  EXPECT_EQ(CollectiveTag::Current(), "");
  EXPECT_EQ(fr.completed() - completed_before, 69);
  std::vector<CollectiveRecord> ring = fr.Snapshot();
  ASSERT_EQ(ring.size(), FlightRecorder::kCapacity);
  EXPECT_EQ(ring.front().seq, first + 70 - 64);
  EXPECT_EQ(ring.back().state, CollectiveState::kCompleted);
  std::optional<CollectiveRecord> oldest = fr.OldestWaiting();
  ASSERT_TRUE(oldest.has_value());
  EXPECT_EQ(oldest->seq, stuck);
  EXPECT_EQ(oldest->step, 7);
  EXPECT_EQ(oldest->tag, "layers.\"1\"");
  fr.WaitBegins(first);  // fell out of the ring: ignored
  nlohmann::json json = nlohmann::json::parse(fr.ToJson(5));
  EXPECT_EQ(json["rank"], 5);
  ASSERT_EQ(json["collectives"].size(), 64u);
  EXPECT_EQ(json["collectives"][64 - 2]["state"], "waiting");
  EXPECT_EQ(json["collectives"][64 - 2]["unit"], "layers.\"1\"");
  EXPECT_EQ(json["collectives"][64 - 2]["ranks"], nlohmann::json({0, 1, 2}));
  fr.WaitEnds(stuck, true);
  EXPECT_FALSE(fr.OldestWaiting().has_value());
}

// A collective whose wait() returned before it ran (NCCL) stays watched until its completion
// query says so, even after hundreds of later collectives pushed it out of the ring.
TEST(FlightRecorderTest, DeviceCollectivesAreWatchedUntilTheyRun) {
  FlightRecorder& fr = FlightRecorder::Get();
  ASSERT_FALSE(fr.OldestWaiting().has_value()) << "another test left a wait open";
  std::atomic<bool> ran{false};
  const int64_t completed_before = fr.completed();
  const int64_t queued = fr.Issue("reduce_scatter", "g", {0, 1}, 4096);
  fr.WaitBegins(queued);
  fr.WaitEnds(queued, true, [&ran] { return ran.load(); });
  EXPECT_EQ(fr.on_device(), 1u);
  EXPECT_EQ(fr.completed(), completed_before) << "queued on the device is not completed";
  EXPECT_EQ(fr.Snapshot().back().state, CollectiveState::kOnDevice);
  // Done at once (Gloo, or a stream already past it): completed, nothing to watch.
  const int64_t quick = fr.Issue("all_gather", "g", {0, 1}, 4096);
  fr.WaitBegins(quick);
  fr.WaitEnds(quick, true, [] { return true; });
  EXPECT_EQ(fr.on_device(), 1u);
  EXPECT_EQ(fr.Snapshot().back().state, CollectiveState::kCompleted);
  for (int i = 0; i < 2 * static_cast<int>(FlightRecorder::kCapacity); ++i) {
    const int64_t seq = fr.Issue("all_gather", "g", {0, 1}, 4096);
    fr.WaitBegins(seq);
    fr.WaitEnds(seq, true);
  }
  ASSERT_GT(fr.Snapshot().front().seq, queued) << "the queued record left the ring";
  fr.PollDevice();  // still not run
  std::optional<CollectiveRecord> oldest = fr.OldestWaiting();
  ASSERT_TRUE(oldest.has_value());
  EXPECT_EQ(oldest->seq, queued);
  EXPECT_EQ(oldest->op, "reduce_scatter");
  EXPECT_EQ(oldest->state, CollectiveState::kOnDevice);
  EXPECT_GE(oldest->wait_start_s, 0);
  ran = true;
  fr.PollDevice();
  EXPECT_EQ(fr.on_device(), 0u);
  EXPECT_FALSE(fr.OldestWaiting().has_value());
  EXPECT_EQ(fr.completed() - completed_before, 2 + 2 * static_cast<int64_t>(FlightRecorder::kCapacity));
  EXPECT_EQ(CollectiveStateName(CollectiveState::kOnDevice), "on_device");
}

}  // namespace
}  // namespace fsdp
