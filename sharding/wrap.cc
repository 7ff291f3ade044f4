// FsdpModel::Wrap: who owns which parameter, checks that every rank wraps the same model,
// and the move from full parameters to shards. Also the auto-wrap policy and the registry.
#include <functional>
#include <map>
#include <mutex>
#include <unordered_map>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/moduledict.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/container/sequential.h>

#include "common/status.h"
#include "common/strings.h"
#include "device_mesh/torch_status.h"
#include "sharding/fsdp_model.h"
#include "sharding/offload/offload_plan.h"
#include "sharding/registry.h"

namespace fsdp {

// ---- registry --------------------------------------------------------------------------------

namespace {
std::mutex g_registry_mu;
std::unordered_map<const torch::nn::Module*, UnitEntry>& Registry() {
  static auto* registry = new std::unordered_map<const torch::nn::Module*, UnitEntry>();
  return *registry;
}
}  // namespace

void RegisterUnit(const torch::nn::Module* module, UnitEntry entry) {
  std::lock_guard<std::mutex> lock(g_registry_mu);
  Registry()[module] = entry;
}

void UnregisterUnit(const torch::nn::Module* module) {
  std::lock_guard<std::mutex> lock(g_registry_mu);
  Registry().erase(module);
}

UnitEntry LookupUnit(const torch::nn::Module* module) {
  std::lock_guard<std::mutex> lock(g_registry_mu);
  auto it = Registry().find(module);
  return it == Registry().end() ? UnitEntry{} : it->second;
}

// ---- auto-wrap policy ------------------------------------------------------------------------

std::vector<std::shared_ptr<torch::nn::Module>> SelectUnits(torch::nn::Module& root,
                                                            const WrapPolicy& policy) {
  std::vector<std::shared_ptr<torch::nn::Module>> units;
  auto matches = [&](const std::shared_ptr<torch::nn::Module>& m) {
    const std::string name = m->name();  // qualified: "myproject::(anonymous namespace)::BlockImpl"
    const size_t colons = name.rfind("::");
    const std::string_view unqualified = colons == std::string::npos
                                             ? std::string_view(name)
                                             : std::string_view(name).substr(colons + 2);
    for (const std::string& type : policy.module_types) {
      if (name == type || unqualified == type) return true;
    }
    if (policy.min_num_params > 0) {
      int64_t n = 0;
      for (const at::Tensor& p : m->parameters()) n += p.numel();
      if (n >= policy.min_num_params) return true;
    }
    return false;
  };
  for (const auto& item : root.named_modules()) {
    torch::nn::Module* m = item.value().get();
    if (dynamic_cast<torch::nn::SequentialImpl*>(m) == nullptr &&
        dynamic_cast<torch::nn::ModuleListImpl*>(m) == nullptr &&
        dynamic_cast<torch::nn::ModuleDictImpl*>(m) == nullptr) {
      continue;
    }
    for (const auto& child : m->children()) {
      if (matches(child)) units.push_back(child);
    }
  }
  return units;
}

// ---- wrapping --------------------------------------------------------------------------------

namespace {

struct PostAccumulateHook : torch::autograd::PostAccumulateGradHook {
  PostAccumulateHook(FsdpModel* model, FsdpUnit* unit) : model(model), unit(unit) {}
  void operator()(const torch::autograd::Variable&) override { model->OnGradAccumulated(*unit); }
  FsdpModel* model;
  FsdpUnit* unit;
};

struct ParamEntry {
  std::vector<std::string> names;
  at::Tensor tensor;
  int owner = -1;  // unit index; units.size() = root
};

std::string Signature(const std::vector<std::string>& unit_names,
                      const std::vector<ParamEntry>& entries) {
  std::string sig;
  for (const ParamEntry& e : entries) {
    sig += StrCat(unit_names[e.owner], " ", StrJoin(e.names, "="), " [",
                  StrJoin(e.tensor.sizes(), ", "), "] ", c10::toString(e.tensor.scalar_type()),
                  e.tensor.requires_grad() ? " trainable" : " frozen", "\n");
  }
  return sig;
}

std::string FirstDifference(const std::string& a, const std::string& b) {
  std::vector<std::string_view> la = Split(a, "\n"), lb = Split(b, "\n");
  for (size_t i = 0; i < std::max(la.size(), lb.size()); ++i) {
    std::string_view x = i < la.size() ? la[i] : "(nothing)";
    std::string_view y = i < lb.size() ? lb[i] : "(nothing)";
    if (x != y) return StrCat("parameter #", i, ": '", x, "' vs '", y, "'");
  }
  return "(no difference found)";
}

// Every rank must wrap the same model: compare a signature of units and parameters across the
// world before any per-unit collective, so that a mismatch is an error on every rank.
absl::Status CheckSameModel(DistContext& ctx, const std::string& signature) {
  int64_t hash = static_cast<int64_t>(std::hash<std::string>{}(signature) >> 1);
  at::Tensor mine = at::tensor({hash}, at::kLong);
  at::Tensor all = at::empty({ctx.world_size()}, at::kLong);
  ctx.world().AllGatherInto(all, mine)->wait();
  int differing = -1;
  for (int r = 0; r < ctx.world_size(); ++r) {
    if (all[r].item<int64_t>() != all[0].item<int64_t>()) {
      differing = r;
      break;
    }
  }
  if (differing < 0) return absl::OkStatus();
  std::string tag = ctx.NextTag("wrap");
  std::string key = StrCat("fsdp/", tag, "/signature/");
  ctx.store()->set(key + StrCat(ctx.rank()),
                   std::vector<uint8_t>(signature.begin(), signature.end()));
  auto get = [&](int r) {
    std::vector<uint8_t> v = ctx.store()->get(key + StrCat(r));
    return std::string(v.begin(), v.end());
  };
  return absl::FailedPreconditionError(StrCat(
      "the model on rank ", differing, " differs from the model on rank 0; every rank must wrap "
      "the same structure (rank 0 vs rank ", differing, ": ", FirstDifference(get(0),
      get(differing)), ")"));
}

}  // namespace

absl::StatusOr<std::unique_ptr<FsdpModel>> FsdpModel::Wrap(
    std::shared_ptr<torch::nn::Module> root, const DeviceMesh& mesh,
    const std::vector<std::shared_ptr<torch::nn::Module>>& requested_units,
    const FsdpOptions& options) {
  // The root is always a unit (as fully_shard(model) on the root in FSDP2), and a module listed
  // twice is one unit: both are dropped from the list rather than becoming a second unit of
  // the same module, which would never gather its parameters.
  std::vector<std::shared_ptr<torch::nn::Module>> unit_modules;
  for (const auto& m : requested_units) {
    if (m == nullptr) return absl::InvalidArgumentError("unit module is null");
    if (m.get() == root.get()) continue;
    bool seen = false;
    for (const auto& u : unit_modules) seen |= u.get() == m.get();
    if (!seen) unit_modules.push_back(m);
  }
  if (LookupUnit(root.get()).model != nullptr) {
    return absl::FailedPreconditionError(StrCat(
        "the root module (", root->name(), ") is already wrapped by another FsdpModel; a model "
        "is wrapped once (its parameters are shards from then on): keep the first FsdpModel"));
  }
  for (const auto& m : unit_modules) {
    if (LookupUnit(m.get()).model != nullptr) {
      return absl::FailedPreconditionError(StrCat(
          "module ", m->name(), " is already a unit of another FsdpModel; a model is wrapped "
          "once (its parameters are shards from then on): keep the first FsdpModel"));
    }
  }
  std::unique_ptr<FsdpModel> model(new FsdpModel());
  model->root_ = root;
  EngineContext& ctx = model->ctx_;
  ctx.options = options;
  ctx.device = mesh.context().device();
  ctx.streams = std::make_unique<DeviceStreams>(ctx.device);

  // Mesh axes.
  for (const std::string& axis : mesh.shape().axis_names) {
    if (axis != "shard" && axis != "replicate") {
      return absl::UnimplementedError(StrCat("mesh axis '", axis, "' is not supported by FSDP; "
                                             "use axes 'replicate' and 'shard'"));
    }
  }
  FSDP_ASSIGN_OR_RETURN(ctx.shard_group, mesh.group("shard"));
  ctx.num_shards = ctx.shard_group->size();
  ctx.shard_rank = ctx.shard_group->rank();
  if (int r = mesh.shape().AxisIndex("replicate"); r >= 0 && mesh.size(r) > 1) {
    ctx.replicate_group = &mesh.group(r);
  }
  ctx.dp_size = mesh.shape().num_ranks();
  const int k = options.reshard_group_size;
  if (k < 0 || (k > 0 && (ctx.num_shards % k != 0))) {
    return absl::InvalidArgumentError(StrCat("reshard_after_forward group size ", k,
                                             " must divide the shard degree ", ctx.num_shards));
  }
  if (options.reshard_after_forward && k > 1 && k < ctx.num_shards) {
    std::vector<int> members;
    int block = ctx.shard_rank / k;
    for (int i = 0; i < k; ++i) members.push_back(ctx.shard_group->global_ranks()[block * k + i]);
    FSDP_ASSIGN_OR_RETURN(ctx.reshard_group,
                          mesh.context().NewGroup(members, mesh.context().NextTag("reshard")));
  }
  if (options.max_unsharded_units < 1) {
    return absl::InvalidArgumentError("max_unsharded_units must be at least 1");
  }

  // Units and their module paths (the root unit is last, with the empty prefix).
  std::vector<std::string> prefixes(unit_modules.size());
  std::vector<bool> found(unit_modules.size(), false);
  for (const auto& item : root->named_modules()) {
    for (size_t u = 0; u < unit_modules.size(); ++u) {
      if (item.value().get() == unit_modules[u].get() && !item.key().empty()) {
        prefixes[u] = item.key() + ".";
        found[u] = true;
      }
    }
  }
  for (size_t u = 0; u < unit_modules.size(); ++u) {
    if (!found[u]) {
      return absl::InvalidArgumentError(StrCat("unit module #", u, " (", unit_modules[u]->name(),
                                               ") is not a submodule of the root module"));
    }
  }
  std::vector<std::string> unit_names;
  for (const std::string& p : prefixes) unit_names.push_back(p.substr(0, p.size() - 1));
  unit_names.push_back("root");
  const int root_index = static_cast<int>(unit_modules.size());

  // Parameters, deduplicated by tensor (tied parameters have several names).
  std::vector<ParamEntry> entries;
  std::unordered_map<const void*, size_t> by_impl;
  for (const auto& item : root->named_parameters(/*recurse=*/true)) {
    const void* impl = item.value().unsafeGetTensorImpl();
    auto [it, inserted] = by_impl.emplace(impl, entries.size());
    if (inserted) entries.push_back({{}, item.value(), -1});
    entries[it->second].names.push_back(item.key());
  }
  for (ParamEntry& e : entries) {
    for (const std::string& name : e.names) {
      int owner = root_index;
      size_t best = 0;
      for (size_t u = 0; u < prefixes.size(); ++u) {
        if (StartsWith(name, prefixes[u]) && prefixes[u].size() > best) {
          owner = static_cast<int>(u);
          best = prefixes[u].size();
        }
      }
      if (e.owner >= 0 && e.owner != owner) {
        return absl::InvalidArgumentError(StrCat(
            "parameter '", e.names[0], "' is shared by units '", unit_names[e.owner], "' and '",
            unit_names[owner], "' (as '", name, "'); tied parameters must live in one unit, "
            "e.g. leave both modules in the root unit"));
      }
      e.owner = owner;
    }
  }

  for (const ParamEntry& e : entries) {
    if (IsDeferred(e.tensor) && !options.param_init) {
      return absl::InvalidArgumentError(StrCat(
          "parameter '", e.names[0], "' is deferred (no memory yet) but FsdpOptions::param_init "
          "is not set; give an initialiser such as fsdp::SeededInit. (A model that an FsdpModel "
          "wrapped before has no memory in its parameters either, even after that FsdpModel is "
          "destroyed: a model is wrapped once.)"));
    }
  }
  DistContext& dist = mesh.context();
  FSDP_RETURN_IF_ERROR(CheckSameModel(dist, Signature(unit_names, entries)));
  // A unit's all-gather and its flat buffers have one compute dtype (its first parameter's):
  // parameters of another dtype in the unit would pair buffers of different sizes across
  // ranks (Gloo: "Received data size doesn't match expected size", an abort). With one shard
  // nothing is gathered.
  if (ctx.num_shards > 1) {
    std::vector<const ParamEntry*> first_of_unit(root_index + 1, nullptr);
    for (const ParamEntry& e : entries) {
      const c10::ScalarType dtype =
          options.mixed_precision.param_dtype.value_or(e.tensor.scalar_type());
      const ParamEntry*& first = first_of_unit[e.owner];
      if (first == nullptr) {
        first = &e;
        continue;
      }
      const c10::ScalarType first_dtype =
          options.mixed_precision.param_dtype.value_or(first->tensor.scalar_type());
      if (dtype != first_dtype) {
        return absl::UnimplementedError(StrCat(
            "FSDP unit '", unit_names[e.owner], "' holds parameters of different dtypes: '",
            first->names[0], "' is ", c10::toString(first_dtype), ", '", e.names[0], "' is ",
            c10::toString(dtype), "; a unit's parameters are gathered in one dtype. Set "
            "FsdpOptions::mixed_precision.param_dtype (every unit then computes in that dtype, "
            "the shards keep their own), convert the parameters to one dtype before wrapping, "
            "or make the module holding '", e.names[0], "' a unit of its own"));
      }
    }
  }

  absl::Status status = CallTorch("sharding the model", [&] {
    at::NoGradGuard no_grad;
    if (options.sync_module_states && dist.world_size() > 1) {
      for (ParamEntry& e : entries) {
        if (IsDeferred(e.tensor)) continue;  // created from the seed on every rank instead
        at::Tensor t = e.tensor.detach();
        dist.world().Broadcast(t, 0)->wait();
      }
      for (at::Tensor b : root->buffers()) dist.world().Broadcast(b, 0)->wait();
    }
    std::vector<std::vector<FsdpParam>> unit_params(root_index + 1);
    for (ParamEntry& e : entries) {
      FsdpParam p;
      p.names = e.names;
      p.param = e.tensor;
      p.requires_grad = e.tensor.requires_grad();
      p.compute_dtype = options.mixed_precision.param_dtype.value_or(e.tensor.scalar_type());
      std::vector<int64_t> shape(e.tensor.sizes().begin(), e.tensor.sizes().end());
      p.sharding = ShardParam(shape, ctx.num_shards);
      const ParamSharding& s = p.sharding;
      std::vector<int64_t> padded_shape = s.LocalShape(0);
      padded_shape[0] = s.rows_per_shard;
      at::TensorOptions orig = e.tensor.options().device(ctx.device).requires_grad(false);
      p.padded_shard = at::zeros(padded_shape, orig);
      int64_t rows = s.LocalRows(ctx.shard_rank);
      if (rows > 0 && IsDeferred(e.tensor)) {
        at::Tensor local = p.padded_shard.narrow(0, 0, rows);
        options.param_init(e.names[0], s.FirstRow(ctx.shard_rank), s.row_numel, local);
      } else if (rows > 0) {
        p.padded_shard.narrow(0, 0, rows).copy_(
            e.tensor.detach().reshape({s.dim0, s.row_numel})
                .narrow(0, s.FirstRow(ctx.shard_rank), rows)
                .view(p.padded_shard.narrow(0, 0, rows).sizes()));
      }
      p.sharded = p.padded_shard.narrow(0, 0, rows).detach();
      p.sharded.set_requires_grad(p.requires_grad);
      // See Note [zero_grad on the module].
      if (p.requires_grad) p.grad_sentinel = at::empty({0}, orig.dtype(p.compute_dtype));
      // P keeps its TensorImpl: new storage (padded, compute dtype), freed until unsharded.
      std::vector<int64_t> strides(shape.size(), 1);
      for (int64_t i = static_cast<int64_t>(shape.size()) - 2; i >= 0; --i) {
        strides[i] = strides[i + 1] * shape[i + 1];
      }
      at::Tensor unsharded = at::empty({s.padded_numel()}, orig.dtype(p.compute_dtype))
                                 .as_strided(shape, strides, 0);
      e.tensor.set_data(unsharded);
      p.FreeUnsharded();
      unit_params[e.owner].push_back(std::move(p));
    }
    for (int u = 0; u <= root_index; ++u) {
      torch::nn::Module* module = u == root_index ? root.get() : unit_modules[u].get();
      model->units_.push_back(std::make_unique<FsdpUnit>(unit_names[u], module,
                                                         std::move(unit_params[u]), &ctx,
                                                         u == root_index));
    }
  });
  FSDP_RETURN_IF_ERROR(status);
  if (options.offload != Offload::kNone) {
    // See Note [CPU offload] (offload/host_offload.h): the masters move to host memory, allocated
    // once here.
    std::vector<FsdpParam*> params;
    for (auto& unit : model->units_) {
      for (FsdpParam& p : unit->params()) params.push_back(&p);
    }
    // Note [Compute copy] (offload_plan.h): kept unless host memory fits only without it.
    ComputeCopyInputs copy{.requested = options.offload_compute_copy,
                           .delayed_update = options.offload_delayed_update};
    for (const FsdpParam* p : params) {
      const int64_t n = p->padded_shard.numel();
      copy.host_bytes_without += kParamsOffloadHostBytesPerElement * n;
      if (c10::elementSize(p->compute_dtype) < c10::elementSize(p->padded_shard.scalar_type())) {
        copy.copy_bytes += static_cast<double>(c10::elementSize(p->compute_dtype)) * n;
      }
    }
    if (options.offload == Offload::kParams && copy.copy_bytes > 0) {
      copy.host_available =
          HostMemoryAvailablePerRank(mesh.context().env().local_world_size);
    }
    if (options.offload == Offload::kParams && copy.copy_bytes > 0) {
      model->compute_copy_ = ChooseComputeCopy(copy);
    }
    const bool keep_copy = !model->compute_copy_ || model->compute_copy_->keep;
    absl::StatusOr<std::unique_ptr<HostOffload>> offload;
    FSDP_RETURN_IF_ERROR(CallTorch("offloading the shards", [&] {
      offload = HostOffload::Create(options.offload, ctx.device, std::move(params),
                                    /*one_shard=*/ctx.num_shards == 1 && !ctx.replicate_group,
                                    /*delayed=*/options.offload_delayed_update,
                                    /*compute_copy=*/keep_copy);
    }));
    FSDP_ASSIGN_OR_RETURN(ctx.offload, std::move(offload));
  }

  for (auto& unit : model->units_) {
    RegisterUnit(unit->module(), UnitEntry{model.get(), unit.get()});
    for (FsdpParam& p : unit->params()) {
      for (const std::string& name : p.names) model->by_name_[name] = &p;
      if (p.requires_grad) {
        torch::autograd::impl::set_post_acc_grad_hooks(
            p.param, std::make_unique<PostAccumulateHook>(model.get(), unit.get()));
      }
    }
  }
  return model;
}

}  // namespace fsdp
