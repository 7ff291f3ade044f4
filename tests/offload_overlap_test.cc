// The offloaded optimizer step overlapping the next forward (Note [Overlapped host step] in
// engine/trainable.cc; FsdpModel::StepOnHost, HostOffload::StepInOrder) on real ranks: the
// runs equal the step run in place bit for bit (offload params and optimizer, fp32 and bf16
// compute, 1 and 2 ranks, with an evaluation forward while the step is in flight), the step
// runs unit by unit in forward order on the host's thread without blocking the caller, and the
// trainer's rank statistics count it.
#include <atomic>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <future>
#include <mutex>

#include <torch/torch.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "absl/strings/match.h"
#include "checkpoint/format.h"
#include "common/strings.h"
#include "engine/host_adam.h"
#include "sharding/host_loops.h"
#include "engine/optimizer.h"
#include "sharding/fsdp_model.h"
#include "tests/gpu_skip.h"
#include "tests/multirank.h"
#include "tests/train_run.h"
#include "tests/tiny_gpt.h"

namespace fsdp {
namespace {

using testing::TinyGpt;
using testing::TinyGptConfig;

// The step in place: the overlapped step's debugging switch, for the ranks' environment.
const std::map<std::string, std::string> kInPlace = {{"FSDP_OFFLOAD_OVERLAP_STEP", "0"}};

constexpr int kSteps = 3;
constexpr int kMicroBatches = 2;
constexpr int64_t kGlobalBatch = 8;

// Two files (checkpoints of two runs) exist, are not empty and hold the same bytes.
void ExpectSameBytes(const std::string& path_a, const std::string& path_b) {
  std::ifstream a(path_a, std::ios::binary);
  std::ifstream b(path_b, std::ios::binary);
  ASSERT_TRUE(a && b) << path_a << " / " << path_b;
  std::string bytes_a((std::istreambuf_iterator<char>(a)), {});
  std::string bytes_b((std::istreambuf_iterator<char>(b)), {});
  EXPECT_FALSE(bytes_a.empty());
  EXPECT_TRUE(bytes_a == bytes_b) << path_a << " / " << path_b;
}

struct RunResult {
  std::vector<double> losses, eval_losses;
  std::map<std::string, torch::Tensor> masters;
  std::vector<std::string> group_order;  // overlapped: each group's first master, in step order
  bool returned_before_step = true;  // overlapped: StepOnHost returned before the last group ran
  HostOffload::Stats stats;
};

// kSteps steps of the fused AdamW (engine/optimizer.h), in place (step, CopyShardsToDevice) or
// overlapped (a prepared step through StepOnHost, as the trainer runs it), with an evaluation
// forward after each step, before the next training forward: while an overlapped step is in
// flight.
RunResult Train(Offload offload, bool bf16, bool overlapped, DeviceMesh& mesh, int rank,
                at::Device device = at::kCPU) {
  TinyGptConfig config;
  config.layers = 5;
  torch::manual_seed(4321);
  TinyGpt model(config);
  model->to(device);
  FsdpOptions options = OptionsForStrategy(Strategy::kFullShard);
  options.offload = offload;
  if (bf16) {
    options.mixed_precision.param_dtype = at::kBFloat16;
    options.mixed_precision.reduce_dtype = at::kFloat;
    options.mixed_precision.output_dtype = at::kFloat;
  }
  auto units = SelectUnits(*model, {.module_types = {"fsdp::testing::BlockImpl"}});
  std::unique_ptr<FsdpModel> wrapped = *FsdpModel::Wrap(model.ptr(), mesh, units, options);
  FsdpModel& fsdp = *wrapped;
  std::unique_ptr<torch::optim::Optimizer> opt = BuildOptimizer(
      {.kind = OptimizerKind::kAdamW, .lr = 1e-2, .weight_decay = 0.1}, fsdp.parameters());
  const int64_t micro = kGlobalBatch / mesh.shape().num_ranks() / kMicroBatches;
  auto loss_of = [&](const torch::Tensor& x, const torch::Tensor& y) {
    torch::Tensor logits = model->forward(x);
    return torch::nn::functional::cross_entropy(logits.reshape({-1, config.vocab}),
                                                y.reshape({-1}));
  };
  RunResult run;
  std::mutex order_mutex;
  std::map<const c10::TensorImpl*, std::string> names;
  for (const auto& [name, master] : fsdp.named_parameters()) names[master.unsafeGetTensorImpl()] = name;
  for (int step = 0; step < kSteps; ++step) {
    torch::manual_seed(200 + step);
    torch::Tensor x = torch::randint(config.vocab, {kGlobalBatch, config.seq}).to(device);
    torch::Tensor y = torch::randint(config.vocab, {kGlobalBatch, config.seq}).to(device);
    double loss_sum = 0;
    for (int m = 0; m < kMicroBatches; ++m) {
      const int64_t begin = (rank * kMicroBatches + m) * micro;
      torch::Tensor loss =
          loss_of(x.narrow(0, begin, micro), y.narrow(0, begin, micro)) / kMicroBatches;
      loss.backward();
      loss_sum += loss.item<double>();
    }
    run.losses.push_back(loss_sum);
    fsdp.ClipGradNorm(0.5);
    if (!overlapped) {
      opt->step();
      fsdp.CopyShardsToDevice();
      opt->zero_grad();
    } else {
      std::shared_ptr<PreparedStep> prepared = PrepareStep(*opt);
      EXPECT_NE(prepared, nullptr);
      if (prepared == nullptr) return run;
      // The last group waits until StepOnHost returned: were the step run inline, it would
      // time out here and say so.
      auto returned = std::make_shared<std::promise<void>>();
      std::shared_future<void> returned_future = returned->get_future().share();
      const size_t groups = fsdp.units().size();
      auto seen = std::make_shared<std::atomic<size_t>>(0);
      auto on_time = std::make_shared<std::atomic<bool>>(true);
      fsdp.StepOnHost([&, prepared, returned_future, groups, seen,
                       on_time](const std::vector<at::Tensor>& masters) {
        if (++*seen == groups &&
            returned_future.wait_for(std::chrono::seconds(30)) != std::future_status::ready) {
          *on_time = false;
        }
        {
          std::lock_guard<std::mutex> lock(order_mutex);
          if (step == 0) run.group_order.push_back(names.at(masters.at(0).unsafeGetTensorImpl()));
        }
        prepared->Run(masters);
      });
      returned->set_value();
      for (const at::Tensor& p : prepared->params()) p.mutable_grad().reset();
      opt->zero_grad();
      // The evaluation forward below waits unit by unit; the flag is read once the step ended.
      run.eval_losses.push_back(
          [&] {
            at::NoGradGuard no_grad;
            return loss_of(x.narrow(0, 0, micro), y.narrow(0, 0, micro)).item<double>();
          }());
      fsdp.FinishHostStep();
      run.returned_before_step = run.returned_before_step && *on_time;
      EXPECT_EQ(prepared->remaining(), 0u);
      continue;
    }
    at::NoGradGuard no_grad;
    run.eval_losses.push_back(loss_of(x.narrow(0, 0, micro), y.narrow(0, 0, micro)).item<double>());
  }
  fsdp.FinishHostStep();
  for (const auto& [name, shard] : fsdp.named_parameters()) {
    run.masters[name] = shard.detach().cpu().clone();
    const FsdpParam* p = fsdp.FindParam(name);
    if (offload == Offload::kOptimizer) {  // the device shards hold the stepped masters
      EXPECT_TRUE(torch::equal(p->padded_shard.cpu(), p->host->shard)) << name;
    }
    if (offload == Offload::kParams && p->host->compute_shard.defined()) {  // refreshed
      EXPECT_TRUE(torch::equal(p->host->compute_shard, p->host->shard.to(at::kBFloat16))) << name;
    }
  }
  run.stats = fsdp.context().offload->stats();
  return run;
}

class OffloadOverlapTest : public ::testing::TestWithParam<int> {};

TEST_P(OffloadOverlapTest, EqualsTheStepInPlaceBitwise) {
  const int world = GetParam();
  testing::RunOnRanks(world, [&](int rank) {
    std::shared_ptr<DistContext> ctx = testing::InitDist(testing::TestDistOptions());
    DeviceMesh mesh = *DeviceMesh::Create(ctx, *MeshShapeForStrategy(Strategy::kFullShard, world, 1));
    for (Offload offload : {Offload::kParams, Offload::kOptimizer}) {
      for (bool bf16 : {false, true}) {
        SCOPED_TRACE(StrCat(OffloadName(offload), bf16 ? " bf16" : " fp32", " rank ", rank));
        RunResult in_place = Train(offload, bf16, /*overlapped=*/false, mesh, rank);
        RunResult overlapped = Train(offload, bf16, /*overlapped=*/true, mesh, rank);
        EXPECT_EQ(overlapped.losses, in_place.losses);
        EXPECT_EQ(overlapped.eval_losses, in_place.eval_losses);
        ASSERT_EQ(overlapped.masters.size(), in_place.masters.size());
        for (const auto& [name, master] : in_place.masters) {
          EXPECT_TRUE(torch::equal(overlapped.masters.at(name), master)) << name;
        }
        EXPECT_TRUE(overlapped.returned_before_step);
        // One group per unit, in forward order: the root (embeddings, final norm) first, then
        // the 5 blocks in order.
        ASSERT_EQ(overlapped.group_order.size(), 6u);
        EXPECT_FALSE(absl::StartsWith(overlapped.group_order[0], "blocks."))
            << overlapped.group_order[0];
        for (size_t i = 1; i < overlapped.group_order.size(); ++i) {
          EXPECT_TRUE(absl::StartsWith(overlapped.group_order[i], StrCat("blocks.", i - 1, ".")))
              << overlapped.group_order[i];
        }
        EXPECT_EQ(overlapped.stats.overlapped_steps, kSteps);
        EXPECT_EQ(in_place.stats.overlapped_steps, 0);
        EXPECT_GT(overlapped.stats.host_step_s, 0);
        EXPECT_EQ(in_place.stats.host_step_s, 0);
        // Every load (forward and backward, training and evaluation) moves the same bytes.
        EXPECT_EQ(overlapped.stats.to_device_bytes, in_place.stats.to_device_bytes);
      }
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Worlds, OffloadOverlapTest, ::testing::Values(1, 2),
                         [](const auto& info) { return StrCat("world", info.param); });

// The same on a GPU: the host->device loads and pushes on the copy-in stream after each unit's
// update, the compute stream waiting for them (one rank: NCCL; two: Gloo on CUDA tensors).
TEST(OffloadOverlapCudaTest, EqualsTheStepInPlaceBitwiseOnTheGpu) {
  FSDP_SKIP_WITHOUT_GPU();
  for (int world : {1, 2}) {
    testing::RunOnRanks(world, [&](int rank) {
      std::shared_ptr<DistContext> ctx = testing::InitCudaDist(world);
      ASSERT_TRUE(ctx->device().is_cuda());
      DeviceMesh mesh =
          *DeviceMesh::Create(ctx, *MeshShapeForStrategy(Strategy::kFullShard, world, 1));
      for (Offload offload : {Offload::kParams, Offload::kOptimizer}) {
        for (bool bf16 : {false, true}) {
          SCOPED_TRACE(StrCat(OffloadName(offload), bf16 ? " bf16" : " fp32", " world ", world));
          RunResult in_place = Train(offload, bf16, false, mesh, rank, ctx->device());
          RunResult overlapped = Train(offload, bf16, true, mesh, rank, ctx->device());
          EXPECT_EQ(overlapped.losses, in_place.losses);
          EXPECT_EQ(overlapped.eval_losses, in_place.eval_losses);
          for (const auto& [name, master] : in_place.masters) {
            EXPECT_TRUE(torch::equal(overlapped.masters.at(name), master)) << name;
          }
          EXPECT_TRUE(overlapped.returned_before_step);
          EXPECT_EQ(overlapped.stats.overlapped_steps, kSteps);
        }
      }
    });
  }
}

// `fsdp train` with offload: the overlapped step (the default) trains, evaluates, checkpoints
// and resumes exactly as the step in place (FSDP_OFFLOAD_OVERLAP_STEP=0), and rank_stats counts
// it.
TEST(OffloadOverlapTrainTest, TrainsAsTheStepInPlace) {
  namespace fs = std::filesystem;
  for (const char* mode : {"params", "optimizer"}) {
    SCOPED_TRACE(mode);
    auto train = [&](const std::string& dir, std::vector<std::string> sets,
                     const std::map<std::string, std::string>& env = {}) {
      sets.insert(sets.begin(),
                  {"training.steps=5", "training.log_interval=1", "training.eval_interval=2",
                   "parallelism.nproc=2", "training.micro_batch_size=2",
                   "training.grad_accum_steps=2", "model.n_layers=3",
                   "training.mixed_precision=bf16", StrCat("parallelism.offload=", mode),
                   "checkpoint.enabled=true", "checkpoint.interval=2"});
      return testing::RunTrain(testing::SourceDir() + "/configs/default.yaml", dir, sets, env);
    };
    std::string overlapped_dir = testing::FreshTempDir("overlap-on"),
                in_place_dir = testing::FreshTempDir("overlap-off");
    testing::TrainRun overlapped = train(overlapped_dir, {});
    ASSERT_TRUE(overlapped.result.exit.ok()) << overlapped.result.Output();
    testing::TrainRun in_place = train(in_place_dir, {}, kInPlace);
    ASSERT_TRUE(in_place.result.exit.ok()) << in_place.result.Output();
    ASSERT_EQ(overlapped.losses.size(), 5u) << overlapped.result.Output();
    EXPECT_EQ(overlapped.losses, in_place.losses);
    const nlohmann::json& on = overlapped.rank0_stats["offload"];
    const nlohmann::json& off = in_place.rank0_stats["offload"];
    EXPECT_EQ(on["overlapped_steps"], 5) << on.dump();
    EXPECT_EQ(off["overlapped_steps"], 0) << off.dump();
    EXPECT_GT(on["host_step_s"].get<double>(), 0) << on.dump();
    EXPECT_GT(on["per_step"]["host_step_ms"].get<double>(), 0) << on.dump();
    // Two ranks, gradients summed on the host in fp32: every parameter of every step stepped by
    // the optimizer's one loop from its fp32 gradient where it matches ATen here (Note [Host
    // Adam pass]), casting into the loaded bf16 copy with offload params; none in place.
    if (HostAdamPassAvailable()) {
      EXPECT_GT(on["host_passes"].get<int64_t>(), 0) << on.dump();
      EXPECT_EQ(on["host_passes"].get<int64_t>() % 5, 0) << on.dump();
    }
    EXPECT_EQ(on["deferred_steps"], 0) << on.dump();
    EXPECT_EQ(off["host_passes"], 0) << off.dump();
    // Clipping's multiplication (max_grad_norm 1.0) done by the step, not the training thread
    // (Note [Deferred clipping multiplication]), for the same parameters; in place, not.
    EXPECT_EQ(on["clip_multiplies_deferred"].get<int64_t>() % 5, 0) << on.dump();
    EXPECT_GT(on["clip_multiplies_deferred"].get<int64_t>(), 0) << on.dump();
    if (HostAdamPassAvailable()) {
      EXPECT_EQ(on["clip_multiplies_deferred"], on["host_passes"]) << on.dump();
    }
    EXPECT_EQ(off["clip_multiplies_deferred"], 0) << off.dump();
    // The checkpoints hold the same bytes (the last one written after the last step ended).
    for (int step : {2, 4, 5}) {
      const std::string name = ckpt::StepDirName(step);
      for (const char* file : {"rank00000.bin", "rank00001.bin"}) {
        const std::string path = "/checkpoints/" + name + "/" + file;
        ExpectSameBytes(overlapped_dir + path, in_place_dir + path);
      }
    }
    // Resuming from step 2 with the overlapped step continues exactly.
    std::string resume_dir = testing::FreshTempDir("overlap-resume");
    testing::TrainRun resumed = train(
        resume_dir, {"checkpoint.load=" + in_place_dir + "/checkpoints/" + ckpt::StepDirName(2)});
    ASSERT_TRUE(resumed.result.exit.ok()) << resumed.result.Output();
    for (int64_t step = 3; step <= 5; ++step) {
      EXPECT_EQ(resumed.losses.at(step), in_place.losses.at(step)) << "step " << step;
    }
    fs::remove_all(overlapped_dir);
    fs::remove_all(in_place_dir);
    fs::remove_all(resume_dir);
  }
}

// The grad_norm of each step record, in order.
std::vector<double> GradNorms(const testing::TrainRun& run) {
  std::vector<double> norms;
  for (const nlohmann::json& r : run.step_records) norms.push_back(r.value("grad_norm", -1.0));
  return norms;
}

// Note [Deferred clipping multiplication] (sharding/offload/deferred_grads.h) through fsdp train,
// where gradients reach the host in fp32 (two ranks; one rank summing two micro-batches on the
// host), with clipping active (max_grad_norm well below the norms). The adder computes each .grad's
// term of the norm as the last micro-batch's gradients land, and the overlapped step multiplies the
// .grads itself: in the optimizer's one loop (Note [Host Adam pass]); with
// FSDP_OFFLOAD_HOST_PASS=off before ATen's step, slice by slice (offload params, casting into the
// bf16 copy; 1040-element slices that end mid-tensor) or on the unit's gradients (offload
// optimizer); with Adam's L2 decay, which the loop does not cover, before ATen's slices or its step
// of the whole tensor. Each gives the norms, losses and checkpoint bytes of the step in place with
// the same optimizer, which does all of it on the training thread. (That the adder's sums split
// their work as the training thread's do, as ATen sets each thread's count at its first parallel
// op, is HostLoopsTest.SumsOfSquaresOnAnotherThreadAreTheSame's.)
TEST(OffloadOverlapTrainTest, ClippingLeftToTheStepGivesClippingsValues) {
  namespace fs = std::filesystem;
  struct Variant {
    std::string optimizer, knob;  // optimizer.name; FSDP_OFFLOAD_HOST_PASS
    bool loop;                    // the one loop may run
  };
  struct Layout {
    const char* mode;  // parallelism.offload
    std::vector<std::string> sets;
    std::vector<Variant> variants;
  };
  const std::vector<Variant> all = {
      {"adamw", "on", true}, {"adamw", "off", false}, {"adam", "on", false}};
  const Layout layouts[] = {
      {"params", {"parallelism.nproc=2"}, all},
      {"optimizer", {"parallelism.nproc=2"}, all},
      {"params", {"parallelism.nproc=1", "training.grad_accum_steps=2"}, {all.front()}},
  };
  for (const Layout& layout : layouts) {
    auto train = [&](const std::string& dir, const std::string& optimizer,
                     std::vector<std::string> sets,
                     const std::map<std::string, std::string>& env = {}) {
      sets.insert(sets.begin(),
                  {"training.steps=4", "training.log_interval=1", "training.eval_interval=0",
                   "training.micro_batch_size=2", "model.n_layers=2",
                   "training.mixed_precision=bf16", StrCat("parallelism.offload=", layout.mode),
                   "training.max_grad_norm=0.05", "checkpoint.enabled=true",
                   "checkpoint.interval=4", "optimizer.name=" + optimizer});
      sets.insert(sets.end(), layout.sets.begin(), layout.sets.end());
      return testing::RunTrain(testing::SourceDir() + "/configs/default.yaml", dir, sets, env);
    };
    std::map<std::string, testing::TrainRun> in_place;
    std::map<std::string, std::string> in_place_dir;
    for (const Variant& v : layout.variants) {
      if (in_place.contains(v.optimizer)) continue;
      in_place_dir[v.optimizer] = testing::FreshTempDir("clip-in-place-" + v.optimizer);
      testing::TrainRun& run = in_place[v.optimizer] =
          train(in_place_dir[v.optimizer], v.optimizer, {}, kInPlace);
      ASSERT_TRUE(run.result.exit.ok()) << run.result.Output();
      ASSERT_EQ(run.losses.size(), 4u) << run.result.Output();
      EXPECT_EQ(run.rank0_stats["offload"]["clip_multiplies_deferred"], 0);
      EXPECT_EQ(run.rank0_stats["offload"]["clip_terms_on_adder"], 0);
    }
    for (const Variant& v : layout.variants) {
      SCOPED_TRACE(StrCat(layout.mode, " ", StrJoin(layout.sets, " "), " ", v.optimizer,
                          " FSDP_OFFLOAD_HOST_PASS=", v.knob));
      const std::string dir = testing::FreshTempDir("clip-deferred");
      testing::TrainRun run = train(
          dir, v.optimizer, {},
          {{"FSDP_OFFLOAD_STEP_SLICE", "1040"}, {"FSDP_OFFLOAD_HOST_PASS", v.knob}});
      ASSERT_TRUE(run.result.exit.ok()) << run.result.Output();
      EXPECT_EQ(run.losses, in_place[v.optimizer].losses);
      EXPECT_EQ(GradNorms(run), GradNorms(in_place[v.optimizer]));
      const nlohmann::json& on = run.rank0_stats["offload"];
      // Every trainable parameter of every step: a multiple of 4, the same count each way.
      const int64_t multiplied = on["clip_multiplies_deferred"].get<int64_t>();
      EXPECT_GT(multiplied, 0) << on.dump();
      EXPECT_EQ(multiplied % 4, 0) << on.dump();
      EXPECT_EQ(on["clip_terms_on_adder"].get<int64_t>(), multiplied) << on.dump();
      const bool one_loop = v.loop && HostAdamPassAvailable();
      EXPECT_EQ(on["host_passes"].get<int64_t>(), one_loop ? multiplied : 0) << on.dump();
      for (const std::string& file : {std::string("rank00000.bin"), std::string("rank00001.bin")}) {
        const std::string path = "/checkpoints/" + ckpt::StepDirName(4) + "/" + file;
        if (!fs::exists(in_place_dir[v.optimizer] + path)) continue;  // one rank
        ExpectSameBytes(dir + path, in_place_dir[v.optimizer] + path);
      }
      fs::remove_all(dir);
    }
    for (const auto& [optimizer, dir] : in_place_dir) fs::remove_all(dir);
  }
}

// A record's loss, grad norm and skip flag as written (a non-finite number is null).
std::vector<std::string> StepSummaries(const testing::TrainRun& run) {
  std::vector<std::string> out;
  for (const nlohmann::json& r : run.step_records) {
    out.push_back(StrCat(r["step"].dump(), " loss ", r["loss"].dump(), " grad_norm ",
                         r["grad_norm"].dump(), " skipped ", r.value("skipped", false)));
  }
  return out;
}

// One non-finite step between finite ones (FSDP_TEST_NONFINITE: one rank's loss is NaN in step
// 2, so every gradient and the global norm are) with training.on_nonfinite: skip, clipping
// active, a checkpoint and an evaluation right after the skipped step. What the overlapped step
// left pending when the step was skipped must not reach the next one: the clipping coefficient
// (NaN) of the fp32 .grads' deferred multiplications (Note [Deferred clipping multiplication]),
// the norm's terms the adder computed, the bf16 gradients left for the one pass (Note [Deferred
// gradient conversion]). Each layout gives the records (a skipped step 2 on both), losses, norms
// and checkpoint bytes of the step in place with the same injection.
TEST(OffloadOverlapTrainTest, SkippedNonFiniteStepLeavesNothingPending) {
  namespace fs = std::filesystem;
  struct Layout {
    std::vector<std::string> sets;
    std::string poisoned;  // FSDP_TEST_NONFINITE
    bool fp32_grads;       // the gradients reach the host in fp32 (else bf16, deferred)
  };
  const Layout layouts[] = {
      {{"parallelism.offload=params", "parallelism.nproc=2"}, "1@2", true},
      {{"parallelism.offload=optimizer", "parallelism.nproc=2"}, "0@2", true},
      {{"parallelism.offload=params", "parallelism.nproc=1", "training.grad_accum_steps=2"},
       "0@2",
       true},
      {{"parallelism.offload=params", "parallelism.nproc=1"}, "0@2", false},
  };
  for (const Layout& layout : layouts) {
    SCOPED_TRACE(StrJoin(layout.sets, " "));
    auto train = [&](const std::string& dir, std::vector<std::string> sets,
                     bool in_place = false) {
      sets.insert(sets.begin(),
                  {"training.steps=4", "training.log_interval=1", "training.eval_interval=2",
                   "training.micro_batch_size=2", "model.n_layers=2",
                   "training.mixed_precision=bf16", "training.max_grad_norm=0.05",
                   "training.on_nonfinite=skip", "checkpoint.enabled=true",
                   "checkpoint.interval=2"});
      sets.insert(sets.end(), layout.sets.begin(), layout.sets.end());
      std::map<std::string, std::string> env = {{"FSDP_TEST_NONFINITE", layout.poisoned}};
      if (in_place) env.insert(kInPlace.begin(), kInPlace.end());
      return testing::RunTrain(testing::SourceDir() + "/configs/default.yaml", dir, sets, env);
    };
    const std::string overlapped_dir = testing::FreshTempDir("skip-overlapped"),
                      in_place_dir = testing::FreshTempDir("skip-in-place");
    testing::TrainRun overlapped = train(overlapped_dir, {});
    ASSERT_TRUE(overlapped.result.exit.ok()) << overlapped.result.Output();
    testing::TrainRun in_place = train(in_place_dir, {}, /*in_place=*/true);
    ASSERT_TRUE(in_place.result.exit.ok()) << in_place.result.Output();
    const std::vector<std::string> records = StepSummaries(overlapped);
    ASSERT_EQ(records.size(), 4u) << overlapped.result.Output();
    EXPECT_EQ(records[1], "2 loss null grad_norm null skipped true") << overlapped.result.Output();
    EXPECT_EQ(records, StepSummaries(in_place));
    EXPECT_TRUE(std::isfinite(overlapped.losses.at(4))) << overlapped.result.Output();
    for (int step : {2, 4}) {
      for (const std::string& file : {std::string("rank00000.bin"), std::string("rank00001.bin")}) {
        const std::string path = "/checkpoints/" + ckpt::StepDirName(step) + "/" + file;
        if (!fs::exists(in_place_dir + path)) continue;  // one rank
        ExpectSameBytes(overlapped_dir + path, in_place_dir + path);
      }
    }
    // Three updates ran; the skipped step's clipping was computed (its terms too) and dropped.
    const nlohmann::json& on = overlapped.rank0_stats["offload"];
    EXPECT_EQ(on["overlapped_steps"], 3) << on.dump();
    if (layout.fp32_grads) {
      const int64_t multiplied = on["clip_multiplies_deferred"].get<int64_t>();
      const int64_t terms = on["clip_terms_on_adder"].get<int64_t>();
      EXPECT_GT(multiplied, 0) << on.dump();
      EXPECT_EQ(multiplied % 3, 0) << on.dump();
      EXPECT_EQ(terms, multiplied / 3 * 4) << on.dump();
    } else {
      // The skipped step's deferred bf16 gradients were dropped, never converted.
      EXPECT_GT(on["deferred_steps"].get<int64_t>(), 0) << on.dump();
      EXPECT_EQ(on["deferred_steps"].get<int64_t>() % 3, 0) << on.dump();
      EXPECT_EQ(on["deferred_materialized"], 0) << on.dump();
    }
    fs::remove_all(overlapped_dir);
    fs::remove_all(in_place_dir);
  }
}

// Note [Deferred gradient conversion] (sharding/offload/deferred_grads.h) through fsdp train:
// offload params on one rank with bf16 compute, where gradients land on the host in bf16. With the
// overlapped step a gradient that lands alone is converted, clipped and stepped in one pass; a
// second one (host accumulation) converts the first on landing; the step in place converts as it
// lands. All three give the in-place run's losses and checkpoint bytes, with clipping active
// (max_grad_norm well below the norms) and off. The first case runs the optimizer's one loop (Note
// [Host Adam pass], where it matches ATen on this machine); the second, with
// FSDP_OFFLOAD_HOST_PASS=off, ATen's ops in 1040-element slices (FSDP_OFFLOAD_STEP_SLICE) that end
// mid-tensor and leave a shorter last one; so does the third case's conversion and addition of the
// second gradient.
TEST(OffloadOverlapTrainTest, DeferredGradientsTrainAsTheStepInPlace) {
  namespace fs = std::filesystem;
  struct Case {
    std::vector<std::string> sets;
    bool deferred_steps;  // stepped in one pass (else converted on a second gradient's landing)
    std::map<std::string, std::string> env;  // the one-pass run's
  };
  const Case cases[] = {
      {{"training.grad_accum_steps=1", "training.max_grad_norm=0.05"},
       true,
       {{"FSDP_OFFLOAD_HOST_THREADS", "3"}}},
      {{"training.grad_accum_steps=2", "training.grad_sync=last", "training.max_grad_norm=0.05"},
       true,
       {{"FSDP_OFFLOAD_STEP_SLICE", "1040"}, {"FSDP_OFFLOAD_HOST_PASS", "off"}}},
      {{"training.grad_accum_steps=2", "training.max_grad_norm=0"},
       false,
       {{"FSDP_OFFLOAD_STEP_SLICE", "1040"}}},
  };
  for (const Case& c : cases) {
    std::string env_text;
    for (const auto& [name, value] : c.env) env_text += StrCat(" ", name, "=", value);
    SCOPED_TRACE(StrJoin(c.sets, " ") + env_text);
    auto train = [&](const std::string& dir, std::vector<std::string> sets,
                     const std::map<std::string, std::string>& env = {}) {
      sets.insert(sets.begin(),
                  {"training.steps=4", "training.log_interval=1", "training.eval_interval=0",
                   "parallelism.nproc=1", "training.micro_batch_size=2", "model.n_layers=2",
                   "training.mixed_precision=bf16", "parallelism.offload=params",
                   "checkpoint.enabled=true", "checkpoint.interval=2"});
      sets.insert(sets.end(), c.sets.begin(), c.sets.end());
      return testing::RunTrain(testing::SourceDir() + "/configs/default.yaml", dir, sets, env);
    };
    std::string one_pass_dir = testing::FreshTempDir("deferred-on"),
                in_place_dir = testing::FreshTempDir("deferred-off");
    testing::TrainRun one_pass = train(one_pass_dir, {}, c.env);
    ASSERT_TRUE(one_pass.result.exit.ok()) << one_pass.result.Output();
    testing::TrainRun in_place = train(in_place_dir, {}, kInPlace);
    ASSERT_TRUE(in_place.result.exit.ok()) << in_place.result.Output();
    ASSERT_EQ(one_pass.losses.size(), 4u) << one_pass.result.Output();
    EXPECT_EQ(one_pass.losses, in_place.losses);
    const nlohmann::json& on = one_pass.rank0_stats["offload"];
    const nlohmann::json& off = in_place.rank0_stats["offload"];
    // The loops' threads: FSDP_OFFLOAD_HOST_THREADS where set, else at::get_num_threads().
    if (c.env.contains("FSDP_OFFLOAD_HOST_THREADS")) {
      EXPECT_EQ(on["host_threads"].dump(), c.env.at("FSDP_OFFLOAD_HOST_THREADS")) << on.dump();
    } else {
      EXPECT_GE(on["host_threads"].get<int64_t>(), 1) << on.dump();
    }
    if (c.deferred_steps) {
      // Every trainable parameter of every step went through the one pass.
      EXPECT_GT(on["deferred_steps"].get<int64_t>(), 0) << on.dump();
      EXPECT_EQ(on["deferred_steps"].get<int64_t>() % 4, 0) << on.dump();
      EXPECT_EQ(on["deferred_materialized"], 0) << on.dump();
      EXPECT_EQ(on["host_adds"], 0) << on.dump();
      // The optimizer's one loop where it matches ATen here, unless turned off.
      const bool one_loop = HostAdamPassAvailable() && !c.env.contains("FSDP_OFFLOAD_HOST_PASS");
      EXPECT_EQ(on["host_passes"], one_loop ? on["deferred_steps"].get<int64_t>() : 0)
          << on.dump();
    } else {
      EXPECT_EQ(on["deferred_steps"], 0) << on.dump();
      EXPECT_GT(on["deferred_materialized"].get<int64_t>(), 0) << on.dump();
      // The second micro-batch's bf16 gradients added by one loop (Note [Host loops]).
      EXPECT_GT(on["host_adds"].get<int64_t>(), 0) << on.dump();
      EXPECT_EQ(on["host_add_passes"].get<int64_t>(),
                HostAddConvertedAvailable(HostNarrow::kBFloat16) ? on["host_adds"].get<int64_t>()
                                                                 : 0)
          << on.dump();
      // Then each step from the summed fp32 gradient by the one loop.
      if (HostAdamPassAvailable()) {
        EXPECT_GT(on["host_passes"].get<int64_t>(), 0) << on.dump();
        EXPECT_EQ(on["host_passes"].get<int64_t>() % 4, 0) << on.dump();
      }
    }
    EXPECT_EQ(off["deferred_steps"], 0) << off.dump();
    EXPECT_EQ(off["deferred_materialized"], 0) << off.dump();
    // Note [Gradients committed on demand]: the fp32 gradients behind the bf16 landing buffers
    // take host memory once written. The step in place writes them all (it materializes the
    // deferred ones); the one loop from a deferred gradient never writes them; ATen's slices
    // and host sums do. Either way the same buffers are reserved.
    const nlohmann::json& state_on = one_pass.rank0_stats["model_state"];
    const nlohmann::json& state_off = in_place.rank0_stats["model_state"];
    EXPECT_EQ(state_off["host_untouched_bytes"], 0) << state_off.dump();
    EXPECT_EQ(state_on["host_bytes"].get<int64_t>() +
                  state_on["host_untouched_bytes"].get<int64_t>(),
              state_off["host_bytes"].get<int64_t>())
        << state_on.dump() << " vs " << state_off.dump();
    const bool never_written = c.deferred_steps && HostAdamPassAvailable() &&
                               !c.env.contains("FSDP_OFFLOAD_HOST_PASS");
    if (never_written) {
      EXPECT_GT(state_on["host_untouched_bytes"].get<int64_t>(), 0) << state_on.dump();
    } else if (!c.deferred_steps) {
      EXPECT_EQ(state_on["host_untouched_bytes"], 0) << state_on.dump();
    }
    for (int step : {2, 4}) {
      const std::string path = "/checkpoints/" + ckpt::StepDirName(step) + "/rank00000.bin";
      ExpectSameBytes(one_pass_dir + path, in_place_dir + path);
    }
    fs::remove_all(one_pass_dir);
    fs::remove_all(in_place_dir);
  }
}

// A bad FSDP_OFFLOAD_STEP_SLICE, FSDP_OFFLOAD_HOST_PASS or FSDP_OFFLOAD_HOST_THREADS stops the
// run before training, naming the knob and what is valid.
TEST(OffloadOverlapTrainTest, BadHostKnobsAreClearErrors) {
  struct Bad {
    std::string knob, value, message;
  };
  const std::vector<Bad> bads = {
      {"FSDP_OFFLOAD_STEP_SLICE", "1000", "FSDP_OFFLOAD_STEP_SLICE=1000 is not a multiple of 16"},
      {"FSDP_OFFLOAD_STEP_SLICE", "8", "FSDP_OFFLOAD_STEP_SLICE=8 is out of range"},
      {"FSDP_OFFLOAD_STEP_SLICE", "lots", "FSDP_OFFLOAD_STEP_SLICE"},
      {"FSDP_OFFLOAD_HOST_PASS", "maybe", "FSDP_OFFLOAD_HOST_PASS=maybe: valid: on, off"},
      {"FSDP_OFFLOAD_HOST_THREADS", "0", "FSDP_OFFLOAD_HOST_THREADS=0 is out of range"},
      {"FSDP_OFFLOAD_OVERLAP_STEP", "no", "FSDP_OFFLOAD_OVERLAP_STEP=no is not valid; valid: 0, 1"},
      {"FSDP_OFFLOAD_COMPUTE_COPY", "2", "FSDP_OFFLOAD_COMPUTE_COPY=2 is not valid; valid: 0, 1"},
  };
  for (const Bad& bad : bads) {
    SCOPED_TRACE(bad.knob + "=" + bad.value);
    const std::string dir = testing::FreshTempDir("bad-slice");
    testing::TrainRun run = testing::RunTrain(
        testing::SourceDir() + "/configs/default.yaml", dir,
        {"training.steps=1", "parallelism.nproc=1", "model.n_layers=1",
         "training.mixed_precision=bf16", "parallelism.offload=params"},
        {{bad.knob, bad.value}});
    EXPECT_FALSE(run.result.exit.ok()) << run.result.Output();
    EXPECT_THAT(run.result.Output(), ::testing::HasSubstr(bad.message));
    EXPECT_TRUE(run.losses.empty()) << run.result.Output();
    std::filesystem::remove_all(dir);
  }
}

// The same on a GPU (one rank, NCCL): the contributions are the device's fp32 norms and the
// coefficient reaches the host through pinned memory after an event, so the norm is rounded
// differently from the in-place run's (the host's sums of squares): close, not the same bits.
TEST(OffloadOverlapCudaTest, DeferredGradientsTrainAsTheStepInPlaceOnTheGpu) {
  FSDP_SKIP_WITHOUT_GPU();
  for (const char* accumulation : {"training.grad_accum_steps=1", "training.grad_sync=last"}) {
    SCOPED_TRACE(accumulation);
    auto train = [&](const std::string& dir, std::vector<std::string> sets,
                     bool in_place = false) {
      sets.insert(sets.begin(),
                  {"training.steps=4", "training.log_interval=1", "training.eval_interval=0",
                   "parallelism.nproc=1", "training.device=cuda", "parallelism.backend=nccl",
                   "training.micro_batch_size=2", "training.grad_accum_steps=2",
                   "model.n_layers=2", "training.mixed_precision=bf16",
                   "parallelism.offload=params", "training.max_grad_norm=0.05", accumulation});
      std::map<std::string, std::string> env = testing::WithGpus();
      if (in_place) env.insert(kInPlace.begin(), kInPlace.end());
      return testing::RunTrain(testing::SourceDir() + "/configs/default.yaml", dir, sets, env);
    };
    testing::TrainRun one_pass = train(testing::FreshTempDir("deferred-cuda-on"), {});
    ASSERT_TRUE(one_pass.result.exit.ok()) << one_pass.result.Output();
    testing::TrainRun in_place =
        train(testing::FreshTempDir("deferred-cuda-off"), {}, /*in_place=*/true);
    ASSERT_TRUE(in_place.result.exit.ok()) << in_place.result.Output();
    ASSERT_EQ(one_pass.losses.size(), 4u) << one_pass.result.Output();
    for (const auto& [step, loss] : in_place.losses) {
      EXPECT_NEAR(one_pass.losses.at(step), loss, 1e-4 * std::abs(loss)) << "step " << step;
    }
    EXPECT_GT(one_pass.rank0_stats["offload"]["deferred_steps"].get<int64_t>(), 0)
        << one_pass.rank0_stats.dump();
  }
}

}  // namespace
}  // namespace fsdp
