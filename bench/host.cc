// `fsdp bench host`: offload's host work per step, fsdp.cpp's loops against ATen's ops, on this
// machine's CPU. See RunHost in bench/bench.h.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <fstream>
#include <functional>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "bench/bench.h"
#include "bench/runs.h"
#include "engine/host_adam.h"
#include "sharding/host_loops.h"

namespace fsdp::bench {
namespace {

// Offload's slice and chunk (kDefaultStepSlice in sharding/offload/host_step.h).
constexpr int64_t kSlice = int64_t{1} << 22;

// The AdamW hyper-parameters of configs/llama_1b.yaml's optimizer, at step 10.
constexpr double kLr = 3e-4, kBeta1 = 0.9, kBeta2 = 0.95, kEps = 1e-8, kWeightDecay = 0.1;
constexpr double kStep = 10;
constexpr float kClip = 0.5f;  // clipping's scale: the gradient is multiplied by it

// One parameter's host state with a bf16 gradient, as offload params with bf16 compute keeps
// it: the fp32 master and moments, the landed bf16 gradient, the fp32 .grad the ATen path
// converts into, the bf16 copy that is loaded next.
// `grad` is also the fp32 gradient of the fp32 rows (several shards, sums on the host).
struct State {
  at::Tensor param, exp_avg, exp_avg_sq, grad_bf16, grad, copy;
  explicit State(int64_t n) {
    at::manual_seed(0);
    param = at::randn({n});
    exp_avg = at::randn({n}) * 0.01;
    exp_avg_sq = at::rand({n}) * 1e-4;
    grad_bf16 = at::randn({n}).to(at::kBFloat16);
    grad = at::randn({n});
    copy = at::empty({n}, at::kBFloat16);
  }
  State Clone() const {
    State s(0);
    s.param = param.clone();
    s.exp_avg = exp_avg.clone();
    s.exp_avg_sq = exp_avg_sq.clone();
    s.grad_bf16 = grad_bf16.clone();
    s.grad = grad.clone();
    s.copy = copy.clone();
    return s;
  }
};

// ATen's ops on [begin, begin + len): the conversion, clipping's multiplication, the fused
// AdamW, the cast (offload's sliced step, StepInSlices with FSDP_OFFLOAD_HOST_PASS=off).
void AtenStep(State& s, int64_t begin, int64_t len) {
  at::Tensor g = s.grad.narrow(0, begin, len);
  at::Tensor p = s.param.narrow(0, begin, len);
  g.copy_(s.grad_bf16.narrow(0, begin, len));
  g.mul_(at::scalar_tensor(kClip));
  const at::Tensor step = at::full({}, kStep, at::kFloat);
  at::_fused_adamw_({p}, {g}, {s.exp_avg.narrow(0, begin, len)},
                    {s.exp_avg_sq.narrow(0, begin, len)}, {}, {step}, kLr, kBeta1, kBeta2,
                    kWeightDecay, kEps, false, false);
  s.copy.narrow(0, begin, len).copy_(p);
}

// An fp32 gradient's step with ATen's ops, as before Note [Deferred clipping multiplication]:
// clipping's multiplication of the whole .grad (the training thread's), then the fused AdamW
// and the cast a slice at a time (offload's sliced step).
void AtenStepWide(State& s) {
  const int64_t n = s.param.numel();
  s.grad.mul_(at::scalar_tensor(kClip));
  const at::Tensor step = at::full({}, kStep, at::kFloat);
  for (int64_t begin = 0; begin < n; begin += kSlice) {
    const int64_t len = std::min(kSlice, n - begin);
    at::Tensor p = s.param.narrow(0, begin, len);
    at::_fused_adamw_({p}, {s.grad.narrow(0, begin, len)}, {s.exp_avg.narrow(0, begin, len)},
                      {s.exp_avg_sq.narrow(0, begin, len)}, {}, {step}, kLr, kBeta1, kBeta2,
                      kWeightDecay, kEps, false, false);
    s.copy.narrow(0, begin, len).copy_(p);
  }
}

// ATen's fused AdamW alone on the whole tensor from the fp32 gradient: 28 bytes per element
// (reads the master, gradient and moments, writes three), the pass whose speed `fsdp plan`
// takes as the host's bandwidth (host_rank_bw, docs/cost_model.md); every row's cost is per
// byte against it.
void AtenAdamW(State& s) {
  const at::Tensor step = at::full({}, kStep, at::kFloat);
  at::_fused_adamw_({s.param}, {s.grad}, {s.exp_avg}, {s.exp_avg_sq}, {}, {step}, kLr, kBeta1,
                    kBeta2, kWeightDecay, kEps, false, false);
}

// The one loop on [begin, begin + len), as the engine calls it once per parameter: from the
// bf16 gradient, or (`wide`) the fp32 one, clipping's multiplication in it.
void OneLoopStep(State& s, int64_t begin, int64_t len, bool wide = false) {
  HostAdamHyper hyper{kLr, kBeta1, kBeta2, kEps, kWeightDecay, /*decoupled=*/true, kStep};
  HostAdamPass(hyper, kClip, len, s.param.data_ptr<float>() + begin,
               s.exp_avg.data_ptr<float>() + begin, s.exp_avg_sq.data_ptr<float>() + begin,
               (wide ? s.grad : s.grad_bf16).narrow(0, begin, len),
               static_cast<uint16_t*>(s.copy.data_ptr()) + begin);
}

void OneLoopAdd(const at::Tensor& sum, const at::Tensor& grad_bf16, int64_t begin, int64_t len) {
  HostAddConverted(sum.data_ptr<float>() + begin,
                   static_cast<const uint16_t*>(grad_bf16.const_data_ptr()) + begin,
                   HostNarrow::kBFloat16, len);
}

// fn(begin, len) over [0, n) in pieces of `piece` elements (0: one piece).
void InPieces(int64_t n, int64_t piece, const std::function<void(int64_t, int64_t)>& fn) {
  const int64_t step = piece > 0 ? piece : n;
  for (int64_t b = 0; b < n; b += step) fn(b, std::min(step, n - b));
}

struct Row {
  std::string name;
  double bytes_per_element;  // what one pass must move
  std::function<void()> fn;
  bool one_loop = false;
  int pass = 0;  // the pass timed: 0 the step from bf16, 1 from fp32, 2 the addition, 3 AdamW
  bool base = false;  // the engine's ATen path for the pass: the ratios' base
};

// Median milliseconds of `repeats` calls after `warmup`, each on a thread of its own (offload
// runs its host work on its adder thread, not the main one) while `busy` threads spin.
double MedianMs(const std::function<void()>& fn, int warmup, int repeats, int busy) {
  std::atomic<bool> stop{false};
  std::vector<std::thread> spinners;
  for (int i = 0; i < busy; ++i) {
    spinners.emplace_back([&] {
      while (!stop.load(std::memory_order_relaxed)) {
      }
    });
  }
  std::vector<double> ms;
  std::thread worker([&] {
    at::NoGradGuard no_grad;
    for (int i = 0; i < warmup + repeats; ++i) {
      const auto start = std::chrono::steady_clock::now();
      fn();
      const double t =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
              .count();
      if (i >= warmup) ms.push_back(t);
    }
  });
  worker.join();
  stop = true;
  for (std::thread& t : spinners) t.join();
  return Median(std::move(ms));  // bench/runs.h
}

}  // namespace

int RunHost(const HostOptions& options) {
  at::NoGradGuard no_grad;
  const int64_t n = options.elements;
  if (!options.out.empty()) {
    if (std::string bad = CheckOutPath(options.out); !bad.empty()) {
      std::cerr << "fsdp bench host: --out " << options.out << " " << bad << "\n";
      return 2;
    }
  }
  // The timed arrays (24 bytes per element, 28 while they are made) must fit in the machine's
  // memory beside the check's (~1 GiB).
  const double per_element = 28;
  const double memory = HostMemoryBytes();
  if (memory > 0 && n * per_element + (1 << 30) > memory) {
    std::cerr << "fsdp bench host: --elements " << n << " needs about "
              << GiB(n * per_element + (1 << 30)) << " of host memory but this machine has "
              << GiB(memory) << "; give --elements "
              << static_cast<int64_t>(std::max(0.0, memory - (1 << 30)) / per_element)
              << " or fewer\n";
    return 2;
  }
  const bool adam_loop = HostAdamPassAvailable();
  const bool add_loop = HostAddConvertedAvailable(HostNarrow::kBFloat16);
  std::cout << fmt::format(
      "fsdp bench host: {:.3g} elements (the master, moments, gradients, copy and sum: {:.2f} "
      "GiB), {} ATen threads ({} kernels), {} host-loop threads; median of {} after {} warm-up, "
      "each on a worker thread\n",
      static_cast<double>(n), n * 24.0 / (1 << 30), at::get_num_threads(), at::get_cpu_capability(),
      HostLoopThreads(), options.repeats, options.warmup);

  // The values first: each loop from the same start as ATen's ops, on up to 2^24 + 13 elements
  // (parts on every thread and a tail; the timed arrays stay the only large ones).
  const int64_t checked = std::min(n, (int64_t{1} << 24) + 13);
  bool adam_equal = false, add_equal = false;
  {
    const State start(checked);
    const at::Tensor sum = at::randn({checked});
    if (adam_loop) {
      auto same = [](const State& a, const State& b) {
        return at::equal(a.param, b.param) && at::equal(a.exp_avg, b.exp_avg) &&
               at::equal(a.exp_avg_sq, b.exp_avg_sq) && at::equal(a.copy, b.copy);
      };
      State aten = start.Clone(), loop = start.Clone();
      AtenStep(aten, 0, checked);
      OneLoopStep(loop, 0, checked);
      State aten_wide = start.Clone(), loop_wide = start.Clone();
      AtenStepWide(aten_wide);
      OneLoopStep(loop_wide, 0, checked, /*wide=*/true);
      adam_equal = same(aten, loop) && same(aten_wide, loop_wide);
    }
    if (add_loop) {
      at::Tensor aten = sum.clone(), loop = sum.clone();
      AddConvertedInChunks(aten, start.grad_bf16, at::empty({std::min(checked, kSlice)}));
      OneLoopAdd(loop, start.grad_bf16, 0, checked);
      add_equal = at::equal(aten, loop);
    }
  }
  State state(n);
  at::Tensor acc = at::randn({n});
  const at::Tensor scratch = at::empty({std::min(n, kSlice)});

  // Bytes a single pass must move per element: the step reads the master, moments and bf16
  // gradient and writes the three and the bf16 copy (28); the addition reads the bf16 gradient
  // and the fp32 sum and writes the sum (10).
  const int64_t piece = options.tensor_elements;
  const std::string loop_name = piece > 0 ? fmt::format(", per {} elements", piece) : "";
  // The step from an fp32 gradient reads 4 bytes of it where the bf16 one reads 2 (30).
  std::vector<Row> rows = {
      {"AdamW alone: ATen fused, whole tensor", 28, [&] { AtenAdamW(state); }, false, 3, true},
      {"step: ATen ops, whole tensor", 28, [&] { AtenStep(state, 0, n); }, false, 0},
      {"step: ATen ops, 4M slices", 28,
       [&] { InPieces(n, kSlice, [&](int64_t b, int64_t len) { AtenStep(state, b, len); }); },
       false, 0, true},
      {"step: one loop" + loop_name, 28,
       [&] { InPieces(n, piece, [&](int64_t b, int64_t len) { OneLoopStep(state, b, len); }); },
       true, 0},
      {"step fp32 grad: ATen mul_, 4M slices", 30, [&] { AtenStepWide(state); }, false, 1, true},
      {"step fp32 grad: one loop" + loop_name, 30,
       [&] {
         InPieces(n, piece, [&](int64_t b, int64_t len) { OneLoopStep(state, b, len, true); });
       },
       true, 1},
      {"add bf16: ATen ops, 4M chunks", 10,
       [&] { AddConvertedInChunks(acc, state.grad_bf16, scratch); }, false, 2, true},
      {"add bf16: one loop" + loop_name, 10,
       [&] {
         InPieces(n, piece,
                  [&](int64_t b, int64_t len) { OneLoopAdd(acc, state.grad_bf16, b, len); });
       },
       true, 2},
  };
  const int default_threads = HostLoopThreads();
  nlohmann::json report = {{"elements", n},
                           {"tensor_elements", piece},
                           {"aten_threads", at::get_num_threads()},
                           {"host_loop_threads", default_threads},
                           {"cpu_capability", at::get_cpu_capability()},
                           {"step_values_equal", adam_equal},
                           {"add_values_equal", add_equal},
                           {"checked_elements", checked},
                           {"rows", nlohmann::json::array()}};
  std::cout << fmt::format("{:<48} {:>5} {:>8} {:>10} {:>8} {:>14} {:>7}\n", "pass", "busy",
                           "threads", "ms", "GB/s", "vs ATen slices", "cost");
  for (int busy : options.busy) {
    double aten_slices[4] = {0, 0, 0, 0};  // per pass: the engine's ATen path, the ratio's base
    for (size_t t = 0; t < options.threads.size(); ++t) {
      const int threads = options.threads[t] > 0 ? options.threads[t] : default_threads;
      SetHostLoopThreads(threads);
      for (const Row& row : rows) {
        const bool add = row.pass == 2;
        if (!row.one_loop && t > 0) continue;  // ATen's threads do not change with --threads
        const int used = row.one_loop ? threads : at::get_num_threads();
        if (row.one_loop && !(add ? add_loop : adam_loop)) {
          std::cout << fmt::format("{:<48} {:>5} {:>8} {:>10}\n", row.name, busy, used,
                                   "not available here");
          continue;
        }
        const double ms = MedianMs(row.fn, options.warmup, options.repeats, busy);
        if (row.base) aten_slices[row.pass] = ms;
        const double base = aten_slices[row.pass];
        const std::string ratio = row.one_loop && base > 0 ? fmt::format("{:.3f}x", ms / base) : "";
        const double gbps = n * row.bytes_per_element / (ms * 1e6);
        // Time per byte against the fused AdamW's beside as many spinning threads: what `fsdp
        // plan` multiplies the pass's bytes by (kHostLoopCost, kHostCastCost in
        // planner/cost_model.cc).
        const double adamw_gbps = aten_slices[3] > 0 ? n * 28 / (aten_slices[3] * 1e6) : 0;
        const double cost = adamw_gbps > 0 ? adamw_gbps / gbps : 0;
        std::cout << fmt::format("{:<48} {:>5} {:>8} {:>10.2f} {:>8.1f} {:>14} {:>7.2f}\n",
                                 row.name, busy, used, ms, gbps, ratio, cost);
        report["rows"].push_back({{"pass", row.name},
                                  {"busy_threads", busy},
                                  {"threads", used},
                                  {"ms", ms},
                                  {"gbps", gbps},
                                  {"cost_vs_adamw", cost},
                                  {"bytes_per_element", row.bytes_per_element}});
      }
    }
  }
  SetHostLoopThreads(default_threads);
  std::cout << fmt::format(
      "values ({} elements): the one-loop step (from bf16 and from fp32 gradients) {} ATen's "
      "ops; the one-loop add {}\n",
      checked,
      !adam_loop   ? "not run"
      : adam_equal ? "equals bit for bit"
                   : "DIFFERS from",
      !add_loop   ? "not run"
      : add_equal ? "equals ATen's bit for bit"
                  : "DIFFERS from ATen's");
  if (!options.out.empty()) {
    std::ofstream out(options.out);
    if (!(out << report.dump(2) << "\n").flush()) {
      std::cerr << "fsdp bench host: cannot write " << options.out << "\n";
      return 1;
    }
  }
  return (adam_loop && !adam_equal) || (add_loop && !add_equal) ? 1 : 0;
}

}  // namespace fsdp::bench
