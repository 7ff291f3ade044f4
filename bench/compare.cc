// `fsdp bench compare`: see bench/bench.h.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "bench/bench.h"
#include "bench/runs.h"
#include "common/strings.h"
#include "common/user_input.h"
#include "device_mesh/cuda_support.h"
#include "engine/metrics.h"
#include "engine/trainer.h"

namespace fsdp::bench {
namespace {

constexpr const char* kCpp = "fsdp.cpp";
constexpr const char* kUnwrapped = "unwrapped";  // fsdp train, parallelism.strategy none
constexpr const char* kParity = "fsdp2-parity";

// fsdp_cpp_0, fsdp2_0, fsdp2_parity_0, eager_0, compile_0, unwrapped_0, ...
std::string RunFolder(const std::string& engine, int repeat) {
  std::string prefix = engine == kCpp ? "fsdp_cpp" : engine;
  std::replace(prefix.begin(), prefix.end(), '-', '_');
  return StrCat(prefix, "_", repeat);
}

bool IsFsdpTrain(const std::string& engine) { return engine == kCpp || engine == kUnwrapped; }

// What bench/fsdp2_reference.py reads (its --spec).
nlohmann::json ReferenceSpec(const RunConfig& c, int world, int steps, const std::string& init,
                             const std::string& batches) {
  const ModelSection& m = c.model;
  auto [replicate, shard] = c.parallelism.MeshDegrees(world);
  return {
      {"device", c.Value("training.device")},
      {"backend", c.Value("parallelism.backend")},
      {"model",
       {{"arch", m.arch}, {"vocab_size", m.vocab_size}, {"dim", m.dim}, {"n_layers", m.n_layers},
        {"n_heads", m.n_heads}, {"n_kv_heads", m.n_kv_heads}, {"seq_len", m.seq_len}, {"ffn_hidden", m.ffn_hidden},
        {"norm", c.Value("model.norm")}, {"activation", c.Value("model.activation")}, {"positions", c.Value("model.positions")},
        {"tie_embeddings", m.tie_embeddings}, {"norm_eps", m.norm_eps},
        {"rope_theta", m.rope_theta}}},
      {"training",
       {{"steps", steps}, {"micro_batch_size", c.training.micro_batch_size},
        {"grad_accum_steps", c.training.grad_accum_steps},
        {"max_grad_norm", c.training.max_grad_norm},
        {"mixed_precision", c.Value("training.mixed_precision")},
        {"reduce_dtype", c.Value("training.reduce_dtype")}}},
      {"optimizer",
       {{"name", c.Value("optimizer.name")}, {"lr", c.optimizer.lr},
        {"weight_decay", c.optimizer.weight_decay}, {"beta1", c.optimizer.beta1},
        {"beta2", c.optimizer.beta2}, {"eps", c.optimizer.eps},
        {"momentum", c.optimizer.momentum},
        {"implementation", c.Value("optimizer.implementation")}}},
      {"lr_scheduler",
       {{"warmup_steps", c.lr_scheduler.warmup_steps}, {"decay", c.Value("lr_scheduler.decay")},
        {"min_lr", c.lr_scheduler.min_lr}}},
      {"parallelism",
       {{"strategy", c.Value("parallelism.strategy")}, {"replicate", replicate}, {"shard", shard},
        {"reshard_between_micro_batches", c.parallelism.reshard_between_micro_batches},
        {"offload", c.Value("parallelism.offload")}}},
      {"init", init},
      {"batches",
       {{"file", batches}, {"steps", steps}, {"grad_accum_steps", c.training.grad_accum_steps},
        {"world_size", world}, {"micro_batch_size", c.training.micro_batch_size},
        {"seq_len", m.seq_len}}},
  };
}

struct EngineSummary {
  double median_step_s = 0, tokens_per_s = 0, comm_wait_s = 0, comm_bytes = 0;
  double mfu = std::nan("");
  int64_t peak_rss = 0;
  int64_t peak_memory = 0;  // what the memory ratio compares: RSS on CPU, allocator peak on GPU
};

// `memory_key`: the rank-statistics field of the peak memory compared ("peak_rss_bytes" on CPU,
// "peak_tensor_bytes": the CUDA allocator's peak, on GPU).
EngineSummary Summarise(const std::vector<RunResult>& runs, const std::string& engine, int warmup,
                        int64_t tokens_per_step, const std::string& memory_key) {
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
    s.peak_memory = std::max(s.peak_memory, run.MaxOverRanks(memory_key));
  }
  s.median_step_s = Median(times);
  s.tokens_per_s = tokens_per_step / s.median_step_s;
  s.comm_wait_s = Median(waits);
  s.comm_bytes = Median(bytes);
  return s;
}

// JSON has no NaN: write null for a missing figure.
nlohmann::json Number(double v) { return std::isfinite(v) ? nlohmann::json(v) : nlohmann::json(); }

struct LossDiff {
  double max_abs = 0, max_rel = 0;
  int64_t step = 0;
};

// Every run of engine `a` against every run of engine `b`, step by step.
LossDiff CompareLosses(const std::vector<RunResult>& runs, const std::string& a,
                       const std::string& b) {
  LossDiff d;
  for (const RunResult& x : runs) {
    for (const RunResult& y : runs) {
      if (x.engine != a || y.engine != b) continue;
      for (size_t i = 0; i < std::min(x.steps.size(), y.steps.size()); ++i) {
        double diff = std::abs(x.steps[i].loss - y.steps[i].loss);
        if (!(diff <= d.max_abs)) {
          d.max_abs = diff;
          d.step = x.steps[i].step;
        }
        d.max_rel = std::max(d.max_rel, diff / std::max(std::abs(y.steps[i].loss), 1e-30));
      }
    }
  }
  return d;
}

// A field of rank 0's statistics in the first run of `engine`; null if absent.
nlohmann::json RankZeroStat(const std::vector<RunResult>& runs, const char* engine,
                            const std::string& key) {
  for (const RunResult& run : runs) {
    if (run.engine == engine && !run.rank_stats.empty()) return run.rank_stats[0].value(key, nlohmann::json());
  }
  return nullptr;
}

double RankZeroNumber(const std::vector<RunResult>& runs, const char* engine, const std::string& key) {
  nlohmann::json v = RankZeroStat(runs, engine, key);
  return v.is_number() ? v.get<double>() : std::nan("");
}

}  // namespace

std::vector<std::string> DefaultReferences(int nproc) {
  if (nproc == 1) return {"fsdp2", "eager", "compile"};
  return {"fsdp2"};
}

double LossTolerance(const std::string& mode, bool bf16) {
  if (bf16) return 2e-2;
  return mode == kParity ? 1e-5 : 1e-4;
}

int RunCompare(const CompareOptions& o) {
  // --- configuration -------------------------------------------------------------------------
  std::vector<std::string> sets = o.overrides;
  sets.push_back(StrCat("training.steps=", o.steps));
  absl::StatusOr<RunConfig> config = LoadRunConfig(o.config_path, sets);
  if (!config.ok()) {
    std::cerr << "fsdp bench compare: " << config.status().message() << "\n";
    return 2;
  }
  // Both engines on the device fsdp train would pick (training.device auto: a GPU if any).
  if (config->training.device == DeviceKind::kAuto) {
    config->training.device = CudaDeviceCount() > 0 ? DeviceKind::kCuda : DeviceKind::kCpu;
  }
  // Before anything is written: a GPU config's inputs are gigabytes.
  if (absl::Status device = CheckDeviceAvailable(*config); !device.ok()) {
    std::cerr << "fsdp bench compare: " << device.message() << "\n";
    return 2;
  }
  sets.push_back(StrCat("training.device=", config->Value("training.device")));
  const bool on_cuda = config->training.device == DeviceKind::kCuda;
  int nproc = o.nproc > 0 ? o.nproc
                          : (config->parallelism.nproc > 0 ? static_cast<int>(config->parallelism.nproc)
                                                           : (on_cuda ? 1 : 2));
  if (config->parallelism.Unwrapped()) {
    std::cerr << "fsdp bench compare: parallelism.strategy none is the unwrapped baseline; give a "
                 "sharding strategy (the baseline is added with --unwrapped)\n";
    return 2;
  }
  // The FSDP2 reference (bench/fsdp2_reference.py) trains every parameter and reduces every
  // micro-batch: a run that does otherwise would be compared with a different computation.
  if (!config->model.freeze.empty() || config->training.grad_sync != GradSync::kEvery) {
    std::cerr << "fsdp bench compare: the FSDP2 reference implements neither model.freeze nor "
                 "training.grad_sync: last; compare with model.freeze: [] and "
                 "training.grad_sync: every\n";
    return 2;
  }
  // The plain model has no shards to offload: by default it is left out of an offload run.
  const bool offloads = config->parallelism.offload != Offload::kNone;
  const bool unwrapped = o.unwrapped.value_or(nproc == 1 && !offloads);
  if (unwrapped && offloads) {
    std::cerr << "fsdp bench compare: --unwrapped runs the plain model, which cannot offload "
                 "(parallelism.offload "
              << config->Value("parallelism.offload") << "); drop --unwrapped\n";
    return 2;
  }
  if (unwrapped && nproc != 1) {
    std::cerr << "fsdp bench compare: --unwrapped runs the plain model on one rank, so it needs "
                 "--nproc 1 (got "
              << nproc << ")\n";
    return 2;
  }
  std::vector<std::string> references;
  for (const std::string& mode : o.references.empty() ? DefaultReferences(nproc) : o.references) {
    if (std::find(kReferenceModes.begin(), kReferenceModes.end(), mode) == kReferenceModes.end()) {
      std::cerr << "fsdp bench compare: --reference '" << mode << "' is not a reference mode; valid: "
                << StrJoin(kReferenceModes, ", ") << "\n";
      return 2;
    }
    if ((mode == "eager" || mode == "compile") && nproc != 1) {
      std::cerr << "fsdp bench compare: --reference " << mode
                << " runs the plain PyTorch model on one rank, so it needs --nproc 1 (got " << nproc
                << "); valid with more ranks: fsdp2, fsdp2-parity\n";
      return 2;
    }
    if (std::find(references.begin(), references.end(), mode) == references.end()) {
      references.push_back(mode);
    }
  }
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
  // The default folder takes one file-name component of run.name: "/tmp/x" or "../x" would
  // put it, and the run folders removed below, outside runs/bench_compare.
  fs::path out = o.out.empty() ? fs::path("runs/bench_compare") /
                                     SafeFileName(StrCat(config->run.name, "-", nproc, "r"))
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
  std::vector<std::string> engines = {kCpp};
  engines.insert(engines.end(), references.begin(), references.end());
  if (unwrapped) engines.push_back(kUnwrapped);
  const int num_engines = static_cast<int>(engines.size());
  std::vector<RunResult> runs;
  for (int rep = 0; rep < o.repeats; ++rep) {
    for (int e = 0; e < num_engines; ++e) {
      const std::string& engine = engines[e];
      std::string dir = (out / RunFolder(engine, rep)).string();
      fs::remove_all(dir, ec);
      std::vector<std::string> program;
      if (IsFsdpTrain(engine)) {
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
        if (engine == kUnwrapped) run_sets.push_back("parallelism.strategy=none");
        for (const std::string& s : run_sets) program.insert(program.end(), {"--set", s});
      } else {
        program = {python, ScriptPath("fsdp2_reference.py"), "--spec", spec, "--out", dir,
                   "--mode", engine};
      }
      std::cout << fmt::format("fsdp bench compare: run {}/{}: {} on {} rank(s)\n",
                               rep * num_engines + e + 1, o.repeats * num_engines, engine, nproc);
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
  const std::string memory_key = on_cuda ? "peak_tensor_bytes" : "peak_rss_bytes";
  const std::string memory_label = on_cuda ? "peak alloc/rank" : "peak RSS/rank";
  // Model FLOPs and the device's peak, as fsdp.cpp's trainer counts them (Note [Rank
  // statistics]): the same work for every engine, so MFU follows the step time. Only on GPU,
  // whose peak comes from a table; a CPU's is a configured guess (metrics.cpu_peak_flops).
  const double flops_per_token = RankZeroNumber(runs, kCpp, "flops_per_token");
  const double peak_flops = on_cuda ? RankZeroNumber(runs, kCpp, "peak_flops_per_device") : std::nan("");
  std::map<std::string, EngineSummary> summary;
  for (const std::string& engine : engines) {
    EngineSummary s = Summarise(runs, engine, o.warmup, tokens_per_step, memory_key);
    s.mfu = flops_per_token * s.tokens_per_s / nproc / peak_flops;
    summary[engine] = s;
  }
  const double cpp_step_s = summary[kCpp].median_step_s;
  // fsdp.cpp against each reference mode: the ratios and the loss check.
  const bool bf16 = config->Value("training.mixed_precision") == "bf16";
  struct VsReference {
    double time_ratio, memory_ratio, rtol;
    LossDiff loss;
    bool pass;
  };
  std::map<std::string, VsReference> vs_reference;
  bool all_pass = true;
  for (const std::string& mode : references) {
    const EngineSummary& cpp = summary[kCpp];
    const EngineSummary& ref = summary[mode];
    VsReference v{cpp.median_step_s / ref.median_step_s,
                  static_cast<double>(cpp.peak_memory) / static_cast<double>(ref.peak_memory),
                  LossTolerance(mode, bf16), CompareLosses(runs, kCpp, mode), false};
    v.pass = v.loss.max_rel <= v.rtol;
    all_pass = all_pass && v.pass;
    vs_reference[mode] = v;
  }
  // The top-level loss difference and ratios (older reports' keys): against fsdp2-parity when it
  // ran, else against the first mode.
  const std::string primary =
      std::find(references.begin(), references.end(), kParity) != references.end() ? kParity
                                                                                     : references[0];
  const LossDiff loss = vs_reference[primary].loss;
  const double time_ratio = vs_reference[primary].time_ratio;
  const double memory_ratio = vs_reference[primary].memory_ratio;
  std::string machine = MachineDescription();
  if (nlohmann::json gpu = RankZeroStat(runs, kCpp, "device"); on_cuda && gpu.is_string()) {
    machine = StrCat(gpu.get<std::string>(), "; host ", machine);
  }

  nlohmann::json report = {
      {"config", o.config_path},
      {"overrides", o.overrides},
      {"model", config->model.arch},
      {"world_size", nproc},
      {"device", config->Value("training.device")},
      {"strategy", config->Value("parallelism.strategy")},
      {"mixed_precision", config->Value("training.mixed_precision")},
      {"steps", o.steps},
      {"warmup_steps", o.warmup},
      {"repeats", o.repeats},
      {"tokens_per_step", tokens_per_step},
      {"flops_per_token", Number(flops_per_token)},
      {"peak_flops_per_device", Number(peak_flops)},
      {"memory_kind", on_cuda ? "allocated (CUDA)" : "RSS"},
      {"machine", machine},
      {"date", Today()},
      {"max_loss_abs_diff", Number(loss.max_abs)},
      {"max_loss_rel_diff", Number(loss.max_rel)},
      {"max_loss_diff_step", loss.step},
      {"ratios", {{"step_time", Number(time_ratio)}, {"memory", Number(memory_ratio)}}},
      {"primary_reference", primary},
      {"loss_check", all_pass ? "PASS" : "FAIL"},
  };
  for (const std::string& mode : references) {
    const VsReference& v = vs_reference[mode];
    report["references"][mode] = {{"step_time_ratio", Number(v.time_ratio)},
                                  {"memory_ratio", Number(v.memory_ratio)},
                                  {"max_loss_abs_diff", Number(v.loss.max_abs)},
                                  {"max_loss_rel_diff", Number(v.loss.max_rel)},
                                  {"max_loss_diff_step", v.loss.step},
                                  {"loss_rtol", v.rtol},
                                  {"loss_check", v.pass ? "PASS" : "FAIL"}};
  }
  // Each wrapper against the plain model: the step time it adds (its overhead), its memory.
  struct VsUnwrapped {
    double overhead, memory_ratio;
    LossDiff loss;
  };
  std::map<std::string, VsUnwrapped> vs_unwrapped;
  if (unwrapped) {
    const EngineSummary& base = summary[kUnwrapped];
    for (const std::string& engine : engines) {
      if (engine == kUnwrapped) continue;
      const VsUnwrapped& v = vs_unwrapped[engine] = {
          summary[engine].median_step_s / base.median_step_s - 1,
          static_cast<double>(summary[engine].peak_memory) / static_cast<double>(base.peak_memory),
          CompareLosses(runs, engine, kUnwrapped)};
      report["vs_unwrapped"][engine] = {{"overhead", Number(v.overhead)},
                                        {"memory_ratio", Number(v.memory_ratio)},
                                        {"max_loss_abs_diff", Number(v.loss.max_abs)},
                                        {"max_loss_rel_diff", Number(v.loss.max_rel)}};
    }
  }
  // FSDP2 wraps eager PyTorch: its overhead, to set beside fsdp.cpp's over the unwrapped model.
  std::map<std::string, double> fsdp2_vs_eager;
  for (const char* fsdp2 : {"fsdp2", "fsdp2-parity"}) {
    if (!summary.count(fsdp2) || !summary.count("eager")) continue;
    const double overhead = summary[fsdp2].median_step_s / summary["eager"].median_step_s - 1;
    fsdp2_vs_eager[fsdp2] = overhead;
    report["vs_eager"][fsdp2] = {{"overhead", Number(overhead)}};
  }
  for (const std::string& engine : engines) {
    const EngineSummary& s = summary[engine];
    report["engines"][engine] = {{"metrics", RunFolder(engine, 0) + "/metrics.jsonl"},
                                 {"median_step_s", Number(s.median_step_s)},
                                 {"tokens_per_s", Number(s.tokens_per_s)},
                                 {"mfu", Number(s.mfu)},
                                 {"peak_rss_bytes", s.peak_rss},
                                 {"peak_memory_bytes", s.peak_memory},
                                 {"comm_wait_s", Number(s.comm_wait_s)},
                                 {"comm_bytes_per_step", Number(s.comm_bytes)}};
  }
  std::ofstream csv(out / "compare.csv");
  csv << "engine,repeat,step,loss,step_time_s,comm_wait_s,comm_bytes\n";
  for (const RunResult& run : runs) {
    report["runs"].push_back({{"engine", run.engine}, {"repeat", run.repeat},
                              {"metrics", fs::relative(run.dir, out).string() + "/metrics.jsonl"},
                              {"wall_s", run.wall_s},
                              {"peak_rss_bytes", run.MaxOverRanks("peak_rss_bytes")},
                              {"peak_memory_bytes", run.MaxOverRanks(memory_key)}});
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
      o.config_path, config->model.arch, nproc, config->Value("parallelism.strategy"),
      config->Value("training.mixed_precision"), tokens_per_step, o.steps, o.warmup, o.repeats, machine,
      Today());
  std::cout << fmt::format("  {:<13} {:>12} {:>12} {:>8} {:>16} {:>14} {:>16} {:>14}\n", "engine",
                           "median step", "tokens/s", on_cuda ? "MFU" : "", memory_label,
                           "comm wait", "comm bytes", "fsdp.cpp / it");
  for (const std::string& engine : engines) {
    const EngineSummary& s = summary[engine];
    std::cout << fmt::format(
        "  {:<13} {:>10.1f}ms {:>12.0f} {:>8} {:>16} {:>12.1f}ms {:>16} {:>14}\n", engine,
        s.median_step_s * 1e3, s.tokens_per_s,
        std::isfinite(s.mfu) ? fmt::format("{:.1f}%", 100 * s.mfu) : "",
        HumanBytes(static_cast<double>(s.peak_memory)), s.comm_wait_s * 1e3,
        HumanBytes(s.comm_bytes),
        engine == kCpp ? "" : fmt::format("{:.3f}x", cpp_step_s / s.median_step_s));
  }
  for (const std::string& mode : references) {
    const VsReference& v = vs_reference[mode];
    std::cout << fmt::format(
        "  fsdp.cpp / {}: step time {:.3f}x, {} {:.3f}x; largest loss difference {:.3g} "
        "(relative {:.3g}, step {}; tolerance {:.0e}): {}\n",
        mode, v.time_ratio, memory_label, v.memory_ratio, v.loss.max_abs, v.loss.max_rel,
        v.loss.step, v.rtol, v.pass ? "PASS" : "FAIL");
  }
  // Only fsdp.cpp wraps the unwrapped model: its difference is the wrapper's overhead. The
  // Python engines run another implementation of the model, so their difference is a framework
  // comparison; FSDP2's own overhead is measured against eager PyTorch, which it wraps.
  for (const auto& [engine, v] : vs_unwrapped) {
    std::cout << fmt::format(
        "  {} vs unwrapped: {} {:+.2f}% of the step, {} {:.3f}x; largest loss difference {:.3g} "
        "(relative {:.3g})\n",
        engine, engine == kCpp ? "wrapper overhead" : "step time (another implementation)",
        100 * v.overhead, memory_label, v.memory_ratio, v.loss.max_abs, v.loss.max_rel);
  }
  for (const auto& [fsdp2, overhead] : fsdp2_vs_eager) {
    std::cout << fmt::format("  {} vs eager: wrapper overhead {:+.2f}% of the step\n", fsdp2,
                             100 * overhead);
  }
  std::cout << fmt::format("  results: {}/compare.json, compare.csv{}\n", out.string(),
                           o.plot ? ", compare.png" : "");
  std::cout.flush();
  if (o.plot) Plot(python, "compare", out.string());
  if (!all_pass) {
    std::cerr << "fsdp bench compare: the losses of fsdp.cpp and a reference mode disagree beyond "
                 "its tolerance (FAIL above); the timings compare different computations\n";
    return 1;
  }
  return 0;
}

}  // namespace fsdp::bench
