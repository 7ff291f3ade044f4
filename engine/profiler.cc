#include "engine/profiler.h"

#include <algorithm>
#include <array>
#include <cctype>
#include <fstream>
#include <map>
#include <set>
#include <utility>

#include <fmt/format.h>
#include <torch/csrc/autograd/profiler_kineto.h>

#include "common/status.h"
#include "common/strings.h"
#include "device_mesh/cuda_support.h"

namespace fsdp {
namespace {

namespace kineto = torch::autograd::profiler;
using torch::profiler::impl::ActivityType;
using torch::profiler::impl::ProfilerConfig;
using torch::profiler::impl::ProfilerState;

bool Contains(std::string_view haystack, std::string_view needle) {
  return haystack.find(needle) != std::string_view::npos;
}

bool ContainsAny(std::string_view name, std::initializer_list<std::string_view> needles) {
  return std::any_of(needles.begin(), needles.end(),
                     [&](std::string_view n) { return Contains(name, n); });
}

// The trainer's phase ranges and other annotations: they nest the work, they are not work.
// fsdp::comm_wait (sharding/collectives.cc) is: the time a rank waits for a collective.
bool IsAnnotation(std::string_view name) {
  if (name == "fsdp::comm_wait") return false;
  return name.rfind("fsdp::", 0) == 0 || name.rfind("ProfilerStep", 0) == 0 ||
         name.rfind("PyTorch Profiler", 0) == 0;
}

// One event of the profile on one timeline (a CPU thread, or a GPU stream).
struct Span {
  uint64_t start = 0, end = 0;
  std::string name;
};

// Self time of nested spans on one timeline: each span's duration less its direct children's.
// Spans must be sorted by start (ties: longer first).
std::vector<int64_t> SelfTimes(const std::vector<Span>& spans) {
  std::vector<int64_t> self(spans.size());
  std::vector<size_t> open;  // indices of the spans enclosing the current one
  for (size_t i = 0; i < spans.size(); ++i) {
    while (!open.empty() && spans[open.back()].end <= spans[i].start) open.pop_back();
    self[i] = static_cast<int64_t>(spans[i].end - spans[i].start);
    if (!open.empty()) self[open.back()] -= static_cast<int64_t>(spans[i].end - spans[i].start);
    open.push_back(i);
  }
  return self;
}

}  // namespace

std::string ProfileWindow::ToString() const {
  return enabled() ? StrCat(start, ":", steps) : std::string("none");
}

std::optional<ProfileWindow> ParseProfileWindow(std::string_view text) {
  if (text == "none") return ProfileWindow{};
  const size_t colon = text.find(':');
  if (colon == std::string_view::npos) return std::nullopt;
  std::optional<int64_t> start = ParseInt<int64_t>(text.substr(0, colon));
  std::optional<int64_t> steps = ParseInt<int64_t>(text.substr(colon + 1));
  if (!start || !steps || *start < 0 || *steps < 1) return std::nullopt;
  return ProfileWindow{.start = *start, .steps = *steps};
}

std::string_view KernelClassOf(std::string_view raw) {
  std::string lower(raw);
  std::transform(lower.begin(), lower.end(), lower.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  const std::string_view name = lower;
  if (ContainsAny(name, {"nccl", "gloo", "c10d", "comm_wait", "all_gather", "allgather", "reduce_scatter",
                         "reducescatter", "all_reduce", "allreduce", "broadcast"})) {
    return "communication";
  }
  if (ContainsAny(name, {"flash", "fmha", "attention", "sdpa", "_efficient_attention"})) {
    return "attention";
  }
  if (ContainsAny(name, {"adam", "sgd"})) return "optimizer";
  if (ContainsAny(name, {"rms_norm", "layer_norm", "rmsnorm", "layernorm"})) return "norm";
  if (ContainsAny(name, {"gemm", "cutlass", "xmma", "nvjet", "sm90_", "matmul", "aten::mm",
                         "aten::addmm", "aten::bmm", "aten::baddbmm", "_addmm_activation"})) {
    return "gemm";
  }
  if (ContainsAny(name, {"softmax", "nll_loss", "cross_entropy"})) return "loss";
  if (ContainsAny(name, {"memcpy", "memset", "copy", "aten::to", "cast", "fill", "aten::zero",
                         "aten::clone", "aten::contiguous"})) {
    return "copy/cast";
  }
  if (ContainsAny(name, {"reduce", "aten::sum", "aten::mean", "norm", "aten::max", "aten::amax"})) {
    return "reduction";
  }
  if (ContainsAny(name, {"elementwise", "foreach", "aten::add", "aten::sub", "aten::mul",
                         "aten::div", "silu", "gelu", "aten::neg", "aten::pow", "rsqrt",
                         "aten::sqrt", "aten::exp", "aten::where", "aten::cat", "aten::stack",
                         "lerp", "addcmul", "addcdiv", "sigmoid", "tanh", "aten::embedding"})) {
    return "elementwise";
  }
  return "other";
}

std::string FormatKernelSummary(const std::vector<KernelClassTime>& classes, int64_t steps,
                                const std::string& trace_path) {
  std::vector<KernelClassTime> sorted = classes;
  std::sort(sorted.begin(), sorted.end(),
            [](const KernelClassTime& a, const KernelClassTime& b) { return a.ns > b.ns; });
  int64_t total = 0;
  for (const KernelClassTime& c : sorted) total += c.ns;
  std::string out = fmt::format("  {:<14} {:>9} {:>11} {:>7}\n", "class", "events/step",
                                "ms/step", "share");
  for (const KernelClassTime& c : sorted) {
    out += fmt::format("  {:<14} {:>9} {:>11.3f} {:>6.1f}%\n", c.kernel_class,
                       c.count / std::max<int64_t>(steps, 1),
                       c.ns / 1e6 / static_cast<double>(std::max<int64_t>(steps, 1)),
                       total > 0 ? 100.0 * static_cast<double>(c.ns) / total : 0.0);
  }
  out += fmt::format("  {:<14} {:>9} {:>11.3f}   trace: {}\n", "total", "",
                     total / 1e6 / static_cast<double>(std::max<int64_t>(steps, 1)), trace_path);
  return out;
}

StepProfiler::StepProfiler(ProfileWindow window, std::filesystem::path dir, c10::Device device,
                           int rank)
    : window_(window), dir_(std::move(dir)), device_(device), rank_(rank) {}

StepProfiler::~StepProfiler() {
  if (running_) kineto::disableProfiler();
}

namespace {

std::set<ActivityType> Activities(c10::Device device) {
  std::set<ActivityType> activities{ActivityType::CPU};
  if (device.is_cuda()) activities.insert(ActivityType::CUDA);
  return activities;
}

const ProfilerConfig& Config() {
  static const ProfilerConfig config(ProfilerState::KINETO);
  return config;
}

// Per kernel class: GPU kernels and copies on a CUDA run (they do not nest), the self time of
// CPU operators otherwise (annotations excluded, operators nest).
std::vector<KernelClassTime> Classify(const std::vector<kineto::KinetoEvent>& events,
                                      bool cuda) {
  std::map<uint64_t, std::vector<Span>> timelines;
  for (const kineto::KinetoEvent& e : events) {
    const bool on_gpu = e.deviceType() == c10::DeviceType::CUDA;
    if (on_gpu != cuda || e.endNs() <= e.startNs()) continue;
    timelines[on_gpu ? static_cast<uint64_t>(e.deviceResourceId()) : e.startThreadId()]
        .push_back({e.startNs(), e.endNs(), e.name()});
  }
  std::map<std::string, KernelClassTime> classes;
  for (auto& [timeline, spans] : timelines) {
    std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) {
      return a.start != b.start ? a.start < b.start : a.end > b.end;
    });
    const std::vector<int64_t> self = SelfTimes(spans);
    for (size_t i = 0; i < spans.size(); ++i) {
      if (IsAnnotation(spans[i].name)) continue;
      const std::string kernel_class(KernelClassOf(spans[i].name));
      KernelClassTime& c = classes[kernel_class];
      c.kernel_class = kernel_class;
      ++c.count;
      c.ns += std::max<int64_t>(self[i], 0);
    }
  }
  std::vector<KernelClassTime> out;
  for (auto& [name, c] : classes) out.push_back(c);
  return out;
}

}  // namespace

void StepProfiler::BeforeStep(int64_t step) {
  if (!window_.enabled() || step != window_.start || running_) return;
  kineto::prepareProfiler(Config(), Activities(device_));
  kineto::enableProfiler(Config(), Activities(device_));
  running_ = true;
}

absl::Status StepProfiler::Prepare() const {
  if (!window_.enabled()) return absl::OkStatus();
  std::error_code ec;
  std::filesystem::create_directories(dir_, ec);
  if (ec || !std::filesystem::is_directory(dir_)) {
    return absl::FailedPreconditionError(
        StrCat("training.profile_dir: cannot create the profile folder '", dir_.string(), "': ",
               ec ? ec.message() : std::string("not a folder")));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::optional<std::string>> StepProfiler::AfterStep(int64_t step) {
  if (!running_ || step != window_.start + window_.steps - 1) return std::nullopt;
  running_ = false;
  if (device_.is_cuda()) CudaSynchronize();  // the window's kernels end inside the trace
  std::unique_ptr<kineto::ProfilerResult> result = kineto::disableProfiler();
  FSDP_RETURN_IF_ERROR(Prepare());
  const std::string trace = (dir_ / StrCat("rank", rank_, ".json")).string();
  // Kineto reports a failed write only in its log, so the trace must be this save's: an older
  // file of that name goes first, and anything else there is an error now.
  std::error_code ec;
  if (std::filesystem::exists(trace, ec) && !std::filesystem::is_regular_file(trace, ec)) {
    return absl::FailedPreconditionError(
        StrCat("training.profile: cannot write the trace '", trace, "': something other than a "
               "file is in the way"));
  }
  std::filesystem::remove(trace, ec);
  result->save(trace);
  if (!std::filesystem::is_regular_file(trace, ec)) {
    std::filesystem::remove(trace + ".tmp", ec);
    return absl::FailedPreconditionError(
        StrCat("training.profile: the trace '", trace, "' was not written"));
  }
  std::string summary = fmt::format(
      "fsdp train: profile of steps {}-{} on rank {} ({} time per kernel class):\n",
      window_.start + 1, window_.start + window_.steps, rank_,
      device_.is_cuda() ? "GPU kernel" : "CPU operator self");
  summary += FormatKernelSummary(Classify(result->events(), device_.is_cuda()), window_.steps, trace);
  const std::string summary_path = (dir_ / StrCat("rank", rank_, "_summary.txt")).string();
  std::ofstream file(summary_path);
  file << summary;
  file.close();
  if (!file) {
    return absl::FailedPreconditionError(
        StrCat("training.profile: cannot write '", summary_path, "'"));
  }
  return summary;
}

}  // namespace fsdp
