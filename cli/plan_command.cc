#include "cli/plan_command.h"

#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>

#include <nlohmann/json.hpp>

#include "common/strings.h"
#include "planner/cost_model.h"

namespace fsdp {
namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

std::string SelfExe() {
  char buffer[PATH_MAX];
  ssize_t n = readlink("/proc/self/exe", buffer, sizeof(buffer) - 1);
  return n > 0 ? std::string(buffer, static_cast<size_t>(n)) : std::string("fsdp");
}

nlohmann::ordered_json ToJson(const plan::Prediction& p) {
  const plan::MemoryBreakdown& m = p.memory;
  const plan::TimeBreakdown& t = p.time;
  nlohmann::ordered_json j;
  j["strategy"] = StrategyName(p.layout.strategy);
  j["runs_as"] = p.runs_as;
  j["replicate"] = p.layout.replicate;
  j["shard"] = p.layout.shard;
  j["activation_checkpointing"] = plan::CheckpointingName(p.activation_checkpointing);
  j["offload"] = OffloadName(p.offload);
  j["fits"] = p.fits;
  j["memory_bytes"] = {{"params", m.params},
                       {"grads", m.grads},
                       {"optimizer", m.optimizer},
                       {"unsharded_units", m.unsharded_units},
                       {"activations", m.activations},
                       {"padding", m.padding},
                       {"partial_grads", m.partial_grads},
                       {"total", m.total},
                       {"host", m.host},
                       {"checkpoint_staging", m.checkpoint_staging}};
  j["time_s"] = {{"compute", t.compute_s},           {"recompute", t.recompute_s},
                 {"all_gather", t.all_gather_s},     {"reduce_scatter", t.reduce_scatter_s},
                 {"all_reduce", t.all_reduce_s},     {"comm", t.comm_s},
                 {"exposed_comm", t.exposed_comm_s}, {"host_copy", t.host_copy_s},
                 {"exposed_copy", t.exposed_copy_s}, {"optimizer", t.optimizer_s},
                 {"step", t.step_s}};
  j["tokens_per_s"] = t.tokens_per_s;
  j["mfu"] = t.mfu;
  j["note"] = p.note;
  return j;
}

// Whether `path` can be written, before any work is done (without creating it): an error naming
// `flag` otherwise.
absl::Status CheckWritable(const std::string& flag, const std::string& path) {
  namespace fs = std::filesystem;
  if (path.empty()) return absl::InvalidArgumentError(StrCat(flag, ": an empty file name"));
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    return absl::InvalidArgumentError(StrCat(flag, " ", path, ": is a folder, not a file"));
  }
  if (fs::exists(path, ec)) {
    if (access(path.c_str(), W_OK) != 0) {
      return absl::InvalidArgumentError(
          StrCat(flag, " ", path, ": cannot write the file (", std::strerror(errno), ")"));
    }
    return absl::OkStatus();
  }
  fs::path folder = fs::path(path).parent_path();
  if (folder.empty()) folder = ".";
  if (!fs::is_directory(folder, ec)) {
    return absl::InvalidArgumentError(
        StrCat(flag, " ", path, ": the folder ", folder.string(), " does not exist"));
  }
  if (access(folder.c_str(), W_OK | X_OK) != 0) {
    return absl::InvalidArgumentError(StrCat(flag, " ", path, ": cannot create files in ",
                                             folder.string(), " (", std::strerror(errno), ")"));
  }
  return absl::OkStatus();
}

// Options that the other mode would use, and output files, checked before any work.
absl::Status CheckOptions(const PlanCommand& command) {
  if (command.calibrate && command.calibrate_host) {
    return absl::InvalidArgumentError(
        "--calibrate (a CPU profile) and --calibrate-host (a GPU profile with this host's "
        "figures) are one or the other");
  }
  if (command.calibrate || command.calibrate_host) {
    const std::string flag = command.calibrate ? "--calibrate" : "--calibrate-host";
    std::vector<std::string> given;
    if (!command.config_path.empty()) given.push_back("CONFIG");
    if (!command.overrides.empty()) given.push_back("--set");
    if (command.world_size != 0) given.push_back("--world-size");
    if (command.gpus_per_node) given.push_back("--gpus-per-node");
    // --calibrate-host starts from the profile that --gpu or --hardware names.
    if (command.calibrate && !command.hardware_file.empty()) given.push_back("--hardware");
    if (command.top != 0) given.push_back("--top");
    if (command.json_out) given.push_back("--json (use --out)");
    if (!given.empty()) {
      return absl::InvalidArgumentError(
          StrCat(flag, " measures this machine and takes no ", StrJoin(given, ", ")));
    }
    if (command.calibrate_out) return CheckWritable("--out", *command.calibrate_out);
    return absl::OkStatus();
  }
  if (command.calibrate_out) {
    return absl::InvalidArgumentError(
        "--out is the output of --calibrate or --calibrate-host; a plan is written with --json "
        "FILE");
  }
  if (command.gpus_per_node && *command.gpus_per_node < 1) {
    return absl::InvalidArgumentError(
        StrCat("--gpus-per-node must be >= 1, got ", *command.gpus_per_node,
               " (leave it out for the default: the world size up to 8, else 8)"));
  }
  if (command.json_out) return CheckWritable("--json", *command.json_out);
  return absl::OkStatus();
}

// What `fsdp bench host` times for --calibrate-host: 64M elements per pass (1.8 GiB of host
// memory), well beyond any cache.
constexpr double kCalibrateHostElements = 64e6;

int Calibrate(const PlanCommand& command) {
  const std::string flag = command.calibrate ? "--calibrate" : "--calibrate-host";
  std::string log;
  absl::StatusOr<plan::Hardware> hw;
  if (command.calibrate) {
    hw = plan::CalibrateCpu(SelfExe(), &log);
  } else {
    absl::StatusOr<plan::Hardware> base = command.hardware_file.empty()
                                              ? plan::HardwareByName(command.gpu)
                                              : plan::LoadHardwareJson(command.hardware_file);
    if (!base.ok()) {
      std::cerr << "fsdp plan: " << base.status().message() << "\n";
      return 2;
    }
    hw = plan::CalibrateHost(SelfExe(), *std::move(base), kCalibrateHostElements, &log);
  }
  std::cout << log;
  if (!hw.ok()) {
    std::cerr << "fsdp plan " << flag << ": " << hw.status().message() << "\n";
    return 1;
  }
  std::string json = plan::HardwareToJson(*hw);
  std::cout << json << "\n";
  if (command.calibrate_out) {
    std::ofstream out(*command.calibrate_out);
    out << json << "\n";
    if (!out) {
      std::cerr << "fsdp plan " << flag << ": --out " << *command.calibrate_out
                << ": cannot write\n";
      return 1;
    }
    std::cout << "wrote " << *command.calibrate_out << " (use it with --hardware)\n";
  }
  return 0;
}

}  // namespace

int RunPlanCommand(const PlanCommand& command) {
  if (absl::Status options = CheckOptions(command); !options.ok()) {
    std::cerr << "fsdp plan: " << options.message() << "\n";
    return 2;
  }
  if (command.calibrate || command.calibrate_host) return Calibrate(command);
  if (command.config_path.empty()) {
    std::cerr << "fsdp plan: CONFIG.yaml is required (or --calibrate)\n";
    return 2;
  }
  absl::StatusOr<plan::PlanRequest> request =
      plan::MakePlanRequest(command.config_path, command.overrides, command.world_size,
                            command.gpus_per_node.value_or(0), command.gpu, command.hardware_file);
  if (!request.ok()) {
    std::cerr << "fsdp plan: " << request.status().message() << "\n";
    return 2;
  }
  absl::StatusOr<plan::Recommendation> rec = plan::Recommend(*request);
  if (!rec.ok()) {
    std::cerr << "fsdp plan: " << rec.status().message() << "\n";
    return 2;
  }
  const plan::PlanRequest& r = *request;
  const plan::ModelCounts counts = plan::CountModel(r.config.model);
  const TrainingSection& t = r.config.training;
  const int64_t tokens_per_step =
      static_cast<int64_t>(r.world_size) * t.micro_batch_size * t.grad_accum_steps * r.config.model.seq_len;
  const double usable = r.hw.memory_bytes * r.hw.usable_memory_fraction /
                        (r.hw.cores_per_node > 0 ? r.gpus_per_node : 1);
  const int64_t nodes = r.world_size / r.gpus_per_node;
  std::cout << fmt::format(
      "fsdp plan: {} ({} {}, {:.3g} parameters, {:.3g} FLOPs/token), {} x {} ranks ({} node{}), "
      "{} {}, micro-batch {} x {} tokens, accumulation {}, {} tokens/step\n",
      command.config_path, r.config.model.arch, r.config.run.name,
      static_cast<double>(counts.params), counts.flops_per_token, nodes, r.gpus_per_node, nodes,
      nodes == 1 ? "" : "s", r.hw.name, PrecisionName(t.mixed_precision),
      t.micro_batch_size, r.config.model.seq_len, t.grad_accum_steps, tokens_per_step);
  std::cout << fmt::format(
      "hardware: {}: {:.3g} FLOP/s ({}), efficiency {:.2f}, {:.1f} GiB usable per rank, "
      "intra-node {:.3g} GB/s, inter-node {:.3g} GB/s per GPU, host {:.0f} GiB per node, "
      "host link {:.3g} GB/s{}{}\n",
      r.hw.name, plan::PeakRate(r.hw, t.mixed_precision), PrecisionName(t.mixed_precision),
      r.hw.compute_efficiency, usable / kGiB, r.hw.intra_node_bw / 1e9, r.hw.inter_node_bw / 1e9,
      r.hw.host_memory_bytes / kGiB, r.hw.host_link_bw / 1e9,
      r.hw.host_rank_bw > 0
          ? fmt::format(", host AdamW {:.3g} GB/s per rank", r.hw.host_rank_bw / 1e9)
          : "",
      r.hw.host_loop_cost > 0 || r.hw.host_add_loop_cost > 0
          ? fmt::format(" (its loop x{:.2f}, the addition's x{:.2f})",
                        plan::HostLoopCost(r.hw), plan::HostAddLoopCost(r.hw))
          : "");
  std::cout << fmt::format("configured: activation_checkpointing {}, offload {}\n\n",
                           plan::CheckpointingName(t.activation_checkpointing),
                           OffloadName(r.config.parallelism.offload));
  std::cout << fmt::format(
      "{:<19} {:>9} | {:>7} {:>7} {:>7} {:>7} {:>7} {:>6} {:>8} {:>7} {:>4} | {:>9} {:>9} "
      "{:>9} {:>9} {:>9} {:>10} {:>6}  {}\n",
      "strategy", "mesh RxS", "params", "grads", "optim", "unshard", "activ", "pad",
      "total GiB", "host", "fits", "step ms", "compute", "comm", "exposed", "copy exp",
      "tok/s/GPU", "MFU", "note");
  size_t shown = 0;
  for (const plan::Prediction& p : rec->configured) {
    if (command.top > 0 && shown++ >= static_cast<size_t>(command.top)) break;
    const plan::MemoryBreakdown& m = p.memory;
    const plan::TimeBreakdown& tm = p.time;
    std::cout << fmt::format(
        "{:<19} {:>9} | {:>7.2f} {:>7.2f} {:>7.2f} {:>7.2f} {:>7.2f} {:>6.3f} {:>8.2f} {:>7.2f} "
        "{:>4} | {:>9.1f} {:>9.1f} {:>9.1f} {:>9.1f} {:>9.1f} {:>10.0f} {:>5.1f}%  {}\n",
        StrategyName(p.layout.strategy), StrCat(p.layout.replicate, "x", p.layout.shard), m.params / kGiB,
        m.grads / kGiB, m.optimizer / kGiB, m.unsharded_units / kGiB, m.activations / kGiB,
        m.padding / kGiB, m.total / kGiB, m.host / kGiB, p.fits ? "yes" : "NO", tm.step_s * 1e3,
        tm.compute_s * 1e3, tm.comm_s * 1e3, tm.exposed_comm_s * 1e3, tm.exposed_copy_s * 1e3,
        tm.tokens_per_s / r.world_size, 100 * tm.mfu, p.note);
  }
  const plan::Prediction& anchor = rec->alternatives.front();
  std::cout << fmt::format(
      "\nactivation checkpointing x offload on {} {}x{}:\n{:<10} {:<9} | {:>7} {:>8} {:>7} {:>4} | "
      "{:>9} {:>9} {:>9} {:>9} {:>10} {:>6}\n",
      anchor.runs_as, anchor.layout.replicate, anchor.layout.shard, "ckpt", "offload", "activ",
      "total GiB", "host", "fits", "step ms", "recompute", "copy exp", "optimizer", "tok/s/GPU",
      "MFU");
  for (const plan::Prediction& p : rec->alternatives) {
    std::cout << fmt::format(
        "{:<10} {:<9} | {:>7.2f} {:>8.2f} {:>7.2f} {:>4} | {:>9.1f} {:>9.1f} {:>9.1f} {:>9.1f} "
        "{:>10.0f} {:>5.1f}%\n",
        plan::CheckpointingName(p.activation_checkpointing), OffloadName(p.offload),
        p.memory.activations / kGiB, p.memory.total / kGiB, p.memory.host / kGiB,
        p.fits ? "yes" : "NO", p.time.step_s * 1e3, p.time.recompute_s * 1e3,
        p.time.exposed_copy_s * 1e3, p.time.optimizer_s * 1e3, p.time.tokens_per_s / r.world_size,
        100 * p.time.mfu);
  }
  std::cout << "\n(memory: GiB per rank at the step's peak. total = params + pad + optim + the "
               "larger of the backward's peak (unshard + activ + the gradient shards alive then, "
               "all of them when accumulating without offload, + HSDP's partial gradient sums) "
               "and its end (grads + one unit's reduce buffer): at most params + grads + optim + "
               "unshard + activ + pad + partial sums. host: host memory per rank with "
               "offload. See docs/cost_model.md)\n";
  // HSDP accumulating micro-batches: the partial sums are in total but in no column.
  std::map<int, double> partial;  // by shard degree
  for (const plan::Prediction& p : rec->configured) {
    if (p.memory.partial_grads > 0) partial[p.layout.shard] = p.memory.partial_grads;
  }
  if (!partial.empty()) {
    std::vector<std::string> sizes;
    for (const auto& [shard, bytes] : partial) {
      sizes.push_back(fmt::format("{:.2f} GiB at shard degree {}", bytes / kGiB, shard));
    }
    std::cout << "partial gradient sums (hybrid layouts accumulating micro-batches; in total, in "
                 "no column; JSON memory_bytes.partial_grads): "
              << StrJoin(sizes, ", ") << "\n";
  }
  // The configuration's own AC and offload, on its best layout (the first listed).
  if (!rec->configured.empty() && rec->configured.front().memory.checkpoint_staging > 0) {
    const plan::Prediction& c = rec->configured.front();
    std::cout << fmt::format(
        "checkpoints: {:.2f} GiB of host memory per rank ({} {}x{}, offload {}) for the saves' "
        "staging, reserved at start-up: counted in `fits`, not in `host`{}\n",
        c.memory.checkpoint_staging / kGiB, c.runs_as, c.layout.replicate, c.layout.shard,
        OffloadName(c.offload),
        c.offload != Offload::kNone ? "; checkpoint.async: false writes the offloaded state in "
                                      "place and needs none"
                                    : "");
  }
  std::cout << rec->message << "\n";
  if (command.json_out) {
    nlohmann::ordered_json j;
    j["config"] = command.config_path;
    j["world_size"] = r.world_size;
    j["gpus_per_node"] = r.gpus_per_node;
    j["hardware"] = nlohmann::json::parse(plan::HardwareToJson(r.hw));
    j["params"] = counts.params;
    j["flops_per_token"] = counts.flops_per_token;
    j["configured"] = {
        {"activation_checkpointing", plan::CheckpointingName(t.activation_checkpointing)},
        {"offload", OffloadName(r.config.parallelism.offload)}};
    j["recommended"] = rec->best ? ToJson(*rec->best) : nlohmann::ordered_json();
    j["recommended_overrides"] = rec->overrides;
    j["message"] = rec->message;
    j["alternatives"] = nlohmann::ordered_json::array();
    for (const plan::Prediction& p : rec->alternatives) j["alternatives"].push_back(ToJson(p));
    j["layouts"] = nlohmann::ordered_json::array();
    for (const plan::Prediction& p : rec->configured) j["layouts"].push_back(ToJson(p));
    std::ofstream out(*command.json_out);
    out << j.dump(2) << "\n";
    if (!out) {
      std::cerr << "fsdp plan: --json " << *command.json_out << ": cannot write\n";
      return 2;
    }
  }
  return 0;
}

}  // namespace fsdp
