// Analytic sizes of the gpt / llama / mlp families: parameter counts and dim-0 shapes per unit,
// FLOPs per token, and the activation bytes the planner's memory model counts. No tensors.
#include "models/gpt/gpt.h"

namespace fsdp {

// Note [Activation bytes]
// What autograd keeps per token and per block until backward, counted from the model's forward
// (models/gpt/gpt.cc) with `cb` bytes per element of the compute dtype. Flash-style attention
// (the CPU and CUDA kernels behind scaled_dot_product_attention) keeps no seq x seq matrix.
//   norm: LayerNorm keeps its input (cb) and two fp32 statistics; RMSNorm computes in fp32 and
//         keeps the fp32 input (4 bytes: a copy when cb = 2) and the normalised value (cb)
//   attention: the norm output (shared by wq/wk/wv), q, k, v (k and v at kv_dim: grouped-query
//         attention does not repeat them, see AttentionImpl) and the attention output (its
//         [batch, seq, heads, head_dim] layout makes wo's input a view): 3 dim + 2 kv_dim, and
//         the fp32 log-sum-exp per head. RoPE adds nothing: the rotated q and k replace the
//         projections' outputs (the cos/sin tables need no gradient, so the products keep
//         only the tables)
//   MLP: the norm output + for GELU the w1 output and the GELU output (2 ffn), for SwiGLU the
//        w1 output, silu's output, the w3 output and the product (4 ffn)
// GPT-2 (layernorm, gelu, ffn = 4 dim) gives 16 dim, as Korthikanti et al. (2022), "Reducing
// activation recomputation in large transformer models": 34 sbh bytes per layer in 16 bits
// with flash attention, of which 2 sbh are dropout masks. Checked against
// torch.autograd.graph.saved_tensors_hooks on the same ops (dim 64, where the small terms
// show): GPT-2 16.1 dim; Llama (RMSNorm, SwiGLU with ffn 2.75 dim, RoPE) 21.2 dim in fp32 and
// 23.4 dim-equivalents in bf16; with 4, 2, 1 key/value heads of 4 query heads 21.2, 20.2,
// 19.7 dim (k and v shrink with kv_dim).
//
// With activation checkpointing (sharding/options.h) a checkpointed block keeps only its input
// (dim, cb); selective keeps the input and the output of every matmul: q (dim), k and v
// (kv_dim each), wo (dim), w1 and w3 (ffn each), w2 (dim; with fused kernels and no bias on w2
// that output is the block's output, residual added by the GEMM, which the next block or the
// head keeps as its input: not counted again). Their recompute materialises the `none` set
// again, one block at a time.
//
// The head keeps the final norm's input and output; the logits reach the loss in fp32 (FSDP
// casts the root's output, MixedPrecision::output_dtype; the trainer holds them through
// backward), log_softmax keeps its fp32 output, and its backward adds two fp32 vocab-sized
// gradients (nll's and its own): 16 bytes per vocabulary entry at the start of backward, in
// bf16 as in fp32. See GptHeadBytesPerToken.
//
// With model.kernels fused (kernels/), per block and token: RMSNorm keeps its input (cb) and
// one fp32 rstd per row, the residual add + ffn_norm pass keeps its sum (cb) and rstd; SwiGLU
// keeps gate and up (2 ffn) and no silu output or product, so the MLP keeps the norm output,
// gate, up and w2's input (dim + 3 ffn); RoPE in place adds nothing (as above). The fused
// projections keep what the separate ones kept (Note [Residual stream gradients] in gpt.cc):
// q/k/v and w1/w3 as one Linears node each save their input once (the linears shared it), the
// attention norm passing the input through saves what RMSNorm saved, and w2's GEMM adding the
// residual saves its input and weight, as linear. The head: the
// final norm (fused) and, from the chunked LM head + cross-entropy, the gradient of its input
// (dim, cb) instead of vocab-sized fp32 logits and gradients; its [vocab, dim] weight gradient
// and [chunk, vocab] logits buffer do not grow with the tokens (a weight-sized term, next to
// the unsharded gradients the planner counts).
//
// Note [Recompute and backward bytes]
// What autograd and sharding/activation_checkpoint.cc hold at a block's backward beyond its
// `none` set, per token (counted like Note [Activation bytes] above; the planner's
// Note [Peak memory phases] in planner/cost_model.cc places them in the backward):
//   T, every block: the backward's own gradients at the MLP, which runs first, while the whole
//     block's saved set is alive: the incoming gradient of the block's output (dim) and the
//     intermediate ones, 2 ffn with GELU (of w2's input, then of w1's output), 3 ffn with
//     SwiGLU (of the product, then of both its inputs);
//   X, a checkpointed block: the recomputed output (dim; RecomputeBackward holds it until its
//     nested backward returns); the input, where `none` does not keep it (RecomputeBackward
//     does: the composite RMSNorm in bf16 saves an fp32 copy instead); and, for selective, the
//     tape's matmul outputs that `none` does not keep, held until the block's backward ends:
//     wo's and w2's (residual adds save nothing) and, with RoPE, q and k before the rotation
//     (autograd keeps the rotated ones). q, k, v, w1 and w3 are in `none` already: the tape and
//     the recomputed graph share them. w2's is the recomputed output itself where w2's GEMM
//     adds the residual (fused kernels, no bias on w2), counted once.
// Measured (fsdp train on a CPU, one rank, peak tensor bytes: GPT and Llama blocks, 1 to 4 of
// them, fused and composite kernels; CheckpointingTest.SelectiveAndFullAgainstMeasuredPeaks in
// tests/planner_memory_test.cc):
// the differences between none, selective and full agree to within 300 bytes per token or 8%.
// So with one block and a small head selective (and full) keep more than none: the block's
// backward is the peak of both and the recompute adds X. From two blocks on they keep less.

namespace {

bool Fused(const ModelArgs& m) { return m.kernels == KernelMode::kFused; }

double NormBytes(const ModelArgs& m, double cb) {
  const double d = static_cast<double>(m.dim);
  if (m.norm != NormKind::kRmsNorm) return d * cb + 2 * 4;
  return Fused(m) ? d * cb + 4 : d * 4 + d * cb + 4;
}

}  // namespace

BlockActivationBytes GptBlockActivationBytes(const ModelArgs& m, double cb) {
  const double d = static_cast<double>(m.dim), f = static_cast<double>(m.ffn());
  const double kv = static_cast<double>(m.kv_dim());
  const bool swiglu = m.activation == Activation::kSwiglu;
  BlockActivationBytes b;
  // Fused without a bias on w2, w2's GEMM adds the residual (Note [Residual stream gradients] in
  // gpt.cc): the tape's w2 output is the block's output, which the next block or the head keeps
  // as its input and the recompute returns as its output, so it adds nothing of its own.
  const bool w2_output_is_block_output = Fused(m) && !HasBiases(m);
  b.none = NormBytes(m, cb) + (d + (swiglu ? (Fused(m) ? 3 : 4) : 2) * f) * cb;
  b.selective =
      (d /*input*/ + (swiglu ? 2 : 1) * f /*w1, w3*/ + (w2_output_is_block_output ? 0 : d) /*w2*/) *
      cb;
  if (HasAttention(m)) {
    b.none += NormBytes(m, cb) + (3 * d + 2 * kv) * cb + 4.0 * m.n_heads;
    b.selective += (2 * d /*wq, wo*/ + 2 * kv /*wk, wv*/) * cb;
  }
  b.full = d * cb;
  // Note [Recompute and backward bytes]: T and X.
  b.backward_transient = (d + (swiglu ? 3 : 2) * f) * cb;
  b.recompute_output = d * cb;
  const bool composite_rms = m.norm == NormKind::kRmsNorm && !Fused(m);
  if (composite_rms && cb < 4) b.recompute_input_unkept = d * cb;
  b.selective_unkept = w2_output_is_block_output ? 0 : d * cb;  // w2
  if (HasAttention(m)) {
    b.selective_unkept += d * cb;  // wo
    if (m.positions == Positions::kRope) b.selective_unkept += (d + kv) * cb;
  }
  return b;
}

double GptHeadBytesPerToken(const ModelArgs& m, double cb) {
  const double d = static_cast<double>(m.dim), v = static_cast<double>(m.vocab_size);
  if (Fused(m)) return NormBytes(m, cb) + d * cb /*the hidden's gradient*/ + 16;
  return NormBytes(m, cb) + d * cb + 4 * v /*fp32 logits*/ + 4 * v /*log_softmax*/ +
         2 * 4 * v /*bwd grads*/ + 16 /*int64 inputs and targets*/;
}

ModelCounts CountGpt(const ModelArgs& m) {
  ModelCounts c;
  const int64_t d = m.dim, v = m.vocab_size, f = m.ffn();
  auto add_norm = [&](std::vector<std::pair<int64_t, int64_t>>& unit) {
    unit.push_back({d, 1});
    if (m.norm != NormKind::kRmsNorm) unit.push_back({d, 1});
  };
  std::vector<std::pair<int64_t, int64_t>> root;
  root.push_back({v, d});
  const bool learned = HasAttention(m) && m.positions == Positions::kLearned;
  if (learned) root.push_back({m.seq_len, d});
  add_norm(root);
  if (!m.tie_embeddings) root.push_back({v, d});
  std::vector<std::pair<int64_t, int64_t>> block;
  if (HasAttention(m)) {
    add_norm(block);
    const int64_t kv = m.kv_dim();
    for (int64_t rows : {d, kv, kv, d}) block.push_back({rows, d});  // wq, wk, wv, wo
    if (HasBiases(m)) {
      for (int64_t rows : {d, kv, kv, d}) block.push_back({rows, 1});
    }
  }
  add_norm(block);
  block.push_back({f, d});
  block.push_back({d, f});
  if (m.activation == Activation::kSwiglu) block.push_back({f, d});
  if (HasBiases(m)) {
    block.push_back({f, 1});
    block.push_back({d, 1});
  }
  c.unit_shapes.push_back(root);
  for (int64_t i = 0; i < m.n_layers; ++i) c.unit_shapes.push_back(block);
  for (const auto& unit : c.unit_shapes) {
    int64_t n = 0;
    for (const auto& [rows, row_numel] : unit) n += rows * row_numel;
    c.unit_params.push_back(n);
    c.params += n;
  }
  double matmul = static_cast<double>(c.params);
  if (!m.tie_embeddings) matmul -= static_cast<double>(v * d);
  if (learned) matmul -= static_cast<double>(m.seq_len * d);
  // QK^T and AV: 2 x 2 x seq_len x dim per layer forward (query heads x head_dim = dim whatever
  // the key/value heads), times 3 with backward.
  double attention = HasAttention(m) ? 12.0 * m.n_layers * m.dim * m.seq_len : 0.0;
  c.flops_per_token = 6.0 * matmul + attention;
  if (m.n_layers > 0) {
    c.block_attention_flops_per_token = attention / m.n_layers;
    c.block_flops_per_token =
        6.0 * static_cast<double>(c.unit_params[1]) + c.block_attention_flops_per_token;
  }
  return c;
}

}  // namespace fsdp
