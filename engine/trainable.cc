#include "engine/trainable.h"

#include "engine/checkpointing.h"
#include "sharding/fsdp_model.h"

namespace fsdp {
namespace {

class FsdpTrainable final : public TrainableModel {
 public:
  FsdpTrainable(std::unique_ptr<FsdpModel> model, bool sync_every_micro_batch)
      : model_(std::move(model)), sync_every_micro_batch_(sync_every_micro_batch) {}

  std::vector<at::Tensor> parameters() const override { return model_->parameters(); }
  void BeginMicroBatch(int index, int count) override {
    const bool last = index == count - 1;
    // See Note [No-sync accumulation]: no communication before the last micro-batch.
    if (!sync_every_micro_batch_) model_->set_requires_gradient_sync(last);
    // See Note [Keeping parameters across micro-batches] (fsdp_model.h): the unsharded
    // parameters stay until the last micro-batch's backward, and are gathered afresh after the
    // optimizer step.
    if (!model_->context().options.reshard_between_micro_batches) {
      model_->set_reshard_after_backward(last);
    }
    // HSDP accumulation: reduce-scatter every micro-batch, all-reduce over replicas once.
    if (model_->context().replicate_group != nullptr && model_->context().num_shards > 1) {
      model_->set_requires_all_reduce(last);
    }
    // Offload optimizer: the micro-batches' gradient shards are summed on the device, where the
    // fp32 shards already are, and copied to the host once (Note [CPU offload], "Accumulating
    // on the device"); offload params keeps the device free of them.
    if (model_->context().options.offload == Offload::kOptimizer) {
      model_->set_offload_accumulate_on_device(!last);
    }
  }
  at::Tensor ClipGradNorm(double max_norm) override { return model_->ClipGradNorm(max_norm); }
  void AfterStep() override {
    // The step's last backward resharded every unit: the next forward gathers the new values.
    TORCH_CHECK(model_->NumUnshardedUnits() == 0,
                "FSDP: unsharded parameters kept past the optimizer step (stale copies); the "
                "last micro-batch must run with set_reshard_after_backward(true)");
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
  const bool sync_every_micro_batch_;
  ModelStateBytes state_bytes_;
};

}  // namespace

std::unique_ptr<TrainableModel> WrapForTraining(std::unique_ptr<FsdpModel> model,
                                                bool sync_every_micro_batch) {
  return std::make_unique<FsdpTrainable>(std::move(model), sync_every_micro_batch);
}

}  // namespace fsdp
