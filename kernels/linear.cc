#include "kernels/linear.h"

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>

namespace fsdp::kernels {
namespace {

using torch::autograd::Node;
using torch::autograd::SavedVariable;
using torch::autograd::variable_list;

constexpr const char* kName = "multi_linear";

void CheckArgs(const at::Tensor& x, at::TensorList weights, at::TensorList biases) {
  TORCH_CHECK(x.dim() >= 1, "fsdp kernel ", kName, ": x must have at least one dimension");
  TORCH_CHECK(!weights.empty(), "fsdp kernel ", kName, ": no weights");
  TORCH_CHECK(biases.empty() || biases.size() == weights.size(), "fsdp kernel ", kName, ": ",
              biases.size(), " biases for ", weights.size(), " weights (none, or one each)");
  for (size_t i = 0; i < weights.size(); ++i) {
    const at::Tensor& w = weights[i];
    TORCH_CHECK(w.dim() == 2 && w.size(1) == x.size(-1), "fsdp kernel ", kName, ": weight ", i,
                " has sizes ", w.sizes(), " but x ", x.sizes(), ": it must be [N, ", x.size(-1),
                "]");
    TORCH_CHECK(w.scalar_type() == x.scalar_type() && w.device() == x.device(), "fsdp kernel ",
                kName, ": weight ", i, " is ", w.scalar_type(), " on ", w.device(), ", x ",
                x.scalar_type(), " on ", x.device());
    if (biases.empty() || !biases[i].defined()) continue;
    const at::Tensor& b = biases[i];
    TORCH_CHECK(b.dim() == 1 && b.size(0) == w.size(0) && b.scalar_type() == x.scalar_type() &&
                    b.device() == x.device(),
                "fsdp kernel ", kName, ": bias ", i, " (", b.sizes(), ", ", b.scalar_type(), ", ",
                b.device(), ") must be [", w.size(0), "], ", x.scalar_type(), ", on ", x.device());
  }
}

// x's shape with the last size replaced by n.
std::vector<int64_t> OutputShape(const at::Tensor& x, int64_t n) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  return shape;
}

// The backward of y_i = x W_i^T + b_i, i < n. Edges: x, the n weights, the n biases (an
// undefined bias has no edge), in that order.
class MultiLinearBackward : public Node {
 public:
  MultiLinearBackward(const at::Tensor& x, const at::Tensor& x2d, at::TensorList weights,
                      const std::vector<at::Tensor>& biases)
      : Node(torch::autograd::collect_next_edges(x, weights, at::TensorList(biases))),
        x2d_(x2d, /*is_output=*/false),
        x_sizes_(x.sizes().vec()) {
    for (size_t i = 0; i < weights.size(); ++i) {
      weights_.emplace_back(weights[i], /*is_output=*/false);
      has_bias_.push_back(biases[i].defined());
    }
  }

  std::string name() const override { return "fsdp::kernels::MultiLinearBackward"; }

  variable_list apply(variable_list&& grads) override {
    const size_t n = weights_.size();
    variable_list out(1 + 2 * n);
    at::Tensor x2d = x2d_.unpack(shared_from_this());
    at::Tensor grad_x;  // [rows, K], accumulated by the GEMMs
    for (size_t i = 0; i < n; ++i) {
      const at::Tensor& g = grads[i];
      if (!g.defined()) continue;  // output i unused: no contribution
      at::Tensor g2d = g.reshape({-1, g.size(-1)});
      if (task_should_compute_output(0)) {
        at::Tensor w = weights_[i].unpack(shared_from_this());
        if (grad_x.defined()) {
          grad_x.addmm_(g2d, w);
        } else {
          grad_x = at::mm(g2d, w);
        }
      }
      if (task_should_compute_output(1 + i)) out[1 + i] = at::mm(g2d.t(), x2d);
      if (has_bias_[i] && task_should_compute_output(1 + n + i)) out[1 + n + i] = g2d.sum(0);
    }
    if (grad_x.defined()) out[0] = grad_x.view(x_sizes_);
    return out;
  }

 private:
  void release_variables() override {
    x2d_.reset_data();
    for (SavedVariable& w : weights_) w.reset_data();
  }

  SavedVariable x2d_;  // x as [rows, K]: a view of x when x is contiguous
  std::vector<int64_t> x_sizes_;
  std::vector<SavedVariable> weights_;
  std::vector<bool> has_bias_;
};

// biases as n tensors, undefined where there is none.
std::vector<at::Tensor> PadBiases(at::TensorList weights, at::TensorList biases) {
  std::vector<at::Tensor> padded(weights.size());
  for (size_t i = 0; i < biases.size(); ++i) padded[i] = biases[i];
  return padded;
}

void SetHistory(at::TensorList outputs, const at::Tensor& x, const at::Tensor& x2d,
                at::TensorList weights, at::TensorList biases) {
  auto node = std::shared_ptr<MultiLinearBackward>(
      new MultiLinearBackward(x, x2d, weights, PadBiases(weights, biases)),
      torch::autograd::deleteNode);
  for (const at::Tensor& y : outputs) torch::autograd::set_history(y, node);
}

}  // namespace

std::vector<at::Tensor> MultiLinear(const at::Tensor& x, at::TensorList weights,
                                    at::TensorList biases) {
  CheckArgs(x, weights, biases);
  std::vector<at::Tensor> ys;
  at::Tensor x2d;
  {
    at::NoGradGuard no_grad;
    x2d = x.reshape({-1, x.size(-1)});
    for (size_t i = 0; i < weights.size(); ++i) {
      const at::Tensor& w = weights[i];
      // Written through a 2-D view of a fresh tensor, so that the output is not a view.
      at::Tensor y = at::empty(OutputShape(x, w.size(0)), x.options());
      at::Tensor y2d = y.view({-1, w.size(0)});
      if (!biases.empty() && biases[i].defined()) {
        at::addmm_out(y2d, biases[i], x2d, w.t());
      } else {
        at::mm_out(y2d, x2d, w.t());
      }
      ys.push_back(std::move(y));
    }
  }
  if (torch::autograd::compute_requires_grad(x, weights, biases)) {
    SetHistory(ys, x, x2d, weights, biases);
  }
  return ys;
}

void SetMultiLinearBackward(at::TensorList outputs, const at::Tensor& x, at::TensorList weights,
                            at::TensorList biases) {
  CheckArgs(x, weights, biases);
  TORCH_CHECK(outputs.size() == weights.size(), "fsdp kernel ", kName, ": ", outputs.size(),
              " outputs for ", weights.size(), " weights");
  for (size_t i = 0; i < outputs.size(); ++i) {
    TORCH_CHECK(outputs[i].sizes() == at::IntArrayRef(OutputShape(x, weights[i].size(0))),
                "fsdp kernel ", kName, ": output ", i, " has sizes ", outputs[i].sizes(),
                ", not those of x ", x.sizes(), " times weight ", i, " ", weights[i].sizes());
    TORCH_CHECK(outputs[i].grad_fn() == nullptr && !outputs[i].is_view(), "fsdp kernel ", kName,
                ": output ", i, " already has autograd history or is a view");
  }
  if (!torch::autograd::compute_requires_grad(x, weights, biases)) return;
  at::Tensor x2d;
  {
    at::NoGradGuard no_grad;
    x2d = x.reshape({-1, x.size(-1)});
  }
  SetHistory(outputs, x, x2d, weights, biases);
}

at::Tensor LinearAdd(const at::Tensor& residual, const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && x.dim() >= 1 && x.size(-1) == w.size(1) &&
                  residual.sizes() == at::IntArrayRef(OutputShape(x, w.size(0))),
              "fsdp kernel linear_add: residual ", residual.sizes(), ", x ", x.sizes(),
              " and weight ", w.sizes(), " do not make residual + x W^T");
  at::Tensor y = at::addmm(residual.reshape({-1, w.size(0)}), x.reshape({-1, x.size(-1)}), w.t());
  return at::_unsafe_view(y, residual.sizes());  // as at::matmul: not a view
}

std::vector<at::Tensor> MultiLinearComposite(const at::Tensor& x, at::TensorList weights,
                                             at::TensorList biases) {
  std::vector<at::Tensor> ys;
  for (size_t i = 0; i < weights.size(); ++i) {
    std::optional<at::Tensor> b;
    if (!biases.empty() && biases[i].defined()) b = biases[i];
    ys.push_back(at::linear(x, weights[i], b));
  }
  return ys;
}

at::Tensor LinearAddComposite(const at::Tensor& residual, const at::Tensor& x,
                              const at::Tensor& w) {
  return residual + at::linear(x, w);
}

}  // namespace fsdp::kernels
