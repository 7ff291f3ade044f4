#include "engine/trainable.h"

#include "engine/checkpointing.h"
#include "sharding/fsdp_model.h"

namespace fsdp {
namespace {

class FsdpTrainable final : public TrainableModel {
 public:
  explicit FsdpTrainable(std::unique_ptr<FsdpModel> model) : model_(std::move(model)) {}

  std::vector<at::Tensor> parameters() const override { return model_->parameters(); }
  void BeginMicroBatch(int index, int count) override {
    // HSDP accumulation: reduce-scatter every micro-batch, all-reduce over replicas once.
    if (model_->context().replicate_group != nullptr && model_->context().num_shards > 1) {
      model_->set_requires_all_reduce(index == count - 1);
    }
  }
  at::Tensor ClipGradNorm(double max_norm) override { return model_->ClipGradNorm(max_norm); }
  void AfterStep() override {
    model_->CopyShardsToDevice();                // offload optimizer: See Note [CPU offload]
    state_bytes_ = model_->model_state_bytes();  // gradients still there (before zero_grad)
  }
  ModelStateBytes model_state_bytes() const override { return state_bytes_; }
  absl::Status InitFromSafetensors(const std::string& path) override {
    return fsdp::InitFromSafetensors(path, *model_);
  }
  CommStats& comm_stats() override { return model_->comm_stats(); }
  FsdpModel* fsdp() override { return model_.get(); }

 private:
  std::unique_ptr<FsdpModel> model_;
  ModelStateBytes state_bytes_;
};

}  // namespace

std::unique_ptr<TrainableModel> WrapForTraining(std::unique_ptr<FsdpModel> model) {
  return std::make_unique<FsdpTrainable>(std::move(model));
}

}  // namespace fsdp
