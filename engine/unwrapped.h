// The model trained without any wrapper (parallelism.strategy: none): the baseline that
// `fsdp bench compare --unwrapped` measures the FSDP wrappers' overhead against. One rank.
//
// Note [The unwrapped baseline]
// With training.mixed_precision=fp32 the optimizer steps the module's own parameters and
// nothing else happens. With bf16 it does the arithmetic FSDP's mixed precision does, without
// units, hooks or collectives: the module's parameters are bf16 copies of fp32 master
// parameters (the optimizer steps the masters), forward and backward run in bf16, each
// micro-batch's bf16 gradients are added into fp32 master gradients (FSDP reduces them in
// reduce_dtype fp32 and accumulates the fp32 shards), and after the step the masters are cast
// back into the module. So at world size 1 its losses agree with fsdp.cpp's and FSDP2's to
// rounding, and the step-time difference is the wrapper's cost. (torchtitan's non-FSDP path
// uses autocast instead, which keeps more operators in fp32: a slower baseline that would
// flatter the wrappers.) Checkpointing is not supported in this mode.
//
//   UnwrappedModel plain(model.ptr(), at::kBFloat16);
//   optimizer(plain.parameters());
//   per micro-batch: loss.backward(); plain.AfterBackward();
//   plain.ClipGradNorm(1.0); optimizer.step(); plain.AfterStep(); optimizer.zero_grad();
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/status.h"
#include "engine/trainable.h"

namespace torch::nn {
class Module;
}

namespace fsdp {

class UnwrappedModel final : public TrainableModel {
 public:
  // `compute_dtype` kFloat: the module trains as is; kBFloat16: the module's parameters become
  // bf16 copies of fp32 masters (buffers too, as the units' casts would see them).
  UnwrappedModel(std::shared_ptr<torch::nn::Module> module, at::ScalarType compute_dtype);

  // What the optimizer steps: the trainable fp32 masters (bf16) or module parameters (fp32).
  std::vector<at::Tensor> parameters() const override;
  // After each backward: bf16 gradients added into the masters' fp32 gradients.
  void AfterBackward() override;
  // Clips the masters' gradients by their 2-norm; returns the norm before clipping (0-dim fp32
  // tensor on the device, no host synchronisation).
  at::Tensor ClipGradNorm(double max_norm) override;
  // After the optimizer step: the masters cast back into the module's parameters.
  void AfterStep() override;
  // The parameters from a safetensors file with the state-dict names (model.init_from).
  absl::Status InitFromSafetensors(const std::string& path) override;
  CommStats& comm_stats() override { return no_comm_; }

 private:
  std::shared_ptr<torch::nn::Module> module_;
  bool mixed_ = false;
  std::vector<std::string> names_;
  std::vector<at::Tensor> params_;   // the module's, all (bf16 when mixed)
  std::vector<at::Tensor> masters_;  // fp32, one per params_ (the same tensors when not mixed)
  std::vector<size_t> trainable_;    // indices of the trainable ones
  CommStats no_comm_;                // no collectives: stays zero
};

}  // namespace fsdp
