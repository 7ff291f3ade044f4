// The flight recorder (device_mesh/watchdog.h) without processes: the ring keeps the last
// kCapacity collectives with their states, the oldest wait is found, the JSON dump parses.
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

}  // namespace
}  // namespace fsdp
