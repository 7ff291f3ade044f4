// Analytic sizes of the gpt / llama / mlp families: parameter counts and dim-0 shapes per unit,
// FLOPs per token, and the activation bytes the planner's memory model counts. No tensors.
#include "models/gpt/gpt.h"

namespace fsdp {

// Note [Activation bytes]
// What autograd keeps per token and per block until backward, counted from the model's forward
// (models/gpt/gpt.cc) in elements of the compute dtype (flash-style attention on CPU and CUDA keeps
// no seq x seq matrix):
//   norm: its input (LayerNorm) or its input and the normalised value (RMSNorm) -> 1 or 2 x dim
//   attention: norm output (shared by wq/wk/wv), q, k, v, the attention output and its
//              contiguous copy that wo reads -> 6 x dim; rope adds the rotated q and k: + 2 x dim
//   MLP: norm output + w1 output and the GELU output (2 x ffn), or for SwiGLU w1 out, silu out,
//        w3 out and the product (4 x ffn)
// GPT-2 (layernorm, gelu, ffn = 4 dim) gives 17 x dim, the no-dropout, flash-attention case of
// Korthikanti et al. (2022), "Reducing activation recomputation in large transformer models".
// The head keeps the final norm's input and output and the logits; the loss computes in fp32
// (a copy when the logits are bf16), log_softmax keeps its fp32 output, and the start of
// backward adds two fp32 vocab-sized gradients: see GptHeadBytesPerToken.
double GptBlockActivationElements(const ModelArgs& m) {
  const double d = static_cast<double>(m.dim), f = static_cast<double>(m.ffn());
  const double norm = m.norm == NormKind::kRmsNorm ? 2 * d : d;
  double e = norm + d + (m.activation == Activation::kSwiglu ? 4 * f : 2 * f);
  if (HasAttention(m)) e += norm + 6 * d + (m.positions == Positions::kRope ? 2 * d : 0);
  return e;
}

double GptHeadBytesPerToken(const ModelArgs& m, double cb) {
  const double d = static_cast<double>(m.dim), v = static_cast<double>(m.vocab_size);
  const double norm = m.norm == NormKind::kRmsNorm ? 2 * d : d;
  const double fp32_copy = cb < 4 ? 4 * v : 0;
  return (norm + d + v) * cb + fp32_copy + 4 * v /*log_softmax*/ + 2 * 4 * v /*bwd grads*/ +
         16 /*int64 inputs and targets*/;
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
    for (int i = 0; i < 4; ++i) block.push_back({d, d});
    if (HasBiases(m)) {
      for (int i = 0; i < 4; ++i) block.push_back({d, 1});
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
  double attention = HasAttention(m) ? 12.0 * m.n_layers * m.dim * m.seq_len : 0.0;
  c.flops_per_token = 6.0 * matmul + attention;
  if (m.n_layers > 0) {
    c.block_flops_per_token = 6.0 * static_cast<double>(c.unit_params[1]) + attention / m.n_layers;
  }
  return c;
}

}  // namespace fsdp
