#include "engine/rank_stats.h"

#include <algorithm>
#include <fstream>
#include <system_error>

#include <fmt/format.h>

#include "engine/optimizer.h"
#include "engine/trainable.h"
#include "sharding/host_loops.h"
#include "sharding/memory_tracker.h"

namespace fsdp {

void WriteRankStats(const std::filesystem::path& run_dir, int rank, const RankStats& s) {
  nlohmann::json stats = {{"rank", rank},
                          {"steps", s.steps},
                          {"peak_rss_bytes", s.peak_rss},
                          {"peak_tensor_bytes", s.peak_tensor},
                          {"state_bytes", s.state_bytes},
                          {"model_state",
                           {{"device_bytes", s.model_state.device},
                            {"host_bytes", s.model_state.host},
                            {"host_untouched_bytes", s.model_state.host_untouched},
                            {"offload", OffloadName(s.offload)}}},
                          {"flops_per_token", s.flops_per_token},
                          {"peak_flops_per_device", s.peak_flops},
                          {"device", s.device}};
  const HostHeapStats heap = GetHostHeapStats();
  stats["host_heap"] = {{"held_bytes", heap.held_bytes}, {"free_bytes", heap.free_bytes}};
  if (!s.offload_stats.is_null()) stats["offload"] = s.offload_stats;
  double wait = 0;
  int64_t bytes = 0;
  for (int k = 0; k < kNumCommKinds; ++k) {
    const CommCounter& c = s.comm->Get(static_cast<CommKind>(k));
    stats["comm"][CommKindName(static_cast<CommKind>(k))] = {
        {"calls", c.calls}, {"bytes", c.bytes}, {"wait_s", c.wait_seconds}};
    wait += c.wait_seconds;
    bytes += c.bytes;
  }
  stats["comm_wait_s_total"] = wait;
  stats["comm_bytes_total"] = bytes;
  std::error_code ec;
  std::filesystem::create_directories(run_dir / "rank_stats", ec);
  std::ofstream(run_dir / "rank_stats" / fmt::format("rank{}.json", rank)) << stats.dump(1) << "\n";
}

ModelStateBytes ModelStateOf(const TrainableModel& trained, torch::optim::Optimizer& optimizer,
                             Offload offload) {
  ModelStateBytes bytes = trained.model_state_bytes();
  (offload == Offload::kNone ? bytes.device : bytes.host) += OptimizerStateBytes(optimizer);
  return bytes;
}

nlohmann::json OffloadStatsJson(const HostOffload::Stats& o, double optimizer_step_s,
                                int64_t steps) {
  nlohmann::json json = {{"optimizer_step_s", optimizer_step_s},
                         {"to_host_bytes", o.to_host_bytes},
                         {"to_host_compute_bytes", o.to_host_compute_bytes},
                         {"to_device_bytes", o.to_device_bytes},
                         {"host_adds", o.host_adds},
                         {"late_adds", o.late_adds},
                         {"wait_s", o.wait_s},
                         {"add_s", o.add_s},
                         {"clip_term_s", o.clip_term_s},
                         {"push_s", o.push_s},
                         {"refresh_s", o.refresh_s},
                         {"host_step_s", o.host_step_s},
                         {"step_wait_s", o.step_wait_s},
                         {"overlapped_steps", o.overlapped_steps},
                         {"deferred_steps", o.deferred_steps},
                         {"deferred_materialized", o.deferred_materialized},
                         {"host_passes", o.host_passes},
                         {"host_add_passes", o.host_add_passes},
                         {"clip_multiplies_deferred", o.clip_multiplies_deferred},
                         {"clip_terms_on_adder", o.clip_terms_on_adder},
                         {"delayed_steps", o.delayed_steps}};
  const double n = static_cast<double>(std::max<int64_t>(1, steps));
  nlohmann::json& per_step = json["per_step"];
  for (const auto& [key, value] : json.items()) {
    if (key == "per_step") continue;
    const bool seconds = key.size() > 2 && key.compare(key.size() - 2, 2, "_s") == 0;
    per_step[seconds ? key.substr(0, key.size() - 2) + "_ms" : key] =
        (seconds ? 1e3 : 1.0) * value.get<double>() / n;
  }
  json["host_threads"] = HostLoopThreads();  // the one loops' (Note [Host loops])
  return json;
}

}  // namespace fsdp
