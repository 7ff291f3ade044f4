// FsdpModel's runtime: the forward/backward hooks and the iteration's ordering.
// Wrapping (parameter ownership, checks, sharding) is in wrap.cc.
#include "sharding/fsdp_model.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <mutex>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>

#include "sharding/activation_checkpoint.h"
#include "sharding/registry.h"
#include "sharding/unit_forward.h"

namespace fsdp {

at::Tensor UnitForward(torch::nn::Module* module, const at::Tensor& input,
                       const std::function<at::Tensor(const at::Tensor&)>& fn) {
  UnitEntry entry = LookupUnit(module);
  if (entry.model == nullptr) return fn(input);
  return entry.model->RunUnitForward(*entry.unit, input, fn);
}

at::Tensor SequentialForward(torch::nn::Module& sequential, const at::Tensor& input) {
  auto* seq = dynamic_cast<torch::nn::SequentialImpl*>(&sequential);
  TORCH_CHECK(seq != nullptr, "SequentialForward needs a torch::nn::Sequential, got ",
              sequential.name());
  at::Tensor x = input;
  for (auto& child : *seq) {
    // By value: activation checkpointing calls the function again in backward.
    x = UnitForward(child.ptr().get(), x, [child](const at::Tensor& h) mutable {
      return child.forward<at::Tensor>(h);
    });
  }
  return x;
}

FsdpModel::~FsdpModel() {
  for (auto& unit : units_) UnregisterUnit(unit->module());
}

std::vector<at::Tensor> FsdpModel::parameters() const {
  std::vector<at::Tensor> out;
  for (const auto& unit : units_) {
    for (const FsdpParam& p : unit->params()) {
      if (p.requires_grad) out.push_back(p.sharded);
    }
  }
  return out;
}

std::vector<std::pair<std::string, at::Tensor>> FsdpModel::named_parameters() const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& unit : units_) {
    for (const FsdpParam& p : unit->params()) out.emplace_back(p.names[0], p.sharded);
  }
  return out;
}

const FsdpParam* FsdpModel::FindParam(const std::string& name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : it->second;
}

int64_t FsdpModel::FirstLocalRow(const FsdpParam& param) const {
  return param.sharding.FirstRow(ctx_.shard_rank);
}

at::Tensor FsdpModel::GatherFullParameter(const FsdpParam& param) {
  at::NoGradGuard no_grad;
  const ParamSharding& s = param.sharding;
  // See Note [CPU offload]: the host master is always there, the device shard may not be.
  const at::Tensor& source = param.host != nullptr ? param.host->shard : param.padded_shard;
  at::Tensor shard = source.to(ctx_.device).contiguous().view(-1);
  at::Tensor full = at::empty({s.padded_numel()}, shard.options());
  if (ctx_.num_shards == 1) {
    full.copy_(shard);
  } else {
    ctx_.shard_group->AllGatherInto(full, shard)->wait();
  }
  std::vector<int64_t> shape = s.shape;
  return full.narrow(0, 0, s.numel()).view(shape);
}

std::vector<const FsdpUnit*> FsdpModel::units() const {
  std::vector<const FsdpUnit*> out;
  if (order_final_) {
    out.assign(order_.begin(), order_.end());
  } else {
    for (const auto& u : units_) out.push_back(u.get());
  }
  return out;
}

int FsdpModel::NumUnshardedUnits() const {
  int n = 0;
  for (const auto& unit : units_) n += !unit->is_root() && unit->HoldsUnsharded();
  return n;
}

void FsdpModel::UpdateMemoryStats() {
  int units = 0;
  int64_t bytes = 0;
  for (const auto& unit : units_) {
    if (unit->is_root()) continue;
    units += unit->HoldsUnsharded();
    bytes += unit->UnshardedBytes();
  }
  memory_.peak_unsharded_units = std::max(memory_.peak_unsharded_units, units);
  memory_.peak_unsharded_bytes = std::max(memory_.peak_unsharded_bytes, bytes);
}

namespace {

// kSharded or kShardedPostForward: an Unshard() would issue an all-gather.
bool IsSharded(const FsdpUnit& unit) {
  return unit.state() == FsdpUnit::ShardedState::kSharded ||
         unit.state() == FsdpUnit::ShardedState::kShardedPostForward;
}

}  // namespace

void FsdpModel::EnsureUnsharded(FsdpUnit& unit) {
  if (IsSharded(unit)) unit.Unshard();  // not prefetched
  if (unit.state() == FsdpUnit::ShardedState::kGathering) unit.WaitForUnshard();
}

FsdpUnit* FsdpModel::Neighbour(const FsdpUnit& unit, int step) const {
  if (!order_final_) return nullptr;
  for (size_t i = 0; i < order_.size(); ++i) {
    if (order_[i] != &unit) continue;
    int64_t j = static_cast<int64_t>(i) + step;
    if (j < 0 || j >= static_cast<int64_t>(order_.size())) return nullptr;
    return order_[j]->is_root() ? nullptr : order_[j];
  }
  return nullptr;
}

// See Note [Rank-identical prefetch] (fsdp_model.h): everything below reads only the forward
// order, the units' states and the options.
// Note [Prefetch limit]: with reshard after forward, at most max_unsharded_units non-root
// units hold or gather unsharded parameters at once (the current one included): the engine
// gathers up to max_unsharded_units - 1 units ahead (in forward order during forward, in
// reverse during backward), so peak memory is bounded by that many units. Without resharding
// after forward (ZeRO-2) every unit stays unsharded until its backward by design, and one unit
// is prefetched ahead; so with units kept across micro-batches (Note [Keeping parameters
// across micro-batches] in fsdp_model.h).
void FsdpModel::Prefetch(const FsdpUnit& current, int direction) {
  const bool limited =
      ctx_.options.reshard_after_forward && ctx_.options.reshard_between_micro_batches;
  const int depth = limited ? ctx_.options.max_unsharded_units - 1 : 1;
  // Offloaded shards (Note [CPU offload]): their host->device copies run one unit ahead.
  for (int step = 1; ctx_.offload && step <= depth + 1; ++step) {
    if (FsdpUnit* unit = Neighbour(current, direction * step)) {
      unit->LoadDeviceShards(/*wait=*/false);  // not while the host steps it (Note [Overlapped host step])
    }
  }
  // One shard (Note [One shard]): no collective to start early. The unshard is an alias or a
  // cast on the compute stream, which costs the same later, and done here it would hold its
  // memory sooner; with offload it would also make the compute stream wait for the copies
  // just issued above before the current unit's own work, so they would not overlap it.
  if (ctx_.num_shards == 1) return;
  // These issue all-gathers, so whether they run must not depend on timing: with an overlapped
  // host step in flight (Note [Overlapped host step]) the prefetched unit's Unshard waits for
  // its update rather than being skipped while the update runs, as the copies above are.
  for (int step = 1; step <= depth; ++step) {
    FsdpUnit* unit = Neighbour(current, direction * step);
    if (unit == nullptr) return;
    if (!IsSharded(*unit)) continue;  // gathered or gathering already
    if (limited && NumUnshardedUnits() >= ctx_.options.max_unsharded_units) return;
    unit->Unshard();
    UpdateMemoryStats();
  }
}

bool FsdpModel::IsCheckpointed(const FsdpUnit& unit) const {
  if (unit.is_root()) return false;
  int index = 0;  // among the non-root units, in wrapping (= forward) order
  for (const auto& u : units_) {
    if (u.get() == &unit) return ctx_.options.activation_checkpointing.Applies(index);
    index += !u->is_root();
  }
  return false;
}

int64_t FsdpModel::Recomputes(const FsdpUnit& unit) const {
  auto it = recomputes_.find(&unit);
  return it == recomputes_.end() ? 0 : it->second;
}

at::Tensor FsdpModel::RunUnitForward(FsdpUnit& unit, const at::Tensor& input,
                                     const std::function<at::Tensor(const at::Tensor&)>& fn) {
  // See Note [Nested UnitForward of one unit]: the unit's forward is already running.
  if (unit.training_state() == FsdpUnit::TrainingState::kForward || in_checkpoint_ == &unit) {
    return fn(input);
  }
  TORCH_CHECK(in_checkpoint_ == nullptr, "training.activation_checkpointing: unit '",
              in_checkpoint_ != nullptr ? in_checkpoint_->name() : "", "' runs the forward of unit '",
              unit.name(), "' inside its own; a checkpointed unit cannot contain other units "
              "(choose units that do not nest, or activation_checkpointing: none)");
  PreForward(unit);
  at::Tensor x = input;
  const auto& dtype = ctx_.options.mixed_precision.param_dtype;
  if (dtype && x.defined() && at::isFloatingType(x.scalar_type()) && x.scalar_type() != *dtype) {
    x = x.to(*dtype);
  }
  const bool backward_follows =
      at::GradMode::is_enabled() && ((x.defined() && x.requires_grad()) || unit.num_trainable() > 0);
  if (unit.is_root()) {  // never checkpointed
    at::Tensor output;
    try {
      output = fn(x);
    } catch (const c10::Error& error) {
      ExplainShardedUse(error);  // See Note [Parameters used while sharded].
      throw;
    }
    return PostForward(unit, std::move(output));
  }
  if (!backward_follows || !IsCheckpointed(unit)) return PostForward(unit, fn(x));
  return PostForward(unit, CheckpointUnitForward(unit, x, fn));
}

namespace {

// The sizes in ATen's "setStorage: sizes [8, 16], strides ..." message; empty if none.
std::vector<int64_t> FailingSizes(const std::string& message) {
  std::vector<int64_t> sizes;
  const size_t begin = message.find("sizes [");
  const size_t end = message.find(']', begin);
  if (begin == std::string::npos || end == std::string::npos) return sizes;
  std::string list = message.substr(begin + 7, end - begin - 7);
  for (size_t pos = 0; pos < list.size();) {
    size_t next = list.find(',', pos);
    if (next == std::string::npos) next = list.size();
    try {
      sizes.push_back(std::stoll(list.substr(pos, next - pos)));
    } catch (const std::exception&) {
      return {};
    }
    pos = next + 1;
  }
  return sizes;
}

}  // namespace

void FsdpModel::ExplainShardedUse(const c10::Error& error) const {
  const std::string message = error.what_without_backtrace();
  if (message.find("out of bounds for storage of size 0") == std::string::npos) return;
  const std::vector<int64_t> sizes = FailingSizes(message);
  const FsdpUnit* culprit = nullptr;
  const FsdpParam* param = nullptr;
  for (const auto& unit : units_) {  // wrapping order
    if (unit->is_root() || unit->forwarded() || unit->HoldsUnsharded()) continue;
    for (const FsdpParam& p : unit->params()) {
      if (sizes.empty() || p.param.sizes().vec() == sizes) {
        param = &p;
        break;
      }
    }
    if (param != nullptr) {
      culprit = unit.get();
      break;
    }
  }
  if (culprit == nullptr) return;
  const std::string first_line = message.substr(0, message.find('\n'));
  TORCH_CHECK(false, "FSDP unit '", culprit->name(), "' (", culprit->module()->name(),
              ") was used while sharded: its parameters (e.g. '", param->names[0], "' ",
              param->param.sizes(),
              ") have no memory outside its forward, and its forward did "
              "not go through fsdp::UnitForward. Route ",
              culprit->module()->name(),
              "::forward through fsdp::UnitForward(this, x, fn) (sharding/unit_forward.h) and "
              "call the module itself, not its submodules, from its parent. (ATen: ",
              first_line, ")");
}

at::Tensor FsdpModel::CheckpointUnitForward(FsdpUnit& unit, const at::Tensor& x,
                                            const std::function<at::Tensor(const at::Tensor&)>& fn) {
  // Once per unit: a forward that draws random numbers would not be reproduced by its
  // recompute (the generator has moved on), so it cannot be checkpointed.
  bool& checked = rng_checked_[&unit];
  at::Tensor rng_before = checked ? at::Tensor() : RngState(ctx_.device);
  FsdpUnit* u = &unit;
  RecomputeHooks hooks{
      .before =
          [this, u] {
            TORCH_CHECK(u->state() == FsdpUnit::ShardedState::kUnsharded,
                        "activation checkpointing: unit '", u->name(), "' is ",
                        StateName(u->state()), " when its forward is re-run in backward");
            ++recomputes_[u];
            in_checkpoint_ = u;
          },
      .after = [this] { in_checkpoint_ = nullptr; }};
  const bool selective = ctx_.options.activation_checkpointing.mode ==
                         ActivationCheckpointing::Mode::kSelective;
  in_checkpoint_ = &unit;  // cleared however the forward ends
  struct Clear {
    const FsdpUnit*& slot;
    ~Clear() { slot = nullptr; }
  } clear{in_checkpoint_};
  at::Tensor out = CheckpointedForward(x, fn, selective, std::move(hooks));
  if (!checked) {
    TORCH_CHECK(at::equal(rng_before, RngState(ctx_.device)),
                "training.activation_checkpointing: unit '", unit.name(),
                "' draws random numbers in its forward (dropout?), which its recompute in "
                "backward would not reproduce; use activation_checkpointing: none, or a unit "
                "without randomness");
    checked = true;
  }
  return out;
}

void FsdpModel::PreForward(FsdpUnit& unit) {
  if (unit.is_root()) {
    // A new iteration: the last forward need not have been followed by a backward.
    if (forward_without_backward_) {
      // See Note [Forward without backward]: what it left unsharded may be stale.
      for (auto& u : units_) ReshardFully(*u);
    }
    forward_without_backward_ = true;
    // See Note [zero_grad on the module]: before this forward, so that no parameter used after
    // the root's forward returns (a head applied to its output) accumulates into a sentinel.
    ApplyModuleZeroGrad();
    for (auto& u : units_) u->ResetIteration();
  }
  unit.BeginForward();
  EnsureUnsharded(unit);
  UpdateMemoryStats();
  if (order_final_) {
    Prefetch(unit, +1);
  } else {
    order_.push_back(&unit);
  }
}

at::Tensor FsdpModel::PostForward(FsdpUnit& unit, at::Tensor output) {
  unit.EndForward();
  const bool backward_follows = at::GradMode::is_enabled();
  if (unit.is_root()) {
    order_final_ = true;
    if (!backward_follows) {
      // No backward will follow (evaluation): give every unit's memory back now, post-forward
      // shards included (they are a copy that a later optimizer step or checkpoint load
      // would make stale).
      for (auto& u : units_) ReshardFully(*u);
      forward_without_backward_ = false;
    }
    const auto& out_dtype = ctx_.options.mixed_precision.output_dtype;
    if (out_dtype && output.defined() && at::isFloatingType(output.scalar_type())) {
      output = output.to(*out_dtype);
    }
  } else if (ctx_.options.reshard_after_forward &&
             (ctx_.options.reshard_between_micro_batches || !backward_follows)) {
    // Kept for the backward and the next micro-batches otherwise: Note [Keeping parameters
    // across micro-batches] (fsdp_model.h).
    // See Note [Reshard to a sub-group] (collectives.h): only worth its memory for a backward.
    if (ctx_.reshard_group && backward_follows) {
      unit.ReshardAfterForward();
    } else {
      unit.Reshard();
    }
  }
  if (output.defined() && output.requires_grad()) {
    FsdpUnit* u = &unit;
    output.register_hook([this, u](const at::Tensor&) { PreBackward(*u); });
  }
  return output;
}

void FsdpModel::PreBackward(FsdpUnit& unit) {
  // A unit that ran more than once in forward has one hook per output: only the first counts.
  if (unit.training_state() != FsdpUnit::TrainingState::kIdle) return;
  if (!backward_started_) {
    ApplyModuleZeroGrad();  // before any accumulation or collective of this backward
    backward_started_ = true;
    torch::autograd::Engine::get_default_engine().queue_callback([this] { FinishBackward(); });
  }
  unit.BeginPreBackward();
  EnsureUnsharded(unit);
  UpdateMemoryStats();
  Prefetch(unit, -1);
}

void FsdpModel::OnGradAccumulated(FsdpUnit& unit) {
  if (unit.CountGradAccumulated() == 0 &&
      unit.training_state() != FsdpUnit::TrainingState::kPostBackward) {
    if (ctx_.reshard_after_backward) ReshardFully(unit);
    unit.PostBackward();
    // At most two units' reduce-scatters in flight: the one just issued overlaps the wait
    // for the previous one, whose full-size gradient buffer is then freed.
    if (last_reducing_ != nullptr && last_reducing_ != &unit) last_reducing_->WaitForReduceScatter();
    last_reducing_ = &unit;
  }
}

namespace {

// End of a backward that keeps the parameters for the next micro-batch: a gather in flight is
// finished (kept), a post-forward shard (a unit resharded to a sub-group whose backward did not
// run) dropped; kUnsharded and kSharded stay as they are.
void KeepUnsharded(FsdpUnit& unit) {
  if (unit.state() == FsdpUnit::ShardedState::kGathering) unit.WaitForUnshard();
  if (unit.state() == FsdpUnit::ShardedState::kShardedPostForward) unit.DropPostForwardShard();
}

}  // namespace

void FsdpModel::FinishBackward() {
  // Units whose parameters did not all get gradients (unused, frozen-only) finish here.
  for (auto it = order_.rbegin(); it != order_.rend(); ++it) {
    FsdpUnit* unit = *it;
    if (ctx_.reshard_after_backward) {
      ReshardFully(*unit);
    } else {
      KeepUnsharded(*unit);  // See Note [Keeping parameters across micro-batches].
    }
    if (unit->num_trainable() > 0 &&
        unit->training_state() != FsdpUnit::TrainingState::kPostBackward) {
      unit->PostBackward();
    }
  }
  for (auto it = order_.rbegin(); it != order_.rend(); ++it) (*it)->FinishGradients();
  if (ctx_.offload) ctx_.offload->WaitForCopies(*ctx_.streams);  // See Note [CPU offload]
  last_reducing_ = nullptr;
  for (auto& u : units_) u->ResetIteration();
  backward_started_ = false;
  forward_without_backward_ = false;
  LeaveGradSentinels();
}

void FsdpModel::LeaveGradSentinels() {
  for (auto& unit : units_) {
    for (FsdpParam& p : unit->params()) {
      p.grad_sentinel_set = p.requires_grad && !p.param.grad().defined();
      if (p.grad_sentinel_set) p.param.mutable_grad() = p.grad_sentinel;
    }
  }
}

void FsdpModel::ApplyModuleZeroGrad() {
  at::NoGradGuard no_grad;
  for (auto& unit : units_) {
    for (FsdpParam& p : unit->params()) {
      if (!p.grad_sentinel_set) continue;
      p.grad_sentinel_set = false;
      at::Tensor& grad = p.param.mutable_grad();
      at::Tensor& shard_grad = p.sharded.mutable_grad();
      if (grad.defined() && grad.is_same(p.grad_sentinel)) {
        grad.reset();  // untouched: the shard's gradient stays
      } else if (!grad.defined()) {
        shard_grad.reset();  // module->zero_grad() (set_to_none)
      } else {
        grad.reset();  // module->zero_grad(false): a zeroed copy of the sentinel
        if (shard_grad.defined()) shard_grad.zero_();
      }
    }
  }
}

// On CUDA, multi-tensor kernels (a few launches for all gradients of a dtype, not four per
// gradient: ~590 launches and 3.3 ms per llama_1b step on an H200): each gradient's norm in
// fp32, whatever its dtype, then the sum of their squares. On the CPU, where a launch costs
// nothing, each gradient's sum of squares directly (no square root and square again: the
// bf16 parity tests' 1e-4 tolerance against a single-process reference was set with these
// sums, and the other rounding moved a bf16 cast at step 7 of full_shard_w3_bf16 past it).
std::vector<at::Tensor> ClipNormTerms(const std::vector<at::Tensor>& grads) {
  at::NoGradGuard no_grad;
  if (!grads.empty() && grads.front().is_cuda()) return at::_foreach_norm(grads, 2, at::kFloat);
  std::vector<at::Tensor> terms;
  terms.reserve(grads.size());
  for (const at::Tensor& g : grads) terms.push_back(g.to(at::kFloat).pow(2).sum());
  return terms;
}

ClipNorm ClipNormFromTerms(const std::vector<at::Tensor>& terms, double max_norm,
                           c10::Device device, ProcessGroup* sum_over) {
  at::NoGradGuard no_grad;
  at::Tensor sum_sq;
  if (!terms.empty() && terms.front().is_cuda()) {
    sum_sq = at::stack(terms).square().sum();
  } else {
    sum_sq = at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(device));
    for (const at::Tensor& t : terms) sum_sq += t;
  }
  if (sum_over != nullptr) sum_over->AllReduce(sum_sq)->wait();
  // All on the device: no host synchronisation (the caller may read the norm when it logs).
  ClipNorm clip;
  clip.norm = sum_sq.sqrt();
  if (max_norm != kNoClipping) clip.coef = (max_norm / (clip.norm + 1e-6)).clamp_max(1.0);
  return clip;
}

at::Tensor ClipGradientsByNorm(const std::vector<at::Tensor>& grads, double max_norm,
                               c10::Device device, ProcessGroup* sum_over) {
  at::NoGradGuard no_grad;
  const ClipNorm clip = ClipNormFromTerms(ClipNormTerms(grads), max_norm, device, sum_over);
  // No clipping: a multiplication by 1 would read and write every gradient for nothing.
  if (!clip.coef.defined()) return clip.norm;
  if (grads.empty() || !grads.front().is_cuda()) {
    for (const at::Tensor& g : grads) g.mul_(clip.coef.to(g.scalar_type()));
    return clip.norm;
  }
  std::map<at::ScalarType, std::vector<at::Tensor>> by_dtype;
  for (const at::Tensor& g : grads) by_dtype[g.scalar_type()].push_back(g);
  for (auto& [dtype, group] : by_dtype) at::_foreach_mul_(group, clip.coef.to(dtype));
  return clip.norm;
}

at::Tensor FsdpModel::ClipGradNorm(double max_norm) {
  std::vector<FsdpParam*> with_grad;  // in parameters()' order
  for (const auto& unit : units_) {
    for (FsdpParam& p : unit->params()) {
      if (p.requires_grad && p.sharded.grad().defined()) with_grad.push_back(&p);
    }
  }
  // Deferred gradients (Note [Deferred gradient conversion] in offload/deferred_grads.h): the
  // norm from their contributions, the multiplication left to the host step.
  if (ctx_.offload && ctx_.offload->has_deferred()) {
    if (std::optional<at::Tensor> norm =
            ctx_.offload->ClipDeferred(with_grad, max_norm, ctx_.device)) {
      return *norm;
    }
  }
  std::vector<at::Tensor> grads;  // written by ClipDeferred's MaterializeDeferred, if it ran
  for (const FsdpParam* p : with_grad) grads.push_back(p->sharded.grad());
  // Replicas hold identical gradient shards: summing over the shard axis counts each once.
  // Offloaded gradients are clipped on the host (Note [CPU offload]); the norm is returned on
  // the device either way.
  const c10::Device where = ctx_.offload ? c10::Device(c10::kCPU) : ctx_.device;
  ProcessGroup* sum_over = ctx_.num_shards > 1 ? ctx_.shard_group : nullptr;
  // Note [Deferred clipping multiplication]: the host's fp32 .grads multiplied by the step.
  const bool defer_multiply =
      ctx_.offload && ctx_.offload->defers_clip_multiply() && !grads.empty() &&
      std::all_of(grads.begin(), grads.end(), [](const at::Tensor& g) {
        return g.device().is_cpu() && g.scalar_type() == at::kFloat;
      });
  if (defer_multiply) {
    // The terms the adder computed during the backward; the others here, with the same op.
    std::vector<at::Tensor> terms = ctx_.offload->TakeClipTerms(with_grad);
    for (size_t i = 0; i < terms.size(); ++i) {
      if (!terms[i].defined()) terms[i] = ClipNormTerms({grads[i]}).front();
    }
    const ClipNorm clip = ClipNormFromTerms(terms, max_norm, where, sum_over);
    if (clip.coef.defined()) ctx_.offload->DeferClipMultiply(with_grad, clip.coef);
    return clip.norm.to(ctx_.device, /*non_blocking=*/true);
  }
  return ClipGradientsByNorm(grads, max_norm, where, sum_over)
      .to(ctx_.device, /*non_blocking=*/true);
}

void FsdpModel::StepOnHost(std::function<void(const std::vector<at::Tensor>&)> step) {
  HostStep whole;
  whole.run = std::move(step);
  StepOnHost(std::move(whole));
}

void FsdpModel::StepOnHost(HostStep step, bool delayed) {
  TORCH_CHECK(ctx_.offload, "FsdpModel::StepOnHost: needs parallelism.offload");
  TORCH_CHECK(NumUnshardedUnits() == 0,
              "FsdpModel::StepOnHost: unsharded parameters kept past the step (stale copies)");
  // A unit that no forward unsharded since the last step (unused in this one) still has its
  // update or its push pending: finish them first.
  FinishHostStep();
  // Forward order, so that the next forward's first unit is stepped first.
  std::vector<FsdpUnit*> order;
  if (order_final_) order = order_;
  for (const auto& unit : units_) {
    if (std::find(order.begin(), order.end(), unit.get()) == order.end()) order.push_back(unit.get());
  }
  std::vector<std::vector<FsdpParam*>> groups;
  for (FsdpUnit* unit : order) {
    std::vector<FsdpParam*>& group = groups.emplace_back();
    for (FsdpParam& p : unit->params()) group.push_back(&p);
  }
  ctx_.offload->StepInOrder(groups, std::move(step), delayed);
}

void FsdpModel::FinishHostStep() {
  if (!ctx_.offload || !ctx_.offload->step_pending()) return;
  ctx_.offload->FinishStep(*ctx_.streams);
  ctx_.offload->WaitForShardsOnCurrentStream();
}

void FsdpModel::CopyShardsToDevice() {
  if (!ctx_.offload) return;
  FinishHostStep();
  ctx_.offload->PushShards(*ctx_.streams);
  // The copies run on the copy-in stream; whatever the caller issues next on its stream (a
  // read of the device shards, the next forward) must follow them. A wait queued on the
  // device: the host does not block.
  ctx_.offload->WaitForShardsOnCurrentStream();
}

ModelStateBytes FsdpModel::model_state_bytes() const {
  ModelStateBytes bytes = model_state_sizes();
  CountResidentBytes(bytes);
  return bytes;
}

ModelStateBytes FsdpModel::model_state_sizes() const {
  ModelStateBytes bytes;
  for (const auto& unit : units_) {
    for (const FsdpParam& p : unit->params()) AddModelStateBytes(p, bytes);
  }
  return bytes;
}

void FsdpModel::CountResidentBytes(ModelStateBytes& bytes) const {
  for (const auto& unit : units_) {
    for (const FsdpParam& p : unit->params()) fsdp::CountResidentBytes(p, bytes);
  }
}

}  // namespace fsdp
