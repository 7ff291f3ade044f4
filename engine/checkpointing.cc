#include "engine/checkpointing.h"

#include <algorithm>
#include <set>

#include <chrono>
#include <iostream>

#include <fmt/format.h>
#include <cstdlib>
#include <filesystem>

#include <ATen/ATen.h>
#include <yaml-cpp/yaml.h>

#include "checkpoint/format.h"
#include "checkpoint/safetensors.h"
#include "common/env_knobs.h"
#include "common/logging.h"
#include "common/status.h"
#include "common/strings.h"
#include "device_mesh/torch_status.h"
#include "engine/hf_llama.h"
#include "engine/optimizer.h"

namespace fsdp {

struct Checkpointer::Pending {
  struct Item {
    std::string name;
    at::Tensor rows;  // host copy: a staging buffer, valid after copies.Wait()
    int64_t row_begin;
    std::vector<int64_t> shape;
  };
  int64_t sequence = 0;  // which Save of this checkpointer (store keys)
  std::set<std::string> optimizer_state;  // state tensor names saved (metadata "optimizer")
  bool optimizer_step = false;            // a step counter per parameter saved
  int64_t step = 0;
  DataPosition data;
  std::vector<Item> items;
  StagedCopies copies;  // the device->host copies into the items' rows
  std::chrono::steady_clock::time_point started;
};

namespace {

using Clock = std::chrono::steady_clock;

// Note [Strict loads]: a load either restores exactly what was saved or refuses, naming the
// file, the tensor and both values. The metadata's "optimizer" record says which optimizer
// saved the state and which of its tensors exist, so that a missing tensor is an error instead
// of a crash in the first step (an undefined state tensor) or a silent reset (a missing step
// counter restarts Adam's bias correction), and SGD state never loads into AdamW or back.
nlohmann::json OptimizerRecord(const OptimizerOptions& o, const std::set<std::string>& state,
                               bool step) {
  nlohmann::json hyper = {{"lr", o.lr}, {"weight_decay", o.weight_decay}};
  if (o.kind == OptimizerKind::kSgd) {
    hyper["momentum"] = o.momentum;
  } else {
    hyper["beta1"] = o.beta1;
    hyper["beta2"] = o.beta2;
    hyper["eps"] = o.eps;
  }
  return {{"name", std::string(OptimizerKindName(o.kind))},
          {"state", std::vector<std::string>(state.begin(), state.end())},
          {"step", step},
          {"hyperparameters", hyper}};
}

// The names a parameter's shard and its optimizer state tensors are saved under.
std::string ShardKey(std::string_view param) { return StrCat("model/", param); }
std::string StateKey(std::string_view param, std::string_view state) {
  return StrCat("optim/", param, "/", state);
}

// Keys of a JSON object, sorted, joined ("beta1, beta2, eps").
std::string KeysOf(const nlohmann::json& object) {
  std::vector<std::string> keys;
  for (const auto& item : object.items()) keys.push_back(item.key());
  std::sort(keys.begin(), keys.end());
  return StrJoin(keys, ", ");
}

// Note [Attention heads in a checkpoint]
// The shape checks cannot see a checkpoint loaded into another head layout: wq and wo are
// [dim, dim] for any n_heads, and wk, wv are [kv_heads x head_dim, dim], the same for 4 heads
// with 2 KV heads as for 8 with 4. Loaded, the weights would be split into other heads than
// they were trained as: a different model, silently. The config saved with the checkpoint
// (metadata extra.config) names the layout, and a load compares it; a checkpoint without it
// (or with a config that does not parse) is checked by shapes only.
absl::Status CheckAttentionHeads(const std::string& dir, const nlohmann::json& extra,
                                 const ModelArgs& model) {
  if (!extra.contains("config") || !extra["config"].is_string()) return absl::OkStatus();
  int64_t heads = 0, kv_heads = 0;
  try {
    YAML::Node saved = YAML::Load(extra["config"].get<std::string>());
    YAML::Node m = saved["model"];
    if (!m || !m["n_heads"]) return absl::OkStatus();
    heads = m["n_heads"].as<int64_t>();
    kv_heads = m["n_kv_heads"] ? m["n_kv_heads"].as<int64_t>() : 0;
  } catch (const YAML::Exception&) {
    return absl::OkStatus();
  }
  if (kv_heads <= 0) kv_heads = heads;
  if (heads == model.n_heads && kv_heads == model.kv_heads()) return absl::OkStatus();
  return absl::FailedPreconditionError(StrCat(
      dir, ": saved with model.n_heads: ", heads, " and ", kv_heads,
      " key/value heads (model.n_kv_heads), the config has model.n_heads: ", model.n_heads,
      " and ", model.kv_heads(),
      "; the attention weights have the same shapes but would be split into other heads (a "
      "different model): set model.n_heads: ", heads, " and model.n_kv_heads: ", kv_heads));
}

}  // namespace

Checkpointer::Checkpointer(const RunConfig& config, std::shared_ptr<DistContext> ctx,
                           const DeviceMesh& mesh, FsdpModel& model,
                           torch::optim::Optimizer& optimizer)
    : config_(config),
      ctx_(std::move(ctx)),
      mesh_(mesh),
      model_(model),
      optimizer_(optimizer),
      worker_status_(std::make_shared<absl::Status>()),
      worker_done_(std::make_shared<std::atomic<bool>>(false)) {
  root_ = CheckpointRoot(config);
  int r = mesh.shape().AxisIndex("replicate");
  writes_shards_ = r < 0 || mesh.coord(r) == 0;  // replicas hold identical shards
}

Checkpointer::~Checkpointer() {
  if (worker_.joinable()) worker_.join();
}

std::string CheckpointRoot(const RunConfig& config) {
  return config.checkpoint.dir.empty()
             ? (std::filesystem::path(config.run.dir) / "checkpoints").string()
             : config.checkpoint.dir;
}

absl::Status Checkpointer::PollBackgroundSave() {
  if (!worker_.joinable() || !worker_done_->load(std::memory_order_acquire)) {
    return absl::OkStatus();
  }
  return Finish();
}

absl::Status Checkpointer::Finish() {
  if (worker_.joinable()) worker_.join();
  absl::Status status = *worker_status_;
  *worker_status_ = absl::OkStatus();
  return status;
}

std::string StagingLabel(int64_t bytes, int64_t pinned_bytes) {
  return fmt::format("{:.1f} MiB of {}host staging", bytes / 1048576.0,
                     pinned_bytes >= bytes ? "pinned "
                     : pinned_bytes > 0    ? "partly pinned "
                                           : "");
}

bool Checkpointer::WritesInPlace(const at::Tensor& t) const {
  // A synchronous save holds the loop until its files are written, so a host tensor cannot
  // change under the write and needs no snapshot (nor its memory: with parallelism.offload a
  // second host copy of the masters and optimizer state). Device tensors still go through
  // host buffers, and an async save snapshots everything.
  return !config_.checkpoint.async && t.is_cpu();
}

int64_t Checkpointer::ReserveStaging() {
  if (!config_.checkpoint.enabled || !writes_shards_) return 0;
  const std::optional<OptimizerKind> kind = KindOf(optimizer_);
  int64_t bytes = 0;
  at::NoGradGuard no_grad;
  for (const auto& [name, shard] : model_.named_parameters()) {
    if (!shard.defined() || shard.dim() == 0 || shard.size(0) == 0) continue;  // as Save
    if (WritesInPlace(shard)) continue;  // and its optimizer state, on the same device
    bytes += staging_.Reserve(ShardKey(name), shard);
    // An optimizer's state tensors are shaped and typed like their parameter (zeros_like):
    // the state a first step creates, or the one a resume loaded.
    if (!kind || !model_.FindParam(name)->requires_grad) continue;  // frozen: no state
    for (std::string_view state : StateTensorNames(*kind)) {
      bytes += staging_.Reserve(StateKey(name, state), shard);
    }
  }
  return bytes;
}

// Note [One save per step]: the SIGTERM save and the periodic save can fall on the same step.
// Saving it twice made rank 0 read the first save's store reports as the second's and commit
// the folder before the other ranks had rewritten their shards into it (a committed checkpoint
// without rank00001.bin). So a step saved or in flight is not saved again (every rank makes
// the same decision: Save is collective), and each save's reports use keys of their own.
absl::Status Checkpointer::Save(int64_t step, const DataPosition& data) {
  auto start = Clock::now();
  FSDP_RETURN_IF_ERROR(Finish());  // one save in flight at a time
  model_.FinishHostStep();  // the masters and optimizer state, stepped (Note [Overlapped host step])
  last_waiting_seconds_ = std::chrono::duration<double>(Clock::now() - start).count();
  if (saved_step_ == step) {
    last_blocking_seconds_ = std::chrono::duration<double>(Clock::now() - start).count();
    return absl::OkStatus();
  }
  saved_step_ = step;
  auto pending = std::make_shared<Pending>();
  pending->started = start;
  pending->sequence = saves_++;
  pending->step = step;
  pending->data = data;
  {
    at::NoGradGuard no_grad;
    staging_.Begin();  // the previous save's writer is done (Finish above): buffers are free
    const bool rank0 = ctx_->rank() == 0;
    for (const auto& [name, shard] : model_.named_parameters()) {
      const FsdpParam* p = model_.FindParam(name);
      int64_t first = model_.FirstLocalRow(*p);
      const std::vector<int64_t>& shape = p->sharding.shape;
      auto add = [&](const std::string& key, const at::Tensor& t) {
        if (!writes_shards_ || !t.defined() || t.size(0) == 0) return;
        at::Tensor rows = WritesInPlace(t) ? t.detach() : staging_.Stage(key, t.detach());
        if (shape.empty()) rows = rows.reshape({});
        pending->items.push_back({key, rows, first, shape});
      };
      add(ShardKey(name), shard);
      auto it = optimizer_.state().find(shard.unsafeGetTensorImpl());
      if (it == optimizer_.state().end()) continue;
      for (auto& [state_name, tensor] : StateTensors(*it->second)) {
        if (tensor->defined()) pending->optimizer_state.insert(std::string(state_name));
        add(StateKey(name, state_name), *tensor);
      }
      pending->optimizer_step |= StepCounter(*it->second) != nullptr;
      if (int64_t* s = StepCounter(*it->second); s != nullptr && rank0) {
        pending->items.push_back(
            {StateKey(name, "step"), at::tensor(*s, at::kLong).reshape({}), 0, {}});
      }
    }
    pending->copies = staging_.End();  // the device's next writes wait for the copies
  }
  if (config_.checkpoint.async) {
    worker_done_->store(false, std::memory_order_relaxed);
    worker_ = std::thread([this, pending, status = worker_status_, done = worker_done_] {
      absl::Status s = CallTorch("checkpoint", [&] {
        pending->copies.Wait();  // Note [Checkpoint staging], point 4
        *status = WriteAndCommit(*pending);
      });
      if (!s.ok()) *status = s;
      done->store(true, std::memory_order_release);
    });
  } else {
    pending->copies.Wait();
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
  const std::string key = StrCat("fsdp/ckpt/", pending.sequence, "/step/", pending.step, "/rank/");
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
  // global_batch: Note [Resuming at another global batch] (engine/data.cc).
  metadata.extra = {{"data",
                     {{"epoch", pending.data.epoch},
                      {"batch", pending.data.batch},
                      {"global_batch", pending.data.global_batch},
                      {"train_windows", pending.data.train_windows},
                      {"seed", pending.data.seed}}},
                    {"config", config_.ToYaml()},
                    {"optimizer", OptimizerRecord(config_.optimizer, pending.optimizer_state,
                                                  pending.optimizer_step)}};
  FSDP_ASSIGN_OR_RETURN(metadata.tensors, ckpt::MergeManifests(manifests));
  for (const ckpt::RankManifest& m : manifests) metadata.files.push_back(m.file);
  FSDP_RETURN_IF_ERROR(ckpt::WriteMetadata(tmp_dir, metadata));
  FSDP_RETURN_IF_ERROR(ckpt::CommitCheckpoint(tmp_dir, final_dir));
  FSDP_RETURN_IF_ERROR(ckpt::PruneCheckpoints(root_, static_cast<int>(config_.checkpoint.keep_latest_k),
                                                pending.step));
  std::cout << fmt::format("checkpoint: step {} committed to {} ({:.2f} s after the save began)\n",
                           pending.step, final_dir,
                           std::chrono::duration<double>(Clock::now() - pending.started).count());
  std::cout.flush();
  return absl::OkStatus();
}

absl::StatusOr<std::optional<ResumePoint>> Checkpointer::Load() {
  model_.FinishHostStep();  // about to write the masters (Note [Overlapped host step])
  std::string dir = config_.checkpoint.load;
  if (dir.empty()) return std::optional<ResumePoint>();
  if (dir == "latest") {
    absl::StatusOr<std::string> latest = ckpt::LatestCheckpoint(root_);
    if (latest.status().code() == absl::StatusCode::kNotFound) {
      if (ctx_->rank() == 0) {
        std::cout << "checkpoint: load: latest: no committed checkpoint in " << root_
                  << " yet; starting from step 0\n";
      }
      return std::optional<ResumePoint>();
    }
    FSDP_RETURN_IF_ERROR(latest.status());
    dir = *latest;
  }
  FSDP_ASSIGN_OR_RETURN(ckpt::CheckpointReader reader, ckpt::CheckpointReader::Open(dir));
  const CheckpointSection& cs = config_.checkpoint;
  const nlohmann::json& extra_meta = reader.metadata().extra;
  FSDP_RETURN_IF_ERROR(CheckAttentionHeads(dir, extra_meta, config_.model));
  // What the saved optimizer kept (Note [Strict loads]); absent in checkpoints written before
  // the record existed, which are then checked tensor by tensor only.
  std::optional<std::set<std::string>> saved_state;
  bool saved_step = false;
  if (cs.load_optimizer && extra_meta.contains("optimizer")) {
    const nlohmann::json& record = extra_meta["optimizer"];
    const std::string saved_name = record.value("name", std::string("?"));
    const std::string want = std::string(OptimizerKindName(config_.optimizer.kind));
    if (saved_name != want) {
      return absl::FailedPreconditionError(StrCat(
          dir, ": saved with optimizer '", saved_name, "', the config has optimizer.name: ", want,
          "; use the same optimizer, or checkpoint.load_optimizer: false to load the model only"));
    }
    const std::string saved_hyper = KeysOf(record.value("hyperparameters", nlohmann::json::object()));
    const std::string want_hyper =
        KeysOf(OptimizerRecord(config_.optimizer, {}, false)["hyperparameters"]);
    if (saved_hyper != want_hyper) {
      return absl::FailedPreconditionError(
          StrCat(dir, ": optimizer hyper-parameters saved (", saved_hyper, ") are not those of ",
                 want, " (", want_hyper, "); use checkpoint.load_optimizer: false"));
    }
    saved_state.emplace();
    for (const auto& n : record.value("state", nlohmann::json::array())) {
      if (n.is_string()) saved_state->insert(n.get<std::string>());
    }
    saved_step = record.value("step", false);
  }
  std::set<std::string> expected;  // every tensor this load reads
  std::vector<std::string> frozen_state;  // "optim/<name>/" of the parameters frozen now
  at::NoGradGuard no_grad;
  auto read_into = [&](const std::string& key, at::Tensor& dst, int64_t first,
                       const std::vector<int64_t>& shape) -> absl::Status {
    const ckpt::TensorEntry* e = reader.Find(key);
    if (e == nullptr) {
      return absl::FailedPreconditionError(StrCat(dir, ": no tensor '", key,
                                                  "': the checkpoint was saved from another model"));
    }
    expected.insert(key);
    if (e->shape != shape) {
      return absl::FailedPreconditionError(StrCat(dir, ": tensor '", key, "' has shape [",
                                                  StrJoin(e->shape, ", "), "], the model expects [",
                                                  StrJoin(shape, ", "), "]"));
    }
    const std::string want_dtype = ckpt::DtypeName(dst.scalar_type());
    if (e->dtype != want_dtype) {
      return absl::FailedPreconditionError(StrCat(dir, ": tensor '", key, "' is stored as ",
                                                  e->dtype, ", the model expects ", want_dtype));
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
    FSDP_RETURN_IF_ERROR(read_into(ShardKey(name), dst, first, p->sharding.shape));
    if (!p->requires_grad) {
      // model.freeze: a parameter frozen now needs no optimizer state; any saved is not used.
      frozen_state.push_back(StrCat("optim/", name, "/"));
      continue;
    }
    if (!cs.load_optimizer) continue;
    std::unique_ptr<torch::optim::OptimizerParamState> state = NewParamState(optimizer_);
    bool any = false;
    for (auto& [state_name, tensor] : StateTensors(*state)) {
      std::string key = StateKey(name, state_name);
      const bool stored = reader.Find(key) != nullptr;
      const bool listed = saved_state ? saved_state->count(std::string(state_name)) > 0 : stored;
      if (!listed) continue;
      if (!stored) {
        return absl::FailedPreconditionError(
            StrCat(dir, ": no tensor '", key, "', which the saved optimizer's state lists (",
                   StrJoin(*saved_state, ", "), "); the checkpoint is incomplete, or '", name,
                   "' was frozen (model.freeze) when it was saved: checkpoint.load_optimizer: "
                   "false starts the optimizer afresh"));
      }
      *tensor = at::zeros_like(shard);
      FSDP_RETURN_IF_ERROR(read_into(key, *tensor, first, p->sharding.shape));
      any = true;
    }
    if (int64_t* step = StepCounter(*state); step != nullptr) {
      const std::string key = StateKey(name, "step");
      const ckpt::TensorEntry* e = reader.Find(key);
      if (e == nullptr && (saved_step || any)) {
        return absl::FailedPreconditionError(StrCat(
            dir, ": no tensor '", key, "': without the step counter Adam's bias correction "
            "would restart; the checkpoint is incomplete (checkpoint.load_optimizer: false "
            "starts the optimizer afresh)"));
      }
      if (e != nullptr) {
        expected.insert(key);
        if (!e->shape.empty() || e->dtype != "I64") {
          return absl::FailedPreconditionError(StrCat(dir, ": tensor '", key, "' is ", e->dtype,
                                                      " [", StrJoin(e->shape, ", "),
                                                      "], expected a scalar I64 step counter"));
        }
        at::Tensor s;
        FSDP_RETURN_IF_ERROR(reader.ReadRows(e->name, 0, 1, s));
        *step = s.item<int64_t>();
      }
    }
    if (any) optimizer_.state()[shard.unsafeGetTensorImpl()] = std::move(state);
  }
  if (cs.strict) {
    std::vector<std::string> unexpected;
    for (const ckpt::TensorEntry& t : reader.metadata().tensors) {
      if (expected.count(t.name) || (!cs.load_optimizer && StartsWith(t.name, "optim/"))) continue;
      if (std::any_of(frozen_state.begin(), frozen_state.end(),
                      [&](const std::string& prefix) { return StartsWith(t.name, prefix); })) {
        continue;
      }
      unexpected.push_back(t.name);
    }
    if (!unexpected.empty()) {
      const size_t shown = std::min<size_t>(unexpected.size(), 5);
      return absl::FailedPreconditionError(StrCat(
          dir, ": ", unexpected.size(), " tensor(s) the model does not have (",
          StrJoin(std::vector<std::string>(unexpected.begin(), unexpected.begin() + shown), ", "),
          unexpected.size() > shown ? ", ..." : "",
          "): saved from another model (e.g. more layers)? checkpoint.strict: false ignores them"));
    }
  }
  model_.CopyShardsToDevice();  // offload: the shards read are host masters (Note [CPU offload])
  ResumePoint point;
  point.step = reader.metadata().step;
  point.dir = dir;
  if (extra_meta.contains("data")) {
    // A field of another type threw out of json::value as an internal error naming nothing.
    const nlohmann::json& data = extra_meta["data"];
    for (const char* key : {"epoch", "batch", "global_batch", "train_windows", "seed"}) {
      if (!data.is_object() || (data.contains(key) && !data[key].is_number_integer())) {
        return absl::DataLossError(StrCat(
            dir, ": metadata.json extra.data", data.is_object() ? StrCat(".", key) : "",
            " must be ", data.is_object() ? "an integer" : "an object", ", got ",
            (data.is_object() ? data[key] : data).dump()));
      }
    }
    point.data.epoch = data.value("epoch", int64_t{0});
    point.data.batch = data.value("batch", int64_t{0});
    point.data.global_batch = data.value("global_batch", int64_t{0});
    point.data.train_windows = data.value("train_windows", int64_t{0});
    point.data.seed = data.value("seed", uint64_t{0});
    const DataPosition& d = point.data;
    if (d.epoch < 0 || d.batch < 0 || d.global_batch < 0) {
      return absl::DataLossError(StrCat(dir, ": the data position in metadata.json (epoch ",
                                        d.epoch, ", batch ", d.batch, ", global_batch ",
                                        d.global_batch, ") must be >= 0"));
    }
  }
  return std::optional<ResumePoint>(point);
}

}  // namespace fsdp

namespace fsdp {

absl::Status FillFromSafetensors(const std::string& path, const std::vector<InitTarget>& targets) {
  if (IsHfCheckpointDir(path)) return FillFromHfLlama(path, targets);
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
    // A float parameter from integer or boolean bytes would be a bit pattern cast to numbers
    // (found by the red-team pass: an F32 tensor relabelled I32 loaded as garbage weights).
    const std::string& stored = it->second.dtype;
    const bool floating_file = stored == "F64" || stored == "F32" || stored == "F16" ||
                               stored == "BF16" || stored.rfind("F8_", 0) == 0;
    if (t.dst.is_floating_point() && !floating_file) {
      return absl::FailedPreconditionError(
          StrCat("model.init_from '", path, "': tensor '", t.name, "' is stored as ", stored,
                 "; the model's parameter is floating point (F32, F16, BF16 or F64 expected)"));
    }
    const int64_t rows = t.dst.dim() == 0 ? 1 : t.dst.size(0);
    if (rows == 0) continue;
    at::Tensor data;
    FSDP_RETURN_IF_ERROR(file.ReadRows(t.name, t.first_row, t.first_row + rows, data));
    at::Tensor dst = t.dst;
    dst.copy_(data.reshape(dst.sizes()));
  }
  // A tensor the model does not have means the file is for another model (another depth or
  // naming): loading the rest would silently start from a mix.
  std::set<std::string> wanted;
  for (const InitTarget& t : targets) wanted.insert(t.name);
  std::vector<std::string> unexpected;
  for (const auto& [name, entry] : file.entries()) {
    if (!wanted.count(name)) unexpected.push_back(name);
  }
  if (!unexpected.empty()) {
    const size_t shown = std::min<size_t>(unexpected.size(), 5);
    return absl::FailedPreconditionError(StrCat(
        "model.init_from '", path, "': ", unexpected.size(), " tensor(s) the model does not have (",
        StrJoin(std::vector<std::string>(unexpected.begin(), unexpected.begin() + shown), ", "),
        unexpected.size() > shown ? ", ..." : "",
        "); the file was saved from another model (check model.n_layers and the names)"));
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

bool Checkpointer::Due(int64_t step, bool last) const {
  const CheckpointSection& cs = config_.checkpoint;
  const bool periodic = cs.interval > 0 && step % cs.interval == 0;
  return cs.enabled && (last || periodic);
}

absl::StatusOr<bool> Checkpointer::MaybeSave(int64_t step, bool last, const DataPosition& data) {
  const CheckpointSection& cs = config_.checkpoint;
  if (!Due(step, last)) return false;
  if (saved_step_ == step) {  // already saved (Note [One save per step]): wait for it if last
    if (last) FSDP_RETURN_IF_ERROR(Finish());
    return false;
  }
  FSDP_RETURN_IF_ERROR(Save(step, data));
  if (ctx_->rank() == 0) {
    // Saves reuse the staging buffers the trainer reserved (ReserveStaging); one that had to
    // allocate some (pinned: page-locking is slow) says so, or its blocked time would read as
    // the steady state.
    const int64_t allocated = staging_.last_allocated_bytes();
    const int64_t pinned = staging_.last_allocated_pinned_bytes();
    std::string staged;
    if (allocated > 0) {
      staged = fmt::format("; {} allocated", StagingLabel(allocated, pinned));
    }
    // Blocked waiting for the previous save to commit: the interval is shorter than a write.
    std::string waited;
    if (last_waiting_seconds_ >= 1e-3) {
      waited = fmt::format(", {:.1f} ms of it for the previous save", last_waiting_seconds_ * 1e3);
    }
    std::cout << fmt::format("checkpoint: step {} {} (loop blocked {:.1f} ms{}{})\n", step,
                             cs.async ? "saving in the background" : "saved",
                             last_blocking_seconds_ * 1e3, waited, staged);
  }
  if (last) FSDP_RETURN_IF_ERROR(Finish());
  return true;
}

}  // namespace fsdp
