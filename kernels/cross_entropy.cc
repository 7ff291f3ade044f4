#include "kernels/cross_entropy.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/custom_function.h>

#include "kernels/cuda/cross_entropy.h"
#include "kernels/dispatch.h"

namespace fsdp::kernels {
namespace {

constexpr const char* kName = "linear_cross_entropy";

void CheckArgs(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
               int64_t chunk_tokens) {
  TORCH_CHECK(hidden.dim() == 2 && weight.dim() == 2 && hidden.size(1) == weight.size(1), kName,
              ": hidden must be [N, D] and weight [V, D], got ", hidden.sizes(), " and ",
              weight.sizes());
  TORCH_CHECK(hidden.scalar_type() == weight.scalar_type(), kName, ": hidden is ",
              hidden.scalar_type(), ", weight is ", weight.scalar_type());
  ToKernelDType(hidden, kName);  // names the kernel for an unsupported dtype
  TORCH_CHECK(
      targets.dim() == 1 && targets.size(0) == hidden.size(0) && targets.scalar_type() == at::kLong,
      kName, ": targets must be [N = ", hidden.size(0), "] int64, got ", targets.sizes(), " ",
      targets.scalar_type());
  TORCH_CHECK(hidden.device() == weight.device() && targets.device() == hidden.device(), kName,
              ": hidden, weight and targets must be on one device");
  TORCH_CHECK(chunk_tokens > 0, kName, ": chunk_tokens must be positive, got ", chunk_tokens);
}

// On CPU the targets are checked before any work (on CUDA the kernel asserts: no host sync).
void CheckTargetsCpu(const at::Tensor& targets, int64_t vocab) {
  const int64_t* t = targets.const_data_ptr<int64_t>();
  for (int64_t row = 0; row < targets.numel(); ++row) {
    TORCH_CHECK(t[row] == kIgnoreIndex || (t[row] >= 0 && t[row] < vocab), kName, ": target ",
                t[row], " of row ", row, " is out of range for vocab size V = ", vocab,
                " (valid: 0..", vocab - 1, ", or ", kIgnoreIndex, " to ignore the row)");
  }
}

// CPU reference of kernels/cuda/cross_entropy.cu's kernel: rows in parallel, fp32 (the sum of
// exps in fp64), the same in-place gradient.
void SoftmaxCrossEntropyCpu(const at::Tensor& logits, const at::Tensor& targets,
                            const at::Tensor& losses, float grad_scale, bool write_grad) {
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), kName, [&] {
    scalar_t* data = logits.mutable_data_ptr<scalar_t>();
    const int64_t* target = targets.const_data_ptr<int64_t>();
    float* loss = losses.mutable_data_ptr<float>();
    auto row_range = [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        scalar_t* x = data + r * vocab;
        const int64_t t = target[r];
        if (t == kIgnoreIndex) {
          loss[r] = 0.0f;
          if (write_grad) std::fill(x, x + vocab, static_cast<scalar_t>(0.0f));
          continue;
        }
        float max = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < vocab; ++j) max = std::max(max, static_cast<float>(x[j]));
        double sum = 0.0;
        for (int64_t j = 0; j < vocab; ++j) sum += std::exp(static_cast<float>(x[j]) - max);
        const float lse = max + static_cast<float>(std::log(sum));
        loss[r] = lse - static_cast<float>(x[t]);
        if (!write_grad) continue;
        for (int64_t j = 0; j < vocab; ++j) {
          const float p = std::exp(static_cast<float>(x[j]) - lse);
          x[j] = static_cast<scalar_t>((p - (j == t ? 1.0f : 0.0f)) * grad_scale);
        }
      }
    };
    at::parallel_for(0, rows, std::max<int64_t>(1, 32768 / std::max<int64_t>(vocab, 1)), row_range);
  });
}

// The per-chunk kernel: losses of the chunk's rows; with grad_scale defined, logits become
// d loss / d logits in place.
void SoftmaxCrossEntropy(const at::Tensor& logits, const at::Tensor& targets,
                         const at::Tensor& losses, const at::Tensor& grad_scale) {
  const bool write_grad = grad_scale.defined();
  if (OnCuda(logits, kName)) {
#ifdef FSDP_WITH_CUDA  // else OnCuda has thrown: the launchers are not built
    c10::DeviceGuard guard(logits.device());  // the launch goes to the current device
    CheckLaunch(
        cuda::SoftmaxCrossEntropy(logits.mutable_data_ptr(), targets.const_data_ptr<int64_t>(),
                                  losses.mutable_data_ptr<float>(),
                                  write_grad ? grad_scale.const_data_ptr<float>() : nullptr,
                                  logits.size(0), logits.size(1), kIgnoreIndex, write_grad,
                                  ToKernelDType(logits, kName), CurrentStream(logits)),
        kName);
#endif
  } else {
    SoftmaxCrossEntropyCpu(logits, targets, losses, write_grad ? grad_scale.item<float>() : 0.0f,
                           write_grad);
  }
}

// acc (fp32) = a @ b (first) or acc + a @ b, for bf16/fp16 a and b. The first chunk on CUDA:
// one GEMM writing fp32 (ATen's mm with out_dtype). Every other case: the product in the
// inputs' dtype (a [V, D] temporary), then an fp32 add. The CPU has no out_dtype GEMM at all;
// on CUDA see Note [addmm with out_dtype]. An fp32 temporary would round less and cost twice
// the memory.
//
// Note [addmm with out_dtype]
// On CUDA, torch 2.11 does have a GEMM that adds into an fp32 C from bf16/fp16 inputs:
// at::addmm_out(acc, acc, a, b, at::kFloat, /*beta=*/1, /*alpha=*/1) (aten::addmm.dtype_out,
// CUDA only: _addmm_dtype_out_cuda in aten/src/ATen/native/cuda/Blas.cpp). Older releases
// checked "self and mat2 must have the same dtype", which an fp32 self fails; later ones check
// "self dtype must match either out_dtype or mat1 dtype", and the 2.11.0+cu130 wheel's
// libtorch_cuda.so holds only the later message (the older string in libtorch_cpu.so is mm's
// meta check on mat1, another op). With out == self it runs addmm_out_cuda_impl without a copy;
// a 2-D self is no cuBLASLt bias, so one at::cuda::blas::gemm<bf16 or half, float> with that
// beta (0 does not read C). Read in the source and the binary, not yet run:
// tests/kernels_cross_entropy_test.cc's CudaAddmmOutDtypeAddsIntoFp32 checks it on a GPU. If
// it passes, the non-first chunks on CUDA can accumulate this way, without the [V, D]
// temporary (131 MB for llama_1b in bf16) and its bf16 rounding of each chunk's product.
void AccumulateF32(at::Tensor& acc, const at::Tensor& a, const at::Tensor& b, bool first) {
  if (first && acc.is_cuda()) {
    at::mm_out(acc, a, b, at::kFloat);
  } else if (first) {
    acc.copy_(at::mm(a, b));
  } else {
    acc.add_(at::mm(a, b));
  }
}

struct Computed {
  at::Tensor loss;         // float32 0-dim
  at::Tensor grad_hidden;  // [N, D], hidden's dtype; undefined unless asked for
  at::Tensor grad_weight;  // [V, D], weight's dtype; undefined unless asked for
};

// The whole computation: see kernels/cross_entropy.h for the chunk loop.
Computed Compute(const at::Tensor& hidden_in, const at::Tensor& weight_in,
                 const at::Tensor& targets_in, int64_t chunk_tokens, bool need_grad_hidden,
                 bool need_grad_weight) {
  const at::Tensor hidden = hidden_in.contiguous(), weight = weight_in.contiguous();
  const at::Tensor targets = targets_in.contiguous();
  const int64_t n = hidden.size(0), d = hidden.size(1), vocab = weight.size(0);
  if (!hidden.is_cuda()) CheckTargetsCpu(targets, vocab);
  const bool need_grad = need_grad_hidden || need_grad_weight;
  const auto dtype = hidden.scalar_type();

  // The mean's denominator stays on the device: no sync. All rows ignored: 0 / 0 = nan, as
  // ATen; the gradient rows are all zero then, so the infinite scale is never used.
  const at::Tensor counted = targets.ne(kIgnoreIndex).sum().to(at::kFloat);
  const at::Tensor grad_scale = need_grad ? counted.reciprocal() : at::Tensor();
  const at::Tensor losses = at::empty({n}, hidden.options().dtype(at::kFloat));

  const int64_t chunk = std::max<int64_t>(1, std::min(chunk_tokens, n));
  const int64_t chunks = (n + chunk - 1) / chunk;
  at::Tensor logits_buffer = at::empty({chunk, vocab}, hidden.options());
  Computed out;
  if (need_grad_hidden) out.grad_hidden = at::empty_like(hidden);
  // grad_weight straight into its own dtype when that is fp32 (cuBLAS accumulates each GEMM in
  // fp32, and addmm_ adds in fp32) or when one GEMM makes it; else an fp32 accumulator.
  const bool direct = dtype == at::kFloat || chunks == 1;
  at::Tensor grad_weight_f32;
  if (need_grad_weight) {
    if (direct) {
      out.grad_weight = at::empty_like(weight);
    } else {
      grad_weight_f32 = at::empty({vocab, d}, weight.options().dtype(at::kFloat));
    }
  }
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t start = c * chunk, rows = std::min(chunk, n - start);
    const at::Tensor h = hidden.narrow(0, start, rows);
    at::Tensor logits = logits_buffer.narrow(0, 0, rows);
    at::mm_out(logits, h, weight.t());
    SoftmaxCrossEntropy(logits, targets.narrow(0, start, rows), losses.narrow(0, start, rows),
                        grad_scale);
    if (!need_grad) continue;
    // logits now holds d loss / d logits of the chunk.
    if (need_grad_hidden) {
      at::Tensor grad_h = out.grad_hidden.narrow(0, start, rows);
      at::mm_out(grad_h, logits, weight);
    }
    if (need_grad_weight) {
      if (direct) {
        if (c == 0) {
          at::mm_out(out.grad_weight, logits.t(), h);
        } else {
          out.grad_weight.addmm_(logits.t(), h);
        }
      } else {
        AccumulateF32(grad_weight_f32, logits.t(), h, /*first=*/c == 0);
      }
    }
  }
  logits_buffer.reset();  // before the cast: the accumulator and its cast are the peak
  if (grad_weight_f32.defined()) out.grad_weight = grad_weight_f32.to(dtype);
  out.loss = losses.sum() / counted;
  return out;
}

// The forward computes everything; the backward scales the kept gradients by grad_output and
// hands them over (released from the node: a second backward is an error, see the header).
struct LinearCrossEntropyFunction : torch::autograd::Function<LinearCrossEntropyFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& hidden,
                            const at::Tensor& weight, const at::Tensor& targets,
                            int64_t chunk_tokens) {
    Computed r = Compute(hidden, weight, targets, chunk_tokens, hidden.requires_grad(),
                         weight.requires_grad());
    ctx->saved_data["grad_hidden"] = r.grad_hidden;
    ctx->saved_data["grad_weight"] = r.grad_weight;
    return r.loss;
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    auto h = ctx->saved_data.find("grad_hidden");
    auto w = ctx->saved_data.find("grad_weight");
    TORCH_CHECK(h != ctx->saved_data.end() && w != ctx->saved_data.end(), kName,
                ": backward through the same loss a second time; the gradients are computed "
                "in forward and handed over by the first backward (retain_graph is not "
                "supported)");
    at::Tensor grad_hidden = h->second.toTensor(), grad_weight = w->second.toTensor();
    ctx->saved_data.erase("grad_hidden");
    ctx->saved_data.erase("grad_weight");
    const at::Tensor& grad_loss = grads[0];
    if (grad_hidden.defined()) grad_hidden.mul_(grad_loss);
    if (grad_weight.defined()) grad_weight.mul_(grad_loss);
    return {grad_hidden, grad_weight, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor LinearCrossEntropy(const at::Tensor& hidden, const at::Tensor& weight,
                              const at::Tensor& targets, int64_t chunk_tokens) {
  CheckArgs(hidden, weight, targets, chunk_tokens);
  if (!at::GradMode::is_enabled() || !(hidden.requires_grad() || weight.requires_grad())) {
    return Compute(hidden, weight, targets, chunk_tokens, false, false).loss;
  }
  return LinearCrossEntropyFunction::apply(hidden, weight, targets, chunk_tokens);
}

int64_t DefaultChunkTokens(int64_t tokens, int64_t vocab, int64_t dim) {
  const int64_t chunk = std::max<int64_t>(1, 2 * dim);
  return tokens <= chunk + 3 * dim ? std::max<int64_t>(tokens, 1) : chunk;
}

at::Tensor LinearCrossEntropyComposite(const at::Tensor& hidden, const at::Tensor& weight,
                                       const at::Tensor& targets) {
  return at::cross_entropy_loss(at::linear(hidden, weight).to(at::kFloat), targets,
                                /*weight=*/{}, at::Reduction::Mean, kIgnoreIndex);
}

}  // namespace fsdp::kernels
