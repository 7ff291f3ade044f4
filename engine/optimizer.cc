#include "engine/optimizer.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <utility>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include "engine/host_adam.h"

namespace fsdp {
namespace {

constexpr std::array<std::pair<OptimizerKind, std::string_view>, 3> kKinds = {{
    {OptimizerKind::kAdamW, "adamw"},
    {OptimizerKind::kAdam, "adam"},
    {OptimizerKind::kSgd, "sgd"},
}};

// Note [Fused optimizer steps]
// libtorch's torch::optim classes step one parameter at a time with several elementwise ops
// each: on a GPU ~8 kernel launches per parameter, the largest class of launches in a
// llama_1b step (../shared/GPU.md). Here Adam, AdamW and SGD keep libtorch's classes and state
// (exp_avg, exp_avg_sq, momentum_buffer, the int64 step counter: what KindOf, StateTensors and
// checkpoints read) and override step():
//   - the parameters of a group are batched by (device, dtype), what one multi-tensor kernel
//     accepts; a sharded model's parameters are usually one batch;
//   - fused: at::_fused_adamw_ / _fused_adam_ / _fused_sgd_, one launch per batch on CUDA (ATen's
//     multi_tensor_apply), one vectorized pass per tensor on CPU;
//   - foreach: the same arithmetic in at::_foreach_* ops, ~8 multi-tensor launches per batch.
// The fused Adam kernels read the step count from a float tensor on the parameter's device
// (bias corrections computed on the device: no host sync). That tensor is a cache of the state's
// int64 counter: it is re-made whenever the counter is not the value it last held (a load
// from a checkpoint, a state another optimizer made), and incremented by one _foreach_add_ per
// batch otherwise, so the steady state allocates nothing and the checkpoint needs no new key.
// On CPU ATen's fused kernels open one parallel region per tensor, however small (grain 0):
// dozens of fork/joins per step, which cost more than the arithmetic when threads are shared
// (1-rank runs next to others) and made a step several times slower. So on CPU the small tensors
// of a batch step one after another inside one at::parallel_for, and only tensors of
// kLargeCpuTensor elements or more were meant to use the kernel's own parallelism. (In this
// project's build, without -fopenmp, that at::parallel_for runs on the calling thread and does
// not mark a parallel region: checked with torch 2.11, each small tensor's kernel still opens
// its own, docs/architecture.md; found 2026-11-26, not yet changed.)
// Weight decay follows libtorch: AdamW's decoupled (p *= 1 - lr * wd), Adam's and SGD's L2
// (grad + wd * p). Results equal the per-tensor step to rounding, not bitwise (other operation
// orders and fused multiply-adds).

// The parameters of one param group with one (device, dtype): one multi-tensor call.
struct Batch {
  Batch(at::Device device, at::ScalarType dtype) : device(device), dtype(dtype) {}
  at::Device device;
  at::ScalarType dtype;
  std::vector<at::Tensor> params, grads, exp_avgs, exp_avg_sqs, momentum_buffers, steps;
  std::vector<int64_t> step_values;  // Adam: the states' steps after this update
};

Batch& BatchOf(std::vector<Batch>& batches, const at::Tensor& p) {
  for (Batch& b : batches) {
    if (b.device == p.device() && b.dtype == p.scalar_type()) return b;
  }
  return batches.emplace_back(p.device(), p.scalar_type());
}

constexpr int64_t kLargeCpuTensor = int64_t{1} << 18;

// The tensor at `i` as a one-element list; an empty list stays empty.
at::TensorList One(const std::vector<at::Tensor>& list, size_t i) {
  return list.empty() ? at::TensorList() : at::TensorList(&list[i], 1);
}

// Calls `call(list_of_one)` for each tensor of a CPU batch (see Note [Fused optimizer steps]):
// large tensors with the kernel's own threads, the small ones inside one parallel region.
template <typename Call>
void ForEachCpuTensor(const Batch& b, const Call& call) {
  std::vector<size_t> small;
  for (size_t i = 0; i < b.params.size(); ++i) {
    if (b.params[i].numel() >= kLargeCpuTensor) {
      call(i);
    } else {
      small.push_back(i);
    }
  }
  at::parallel_for(0, static_cast<int64_t>(small.size()), 1, [&](int64_t begin, int64_t end) {
    at::NoGradGuard no_grad;  // worker threads do not inherit the caller's grad mode
    for (int64_t k = begin; k < end; ++k) call(small[k]);
  });
}

std::vector<at::Scalar> Scalars(const std::vector<double>& values) {
  return {values.begin(), values.end()};
}

// One step of Adam (kDecoupledDecay false) or AdamW over a batch with _foreach_ ops, the same
// arithmetic as libtorch's per-tensor step.
template <bool kDecoupledDecay, typename Options>
void ForeachAdamStep(Batch& b, const Options& o) {
  const auto [beta1, beta2] = o.betas();
  std::vector<at::Tensor> grads = b.grads;
  if (o.weight_decay() != 0) {
    if constexpr (kDecoupledDecay) {
      at::_foreach_mul_(b.params, 1 - o.lr() * o.weight_decay());
    } else {
      grads = at::_foreach_add(b.grads, b.params, o.weight_decay());
    }
  }
  at::_foreach_mul_(b.exp_avgs, beta1);
  at::_foreach_add_(b.exp_avgs, grads, 1 - beta1);
  at::_foreach_mul_(b.exp_avg_sqs, beta2);
  at::_foreach_addcmul_(b.exp_avg_sqs, grads, grads, 1 - beta2);
  std::vector<double> bias2_sqrt, neg_step_size;
  for (int64_t step : b.step_values) {
    const double bias1 = 1 - std::pow(beta1, static_cast<double>(step));
    bias2_sqrt.push_back(std::sqrt(1 - std::pow(beta2, static_cast<double>(step))));
    neg_step_size.push_back(-o.lr() / bias1);
  }
  std::vector<at::Tensor> denom = at::_foreach_sqrt(b.exp_avg_sqs);
  at::_foreach_div_(denom, Scalars(bias2_sqrt));
  at::_foreach_add_(denom, o.eps());
  at::_foreach_addcdiv_(b.params, b.exp_avgs, denom, Scalars(neg_step_size));
}

// Adam / AdamW stepped by ATen's fused or foreach kernels: Note [Fused optimizer steps].
template <typename Base, typename State, typename Options, bool kDecoupledDecay>
class MultiTensorAdam final : public Base {
 public:
  MultiTensorAdam(std::vector<at::Tensor> params, const Options& options, bool fused)
      : Base(std::move(params), options), fused_(fused) {}

  at::Tensor step(torch::optim::Optimizer::LossClosure closure = nullptr) override {
    at::NoGradGuard no_grad;
    at::Tensor loss;
    if (closure != nullptr) {
      at::AutoGradMode enable_grad(true);
      loss = closure();
    }
    for (auto& [batch, options] : Prepare()) RunBatch(batch, options, fused_);
    return loss;
  }

  // Everything step() does but the arithmetic (Note [Prepared steps]): the states of parameters
  // stepped for the first time, their counters advanced, the hyper-parameters copied.
  std::vector<std::pair<Batch, Options>> Prepare() {
    std::vector<std::pair<Batch, Options>> prepared;
    for (auto& group : this->param_groups()) {
      const auto& o = static_cast<const Options&>(group.options());
      TORCH_CHECK(!o.amsgrad(), "fsdp: the fused and foreach Adam steps do not implement amsgrad");
      std::vector<Batch> batches;
      for (const at::Tensor& p : group.params()) {
        if (!p.grad().defined()) continue;
        auto& slot = this->state_[p.unsafeGetTensorImpl()];
        if (!slot) {  // as libtorch's first step
          auto fresh = std::make_unique<State>();
          fresh->exp_avg(at::zeros_like(p, at::MemoryFormat::Preserve));
          fresh->exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
          slot = std::move(fresh);
        }
        auto& state = static_cast<State&>(*slot);
        Batch& b = BatchOf(batches, p);
        b.params.push_back(p);
        b.grads.push_back(p.grad());
        b.exp_avgs.push_back(state.exp_avg());
        b.exp_avg_sqs.push_back(state.exp_avg_sq());
        if (fused_) b.steps.push_back(StepTensor(p, state.step()));
        state.step(state.step() + 1);
        b.step_values.push_back(state.step());
        // The step tensor holds this count once the batch ran (its _foreach_add_ below).
        if (fused_) step_cache_[p.unsafeGetTensorImpl()].value = state.step();
      }
      for (Batch& b : batches) prepared.emplace_back(std::move(b), o);
    }
    return prepared;
  }

  // The arithmetic of one prepared batch (any subset of one, in its order: each tensor's
  // update depends on its own tensors only).
  static void RunBatch(Batch& b, const Options& o, bool fused_step) {
    at::NoGradGuard no_grad;
    if (!fused_step) {
      ForeachAdamStep<kDecoupledDecay>(b, o);
      return;
    }
    at::_foreach_add_(b.steps, 1.0);
    auto fused = [&](at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                     at::TensorList exp_avg_sqs, at::TensorList steps) {
      RunFused(params, grads, exp_avgs, exp_avg_sqs, steps, o);
    };
    if (b.device.is_cpu()) {
      ForEachCpuTensor(b, [&](size_t i) {
        fused(One(b.params, i), One(b.grads, i), One(b.exp_avgs, i), One(b.exp_avg_sqs, i),
              One(b.steps, i));
      });
    } else {
      fused(b.params, b.grads, b.exp_avgs, b.exp_avg_sqs, b.steps);
    }
  }

  // ATen's fused kernel on these lists; `steps` hold the counts after this update (RunBatch
  // adds 1 to them first; PreparedStep::RunSlice passes its own).
  static void RunFused(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                       at::TensorList exp_avg_sqs, at::TensorList steps, const Options& o) {
    at::NoGradGuard no_grad;
    const auto [beta1, beta2] = o.betas();
    if constexpr (kDecoupledDecay) {
      at::_fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, {}, steps, o.lr(), beta1, beta2,
                        o.weight_decay(), o.eps(), /*amsgrad=*/false, /*maximize=*/false);
    } else {
      at::_fused_adam_(params, grads, exp_avgs, exp_avg_sqs, {}, steps, o.lr(), beta1, beta2,
                       o.weight_decay(), o.eps(), /*amsgrad=*/false, /*maximize=*/false);
    }
  }

  bool fused() const { return fused_; }

 private:
  struct CachedStep {
    at::Tensor tensor;  // 0-dim float32 on the parameter's device
    int64_t value = -1;  // the count it holds
  };

  // `p`'s step tensor holding `count` (the state's counter before this update).
  at::Tensor StepTensor(const at::Tensor& p, int64_t count) {
    CachedStep& cached = step_cache_[p.unsafeGetTensorImpl()];
    if (!cached.tensor.defined() || cached.value != count) {
      cached.tensor = at::full({}, static_cast<double>(count),
                               at::TensorOptions().dtype(at::kFloat).device(p.device()));
      cached.value = count;
    }
    return cached.tensor;
  }

  bool fused_;
  std::unordered_map<c10::TensorImpl*, CachedStep> step_cache_;
};

using FastAdamW = MultiTensorAdam<torch::optim::AdamW, torch::optim::AdamWParamState,
                                  torch::optim::AdamWOptions, true>;
using FastAdam = MultiTensorAdam<torch::optim::Adam, torch::optim::AdamParamState,
                                 torch::optim::AdamOptions, false>;

// A step of FastAdamW / FastAdam prepared on the training thread, run later a unit at a time
// (Note [Prepared steps]).
template <typename Optimizer, typename Options>
class PreparedAdamStep final : public PreparedStep {
 public:
  PreparedAdamStep(std::vector<std::pair<Batch, Options>> batches, bool fused)
      : batches_(std::move(batches)), fused_(fused) {
    for (size_t b = 0; b < batches_.size(); ++b) {
      const Batch& batch = batches_[b].first;
      for (size_t i = 0; i < batch.params.size(); ++i) {
        params_.push_back(batch.params[i]);
        Entry entry{b, i, {}};
        // RunSlice's step: the count after this update (RunBatch adds 1 to steps[i] in place).
        if (fused_) {
          entry.after_step = at::full({}, static_cast<double>(batch.step_values[i]),
                                      batch.steps[i].options());
        }
        where_.emplace(batch.params[i].unsafeGetTensorImpl(), std::move(entry));
      }
    }
  }

  const std::vector<at::Tensor>& params() const override { return params_; }

  void Run(at::TensorList params) override {
    std::vector<std::vector<size_t>> picked(batches_.size());
    for (const at::Tensor& p : params) {
      auto it = where_.find(p.unsafeGetTensorImpl());
      if (it == where_.end()) continue;  // not stepped, or stepped already
      picked[it->second.batch].push_back(it->second.index);
      where_.erase(it);
    }
    for (size_t b = 0; b < batches_.size(); ++b) {
      if (picked[b].empty()) continue;
      std::sort(picked[b].begin(), picked[b].end());  // the batch's order
      const Batch& all = batches_[b].first;
      Batch sub(all.device, all.dtype);
      for (size_t i : picked[b]) {
        sub.params.push_back(all.params[i]);
        sub.grads.push_back(all.grads[i]);
        sub.exp_avgs.push_back(all.exp_avgs[i]);
        sub.exp_avg_sqs.push_back(all.exp_avg_sqs[i]);
        if (!all.steps.empty()) sub.steps.push_back(all.steps[i]);
        sub.step_values.push_back(all.step_values[i]);
      }
      Optimizer::RunBatch(sub, batches_[b].second, fused_);
    }
  }

  size_t remaining() const override { return where_.size(); }

  bool CanRunSlices(const at::Tensor& param) const override {
    return fused_ && where_.count(param.unsafeGetTensorImpl()) > 0 && param.is_contiguous();
  }

  void RunSlice(const at::Tensor& param, int64_t begin, int64_t n) const override {
    auto it = where_.find(param.unsafeGetTensorImpl());
    TORCH_CHECK(fused_ && it != where_.end(), "PreparedStep::RunSlice: not a slice it can run");
    const Entry& e = it->second;
    const size_t b = e.batch, i = e.index;
    const Batch& all = batches_[b].first;
    auto slice = [&](const at::Tensor& t) { return t.view(-1).narrow(0, begin, n); };
    const at::Tensor tensors[] = {slice(all.params[i]), slice(all.grads[i]),
                                  slice(all.exp_avgs[i]), slice(all.exp_avg_sqs[i]),
                                  e.after_step};
    Optimizer::RunFused(at::TensorList(&tensors[0], 1), at::TensorList(&tensors[1], 1),
                        at::TensorList(&tensors[2], 1), at::TensorList(&tensors[3], 1),
                        at::TensorList(&tensors[4], 1), batches_[b].second);
  }

  bool RunHostPass(const at::Tensor& param, const at::Tensor& grad, float scale,
                   const at::Tensor& copy) const override {
    auto it = where_.find(param.unsafeGetTensorImpl());
    if (!fused_ || it == where_.end() || !HostAdamPassAvailable()) return false;
    const Batch& all = batches_[it->second.batch].first;
    const Options& o = batches_[it->second.batch].second;
    const size_t i = it->second.index;
    const int64_t n = param.numel();
    auto usable = [&](const at::Tensor& t, at::ScalarType dtype, bool at_least) {
      return t.device().is_cpu() && t.scalar_type() == dtype && t.is_contiguous() &&
             (at_least ? t.numel() >= n : t.numel() == n);
    };
    // Undefined: the gradient the step took (the master's .grad).
    const at::Tensor& g = grad.defined() ? grad : all.grads[i];
    const bool narrow = g.scalar_type() == at::kBFloat16;
    // The copy: bf16, written by the loop; fp32 (fp32 compute's spare copy under the delayed
    // update, Note [Delayed parameter update]), copied from the updated master after it.
    const bool bf16_copy = copy.defined() && usable(copy, at::kBFloat16, true);
    const bool wide_copy = copy.defined() && usable(copy, at::kFloat, true);
    if (!usable(param, at::kFloat, false) ||
        !usable(g, narrow ? at::kBFloat16 : at::kFloat, false) ||
        !usable(all.exp_avgs[i], at::kFloat, false) ||
        !usable(all.exp_avg_sqs[i], at::kFloat, false) ||
        (copy.defined() && !bf16_copy && !wide_copy)) {
      return false;
    }
    HostAdamHyper hyper;
    hyper.lr = o.lr();
    std::tie(hyper.beta1, hyper.beta2) = o.betas();
    hyper.eps = o.eps();
    hyper.weight_decay = o.weight_decay();
    hyper.decoupled = std::is_same_v<Options, torch::optim::AdamWOptions>;
    hyper.step = static_cast<double>(all.step_values[i]);
    if (o.amsgrad() || !HostAdamPassCovers(hyper)) return false;
    HostAdamPass(hyper, scale, n, param.data_ptr<float>(), all.exp_avgs[i].data_ptr<float>(),
                 all.exp_avg_sqs[i].data_ptr<float>(), g,
                 bf16_copy ? static_cast<uint16_t*>(copy.data_ptr()) : nullptr);
    if (wide_copy) copy.view(-1).narrow(0, 0, n).copy_(param.view(-1));
    return true;
  }

  void SlicesDone(const at::Tensor& param) override {
    auto it = where_.find(param.unsafeGetTensorImpl());
    TORCH_CHECK(it != where_.end(), "PreparedStep::SlicesDone: not a parameter it steps");
    // The step tensor as RunBatch leaves it (the optimizer's cache expects the new count).
    batches_[it->second.batch].first.steps[it->second.index].add_(1.0);
    where_.erase(it);
  }

 private:
  struct Entry {
    size_t batch, index;    // in batches_
    at::Tensor after_step;  // fused: the count after this update, for RunSlice
  };

  std::vector<std::pair<Batch, Options>> batches_;
  bool fused_;
  std::vector<at::Tensor> params_;
  std::unordered_map<c10::TensorImpl*, Entry> where_;
};

template <typename Optimizer, typename Options>
std::unique_ptr<PreparedStep> Prepare(Optimizer& optimizer) {
  return std::make_unique<PreparedAdamStep<Optimizer, Options>>(optimizer.Prepare(),
                                                                optimizer.fused());
}

// SGD with momentum, weight decay and dampening stepped by ATen's fused or foreach kernels
// (Note [Fused optimizer steps]); nesterov as libtorch.
class MultiTensorSgd final : public torch::optim::SGD {
 public:
  MultiTensorSgd(std::vector<at::Tensor> params, const torch::optim::SGDOptions& options,
                 bool fused)
      : SGD(std::move(params), options), fused_(fused) {}

  at::Tensor step(LossClosure closure = nullptr) override {
    at::NoGradGuard no_grad;
    at::Tensor loss;
    if (closure != nullptr) {
      at::AutoGradMode enable_grad(true);
      loss = closure();
    }
    for (auto& group : param_groups()) {
      const auto& o = static_cast<const torch::optim::SGDOptions&>(group.options());
      const bool momentum = o.momentum() != 0;
      // Two batch lists: a fused call takes one is_first_step for all of its tensors.
      std::vector<Batch> first, later;
      for (const at::Tensor& p : group.params()) {
        if (!p.grad().defined()) continue;
        bool is_first = false;
        at::Tensor buffer;
        if (momentum) {
          auto& slot = state_[p.unsafeGetTensorImpl()];
          if (!slot) {
            auto fresh = std::make_unique<torch::optim::SGDParamState>();
            fresh->momentum_buffer(at::empty_like(p, at::MemoryFormat::Preserve));
            slot = std::move(fresh);
            is_first = true;
          }
          buffer = static_cast<torch::optim::SGDParamState&>(*slot).momentum_buffer();
        }
        Batch& b = BatchOf(is_first ? first : later, p);
        b.params.push_back(p);
        b.grads.push_back(p.grad());
        if (momentum) b.momentum_buffers.push_back(buffer);
      }
      for (bool is_first : {true, false}) {
        for (Batch& b : is_first ? first : later) {
          auto fused = [&](at::TensorList params, at::TensorList grads, at::TensorList buffers) {
            at::_fused_sgd_(params, grads, buffers, o.weight_decay(), o.momentum(), o.lr(),
                            o.dampening(), o.nesterov(), /*maximize=*/false, is_first);
          };
          if (fused_ && b.device.is_cpu()) {
            ForEachCpuTensor(b, [&](size_t i) {
              fused(One(b.params, i), One(b.grads, i), One(b.momentum_buffers, i));
            });
          } else if (fused_) {
            fused(b.params, b.grads, b.momentum_buffers);
          } else {
            ForeachStep(b, o, is_first);
          }
        }
      }
    }
    return loss;
  }

 private:
  static void ForeachStep(Batch& b, const torch::optim::SGDOptions& o, bool is_first) {
    std::vector<at::Tensor> update = b.grads;
    if (o.weight_decay() != 0) update = at::_foreach_add(b.grads, b.params, o.weight_decay());
    if (o.momentum() != 0) {
      if (is_first) {
        at::_foreach_copy_(b.momentum_buffers, update);
      } else {
        at::_foreach_mul_(b.momentum_buffers, o.momentum());
        at::_foreach_add_(b.momentum_buffers, update, 1 - o.dampening());
      }
      if (o.nesterov()) {
        update = at::_foreach_add(update, b.momentum_buffers, o.momentum());
      } else {
        update = b.momentum_buffers;
      }
    }
    at::_foreach_add_(b.params, update, -o.lr());
  }

  bool fused_;
};

constexpr std::array<std::pair<OptimizerImplementation, std::string_view>, 3> kImplementations = {{
    {OptimizerImplementation::kFused, "fused"},
    {OptimizerImplementation::kForeach, "foreach"},
    {OptimizerImplementation::kPerTensor, "per_tensor"},
}};

}  // namespace

std::string_view OptimizerKindName(OptimizerKind kind) {
  for (const auto& [k, name] : kKinds) {
    if (k == kind) return name;
  }
  return "unknown";
}

std::optional<OptimizerKind> ParseOptimizerKind(std::string_view name) {
  for (const auto& [kind, kind_name] : kKinds) {
    if (kind_name == name) return kind;
  }
  return std::nullopt;
}

std::vector<std::string> OptimizerKindNames() {
  std::vector<std::string> names;
  for (const auto& entry : kKinds) names.emplace_back(entry.second);
  return names;
}

std::string_view OptimizerImplementationName(OptimizerImplementation implementation) {
  for (const auto& [i, name] : kImplementations) {
    if (i == implementation) return name;
  }
  return "unknown";
}

std::optional<OptimizerImplementation> ParseOptimizerImplementation(std::string_view name) {
  for (const auto& [i, i_name] : kImplementations) {
    if (i_name == name) return i;
  }
  return std::nullopt;
}

std::vector<std::string> OptimizerImplementationNames() {
  std::vector<std::string> names;
  for (const auto& entry : kImplementations) names.emplace_back(entry.second);
  return names;
}

namespace {

// libtorch's class (per_tensor) or our multi-tensor subclass of it (fused, foreach).
template <typename Libtorch, typename MultiTensor, typename Options>
std::unique_ptr<torch::optim::Optimizer> Make(OptimizerImplementation implementation,
                                              std::vector<at::Tensor> params,
                                              const Options& options) {
  if (implementation == OptimizerImplementation::kPerTensor) {
    return std::make_unique<Libtorch>(std::move(params), options);
  }
  return std::make_unique<MultiTensor>(std::move(params), options,
                                       implementation == OptimizerImplementation::kFused);
}

}  // namespace

std::unique_ptr<torch::optim::Optimizer> BuildOptimizer(const OptimizerOptions& o,
                                                        std::vector<at::Tensor> params) {
  switch (o.kind) {
    case OptimizerKind::kSgd:
      return Make<torch::optim::SGD, MultiTensorSgd>(
          o.implementation, std::move(params),
          torch::optim::SGDOptions(o.lr).momentum(o.momentum).weight_decay(o.weight_decay));
    case OptimizerKind::kAdam:
      return Make<torch::optim::Adam, FastAdam>(o.implementation, std::move(params),
                                                torch::optim::AdamOptions(o.lr)
                                                    .betas({o.beta1, o.beta2})
                                                    .eps(o.eps)
                                                    .weight_decay(o.weight_decay));
    case OptimizerKind::kAdamW:
      break;
  }
  return Make<torch::optim::AdamW, FastAdamW>(o.implementation, std::move(params),
                                              torch::optim::AdamWOptions(o.lr)
                                                  .betas({o.beta1, o.beta2})
                                                  .eps(o.eps)
                                                  .weight_decay(o.weight_decay));
}

void SetLearningRate(torch::optim::Optimizer& optimizer, double lr) {
  for (auto& group : optimizer.param_groups()) group.options().set_lr(lr);
}

void PreparedStep::RunSlice(const at::Tensor& /*param*/, int64_t /*begin*/, int64_t /*n*/) const {
  TORCH_CHECK(false, "PreparedStep::RunSlice: this step does not run slices (CanRunSlices)");
}

void PreparedStep::SlicesDone(const at::Tensor& /*param*/) {
  TORCH_CHECK(false, "PreparedStep::SlicesDone: this step does not run slices (CanRunSlices)");
}

std::unique_ptr<PreparedStep> PrepareStep(torch::optim::Optimizer& optimizer) {
  at::NoGradGuard no_grad;
  if (auto* adamw = dynamic_cast<FastAdamW*>(&optimizer)) {
    return Prepare<FastAdamW, torch::optim::AdamWOptions>(*adamw);
  }
  if (auto* adam = dynamic_cast<FastAdam*>(&optimizer)) {
    return Prepare<FastAdam, torch::optim::AdamOptions>(*adam);
  }
  return nullptr;
}

std::optional<OptimizerKind> KindOf(const torch::optim::Optimizer& optimizer) {
  // AdamW before Adam: neither derives from the other in libtorch, but keep the order explicit.
  if (dynamic_cast<const torch::optim::AdamW*>(&optimizer)) return OptimizerKind::kAdamW;
  if (dynamic_cast<const torch::optim::Adam*>(&optimizer)) return OptimizerKind::kAdam;
  if (dynamic_cast<const torch::optim::SGD*>(&optimizer)) return OptimizerKind::kSgd;
  return std::nullopt;
}

std::vector<std::string_view> StateTensorNames(OptimizerKind kind) {
  if (kind == OptimizerKind::kSgd) return {"momentum_buffer"};
  return {"exp_avg", "exp_avg_sq"};
}

std::vector<OptimizerStateTensor> StateTensors(torch::optim::OptimizerParamState& state) {
  if (auto* a = dynamic_cast<torch::optim::AdamWParamState*>(&state)) {
    return {{"exp_avg", &a->exp_avg()}, {"exp_avg_sq", &a->exp_avg_sq()}};
  }
  if (auto* a = dynamic_cast<torch::optim::AdamParamState*>(&state)) {
    return {{"exp_avg", &a->exp_avg()}, {"exp_avg_sq", &a->exp_avg_sq()}};
  }
  if (auto* s = dynamic_cast<torch::optim::SGDParamState*>(&state)) {
    return {{"momentum_buffer", &s->momentum_buffer()}};
  }
  return {};
}

int64_t OptimizerStateBytes(torch::optim::Optimizer& optimizer) {
  int64_t bytes = 0;
  for (auto& [impl, state] : optimizer.state()) {
    for (const OptimizerStateTensor& t : StateTensors(*state)) {
      if (t.tensor->defined()) bytes += static_cast<int64_t>(t.tensor->nbytes());
    }
  }
  return bytes;
}

int64_t* StepCounter(torch::optim::OptimizerParamState& state) {
  if (auto* a = dynamic_cast<torch::optim::AdamWParamState*>(&state)) return &a->step();
  if (auto* a = dynamic_cast<torch::optim::AdamParamState*>(&state)) return &a->step();
  return nullptr;
}

std::unique_ptr<torch::optim::OptimizerParamState> NewParamState(
    const torch::optim::Optimizer& optimizer) {
  switch (KindOf(optimizer).value_or(OptimizerKind::kSgd)) {
    case OptimizerKind::kAdamW:
      return std::make_unique<torch::optim::AdamWParamState>();
    case OptimizerKind::kAdam:
      return std::make_unique<torch::optim::AdamParamState>();
    case OptimizerKind::kSgd:
      break;
  }
  return std::make_unique<torch::optim::SGDParamState>();
}

}  // namespace fsdp
