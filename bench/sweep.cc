// `fsdp bench sweep`: see bench/bench.h.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>

#include <fmt/format.h>

#include "bench/bench.h"
#include "bench/runs.h"
#include "common/strings.h"
#include "common/user_input.h"
#include "engine/metrics.h"
#include "planner/cost_model.h"

namespace fsdp::bench {
namespace {

namespace fs = std::filesystem;

// The replicate x shard mesh a strategy gets on `world` ranks in the sweep: sharded
// strategies over all ranks, no_shard replicated over all, hybrid 2 replicas of world/2.
std::optional<plan::Layout> SweepLayout(Strategy strategy, int world) {
  if (strategy == Strategy::kNoShard) return plan::Layout{strategy, world, 1};
  if (strategy == Strategy::kHybridShard || strategy == Strategy::kHybridShardZero2) {
    if (world < 4 || world % 2 != 0) return std::nullopt;  // needs 2 replicas of >= 2 shards
    return plan::Layout{strategy, 2, world / 2};
  }
  return plan::Layout{strategy, 1, world};
}

// Bytes one rank sends per step on the wire with ring algorithms, from the engine's own
// counters (full buffers): all-gather / reduce-scatter (n-1)/n of the buffer over the shard
// group, all-reduce 2(n-1)/n over the replicate group. See Note [Rank statistics].
double WireBytesPerStep(const nlohmann::json& stats, const plan::Layout& layout, int64_t steps) {
  auto bytes = [&](const char* kind) {
    return stats.contains("comm") && stats["comm"].contains(kind)
               ? stats["comm"][kind].value("bytes", 0.0)
               : 0.0;
  };
  double s = layout.shard, r = layout.replicate;
  double wire = (bytes("all_gather") + bytes("reduce_scatter")) * (s - 1) / s +
                bytes("all_reduce") * 2 * (r - 1) / r;
  return wire / static_cast<double>(std::max<int64_t>(steps, 1));
}

// The same from the model's unit sizes, counting what the engine does (and FSDP2 does): the
// root unit (embeddings, final norm, head) stays unsharded from forward to backward, so only
// the blocks are all-gathered again in backward; every micro-batch gathers and reduces. Only
// dim-0 padding separates it from the counters.
double EngineWireBytesPerStep(const plan::ModelCounts& counts, const plan::Layout& layout,
                              const TrainingSection& t) {
  const double param_bytes = BytesOf(t.mixed_precision);
  const double reduce_bytes = BytesOf(t.reduce_dtype);
  const double all = static_cast<double>(counts.params);
  const double root = counts.unit_params.empty() ? 0 : static_cast<double>(counts.unit_params[0]);
  const double s = layout.shard, r = layout.replicate;
  const bool reshard = OptionsForStrategy(layout.strategy).reshard_after_forward;
  double wire = 0;
  if (layout.shard > 1) {
    double gathered = all + (reshard ? all - root : 0);
    wire += (gathered * param_bytes + all * reduce_bytes) * (s - 1) / s;
  }
  if (layout.replicate > 1) wire += all / s * reduce_bytes * 2 * (r - 1) / r;
  return wire * static_cast<double>(t.grad_accum_steps);
}

std::string Cell(double v, const char* format = "{:.6g}") {
  return std::isfinite(v) ? fmt::format(fmt::runtime(format), v) : std::string();
}

// Why SweepLayout has no layout for `strategy` (a hybrid one) on some world sizes.
constexpr char kHybridNeeds[] =
    "it needs an even world size of at least 4 (2 replicas of >= 2 shards each)";

}  // namespace

int RunSweep(const SweepOptions& o) {
  // Every input is checked before anything is written or run: a config that cannot be read
  // used to leave a sweep.csv with only its header.
  std::vector<std::string> configs = o.configs;
  if (configs.empty()) {
    configs = {StrCat(FSDP_SOURCE_DIR, "/configs/default.yaml"),
               StrCat(FSDP_SOURCE_DIR, "/configs/sweep_medium.yaml")};
  }
  if (o.warmup >= o.steps) {
    std::cerr << "fsdp bench sweep: --warmup " << o.warmup << " leaves no measured step of --steps "
              << o.steps << "\n";
    return 2;
  }
  for (int world : o.world_sizes) {
    if (world < 1) {
      std::cerr << "fsdp bench sweep: --world-sizes: " << world << " is not a rank count (>= 1)\n";
      return 2;
    }
  }
  struct Model {
    std::string config_path;
    RunConfig config;
  };
  std::vector<Model> models;
  for (const std::string& config_path : configs) {
    absl::StatusOr<RunConfig> config = LoadRunConfig(config_path, o.overrides);
    if (!config.ok()) {
      std::cerr << "fsdp bench sweep: " << config.status().message() << "\n";
      return 2;
    }
    models.push_back({config_path, *std::move(config)});
  }
  // Two run.names can give one folder ("exp/a" and "exp_a"): the second row would remove the
  // first's run folder. Refused before anything runs.
  {
    std::map<std::string, std::string> folders;  // folder -> the config that names it
    for (const Model& model : models) {
      // The folders are SafeFileName("<run.name>-<strategy>-<world>"): the same for two
      // configs exactly when their names map to the same prefix.
      const std::string name = SafeFileName(StrCat(model.config.run.name, "-"));
      auto [it, fresh] = folders.emplace(name, model.config_path);
      if (!fresh) {
        std::cerr << "fsdp bench sweep: " << it->second << " and " << model.config_path
                  << " name the same run folders (run.name '" << model.config.run.name
                  << "'); give them different run.name values (--set applies to both)\n";
        return 2;
      }
    }
  }
  std::vector<Strategy> strategies;
  int runnable = 0;
  for (const std::string& strategy : o.strategies) {
    absl::StatusOr<Strategy> parsed = ParseStrategy(strategy);
    if (!parsed.ok()) {
      std::cerr << "fsdp bench sweep: --strategies: " << parsed.status().message() << "\n";
      return 2;
    }
    strategies.push_back(*parsed);
    std::vector<int> skipped;
    for (int world : o.world_sizes) {
      if (SweepLayout(*parsed, world)) {
        ++runnable;
      } else {
        skipped.push_back(world);
      }
    }
    if (!skipped.empty()) {
      std::cerr << "fsdp bench sweep: skipping " << strategy << " at world size "
                << StrJoin(skipped, ", ") << ": " << kHybridNeeds << "\n";
    }
  }
  if (runnable == 0) {
    std::cerr << "fsdp bench sweep: nothing to run: no strategy of --strategies "
              << StrJoin(o.strategies, ",") << " has a layout at --world-sizes "
              << StrJoin(o.world_sizes, ",") << "\n";
    return 2;
  }

  // The cost model's hardware: a named or JSON profile now; "calibrate" measures this
  // machine once --out exists (below).
  plan::Hardware hw;
  if (o.hardware != "calibrate") {
    std::error_code ec;
    const fs::file_status file = fs::status(o.hardware, ec);
    absl::StatusOr<plan::Hardware> named = absl::InvalidArgumentError("");
    if (fs::is_regular_file(file)) {
      named = plan::LoadHardwareJson(o.hardware);
    } else if (fs::exists(file)) {
      named = absl::InvalidArgumentError(StrCat(o.hardware, ": not a JSON file"));
    } else {
      const std::vector<std::string> names = plan::HardwareNames();
      named = std::find(names.begin(), names.end(), o.hardware) != names.end()
                  ? plan::HardwareByName(o.hardware)
                  : absl::InvalidArgumentError(StrCat("'", o.hardware,
                                                      "' is neither calibrate, a profile name (",
                                                      StrJoin(names, ", "), ") nor a JSON file"));
    }
    if (!named.ok()) {
      std::cerr << "fsdp bench sweep: --hardware " << named.status().message() << "\n";
      return 2;
    }
    hw = *named;
  }
  std::string python;
  if (o.plot) {
    python = PythonPath(o.python);
    if (absl::Status ready = EnsurePythonPackages(python); !ready.ok()) {
      std::cerr << "fsdp bench sweep: cannot draw the plots: " << ready.message()
                << " (or pass --no-plot)\n";
      return 2;
    }
  }

  fs::path out = fs::absolute(o.out);
  std::error_code ec;
  fs::create_directories(out, ec);
  if (ec) {
    std::cerr << "fsdp bench sweep: --out " << out << ": " << ec.message() << "\n";
    return 2;
  }
  if (o.hardware == "calibrate") {
    std::string log;
    std::cout << "fsdp bench sweep: calibrating the CPU profile (GEMM rate, loopback all-gather)\n";
    // The calibration runs `fsdp launch ... fsdp doctor` through a shell: the real path.
    absl::StatusOr<plan::Hardware> measured =
        plan::CalibrateCpu(fs::read_symlink("/proc/self/exe", ec).string(), &log);
    if (!measured.ok()) {
      std::cerr << "fsdp bench sweep: calibration failed: " << measured.status().message() << "\n" << log;
      return 1;
    }
    hw = *measured;
    std::ofstream(out / "hardware.json") << plan::HardwareToJson(hw) << "\n";
  }

  std::ofstream csv(out / "sweep.csv");
  csv << "model,params,strategy,world_size,replicate,shard,tokens_per_s,tokens_per_s_per_rank,"
         "step_time_s,peak_tensor_bytes,state_bytes,peak_rss_bytes,comm_buffer_bytes_per_step,"
         "comm_wire_bytes_per_step,theory_state_bytes,theory_wire_bytes_per_step,"
         "engine_wire_bytes_per_step,wire_vs_engine_theory,predicted_step_time_s,predicted_peak_bytes,step_time_error,"
         "peak_bytes_error\n";
  std::cout << fmt::format("{:<14} {:<14} {:>5} {:>12} {:>12} {:>11} {:>11} {:>11} {:>9} {:>9} {:>9}\n",
                           "model", "strategy", "ranks", "tok/s/rank", "peak mem", "state",
                           "wire/step", "expected", "ratio", "t err", "mem err");
  for (const Model& model : models) {
    const std::string& config_path = model.config_path;
    const RunConfig* config = &model.config;
    const std::string model_name = config->run.name;
    const plan::ModelCounts counts = plan::CountModel(config->model);
    for (size_t i = 0; i < strategies.size(); ++i) {
      const std::string& strategy = o.strategies[i];
      const Strategy* parsed = &strategies[i];
      for (int world : o.world_sizes) {
        std::optional<plan::Layout> layout = SweepLayout(*parsed, world);
        if (!layout) continue;
        // run.name is the user's: one file-name component of it, so that the folder this
        // removes and rewrites is always inside --out ("/tmp/x" or "../x" would escape).
        std::string dir =
            (out / "runs" / SafeFileName(StrCat(model_name, "-", strategy, "-", world))).string();
        fs::remove_all(dir, ec);
        std::vector<std::string> sets = o.overrides;
        for (std::string s : {StrCat("run.dir=", dir), StrCat("training.steps=", o.steps),
                              std::string("training.log_interval=1"),
                              std::string("training.eval_interval=0"),
                              std::string("checkpoint.enabled=false"),
                              std::string("metrics.progress_bar=off"),
                              StrCat("parallelism.nproc=", world),
                              StrCat("parallelism.strategy=", strategy),
                              StrCat("parallelism.data_parallel_replicate_degree=", layout->replicate),
                              StrCat("parallelism.data_parallel_shard_degree=", layout->shard)}) {
          sets.push_back(s);
        }
        std::vector<std::string> program = {"/proc/self/exe", "train", config_path};
        for (const std::string& s : sets) program.insert(program.end(), {"--set", s});
        std::cout << fmt::format("fsdp bench sweep: {} {} on {} rank(s) ({}x{})\n", model_name,
                                 strategy, world, layout->replicate, layout->shard);
        std::cout.flush();
        if (int code = LaunchRanks(world, program); code != 0) {
          std::cerr << "fsdp bench sweep: the run failed (exit code " << code << "); files in "
                    << dir << "\n";
          return 1;
        }
        absl::StatusOr<RunResult> run = ReadRun("fsdp.cpp", 0, dir, world);
        if (!run.ok()) {
          std::cerr << "fsdp bench sweep: " << run.status().message() << "\n";
          return 1;
        }
        const TrainingSection& t = config->training;
        const int64_t tokens_per_step =
            world * t.micro_batch_size * t.grad_accum_steps * config->model.seq_len;
        const double step_s = run->MedianAfter(o.warmup, &StepRecord::step_time_s);
        const double tokens_per_s = tokens_per_step / step_s;
        const int64_t steps_run = run->rank_stats[0].value("steps", int64_t{0});
        const double buffer_bytes = run->rank_stats[0].value("comm_bytes_total", 0.0) /
                                    static_cast<double>(std::max<int64_t>(steps_run, 1));
        const double wire = WireBytesPerStep(run->rank_stats[0], *layout, steps_run);
        const int bytes_per_element = BytesOf(t.mixed_precision);
        const double theory_wire = plan::TheoryWireBytesPerStep(
            counts.params, bytes_per_element, *parsed, layout->replicate, layout->shard,
            static_cast<int>(t.grad_accum_steps));
        const double theory_state =
            plan::ZeroModelStateBytes(counts.params, *parsed, layout->replicate, layout->shard);
        double predicted_step = std::nan(""), predicted_peak = std::nan("");
        absl::StatusOr<plan::PlanRequest> request =
            plan::MakePlanRequest(config_path, sets, world, world, "cpu", "");
        if (request.ok()) {
          request->hw = hw;
          if (absl::StatusOr<plan::Prediction> p = plan::Predict(*request, *layout); p.ok()) {
            predicted_step = p->time.step_s;
            predicted_peak = p->memory.total;
          }
        }
        const double peak = static_cast<double>(run->MaxOverRanks("peak_tensor_bytes"));
        const double state = static_cast<double>(run->MaxOverRanks("state_bytes"));
        const double engine_wire = EngineWireBytesPerStep(counts, *layout, t);
        const double wire_ratio = engine_wire > 0 ? wire / engine_wire : std::nan("");
        const double t_err = predicted_step / step_s - 1, m_err = predicted_peak / peak - 1;
        csv << fmt::format("{},{},{},{},{},{},{},{},{},{:.0f},{:.0f},{},{},{},{},{},{},{},{},{},{},{}\n",
                           CsvField(model_name), counts.params, strategy, world, layout->replicate,
                           layout->shard, Cell(tokens_per_s), Cell(tokens_per_s / world),
                           Cell(step_s), peak, state, run->MaxOverRanks("peak_rss_bytes"),
                           Cell(buffer_bytes, "{:.0f}"), Cell(wire, "{:.0f}"),
                           Cell(theory_state, "{:.0f}"), Cell(theory_wire, "{:.0f}"),
                           Cell(engine_wire, "{:.0f}"), Cell(wire_ratio), Cell(predicted_step), Cell(predicted_peak, "{:.0f}"),
                           Cell(t_err, "{:.4f}"), Cell(m_err, "{:.4f}"));
        csv.flush();
        std::cout << fmt::format(
            "{:<14} {:<14} {:>5} {:>12.0f} {:>12} {:>11} {:>11} {:>11} {:>9} {:>9} {:>9}\n",
            model_name, strategy, world, tokens_per_s / world, HumanBytes(peak), HumanBytes(state),
            HumanBytes(wire), HumanBytes(engine_wire), Cell(wire_ratio, "{:.4f}"),
            Cell(100 * t_err, "{:+.0f}%"), Cell(100 * m_err, "{:+.0f}%"));
        std::cout.flush();
      }
    }
  }
  csv.close();
  std::ofstream(out / "sweep.json")
      << nlohmann::json({{"machine", MachineDescription()}, {"date", Today()},
                         {"steps", o.steps}, {"warmup_steps", o.warmup},
                         {"hardware", nlohmann::json::parse(plan::HardwareToJson(hw), nullptr, false)}})
             .dump(1)
      << "\n";
  std::cout << "fsdp bench sweep: " << (out / "sweep.csv").string() << "\n";
  if (o.plot) Plot(python, "sweep", out.string());
  return 0;
}

}  // namespace fsdp::bench
