#include "engine/checkpointing.h"

#include <chrono>
#include <iostream>

#include <fmt/format.h>
#include <cstdlib>
#include <filesystem>

#include <ATen/ATen.h>

#include "checkpoint/format.h"
#include "checkpoint/safetensors.h"
#include "common/env_knobs.h"
#include "common/logging.h"
#include "common/status.h"
#include "common/strings.h"
#include "device_mesh/torch_status.h"
#include "engine/optimizer.h"

namespace fsdp {

struct Checkpointer::Pending {
  struct Item {
    std::string name;
    at::Tensor rows;  // CPU copy
    int64_t row_begin;
    std::vector<int64_t> shape;
  };
  int64_t step = 0;
  DataPosition data;
  std::vector<Item> items;
  std::chrono::steady_clock::time_point started;
};

namespace {

using Clock = std::chrono::steady_clock;

}  // namespace

Checkpointer::Checkpointer(const RunConfig& config, std::shared_ptr<DistContext> ctx,
                           const DeviceMesh& mesh, FsdpModel& model,
                           torch::optim::Optimizer& optimizer)
    : config_(config),
      ctx_(std::move(ctx)),
      mesh_(mesh),
      model_(model),
      optimizer_(optimizer),
      worker_status_(std::make_shared<absl::Status>()) {
  root_ = config.checkpoint.dir.empty()
              ? (std::filesystem::path(config.run.dir) / "checkpoints").string()
              : config.checkpoint.dir;
  int r = mesh.shape().AxisIndex("replicate");
  writes_shards_ = r < 0 || mesh.coord(r) == 0;  // replicas hold identical shards
}

Checkpointer::~Checkpointer() {
  if (worker_.joinable()) worker_.join();
}

absl::Status Checkpointer::Finish() {
  if (worker_.joinable()) worker_.join();
  absl::Status status = *worker_status_;
  *worker_status_ = absl::OkStatus();
  return status;
}

absl::Status Checkpointer::Save(int64_t step, const DataPosition& data) {
  auto start = Clock::now();
  FSDP_RETURN_IF_ERROR(Finish());  // one save in flight at a time
  auto pending = std::make_shared<Pending>();
  pending->started = start;
  pending->step = step;
  pending->data = data;
  {
    at::NoGradGuard no_grad;
    const bool rank0 = ctx_->rank() == 0;
    for (const auto& [name, shard] : model_.named_parameters()) {
      const FsdpParam* p = model_.FindParam(name);
      int64_t first = model_.FirstLocalRow(*p);
      const std::vector<int64_t>& shape = p->sharding.shape;
      auto add = [&](const std::string& key, const at::Tensor& t) {
        if (!writes_shards_ || !t.defined() || t.size(0) == 0) return;
        at::Tensor rows = t.detach().to(at::kCPU, /*non_blocking=*/false, /*copy=*/true);
        if (shape.empty()) rows = rows.reshape({});
        pending->items.push_back({key, rows, first, shape});
      };
      add("model/" + name, shard);
      auto it = optimizer_.state().find(shard.unsafeGetTensorImpl());
      if (it == optimizer_.state().end()) continue;
      for (auto& [state_name, tensor] : StateTensors(*it->second)) {
        add(StrCat("optim/", name, "/", state_name), *tensor);
      }
      if (int64_t* s = StepCounter(*it->second); s != nullptr && rank0) {
        pending->items.push_back({StrCat("optim/", name, "/step"), at::tensor(*s, at::kLong).reshape({}), 0, {}});
      }
    }
  }
  if (config_.checkpoint.async) {
    worker_ = std::thread([this, pending, status = worker_status_] {
      absl::Status s = CallTorch("checkpoint", [&] { *status = WriteAndCommit(*pending); });
      if (!s.ok()) *status = s;
    });
  } else {
    absl::Status status = WriteAndCommit(*pending);
    if (!status.ok()) return status;
  }
  last_blocking_seconds_ = std::chrono::duration<double>(Clock::now() - start).count();
  return absl::OkStatus();
}

absl::Status Checkpointer::WriteAndCommit(const Pending& pending) {
  const std::string final_dir = (std::filesystem::path(root_) / ckpt::StepDirName(pending.step)).string();
  const std::string tmp_dir = final_dir + ".tmp";
  std::error_code ec;
  std::filesystem::create_directories(tmp_dir, ec);
  if (ec) return absl::FailedPreconditionError(StrCat("cannot create '", tmp_dir, "': ", ec.message()));
  ckpt::RankManifest manifest;
  manifest.rank = ctx_->rank();
  if (!pending.items.empty()) {
    ckpt::ShardWriter writer(tmp_dir, ctx_->rank());
    for (const Pending::Item& item : pending.items) {
      FSDP_RETURN_IF_ERROR(writer.Add(item.name, item.rows, item.row_begin, item.shape));
    }
    FSDP_ASSIGN_OR_RETURN(manifest, writer.Finish());
  }
  // Fault injection for the tests: this rank dies after writing its shard, before reporting.
  if (std::optional<std::string> crash = GetEnvKnob(kCheckpointCrashAfterWrite);
      crash && ParseInt(*crash) == ctx_->rank()) {
    std::_Exit(137);
  }
  // Report to rank 0 through the store (thread-safe, outside the process groups' order).
  const std::string key = StrCat("fsdp/ckpt/", pending.step, "/rank/");
  std::string text = ckpt::RankManifestToJson(manifest).dump();
  ctx_->store()->set(key + StrCat(ctx_->rank()), std::vector<uint8_t>(text.begin(), text.end()));
  if (ctx_->rank() != 0) return absl::OkStatus();

  std::vector<ckpt::RankManifest> manifests;
  for (int r = 0; r < ctx_->world_size(); ++r) {
    std::string k = key + StrCat(r);
    FSDP_RETURN_IF_ERROR(CallTorch(StrCat("waiting for rank ", r, "'s checkpoint shard"), [&] {
      ctx_->store()->wait({k}, ctx_->options().collective_timeout);
    }));
    std::vector<uint8_t> v = ctx_->store()->get(k);
    const std::string source = StrCat("rank ", r, "'s checkpoint manifest (store key ", k, ")");
    FSDP_ASSIGN_OR_RETURN(nlohmann::json json,
                          ckpt::ParseJson(std::string_view(reinterpret_cast<const char*>(v.data()),
                                                           v.size()),
                                          source));
    FSDP_ASSIGN_OR_RETURN(ckpt::RankManifest m, ckpt::RankManifestFromJson(json, source));
    if (m.rank != r) {
      return absl::DataLossError(StrCat(source, ": rank: ", m.rank, ", expected ", r));
    }
    if (!m.file.file.empty()) manifests.push_back(std::move(m));
  }
  ckpt::Metadata metadata;
  metadata.step = pending.step;
  metadata.world_size = ctx_->world_size();
  metadata.mesh_axes = mesh_.shape().axis_names;
  metadata.mesh_degrees = mesh_.shape().degrees;
  // What ran (Note: an override of reshard_after_forward can change the strategy's behaviour).
  absl::StatusOr<ShardingPlan> plan =
      ShardingPlanFor(config_, *config_.parallelism.strategy, mesh_.shape().degrees.back());
  metadata.strategy = plan.ok() ? plan->effective : StrategyLabel(config_.parallelism.strategy);
  metadata.extra = {{"data", {{"epoch", pending.data.epoch}, {"batch", pending.data.batch}}},
                    {"config", config_.ToYaml()}};
  FSDP_ASSIGN_OR_RETURN(metadata.tensors, ckpt::MergeManifests(manifests));
  for (const ckpt::RankManifest& m : manifests) metadata.files.push_back(m.file);
  FSDP_RETURN_IF_ERROR(ckpt::WriteMetadata(tmp_dir, metadata));
  FSDP_RETURN_IF_ERROR(ckpt::CommitCheckpoint(tmp_dir, final_dir));
  FSDP_RETURN_IF_ERROR(ckpt::PruneCheckpoints(root_, static_cast<int>(config_.checkpoint.keep_latest_k)));
  std::cout << fmt::format("checkpoint: step {} committed to {} ({:.2f} s after the save began)\n",
                           pending.step, final_dir,
                           std::chrono::duration<double>(Clock::now() - pending.started).count());
  std::cout.flush();
  return absl::OkStatus();
}

absl::StatusOr<std::optional<ResumePoint>> Checkpointer::Load() {
  std::string dir = config_.checkpoint.load;
  if (dir.empty()) return std::optional<ResumePoint>();
  if (dir == "latest") {
    absl::StatusOr<std::string> latest = ckpt::LatestCheckpoint(root_);
    if (latest.status().code() == absl::StatusCode::kNotFound) return std::optional<ResumePoint>();
    FSDP_RETURN_IF_ERROR(latest.status());
    dir = *latest;
  }
  FSDP_ASSIGN_OR_RETURN(ckpt::CheckpointReader reader, ckpt::CheckpointReader::Open(dir));
  at::NoGradGuard no_grad;
  auto read_into = [&](const std::string& key, at::Tensor& dst, int64_t first,
                       const std::vector<int64_t>& shape) -> absl::Status {
    const ckpt::TensorEntry* e = reader.Find(key);
    if (e == nullptr) {
      return absl::FailedPreconditionError(StrCat(dir, ": no tensor '", key,
                                                  "': the checkpoint was saved from another model"));
    }
    if (e->shape != shape) {
      return absl::FailedPreconditionError(StrCat(dir, ": tensor '", key, "' has shape [",
                                                  StrJoin(e->shape, ", "), "], the model expects [",
                                                  StrJoin(shape, ", "), "]"));
    }
    if (dst.size(0) == 0) return absl::OkStatus();
    at::Tensor rows;
    FSDP_RETURN_IF_ERROR(reader.ReadRows(key, first, first + dst.size(0), rows));
    dst.copy_(rows.reshape(dst.sizes()));
    return absl::OkStatus();
  };
  for (const auto& [name, shard] : model_.named_parameters()) {
    const FsdpParam* p = model_.FindParam(name);
    int64_t first = model_.FirstLocalRow(*p);
    at::Tensor dst = shard;
    FSDP_RETURN_IF_ERROR(read_into("model/" + name, dst, first, p->sharding.shape));
    if (!p->requires_grad) continue;
    std::unique_ptr<torch::optim::OptimizerParamState> state = NewParamState(optimizer_);
    bool any = false;
    for (auto& [state_name, tensor] : StateTensors(*state)) {
      std::string key = StrCat("optim/", name, "/", state_name);
      if (reader.Find(key) == nullptr) continue;
      *tensor = at::zeros_like(shard);
      FSDP_RETURN_IF_ERROR(read_into(key, *tensor, first, p->sharding.shape));
      any = true;
    }
    if (int64_t* step = StepCounter(*state); step != nullptr) {
      if (const ckpt::TensorEntry* e = reader.Find(StrCat("optim/", name, "/step")); e != nullptr) {
        at::Tensor s;
        FSDP_RETURN_IF_ERROR(reader.ReadRows(e->name, 0, 1, s));
        *step = s.item<int64_t>();
      }
    }
    if (any) optimizer_.state()[shard.unsafeGetTensorImpl()] = std::move(state);
  }
  model_.CopyShardsToDevice();  // offload: the shards read are host masters (Note [CPU offload])
  ResumePoint point;
  point.step = reader.metadata().step;
  point.dir = dir;
  const nlohmann::json& extra = reader.metadata().extra;
  if (extra.contains("data")) {
    point.data.epoch = extra["data"].value("epoch", int64_t{0});
    point.data.batch = extra["data"].value("batch", int64_t{0});
  }
  return std::optional<ResumePoint>(point);
}

}  // namespace fsdp

namespace fsdp {

absl::Status FillFromSafetensors(const std::string& path, const std::vector<InitTarget>& targets) {
  FSDP_ASSIGN_OR_RETURN(ckpt::SafetensorsFile file, ckpt::SafetensorsFile::Open(path));
  at::NoGradGuard no_grad;
  for (const InitTarget& t : targets) {
    auto it = file.entries().find(t.name);
    if (it == file.entries().end()) {
      return absl::FailedPreconditionError(
          StrCat("model.init_from '", path, "': no tensor '", t.name, "' (the model's parameter)"));
    }
    if (it->second.shape != t.shape) {
      return absl::FailedPreconditionError(
          StrCat("model.init_from '", path, "': tensor '", t.name, "' has shape [",
                 StrJoin(it->second.shape, ", "), "], the model expects [", StrJoin(t.shape, ", "),
                 "]"));
    }
    const int64_t rows = t.dst.dim() == 0 ? 1 : t.dst.size(0);
    if (rows == 0) continue;
    at::Tensor data;
    FSDP_RETURN_IF_ERROR(file.ReadRows(t.name, t.first_row, t.first_row + rows, data));
    at::Tensor dst = t.dst;
    dst.copy_(data.reshape(dst.sizes()));
  }
  return absl::OkStatus();
}

absl::Status InitFromSafetensors(const std::string& path, FsdpModel& model) {
  std::vector<InitTarget> targets;
  for (const auto& [name, shard] : model.named_parameters()) {
    const FsdpParam* p = model.FindParam(name);
    targets.push_back({name, p->sharding.shape, model.FirstLocalRow(*p), shard});
  }
  FSDP_RETURN_IF_ERROR(FillFromSafetensors(path, targets));
  model.CopyShardsToDevice();  // offload: the shards filled are host masters (Note [CPU offload])
  return absl::OkStatus();
}

absl::StatusOr<bool> Checkpointer::MaybeSave(int64_t step, bool last, const DataPosition& data) {
  const CheckpointSection& cs = config_.checkpoint;
  const bool periodic = cs.interval > 0 && step % cs.interval == 0;
  if (!cs.enabled || !(last || periodic)) return false;
  FSDP_RETURN_IF_ERROR(Save(step, data));
  if (ctx_->rank() == 0) {
    std::cout << fmt::format("checkpoint: step {} {} (loop blocked {:.1f} ms)\n", step,
                             cs.async ? "saving in the background" : "saved",
                             last_blocking_seconds_ * 1e3);
  }
  if (last) FSDP_RETURN_IF_ERROR(Finish());
  return true;
}

}  // namespace fsdp
