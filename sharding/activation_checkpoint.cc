// Activation checkpointing's two autograd nodes (Note [Activation checkpointing]) and the
// fsdp::Linear, LinearAdd and Linears that selective checkpointing records and replays.
#include "sharding/activation_checkpoint.h"

#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>

#include "kernels/linear.h"
#include "sharding/unit_forward.h"

namespace fsdp {
namespace {

using torch::autograd::Node;
using torch::autograd::SavedVariable;
using torch::autograd::variable_list;

// The matmul outputs of one checkpointed forward, in call order: recorded under no-grad in
// forward, replayed (each once, in the same order) by the recompute.
struct MatmulTape {
  std::vector<at::Tensor> outputs;
  std::vector<uint32_t> versions;  // each output's version when recorded
  size_t next = 0;
  bool replaying = false;
};

// The tape of the checkpointed forward or recompute running on this thread, if selective.
thread_local MatmulTape* active_tape = nullptr;

class TapeScope {
 public:
  explicit TapeScope(MatmulTape* tape) : saved_(active_tape) { active_tape = tape; }
  ~TapeScope() { active_tape = saved_; }
  TapeScope(const TapeScope&) = delete;
  TapeScope& operator=(const TapeScope&) = delete;

 private:
  MatmulTape* saved_;
};

// y = x W^T + b (+ residual) where y was computed in forward and kept: only the backward of
// linear runs (fsdp::Linear, fsdp::LinearAdd; a residual gets the incoming gradient itself).
class ReplayedLinearBackward : public Node {
 public:
  ReplayedLinearBackward(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b,
                         const at::Tensor& residual)
      : Node(torch::autograd::collect_next_edges(x, w, b, residual)),
        x_(x, /*is_output=*/false),
        w_(w, /*is_output=*/false),
        has_bias_(b.defined()) {}

  std::string name() const override { return "fsdp::ReplayedLinearBackward"; }

  variable_list apply(variable_list&& grads) override {
    variable_list out(4);
    const at::Tensor& g = grads[0];
    if (!g.defined()) return out;
    at::Tensor x = x_.unpack(shared_from_this());
    at::Tensor w = w_.unpack(shared_from_this());
    at::Tensor g2 = g.reshape({-1, g.size(-1)});
    if (task_should_compute_output(0)) out[0] = g.matmul(w);
    if (task_should_compute_output(1)) out[1] = g2.t().mm(x.reshape({-1, x.size(-1)}));
    if (has_bias_ && task_should_compute_output(2)) out[2] = g2.sum(0);
    if (task_should_compute_output(3)) out[3] = g;
    return out;
  }

 private:
  void release_variables() override {
    x_.reset_data();
    w_.reset_data();
  }

  SavedVariable x_;
  SavedVariable w_;
  bool has_bias_;
};

// The grad_fn of a checkpointed unit's output: re-runs the unit's forward, then its backward.
class RecomputeBackward : public Node {
 public:
  RecomputeBackward(const at::Tensor& input, UnitFunction fn, std::unique_ptr<MatmulTape> tape,
                    RecomputeHooks hooks)
      : Node(torch::autograd::collect_next_edges(input)),
        input_(input, /*is_output=*/false),
        input_requires_grad_(input.requires_grad()),
        fn_(std::move(fn)),
        tape_(std::move(tape)),
        hooks_(std::move(hooks)) {}

  std::string name() const override { return "fsdp::RecomputeBackward"; }

  variable_list apply(variable_list&& grads) override {
    TORCH_CHECK(fn_, "activation checkpointing: a checkpointed unit's backward ran twice; "
                "retain_graph is not supported with training.activation_checkpointing");
    at::Tensor saved = input_.unpack(shared_from_this());
    at::Tensor x = saved.detach();
    x.requires_grad_(input_requires_grad_);
    if (hooks_.before) hooks_.before();
    at::Tensor out;
    {
      at::AutoGradMode grad_on(true);
      if (tape_) tape_->replaying = true;
      TapeScope scope(tape_.get());
      out = fn_(x);
    }
    if (tape_) {
      TORCH_CHECK(tape_->next == tape_->outputs.size(),
                  "selective activation checkpointing: the recompute used ", tape_->next,
                  " of the ", tape_->outputs.size(),
                  " matmul outputs the forward recorded; the unit's forward must take the same "
                  "path every time");
    }
    if (hooks_.after) hooks_.after();
    const at::Tensor& g = grads[0];
    if (g.defined() && out.requires_grad()) torch::autograd::backward({out}, {g});
    release_variables();
    fn_ = nullptr;
    return {input_requires_grad_ ? x.grad() : at::Tensor()};
  }

 private:
  void release_variables() override {
    input_.reset_data();
    tape_.reset();
  }

  SavedVariable input_;
  bool input_requires_grad_;
  UnitFunction fn_;
  std::unique_ptr<MatmulTape> tape_;  // selective only
  RecomputeHooks hooks_;
};

}  // namespace

at::Tensor CheckpointedForward(const at::Tensor& input, UnitFunction fn, bool selective,
                               RecomputeHooks hooks) {
  std::unique_ptr<MatmulTape> tape = selective ? std::make_unique<MatmulTape>() : nullptr;
  at::Tensor out;
  {
    at::NoGradGuard no_grad;
    TapeScope scope(tape.get());
    out = fn(input);
  }
  TORCH_CHECK(out.defined() && torch::autograd::isDifferentiableType(out.scalar_type()),
              "activation checkpointing: a checkpointed unit must return a floating-point "
              "tensor, got ", out.defined() ? c10::toString(out.scalar_type()) : "none");
  // Made under no-grad, the output may still be a view (e.g. linear's reshaped addmm); its
  // detached alias (same memory) is not, so the node becomes its grad_fn without view
  // bookkeeping.
  out = out.detach();
  auto node = std::shared_ptr<RecomputeBackward>(
      new RecomputeBackward(input, std::move(fn), std::move(tape), std::move(hooks)),
      torch::autograd::deleteNode);
  torch::autograd::set_history(out, node);
  return out;
}

at::Tensor RngState(const c10::Device& device) {
  at::Generator generator = at::globalContext().defaultGenerator(device);
  std::lock_guard<std::mutex> lock(generator.mutex());
  return generator.get_state();
}

bool KeepsMatmulOutputs() { return active_tape != nullptr; }

namespace {

// In a recompute: the next recorded matmul output, checked against what the forward recorded;
// detached (not a view: see CheckpointedForward).
at::Tensor TakeRecorded(MatmulTape& tape, const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(tape.next < tape.outputs.size(),
              "selective activation checkpointing: the recompute calls fsdp::Linear more often "
              "than the forward did (", tape.outputs.size(),
              " times); the unit's forward must take the same path every time");
  const size_t i = tape.next++;
  at::Tensor y = std::move(tape.outputs[i]).detach();
  TORCH_CHECK(y._version() == tape.versions[i],
              "selective activation checkpointing: matmul output ", i,
              " was modified in place after the forward used it; make that op out of place");
  TORCH_CHECK(y.size(-1) == w.size(0) && y.numel() / y.size(-1) == x.numel() / x.size(-1),
              "selective activation checkpointing: the recompute's matmul ", i,
              " does not match the forward's (", y.sizes(), " recorded); the unit's forward "
              "must take the same path every time");
  return y;
}

void Record(MatmulTape& tape, const at::Tensor& y) {
  tape.outputs.push_back(y);
  tape.versions.push_back(y._version());
}

std::optional<at::Tensor> Optional(const at::Tensor& b) {
  return b.defined() ? std::optional<at::Tensor>(b) : std::nullopt;
}

// Linear and LinearAdd (residual defined) under the active tape, if any.
at::Tensor TapedLinear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b,
                       const at::Tensor& residual) {
  auto compute = [&] {
    return residual.defined() ? kernels::LinearAdd(residual, x, w) : at::linear(x, w, Optional(b));
  };
  MatmulTape* tape = active_tape;
  if (tape == nullptr) return compute();
  if (!tape->replaying) {
    at::Tensor y = compute();
    Record(*tape, y);
    return y;
  }
  at::Tensor y = TakeRecorded(*tape, x, w);
  if (!torch::autograd::compute_requires_grad(x, w, b, residual)) return y;
  auto node = std::shared_ptr<ReplayedLinearBackward>(new ReplayedLinearBackward(x, w, b, residual),
                                                      torch::autograd::deleteNode);
  torch::autograd::set_history(y, node);
  return y;
}

}  // namespace

at::Tensor Linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
  return TapedLinear(x, w, b, at::Tensor());
}

at::Tensor LinearAdd(const at::Tensor& residual, const at::Tensor& x, const at::Tensor& w) {
  return TapedLinear(x, w, at::Tensor(), residual);
}

std::vector<at::Tensor> Linears(const at::Tensor& x, at::TensorList weights,
                                at::TensorList biases) {
  MatmulTape* tape = active_tape;
  if (tape == nullptr) return kernels::MultiLinear(x, weights, biases);
  if (!tape->replaying) {
    std::vector<at::Tensor> ys = kernels::MultiLinear(x, weights, biases);
    for (const at::Tensor& y : ys) Record(*tape, y);
    return ys;
  }
  std::vector<at::Tensor> ys;
  for (const at::Tensor& w : weights) ys.push_back(TakeRecorded(*tape, x, w));
  kernels::SetMultiLinearBackward(ys, x, weights, biases);  // nothing without gradients
  return ys;
}

}  // namespace fsdp
