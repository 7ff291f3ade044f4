// `fsdp bench compare`: see bench/bench.h.
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "bench/bench.h"
#include "bench/runs.h"
#include "common/strings.h"
#include "engine/metrics.h"

namespace fsdp::bench {
namespace {

constexpr const char* kCpp = "fsdp.cpp";
constexpr const char* kFsdp2 = "fsdp2";

// What bench/fsdp2_reference.py reads (its --spec).
nlohmann::json ReferenceSpec(const RunConfig& c, int world, int steps, const std::string& init,
                             const std::string& batches) {
  const ModelSection& m = c.model;
  auto [replicate, shard] = c.parallelism.MeshDegrees(world);
  return {
      {"model",
       {{"arch", m.arch}, {"vocab_size", m.vocab_size}, {"dim", m.dim}, {"n_layers", m.n_layers},
        {"n_heads", m.n_heads}, {"seq_len", m.seq_len}, {"ffn_hidden", m.ffn_hidden},
        {"norm", m.norm}, {"activation", m.activation}, {"positions", m.positions},
        {"tie_embeddings", m.tie_embeddings}, {"norm_eps", m.norm_eps},
        {"rope_theta", m.rope_theta}}},
      {"training",
       {{"steps", steps}, {"micro_batch_size", c.training.micro_batch_size},
        {"grad_accum_steps", c.training.grad_accum_steps},
        {"max_grad_norm", c.training.max_grad_norm},
        {"mixed_precision", c.training.mixed_precision},
        {"reduce_dtype", c.training.reduce_dtype}}},
      {"optimizer",
       {{"name", c.optimizer.name}, {"lr", c.optimizer.lr},
        {"weight_decay", c.optimizer.weight_decay}, {"beta1", c.optimizer.beta1},
        {"beta2", c.optimizer.beta2}, {"eps", c.optimizer.eps},
        {"momentum", c.optimizer.momentum}}},
      {"lr_scheduler",
       {{"warmup_steps", c.lr_scheduler.warmup_steps}, {"decay", c.lr_scheduler.decay},
        {"min_lr", c.lr_scheduler.min_lr}}},
      {"parallelism",
       {{"strategy", c.parallelism.strategy}, {"replicate", replicate}, {"shard", shard}}},
      {"init", init},
      {"batches",
       {{"file", batches}, {"steps", steps}, {"grad_accum_steps", c.training.grad_accum_steps},
        {"world_size", world}, {"micro_batch_size", c.training.micro_batch_size},
        {"seq_len", m.seq_len}}},
  };
}

struct EngineSummary {
  double median_step_s = 0, tokens_per_s = 0, comm_wait_s = 0, comm_bytes = 0;
  int64_t peak_rss = 0;
};

EngineSummary Summarise(const std::vector<RunResult>& runs, const std::string& engine, int warmup,
                        int64_t tokens_per_step) {
  std::vector<double> times, waits, bytes;
  EngineSummary s;
  for (const RunResult& run : runs) {
    if (run.engine != engine) continue;
    for (const StepRecord& step : run.steps) {
      if (step.step <= warmup) continue;
      times.push_back(step.step_time_s);
      waits.push_back(step.comm_wait_s);
      bytes.push_back(step.comm_bytes);
    }
    s.peak_rss = std::max(s.peak_rss, run.MaxOverRanks("peak_rss_bytes"));
  }
  s.median_step_s = Median(times);
  s.tokens_per_s = tokens_per_step / s.median_step_s;
  s.comm_wait_s = Median(waits);
  s.comm_bytes = Median(bytes);
  return s;
}

// JSON has no NaN: write null for a missing figure.
nlohmann::json Number(double v) { return std::isfinite(v) ? nlohmann::json(v) : nlohmann::json(); }

}  // namespace

int RunCompare(const CompareOptions& o) {
  // --- configuration -------------------------------------------------------------------------
  std::vector<std::string> sets = o.overrides;
  sets.push_back(StrCat("training.steps=", o.steps));
  absl::StatusOr<RunConfig> config = LoadRunConfig(o.config_path, sets);
  if (!config.ok()) {
    std::cerr << "fsdp bench compare: " << config.status().message() << "\n";
    return 2;
  }
  if (config->training.device == "cuda") {
    std::cerr << "fsdp bench compare: training.device=cuda: the FSDP2 reference "
                 "(bench/fsdp2_reference.py) runs on CPU with Gloo only; set training.device=cpu\n";
    return 2;
  }
  int nproc = o.nproc > 0 ? o.nproc
                          : (config->parallelism.nproc > 0 ? static_cast<int>(config->parallelism.nproc) : 2);
  if (absl::Status fits = config->ValidateForWorld(nproc); !fits.ok()) {
    std::cerr << "fsdp bench compare: " << fits.message() << " (--nproc " << nproc << ")\n";
    return 2;
  }
  if (o.warmup >= o.steps) {
    std::cerr << "fsdp bench compare: --warmup " << o.warmup << " leaves no measured step of --steps "
              << o.steps << "\n";
    return 2;
  }
  namespace fs = std::filesystem;
  fs::path out = o.out.empty() ? fs::path("runs/bench_compare") / StrCat(config->run.name, "-", nproc, "r")
                               : fs::path(o.out);
  std::error_code ec;
  fs::create_directories(out, ec);
  if (ec) {
    std::cerr << "fsdp bench compare: --out " << out << ": " << ec.message() << "\n";
    return 2;
  }
  out = fs::absolute(out);
  std::string python = PythonPath(o.python);
  if (absl::Status ready = EnsurePythonPackages(python); !ready.ok()) {
    std::cerr << "fsdp bench compare: " << ready.message() << "\n";
    return 2;
  }

  // --- shared inputs: weights and batches ------------------------------------------------------
  const std::string init = (out / "init.safetensors").string();
  const std::string batches = (out / "batches.bin").string();
  std::cout << "fsdp bench compare: writing the initial weights and " << o.steps
            << " steps of batches to " << out.string() << "\n";
  for (absl::Status s : {WriteInitialWeights(*config, init), WriteBatches(*config, nproc, o.steps, batches)}) {
    if (!s.ok()) {
      std::cerr << "fsdp bench compare: " << s.message() << "\n";
      return 1;
    }
  }
  const std::string spec = (out / "fsdp2_spec.json").string();
  std::ofstream(spec) << ReferenceSpec(*config, nproc, o.steps, init, batches).dump(1) << "\n";

  // --- alternating runs ------------------------------------------------------------------------
  std::vector<RunResult> runs;
  for (int rep = 0; rep < o.repeats; ++rep) {
    for (const char* engine : {kCpp, kFsdp2}) {
      std::string dir = (out / StrCat(engine == kCpp ? "fsdp_cpp_" : "fsdp2_", rep)).string();
      fs::remove_all(dir, ec);
      std::vector<std::string> program;
      if (engine == kCpp) {
        program = {"/proc/self/exe", "train", o.config_path};
        std::vector<std::string> run_sets = sets;
        for (std::string s : {StrCat("run.dir=", dir), StrCat("model.init_from=", init),
                              std::string("training.log_interval=1"),
                              std::string("training.eval_interval=0"),
                              std::string("checkpoint.enabled=false"),
                              std::string("metrics.progress_bar=off"),
                              StrCat("parallelism.nproc=", nproc)}) {
          run_sets.push_back(s);
        }
        for (const std::string& s : run_sets) program.insert(program.end(), {"--set", s});
      } else {
        program = {python, ScriptPath("fsdp2_reference.py"), "--spec", spec, "--out", dir};
      }
      std::cout << fmt::format("fsdp bench compare: run {}/{}: {} on {} rank(s)\n",
                               rep * 2 + (engine == kCpp ? 1 : 2), o.repeats * 2, engine, nproc);
      std::cout.flush();
      auto start = std::chrono::steady_clock::now();
      int code = LaunchRanks(nproc, program);
      if (code != 0) {
        std::cerr << "fsdp bench compare: the " << engine << " run failed (exit code " << code
                  << "); its output is above, its files in " << dir << "\n";
        return 1;
      }
      absl::StatusOr<RunResult> run = ReadRun(engine, rep, dir, nproc);
      if (!run.ok()) {
        std::cerr << "fsdp bench compare: " << run.status().message() << "\n";
        return 1;
      }
      run->wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      runs.push_back(std::move(*run));
    }
  }

  // --- report ----------------------------------------------------------------------------------
  const int64_t tokens_per_step = static_cast<int64_t>(nproc) * config->training.micro_batch_size *
                                  config->training.grad_accum_steps * config->model.seq_len;
  EngineSummary cpp = Summarise(runs, kCpp, o.warmup, tokens_per_step);
  EngineSummary ref = Summarise(runs, kFsdp2, o.warmup, tokens_per_step);
  // Loss agreement: every fsdp.cpp run against every FSDP2 run, step by step.
  double max_abs = 0, max_rel = 0;
  int64_t worst_step = 0;
  for (const RunResult& a : runs) {
    for (const RunResult& b : runs) {
      if (a.engine != kCpp || b.engine != kFsdp2) continue;
      for (size_t i = 0; i < std::min(a.steps.size(), b.steps.size()); ++i) {
        double diff = std::abs(a.steps[i].loss - b.steps[i].loss);
        if (!(diff <= max_abs)) {
          max_abs = diff;
          worst_step = a.steps[i].step;
        }
        max_rel = std::max(max_rel, diff / std::max(std::abs(b.steps[i].loss), 1e-30));
      }
    }
  }
  const double time_ratio = cpp.median_step_s / ref.median_step_s;
  const double memory_ratio = static_cast<double>(cpp.peak_rss) / static_cast<double>(ref.peak_rss);

  nlohmann::json report = {
      {"config", o.config_path},
      {"overrides", o.overrides},
      {"model", config->model.arch},
      {"world_size", nproc},
      {"strategy", config->parallelism.strategy},
      {"mixed_precision", config->training.mixed_precision},
      {"steps", o.steps},
      {"warmup_steps", o.warmup},
      {"repeats", o.repeats},
      {"tokens_per_step", tokens_per_step},
      {"machine", MachineDescription()},
      {"date", Today()},
      {"max_loss_abs_diff", Number(max_abs)},
      {"max_loss_rel_diff", Number(max_rel)},
      {"max_loss_diff_step", worst_step},
      {"ratios", {{"step_time", Number(time_ratio)}, {"memory", Number(memory_ratio)}}},
  };
  for (const auto& [name, s] : {std::pair{kCpp, cpp}, std::pair{kFsdp2, ref}}) {
    std::string prefix = name == kCpp ? "fsdp_cpp_" : "fsdp2_";
    report["engines"][name] = {{"metrics", prefix + "0/metrics.jsonl"},
                               {"median_step_s", Number(s.median_step_s)},
                               {"tokens_per_s", Number(s.tokens_per_s)},
                               {"peak_rss_bytes", s.peak_rss},
                               {"comm_wait_s", Number(s.comm_wait_s)},
                               {"comm_bytes_per_step", Number(s.comm_bytes)}};
  }
  std::ofstream csv(out / "compare.csv");
  csv << "engine,repeat,step,loss,step_time_s,comm_wait_s,comm_bytes\n";
  for (const RunResult& run : runs) {
    report["runs"].push_back({{"engine", run.engine}, {"repeat", run.repeat},
                              {"metrics", fs::relative(run.dir, out).string() + "/metrics.jsonl"},
                              {"wall_s", run.wall_s},
                              {"peak_rss_bytes", run.MaxOverRanks("peak_rss_bytes")}});
    for (const StepRecord& s : run.steps) {
      csv << fmt::format("{},{},{},{:.9g},{:.6g},{:.6g},{:.0f}\n", run.engine, run.repeat, s.step,
                         s.loss, s.step_time_s, s.comm_wait_s, s.comm_bytes);
    }
  }
  csv.close();
  std::ofstream(out / "compare.json") << report.dump(1) << "\n";

  std::cout << fmt::format(
      "\nfsdp bench compare: {} ({}), {} rank(s), {}, {}, {} tokens/step, {} steps ({} warm-up) x "
      "{} run(s) per engine\n{}, {}\n",
      o.config_path, config->model.arch, nproc, config->parallelism.strategy,
      config->training.mixed_precision, tokens_per_step, o.steps, o.warmup, o.repeats,
      MachineDescription(), Today());
  std::cout << fmt::format("  {:<10} {:>12} {:>12} {:>16} {:>14} {:>16}\n", "engine",
                           "median step", "tokens/s", "peak RSS/rank", "comm wait", "comm bytes");
  for (const auto& [name, s] : {std::pair{kCpp, cpp}, std::pair{kFsdp2, ref}}) {
    std::cout << fmt::format("  {:<10} {:>10.1f}ms {:>12.0f} {:>16} {:>12.1f}ms {:>16}\n", name,
                             s.median_step_s * 1e3, s.tokens_per_s,
                             HumanBytes(static_cast<double>(s.peak_rss)), s.comm_wait_s * 1e3,
                             HumanBytes(s.comm_bytes));
  }
  std::cout << fmt::format(
      "  fsdp.cpp / FSDP2: step time {:.3f}x, peak RSS {:.3f}x; largest loss difference {:.3g} "
      "(relative {:.3g}, step {})\n  results: {}/compare.json, compare.csv, compare.png\n",
      time_ratio, memory_ratio, max_abs, max_rel, worst_step, out.string());
  std::cout.flush();
  if (o.plot) Plot(python, "compare", out.string());
  return 0;
}

}  // namespace fsdp::bench
