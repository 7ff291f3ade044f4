#include "tests/train_run.h"

#include <cmath>
#include <fstream>

namespace fsdp::testing {

TrainRun RunTrain(const std::string& config, const std::string& dir,
                  const std::vector<std::string>& sets,
                  const std::map<std::string, std::string>& env, std::chrono::seconds timeout,
                  const std::vector<std::string>& flags) {
  std::vector<std::string> argv = {FsdpBinary(), "train", config, "--set", "run.dir=" + dir,
                                   "--set", "metrics.progress_bar=off"};
  argv.insert(argv.end(), flags.begin(), flags.end());
  for (const std::string& s : sets) argv.insert(argv.end(), {"--set", s});
  TrainRun run;
  run.result = RunCommand(argv, env, timeout);
  std::ifstream in(dir + "/metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    nlohmann::json r = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!r.is_object()) continue;
    run.records.push_back(r);
    if (!r.contains("loss")) continue;
    if (r["loss"].is_number() && r.contains("step")) {
      run.losses[r["step"].get<int64_t>()] = r["loss"].get<double>();
    }
    run.step_records.push_back(std::move(r));
  }
  std::ifstream stats(dir + "/rank_stats/rank0.json");
  if (stats) run.rank0_stats = nlohmann::json::parse(stats, nullptr, /*allow_exceptions=*/false);
  if (run.rank0_stats.is_discarded()) run.rank0_stats = nullptr;
  return run;
}

std::vector<double> LossSeries(const TrainRun& run) {
  std::vector<double> out;
  for (const nlohmann::json& r : run.step_records) {
    out.push_back(r["loss"].is_number() ? r["loss"].get<double>() : std::nan(""));
  }
  return out;
}

}  // namespace fsdp::testing
