// Checkpoint staging (engine/checkpoint_staging.h, Note [Checkpoint staging]): host buffers
// reused across saves, the snapshot taken at the save whatever the loop does next, and the
// Checkpointer's async saves reloading bitwise, on CPU and (tests named *Cuda*, label gpu,
// skipped without a GPU) on CUDA, where the copies are non_blocking on a side stream and the
// next optimizer step is issued right after Save returns.
#include <filesystem>
#include <map>

#include <torch/torch.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "checkpoint/format.h"
#include "common/strings.h"
#include "device_mesh/cuda_support.h"
#include "device_mesh/device_mesh.h"
#include "engine/checkpoint_staging.h"
#include "engine/checkpointing.h"
#include "engine/optimizer.h"
#include "sharding/fsdp_model.h"
#include "tests/multirank.h"
#include "tests/tiny_gpt.h"

namespace fsdp {
namespace {

int64_t Bytes(const at::Tensor& t) { return t.numel() * t.element_size(); }

TEST(CheckpointStagingTest, ReusesHostBuffersAcrossSnapshots) {
  at::Tensor a = at::arange(12, at::kFloat).reshape({3, 4});
  at::Tensor b = at::arange(5, at::kLong);
  at::Tensor gone = at::ones({7}, at::kBFloat16);
  CheckpointStaging staging;
  staging.Begin();
  at::Tensor a1 = staging.Stage("a", a);
  at::Tensor b1 = staging.Stage("b", b);
  staging.Stage("gone", gone);
  staging.End().Wait();
  EXPECT_TRUE(at::equal(a1, a));
  EXPECT_TRUE(at::equal(b1, b));
  EXPECT_EQ(staging.last_allocated_bytes(), Bytes(a) + Bytes(b) + Bytes(gone));
  EXPECT_EQ(staging.last_allocated_pinned_bytes(), 0);  // host sources: plain memory

  // Second snapshot: same key and shape -> same buffer, refilled; another shape -> a new one;
  // a key not staged any more -> its buffer freed.
  a.mul_(-2);
  at::Tensor b_longer = at::arange(6, at::kLong);
  staging.Begin();
  at::Tensor a2 = staging.Stage("a", a);
  at::Tensor b2 = staging.Stage("b", b_longer);
  staging.End().Wait();
  EXPECT_EQ(a2.data_ptr(), a1.data_ptr());
  EXPECT_TRUE(at::equal(a2, a));
  EXPECT_NE(b2.data_ptr(), b1.data_ptr());
  EXPECT_TRUE(at::equal(b2, b_longer));
  EXPECT_EQ(staging.last_allocated_bytes(), Bytes(b_longer));
  EXPECT_EQ(staging.held_bytes(), Bytes(a) + Bytes(b_longer));

  // A dtype change is a new buffer too.
  staging.Begin();
  at::Tensor a3 = staging.Stage("a", a.to(at::kDouble));
  staging.End().Wait();
  EXPECT_EQ(a3.scalar_type(), at::kDouble);
  EXPECT_EQ(staging.last_allocated_bytes(), Bytes(a3));
}

// Reserve allocates ahead of the first Stage: a snapshot staging what was reserved allocates
// nothing; a reserved key the snapshot does not stage is freed at its End; a reservation that
// no longer fits is replaced.
TEST(CheckpointStagingTest, ReservedBuffersAreTheFirstSnapshots) {
  at::Tensor a = at::arange(12, at::kFloat).reshape({3, 4});
  at::Tensor b = at::arange(5, at::kLong);
  CheckpointStaging staging;
  EXPECT_EQ(staging.Reserve("a", a), Bytes(a));
  EXPECT_EQ(staging.Reserve("a", a), 0);  // fits already
  EXPECT_EQ(staging.Reserve("b", at::empty({4}, at::kLong)), 4 * 8);
  EXPECT_EQ(staging.Reserve("b", b), Bytes(b));  // another shape: replaced
  EXPECT_EQ(staging.Reserve("unused", at::ones({9})), 9 * 4);
  EXPECT_EQ(staging.held_bytes(), Bytes(a) + Bytes(b) + 9 * 4);
  EXPECT_EQ(staging.held_pinned_bytes(), 0);  // host tensors: plain memory
  staging.Begin();
  EXPECT_THROW(staging.Reserve("c", a), c10::Error);  // not inside a snapshot
  at::Tensor a1 = staging.Stage("a", a);
  at::Tensor b1 = staging.Stage("b", b);
  staging.End().Wait();
  EXPECT_EQ(staging.last_allocated_bytes(), 0);
  EXPECT_TRUE(at::equal(a1, a));
  EXPECT_TRUE(at::equal(b1, b));
  EXPECT_EQ(staging.held_bytes(), Bytes(a) + Bytes(b));  // "unused" freed
}

TEST(CheckpointStagingTest, SnapshotIsTheValueAtStage) {
  at::Tensor src = at::arange(10, at::kFloat);
  CheckpointStaging staging;
  staging.Begin();
  at::Tensor host = staging.Stage("x", src);
  StagedCopies copies = staging.End();
  src.fill_(-1);  // the loop's next step
  copies.Wait();
  EXPECT_TRUE(at::equal(host, at::arange(10, at::kFloat)));
}

// The buffers of a snapshot are reused by the next one only after its copies were waited for
// (the writer may still read them otherwise): a Begin before that is refused.
TEST(CheckpointStagingTest, BeginBeforeThePreviousCopiesWereWaitedIsRefused) {
  CheckpointStaging staging;
  staging.Begin();
  staging.Stage("x", at::ones({4}));
  StagedCopies copies = staging.End();
  EXPECT_THROW(staging.Begin(), c10::Error);
  copies.Wait();
  staging.Begin();  // now it may
  staging.Stage("x", at::ones({4}));
  staging.End().Wait();
}

// On CUDA: pinned buffers, reused; and a write issued on the current stream right after End
// (the next optimizer step) does not reach the snapshot. 256 MiB, so that the copy takes
// milliseconds and the fill (microseconds) would overtake it if the current stream did not
// wait for the copy.
TEST(CheckpointStagingTest, CudaCopiesArePinnedReusedAndNotOverwritten) {
  FSDP_SKIP_WITHOUT_GPU();
  const int64_t n = int64_t{64} << 20;
  at::Tensor expected = at::rand({n}, at::kFloat);
  at::Tensor src = expected.to(at::kCUDA);
  CheckpointStaging staging;
  at::Tensor first;
  for (int round = 0; round < 2; ++round) {
    staging.Begin();
    at::Tensor host = staging.Stage("x", src);
    StagedCopies copies = staging.End();
    src.fill_(-1);  // issued at once on the current stream
    src.mul_(3);
    copies.Wait();
    EXPECT_TRUE(host.is_pinned());
    EXPECT_TRUE(at::equal(host, expected)) << "round " << round;
    if (round == 0) {
      first = host;
      EXPECT_EQ(staging.last_allocated_pinned_bytes(), Bytes(src));
    } else {
      EXPECT_EQ(host.data_ptr(), first.data_ptr());
      EXPECT_EQ(staging.last_allocated_bytes(), 0);
    }
    expected = at::rand({n}, at::kFloat);
    src.copy_(expected);
  }
}

// ---- the Checkpointer --------------------------------------------------------------------

using TensorMap = std::map<std::string, at::Tensor>;

// Every tensor a checkpoint holds, as host copies, by checkpoint name (model/..., optim/...).
TensorMap StateOf(FsdpModel& model, torch::optim::Optimizer& optimizer) {
  TensorMap out;
  for (const auto& [name, shard] : model.named_parameters()) {
    out["model/" + name] = shard.detach().to(at::kCPU, /*non_blocking=*/false, /*copy=*/true);
    auto it = optimizer.state().find(shard.unsafeGetTensorImpl());
    if (it == optimizer.state().end()) continue;
    for (auto& [state_name, tensor] : StateTensors(*it->second)) {
      if (tensor->defined()) {
        out[StrCat("optim/", name, "/", state_name)] =
            tensor->to(at::kCPU, /*non_blocking=*/false, /*copy=*/true);
      }
    }
    if (int64_t* step = StepCounter(*it->second)) {
      out[StrCat("optim/", name, "/step")] = at::tensor(*step, at::kLong);
    }
  }
  return out;
}

void ExpectBitwiseEqual(const TensorMap& got, const TensorMap& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (const auto& [name, w] : want) {
    auto it = got.find(name);
    ASSERT_NE(it, got.end()) << what << ": " << name;
    EXPECT_TRUE(at::equal(it->second, w)) << what << ": " << name;
  }
}

struct Run {
  std::shared_ptr<DistContext> ctx;
  std::optional<DeviceMesh> mesh;
  testing::TinyGpt model{nullptr};
  std::unique_ptr<FsdpModel> fsdp;
  std::unique_ptr<torch::optim::Optimizer> optimizer;

  // One AdamW step with gradients from `seed` (the update writes the shards and the state on
  // the current stream, as the training loop's does).
  void Step(int seed) {
    at::NoGradGuard no_grad;
    at::manual_seed(seed);
    for (at::Tensor& p : optimizer->param_groups()[0].params()) {
      if (p.requires_grad()) p.mutable_grad() = at::randn_like(p);
    }
    optimizer->step();
  }
};

void MakeRun(const std::string& device, const RunConfig& config, int seed, Run& run) {
  DistOptions options = testing::TestDistOptions();
  options.device = device;
  if (device == "cuda") options.cuda_backend = "nccl";
  absl::StatusOr<LaunchEnv> env = ParseLaunchEnv(MapEnv({}));
  ASSERT_TRUE(env.ok()) << env.status();
  absl::StatusOr<std::shared_ptr<DistContext>> ctx = DistContext::Init(*env, options);
  ASSERT_TRUE(ctx.ok()) << ctx.status();
  run.ctx = *ctx;
  absl::StatusOr<MeshShape> shape = MeshShapeForStrategy(Strategy::kFullShard, 1, 1);
  ASSERT_TRUE(shape.ok()) << shape.status();
  absl::StatusOr<DeviceMesh> mesh = DeviceMesh::Create(run.ctx, *shape);
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  run.mesh.emplace(*std::move(mesh));
  torch::manual_seed(seed);
  run.model = testing::TinyGpt(testing::TinyGptConfig{});
  run.model->to(run.ctx->device());
  auto units = SelectUnits(*run.model, {.module_types = {"fsdp::testing::BlockImpl"}});
  absl::StatusOr<std::unique_ptr<FsdpModel>> wrapped =
      FsdpModel::Wrap(run.model.ptr(), *run.mesh, units, OptionsForStrategy(Strategy::kFullShard));
  ASSERT_TRUE(wrapped.ok()) << wrapped.status();
  run.fsdp = *std::move(wrapped);
  run.optimizer = BuildOptimizer(config.optimizer, run.fsdp->parameters());
}

// Two async saves of a run whose next step is issued right after each Save returns; each
// checkpoint reloads into a fresh model and optimizer bitwise equal to the state at its save,
// and the second save reused the first one's staging buffers. With `reserve`, the staging is
// reserved before the first step (as the trainer does): then the first save allocates nothing
// either, although the optimizer state it stages did not exist at the reservation.
// Synchronous saves of host tensors write them in place: nothing reserved or staged at all.
void SaveTwiceAndReload(const std::string& device, bool reserve, bool async = true) {
  const std::string dir = testing::FreshTempDir("staging-" + device);
  RunConfig config;
  config.run.dir = dir;
  config.checkpoint.enabled = true;
  config.checkpoint.async = async;
  const bool in_place = !async && device == "cpu";
  config.checkpoint.keep_latest_k = 5;
  Run run;
  ASSERT_NO_FATAL_FAILURE(MakeRun(device, config, 1, run));
  std::vector<TensorMap> saved;
  {
    Checkpointer ckpt(config, run.ctx, *run.mesh, *run.fsdp, *run.optimizer);
    if (reserve) {
      ASSERT_TRUE(run.optimizer->state().empty());
      const int64_t reserved = ckpt.ReserveStaging();
      // Every shard, and AdamW's two state tensors for each trainable one (not the frozen
      // pos_emb, which has no state).
      int64_t expected = 0;
      for (const auto& [name, shard] : run.fsdp->named_parameters()) {
        expected += (run.fsdp->FindParam(name)->requires_grad ? 3 : 1) * Bytes(shard);
      }
      EXPECT_EQ(reserved, in_place ? 0 : expected);
      EXPECT_EQ(ckpt.ReserveStaging(), 0) << "a second reservation allocated again";
      EXPECT_EQ(ckpt.staging_held_pinned_bytes(), device == "cpu" ? 0 : reserved);
    }
    for (int save = 1; save <= 2; ++save) {
      run.Step(10 * save);
      saved.push_back(StateOf(*run.fsdp, *run.optimizer));
      absl::Status status = ckpt.Save(save, DataPosition{});
      ASSERT_TRUE(status.ok()) << status;
      // The race of Note [Checkpoint staging]: the next update, issued at once.
      run.Step(10 * save + 1);
      if (in_place) {
        EXPECT_EQ(ckpt.last_staging_allocated_bytes(), 0);
        EXPECT_EQ(ckpt.staging_held_bytes(), 0) << "a synchronous save staged host tensors";
      } else if (save == 1 && !reserve) {
        EXPECT_GT(ckpt.last_staging_allocated_bytes(), 0);
      } else {
        EXPECT_EQ(ckpt.last_staging_allocated_bytes(), 0) << "save " << save << " allocated";
      }
    }
    absl::Status finished = ckpt.Finish();
    ASSERT_TRUE(finished.ok()) << finished;
  }
  for (int save = 1; save <= 2; ++save) {
    RunConfig load = config;
    load.checkpoint.load = StrCat(dir, "/checkpoints/", ckpt::StepDirName(save));
    Run fresh;
    ASSERT_NO_FATAL_FAILURE(MakeRun(device, load, 2, fresh));
    Checkpointer ckpt(load, fresh.ctx, *fresh.mesh, *fresh.fsdp, *fresh.optimizer);
    absl::StatusOr<std::optional<ResumePoint>> point = ckpt.Load();
    ASSERT_TRUE(point.ok()) << point.status();
    ASSERT_TRUE(point->has_value());
    EXPECT_EQ((*point)->step, save);
    ExpectBitwiseEqual(StateOf(*fresh.fsdp, *fresh.optimizer), saved[save - 1],
                       StrCat("checkpoint of save ", save));
  }
  std::filesystem::remove_all(dir);
}

TEST(CheckpointerStagingTest, AsyncSavesReloadBitwiseOnCpu) {
  SaveTwiceAndReload("cpu", /*reserve=*/false);
}

TEST(CheckpointerStagingTest, ReservedAsyncSavesAllocateNothingOnCpu) {
  SaveTwiceAndReload("cpu", /*reserve=*/true);
}

TEST(CheckpointerStagingTest, SynchronousSavesWriteHostTensorsInPlace) {
  SaveTwiceAndReload("cpu", /*reserve=*/true, /*async=*/false);
}

TEST(CheckpointerStagingTest, AsyncSavesReloadBitwiseCuda) {
  FSDP_SKIP_WITHOUT_GPU();
  SaveTwiceAndReload("cuda", /*reserve=*/false);
}

TEST(CheckpointerStagingTest, ReservedAsyncSavesAllocateNothingCuda) {
  FSDP_SKIP_WITHOUT_GPU();
  SaveTwiceAndReload("cuda", /*reserve=*/true);
}

}  // namespace
}  // namespace fsdp
