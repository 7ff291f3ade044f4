// training.profile: a Kineto trace (Chrome trace JSON, for chrome://tracing or Perfetto) of a
// window of training steps, written from C++, and a short summary of where the time went, by
// kernel class (GEMM, attention, elementwise, ...). The trace carries the trainer's phase
// ranges (fsdp::train_step, fsdp::forward, fsdp::backward, fsdp::optimizer_step, ...).
// Not collective: each rank profiles itself and writes <dir>/rank<R>.json; ranks only need to
// call BeforeStep/AfterStep with the same steps (they do: the loop is the same everywhere).
//
//   StepProfiler profiler(*ParseProfileWindow("10:3"), run_dir / "profile", device, rank);
//   for (int64_t step = 0; step < steps; ++step) {
//     profiler.BeforeStep(step);                   // starts before step 10
//     TrainStep(...);
//     FSDP_ASSIGN_OR_RETURN(std::optional<std::string> summary, profiler.AfterStep(step));
//     if (summary && rank == 0) std::cout << *summary;   // after step 12: trace saved
//   }
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <c10/core/Device.h>

#include "absl/status/statusor.h"

namespace torch::autograd::profiler {
struct ProfilerResult;
}

namespace fsdp {

// The YAML value `training.profile`: "none", or "START:STEPS" (profile STEPS steps starting with
// the 0-based step START, e.g. "10:3"; START >= 0, STEPS >= 1).
struct ProfileWindow {
  int64_t start = 0;
  int64_t steps = 0;  // 0: no profile
  bool enabled() const { return steps > 0; }
  std::string ToString() const;
};
std::optional<ProfileWindow> ParseProfileWindow(std::string_view text);

// One class of the summary: its events' time (self time of CPU operators on a CPU run; GPU
// kernel time on a CUDA run), in nanoseconds.
struct KernelClassTime {
  std::string kernel_class;  // "gemm", "attention", "elementwise", ...
  int64_t count = 0;
  int64_t ns = 0;
};

// The kernel class of an event name (a CUDA kernel's or an ATen operator's): gemm, attention,
// norm, optimizer, communication, copy/cast, elementwise, reduction, or other. Pure; tested.
std::string_view KernelClassOf(std::string_view name);

// Formats the classes as a table, largest first, with shares of the total.
std::string FormatKernelSummary(const std::vector<KernelClassTime>& classes, int64_t steps,
                                const std::string& trace_path);

class StepProfiler {
 public:
  StepProfiler(ProfileWindow window, std::filesystem::path dir, c10::Device device, int rank);
  ~StepProfiler();  // stops a profile still running (a run that ended inside the window)

  // Creates the output folder (nothing when no window is set): a folder that cannot be made is
  // an error at start rather than after the profiled steps.
  absl::Status Prepare() const;
  // Starts the profiler when `step` (0-based) is the window's first step.
  void BeforeStep(int64_t step);
  // After the window's last step: stops, writes <dir>/rank<R>.json and <dir>/rank<R>_summary.txt,
  // and returns the summary; nullopt on other steps. An error names the file it could not write.
  absl::StatusOr<std::optional<std::string>> AfterStep(int64_t step);

 private:
  ProfileWindow window_;
  std::filesystem::path dir_;
  c10::Device device_;
  int rank_;
  bool running_ = false;
};

}  // namespace fsdp
