#include "bench/runs.h"

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iostream>

#include <fmt/format.h>

#include "common/strings.h"
#include "launcher/launch.h"

namespace fsdp::bench {

double RunResult::MedianAfter(int warmup, double StepRecord::*field) const {
  std::vector<double> values;
  for (const StepRecord& s : steps) {
    if (s.step > warmup) values.push_back(s.*field);
  }
  return Median(values);
}

int64_t RunResult::MaxOverRanks(const std::string& key) const {
  int64_t best = 0;
  for (const nlohmann::json& stats : rank_stats) {
    if (stats.contains(key) && stats[key].is_number()) best = std::max(best, stats[key].get<int64_t>());
  }
  return best;
}

int LaunchRanks(int nproc, const std::vector<std::string>& program) {
  LaunchOptions launch;
  launch.nproc_per_node = nproc;
  launch.program = program;
  launch.echo = [](int rank, bool is_stderr, std::string_view line) {
    if (is_stderr) return !StartsWith(line, "fsdp launch: starting");
    // Rank 0's step lines, and the reference's line saying which mode runs and how.
    return rank == 0 && (StartsWith(line, "step ") || StartsWith(line, "fsdp train: done") ||
                         StartsWith(line, "fsdp2_reference: "));
  };
  return RunLaunch(launch);
}

absl::StatusOr<RunResult> ReadRun(const std::string& engine, int repeat, const std::string& dir,
                                  int nproc) {
  RunResult run;
  run.engine = engine;
  run.repeat = repeat;
  run.dir = dir;
  std::string metrics = dir + "/metrics.jsonl";
  std::ifstream in(metrics);
  if (!in) return absl::DataLossError(StrCat(engine, " run wrote no ", metrics));
  std::string line;
  int line_number = 0;
  while (std::getline(in, line)) {
    ++line_number;
    nlohmann::json record = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (record.is_discarded()) {
      return absl::DataLossError(StrCat(metrics, ":", line_number, ": not JSON"));
    }
    if (!record.contains("loss")) continue;
    StepRecord s;
    auto number = [&](const char* key) {
      return record.contains(key) && record[key].is_number() ? record[key].get<double>()
                                                             : std::nan("");
    };
    s.step = record.value("step", int64_t{0});
    s.loss = number("loss");
    s.step_time_s = number("step_time_s");
    s.comm_wait_s = number("comm_wait_s");
    s.comm_bytes = number("comm_bytes");
    run.steps.push_back(s);
  }
  if (run.steps.empty()) return absl::DataLossError(StrCat(metrics, " has no step records"));
  for (int r = 0; r < nproc; ++r) {
    std::string path = StrCat(dir, "/rank_stats/rank", r, ".json");
    std::ifstream stats_in(path);
    nlohmann::json stats = nlohmann::json::parse(stats_in, nullptr, false);
    if (!stats_in || stats.is_discarded() || !stats.is_object()) {
      return absl::DataLossError(StrCat(engine, " run: missing or unreadable ", path));
    }
    run.rank_stats.push_back(std::move(stats));
  }
  return run;
}

double Median(std::vector<double> values) {
  std::erase_if(values, [](double v) { return std::isnan(v); });
  if (values.empty()) return std::nan("");
  std::sort(values.begin(), values.end());
  size_t n = values.size();
  return n % 2 == 1 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

std::string GiB(double bytes) { return fmt::format("{:.1f} GiB", bytes / 1073741824.0); }

// --out is checked before the benchmark runs: a folder that does not exist, a directory, a
// file that cannot be written. "" when it can be written (nothing is left behind).
std::string CheckOutPath(const std::string& out) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::file_status status = fs::status(out, ec);
  if (fs::exists(status) && !fs::is_regular_file(status)) {
    return fs::is_directory(status) ? "is a directory" : "is not a regular file";
  }
  const bool existed = fs::exists(status);
  {
    std::ofstream probe(out, std::ios::app);
    if (!probe) return fmt::format("cannot be written ({})", std::strerror(errno));
  }
  if (!existed) fs::remove(out, ec);
  return "";
}

double HostMemoryBytes() {
  const double bytes = static_cast<double>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGESIZE);
  return bytes > 0 ? bytes : 0;
}

std::string MachineDescription() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line, model = "unknown CPU";
  while (std::getline(cpuinfo, line)) {
    if (StartsWith(line, "model name")) {
      model = std::string(Strip(line.substr(line.find(':') + 1)));
      break;
    }
  }
  return StrCat(model, ", ", sysconf(_SC_NPROCESSORS_ONLN), " cores");
}

std::string Today() {
  std::time_t now = std::time(nullptr);
  char text[16];
  std::strftime(text, sizeof(text), "%Y-%m-%d", std::localtime(&now));
  return text;
}

void Plot(const std::string& python, const std::string& kind, const std::string& dir) {
  std::string command = StrCat("'", python, "' '", FSDP_SOURCE_DIR, "/bench/plot.py' ", kind, " '",
                               dir, "'");
  int status = std::system(command.c_str());
  if (status != 0) {
    std::cerr << "fsdp bench: plotting failed (" << command << "); the numbers are in " << dir
              << "\n";
  }
}

}  // namespace fsdp::bench
