// model.attention: which ATen kernel computes the decoder's causal attention
// (at::scaled_dot_product_attention's backends), chosen once at start, for the whole process,
// and printed in the start line, instead of being picked silently per call.
//
//   auto       the backend SDPA itself picks for the model's attention shape on this device
//              (on an H100 in bf16: cuDNN's flash attention; on a CPU: its flash kernel), then
//              held: a later call that it cannot serve is an error, not a silent fall-back to
//              the math path;
//   flash      FlashAttention-2 (CUDA; the CPU's own flash kernel on a CPU);
//   cudnn      cuDNN's fused attention (CUDA);
//   efficient  the memory-efficient (xformers-style) kernel (CUDA);
//   math       the composite softmax(QK^T / sqrt(d)) V in ATen ops (any device; slow).
// A backend that cannot run the model's shape or dtype on this device is a config error naming
// model.attention and the backends that can. training.deterministic allows flash and math only
// (Note [Deterministic mode] in trainer.cc).
//
//   FSDP_ASSIGN_OR_RETURN(AttentionBackend used,
//       SelectAttentionBackend(config.model.attention, config.model, at::kBFloat16, device,
//                              /*deterministic=*/false));
//   std::cout << AttentionBackendName(used);   // "cudnn"
#pragma once

#include <string>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "absl/status/statusor.h"
#include "models/model.h"

namespace fsdp {

enum class AttentionBackend { kAuto, kFlash, kCudnn, kEfficient, kMath };
const char* AttentionBackendName(AttentionBackend backend);
// Every value of model.attention, in order ("auto", "flash", ...).
const std::vector<AttentionBackend>& AttentionBackends();

// Restricts scaled_dot_product_attention in this process to one backend and returns it (never
// kAuto). The probe runs SDPA's own selection on a [1, n_heads, seq_len, head_dim] query (and
// n_kv_heads keys and values) of `dtype` on `device`: no attention is computed.
absl::StatusOr<AttentionBackend> SelectAttentionBackend(AttentionBackend requested,
                                                        const ModelArgs& model,
                                                        at::ScalarType dtype, c10::Device device,
                                                        bool deterministic);

}  // namespace fsdp
