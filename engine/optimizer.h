// The optimizers a run can use (the YAML `optimizer` section), built in one place, and the names
// their per-parameter state is saved under in a checkpoint ("optim/<param>/exp_avg", ...).
// Not collective: each rank builds its optimizer over its own shards.
//
//   OptimizerOptions options{.kind = *ParseOptimizerKind("adamw"), .lr = 1e-3};  // fused
//   std::unique_ptr<torch::optim::Optimizer> opt = BuildOptimizer(options, model.parameters());
//   SetLearningRate(*opt, 5e-4);                                 // every param group
//   for (const OptimizerStateTensor& s : StateTensors(*opt->state().begin()->second))
//     ... s.name ("exp_avg", "exp_avg_sq" or "momentum_buffer"), *s.tensor ...
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <torch/optim/optimizer.h>

namespace fsdp {

enum class OptimizerKind { kAdamW, kAdam, kSgd };

// How a step runs (YAML `optimizer.implementation`); every one keeps the same state under the
// same names, so a checkpoint saved with one resumes with another (to rounding).
enum class OptimizerImplementation {
  // ATen's fused multi-tensor kernels (at::_fused_adamw_ / _fused_adam_ / _fused_sgd_): one
  // launch per (device, dtype) group on CUDA, one vectorized pass on CPU. The default.
  kFused,
  // ATen's _foreach_ ops: a handful of multi-tensor launches per group (PyTorch's foreach=True).
  kForeach,
  // libtorch's torch::optim classes: several elementwise ops per parameter.
  kPerTensor,
};
std::string_view OptimizerImplementationName(OptimizerImplementation implementation);
std::optional<OptimizerImplementation> ParseOptimizerImplementation(std::string_view name);
std::vector<std::string> OptimizerImplementationNames();

std::string_view OptimizerKindName(OptimizerKind kind);  // "adamw" | "adam" | "sgd"
// The kind named `name` (exact, lower case), or nullopt.
std::optional<OptimizerKind> ParseOptimizerKind(std::string_view name);
// Every kind's name, in enum order: for "valid: ..." messages.
std::vector<std::string> OptimizerKindNames();

struct OptimizerOptions {  // the YAML `optimizer` section, typed
  OptimizerKind kind = OptimizerKind::kAdamW;
  double lr = 3e-3;
  double weight_decay = 0.1;
  double beta1 = 0.9;   // adam, adamw
  double beta2 = 0.95;  // adam, adamw
  double eps = 1e-8;    // adam, adamw
  double momentum = 0.9;  // sgd
  OptimizerImplementation implementation = OptimizerImplementation::kFused;
};

// torch::optim::AdamW / Adam / SGD over `params` with the options' hyper-parameters (Adam's
// weight decay is L2 added to the gradient, AdamW's is decoupled, as in torch), stepping with
// `options.implementation`. Whatever the implementation the optimizer is a torch::optim::AdamW /
// Adam / SGD with libtorch's state, so KindOf, StateTensors, StepCounter and checkpoints do not
// change; fused and foreach agree with per_tensor to rounding (~1e-7 relative per step), not
// bitwise. See Note [Fused optimizer steps] (engine/optimizer.cc).
std::unique_ptr<torch::optim::Optimizer> BuildOptimizer(const OptimizerOptions& options,
                                                        std::vector<at::Tensor> params);

// Sets the learning rate of every parameter group.
void SetLearningRate(torch::optim::Optimizer& optimizer, double lr);

// Note [Prepared steps]
// A step split in two: PrepareStep does, on the calling thread, everything optimizer.step()
// does but the arithmetic (the states of parameters stepped for the first time, the step
// counters advanced, the hyper-parameters and the gradients' tensors taken), and Run does the
// arithmetic later, on any thread, a subset of the parameters at a time: the offloaded host
// step that overlaps the next forward (Note [Overlapped host step] in engine/trainable.cc).
// Each tensor's update reads only its own tensors, so any split gives the values of step(),
// bit for bit. After PrepareStep the optimizer may be changed (a new learning rate, zero_grad:
// .grad reset, not the gradient tensors) without changing what Run computes; its state
// tensors must not be read or written until every parameter ran.
class PreparedStep {
 public:
  virtual ~PreparedStep() = default;
  // The parameters the step updates (those that had a gradient).
  virtual const std::vector<at::Tensor>& params() const = 0;
  // Updates those of `params` the step covers and has not updated yet; ignores the others.
  virtual void Run(at::TensorList params) = 0;
  // Parameters not updated yet.
  virtual size_t remaining() const = 0;

  // Slices (Note [Deferred gradient conversion] in sharding/offload/deferred_grads.h): the update
  // of elements [begin, begin + n) of `param`'s flattened tensors, for a caller that converts and
  // scales a gradient chunk by chunk and steps each chunk while it is in cache, on several threads
  // at once (disjoint slices: concurrent calls are safe). With every slice beginning at a multiple
  // of 16 elements the values are Run's, bit for bit (ATen's fused kernels are elementwise and
  // group elements by 64-byte units from the tensor's start). After a parameter's last slice,
  // SlicesDone(param) (not concurrent with anything). CanRunSlices: whether `param` is covered and
  // not updated yet, and the step can run slices (the fused implementation can; foreach cannot:
  // false, and the caller uses Run).
  virtual bool CanRunSlices(const at::Tensor& /*param*/) const { return false; }
  virtual void RunSlice(const at::Tensor& param, int64_t begin, int64_t n) const;
  virtual void SlicesDone(const at::Tensor& param);
  // The whole update of `param` (fp32, covered, not updated yet) from `grad` (bf16 or fp32,
  // param's numel; undefined: the gradient the step took) times `scale`, in one loop that also
  // casts the result into `copy` (bf16, at least param's numel; fp32: copied after the loop;
  // undefined: none): Note [Host Adam pass] (engine/host_adam.cc), the values of converting,
  // scaling, Run and copy_, bit for bit. False when this step or machine cannot
  // (foreach, amsgrad, Adam's L2 decay, another dtype, a CPU whose ATen kernels it does not
  // match), having changed nothing. SlicesDone(param) follows, as after slices.
  virtual bool RunHostPass(const at::Tensor& /*param*/, const at::Tensor& /*grad*/,
                           float /*scale*/, const at::Tensor& /*copy*/) const {
    return false;
  }
};

// The step of `optimizer` prepared (above), or nullptr when its implementation has no
// prepared form: fused and foreach Adam / AdamW do; SGD and the per_tensor implementation step
// only through optimizer.step().
std::unique_ptr<PreparedStep> PrepareStep(torch::optim::Optimizer& optimizer);

// ---- per-parameter state, as checkpoints name it ----

// The kind of an optimizer BuildOptimizer made; nullopt for any other optimizer.
std::optional<OptimizerKind> KindOf(const torch::optim::Optimizer& optimizer);

// Names of the state tensors (each shaped like its parameter) that `kind` keeps per parameter:
// adam / adamw {"exp_avg", "exp_avg_sq"}, sgd {"momentum_buffer"}.
std::vector<std::string_view> StateTensorNames(OptimizerKind kind);

struct OptimizerStateTensor {
  std::string_view name;  // one of StateTensorNames(kind)
  at::Tensor* tensor;     // inside the state; may be undefined (e.g. SGD before its first step)
};
// The state tensors of one parameter's state, by checkpoint name, in StateTensorNames order;
// empty for a state of another optimizer.
std::vector<OptimizerStateTensor> StateTensors(torch::optim::OptimizerParamState& state);

// Bytes of every state tensor the optimizer holds (exp_avg, exp_avg_sq, momentum_buffer...).
int64_t OptimizerStateBytes(torch::optim::Optimizer& optimizer);

// The state's step counter (adam, adamw), or nullptr (sgd has none).
int64_t* StepCounter(torch::optim::OptimizerParamState& state);

// A fresh per-parameter state of the optimizer's kind (tensors undefined, step 0), to fill from
// a checkpoint and put into optimizer.state(); an SGD state for an optimizer of unknown kind.
std::unique_ptr<torch::optim::OptimizerParamState> NewParamState(
    const torch::optim::Optimizer& optimizer);

}  // namespace fsdp
