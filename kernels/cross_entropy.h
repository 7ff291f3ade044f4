// The LM head and its cross-entropy loss in chunks of tokens, without the [N, V] logits of the
// whole batch in fp32: mean over counted rows of cross_entropy(hidden @ weight^T, targets).
//
// Per chunk of `chunk_tokens` rows (after llm.c's fused classifier):
//   logits  = hidden_chunk @ weight^T             [chunk, V], compute dtype, one GEMM
//   one kernel per row: max and log-sum-exp in fp32, the row's loss, and (when a gradient is
//   needed) the logits overwritten IN PLACE by d loss / d logits = (softmax - onehot) / count
//   grad_hidden_chunk  = dlogits @ weight         GEMM
//   grad_weight       += dlogits^T @ hidden_chunk GEMM, accumulated in fp32 across chunks
// So the forward does all the work (three GEMMs per chunk: the FLOPs of the unfused forward and
// backward) and keeps the two gradients; the backward only scales them by the incoming
// gradient (a scalar) and hands them over. Without a gradient (eval, NoGradGuard, nothing
// requires grad) only the first GEMM and the loss run.
//
//   at::Tensor h = final_norm(x).flatten(0, 1);                          // [N, D]
//   at::Tensor loss = fsdp::kernels::LinearCrossEntropy(h, output_weight, targets.flatten(),
//                                                       /*chunk_tokens=*/1024);
//   loss.backward();   // grads of h and output_weight; a tied embedding's add up
//
// Targets: a class in [0, V) or kIgnoreIndex (-100), excluded from the mean as in ATen: a
// batch with every row ignored has loss nan and zero gradients. Any other target: on CPU an
// error naming it, its row and V; on CUDA a device-side assert (as ATen's), no host sync.
// Memory beyond the inputs: one [chunk, V] logits buffer in the compute dtype (reused by every
// chunk), the gradients (grad_hidden [N, D] and grad_weight [V, D] in the inputs' dtype, kept
// from forward to backward: the unfused backward allocates the same), and, in bf16/fp16 with
// more than one chunk, an fp32 [V, D] accumulator for grad_weight while the forward runs and a
// [V, D] product in the inputs' dtype per chunk (on CUDA not for the first: it is written to the
// accumulator in fp32 directly). So in bf16 chunking saves memory over one chunk only while the
// logits it avoids, (N - chunk) x V x 2 bytes, exceed those two, V x D x 6: N > chunk + 3 D.
// For llama_1b (V 32000, D 2048) and a 2 x 2048 micro-batch, peaks: one chunk 410 MB (logits
// 262, grad_weight 131, grad_hidden 17); chunks of 1024 475 MB in the loop (logits 66,
// accumulator 262, product 131, grad_hidden 17) and 410 MB at the cast (accumulator 262,
// grad_weight 131, grad_hidden 17); the composite 1311 MB in its forward (bf16 logits 262, fp32 logits 524,
// log_softmax 524) and more in its backward. The backward scales the kept gradients in place
// and releases them: a second backward through the same loss (retain_graph) is an error.
//
// CUDA tensors run kernels/cuda/cross_entropy.cu for the per-row kernel (the GEMMs: ATen, so
// cuBLAS); others the CPU reference in kernels/cross_entropy.cc. Tolerances against the
// composite: tests/kernels_cross_entropy_test.cc.
#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>

namespace fsdp::kernels {

// The target that marks a row excluded from the loss (ATen's default ignore_index).
inline constexpr int64_t kIgnoreIndex = -100;

// hidden [N, D] and weight [V, D]: one dtype (float32, bfloat16, float16); targets [N] int64,
// same device; chunk_tokens > 0 (N or more: one chunk). Returns the mean loss, a float32
// 0-dim tensor. Differentiable in hidden and weight.
at::Tensor LinearCrossEntropy(const at::Tensor& hidden, const at::Tensor& weight,
                              const at::Tensor& targets, int64_t chunk_tokens);

// A chunk size for `tokens` rows of a [vocab, dim] head: every row in one chunk up to 5 x dim
// rows, else chunks of 2 x dim rows. Chunking bounds the [chunk, V] logits buffer but adds an
// fp32 [V, D] accumulator for the weight's gradient and a [V, D] product per chunk in
// bf16/fp16, which only pays once the logits it avoids outgrow them: tokens > chunk + 3 x dim.
// llama_1b, one 2 x 2048 micro-batch (4096 tokens, dim 2048): one chunk, 410 MB in bf16
// against the composite's 1.3 GB forward peak; 8 x 2048 (16384 tokens): chunks of 4096.
int64_t DefaultChunkTokens(int64_t tokens, int64_t vocab, int64_t dim);

// The composite reference, the trainer's arithmetic: cross_entropy(linear(hidden, weight)
// .float(), targets) with ATen's ignore_index -100 and mean reduction.
at::Tensor LinearCrossEntropyComposite(const at::Tensor& hidden, const at::Tensor& weight,
                                       const at::Tensor& targets);

}  // namespace fsdp::kernels
