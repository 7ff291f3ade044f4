#include "cli/plan_command.h"

#include <unistd.h>

#include <climits>
#include <fstream>
#include <iostream>

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
  j["memory_bytes"] = {{"params", m.params},       {"grads", m.grads},
                       {"optimizer", m.optimizer}, {"unsharded_units", m.unsharded_units},
                       {"activations", m.activations}, {"padding", m.padding},
                       {"total", m.total},         {"host", m.host},
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

int Calibrate(const PlanCommand& command) {
  std::string log;
  absl::StatusOr<plan::Hardware> hw = plan::CalibrateCpu(SelfExe(), &log);
  std::cout << log;
  if (!hw.ok()) {
    std::cerr << "fsdp plan --calibrate: " << hw.status().message() << "\n";
    return 1;
  }
  std::string json = plan::HardwareToJson(*hw);
  std::cout << json << "\n";
  if (!command.calibrate_out.empty()) {
    std::ofstream out(command.calibrate_out);
    out << json << "\n";
    if (!out) {
      std::cerr << "fsdp plan --calibrate: --out " << command.calibrate_out << ": cannot write\n";
      return 1;
    }
    std::cout << "wrote " << command.calibrate_out << " (use it with --hardware)\n";
  }
  return 0;
}

}  // namespace

int RunPlanCommand(const PlanCommand& command) {
  if (command.calibrate) return Calibrate(command);
  if (command.config_path.empty()) {
    std::cerr << "fsdp plan: CONFIG.yaml is required (or --calibrate)\n";
    return 2;
  }
  absl::StatusOr<plan::PlanRequest> request =
      plan::MakePlanRequest(command.config_path, command.overrides, command.world_size,
                            command.gpus_per_node, command.gpu, command.hardware_file);
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
  std::cout << fmt::format(
      "fsdp plan: {} ({} {}, {:.3g} parameters, {:.3g} FLOPs/token), {} x {} ranks ({} nodes), "
      "{} {}, micro-batch {} x {} tokens, accumulation {}, {} tokens/step\n",
      command.config_path, r.config.model.arch, r.config.run.name,
      static_cast<double>(counts.params), counts.flops_per_token, r.world_size / r.gpus_per_node,
      r.gpus_per_node, r.world_size / r.gpus_per_node, r.hw.name, PrecisionName(t.mixed_precision),
      t.micro_batch_size, r.config.model.seq_len, t.grad_accum_steps, tokens_per_step);
  std::cout << fmt::format(
      "hardware: {}: {:.3g} FLOP/s ({}), efficiency {:.2f}, {:.1f} GiB usable per rank, "
      "intra-node {:.3g} GB/s, inter-node {:.3g} GB/s per GPU, host {:.0f} GiB per node, "
      "host link {:.3g} GB/s\n",
      r.hw.name, t.mixed_precision == Precision::kBf16 && r.hw.peak_flops_bf16 > 0 ? r.hw.peak_flops_bf16 : r.hw.peak_flops_fp32,
      PrecisionName(t.mixed_precision), r.hw.compute_efficiency, usable / kGiB, r.hw.intra_node_bw / 1e9,
      r.hw.inter_node_bw / 1e9, r.hw.host_memory_bytes / kGiB, r.hw.host_link_bw / 1e9);
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
  std::cout << "\n(memory: GiB per rank at the step's peak; host: pinned host memory per rank with "
               "offload; total can be less than the sum: see docs/cost_model.md)\n";
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
  if (!command.json_out.empty()) {
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
    std::ofstream out(command.json_out);
    out << j.dump(2) << "\n";
    if (!out) {
      std::cerr << "fsdp plan: --json " << command.json_out << ": cannot write\n";
      return 2;
    }
  }
  return 0;
}

}  // namespace fsdp
