// `fsdp bench`: fsdp.cpp measured against PyTorch (FSDP2, eager, torch.compile), and against
// itself across world sizes, strategies and model sizes.
//
//   compare  one configuration through (a) fsdp.cpp and (b) each PyTorch reference mode of
//            --reference (bench/fsdp2_reference.py, same torch wheel; Note [Reference modes]
//            there): `fsdp2` (FSDP2 as torchtitan runs it: fused AdamW, no host sync per step),
//            `eager` and `compile` (the plain model, one rank only) and `fsdp2-parity` (FSDP2
//            doing fsdp.cpp's arithmetic: the same optimizer.implementation, the loss read every
//            step). Runs alternate, from the same initial weights (a safetensors file) and the
//            same token batches (a file all read), so their losses must agree: to fp32 rounding
//            for fsdp2-parity (1e-5 relative), looser for the others (LossTolerance); each
//            mode's check is reported PASS or FAIL, and a FAIL makes the command exit 1.
//            Reports, per engine, the median step time after warm-up, tokens/s, MFU, peak
//            memory per rank (RSS on CPU, the CUDA allocator's peak on GPU), time blocked in
//            collectives and fsdp.cpp's ratio to it, and per mode the largest loss difference;
//            writes compare.json / compare.csv / compare.png in the output folder. On one rank
//            (--unwrapped) also (c) the plain model without any wrapper (fsdp train with
//            parallelism.strategy none), fsdp.cpp's wrapper overhead against it, and FSDP2's
//            against eager.
//   kernels  the fused kernels (kernels/) against their composite references at a model's
//            shapes, on one device (KernelsOptions).
//   host     offload's host passes, fsdp.cpp's loops against ATen's ops (HostOptions).
//   sweep    world sizes x strategies x model configs through `fsdp train`, one CSV row each
//            (throughput, peak and model-state memory, bytes on the wire per step) beside the
//            textbook formulas and the cost model's prediction (planner/cost_model.h); writes
//            sweep.csv and three PNG charts.
//
// Both start their ranks through the project's launcher (launcher/launch.h), which gives every
// rank OMP_NUM_THREADS = cores / ranks, so the two engines run with the same threads. Only the
// plots need Python packages beyond torch: the commands install what is missing into the
// Python they use (see Note [Bench Python]).
//
//   fsdp bench compare configs/bench_125m.yaml --nproc 4 --steps 50
//   fsdp bench compare configs/llama_1b.yaml --nproc 1 --steps 30     # GPU: + eager, compile
//   fsdp bench compare configs/default.yaml --nproc 2 --reference fsdp2,fsdp2-parity
//   fsdp bench sweep --world-sizes 1,2,4,8 --out runs/sweep
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "engine/config.h"

namespace fsdp::bench {

struct CompareOptions {
  std::string config_path;
  std::vector<std::string> overrides;  // --set section.key=value
  int nproc = 0;         // 0: parallelism.nproc, or 2 on CPU
  int steps = 50;
  int warmup = 3;        // steps left out of the medians
  int repeats = 1;       // runs per engine, alternating fsdp.cpp, FSDP2, fsdp.cpp, ...
  std::string out;       // "": runs/bench_compare/<run.name>-<nproc>r
  std::string python;    // "": $FSDP_PYTHON, or the build's venv python
  bool plot = true;
  // Also run the plain model (fsdp train with parallelism.strategy none, engine/unwrapped.h) and
  // report fsdp.cpp's wrapper overhead against it; one rank only. Unset: on when --nproc is 1.
  std::optional<bool> unwrapped;
  // Reference modes (kReferenceModes), in the order run; empty: DefaultReferences(nproc).
  std::vector<std::string> references;
};

// Every --reference mode, in the order reports list them.
inline const std::vector<std::string> kReferenceModes = {"fsdp2", "eager", "compile",
                                                         "fsdp2-parity"};
// The fast modes: fsdp2, plus eager and compile on one rank.
std::vector<std::string> DefaultReferences(int nproc);
// Largest relative per-step loss difference from fsdp.cpp a mode may show: fsdp2-parity
// mirrors fsdp.cpp's arithmetic (fp32: 1e-5); the fast modes fuse and reorder it (fp32: 1e-4);
// bf16 compute: 2e-2 for every mode.
double LossTolerance(const std::string& mode, bool bf16);

struct SweepOptions {
  std::vector<std::string> configs;       // model sizes; empty: the two built-in ones
  std::vector<std::string> overrides;     // applied to every config
  std::vector<int> world_sizes = {1, 2, 4, 8};
  std::vector<std::string> strategies = {"full_shard", "shard_grad_op", "no_shard"};
  int steps = 8;
  int warmup = 3;
  // Cost-model profile: "calibrate" (measure this machine first), a name, or a JSON file.
  std::string hardware = "calibrate";
  std::string out = "runs/bench_sweep";
  std::string python;
  bool plot = true;
};

// `fsdp bench kernels`: each fused kernel of kernels/ against its composite ATen reference at
// CONFIG's shapes (micro-batch x seq_len tokens, the compute dtype of
// training.mixed_precision), forward + backward, median milliseconds and the ratio, one device.
// A microbenchmark of the pieces; `compare` measures the whole step.
struct KernelsOptions {
  std::string config_path;
  std::vector<std::string> overrides;
  std::string device = "auto";  // auto (cuda when visible) | cpu | cuda
  int64_t tokens = 0;           // 0: training.micro_batch_size x model.seq_len
  int warmup = 3;
  int repeats = 20;
  std::string out;              // "": no JSON file
};

// `fsdp bench host`: offload's host work on this machine's CPU (Note [Host loops] in
// sharding/host_loops.cc, Note [Host Adam pass] in engine/host_adam.cc): the AdamW step from a
// bf16 gradient (conversion, clipping, update, bf16 copy) with ATen's ops over the whole tensor,
// with them in offload's 4M-element slices and as fsdp.cpp's one loop; the bf16 gradient's
// addition into an fp32 sum with ATen's ops in 4M-element chunks and as one loop. Median ms,
// GB/s of the bytes one pass must move, the loops' ratio to ATen's slices, each pass's time per
// byte against ATen's fused AdamW alone on the whole tensor (`cost`: the factor `fsdp plan`
// counts host passes at, docs/cost_model.md), each with `busy`
// threads spinning beside it (a training thread's share of the cores), the loops with each
// count of `threads`; checks first that the loops give ATen's values bit for bit (exit 1 if
// not). No GPU, no config.
struct HostOptions {
  int64_t elements = 64 << 20;  // per pass (llama_1b 2 x 4 on one rank: 0.48e9)
  // The loops called on pieces of this many elements, as the engine calls them once per
  // parameter (0: one call over all).
  int64_t tensor_elements = 0;
  std::vector<int> busy = {0, 1};
  // The loops' threads (SetHostLoopThreads; 0: the default, at::get_num_threads()); ATen's
  // ops run once per --busy, on ATen's threads.
  std::vector<int> threads = {0};
  int warmup = 1;
  int repeats = 5;
  std::string out;  // "": no JSON file
};

int RunCompare(const CompareOptions& options);
int RunSweep(const SweepOptions& options);
int RunKernels(const KernelsOptions& options);
int RunHost(const HostOptions& options);

// --- shared inputs (bench/inputs.cc) -------------------------------------------------------

// The model's initial parameters (seeded from run.seed, as every run would create them) as a
// safetensors file with the state-dict names.
absl::Status WriteInitialWeights(const RunConfig& config, const std::string& path);

// The token batches `world_size` data-parallel ranks read in the first `steps` steps, from the
// trainer's own data loader: little-endian int32, laid out
// [steps][grad_accum][world_size][2 (inputs, targets)][micro_batch][seq_len].
absl::Status WriteBatches(const RunConfig& config, int world_size, int steps,
                          const std::string& path);

// The Python that runs the FSDP2 side and the plots: `requested`, else $FSDP_PYTHON, else the
// python of the venv this build was configured with.
std::string PythonPath(const std::string& requested);
// Makes sure `python` can import torch, safetensors, numpy and matplotlib, installing what is
// missing with pip; kFailedPrecondition naming the packages when it cannot.
absl::Status EnsurePythonPackages(const std::string& python);
// bench/<name> in the source tree this binary was built from.
std::string ScriptPath(const std::string& name);

}  // namespace fsdp::bench
