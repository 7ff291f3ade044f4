// What a model's modules need to be wrappable by FsdpModel, and nothing else: route the forward
// of a module that may become an FSDP unit through UnitForward (libtorch modules have no forward
// hooks). The math is untouched and, when the module is not a unit (one process, no wrapping),
// UnitForward just calls the function. Model code includes this header, not fsdp_model.h.
//
// With training.activation_checkpointing the function given to UnitForward runs again in
// backward (Note [Activation checkpointing] in activation_checkpoint.h): it must capture by
// value, or objects that outlive the backward (the module's `this`), and draw no random numbers.
// Its matmuls go through fsdp::Linear (or Linears, LinearAdd) so that selective checkpointing can
// keep their outputs.
//
// Cross-rank contract: none here beyond FsdpModel's (every rank runs its units' forwards in the
// same order).
//
//   struct BlockImpl : torch::nn::Module {
//     torch::Tensor forward(const torch::Tensor& x) {
//       return fsdp::UnitForward(this, x, [&](const torch::Tensor& h) {
//         return h + mlp->forward(norm->forward(h));
//       });
//     }
//     ...
//   };
//   x = fsdp::SequentialForward(*blocks, x);  // a Sequential whose children may be units
#pragma once

#include <functional>
#include <vector>

#include <ATen/core/Tensor.h>

namespace torch::nn {
class Module;
}

namespace fsdp {

// Runs `fn(input)` as the forward of `module`'s FSDP unit: unshard before, reshard after, and
// hooks for backward. A module that is not a unit just runs fn(input). Floating-point inputs
// are cast to the unit's compute dtype (mixed precision).
at::Tensor UnitForward(torch::nn::Module* module, const at::Tensor& input,
                       const std::function<at::Tensor(const at::Tensor&)>& fn);

// y = x W^T + b (b may be undefined), as torch::nn::functional::linear. Inside a unit under
// selective activation checkpointing its output is kept for the recompute; elsewhere it is
// just linear.
at::Tensor Linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b = {});

// Kept by selective checkpointing as Linear, one output per weight; otherwise
// kernels::MultiLinear (y_i = x W_i^T + b_i, one backward node whose GEMMs accumulate x's
// gradient: no add kernels) and kernels::LinearAdd (residual + x W^T, one addmm). Model code
// calls them for model.kernels fused (kernels/linear.h).
std::vector<at::Tensor> Linears(const at::Tensor& x, at::TensorList weights,
                                at::TensorList biases = {});
at::Tensor LinearAdd(const at::Tensor& residual, const at::Tensor& x, const at::Tensor& w);

// True while a unit's forward (or its recompute) runs under selective activation checkpointing
// on this thread: the outputs of fsdp::Linear, Linears and LinearAdd are then kept for the
// recompute and must not be modified in place (an in-place op on them is an error in
// backward), so model code picks an out-of-place variant (e.g. kernels::Rope instead of
// kernels::RopeInPlace).
bool KeepsMatmulOutputs();

// Forward through a torch::nn::Sequential whose children may be units.
at::Tensor SequentialForward(torch::nn::Module& sequential, const at::Tensor& input);

}  // namespace fsdp
