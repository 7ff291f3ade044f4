#include "engine/config.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <limits>
#include <charconv>
#include <climits>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <map>
#include <optional>
#include <sstream>
#include <string_view>
#include <functional>
#include <variant>

#include <yaml-cpp/yaml.h>

#include "common/env_knobs.h"
#include "common/status.h"
#include "common/strings.h"
#include "device_mesh/mesh_shape.h"
#include "engine/data.h"
#include "engine/hf_llama.h"
#include "sharding/options.h"

namespace fsdp {
namespace {

// A key whose YAML string maps to a typed value (an enum or a small struct): `parse` returns
// nullopt on success or what is wrong ("'x' is not valid; valid: ..."); `print` gives it back
// for ToYaml.
struct ChoiceField {
  std::function<std::optional<std::string>(const std::string&)> parse;
  std::function<std::string()> print;
};

// A list of strings (model.freeze) is a YAML sequence; a single string is a list of one.
using StringList = std::vector<std::string>;
using FieldRef = std::variant<int64_t*, double*, bool*, std::string*, ChoiceField, StringList*>;

struct Field {
  std::string_view name;
  FieldRef ref;
};

struct Section {
  std::string_view name;
  std::vector<Field> fields;
};

template <typename T, typename GetName>
std::vector<std::string> Names(const std::vector<T>& items, GetName get_name) {
  std::vector<std::string> names;
  for (const T& item : items) names.emplace_back(get_name(item));
  return names;
}

// Optimal string alignment distance (Levenshtein plus adjacent transpositions), ignoring case.
size_t EditDistance(std::string_view a_in, std::string_view b_in) {
  std::string a = ToLower(a_in);
  std::string b = ToLower(b_in);
  std::vector<std::vector<size_t>> d(a.size() + 1, std::vector<size_t>(b.size() + 1));
  for (size_t i = 0; i <= a.size(); ++i) d[i][0] = i;
  for (size_t j = 0; j <= b.size(); ++j) d[0][j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t cost = a[i - 1] == b[j - 1] ? 0 : 1;
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) {
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
      }
    }
  }
  return d[a.size()][b.size()];
}

// The closest candidate, if it is close: at most 2 edits (or a third of its length, for long
// names), and never more than half of it, so that "ab" does not suggest "lr".
std::optional<std::string> Suggest(std::string_view word, const std::vector<std::string>& valid) {
  std::optional<std::string> best;
  size_t best_distance = SIZE_MAX;
  for (const std::string& candidate : valid) {
    size_t distance = EditDistance(word, candidate);
    bool close =
        distance <= std::max<size_t>(2, candidate.size() / 3) && 2 * distance <= candidate.size();
    if (close && distance < best_distance) {
      best = candidate;
      best_distance = distance;
    }
  }
  return best;
}

// "unknown key; did you mean 'steps'? (valid: a, b)" or "unknown key (valid: a, b)".
std::string UnknownName(std::string_view what, std::string_view word,
                        const std::vector<std::string>& valid) {
  std::optional<std::string> suggestion = Suggest(word, valid);
  if (suggestion) {
    return StrCat(what, "; did you mean '", *suggestion, "'? (valid: ", StrJoin(valid, ", "), ")");
  }
  return StrCat(what, " (valid: ", StrJoin(valid, ", "), ")");
}

// "'fully_shard' is not valid; did you mean 'full_shard'? valid: a, b" (the suggestion if close).
std::string NotValid(std::string_view value, const std::vector<std::string>& valid,
                     std::string_view valid_text = {}) {
  std::string listed = valid_text.empty() ? StrJoin(valid, ", ") : std::string(valid_text);
  std::optional<std::string> suggestion = Suggest(value, valid);
  if (suggestion) {
    return StrCat("'", value, "' is not valid; did you mean '", *suggestion, "'? valid: ", listed);
  }
  return StrCat("'", value, "' is not valid; valid: ", listed);
}

// Every spelling of an enum, in the order "valid: ..." lists them.
template <typename E>
using NameTable = std::vector<std::pair<E, const char*>>;

template <typename E>
const char* NameIn(const NameTable<E>& table, E value) {
  for (const auto& [v, name] : table) {
    if (v == value) return name;
  }
  return "?";
}

template <typename E>
ChoiceField Enum(E* field, NameTable<E> table) {
  return {[field, table](const std::string& text) -> std::optional<std::string> {
            std::vector<std::string> valid;
            for (const auto& [value, name] : table) {
              if (text == name) {
                *field = value;
                return std::nullopt;
              }
              valid.emplace_back(name);
            }
            return NotValid(text, valid);
          },
          [field, table] { return std::string(NameIn(table, *field)); }};
}

const NameTable<Precision>& Precisions() {
  static const NameTable<Precision> t = {{Precision::kFp32, "fp32"}, {Precision::kBf16, "bf16"}};
  return t;
}
const NameTable<DeviceKind>& DeviceKinds() {
  static const NameTable<DeviceKind> t = {
      {DeviceKind::kAuto, "auto"}, {DeviceKind::kCpu, "cpu"}, {DeviceKind::kCuda, "cuda"}};
  return t;
}
const NameTable<CudaBackend>& CudaBackends() {
  static const NameTable<CudaBackend> t = {
      {CudaBackend::kAuto, "auto"}, {CudaBackend::kNccl, "nccl"}, {CudaBackend::kGloo, "gloo"}};
  return t;
}
const NameTable<CpuCollectives>& CpuCollectivesNames() {
  static const NameTable<CpuCollectives> t = {{CpuCollectives::kP2p, "p2p"},
                                              {CpuCollectives::kGloo, "gloo"}};
  return t;
}

std::vector<std::string> StrategyNames() {
  std::vector<std::string> names;
  for (Strategy s : {Strategy::kFullShard, Strategy::kShardGradOp, Strategy::kHybridShard,
                     Strategy::kHybridShardZero2, Strategy::kNoShard}) {
    names.emplace_back(StrategyName(s));
  }
  names.emplace_back("none");
  return names;
}

constexpr std::string_view kReshardValid =
    "default, true, false, or an integer k with 1 < k < the shard degree, dividing it "
    "(reshard to groups of k ranks)";

ChoiceField StrategyField(std::optional<Strategy>* field) {
  return {[field](const std::string& text) -> std::optional<std::string> {
            if (text == "none") {
              *field = std::nullopt;
              return std::nullopt;
            }
            absl::StatusOr<Strategy> parsed = ParseStrategy(text);
            if (!parsed.ok()) return NotValid(text, StrategyNames());
            *field = *parsed;
            return std::nullopt;
          },
          [field] { return std::string(StrategyLabel(*field)); }};
}

ChoiceField ReshardField(ReshardPolicy* field) {
  using Kind = ReshardPolicy::Kind;
  return {[field](const std::string& text) -> std::optional<std::string> {
            if (text == "default" || text == "true" || text == "false") {
              field->kind = text == "default" ? Kind::kDefault
                            : text == "true"  ? Kind::kAlways
                                              : Kind::kNever;
              field->group_size = 0;
              return std::nullopt;
            }
            std::optional<int64_t> k = ParseInt<int64_t>(text);
            if (!k || *k < 2 || *k > INT_MAX) {
              return NotValid(text, {"default", "true", "false"}, kReshardValid);
            }
            *field = {Kind::kGroup, static_cast<int>(*k)};
            return std::nullopt;
          },
          [field]() -> std::string {
            switch (field->kind) {
              case Kind::kDefault: return "default";
              case Kind::kAlways: return "true";
              case Kind::kNever: return "false";
              case Kind::kGroup: break;
            }
            return StrCat(field->group_size);
          }};
}

ChoiceField UnitPolicyField(UnitPolicy* field) {
  return {[field](const std::string& text) -> std::optional<std::string> {
            if (text == "block") {
              *field = {};
              return std::nullopt;
            }
            std::optional<int64_t> n;
            if (StartsWith(text, "params:")) n = ParseInt<int64_t>(std::string_view(text).substr(7));
            if (!n || *n < 1) {
              return NotValid(text, {"block"},
                              "block, params:N (children with >= N parameters, N >= 1)");
            }
            *field = {UnitPolicy::Kind::kMinParams, *n};
            return std::nullopt;
          },
          [field] {
            return field->kind == UnitPolicy::Kind::kBlock ? std::string("block")
                                                           : StrCat("params:", field->min_params);
          }};
}

NameTable<Offload> OffloadNames() {
  NameTable<Offload> table;
  for (Offload o : {Offload::kNone, Offload::kOptimizer, Offload::kParams}) {
    table.emplace_back(o, OffloadName(o));  // sharding/options.cc holds the names
  }
  return table;
}

ChoiceField CheckpointingField(ActivationCheckpointing* field) {
  using Mode = ActivationCheckpointing::Mode;
  return {[field](const std::string& text) -> std::optional<std::string> {
            if (text == "none" || text == "full" || text == "selective") {
              *field = {text == "none" ? Mode::kNone : text == "full" ? Mode::kFull : Mode::kSelective, 1};
              return std::nullopt;
            }
            std::optional<int64_t> k;
            if (StartsWith(text, "every:")) k = ParseInt<int64_t>(std::string_view(text).substr(6));
            if (!k || *k < 1 || *k > INT_MAX) {
              return NotValid(text, {"none", "full", "selective"},
                              "none, full, selective, every:k (every k-th block, k >= 1)");
            }
            *field = {Mode::kFull, static_cast<int>(*k)};
            return std::nullopt;
          },
          [field]() -> std::string {
            switch (field->mode) {
              case Mode::kNone: return "none";
              case Mode::kSelective: return "selective";
              case Mode::kFull: break;
            }
            return field->every == 1 ? std::string("full") : StrCat("every:", field->every);
          }};
}

ChoiceField ProfileField(ProfileWindow* field) {
  return {[field](const std::string& text) -> std::optional<std::string> {
            std::optional<ProfileWindow> window = ParseProfileWindow(text);
            if (!window) {
              return NotValid(text, {"none"},
                              "none, or START:STEPS (profile STEPS >= 1 steps from the 0-based "
                              "step START, e.g. 10:3)");
            }
            *field = *window;
            return std::nullopt;
          },
          [field]() { return field->ToString(); }};
}

ChoiceField OptimizerField(OptimizerKind* field) {
  NameTable<OptimizerKind> table;
  for (OptimizerKind kind : {OptimizerKind::kAdamW, OptimizerKind::kAdam, OptimizerKind::kSgd}) {
    table.emplace_back(kind, OptimizerKindName(kind).data());
  }
  return Enum(field, std::move(table));
}

ChoiceField AttentionField(AttentionBackend* field) {
  NameTable<AttentionBackend> table;
  for (AttentionBackend b : AttentionBackends()) table.emplace_back(b, AttentionBackendName(b));
  return Enum(field, std::move(table));
}

ChoiceField OptimizerImplementationField(OptimizerImplementation* field) {
  NameTable<OptimizerImplementation> table;
  for (OptimizerImplementation i : {OptimizerImplementation::kFused,
                                    OptimizerImplementation::kForeach,
                                    OptimizerImplementation::kPerTensor}) {
    table.emplace_back(i, OptimizerImplementationName(i).data());  // literals (engine/optimizer.cc)
  }
  return Enum(field, std::move(table));
}

ChoiceField DelayedUpdateField(DelayedUpdate* field) {
  return {[field](const std::string& text) -> std::optional<std::string> {
            if (text == "off" || text == "on") {
              *field = {.enabled = text == "on", .after = 0};
              return std::nullopt;
            }
            std::optional<int64_t> n;
            if (StartsWith(text, "after:")) n = ParseInt<int64_t>(std::string_view(text).substr(6));
            if (!n || *n < 0) {
              const bool boolean = text == "true" || text == "false";
              return StrCat(NotValid(text, {"off", "on"},
                                    "off, on, after:N (the first N >= 0 steps undelayed)"),
                            boolean ? StrCat(" (write ", text == "true" ? "on" : "off", ")") : "");
            }
            *field = {.enabled = true, .after = *n};
            return std::nullopt;
          },
          [field]() -> std::string {
            if (!field->enabled) return "off";
            return field->after == 0 ? std::string("on") : StrCat("after:", field->after);
          }};
}

// Keys that no longer exist, with what replaces them: an old config fails naming the new way.
struct RemovedKey {
  std::string_view key;
  std::string_view replacement;
};
constexpr RemovedKey kRemovedKeys[] = {
    {"parallelism.offload_overlap_step",
     "was removed: the overlapped host step is always on (the same values bit for bit); "
     "FSDP_OFFLOAD_OVERLAP_STEP=0 turns it off for debugging"},
    {"parallelism.offload_compute_copy",
     "was removed: offload params keeps the compute-dtype copy on the host unless host memory "
     "only fits without it (the start line prints the choice); FSDP_OFFLOAD_COMPUTE_COPY=0|1 "
     "forces it for debugging"},
    {"parallelism.offload_delayed_update_warmup",
     "was removed: write parallelism.offload_delayed_update: after:N"},
};

std::optional<std::string_view> RemovedKeyReplacement(std::string_view key) {
  for (const RemovedKey& removed : kRemovedKeys) {
    if (removed.key == key) return removed.replacement;
  }
  return std::nullopt;
}

// The schema: every section and key, in the order ToYaml writes them, pointing into `c`.
std::vector<Section> Sections(RunConfig& c) {
  return {
      {"run", {{"name", &c.run.name}, {"dir", &c.run.dir}, {"seed", &c.run.seed}}},
      {"model",
       {{"arch", &c.model.arch},
        {"vocab_size", &c.model.vocab_size},
        {"dim", &c.model.dim},
        {"n_layers", &c.model.n_layers},
        {"n_heads", &c.model.n_heads},
        {"n_kv_heads", &c.model.n_kv_heads},
        {"seq_len", &c.model.seq_len},
        {"ffn_hidden", &c.model.ffn_hidden},
        {"norm", Enum(&c.model.norm, {{NormKind::kLayerNorm, "layernorm"}, {NormKind::kRmsNorm, "rmsnorm"}})},
        {"activation", Enum(&c.model.activation, {{Activation::kGelu, "gelu"}, {Activation::kSwiglu, "swiglu"}})},
        {"positions", Enum(&c.model.positions, {{Positions::kLearned, "learned"}, {Positions::kRope, "rope"}})},
        {"tie_embeddings", &c.model.tie_embeddings},
        {"norm_eps", &c.model.norm_eps},
        {"rope_theta", &c.model.rope_theta},
        {"init_std", &c.model.init_std},
        {"kernels", Enum(&c.model.kernels, {{KernelMode::kAuto, "auto"}, {KernelMode::kFused, "fused"}, {KernelMode::kComposite, "composite"}})},
        {"loss_chunk_tokens", &c.model.loss_chunk_tokens},
        {"attention", AttentionField(&c.model.attention)},
        {"deferred_init", &c.model.deferred_init},
        {"init_from", &c.model.init_from},
        {"freeze", &c.model.freeze}}},
      {"data",
       {{"source", Enum(&c.data.source, {{DataSource::kSynthetic, "synthetic"}, {DataSource::kTokens, "tokens"}, {DataSource::kText, "text"}})},
        {"path", &c.data.path},
        {"token_dtype", Enum(&c.data.token_dtype, {{TokenDtype::kUint16, "uint16"}, {TokenDtype::kUint32, "uint32"}})},
        {"header", Enum(&c.data.header, {{TokenHeader::kAuto, "auto"}, {TokenHeader::kLlmc, "llmc"}, {TokenHeader::kNone, "none"}})},
        {"val_fraction", &c.data.val_fraction},
        {"synthetic_tokens", &c.data.synthetic_tokens}}},
      {"training",
       {{"steps", &c.training.steps},
        {"micro_batch_size", &c.training.micro_batch_size},
        {"grad_accum_steps", &c.training.grad_accum_steps},
        {"grad_sync", Enum(&c.training.grad_sync, {{GradSync::kEvery, "every"}, {GradSync::kLast, "last"}})},
        {"max_grad_norm", &c.training.max_grad_norm},
        {"mixed_precision", Enum(&c.training.mixed_precision, Precisions())},
        {"reduce_dtype", Enum(&c.training.reduce_dtype, Precisions())},
        {"device", Enum(&c.training.device, DeviceKinds())},
        {"cpu_allocator", Enum(&c.training.cpu_allocator, {{HostAllocator::kCaching, "caching"}, {HostAllocator::kDefault, "default"}})},
        {"on_nonfinite", Enum(&c.training.on_nonfinite, {{OnNonFinite::kStop, "stop"}, {OnNonFinite::kSkip, "skip"}})},
        {"eval_interval", &c.training.eval_interval},
        {"eval_batches", &c.training.eval_batches},
        {"log_interval", &c.training.log_interval},
        {"activation_checkpointing", CheckpointingField(&c.training.activation_checkpointing)},
        {"profile", ProfileField(&c.training.profile)},
        {"profile_dir", &c.training.profile_dir},
        {"deterministic", &c.training.deterministic}}},
      {"optimizer",
       {{"name", OptimizerField(&c.optimizer.kind)},
        {"lr", &c.optimizer.lr},
        {"weight_decay", &c.optimizer.weight_decay},
        {"beta1", &c.optimizer.beta1},
        {"beta2", &c.optimizer.beta2},
        {"eps", &c.optimizer.eps},
        {"momentum", &c.optimizer.momentum},
        {"implementation", OptimizerImplementationField(&c.optimizer.implementation)}}},
      {"lr_scheduler",
       {{"warmup_steps", &c.lr_scheduler.warmup_steps},
        {"decay", Enum(&c.lr_scheduler.decay, {{LrDecay::kCosine, "cosine"}, {LrDecay::kLinear, "linear"}, {LrDecay::kConstant, "constant"}})},
        {"min_lr", &c.lr_scheduler.min_lr}}},
      {"parallelism",
       {{"nproc", &c.parallelism.nproc},
        {"data_parallel_replicate_degree", &c.parallelism.data_parallel_replicate_degree},
        {"data_parallel_shard_degree", &c.parallelism.data_parallel_shard_degree},
        {"strategy", StrategyField(&c.parallelism.strategy)},
        {"reshard_after_forward", ReshardField(&c.parallelism.reshard_after_forward)},
        {"wrap_policy", UnitPolicyField(&c.parallelism.wrap_policy)},
        {"max_unsharded_units", &c.parallelism.max_unsharded_units},
        {"reshard_between_micro_batches", &c.parallelism.reshard_between_micro_batches},
        {"backend", Enum(&c.parallelism.backend, CudaBackends())},
        {"cpu_collectives", Enum(&c.parallelism.cpu_collectives, CpuCollectivesNames())},
        {"offload", Enum(&c.parallelism.offload, OffloadNames())},
        {"offload_delayed_update", DelayedUpdateField(&c.parallelism.offload_delayed_update)},
        {"collective_timeout_s", &c.parallelism.collective_timeout_s}}},
      {"metrics",
       {{"jsonl", &c.metrics.jsonl},
        {"cpu_peak_flops", &c.metrics.cpu_peak_flops},
        {"print_config", &c.metrics.print_config},
        {"progress_bar", Enum(&c.metrics.progress_bar, {{ProgressBarMode::kAuto, "auto"}, {ProgressBarMode::kOn, "on"}, {ProgressBarMode::kOff, "off"}})}}},
      {"checkpoint",
       {{"enabled", &c.checkpoint.enabled},
        {"dir", &c.checkpoint.dir},
        {"interval", &c.checkpoint.interval},
        {"keep_latest_k", &c.checkpoint.keep_latest_k},
        {"load", &c.checkpoint.load},
        {"async", &c.checkpoint.async},
        {"strict", &c.checkpoint.strict},
        {"load_optimizer", &c.checkpoint.load_optimizer}}},
  };
}

absl::Status Invalid(std::string_view where, std::string_view key, std::string_view what) {
  if (key.empty()) return absl::InvalidArgumentError(StrCat(where, ": ", what));
  return absl::InvalidArgumentError(StrCat(where, ": ", key, ": ", what));
}

std::string At(std::string_view name, const YAML::Mark& mark) {
  if (mark.is_null()) return std::string(name);
  return StrCat(name, ":", mark.line + 1);
}

std::string Describe(const YAML::Node& node) {
  switch (node.Type()) {
    case YAML::NodeType::Map:
      return "a map";
    case YAML::NodeType::Sequence:
      return "a list";
    case YAML::NodeType::Scalar:
      return StrCat("'", node.Scalar(), "'");
    default:
      return "an empty value";
  }
}

std::optional<int64_t> ToInt(std::string_view s) {
  if (StartsWith(s, "+")) s.remove_prefix(1);
  return ParseInt<int64_t>(s);
}

std::optional<double> ToDouble(std::string_view s) {
  if (StartsWith(s, "+")) s.remove_prefix(1);
  double value = 0;
  auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), value);
  if (s.empty() || ec != std::errc() || ptr != s.data() + s.size() || !std::isfinite(value)) {
    return std::nullopt;
  }
  return value;
}

// Sets the field from a YAML value; the message on a type error is "expected ..., got ...".
absl::Status SetField(const FieldRef& ref, const YAML::Node& value, std::string_view where,
                      std::string_view key) {
  bool scalar = value.IsScalar();
  if (auto* choice = std::get_if<ChoiceField>(&ref)) {
    if (!scalar) {
      // What is valid, from the parser's own message for a value no field accepts.
      std::string valid;
      if (std::optional<std::string> e = choice->parse("\x7f"); e) {
        if (size_t at = e->rfind("valid: "); at != std::string::npos) valid = "; " + e->substr(at);
      }
      const bool key_value = value.IsMap() && value.size() == 1;
      return Invalid(where, key,
                     StrCat("expected a string, got ", Describe(value),
                            key_value ? " (YAML reads 'a: b' with a space after the colon as a "
                                        "map: write a:b)"
                                      : "",
                            valid));
    }
    if (std::optional<std::string> error = choice->parse(value.Scalar())) {
      return Invalid(where, key, *error);
    }
    return absl::OkStatus();
  }
  if (auto* list = std::get_if<StringList*>(&ref)) {
    StringList items;
    if (scalar) items.push_back(value.Scalar());
    if (value.IsSequence()) {
      for (const YAML::Node& item : value) {
        if (!item.IsScalar()) {
          return Invalid(
              where, key,
              StrCat("expected a list of strings, got an item that is ", Describe(item)));
        }
        items.push_back(item.Scalar());
      }
    } else if (!scalar && !value.IsNull()) {
      return Invalid(where, key, StrCat("expected a list of strings, got ", Describe(value)));
    }
    **list = std::move(items);
    return absl::OkStatus();
  }
  if (auto* s = std::get_if<std::string*>(&ref)) {
    if (!scalar && !value.IsNull()) {
      return Invalid(where, key, StrCat("expected a string, got ", Describe(value)));
    }
    **s = value.IsNull() ? "" : value.Scalar();
    return absl::OkStatus();
  }
  if (auto* i = std::get_if<int64_t*>(&ref)) {
    std::optional<int64_t> parsed = scalar ? ToInt(value.Scalar()) : std::nullopt;
    if (!parsed) return Invalid(where, key, StrCat("expected an integer, got ", Describe(value)));
    **i = *parsed;
    return absl::OkStatus();
  }
  if (auto* d = std::get_if<double*>(&ref)) {
    std::optional<double> parsed = scalar ? ToDouble(value.Scalar()) : std::nullopt;
    if (!parsed) return Invalid(where, key, StrCat("expected a number, got ", Describe(value)));
    **d = *parsed;
    return absl::OkStatus();
  }
  bool* b = std::get<bool*>(ref);
  if (!scalar || (value.Scalar() != "true" && value.Scalar() != "false")) {
    return Invalid(where, key, StrCat("expected true or false, got ", Describe(value)));
  }
  *b = value.Scalar() == "true";
  return absl::OkStatus();
}

// Where each key was set ("configs/x.yaml:12" or "--set training.steps=5"), by "section.key".
using Locations = std::map<std::string, std::string, std::less<>>;

class Parser {
 public:
  Parser(std::string name, RunConfig& config)
      : name_(std::move(name)), sections_(Sections(config)) {}

  absl::Status ParseDocument(const std::string& text, Locations& where) {
    YAML::Node root;
    try {
      // One document: a second one ("---") would otherwise be silently ignored.
      std::vector<YAML::Node> documents = YAML::LoadAll(text);
      if (documents.size() > 1) {
        return Invalid(At(name_, documents[1].Mark()), "",
                       StrCat("the file holds ", documents.size(),
                              " YAML documents ('---'); a run configuration is one document"));
      }
      root = YAML::Load(text);
    } catch (const YAML::ParserException& e) {
      return Invalid(At(name_, e.mark), "", StrCat("YAML syntax error: ", e.msg));
    } catch (const YAML::Exception& e) {
      return Invalid(name_, "", StrCat("cannot read YAML: ", e.what()));
    }
    if (root.IsNull()) return absl::OkStatus();
    if (!root.IsMap()) {
      return Invalid(At(name_, root.Mark()), "",
                     StrCat("expected a map of sections (", StrJoin(SectionNames(), ", "),
                            "), got ", Describe(root)));
    }
    std::map<std::string, std::string> section_at;
    for (const auto& entry : root) {
      const YAML::Node& key = entry.first;
      std::string section_name = key.IsScalar() ? key.Scalar() : Describe(key);
      std::string at = At(name_, key.Mark());
      Section* section = FindSection(section_name);
      if (section == nullptr) {
        return Invalid(at, section_name,
                       UnknownName("unknown section", section_name, SectionNames()));
      }
      auto [first, inserted] = section_at.emplace(section_name, at);
      if (!inserted) {
        return Invalid(at, section_name,
                       StrCat("duplicate section (first at ", first->second, ")"));
      }
      const YAML::Node& body = entry.second;
      if (body.IsNull()) continue;
      if (!body.IsMap()) {
        return Invalid(at, section_name,
                       StrCat("expected a map of keys, got ", Describe(body),
                              " (valid: ", StrJoin(KeyNames(*section), ", "), ")"));
      }
      for (const auto& item : body) {
        const YAML::Node& field_key = item.first;
        std::string field_name = field_key.IsScalar() ? field_key.Scalar() : Describe(field_key);
        std::string path = StrCat(section_name, ".", field_name);
        std::string field_at = At(name_, field_key.Mark());
        Field* field = FindField(*section, field_name);
        if (field == nullptr) {
          if (auto replacement = RemovedKeyReplacement(path)) {
            return Invalid(field_at, path, *replacement);
          }
          return Invalid(field_at, path,
                         UnknownName("unknown key", field_name, KeyNames(*section)));
        }
        if (where.count(path) > 0) {
          return Invalid(field_at, path, StrCat("duplicate key (first at ", where[path], ")"));
        }
        FSDP_RETURN_IF_ERROR(SetField(field->ref, item.second, field_at, path));
        where[path] = field_at;
      }
    }
    return absl::OkStatus();
  }

  absl::Status ApplyOverride(const std::string& item, Locations& where) {
    std::string at = StrCat("--set ", item);
    size_t eq = item.find('=');
    std::string_view path =
        eq == std::string::npos ? "" : Strip(std::string_view(item).substr(0, eq));
    size_t dot = path.find('.');
    if (eq == std::string::npos || dot == std::string_view::npos || dot == 0 ||
        dot + 1 == path.size()) {
      return Invalid(at, "", "expected section.key=value (e.g. training.steps=100)");
    }
    std::string section_name(path.substr(0, dot));
    std::string field_name(path.substr(dot + 1));
    Section* section = FindSection(section_name);
    if (section == nullptr) {
      return Invalid(at, section_name,
                     UnknownName("unknown section", section_name, SectionNames()));
    }
    std::string key = StrCat(section_name, ".", field_name);
    Field* field = FindField(*section, field_name);
    if (field == nullptr) {
      if (auto replacement = RemovedKeyReplacement(key)) return Invalid(at, key, *replacement);
      return Invalid(at, key, UnknownName("unknown key", field_name, KeyNames(*section)));
    }
    YAML::Node value;
    try {
      value = YAML::Load(std::string(Strip(std::string_view(item).substr(eq + 1))));
    } catch (const YAML::Exception& e) {
      return Invalid(at, key, StrCat("cannot parse the value as YAML: ", e.msg));
    }
    FSDP_RETURN_IF_ERROR(SetField(field->ref, value, at, key));
    where[key] = at;
    return absl::OkStatus();
  }

 private:
  Section* FindSection(std::string_view name) {
    for (Section& section : sections_) {
      if (section.name == name) return &section;
    }
    return nullptr;
  }
  static Field* FindField(Section& section, std::string_view name) {
    for (Field& field : section.fields) {
      if (field.name == name) return &field;
    }
    return nullptr;
  }
  std::vector<std::string> SectionNames() const {
    return Names(sections_, [](const Section& s) { return s.name; });
  }
  static std::vector<std::string> KeyNames(const Section& section) {
    return Names(section.fields, [](const Field& f) { return f.name; });
  }

  std::string name_;
  std::vector<Section> sections_;
};

// Value checks; each error is reported at the place its first named key was set (the file
// name alone for a key left at its default).
class Validator {
 public:
  Validator(const Locations& where, std::string name) : where_(where), name_(std::move(name)) {}

  absl::Status Fail(std::string_view key, std::string_view what,
                    std::initializer_list<std::string_view> related = {}) const {
    return Invalid(Where(key, related), key, what);
  }
  absl::Status Check(bool ok, std::string_view key, std::string_view what,
                     std::initializer_list<std::string_view> related = {}) const {
    return ok ? absl::OkStatus() : Fail(key, what, related);
  }
  template <typename T>
  absl::Status AtLeast(std::string_view key, T value, T min) const {
    return Check(value >= min, key, StrCat("must be >= ", min, ", got ", value));
  }
  // Within float32's range: these values end up in fp32 arithmetic, where 1e300 is inf (found
  // by the red-team pass: model.init_std 1e300 trained into a NaN at step 1, and
  // training.max_grad_norm 1e300 failed inside ATen's clipping with an internal error).
  absl::Status FitsFloat(std::string_view key, double value) const {
    return Check(std::abs(value) <= std::numeric_limits<float>::max(), key,
                 StrCat("must be at most float32's largest value (3.4e38), got ", value));
  }
  absl::Status Positive(std::string_view key, double value) const {
    FSDP_RETURN_IF_ERROR(Check(value > 0, key, StrCat("must be > 0, got ", value)));
    return FitsFloat(key, value);
  }
  absl::Status Fraction(std::string_view key, double value) const {
    return Check(value >= 0 && value < 1, key, StrCat("must be in [0, 1), got ", value));
  }
  absl::Status OneOf(std::string_view key, const std::string& value,
                     const std::vector<std::string>& valid) const {
    bool ok = std::find(valid.begin(), valid.end(), value) != valid.end();
    return Check(ok, key, NotValid(value, valid));
  }

 private:
  std::string Where(std::string_view key, std::initializer_list<std::string_view> related) const {
    if (auto it = where_.find(key); it != where_.end()) return it->second;
    for (std::string_view other : related) {
      if (auto it = where_.find(other); it != where_.end()) return it->second;
    }
    return name_;
  }

  const Locations& where_;
  std::string name_;
};

absl::Status ValidateModel(const ModelSection& m, const Validator& v) {
  FSDP_RETURN_IF_ERROR(v.OneOf("model.arch", m.arch, ModelArchs()));
  FSDP_RETURN_IF_ERROR(v.AtLeast<int64_t>("model.vocab_size", m.vocab_size, 2));
  FSDP_RETURN_IF_ERROR(v.AtLeast<int64_t>("model.dim", m.dim, 1));
  FSDP_RETURN_IF_ERROR(v.AtLeast<int64_t>("model.n_layers", m.n_layers, 1));
  FSDP_RETURN_IF_ERROR(v.AtLeast<int64_t>("model.n_heads", m.n_heads, 1));
  FSDP_RETURN_IF_ERROR(
      v.Check(m.dim % m.n_heads == 0, "model.dim",
              StrCat("must be a multiple of model.n_heads = ", m.n_heads, ", got ", m.dim),
              {"model.n_heads"}));
  FSDP_RETURN_IF_ERROR(v.AtLeast<int64_t>("model.n_kv_heads", m.n_kv_heads, 0));
  FSDP_RETURN_IF_ERROR(v.Check(
      m.n_heads % m.kv_heads() == 0, "model.n_kv_heads",
      StrCat("must divide model.n_heads = ", m.n_heads, " (0: n_heads), got ", m.n_kv_heads),
      {"model.n_heads"}));
  FSDP_RETURN_IF_ERROR(v.AtLeast<int64_t>("model.seq_len", m.seq_len, 1));
  FSDP_RETURN_IF_ERROR(v.AtLeast<int64_t>("model.ffn_hidden", m.ffn_hidden, 0));
  int64_t head_dim = m.dim / m.n_heads;
  FSDP_RETURN_IF_ERROR(
      v.Check(m.positions != Positions::kRope || head_dim % 2 == 0, "model.positions",
              StrCat("rope needs an even head dimension, got model.dim / model.n_heads = ", m.dim,
                     " / ", m.n_heads, " = ", head_dim),
              {"model.dim", "model.n_heads"}));
  FSDP_RETURN_IF_ERROR(v.Positive("model.norm_eps", m.norm_eps));
  FSDP_RETURN_IF_ERROR(v.Positive("model.rope_theta", m.rope_theta));
  FSDP_RETURN_IF_ERROR(v.AtLeast<int64_t>("model.loss_chunk_tokens", m.loss_chunk_tokens, 0));
  for (const std::string& pattern : m.freeze) {
    FSDP_RETURN_IF_ERROR(v.Check(!pattern.empty(), "model.freeze",
                                 "a pattern is empty (patterns are globs over parameter names, "
                                 "e.g. \"tok_embeddings.*\", \"layers.0.*\")"));
  }
  return v.Positive("model.init_std", m.init_std);
}

absl::Status ValidateData(const DataSection& d, const Validator& v) {
  FSDP_RETURN_IF_ERROR(v.Check(d.source == DataSource::kSynthetic || !d.path.empty(), "data.path",
                               StrCat("required for data.source '", d.source == DataSource::kTokens ? "tokens" : "text", "'"),
                               {"data.source"}));
  FSDP_RETURN_IF_ERROR(v.Fraction("data.val_fraction", d.val_fraction));
  FSDP_RETURN_IF_ERROR(v.AtLeast<int64_t>("data.synthetic_tokens", d.synthetic_tokens, 1024));
  // kMaxSyntheticTokens (engine/data.h): 2^63 failed inside std::vector as an internal error.
  return v.Check(d.synthetic_tokens <= kMaxSyntheticTokens, "data.synthetic_tokens",
                 StrCat("must be <= 2^32 = ", kMaxSyntheticTokens,
                        " (the synthetic stream is generated in memory at start, 4 bytes a "
                        "token; data.source tokens reads a file of any size), got ",
                        d.synthetic_tokens));
}

absl::Status ValidateTraining(const TrainingSection& t, const Validator& v) {
  FSDP_RETURN_IF_ERROR(v.AtLeast<int64_t>("training.steps", t.steps, 1));
  FSDP_RETURN_IF_ERROR(v.FitsFloat("training.max_grad_norm", t.max_grad_norm));
  FSDP_RETURN_IF_ERROR(v.AtLeast<int64_t>("training.micro_batch_size", t.micro_batch_size, 1));
  FSDP_RETURN_IF_ERROR(v.AtLeast<int64_t>("training.grad_accum_steps", t.grad_accum_steps, 1));
  FSDP_RETURN_IF_ERROR(v.AtLeast<int64_t>("training.eval_interval", t.eval_interval, 0));
  FSDP_RETURN_IF_ERROR(v.AtLeast<int64_t>("training.eval_batches", t.eval_batches, 1));
  // start + steps would overflow for huge values (and pass): compared without the sum.
  const bool profile_fits = !t.profile.enabled() || (t.profile.start <= t.steps &&
                                                     t.profile.steps <= t.steps - t.profile.start);
  FSDP_RETURN_IF_ERROR(v.Check(
      profile_fits, "training.profile",
      StrCat("'", t.profile.ToString(), "' ends after step ",
             t.profile.start > std::numeric_limits<int64_t>::max() - t.profile.steps
                 ? std::string("2^63")
                 : StrCat(t.profile.start + t.profile.steps),
             " of a run of ", t.steps, " steps"),
      {"training.steps"}));
  return v.AtLeast<int64_t>("training.log_interval", t.log_interval, 1);
}

absl::Status ValidateOptimizer(const OptimizerSection& o, const LrSchedulerSection& s,
                               const Validator& v) {
  FSDP_RETURN_IF_ERROR(v.Positive("optimizer.lr", o.lr));
  FSDP_RETURN_IF_ERROR(v.AtLeast<double>("optimizer.weight_decay", o.weight_decay, 0));
  FSDP_RETURN_IF_ERROR(v.FitsFloat("optimizer.weight_decay", o.weight_decay));
  FSDP_RETURN_IF_ERROR(v.FitsFloat("optimizer.momentum", o.momentum));
  FSDP_RETURN_IF_ERROR(v.Fraction("optimizer.beta1", o.beta1));
  FSDP_RETURN_IF_ERROR(v.Fraction("optimizer.beta2", o.beta2));
  FSDP_RETURN_IF_ERROR(v.Positive("optimizer.eps", o.eps));
  FSDP_RETURN_IF_ERROR(v.AtLeast<double>("optimizer.momentum", o.momentum, 0));
  FSDP_RETURN_IF_ERROR(v.AtLeast<int64_t>("lr_scheduler.warmup_steps", s.warmup_steps, 0));
  FSDP_RETURN_IF_ERROR(v.AtLeast<double>("lr_scheduler.min_lr", s.min_lr, 0));
  return v.Check(s.min_lr <= o.lr, "lr_scheduler.min_lr",
                 StrCat("must be <= optimizer.lr = ", o.lr, ", got ", s.min_lr), {"optimizer.lr"});
}

absl::Status ValidateParallelism(const ParallelismSection& p, const Validator& v) {
  FSDP_RETURN_IF_ERROR(v.AtLeast<int64_t>("parallelism.nproc", p.nproc, 0));
  FSDP_RETURN_IF_ERROR(v.Check(p.collective_timeout_s >= 1 && p.collective_timeout_s <= 604800,
                               "parallelism.collective_timeout_s",
                               StrCat("must be in 1..604800 seconds, got ", p.collective_timeout_s)));
  for (auto [key, degree] :
       {std::pair<std::string_view, int64_t>{"parallelism.data_parallel_replicate_degree",
                                             p.data_parallel_replicate_degree},
        {"parallelism.data_parallel_shard_degree", p.data_parallel_shard_degree}}) {
    FSDP_RETURN_IF_ERROR(
        v.Check(degree >= 1 || degree == -1, key,
                StrCat("must be >= 1, or -1 to infer it from the world size, got ", degree)));
  }
  FSDP_RETURN_IF_ERROR(v.Check(
      p.data_parallel_replicate_degree != -1 || p.data_parallel_shard_degree != -1,
      "parallelism.data_parallel_replicate_degree",
      "-1 needs a fixed parallelism.data_parallel_shard_degree; at most one of the two degrees "
      "may be -1 (inferred from the world size)",
      {"parallelism.data_parallel_shard_degree"}));
  FSDP_RETURN_IF_ERROR(
      v.AtLeast<int64_t>("parallelism.max_unsharded_units", p.max_unsharded_units, 1));
  return absl::OkStatus();
}

absl::Status Validate(const RunConfig& c, const Locations& where) {
  Validator v(where, c.source_file);
  FSDP_RETURN_IF_ERROR(v.Check(!c.run.name.empty(), "run.name", "must not be empty"));
  FSDP_RETURN_IF_ERROR(ValidateModel(c.model, v));
  FSDP_RETURN_IF_ERROR(ValidateData(c.data, v));
  FSDP_RETURN_IF_ERROR(ValidateTraining(c.training, v));
  // Every evaluation was NaN (no held-out windows), and the run exited 0.
  FSDP_RETURN_IF_ERROR(v.Check(
      c.training.eval_interval == 0 || c.data.val_fraction > 0, "training.eval_interval",
      StrCat(c.training.eval_interval,
             " evaluates on the held-out part of the data, but data.val_fraction is 0 (nothing "
             "held out); set data.val_fraction (e.g. 0.05), or training.eval_interval: 0"),
      {"data.val_fraction"}));
  FSDP_RETURN_IF_ERROR(ValidateOptimizer(c.optimizer, c.lr_scheduler, v));
  FSDP_RETURN_IF_ERROR(ValidateParallelism(c.parallelism, v));
  FSDP_RETURN_IF_ERROR(v.Check(c.metrics.cpu_peak_flops >= 0, "metrics.cpu_peak_flops",
                               StrCat("must be > 0 (FLOP/s per rank), or 0 for unset (no MFU on "
                                      "CPU), got ", c.metrics.cpu_peak_flops)));
  FSDP_RETURN_IF_ERROR(v.Check(
      !(c.parallelism.Unwrapped() && c.checkpoint.enabled), "checkpoint.enabled",
      "must be false with parallelism.strategy none (the unwrapped baseline saves no checkpoints); "
      "use full_shard or no_shard to checkpoint a one-rank run",
      {"parallelism.strategy"}));
  FSDP_RETURN_IF_ERROR(v.Check(
      !(c.parallelism.Unwrapped() && c.training.activation_checkpointing.enabled()),
      "training.activation_checkpointing",
      "must be none with parallelism.strategy none (checkpointing runs at the FSDP units' "
      "seam); use full_shard or no_shard on one rank",
      {"parallelism.strategy"}));
  FSDP_RETURN_IF_ERROR(v.Check(
      !(c.parallelism.Unwrapped() && c.parallelism.offload != Offload::kNone),
      "parallelism.offload",
      "must be none with parallelism.strategy none (offload moves FSDP shards); use full_shard "
      "or no_shard on one rank",
      {"parallelism.strategy"}));
  FSDP_RETURN_IF_ERROR(v.Check(
      !c.parallelism.offload_delayed_update.enabled || c.parallelism.offload != Offload::kNone,
      "parallelism.offload_delayed_update",
      "needs parallelism.offload: optimizer or params (it delays the host's update); set it "
      "off, or offload",
      {"parallelism.offload"}));
  FSDP_RETURN_IF_ERROR(v.AtLeast<int64_t>("checkpoint.interval", c.checkpoint.interval, 0));
  return v.AtLeast<int64_t>("checkpoint.keep_latest_k", c.checkpoint.keep_latest_k, 1);
}

// Shortest round-trip text, with a '.' so that every YAML reader types it as a float
// (1 -> 1.0, 1e-05 -> 1.0e-05).
std::string FormatDouble(double value) {
  std::string text = fmt::format("{}", value);
  if (text.find('.') == std::string::npos) {
    size_t exponent = text.find('e');
    text.insert(exponent == std::string::npos ? text.size() : exponent, ".0");
  }
  return text;
}

std::string YamlScalar(const FieldRef& ref) {
  if (auto* i = std::get_if<int64_t*>(&ref)) return StrCat(**i);
  if (auto* d = std::get_if<double*>(&ref)) return FormatDouble(**d);
  if (auto* b = std::get_if<bool*>(&ref)) return **b ? "true" : "false";
  YAML::Emitter out;
  if (auto* choice = std::get_if<ChoiceField>(&ref)) {
    out << choice->print();
    return out.c_str();
  }
  if (auto* list = std::get_if<StringList*>(&ref)) {
    out << YAML::Flow << **list;  // ["tok_embeddings.*", "layers.0.*"], or []
    return out.c_str();
  }
  out << *std::get<std::string*>(ref);
  return out.c_str();
}

int ClampToInt(int64_t value) {
  return static_cast<int>(std::clamp<int64_t>(value, INT_MIN, INT_MAX));
}

}  // namespace

// Either degree may be -1 (not both): it is inferred so that replicate x shard = world size.
// DDP (no_shard) configs thus say shard 1, replicate -1, and fit any world size; FSDP configs
// say replicate 1, shard -1.
absl::Status RunConfig::ValidateForWorld(int world_size) const {
  const ParallelismSection& p = parallelism;
  if (p.Unwrapped()) {
    if (world_size == 1) return absl::OkStatus();
    return absl::InvalidArgumentError(
        StrCat("parallelism.strategy none trains the plain model on one rank, not ", world_size,
               "; use --nproc 1, or a sharding strategy (full_shard, no_shard, ...) for ",
               world_size, " ranks"));
  }
  const std::optional<Strategy>& strategy = p.strategy;
  std::string degrees =
      StrCat("parallelism.data_parallel_replicate_degree=", p.data_parallel_replicate_degree,
             ", parallelism.data_parallel_shard_degree=", p.data_parallel_shard_degree);
  absl::StatusOr<MeshShape> mesh = ResolveMeshShape(
      {"replicate", "shard"},
      {ClampToInt(p.data_parallel_replicate_degree), ClampToInt(p.data_parallel_shard_degree)},
      world_size);
  if (!mesh.ok()) {
    return absl::InvalidArgumentError(StrCat(degrees, ": ", std::string(mesh.status().message())));
  }
  int replicate = mesh->degrees[0];
  int shard = mesh->degrees[1];
  auto inferred = [&](int64_t given, int resolved) {
    return given == -1 ? StrCat(resolved, " (inferred from world size ", world_size, ")")
                       : StrCat(resolved);
  };
  const std::string name = StrategyName(*strategy);
  switch (*strategy) {
    case Strategy::kFullShard:
    case Strategy::kShardGradOp:
      if (replicate != 1) {
        return absl::InvalidArgumentError(
            StrCat("parallelism.data_parallel_replicate_degree=",
                   inferred(p.data_parallel_replicate_degree, replicate),
                   " does not fit strategy '", name, "' (it shards over all ranks); use ",
                   *strategy == Strategy::kFullShard ? "hybrid_shard" : "hybrid_shard_zero2",
                   ", or set the replicate degree to 1"));
      }
      break;
    case Strategy::kNoShard:
      if (shard != 1) {
        return absl::InvalidArgumentError(
            StrCat("parallelism.data_parallel_shard_degree=",
                   inferred(p.data_parallel_shard_degree, shard), " does not fit strategy '", name,
                   "' (it replicates over all ranks, like DDP); use hybrid_shard, or set the shard "
                   "degree to 1 and the replicate degree to -1"));
      }
      break;
    case Strategy::kHybridShard:
    case Strategy::kHybridShardZero2:
      if (replicate < 2) {
        return absl::InvalidArgumentError(StrCat(
            "parallelism.data_parallel_replicate_degree=",
            inferred(p.data_parallel_replicate_degree, replicate), " does not fit strategy '", name,
            "' (it replicates over groups of shards); set the replicate degree to 2 or "
            "more, or use ",
            *strategy == Strategy::kHybridShard ? "full_shard" : "shard_grad_op"));
      }
      break;
  }
  const ReshardPolicy& reshard = p.reshard_after_forward;
  if (reshard.kind == ReshardPolicy::Kind::kGroup &&
      (reshard.group_size >= shard || shard % reshard.group_size != 0)) {
    return absl::InvalidArgumentError(
        StrCat("parallelism.reshard_after_forward=", reshard.group_size,
               " must divide the shard degree and be smaller than it, "
               "parallelism.data_parallel_shard_degree=",
               inferred(p.data_parallel_shard_degree, shard),
               " (true or false to reshard to the whole shard axis or not at all)"));
  }
  return absl::OkStatus();
}

std::string RunConfig::ToYaml() const {
  RunConfig copy = *this;
  std::string out = StrCat("# Resolved run configuration",
                           source_file.empty() ? "" : StrCat(" (from ", source_file, ")"), "\n");
  for (const Section& section : Sections(copy)) {
    out += StrCat("\n", section.name, ":\n");
    for (const Field& field : section.fields) {
      out += StrCat("  ", field.name, ": ", YamlScalar(field.ref), "\n");
    }
  }
  return out;
}

std::string RunConfig::Value(std::string_view key) const {
  RunConfig copy = *this;
  for (const Section& section : Sections(copy)) {
    for (const Field& field : section.fields) {
      if (StrCat(section.name, ".", field.name) != key) continue;
      if (auto* choice = std::get_if<ChoiceField>(&field.ref)) return choice->print();
      if (auto* text = std::get_if<std::string*>(&field.ref)) return **text;
      return YamlScalar(field.ref);
    }
  }
  return "";
}

absl::StatusOr<RunConfig> ParseRunConfig(const std::string& yaml_text, const std::string& name,
                                         const std::vector<std::string>& overrides) {
  RunConfig config;
  config.source_file = name;
  Locations where;
  Parser parser(name, config);
  FSDP_RETURN_IF_ERROR(parser.ParseDocument(yaml_text, where));
  for (const std::string& item : overrides) {
    FSDP_RETURN_IF_ERROR(parser.ApplyOverride(item, where));
  }
  if (IsHfCheckpointDir(config.model.init_from)) {  // the shape comes from its config.json
    FSDP_RETURN_IF_ERROR(ApplyHfLlamaConfig(
        config.model.init_from,
        [&](const std::string& key) {
          auto it = where.find(key);
          return it == where.end() ? std::string() : it->second;
        },
        config.model));
  }
  FSDP_RETURN_IF_ERROR(Validate(config, where));
  config.locations = std::move(where);
  return config;
}

std::string RunConfig::Where(std::string_view key) const {
  if (auto it = locations.find(key); it != locations.end()) return it->second;
  return source_file;
}

namespace {

// What a path that is not a regular file is, for the message.
const char* FileKind(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO (named pipe)";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "a special file";
}

}  // namespace

absl::StatusOr<RunConfig> LoadRunConfig(const std::string& path,
                                        const std::vector<std::string>& overrides) {
  // Only a regular file is read: a FIFO would block the command until someone writes to it,
  // /dev/zero would never end. stat() first for the message; the open does not wait for a
  // FIFO's writer (O_NONBLOCK) and fstat() checks again what was opened.
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) {
    if (errno == ENOENT || errno == ENOTDIR) {
      return absl::NotFoundError(StrCat(path, ": no such config file"));
    }
    return absl::InvalidArgumentError(StrCat(path, ": cannot read: ", std::strerror(errno)));
  }
  auto not_regular = [&](mode_t mode) {
    return absl::InvalidArgumentError(StrCat(path, ": is ", FileKind(mode), ", not a YAML file"));
  };
  if (!S_ISREG(st.st_mode)) return not_regular(st.st_mode);
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    return absl::InvalidArgumentError(
        StrCat(path, ": cannot open the file: ", std::strerror(errno)));
  }
  struct CloseFd {
    int fd;
    ~CloseFd() { ::close(fd); }
  } close_fd{fd};
  if (::fstat(fd, &st) != 0) {
    return absl::InvalidArgumentError(StrCat(path, ": cannot read: ", std::strerror(errno)));
  }
  if (!S_ISREG(st.st_mode)) return not_regular(st.st_mode);
  std::string text;
  char buffer[1 << 16];
  while (true) {
    const ssize_t n = ::read(fd, buffer, sizeof(buffer));
    if (n == 0) break;
    if (n < 0) {
      if (errno == EINTR) continue;
      return absl::InvalidArgumentError(StrCat(path, ": cannot read: ", std::strerror(errno)));
    }
    text.append(buffer, static_cast<size_t>(n));
  }
  return ParseRunConfig(text, path, overrides);
}

std::pair<int, int> ParallelismSection::MeshDegrees(int world_size) const {
  int replicate = static_cast<int>(data_parallel_replicate_degree);
  int shard = static_cast<int>(data_parallel_shard_degree);
  if (replicate == -1) replicate = world_size / shard;
  if (shard == -1) shard = world_size / replicate;
  return {replicate, shard};
}

c10::ScalarType ScalarTypeOf(Precision precision) {
  return precision == Precision::kBf16 ? c10::kBFloat16 : c10::kFloat;
}
int BytesOf(Precision precision) { return precision == Precision::kBf16 ? 2 : 4; }
const char* PrecisionName(Precision precision) { return NameIn(Precisions(), precision); }
const char* DeviceKindName(DeviceKind device) { return NameIn(DeviceKinds(), device); }
const char* CudaBackendName(CudaBackend backend) { return NameIn(CudaBackends(), backend); }
const char* CpuCollectivesName(CpuCollectives collectives) {
  return NameIn(CpuCollectivesNames(), collectives);
}
const char* StrategyLabel(const std::optional<Strategy>& strategy) {
  return strategy ? StrategyName(*strategy) : "none";
}

namespace {

// A 0/1 debugging knob: nullopt when unset.
absl::StatusOr<std::optional<bool>> BinaryKnob(const EnvKnob& knob) {
  std::optional<std::string> value = GetEnvKnob(knob);
  if (!value) return std::optional<bool>();
  if (*value != "0" && *value != "1") {
    return absl::InvalidArgumentError(
        StrCat(knob.name, "=", *value, " is not valid; valid: ", knob.valid));
  }
  return std::optional<bool>(*value == "1");
}

}  // namespace

absl::StatusOr<ShardingPlan> ShardingPlanFor(const RunConfig& config, Strategy strategy,
                                             int shard_degree) {
  ShardingPlan plan;
  FsdpOptions& options = plan.options;
  options = OptionsForStrategy(strategy);
  const bool strategy_reshards = options.reshard_after_forward;
  const ReshardPolicy& reshard = config.parallelism.reshard_after_forward;
  switch (reshard.kind) {
    case ReshardPolicy::Kind::kDefault:
      break;
    case ReshardPolicy::Kind::kAlways:
      options.reshard_after_forward = true;
      break;
    case ReshardPolicy::Kind::kNever:
      options.reshard_after_forward = false;
      break;
    case ReshardPolicy::Kind::kGroup:
      if (reshard.group_size >= shard_degree || shard_degree % reshard.group_size != 0) {
        return absl::InvalidArgumentError(StrCat(
            "parallelism.reshard_after_forward=", reshard.group_size,
            " must divide the shard degree and be smaller than it, got shard degree ",
            shard_degree));
      }
      options.reshard_after_forward = true;
      options.reshard_group_size = reshard.group_size;
      break;
  }
  options.max_unsharded_units = static_cast<int>(config.parallelism.max_unsharded_units);
  options.activation_checkpointing = config.training.activation_checkpointing;
  options.offload = config.parallelism.offload;
  options.offload_delayed_update = config.parallelism.offload_delayed_update.enabled;
  FSDP_ASSIGN_OR_RETURN(std::optional<bool> overlap, BinaryKnob(kOffloadOverlapStep));
  options.offload_overlap_step = overlap.value_or(true);
  FSDP_ASSIGN_OR_RETURN(std::optional<bool> copy, BinaryKnob(kOffloadComputeCopy));
  options.offload_compute_copy =
      !copy ? ComputeCopy::kAuto : *copy ? ComputeCopy::kKeep : ComputeCopy::kDrop;
  if (options.offload_delayed_update && (!options.offload_overlap_step || copy == false)) {
    return absl::InvalidArgumentError(StrCat(
        "parallelism.offload_delayed_update cannot go with ",
        !options.offload_overlap_step
            ? StrCat(kOffloadOverlapStep.name, "=0 (the delayed update is an overlapped step)")
            : StrCat(kOffloadComputeCopy.name,
                     "=0 (the next step loads the copies while the delayed update writes the "
                     "masters)"),
        "; unset the variable or set the key off"));
  }
  options.reshard_between_micro_batches = config.parallelism.reshard_between_micro_batches;
  const TrainingSection& t = config.training;
  if (t.mixed_precision == Precision::kBf16) {
    options.mixed_precision.param_dtype = c10::kBFloat16;
    options.mixed_precision.output_dtype = c10::kFloat;
  }
  options.mixed_precision.reduce_dtype = ScalarTypeOf(t.reduce_dtype);

  // What runs, named by the strategy that means it: an override that flips resharding turns
  // full_shard into shard_grad_op (and back), hybrid_shard into hybrid_shard_zero2.
  plan.effective = StrategyName(strategy);
  const bool ddp = strategy == Strategy::kNoShard;
  if (!ddp && options.reshard_after_forward != strategy_reshards) {
    const bool hybrid = strategy == Strategy::kHybridShard || strategy == Strategy::kHybridShardZero2;
    Strategy ran = options.reshard_after_forward
                       ? (hybrid ? Strategy::kHybridShard : Strategy::kFullShard)
                       : (hybrid ? Strategy::kHybridShardZero2 : Strategy::kShardGradOp);
    plan.effective = StrCat(StrategyName(ran), " (", StrategyName(strategy),
                            " with parallelism.reshard_after_forward: ",
                            options.reshard_after_forward ? "true" : "false", ")");
  }
  if (!ddp && options.reshard_group_size > 0) {
    plan.effective += StrCat(", resharded to groups of ", options.reshard_group_size,
                             " after forward");
  }
  if (!options.reshard_between_micro_batches) {
    plan.effective += ", unsharded parameters kept through the step";
  }
  return plan;
}

}  // namespace fsdp
