// Hardware profiles for the cost model: the built-in data-sheet figures (sources in
// docs/cost_model.md), JSON profiles, and the calibration of this machine's CPU or host.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <sstream>
#include <thread>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <nlohmann/json.hpp>

#include "common/strings.h"
#include "planner/cost_model.h"

namespace fsdp::plan {
namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

std::vector<Hardware> BuiltIn() {
  Hardware h100;
  h100.name = "h100";
  h100.peak_flops_bf16 = 989.4e12;  // dense
  h100.peak_flops_fp32 = 494.7e12;  // TF32 dense
  h100.memory_bytes = 80 * kGiB;
  h100.memory_bw = 3.35e12;
  h100.intra_node_bw = 360e9;  // NVLink 4: 450 GB/s per direction; ~80% as all-gather busbw
  h100.intra_node_latency_s = 2e-6;
  h100.inter_node_bw = 42e9;  // 400 Gb/s InfiniBand NDR per GPU = 50 GB/s; ~85% achievable
  h100.inter_node_latency_s = 6e-6;
  h100.compute_efficiency = 0.5;
  // The host of a DGX H100 (docs/cost_model.md has the sources): 2 TiB of DDR5-4800 on two
  // Xeon 8480C, 16 channels = 614 GB/s peak, ~65% sustained; each GPU on PCIe Gen5 x16,
  // 63 GB/s per direction peak, ~50 GB/s measured alone; 8 x 40 GB/s = 320 GB/s fits in the
  // host's sustained bandwidth when all GPUs copy at once.
  h100.host_memory_bytes = 2048 * kGiB;
  h100.host_memory_bw = 400e9;
  h100.host_link_bw = 40e9;
  // One rank alone on such a host (a one-GPU machine with 16 cores, 2026-11-26, gpu_check's
  // offload runs of llama_1b): ATen's fused CPU AdamW stepped 0.953e9 parameters in 197 ms
  // (32 bytes each as counted here: 155 GB/s), and 207 ms without the bf16 refresh (147 GB/s).
  h100.host_rank_bw = 150e9;
  h100.source = "NVIDIA H100 SXM5 data sheet; NVLink 4, 8 GPUs per node, 1 NDR NIC per GPU; "
                "DGX H100 host (2 TiB, PCIe Gen5)";
  Hardware h200 = h100;
  h200.name = "h200";
  h200.memory_bytes = 141 * kGiB;
  h200.memory_bw = 4.8e12;
  h200.source = "NVIDIA H200 SXM data sheet (H100 compute, 141 GB HBM3e); DGX H200 host";
  Hardware a100 = h100;
  a100.name = "a100-80gb";
  a100.peak_flops_bf16 = 312e12;
  a100.peak_flops_fp32 = 156e12;
  a100.memory_bytes = 80 * kGiB;
  a100.memory_bw = 2.039e12;
  a100.intra_node_bw = 230e9;  // NVLink 3: 600 GB/s total, 300 per direction
  a100.intra_node_latency_s = 3e-6;
  a100.inter_node_bw = 22e9;  // 200 Gb/s InfiniBand HDR per GPU = 25 GB/s
  a100.inter_node_latency_s = 7e-6;
  // DGX A100 (640 GB): 2 TiB of DDR4-3200 on two EPYC 7742, 16 channels = 410 GB/s peak,
  // ~65% sustained; PCIe Gen4 x16, 31.5 GB/s per direction peak, ~25 GB/s measured alone.
  a100.host_memory_bytes = 2048 * kGiB;
  a100.host_memory_bw = 260e9;
  a100.host_link_bw = 20e9;
  a100.source = "NVIDIA A100 SXM4 data sheet; NVLink 3, 8 GPUs per node, 1 HDR NIC per GPU; "
                "DGX A100 host (2 TiB, PCIe Gen4)";
  Hardware a100_40 = a100;
  a100_40.name = "a100-40gb";
  a100_40.memory_bytes = 40 * kGiB;
  a100_40.memory_bw = 1.555e12;
  a100_40.host_memory_bytes = 1024 * kGiB;  // DGX A100 320 GB: 1 TiB
  // This machine (2 cores), from `fsdp plan --calibrate` and the validation runs in
  // docs/cost_model.md; node-wide figures shared by the ranks on it.
  Hardware cpu;
  cpu.name = "cpu";
  cpu.peak_flops_fp32 = 1.9e11;  // 2 x the 1-thread fp32 GEMM (512^3), 9.5e10 FLOP/s
  cpu.peak_flops_bf16 = 0;        // bf16 on CPU: no faster than fp32 here
  cpu.memory_bytes = 23.5 * kGiB;
  cpu.memory_bw = 1.68e10;        // 64 MiB copy, read + write
  cpu.intra_node_bw = 0.39e9;     // Gloo loopback all-gather busbw, 2 ranks, 64 MiB
  cpu.intra_node_latency_s = 131e-6;  // the same at 4 KiB
  cpu.inter_node_bw = 0.1e9;
  cpu.inter_node_latency_s = 200e-6;
  // Fitted on the two 1-rank runs of docs/cost_model.md (geometric mean of the 0.71 and 0.89
  // they imply, measured 2026-11-28 with the optimizer's passes counted at host_memory_bw); the
  // others validate.
  cpu.compute_efficiency = 0.80;
  cpu.comm_overlap = 0;
  cpu.usable_memory_fraction = 0.8;
  cpu.cores_per_node = 2;
  // No device: "host" buffers are the same memory, a copy reads and writes it. The optimizer's
  // passes (the step, with offload or without) run at ATen's fused AdamW's rate over the node:
  // 32.4-42.2 GB/s in five `fsdp plan --calibrate` runs on 2026-11-28 (16M elements, 2 threads),
  // the median here; the copy measured 22.3-31.9 GB/s beside it.
  cpu.host_memory_bytes = cpu.memory_bytes;
  cpu.host_memory_bw = 3.39e10;
  cpu.host_link_bw = cpu.memory_bw / 2;
  cpu.source = "calibrated on the development machine (fsdp plan --calibrate)";
  return {h100, h200, a100, a100_40, cpu};
}

// The first all_gather row of `fsdp doctor` with the largest buffer: (bytes, time_us, busbw).
struct DoctorRow {
  double time_us = 0, busbw_gbs = 0;
  std::string bytes;
};

std::vector<DoctorRow> ParseDoctor(const std::string& output, const std::string& collective) {
  std::vector<DoctorRow> rows;
  std::istringstream in(output);
  std::string line;
  while (std::getline(in, line)) {
    size_t at = line.find(collective);
    if (at == std::string::npos) continue;
    std::istringstream fields(line.substr(at));
    std::string name, axis, ranks, busbw;
    DoctorRow row;
    double algbw = 0;
    if (fields >> name >> axis >> ranks >> row.bytes >> row.time_us >> algbw >> busbw &&
        name == collective) {
      row.busbw_gbs = std::atof(busbw.c_str());
      rows.push_back(row);
    }
  }
  return rows;
}

std::string RunChild(const std::string& command, int* rc) {
  std::string output;
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) {
    *rc = -1;
    return output;
  }
  char buffer[4096];
  size_t got;
  while ((got = fread(buffer, 1, sizeof(buffer), pipe)) > 0) output.append(buffer, got);
  *rc = pclose(pipe);
  return output;
}

// The median rate of `pass`, `work` (FLOPs or bytes) each, over `passes` runs after two
// warm-up runs.
double MedianRate(int passes, double work, const std::function<void()>& pass) {
  std::vector<double> rates;
  for (int i = 0; i < passes + 2; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    pass();
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (i >= 2) rates.push_back(work / s);
  }
  std::sort(rates.begin(), rates.end());
  return rates[rates.size() / 2];
}

// Median FLOP/s of an fp32 [n x n] x [n x n] GEMM on `threads` intra-op threads.
double TimeGemm(int threads, int64_t n) {
  at::set_num_threads(threads);
  at::Tensor a = at::randn({n, n}), b = at::randn({n, n});
  return MedianRate(10, 2.0 * n * n * n, [&] { at::mm(a, b); });
}

// Copy bandwidth (read + write bytes per second) of a 64 MiB fp32 tensor.
double TimeCopy(int threads) {
  at::set_num_threads(threads);
  at::Tensor a = at::randn({16 << 20}), b = at::empty_like(a);
  return MedianRate(6, 2.0 * a.nbytes(), [&] { b.copy_(a); });
}

// ATen's fused AdamW over 16M-element fp32 tensors, in bytes it moves per second (28 per element:
// parameter, gradient and both moments read, three written back): the rate of the optimizer's
// passes on a CPU, faster per byte than the copy above.
double TimeAdamW(int threads) {
  at::set_num_threads(threads);
  const int64_t n = 16 << 20;
  at::Tensor p = at::randn({n}), g = at::randn({n}), m = at::zeros({n}), v = at::zeros({n});
  at::Tensor step = at::ones({});  // a bias correction of 1 - beta^1, as at the first step
  return MedianRate(6, 28.0 * static_cast<double>(n), [&] {
    at::_fused_adamw_({p}, {g}, {m}, {v}, {}, {step}, 1e-3, 0.9, 0.999, 0.1, 1e-8,
                      /*amsgrad=*/false, /*maximize=*/false);
  });
}

// This machine's memory in bytes (0 if the system does not say).
double MachineMemoryBytes() {
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  return pages > 0 && page > 0 ? static_cast<double>(pages) * page : 0;
}
// Its cores (at least 1).
int MachineCores() { return static_cast<int>(std::max(1u, std::thread::hardware_concurrency())); }

}  // namespace

std::vector<std::string> HardwareNames() {
  std::vector<std::string> names;
  for (const Hardware& hw : BuiltIn()) names.push_back(hw.name);
  return names;
}

absl::StatusOr<Hardware> HardwareByName(const std::string& name) {
  for (const Hardware& hw : BuiltIn()) {
    if (hw.name == name) return hw;
  }
  return absl::InvalidArgumentError(StrCat("--gpu '", name, "': unknown hardware (valid: ",
                                           StrJoin(HardwareNames(), ", "),
                                           ", or --hardware FILE.json)"));
}

std::string HardwareToJson(const Hardware& hw) {
  nlohmann::ordered_json j;
  j["name"] = hw.name;
  j["peak_flops_bf16"] = hw.peak_flops_bf16;
  j["peak_flops_fp32"] = hw.peak_flops_fp32;
  j["memory_bytes"] = hw.memory_bytes;
  j["memory_bw"] = hw.memory_bw;
  j["intra_node_bw"] = hw.intra_node_bw;
  j["intra_node_latency_s"] = hw.intra_node_latency_s;
  j["inter_node_bw"] = hw.inter_node_bw;
  j["inter_node_latency_s"] = hw.inter_node_latency_s;
  j["compute_efficiency"] = hw.compute_efficiency;
  j["comm_overlap"] = hw.comm_overlap;
  j["usable_memory_fraction"] = hw.usable_memory_fraction;
  j["cores_per_node"] = hw.cores_per_node;
  j["host_memory_bytes"] = hw.host_memory_bytes;
  j["host_memory_bw"] = hw.host_memory_bw;
  j["host_link_bw"] = hw.host_link_bw;
  j["host_rank_bw"] = hw.host_rank_bw;
  j["host_loop_cost"] = hw.host_loop_cost;
  j["host_add_loop_cost"] = hw.host_add_loop_cost;
  j["source"] = hw.source;
  return j.dump(2);
}

double PeakRate(const Hardware& hw, Precision precision) {
  return precision == Precision::kBf16 && hw.peak_flops_bf16 > 0 ? hw.peak_flops_bf16
                                                                 : hw.peak_flops_fp32;
}

absl::StatusOr<Hardware> ParseHardwareJson(const std::string& text, const std::string& name) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    // e.g. "number overflow parsing '1e400'" (no JSON number is infinite), or a syntax error.
    std::string what = e.what();
    if (size_t at = what.find("] "); at != std::string::npos) what = what.substr(at + 2);
    return absl::InvalidArgumentError(StrCat(name, ": not valid JSON: ", what));
  }
  if (!j.is_object()) {
    return absl::InvalidArgumentError(StrCat(name, ": not a JSON object (", j.type_name(), ")"));
  }
  Hardware hw;
  if (j.contains("base")) {
    if (!j["base"].is_string()) return absl::InvalidArgumentError(StrCat(name, ": base: expected a string"));
    absl::StatusOr<Hardware> base = HardwareByName(j["base"].get<std::string>());
    if (!base.ok()) return absl::InvalidArgumentError(StrCat(name, ": base: ", std::string(base.status().message())));
    hw = *base;
  }
  // Every number of the profile (base included) within [min, max], 0 allowed unless
  // `positive`: rates and sizes of at least 1 (FLOP/s, bytes, bytes/s) so that no time divides
  // by a denormal, at most 1e30; latencies up to a second per ring step; shares up to 1.
  struct Field {
    const char* key;
    double* value;
    double min, max;
    bool positive;
  };
  constexpr double kHuge = 1e30;
  const Field numbers[] = {{"peak_flops_bf16", &hw.peak_flops_bf16, 1, kHuge, false},
                           {"peak_flops_fp32", &hw.peak_flops_fp32, 1, kHuge, false},
                           {"memory_bytes", &hw.memory_bytes, 1, kHuge, true},
                           {"memory_bw", &hw.memory_bw, 1, kHuge, false},
                           {"intra_node_bw", &hw.intra_node_bw, 1, kHuge, true},
                           {"intra_node_latency_s", &hw.intra_node_latency_s, 0, 1, false},
                           {"inter_node_bw", &hw.inter_node_bw, 1, kHuge, false},
                           {"inter_node_latency_s", &hw.inter_node_latency_s, 0, 1, false},
                           {"compute_efficiency", &hw.compute_efficiency, 0, 1, true},
                           {"comm_overlap", &hw.comm_overlap, 0, 1, false},
                           {"usable_memory_fraction", &hw.usable_memory_fraction, 0, 1, true},
                           {"host_memory_bytes", &hw.host_memory_bytes, 1, kHuge, false},
                           {"host_memory_bw", &hw.host_memory_bw, 1, kHuge, false},
                           {"host_link_bw", &hw.host_link_bw, 1, kHuge, false},
                           {"host_rank_bw", &hw.host_rank_bw, 0, kHuge, false},
                           {"host_loop_cost", &hw.host_loop_cost, 0.05, 100, false},
                           {"host_add_loop_cost", &hw.host_add_loop_cost, 0.05, 100, false}};
  std::vector<std::string> valid = {"name", "base", "cores_per_node", "source"};
  for (const Field& f : numbers) valid.push_back(f.key);
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (std::find(valid.begin(), valid.end(), it.key()) == valid.end()) {
      return absl::InvalidArgumentError(StrCat(name, ": unknown key '", it.key(), "' (valid: ",
                                               StrJoin(valid, ", "), ")"));
    }
  }
  for (const Field& f : numbers) {
    if (!j.contains(f.key)) continue;
    if (!j[f.key].is_number()) {
      return absl::InvalidArgumentError(
          StrCat(name, ": ", f.key, ": expected a number, got ", j[f.key].dump()));
    }
    *f.value = j[f.key].get<double>();
  }
  for (const Field& f : numbers) {
    const double v = *f.value;
    if (std::isfinite(v) && v >= 0 && v <= f.max && (v == 0 ? !f.positive : v >= f.min)) continue;
    std::string range = f.max == 1 ? (f.positive ? "> 0 and <= 1" : ">= 0 and <= 1")
                                   : StrCat(f.positive ? "" : "0 or ", ">= ", f.min, " and <= ",
                                            f.max == kHuge ? kHuge : f.max);
    if (std::string(f.key).ends_with("_s")) range += " (seconds per ring step)";
    return absl::InvalidArgumentError(
        StrCat(name, ": ", f.key, ": ", v, " is out of range (valid: ", range, ")"));
  }
  if (j.contains("name")) {
    if (!j["name"].is_string())
      return absl::InvalidArgumentError(StrCat(name, ": name: expected a string"));
    hw.name = j["name"].get<std::string>();
  }
  if (j.contains("source")) {
    if (!j["source"].is_string())
      return absl::InvalidArgumentError(StrCat(name, ": source: expected a string"));
    hw.source = j["source"].get<std::string>();
  }
  if (j.contains("cores_per_node")) {
    const nlohmann::json& cores = j["cores_per_node"];
    if (!cores.is_number_integer() || cores.get<int64_t>() < 0 ||
        cores.get<int64_t>() > std::numeric_limits<int>::max()) {
      return absl::InvalidArgumentError(
          StrCat(name, ": cores_per_node: expected an integer >= 0 and <= 2147483647, got ",
                 cores.dump()));
    }
    hw.cores_per_node = static_cast<int>(cores.get<int64_t>());
  }
  if (hw.name.empty()) hw.name = name;
  if (hw.peak_flops_fp32 <= 0 && hw.peak_flops_bf16 <= 0) {
    return absl::InvalidArgumentError(StrCat(name, ": peak_flops_fp32 or peak_flops_bf16 must be > 0"));
  }
  if (hw.inter_node_bw <= 0) hw.inter_node_bw = hw.intra_node_bw;
  return hw;
}

absl::StatusOr<Hardware> LoadHardwareJson(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(StrCat("--hardware ", path, ": cannot open the file"));
  std::stringstream text;
  text << in.rdbuf();
  return ParseHardwareJson(text.str(), path);
}

absl::StatusOr<Hardware> CalibrateCpu(const std::string& fsdp_binary, std::string* log) {
  Hardware hw = *HardwareByName("cpu");
  const int cores = MachineCores();
  hw.cores_per_node = cores;
  // A rank alone gets every core; with `cores` ranks each gets one thread (launcher's
  // OMP_NUM_THREADS = cores / nproc). The node rate is the larger of the two.
  double all = TimeGemm(cores, 512);
  double one = TimeGemm(1, 512);
  hw.peak_flops_fp32 = std::max(all, one * cores);
  hw.memory_bw = TimeCopy(cores);
  hw.host_memory_bw = TimeAdamW(cores);
  hw.host_link_bw = hw.memory_bw / 2;
  *log += fmt::format("gemm 512^3 fp32: {:.3g} FLOP/s on {} thread(s), {:.3g} on 1; "
                      "copy {:.3g} B/s; fused AdamW {:.3g} B/s\n", all, cores, one,
                      hw.memory_bw, hw.host_memory_bw);
  if (const double memory = MachineMemoryBytes(); memory > 0) hw.memory_bytes = memory;
  hw.host_memory_bytes = hw.memory_bytes;

  std::string command = StrCat(fsdp_binary, " launch --no-prefix --nproc-per-node 2 -- ",
                               fsdp_binary, " doctor --device cpu --min-bytes 4K --max-bytes 64M 2>&1");
  *log += "running: " + command + "\n";
  int rc = 0;
  std::string output = RunChild(command, &rc);
  std::vector<DoctorRow> rows = ParseDoctor(output, "all_gather");
  if (rc != 0 || rows.empty()) {
    return absl::UnavailableError(StrCat("calibration: `", command, "` failed (exit ", rc,
                                         "); its output:\n", output));
  }
  // Bandwidth from the largest buffer; latency per ring hop from the smallest (n = 2: one hop).
  hw.intra_node_bw = rows.back().busbw_gbs * 1e9;
  hw.intra_node_latency_s = rows.front().time_us * 1e-6;
  *log += fmt::format("gloo all_gather, 2 ranks: busbw {:.3g} GB/s at {}, {:.0f} us at {}\n",
                      rows.back().busbw_gbs, rows.back().bytes, rows.front().time_us,
                      rows.front().bytes);
  hw.source = StrCat("fsdp plan --calibrate on this machine (", cores, " cores)");
  return hw;
}

absl::StatusOr<Hardware> CalibrateHost(const std::string& fsdp_binary, Hardware base,
                                       double elements, std::string* log) {
  // Tensors of 4M elements, as the engine calls the loops once per parameter of that order
  // (llama_1b's attention weights); one spinning thread, as a training thread waiting for its
  // GPU takes a core; the median of 5 passes.
  const std::string out = (std::filesystem::temp_directory_path() /
                           StrCat("fsdp_calibrate_host_", getpid(), ".json"))
                              .string();
  const std::string command =
      StrCat(fsdp_binary, " bench host --elements ", static_cast<int64_t>(elements),
             " --tensor-elements 4194304 --busy 1 --repeats 5 --out ", out, " 2>&1");
  *log += "running: " + command + "\n";
  int rc = 0;
  const std::string output = RunChild(command, &rc);
  *log += output;
  nlohmann::json report;
  {
    std::ifstream in(out);
    if (rc != 0 || !in) {
      std::filesystem::remove(out);
      return absl::UnavailableError(
          StrCat("calibration: `", command, "` failed (exit ", rc, "); its output is above"));
    }
    try {
      report = nlohmann::json::parse(in);
    } catch (const nlohmann::json::exception& e) {
      std::filesystem::remove(out);
      return absl::UnavailableError(StrCat("calibration: ", out, ": ", e.what()));
    }
  }
  std::filesystem::remove(out);
  // The rows at --busy 1, by the start of their pass's name.
  if (!report.contains("rows") || !report["rows"].is_array()) {
    return absl::UnavailableError("calibration: `fsdp bench host` wrote no rows");
  }
  const nlohmann::json& rows = report["rows"];
  auto row = [&](const std::string& prefix) -> const nlohmann::json* {
    for (const nlohmann::json& r : rows) {
      if (r.value("busy_threads", -1) == 1 && r.value("pass", "").starts_with(prefix)) return &r;
    }
    return nullptr;
  };
  const nlohmann::json* adamw = row("AdamW alone");
  if (adamw == nullptr || (*adamw)["gbps"].get<double>() <= 0) {
    return absl::UnavailableError("calibration: `fsdp bench host` gave no AdamW row");
  }
  Hardware hw = std::move(base);
  hw.host_rank_bw = (*adamw)["gbps"].get<double>() * 1e9;
  hw.host_memory_bw = std::max(hw.host_memory_bw, hw.host_rank_bw);
  const nlohmann::json* step = row("step: one loop");
  const nlohmann::json* add = row("add bf16: one loop");
  // Without a row (no AVX2 here, so no loop) 0: the built-in costs. Within the range a profile
  // file may hold, so that the profile written loads again.
  auto cost = [](const nlohmann::json* r) {
    return r != nullptr ? std::clamp((*r)["cost_vs_adamw"].get<double>(), 0.05, 100.0) : 0.0;
  };
  hw.host_loop_cost = cost(step);
  hw.host_add_loop_cost = cost(add);
  if (const double memory = MachineMemoryBytes(); memory > 0) hw.host_memory_bytes = memory;
  const int cores = MachineCores();
  *log += fmt::format(
      "host: fused AdamW {:.3g} GB/s with one thread spinning; the step's loop {} and the "
      "addition's {} times its time per byte; {:.0f} GiB of memory, {} cores\n",
      hw.host_rank_bw / 1e9, step != nullptr ? fmt::format("{:.2f}", hw.host_loop_cost) : "n/a",
      add != nullptr ? fmt::format("{:.2f}", hw.host_add_loop_cost) : "n/a",
      hw.host_memory_bytes / kGiB, cores);
  hw.source = StrCat(hw.name, " (", hw.source, ") with this host's figures: fsdp plan "
                     "--calibrate-host (", cores, " cores)");
  return hw;
}

}  // namespace fsdp::plan
