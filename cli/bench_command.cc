#include "cli/bench_command.h"

#include <cmath>

#include "cli/options.h"

namespace fsdp {

CLI::App* AddBenchCommand(CLI::App& app, BenchCommand& c) {
  CLI::App* bench = app.add_subcommand(
      "bench", "Benchmarks: fsdp.cpp against PyTorch (FSDP2, eager, torch.compile), sweeps over "
               "world sizes, the fused kernels against their composite references, offload's "
               "host passes");
  bench->require_subcommand(1);

  bench::CompareOptions& o = c.compare;
  c.compare_cmd = bench->add_subcommand(
      "compare",
      "Run CONFIG through fsdp.cpp and through each PyTorch reference mode of --reference "
      "(bench/fsdp2_reference.py) from the same weights and batches, alternating runs; report "
      "median step time, tokens/s, MFU, peak memory per rank (RSS on CPU, allocator peak on GPU), "
      "communication wait, fsdp.cpp's ratio to each mode and each mode's loss check, PASS or FAIL "
      "(compare.json, compare.csv, compare.png in --out). On one rank also the unwrapped model, "
      "fsdp.cpp's wrapper overhead against it and FSDP2's against eager.\n"
      "Example: fsdp bench compare configs/bench_125m.yaml --nproc 4 --steps 50\n"
      "         fsdp bench compare configs/llama_1b.yaml --nproc 1 --steps 30   (GPU)");
  c.compare_cmd->add_option("config", o.config_path, "YAML configuration file")->required();
  c.compare_cmd->add_option("--set", o.overrides, "Override a key: --set section.key=value");
  c.compare_cmd->add_option("--nproc", o.nproc,
                            "Ranks (default: parallelism.nproc, or 2 on CPU, 1 on GPU)")
      ->check(IntAtLeast(0));
  c.compare_cmd->add_option("--steps", o.steps, "Steps per run")->capture_default_str()
      ->check(IntAtLeast(1));
  c.compare_cmd->add_option("--warmup", o.warmup, "Steps left out of the medians")
      ->capture_default_str()->check(IntAtLeast(0));
  c.compare_cmd->add_option("--repeats", o.repeats, "Runs per engine, alternating")
      ->capture_default_str()->check(IntAtLeast(1));
  c.compare_cmd->add_option("--out", o.out, "Output folder (default runs/bench_compare/NAME-Nr)");
  c.compare_cmd->add_option("--python", o.python,
                            "Python with torch 2.11 (default $FSDP_PYTHON, or the build's venv)");
  c.compare_cmd->add_flag("!--no-plot", o.plot, "Do not draw compare.png");
  c.compare_cmd->add_flag_callback(
      "--unwrapped", [&o] { o.unwrapped = true; },
      "Also run the plain model without a wrapper (parallelism.strategy none; one rank only). "
      "Default: on with --nproc 1");
  c.compare_cmd->add_option(
      "--reference", o.references,
      "PyTorch reference modes, comma list: fsdp2 (FSDP2 as torchtitan runs it: fused AdamW, no "
      "host sync per step), eager and compile (the plain model, torch.compile for the latter; one "
      "rank only), fsdp2-parity (FSDP2 doing fsdp.cpp's arithmetic step for step: loss equality "
      "to 1e-5). Default: fsdp2, plus eager,compile with --nproc 1")
      ->delimiter(',');
  c.compare_cmd->add_flag_callback("--no-unwrapped", [&o] { o.unwrapped = false; },
                                   "Do not run the plain model");

  bench::KernelsOptions& k = c.kernels;
  c.kernels_cmd = bench->add_subcommand(
      "kernels",
      "Time each fused kernel (kernels/: RMSNorm, residual-add + RMSNorm, RoPE, SwiGLU, the "
      "chunked LM head + cross-entropy) against its composite ATen reference at CONFIG's shapes "
      "(micro_batch_size x seq_len tokens, training.mixed_precision), forward + backward, on one "
      "device; print median ms and the ratio (JSON with --out).\n"
      "Example: fsdp bench kernels configs/llama_1b.yaml   (GPU; on a CPU the CPU references)");
  c.kernels_cmd->add_option("config", k.config_path, "YAML configuration file")->required();
  c.kernels_cmd->add_option("--set", k.overrides, "Override a key: --set section.key=value");
  c.kernels_cmd->add_option("--device", k.device, "auto (cuda when visible), cpu or cuda")
      ->capture_default_str()->check(CLI::IsMember({"auto", "cpu", "cuda"}));
  c.kernels_cmd->add_option("--tokens", k.tokens,
                            "Tokens per call (default micro_batch_size x seq_len; with RoPE a "
                            "multiple of seq_len)")
      ->check(IntAtLeast<int64_t>(1));
  c.kernels_cmd->add_option("--warmup", k.warmup, "Calls left out")->capture_default_str()
      ->check(IntAtLeast(0));
  c.kernels_cmd->add_option("--repeats", k.repeats, "Timed calls")->capture_default_str()
      ->check(IntAtLeast(1));
  c.kernels_cmd->add_option("--out", k.out, "Write the table as JSON to this file");

  bench::HostOptions& h = c.host;
  c.host_cmd = bench->add_subcommand(
      "host",
      "Time CPU offload's host work on this machine (no GPU, no config): the AdamW step from a "
      "bf16 gradient with ATen's ops (whole tensor, 4M-element slices) and as fsdp.cpp's one "
      "loop, the same from an fp32 gradient (clipping's mul_, ATen's step in slices; one loop), "
      "the bf16 gradient's addition into fp32 with ATen's ops and as one loop; each with "
      "--busy threads spinning beside it; print median ms, GB/s, the loops' ratio to ATen's "
      "slices and each pass's time per byte against ATen's fused AdamW alone (the cost column: "
      "what fsdp plan counts), after checking they give ATen's values bit for bit (exit 1 if "
      "not).\n"
      "Example: fsdp bench host --elements 480e6   (llama_1b's parameters on one rank)");
  c.host_cmd
      ->add_option_function<double>(
          "--elements", [&h](double v) { h.elements = static_cast<int64_t>(v); },
          "Elements per pass, a whole number (480e6 is fine); default 67108864")
      ->check(CLI::Validator(
          [](std::string& text) -> std::string {
            double v = 0;
            if (!CLI::detail::lexical_cast(text, v) || v < 1 || v > 1e15 || v != std::floor(v)) {
              return "'" + text + "' is not a whole number of elements in 1..1e15";
            }
            return "";
          },
          "NUMBER"));
  c.host_cmd->add_option("--tensor-elements", h.tensor_elements,
                         "Call the loops on pieces of this many elements, as the engine calls "
                         "them once per parameter (0: one call)")
      ->capture_default_str()->check(IntAtLeast<int64_t>(0));
  c.host_cmd->add_option("--threads", h.threads,
                         "The loops' threads, comma list (FSDP_OFFLOAD_HOST_THREADS; 0: the "
                         "default, at::get_num_threads())")
      ->delimiter(',')->capture_default_str()->check(IntInRange(0, 1024));
  c.host_cmd->add_option("--busy", h.busy, "Spinning threads beside each pass, comma list")
      ->delimiter(',')->capture_default_str()->check(IntInRange(0, 256));
  c.host_cmd->add_option("--warmup", h.warmup, "Passes left out")->capture_default_str()
      ->check(IntAtLeast(0));
  c.host_cmd->add_option("--repeats", h.repeats, "Timed passes")->capture_default_str()
      ->check(IntAtLeast(1));
  c.host_cmd->add_option("--out", h.out, "Write the table as JSON to this file");

  bench::SweepOptions& s = c.sweep;
  c.sweep_cmd = bench->add_subcommand(
      "sweep",
      "Train each CONFIG (a model size; default: two built-in small GPTs) for a few steps at every "
      "world size and strategy; write sweep.csv (tokens/s per rank, peak and model-state memory, "
      "bytes on the wire per step, beside the ZeRO formulas and the cost model's prediction) and "
      "sweep_*.png in --out.\n"
      "Example: fsdp bench sweep --world-sizes 1,2,4,8 --out runs/sweep");
  c.sweep_cmd->add_option("configs", s.configs, "YAML configurations, one per model size");
  c.sweep_cmd->add_option("--set", s.overrides, "Override a key in every config");
  c.sweep_cmd->add_option("--world-sizes", s.world_sizes, "Ranks, e.g. 1,2,4,8")
      ->delimiter(',')->capture_default_str()->check(IntAtLeast(1));
  c.sweep_cmd->add_option("--strategies", s.strategies,
                          "full_shard, shard_grad_op, no_shard, hybrid_shard, hybrid_shard_zero2")
      ->delimiter(',')->capture_default_str()
      ->check(CLI::IsMember({"full_shard", "shard_grad_op", "no_shard", "hybrid_shard",
                             "hybrid_shard_zero2"}));
  c.sweep_cmd->add_option("--steps", s.steps, "Steps per run")->capture_default_str()
      ->check(IntAtLeast(1));
  c.sweep_cmd->add_option("--warmup", s.warmup, "Steps left out of the medians")
      ->capture_default_str()->check(IntAtLeast(0));
  c.sweep_cmd->add_option("--hardware", s.hardware,
                          "Cost-model profile for the predictions: calibrate (measure this machine), a name (cpu, h100, ...) or a "
                          "JSON file from `fsdp plan --calibrate --out F`")->capture_default_str();
  c.sweep_cmd->add_option("--out", s.out, "Output folder")->capture_default_str();
  c.sweep_cmd->add_option("--python", s.python, "Python for the plots");
  c.sweep_cmd->add_flag("!--no-plot", s.plot, "Do not draw the charts");
  return bench;
}

int RunBenchCommand(const BenchCommand& c) {
  if (c.compare_cmd->parsed()) return bench::RunCompare(c.compare);
  if (c.sweep_cmd->parsed()) return bench::RunSweep(c.sweep);
  if (c.kernels_cmd->parsed()) return bench::RunKernels(c.kernels);
  if (c.host_cmd->parsed()) return bench::RunHost(c.host);
  return 2;
}

}  // namespace fsdp
