// `fsdp bench kernels`: each fused kernel (kernels/) against its composite ATen reference at a
// model's shapes, forward + backward, on one device. See RunKernels in bench/bench.h.
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
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
  // The DRAM bytes the fused kernels must move, forward + backward, from the shapes: each
  // input read once, each output written once (the weight and per-row statistics left out);
  // 0 where the case is not bandwidth-bound (the LM head's matmuls).
  double fused_bytes = 0;
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

bool HasRopeCase(const ModelArgs& m) { return m.positions == Positions::kRope && m.arch != "mlp"; }

// About the bytes Cases() and the largest composite's forward + backward need per token: every
// case's inputs exist together, then one case at a time runs; the LM head's composite holds
// the logits (compute dtype), their fp32 log-softmax and the gradients of both.
double BytesPerToken(const ModelArgs& m, at::ScalarType dtype) {
  const double es = at::elementSize(dtype);
  const double dim = m.dim, ffn = m.ffn(), heads = (m.n_heads + m.kv_heads()) * m.head_dim();
  double inputs = dim * es + 8;  // the LM head's hidden states and targets
  if (m.norm == NormKind::kRmsNorm) inputs += 2 * dim * es;
  if (HasRopeCase(m)) inputs += heads * es;
  if (m.activation == Activation::kSwiglu) inputs += 2 * ffn * es;
  const double peak = std::max(
      {static_cast<double>(m.vocab_size) * (2 * es + 8), 6 * dim * 4, 6 * ffn * 4, 4 * heads * 4});
  return inputs + peak;
}


std::vector<KernelCase> Cases(const ModelArgs& m, int64_t tokens, at::ScalarType dtype,
                              c10::Device device) {
  auto opts = at::TensorOptions().dtype(dtype).device(device);
  const std::string dt = DtypeName(dtype);
  const double es = at::elementSize(dtype);
  const double eps = m.norm_eps;
  std::vector<KernelCase> cases;
  if (m.norm == NormKind::kRmsNorm) {
    at::Tensor x = at::randn({tokens, m.dim}, opts), r = at::randn({tokens, m.dim}, opts);
    at::Tensor w = at::ones({m.dim}, opts);
    cases.push_back(
        {"rms_norm", fmt::format("{} x {} {}", tokens, m.dim, dt),
         FwdBwd({x, w}, [eps](const auto& v) { return Outputs{kernels::RmsNormComposite(v[0], v[1], eps)}; }),
         FwdBwd({x, w}, [eps](const auto& v) { return Outputs{kernels::RmsNorm(v[0], v[1], eps)}; }),
         // forward x -> y, backward x, dy -> dx
         5.0 * tokens * m.dim * es});
    cases.push_back(
        {"add_rms_norm", fmt::format("{} x {} {}", tokens, m.dim, dt),
         FwdBwd({x, r, w}, [eps](const auto& v) {
           auto [h, y] = kernels::AddRmsNormComposite(v[0], v[1], v[2], eps);
           return Outputs{h, y};
         }),
         FwdBwd({x, r, w}, [eps](const auto& v) {
           auto [h, y] = kernels::AddRmsNorm(v[0], v[1], v[2], eps);
           return Outputs{h, y};
         }),
         // forward x, residual -> h, y; backward h, dy, dh -> dx (also the residual's)
         8.0 * tokens * m.dim * es});
  }
  if (HasRopeCase(m)) {
    const int64_t seq = m.seq_len, batch = tokens / seq;  // a multiple: see RunKernels
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
         }),
         // q and k read and written, forward and backward (the tables stay in L2)
         4.0 * batch * seq * (m.n_heads + m.kv_heads()) * hd * es});
  }
  if (m.activation == Activation::kSwiglu) {
    at::Tensor gate = at::randn({tokens, m.ffn()}, opts), up = at::randn({tokens, m.ffn()}, opts);
    cases.push_back({"swiglu", fmt::format("{} x {} {}", tokens, m.ffn(), dt),
                     FwdBwd({gate, up}, [](const auto& v) { return Outputs{kernels::SwiGluComposite(v[0], v[1])}; }),
                     FwdBwd({gate, up}, [](const auto& v) { return Outputs{kernels::SwiGlu(v[0], v[1])}; }),
                     // forward gate, up -> out; backward gate, up, dout -> dgate, dup
                     8.0 * tokens * m.ffn() * es});
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
  if (!options.out.empty()) {
    if (std::string bad = CheckOutPath(options.out); !bad.empty()) {
      std::cerr << "fsdp bench kernels: --out " << options.out << " " << bad << "\n";
      return 2;
    }
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
  // RoPE is timed on whole sequences ([tokens / seq_len, seq_len] positions): other counts
  // would time another number of tokens than the header says.
  if (HasRopeCase(m) && tokens % m.seq_len != 0) {
    std::cerr << "fsdp bench kernels: --tokens " << tokens
              << " is not a multiple of model.seq_len (" << m.seq_len
              << "): the RoPE case runs whole sequences; give --tokens " << m.seq_len << ", "
              << 2 * m.seq_len << ", ... (or --set model.seq_len=N)\n";
    return 2;
  }
  // On a CPU the inputs and the composite LM head must fit in the machine's memory (a GPU
  // that runs out says so itself: caught below).
  const double per_token = BytesPerToken(m, dtype);
  const double memory = HostMemoryBytes();
  if (device.is_cpu() && memory > 0 && tokens * per_token > memory) {
    std::cerr << "fsdp bench kernels: --tokens " << tokens << " needs about "
              << GiB(tokens * per_token) << " (" << fmt::format("{:.0f}", per_token)
              << " bytes per token: the inputs and the composite LM head's logits) but this "
              << "machine has " << GiB(memory) << "; give --tokens "
              << static_cast<int64_t>(memory / per_token) << " or fewer\n";
    return 2;
  }
  at::manual_seed(0);
  std::vector<KernelCase> cases;
  try {
    cases = Cases(m, tokens, dtype, device);
  } catch (const c10::Error& e) {
    std::cerr << "fsdp bench kernels: --tokens " << tokens
              << ": cannot create the inputs: " << e.msg().substr(0, e.msg().find('\n')) << "\n";
    return 1;
  }
  std::cout << fmt::format(
      "fsdp bench kernels: {} ({}), {} tokens, {} on {}; forward + backward, median of {} after "
      "{} warm-up; MiB: the allocator's peak beyond the inputs (CUDA); fused GB/s: the bytes the "
      "fused kernels must move (each input read and each output written once, forward + "
      "backward, from the shapes) / fused ms, a lower bound on their bandwidth (the time also "
      "holds autograd and the upstream gradients' fill)\n",
      config->run.name, m.arch, tokens, DtypeName(dtype), device.str(), options.repeats,
      options.warmup);
  std::cout << fmt::format("{:<24} {:<40} {:>13} {:>9} {:>7} {:>15} {:>11} {:>11} {:>11}\n",
                           "kernel", "shape", "composite ms", "fused ms", "ratio",
                           "composite MiB", "fused MiB", "fused MB", "fused GB/s");
  nlohmann::json report = {{"config", options.config_path}, {"device", device.str()},
                           {"tokens", tokens}, {"dtype", DtypeName(dtype)},
                           {"kernels", nlohmann::json::array()}};
  for (const KernelCase& c : cases) {
    double composite = 0, fused = 0;
    int64_t composite_bytes = -1, fused_bytes = -1;
    try {
      composite = MedianMs(c.composite, device, options.warmup, options.repeats);
      fused = MedianMs(c.fused, device, options.warmup, options.repeats);
      composite_bytes = PeakExtraBytes(c.composite, device);
      fused_bytes = PeakExtraBytes(c.fused, device);
    } catch (const c10::Error& e) {
      std::cerr << "fsdp bench kernels: " << c.name << " at --tokens " << tokens << ": "
                << e.msg().substr(0, e.msg().find('\n')) << "\n";
      return 1;
    }
    auto mib = [](int64_t b) {
      return b < 0 ? std::string("n/a") : fmt::format("{:.1f}", b / 1048576.0);
    };
    // GB/s = bytes / (ms * 1e6).
    const double gbps = c.fused_bytes > 0 && fused > 0 ? c.fused_bytes / (fused * 1e6) : 0;
    auto or_na = [](double v, const char* spec) {
      return v > 0 ? fmt::format(fmt::runtime(spec), v) : std::string("n/a");
    };
    std::cout << fmt::format("{:<24} {:<40} {:>13.3f} {:>9.3f} {:>6.2f}x {:>15} {:>11} {:>11} "
                             "{:>11}\n",
                             c.name, c.shape, composite, fused, fused / composite,
                             mib(composite_bytes), mib(fused_bytes),
                             or_na(c.fused_bytes / 1e6, "{:.1f}"), or_na(gbps, "{:.0f}"));
    report["kernels"].push_back({{"name", c.name}, {"shape", c.shape},
                                 {"composite_ms", composite}, {"fused_ms", fused},
                                 {"ratio", fused / composite},
                                 {"composite_peak_bytes", composite_bytes},
                                 {"fused_peak_bytes", fused_bytes},
                                 {"fused_moved_bytes", c.fused_bytes},
                                 {"fused_gbps", gbps}});
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
