// `fsdp bench kernels`: each fused kernel (kernels/) against its composite ATen reference at a
// model's shapes, forward + backward, on one device. See RunKernels in bench/bench.h.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <iostream>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <torch/cuda.h>

#include "bench/bench.h"
#include "engine/config.h"
#include "kernels/swiglu.h"

namespace fsdp::bench {
namespace {

// One kernel's two implementations, each a callable that runs forward and backward once.
struct KernelCase {
  std::string name;
  std::string shape;  // for the table, e.g. "4096 x 2 x 5632 bf16"
  std::function<void()> composite;
  std::function<void()> fused;
};

void Synchronize(c10::Device device) {
  if (device.is_cuda()) torch::cuda::synchronize(device.index());
}

// Median milliseconds of `repeats` calls after `warmup` calls, synchronising around each call.
double MedianMs(const std::function<void()>& fn, c10::Device device, int warmup, int repeats) {
  for (int i = 0; i < warmup; ++i) fn();
  std::vector<double> ms;
  for (int i = 0; i < repeats; ++i) {
    Synchronize(device);
    auto start = std::chrono::steady_clock::now();
    fn();
    Synchronize(device);
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
                     .count());
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

// Forward + backward of `f` on fresh leaves cloned from `inputs`, with a random upstream grad.
std::function<void()> FwdBwd(std::vector<at::Tensor> inputs,
                             std::function<at::Tensor(const std::vector<at::Tensor>&)> f) {
  return [inputs = std::move(inputs), f = std::move(f)] {
    std::vector<at::Tensor> leaves;
    for (const at::Tensor& x : inputs) leaves.push_back(x.detach().requires_grad_(true));
    at::Tensor y = f(leaves);
    y.backward(at::ones_like(y));
  };
}

std::string DtypeName(at::ScalarType dtype) { return dtype == at::kBFloat16 ? "bf16" : "fp32"; }

std::vector<KernelCase> Cases(const ModelArgs& m, int64_t tokens, at::ScalarType dtype,
                              c10::Device device) {
  auto opts = at::TensorOptions().dtype(dtype).device(device);
  std::vector<KernelCase> cases;
  if (m.activation == Activation::kSwiglu) {
    at::Tensor gate_up = at::randn({tokens, 2 * m.ffn()}, opts);
    cases.push_back({"swiglu", fmt::format("{} x 2 x {} {}", tokens, m.ffn(), DtypeName(dtype)),
                     FwdBwd({gate_up}, [](const auto& x) { return kernels::SwiGluComposite(x[0]); }),
                     FwdBwd({gate_up}, [](const auto& x) { return kernels::SwiGlu(x[0]); })});
  }
  return cases;
}

}  // namespace

int RunKernels(const KernelsOptions& options) {
  absl::StatusOr<RunConfig> config = LoadRunConfig(options.config_path, options.overrides);
  if (!config.ok()) {
    std::cerr << "fsdp bench kernels: " << config.status().message() << "\n";
    return 2;
  }
  c10::Device device = c10::kCPU;
  if (options.device == "cuda" || (options.device == "auto" && torch::cuda::is_available())) {
    if (!torch::cuda::is_available()) {
      std::cerr << "fsdp bench kernels: --device cuda but no GPU is visible\n";
      return 2;
    }
    device = c10::Device(c10::kCUDA, 0);
  }
  const ModelArgs& m = config->model;
  at::ScalarType dtype = ScalarTypeOf(config->training.mixed_precision);
  int64_t tokens = options.tokens > 0 ? options.tokens
                                      : config->training.micro_batch_size * m.seq_len;
  at::manual_seed(0);
  std::vector<KernelCase> cases = Cases(m, tokens, dtype, device);
  std::cout << fmt::format(
      "fsdp bench kernels: {} ({}), {} tokens, {} on {}; forward + backward, median of {} after "
      "{} warm-up\n",
      config->run.name, m.arch, tokens, DtypeName(dtype), device.str(), options.repeats,
      options.warmup);
  std::cout << fmt::format("{:<22} {:<28} {:>14} {:>10} {:>8}\n", "kernel", "shape",
                           "composite ms", "fused ms", "ratio");
  nlohmann::json report = {{"config", options.config_path}, {"device", device.str()},
                           {"tokens", tokens}, {"dtype", DtypeName(dtype)},
                           {"kernels", nlohmann::json::array()}};
  for (const KernelCase& c : cases) {
    double composite = MedianMs(c.composite, device, options.warmup, options.repeats);
    double fused = MedianMs(c.fused, device, options.warmup, options.repeats);
    std::cout << fmt::format("{:<22} {:<28} {:>14.3f} {:>10.3f} {:>7.2f}x\n", c.name, c.shape,
                             composite, fused, fused / composite);
    report["kernels"].push_back({{"name", c.name}, {"shape", c.shape},
                                 {"composite_ms", composite}, {"fused_ms", fused},
                                 {"ratio", fused / composite}});
  }
  if (!options.out.empty()) {
    std::ofstream out(options.out);
    if (!(out << report.dump(2) << "\n").flush()) {
      std::cerr << "fsdp bench kernels: cannot write " << options.out << "\n";
      return 1;
    }
  }
  return 0;
}

}  // namespace fsdp::bench
