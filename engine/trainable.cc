#include "engine/trainable.h"

#include <unordered_set>

#include "engine/checkpointing.h"
#include "engine/optimizer.h"
#include "sharding/fsdp_model.h"

namespace fsdp {
namespace {

// Note [Overlapped host step]
// With parallelism.offload the optimizer steps the fp32 masters on the host (Note [CPU
// offload], sharding/offload/host_offload.h), and done in place (optimizer.step(), then the
// masters' cast or copy for the device) the device sits idle through all of it: the next forward
// needs the new values. But it needs them a unit at a time, in forward order, and each unit's
// update reads only that unit's tensors (the clipping, which needs every gradient, is over by
// then). So StepOverlapped prepares the step on the training thread (engine/optimizer.h: Note
// [Prepared steps]: states, counters, learning rate taken) and FsdpModel::StepOnHost queues it on
// HostOffload's thread, unit after unit in forward order, each followed by the refresh of the
// unit's bf16 host copy (offload=params); the trainer goes on to the next step at once. A unit's
// next unshard waits for its own step (HostOffload::LoadShards; a prefetch does not wait, it
// leaves the unit to its unshard), so the first units' forward runs while the host steps the
// later ones: the host's step overlaps the next forward instead of preceding it. The values are
// the in-place step's, bit for bit (same kernels, same per-tensor arithmetic, any split). The
// gradients stay with the prepared step: the .grad slots are reset here (the next backward
// writes new tensors), and the host gradient buffers they alias are written again only by the
// next backward, after its forward waited for every unit. Everything else that reads or writes
// the masters or the optimizer's state first waits for the whole step: checkpoint saves and
// loads (Checkpointer), CopyShardsToDevice, the end of training (TrainableModel::FinishStep);
// evaluation forwards wait unit by unit like training ones. Costs: none in memory; rank_stats'
// offload section says how much of the host's step the forward hid (host_step_ms against
// step_wait_ms, the training thread's wait). FSDP_OFFLOAD_OVERLAP_STEP=0 (debugging) steps in
// place (the step's time is then all exposed: optimizer_step_ms).

class FsdpTrainable final : public TrainableModel {
 public:
  FsdpTrainable(std::unique_ptr<FsdpModel> model, bool sync_every_micro_batch,
                DelayedUpdate delayed)
      : model_(std::move(model)),
        sync_every_micro_batch_(sync_every_micro_batch),
        delayed_(delayed) {}

  std::vector<at::Tensor> parameters() const override { return model_->parameters(); }
  void BeginStep(int64_t step) override { delayed_now_ = delayed_.At(step); }
  void BeginMicroBatch(int index, int count) override {
    const bool last = index == count - 1;
    // Note [Deferred clipping multiplication] (offload/deferred_grads.h): the norm's terms on the
    // host's thread as the last micro-batch's gradients land.
    model_->set_offload_final_gradients(last);
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
    state_bytes_ = model_->model_state_sizes();  // gradients still there (before zero_grad)
  }
  bool StepOverlapped(torch::optim::Optimizer& optimizer) override {
    if (model_->context().offload == nullptr || !model_->context().options.offload_overlap_step ||
        !StepsOnlyMasters(optimizer)) {
      model_->MaterializeDeferredGradients();  // optimizer.step() reads the .grads
      return false;
    }
    const ModelStateBytes state_bytes = model_->model_state_sizes();  // gradients still there
    std::shared_ptr<PreparedStep> prepared = PrepareStep(optimizer);
    if (prepared == nullptr) {
      model_->MaterializeDeferredGradients();
      return false;
    }
    state_bytes_ = state_bytes;
    // The prepared step holds the gradient tensors; the .grad slots go now, before the host
    // thread reads those tensors (zero_grad would detach_ them in place).
    for (const at::Tensor& p : prepared->params()) p.mutable_grad().reset();
    HostStep step;
    step.run = [prepared](const std::vector<at::Tensor>& unit_masters) {
      prepared->Run(unit_masters);
    };
    // Note [Deferred gradient conversion] (sharding/offload/deferred_grads.h): deferred gradients
    // in slices.
    step.can_run_slices = [prepared](const at::Tensor& p) { return prepared->CanRunSlices(p); };
    step.run_slice = [prepared](const at::Tensor& p, int64_t begin, int64_t n) {
      prepared->RunSlice(p, begin, n);
    };
    step.slices_done = [prepared](const at::Tensor& p) { prepared->SlicesDone(p); };
    step.run_host_pass = [prepared](const at::Tensor& p, const at::Tensor& grad, float scale,
                                    const at::Tensor& copy) {
      return prepared->RunHostPass(p, grad, scale, copy);
    };
    model_->StepOnHost(std::move(step), delayed_now_ && model_->context().offload->can_delay());
    return true;
  }
  void AllowDeferredGradients() override {
    const FsdpOptions& options = model_->context().options;
    model_->set_offload_defer_conversion(options.offload == Offload::kParams &&
                                         options.offload_overlap_step);
    model_->set_offload_defer_clip_multiply(options.offload_overlap_step);
  }
  void FinishStep() override { model_->FinishHostStep(); }
  void AfterSkippedStep() override {
    if (delayed_now_) FinishStep();
  }
  void BeforeEvaluate() override {
    if (delayed_.enabled) FinishStep();
  }

  // Whether every parameter `optimizer` steps is one of the units' masters (the overlapped step
  // runs unit by unit; else it runs in place). Checked once per optimizer, not every step.
  bool StepsOnlyMasters(const torch::optim::Optimizer& optimizer) {
    if (checked_optimizer_ == &optimizer) return steps_only_masters_;
    std::unordered_set<const c10::TensorImpl*> masters;
    for (const at::Tensor& p : model_->parameters()) masters.insert(p.unsafeGetTensorImpl());
    steps_only_masters_ = true;
    for (const auto& group : optimizer.param_groups()) {
      for (const at::Tensor& p : group.params()) {
        steps_only_masters_ = steps_only_masters_ && masters.count(p.unsafeGetTensorImpl()) > 0;
      }
    }
    checked_optimizer_ = &optimizer;
    return steps_only_masters_;
  }
  // The last step's sizes, with what of the gradients committed on demand has been written by
  // now (asked of the kernel here, not at every step).
  ModelStateBytes model_state_bytes() const override {
    ModelStateBytes bytes = state_bytes_;
    model_->CountResidentBytes(bytes);
    return bytes;
  }
  absl::Status InitFromSafetensors(const std::string& path) override {
    return fsdp::InitFromSafetensors(path, *model_);
  }
  CommStats& comm_stats() override { return model_->comm_stats(); }
  FsdpModel* fsdp() override { return model_.get(); }

 private:
  std::unique_ptr<FsdpModel> model_;
  const bool sync_every_micro_batch_;
  const DelayedUpdate delayed_;
  bool delayed_now_ = false;  // the delayed update applies to the step begun
  ModelStateBytes state_bytes_;
  const torch::optim::Optimizer* checked_optimizer_ = nullptr;  // StepsOnlyMasters' cache
  bool steps_only_masters_ = false;
};

}  // namespace

std::unique_ptr<TrainableModel> WrapForTraining(std::unique_ptr<FsdpModel> model,
                                                bool sync_every_micro_batch,
                                                DelayedUpdate delayed) {
  return std::make_unique<FsdpTrainable>(std::move(model), sync_every_micro_batch, delayed);
}

}  // namespace fsdp
