#include "engine/attention.h"

#include <vector>

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/SDPBackend.h>
#include <ATen/core/grad_mode.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace fsdp {
namespace {

void EnableOnly(const std::vector<AttentionBackend>& enabled) {
  auto on = [&](AttentionBackend b) {
    for (AttentionBackend e : enabled) {
      if (e == b) return true;
    }
    return false;
  };
  at::Context& context = at::globalContext();
  context.setSDPUseFlash(on(AttentionBackend::kFlash));
  context.setSDPUseCuDNN(on(AttentionBackend::kCudnn));
  context.setSDPUseMemEfficient(on(AttentionBackend::kEfficient));
  context.setSDPUseMath(on(AttentionBackend::kMath));
}

AttentionBackend FromAten(int64_t choice) {
  switch (static_cast<at::SDPBackend>(choice)) {
    case at::SDPBackend::flash_attention: return AttentionBackend::kFlash;
    case at::SDPBackend::cudnn_attention: return AttentionBackend::kCudnn;
    case at::SDPBackend::efficient_attention: return AttentionBackend::kEfficient;
    case at::SDPBackend::math: return AttentionBackend::kMath;
    default: return AttentionBackend::kAuto;  // error / overrideable: none of ours
  }
}

// What SDPA picks for the model's shape with `enabled` backends allowed; kAuto when none fits.
AttentionBackend Probe(const std::vector<AttentionBackend>& enabled, const ModelArgs& model,
                       at::ScalarType dtype, c10::Device device) {
  EnableOnly(enabled);
  // As the model calls it in training: inputs that need gradients (some backends refuse a
  // shape only for the backward, e.g. head_dim > 192 on sm86/89) in the model's layout,
  // [batch, seq, heads, head_dim] transposed to [batch, heads, seq, head_dim].
  at::AutoGradMode grad(true);
  auto options = at::TensorOptions().dtype(dtype).device(device);
  at::Tensor q = at::empty({1, model.seq_len, model.n_heads, model.head_dim()}, options)
                     .requires_grad_()
                     .transpose(1, 2);
  at::Tensor kv = at::empty({1, model.seq_len, model.kv_heads(), model.head_dim()}, options)
                      .requires_grad_()
                      .transpose(1, 2);
  try {
    return FromAten(at::_fused_sdp_choice(q, kv, kv, {}, 0.0, /*is_causal=*/true, std::nullopt,
                                          /*enable_gqa=*/model.kv_heads() != model.n_heads));
  } catch (const c10::Error&) {
    return AttentionBackend::kAuto;  // "No available kernel"
  }
}

}  // namespace

const char* AttentionBackendName(AttentionBackend backend) {
  switch (backend) {
    case AttentionBackend::kAuto: return "auto";
    case AttentionBackend::kFlash: return "flash";
    case AttentionBackend::kCudnn: return "cudnn";
    case AttentionBackend::kEfficient: return "efficient";
    case AttentionBackend::kMath: return "math";
  }
  return "?";
}

const std::vector<AttentionBackend>& AttentionBackends() {
  static const std::vector<AttentionBackend> all = {
      AttentionBackend::kAuto, AttentionBackend::kFlash, AttentionBackend::kCudnn,
      AttentionBackend::kEfficient, AttentionBackend::kMath};
  return all;
}

absl::StatusOr<AttentionBackend> SelectAttentionBackend(AttentionBackend requested,
                                                        const ModelArgs& model,
                                                        at::ScalarType dtype, c10::Device device,
                                                        bool deterministic) {
  std::vector<AttentionBackend> allowed = {AttentionBackend::kFlash, AttentionBackend::kMath};
  if (!deterministic) {
    allowed = {AttentionBackend::kCudnn, AttentionBackend::kFlash, AttentionBackend::kEfficient,
               AttentionBackend::kMath};
  }
  // Which backends can run this shape here (each probed alone), for the messages.
  std::vector<std::string> usable;
  for (AttentionBackend b : allowed) {
    if (Probe({b}, model, dtype, device) == b) usable.push_back(AttentionBackendName(b));
  }
  AttentionBackend chosen = requested;
  if (requested == AttentionBackend::kAuto) {
    chosen = Probe(allowed, model, dtype, device);
  } else if (Probe({requested}, model, dtype, device) != requested) {
    chosen = AttentionBackend::kAuto;
  }
  if (chosen == AttentionBackend::kAuto) {
    EnableOnly(allowed);
    std::string where = absl::StrCat(device.str(), ", ", c10::toString(dtype), ", head_dim ",
                                     model.head_dim(), ", ", model.n_heads, " heads / ",
                                     model.kv_heads(), " kv heads");
    bool excluded = deterministic && (requested == AttentionBackend::kCudnn ||
                                      requested == AttentionBackend::kEfficient);
    return absl::InvalidArgumentError(absl::StrCat(
        "model.attention: ", AttentionBackendName(requested),
        excluded ? " is not deterministic (training.deterministic allows flash and math)"
                 : " cannot run this model's attention",
        " (", where, "); backends that can: ",
        usable.empty() ? std::string("none") : absl::StrJoin(usable, ", "),
        " (or model.attention=auto)"));
  }
  EnableOnly({chosen});
  return chosen;
}

}  // namespace fsdp
