// Internal to sharding/: activation checkpointing at the FSDP unit seam. FsdpModel calls
// CheckpointedForward from RunUnitForward for the units training.activation_checkpointing
// selects; models see only fsdp::Linear, Linears and LinearAdd (unit_forward.h).
//
// Note [Activation checkpointing]
// A checkpointed unit's forward runs under no-grad, so autograd keeps nothing of it but the
// unit's input (saved by one RecomputeBackward node that becomes the output's grad_fn). When
// backward reaches that node, the unit's pre-backward hook has already run (it is a hook on the
// same output), so the parameters are gathered again; the node then re-runs the unit's forward
// with grad enabled on a detached copy of the input and back-propagates the incoming gradient
// through it (a nested backward on the same thread, as torch.utils.checkpoint's reentrant
// variant). The parameters' gradients accumulate as without checkpointing, so their
// post-accumulate hooks reshard the unit and start its reduce-scatter as usual; the node returns
// the input's gradient to the outer graph. Each unit is recomputed exactly once per backward.
//
//   none        autograd keeps every unit's activations until its backward
//   full        a unit keeps its input: 1 x dim per token instead of the whole block
//   every:k     full for every k-th non-root unit (forward order: index % k == k - 1)
//   selective   as full, and the unit's fsdp::Linear (Linears, LinearAdd) outputs are kept
//               too (recorded in forward, replayed in the recompute through a node with
//               linear's backward: ReplayedLinearBackward, or kernels::MultiLinear's for
//               Linears), so the recompute runs only the ops between matmuls: norms, RoPE,
//               activations, attention's core. (torchtitan's op-level selective AC saves
//               every other matmul's output and attention's, and recomputes the rest: less
//               memory, more recomputed FLOPs; here no matmul runs twice.)
//
// What the recompute must reproduce: the same values from the same input, parameters and
// buffers. Randomness in a unit breaks that, so the first checkpointed forward of each unit
// checks that it drew no random numbers (an error naming training.activation_checkpointing);
// an in-place change to a saved input or matmul output is caught by its version counter. The
// function given to UnitForward is called again in backward: it must capture by value, or
// objects that outlive the backward (the module's `this`).
#pragma once

#include <cstdint>
#include <functional>

#include <ATen/core/Tensor.h>

namespace fsdp {

using UnitFunction = std::function<at::Tensor(const at::Tensor&)>;

struct RecomputeHooks {
  std::function<void()> before;  // in backward, just before the forward is re-run
  std::function<void()> after;   // once it has been re-run (before its backward)
};

// Runs `fn(input)` under no-grad and returns its output with a grad_fn that, in backward,
// re-runs `fn` (calling hooks.before / hooks.after around it) and back-propagates through it.
// `selective` keeps fsdp::Linear's outputs (Note [Activation checkpointing]). For a backward
// that will follow: grad mode on, and the input or the unit's parameters requiring grad.
at::Tensor CheckpointedForward(const at::Tensor& input, UnitFunction fn, bool selective,
                               RecomputeHooks hooks);

// The default generator's state on `device`, to tell whether a forward drew random numbers.
at::Tensor RngState(const c10::Device& device);

}  // namespace fsdp
