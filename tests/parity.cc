#include "tests/parity.h"

#include <map>

#include <torch/torch.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "common/strings.h"
#include "sharding/fsdp_model.h"
#include "tests/multirank.h"
#include "tests/tiny_gpt.h"

namespace fsdp::testing {

std::string ParityCase::Name() const {
  std::string n = StrCat(strategy, "_w", world);
  if (replicate > 1) n += StrCat("_r", replicate);
  if (reshard_group) n += StrCat("_k", reshard_group);
  if (accumulate == Accumulate::kNoSyncUntilLast) n += "_nosync";
  if (accumulate == Accumulate::kNoAllReduceUntilLast) n += "_noallreduce";
  if (bf16) n += "_bf16";
  if (device != "cpu") n += StrCat("_", device, "_", cuda_backend);
  if (keep) n += "_keep";
  if (cpu_collectives != "p2p") n += StrCat("_", cpu_collectives, "_collectives");
  return n;
}

void PrintTo(const ParityCase& c, std::ostream* os) { *os << c.Name(); }

namespace {


constexpr int kSteps = 10;
constexpr int kMicroBatches = 2;
constexpr int64_t kGlobalBatch = 24;  // divisible by every data-parallel size x micro-batches
constexpr double kMaxNorm = 0.5;
constexpr double kAdamEps = 1e-6;

struct Tolerance {
  double rtol, atol;  // parameters after the optimizer step
  double grad_rel;    // gradients, relative to the largest element of the parameter's gradient
};

// Note [Mixed-precision gradients, exactly]
// A bf16 reference that computes ONE bf16 gradient of the whole batch differs from the engine
// by bf16 rounding (the engine sums the micro-batches' bf16 gradients in fp32, and with
// no_sync adds them in bf16 first): up to 5.6% of a gradient's largest element in this test
// (ln2.bias, 4 ranks), so a tolerance loose enough for it would also pass an engine that
// reduced in bf16 instead of fp32. So the bf16 reference reproduces the engine's arithmetic:
// each (data-parallel rank, micro-batch) slice's gradient in bf16, bitwise as the engine
// computes it (the same module on the same slice), cast to fp32, summed over ranks and
// micro-batches, divided by the data-parallel size; with no_sync, autograd adds a rank's
// micro-batch gradients in bf16 first, as the unsharded parameters' .grad do in the engine.
// Only the fp32 summation order differs. At the first step, where the parameters are equal,
// the gradients must agree to fp32 rounding (1e-5 of the largest element; a bf16 reduction is
// off by ~1e-3). Later, the fp32 masters differ in their last bits, and a bf16 cast that
// rounds the other way changes a weight by 2^-8: the tolerance after the first step is 1e-4.
// This needs bitwise-reproducible bf16 kernels, i.e. the CPU's; on CUDA (atomics in some
// backward kernels) the first-step check is skipped and the bf16 tolerances are bf16's.
// This rank's rows of `full` (a whole parameter's values or gradient): [local rows, row_numel].
torch::Tensor LocalRows(const FsdpModel& fsdp, const FsdpParam& p, const torch::Tensor& full) {
  const ParamSharding& s = p.sharding;
  return full.reshape({s.dim0, s.row_numel}).narrow(0, fsdp.FirstLocalRow(p), p.sharded.size(0));
}

// The largest |shard - this rank's rows of full|, and the largest |rows of full| (the scale
// the gradient tolerances are relative to).
struct ShardDiff {
  double err, scale;
};
ShardDiff DiffFromFull(const FsdpModel& fsdp, const FsdpParam& p, const torch::Tensor& full,
                       const torch::Tensor& shard) {
  torch::Tensor expected = LocalRows(fsdp, p, full);
  torch::Tensor actual = shard.reshape(expected.sizes());
  return {(actual - expected).abs().max().item<double>(), expected.abs().max().item<double>()};
}

struct MixedPrecisionResult {
  std::map<std::string, torch::Tensor> grads;  // fp32, the whole parameters
  double loss = 0;                             // the mean loss, as the engine reports it
};

MixedPrecisionResult MixedPrecisionReference(TinyGpt& compute, const torch::Tensor& x,
                                             const torch::Tensor& y, int dp, int64_t micro,
                                             Accumulate accumulate, int64_t vocab) {
  MixedPrecisionResult out;
  for (int r = 0; r < dp; ++r) {
    for (auto& p : compute->parameters()) p.mutable_grad().reset();
    for (int m = 0; m < kMicroBatches; ++m) {
      const int64_t begin = (r * kMicroBatches + m) * micro;
      torch::Tensor logits = compute->forward(x.narrow(0, begin, micro)).to(torch::kFloat);
      torch::Tensor loss =
          torch::nn::functional::cross_entropy(logits.reshape({-1, vocab}),
                                               y.narrow(0, begin, micro).reshape({-1})) /
          kMicroBatches;
      loss.backward();
      out.loss += loss.item<double>() / dp;
      const bool last = m == kMicroBatches - 1;
      if (accumulate == Accumulate::kNoSyncUntilLast && !last) continue;  // .grad accumulates
      for (const auto& item : compute->named_parameters()) {
        const torch::Tensor& g = item.value().grad();
        if (!g.defined()) continue;
        torch::Tensor& sum = out.grads[item.key()];
        sum = sum.defined() ? sum + g.to(torch::kFloat) : g.to(torch::kFloat);
      }
      for (auto& p : compute->parameters()) p.mutable_grad().reset();
    }
  }
  for (auto& [name, sum] : out.grads) sum.div_(dp);
  return out;
}

}  // namespace

void RunParity(const ParityCase& c, int rank) {
  TinyGptConfig config;
  torch::manual_seed(1234);
  TinyGpt model(config);
  torch::manual_seed(1234);
  TinyGpt reference(config);  // identical initial parameters

  DistOptions options_for_device = TestDistOptions();
  options_for_device.device = c.device;
  options_for_device.cuda_backend = c.cuda_backend;
  options_for_device.cpu_collectives = c.cpu_collectives;
  std::shared_ptr<DistContext> ctx = InitDist(options_for_device);
  const torch::Device device = ctx->device();
  model->to(device);
  reference->to(device);
  absl::StatusOr<Strategy> strategy = ParseStrategy(c.strategy);
  ASSERT_TRUE(strategy.ok()) << strategy.status();
  absl::StatusOr<MeshShape> shape = MeshShapeForStrategy(*strategy, c.world, c.replicate);
  ASSERT_TRUE(shape.ok()) << shape.status();
  absl::StatusOr<DeviceMesh> mesh = DeviceMesh::Create(ctx, *shape);
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  FsdpOptions options = OptionsForStrategy(*strategy);
  options.reshard_group_size = c.reshard_group;
  options.reshard_between_micro_batches = !c.keep;
  if (c.bf16) {
    options.mixed_precision.param_dtype = at::kBFloat16;
    options.mixed_precision.reduce_dtype = at::kFloat;
    options.mixed_precision.output_dtype = at::kFloat;
  }
  auto units = SelectUnits(*model, {.module_types = {"fsdp::testing::BlockImpl"}});
  ASSERT_EQ(units.size(), static_cast<size_t>(config.layers));
  absl::StatusOr<std::unique_ptr<FsdpModel>> wrapped = FsdpModel::Wrap(model.ptr(), *mesh, units, options);
  ASSERT_TRUE(wrapped.ok()) << wrapped.status();
  FsdpModel& fsdp = **wrapped;

  // State-dict names are those of the unwrapped model.
  std::vector<std::string> names, ref_names;
  for (const auto& item : model->named_parameters()) names.push_back(item.key());
  for (const auto& item : reference->named_parameters()) ref_names.push_back(item.key());
  ASSERT_EQ(names, ref_names);

  // Note [Parity tolerance]: Adam divides each gradient element by its running RMS, so an
  // element whose gradient is near zero turns rounding noise into an update of up to lr. With
  // eps = 1e-6 that amplification is bounded (lr * noise / eps) and fp32 runs agree to ~1e-6.
  // In bf16 the fp32 masters differ from the reference's in their last bits after a step, and
  // a bf16 cast that then rounds the other way changes a weight by 2^-8; Adam turns the
  // resulting gradient differences into lr-sized updates (with AdamW here: gradients 2e-3 of
  // their largest element apart by step 10). The bf16 cases use SGD with momentum, whose updates
  // are proportional to the gradients: they stay within 2.5e-7 (Note [Mixed-precision
  // gradients, exactly]).
  std::unique_ptr<torch::optim::Optimizer> opt, ref_opt;
  if (c.bf16) {
    auto sgd = torch::optim::SGDOptions(5e-2).momentum(0.9).weight_decay(0.01);
    opt = std::make_unique<torch::optim::SGD>(fsdp.parameters(), sgd);
    ref_opt = std::make_unique<torch::optim::SGD>(UniqueTrainable(*reference), sgd);
  } else {
    auto adamw = torch::optim::AdamWOptions(1e-2).weight_decay(0.1).eps(kAdamEps);
    opt = std::make_unique<torch::optim::AdamW>(fsdp.parameters(), adamw);
    ref_opt = std::make_unique<torch::optim::AdamW>(UniqueTrainable(*reference), adamw);
  }

  // The reference in bf16 mode computes with a bf16 copy of its fp32 parameters, as FSDP does.
  TinyGpt ref_compute(config);
  ref_compute->to(device);
  const int dp = mesh->shape().num_ranks();
  const int dp_rank = rank;  // row-major mesh: replicate-major, shard-minor
  const int64_t local_batch = kGlobalBatch / dp;
  const int64_t micro = local_batch / kMicroBatches;
  // bf16 on CPU: against the mixed-precision reference (Note [Mixed-precision gradients,
  // exactly]) the runs agree to fp32 rounding (worst: gradients 2.5e-7 of the largest element,
  // parameters 1.2e-7); 1e-4 leaves room for a bf16 cast rounding the other way after a step.
  // On CUDA the same slice's bf16 gradient is not bitwise reproducible (atomics in the
  // position embedding's and attention's backward), so the bf16 tolerances stay bf16's.
  const bool deterministic_kernels = c.device == "cpu";
  Tolerance tol = !c.bf16                ? Tolerance{1e-5, 1e-5, 1e-5}
                  : deterministic_kernels ? Tolerance{1e-4, 1e-4, 1e-4}
                                          : Tolerance{1e-2, 1e-3, 5e-2};
  double worst_param = 0, worst_loss = 0, worst_grad = 0;

  for (int step = 0; step < kSteps; ++step) {
    torch::manual_seed(100 + step);
    torch::Tensor x = torch::randint(config.vocab, {kGlobalBatch, config.seq}).to(device);
    torch::Tensor y = torch::randint(config.vocab, {kGlobalBatch, config.seq}).to(device);

    // Sharded: this rank's slice of the global batch, in micro-batches.
    double local_loss = 0;
    for (int m = 0; m < kMicroBatches; ++m) {
      bool last = m == kMicroBatches - 1;
      if (c.accumulate == Accumulate::kNoSyncUntilLast) fsdp.set_requires_gradient_sync(last);
      if (c.accumulate == Accumulate::kNoAllReduceUntilLast) fsdp.set_requires_all_reduce(last);
      if (c.keep) fsdp.set_reshard_after_backward(last);
      int64_t begin = dp_rank * local_batch + m * micro;
      torch::Tensor logits = model->forward(x.narrow(0, begin, micro));
      torch::Tensor loss = torch::nn::functional::cross_entropy(
                               logits.reshape({-1, config.vocab}),
                               y.narrow(0, begin, micro).reshape({-1})) /
                           kMicroBatches;
      loss.backward();
      local_loss += loss.item<double>();
    }
    std::map<std::string, torch::Tensor> unclipped;  // step 0, bf16: Note [Mixed-precision ...]
    if (c.bf16 && step == 0 && deterministic_kernels) {
      for (const auto& [name, shard] : fsdp.named_parameters()) {
        if (shard.grad().defined()) unclipped[name] = shard.grad().clone();
      }
    }
    double norm = fsdp.ClipGradNorm(kMaxNorm).item<double>();
    std::map<std::string, torch::Tensor> grads;
    for (const auto& [name, shard] : fsdp.named_parameters()) {
      if (shard.grad().defined()) grads[name] = shard.grad().clone();
    }
    opt->step();
    opt->zero_grad();
    torch::Tensor loss_sum = torch::tensor({local_loss}, torch::kDouble).to(device);
    ctx->world().AllReduce(loss_sum)->wait();
    double loss = loss_sum.item<double>() / dp;

    // Reference. fp32: the whole global batch at once. bf16: the engine's mixed-precision
    // arithmetic, slice by slice (Note [Mixed-precision gradients, exactly]).
    double ref_loss = 0;
    if (c.bf16) {
      {
        torch::NoGradGuard no_grad;
        auto dst = ref_compute->named_parameters();
        for (const auto& item : reference->named_parameters()) {
          dst[item.key()].set_data(item.value().detach().to(torch::kBFloat16));
        }
      }
      MixedPrecisionResult mp =
          MixedPrecisionReference(ref_compute, x, y, dp, micro, c.accumulate, config.vocab);
      ref_loss = mp.loss;
      for (const auto& [name, sum] : mp.grads) {
        const FsdpParam* p = fsdp.FindParam(name);
        if (unclipped.empty() || p == nullptr || !unclipped.count(p->names[0]) ||
            p->sharded.size(0) == 0) {
          continue;
        }
        const ShardDiff d = DiffFromFull(fsdp, *p, sum, unclipped[p->names[0]]);
        EXPECT_LE(d.err, 1e-5 * d.scale + 1e-9)
            << "step 0 gradient of " << name << " is not the fp32 sum of the micro-batches' "
            << "bf16 gradients (Note [Mixed-precision gradients, exactly])";
      }
      for (const auto& item : reference->named_parameters()) {
        auto it = mp.grads.find(item.key());
        if (item.value().requires_grad() && it != mp.grads.end()) {
          item.value().mutable_grad() = it->second;
        }
      }
    } else {
      torch::Tensor ref_logits = reference->forward(x);
      torch::Tensor loss = torch::nn::functional::cross_entropy(
          ref_logits.reshape({-1, config.vocab}), y.reshape({-1}));
      loss.backward();
      ref_loss = loss.item<double>();
    }
    double ref_norm =
        torch::nn::utils::clip_grad_norm_(UniqueTrainable(*reference), kMaxNorm);
    for (const auto& item : reference->named_parameters()) {
      const FsdpParam* p = fsdp.FindParam(item.key());
      if (p == nullptr || !grads.count(p->names[0]) || !item.value().grad().defined()) continue;
      if (p->sharded.size(0) == 0) continue;
      const ShardDiff d = DiffFromFull(fsdp, *p, item.value().grad(), grads[p->names[0]]);
      worst_grad = std::max(worst_grad, d.err / std::max(d.scale, 1e-12));
      EXPECT_LE(d.err, tol.grad_rel * d.scale + 1e-9) << "grad of " << item.key() << " step " << step;
    }
    ref_opt->step();
    ref_opt->zero_grad();

    SCOPED_TRACE(StrCat("step ", step));
    double loss_err = std::abs(loss - ref_loss);
    worst_loss = std::max(worst_loss, loss_err);
    EXPECT_LE(loss_err, tol.atol * 10 + tol.rtol * std::abs(loss)) << loss << " vs " << ref_loss;
    EXPECT_NEAR(norm, ref_norm, tol.atol * 10 + tol.rtol * 10 * ref_norm);
    for (const auto& item : reference->named_parameters()) {
      const FsdpParam* p = fsdp.FindParam(item.key());
      ASSERT_NE(p, nullptr) << item.key();
      int64_t rows = p->sharded.size(0);
      if (rows > 0) {
        torch::Tensor expected = LocalRows(fsdp, *p, item.value().detach());
        torch::Tensor actual = p->sharded.detach().reshape(expected.sizes());
        double err = (actual - expected).abs().max().item<double>();
        worst_param = std::max(worst_param, err);
        EXPECT_TRUE(torch::allclose(actual, expected, tol.rtol, tol.atol))
            << item.key() << " rows " << fsdp.FirstLocalRow(*p) << "+" << rows
            << ": max abs diff " << err;
      }
    }
    if (::testing::Test::HasFailure()) break;
  }
  // The padding rows of every shard stayed zero.
  for (const auto& [name, shard] : fsdp.named_parameters()) {
    const FsdpParam* p = fsdp.FindParam(name);
    int64_t rows = p->sharded.size(0);
    if (rows < p->sharding.rows_per_shard) {
      EXPECT_EQ(p->padded_shard.narrow(0, rows, p->sharding.rows_per_shard - rows).abs().sum().item<double>(), 0.0) << name;
    }
  }
  if (rank == 0) {
    std::cout << "[parity] " << c.Name() << ": worst |param diff| " << worst_param
              << ", worst |loss diff| " << worst_loss << ", worst grad diff / max |grad| "
              << worst_grad << "\n";
  }
}


}  // namespace fsdp::testing
