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
#include <torch/csrc/autograd/autograd.h>
#include <torch/cuda.h>

#include "bench/bench.h"
#include "bench/runs.h"
#include "engine/config.h"
#include "kernels/cross_entropy.h"
#include "kernels/rms_norm.h"
#include "kernels/rope.h"
#include "kernels/swiglu.h"

#ifdef FSDP_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

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
  return Median(std::move(ms));  // bench/runs.h
}

// Forward + backward of `f` on fresh leaves cloned from `inputs`, with ones as the upstream
// gradient of every output.
using Outputs = std::vector<at::Tensor>;
std::function<void()> FwdBwd(std::vector<at::Tensor> inputs,
                             std::function<Outputs(const std::vector<at::Tensor>&)> f) {
  return [inputs = std::move(inputs), f = std::move(f)] {
    std::vector<at::Tensor> leaves;
    for (const at::Tensor& x : inputs) {
      leaves.push_back(x.detach().requires_grad_(x.is_floating_point()));
    }
    Outputs ys = f(leaves);
    Outputs grads;
    for (const at::Tensor& y : ys) grads.push_back(at::ones_like(y));
    torch::autograd::backward(ys, grads);
  };
}

// Peak bytes the allocator held during `fn` beyond what was allocated before (CUDA only; -1
// elsewhere).
int64_t PeakExtraBytes(const std::function<void()>& fn, c10::Device device) {
#ifdef FSDP_WITH_CUDA
  if (device.is_cuda()) {
    namespace alloc = c10::cuda::CUDACachingAllocator;
    torch::cuda::synchronize(device.index());
    alloc::resetPeakStats(device.index());
    const int64_t before = alloc::getDeviceStats(device.index()).allocated_bytes[0].current;
    fn();
    torch::cuda::synchronize(device.index());
    return alloc::getDeviceStats(device.index()).allocated_bytes[0].peak - before;
  }
#endif
  return -1;
}

std::string DtypeName(at::ScalarType dtype) { return dtype == at::kBFloat16 ? "bf16" : "fp32"; }

std::vector<KernelCase> Cases(const ModelArgs& m, int64_t tokens, at::ScalarType dtype,
                              c10::Device device) {
  auto opts = at::TensorOptions().dtype(dtype).device(device);
  const std::string dt = DtypeName(dtype);
  const double eps = m.norm_eps;
  std::vector<KernelCase> cases;
  if (m.norm == NormKind::kRmsNorm) {
    at::Tensor x = at::randn({tokens, m.dim}, opts), r = at::randn({tokens, m.dim}, opts);
    at::Tensor w = at::ones({m.dim}, opts);
    cases.push_back(
        {"rms_norm", fmt::format("{} x {} {}", tokens, m.dim, dt),
         FwdBwd({x, w}, [eps](const auto& v) { return Outputs{kernels::RmsNormComposite(v[0], v[1], eps)}; }),
         FwdBwd({x, w}, [eps](const auto& v) { return Outputs{kernels::RmsNorm(v[0], v[1], eps)}; })});
    cases.push_back(
        {"add_rms_norm", fmt::format("{} x {} {}", tokens, m.dim, dt),
         FwdBwd({x, r, w}, [eps](const auto& v) {
           auto [h, y] = kernels::AddRmsNormComposite(v[0], v[1], v[2], eps);
           return Outputs{h, y};
         }),
         FwdBwd({x, r, w}, [eps](const auto& v) {
           auto [h, y] = kernels::AddRmsNorm(v[0], v[1], v[2], eps);
           return Outputs{h, y};
         })});
  }
  if (m.positions == Positions::kRope && m.arch != "mlp") {
    const int64_t seq = m.seq_len, batch = std::max<int64_t>(1, tokens / seq);
    const int64_t hd = m.head_dim();
    at::Tensor q = at::randn({batch, seq, m.n_heads, hd}, opts);
    at::Tensor k = at::randn({batch, seq, m.kv_heads(), hd}, opts);
    at::Tensor angles = at::rand({seq, hd / 2}, opts.dtype(at::kFloat));
    at::Tensor cos = angles.cos(), sin = angles.sin();
    // Both sides start from a copy of q and k (the in-place kernel needs non-leaf tensors).
    cases.push_back(
        {"rope (q and k)", fmt::format("{} x {}+{} heads x {} {}", batch * seq, m.n_heads,
                                       m.kv_heads(), hd, dt),
         FwdBwd({q, k}, [cos, sin](const auto& v) {
           return Outputs{kernels::RopeComposite(v[0].clone(), cos, sin),
                          kernels::RopeComposite(v[1].clone(), cos, sin)};
         }),
         FwdBwd({q, k}, [cos, sin](const auto& v) {
           at::Tensor q2 = v[0].clone(), k2 = v[1].clone();
           kernels::RopeInPlace(q2, k2, cos, sin);
           return Outputs{q2, k2};
         })});
  }
  if (m.activation == Activation::kSwiglu) {
    at::Tensor gate = at::randn({tokens, m.ffn()}, opts), up = at::randn({tokens, m.ffn()}, opts);
    cases.push_back({"swiglu", fmt::format("{} x {} {}", tokens, m.ffn(), dt),
                     FwdBwd({gate, up}, [](const auto& v) { return Outputs{kernels::SwiGluComposite(v[0], v[1])}; }),
                     FwdBwd({gate, up}, [](const auto& v) { return Outputs{kernels::SwiGlu(v[0], v[1])}; })});
  }
  {
    at::Tensor h = at::randn({tokens, m.dim}, opts);
    at::Tensor w = at::randn({m.vocab_size, m.dim}, opts) * 0.02;
    at::Tensor targets = at::randint(m.vocab_size, {tokens}, opts.dtype(at::kLong));
    const int64_t chunk = m.loss_chunk_tokens > 0
                              ? m.loss_chunk_tokens
                              : kernels::DefaultChunkTokens(tokens, m.vocab_size, m.dim);
    cases.push_back(
        {"lm_head + cross_entropy", fmt::format("{} x {} x {} {}, chunk {}", tokens, m.dim,
                                                m.vocab_size, dt, chunk),
         FwdBwd({h, w, targets}, [](const auto& v) {
           return Outputs{kernels::LinearCrossEntropyComposite(v[0], v[1], v[2])};
         }),
         FwdBwd({h, w, targets}, [chunk](const auto& v) {
           return Outputs{kernels::LinearCrossEntropy(v[0], v[1], v[2], chunk)};
         })});
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
      "{} warm-up; MiB: the allocator's peak beyond the inputs (CUDA)\n",
      config->run.name, m.arch, tokens, DtypeName(dtype), device.str(), options.repeats,
      options.warmup);
  std::cout << fmt::format("{:<24} {:<40} {:>13} {:>9} {:>7} {:>15} {:>11}\n", "kernel",
                           "shape", "composite ms", "fused ms", "ratio", "composite MiB", "fused MiB");
  nlohmann::json report = {{"config", options.config_path}, {"device", device.str()},
                           {"tokens", tokens}, {"dtype", DtypeName(dtype)},
                           {"kernels", nlohmann::json::array()}};
  for (const KernelCase& c : cases) {
    double composite = MedianMs(c.composite, device, options.warmup, options.repeats);
    double fused = MedianMs(c.fused, device, options.warmup, options.repeats);
    int64_t composite_bytes = PeakExtraBytes(c.composite, device);
    int64_t fused_bytes = PeakExtraBytes(c.fused, device);
    auto mib = [](int64_t b) {
      return b < 0 ? std::string("n/a") : fmt::format("{:.1f}", b / 1048576.0);
    };
    std::cout << fmt::format("{:<24} {:<40} {:>13.3f} {:>9.3f} {:>6.2f}x {:>15} {:>11}\n",
                             c.name, c.shape, composite, fused, fused / composite,
                             mib(composite_bytes), mib(fused_bytes));
    report["kernels"].push_back({{"name", c.name}, {"shape", c.shape},
                                 {"composite_ms", composite}, {"fused_ms", fused},
                                 {"ratio", fused / composite},
                                 {"composite_peak_bytes", composite_bytes},
                                 {"fused_peak_bytes", fused_bytes}});
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
