// DistContext: this process's place in the job. Rendezvous through a TCPStore, this rank's
// device, and the world process group; DeviceMesh and everything above it build on it.
//
// Init is collective over the whole world: every rank calls it once, with the same options.
// It returns (never hangs) when a rank does not arrive within rendezvous_timeout: every rank
// that did arrive gets kDeadlineExceeded naming the ranks it waited for. The deadline covers
// every wait of the rendezvous, a store that accepts the connection and never answers
// included (Note [Rendezvous deadline]).
//
//   absl::StatusOr<std::shared_ptr<DistContext>> ctx =
//       DistContext::InitFromEnvironment(DistOptions{.device = "cpu"});
//   if (!ctx.ok()) { std::cerr << ctx.status().message() << "\n"; return 1; }
//   at::Tensor t = at::ones({8});
//   (*ctx)->world().AllReduce(t)->wait();
//
// Store layout. torchrun's agent store (TORCHELASTIC_USE_AGENT_STORE=True, also what
// `fsdp launch` provides): every rank is a client, keys under "/worker/attempt_<restart>".
// Otherwise rank 0 hosts the TCPStore on MASTER_PORT. A single process without a launcher uses
// an in-process store. Our keys live under "fsdp/".
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <c10/core/Device.h>

#include "absl/status/statusor.h"
#include "common/env.h"
#include "device_mesh/launch_env.h"
#include "device_mesh/process_group.h"
#include "device_mesh/watchdog.h"

namespace fsdp {

class LauncherWatch;  // dist_context.cc, Note [A rank outlives its launcher]

struct DistOptions {
  // How long a rank waits for the others to arrive (store connection and group creation).
  std::chrono::milliseconds rendezvous_timeout{std::chrono::minutes(5)};
  // How long a collective may take before it fails.
  std::chrono::milliseconds collective_timeout{std::chrono::minutes(10)};
  // Run the collective watchdog (device_mesh/watchdog.h): a collective waited on for longer
  // than collective_timeout ends the rank with one line naming it and the ranks that did not
  // arrive (exit code 6), instead of an exception from the backend.
  bool watchdog = false;
  // With the watchdog: where its flight recorder goes on a timeout (rank<R>.json).
  std::string flight_dir{};
  // "cpu", "cuda" (this rank's GPU is LOCAL_RANK % device count), or "auto" (cuda if any).
  std::string device = "cpu";
  // Backend for CUDA tensors: "nccl" or "gloo".
  std::string cuda_backend = "nccl";
  // CPU all-gather / reduce-scatter: "p2p" or "gloo" (see GroupOptions::cpu_collectives).
  std::string cpu_collectives = "p2p";

  absl::Status Validate() const;
};

// Overrides timeouts from FSDP_RENDEZVOUS_TIMEOUT_S / FSDP_COLLECTIVE_TIMEOUT_S (seconds).
absl::Status ApplyTimeoutEnv(const EnvLookup& env, DistOptions& options);

class DistContext {
 public:
  static absl::StatusOr<std::shared_ptr<DistContext>> Init(const LaunchEnv& env,
                                                           const DistOptions& options);
  ~DistContext();
  // ParseLaunchEnv(ProcessEnv()) + ApplyTimeoutEnv + Init.
  static absl::StatusOr<std::shared_ptr<DistContext>> InitFromEnvironment(DistOptions options);

  int rank() const { return env_.rank; }
  int world_size() const { return env_.world_size; }
  const LaunchEnv& env() const { return env_; }
  const DistOptions& options() const { return options_; }
  // This rank's compute device: cpu, or cuda:<LOCAL_RANK % device count>.
  c10::Device device() const { return device_; }
  ProcessGroup& world() { return *world_; }
  const c10::intrusive_ptr<c10d::Store>& store() const { return store_; }

  // Creates a group of the given global ranks. Collective over those ranks only: each member
  // calls it with the same ranks and tag, in the same order relative to other NewGroup calls.
  absl::StatusOr<std::shared_ptr<ProcessGroup>> NewGroup(std::vector<int> ranks,
                                                         std::string_view tag);
  // A tag unique within this context ("mesh0", "mesh1", ...); identical on all ranks as long as
  // they call it the same number of times.
  std::string NextTag(std::string_view kind);

 private:
  DistContext();

  LaunchEnv env_;
  DistOptions options_;
  GroupOptions group_options_;
  c10::Device device_{c10::kCPU};
  c10::intrusive_ptr<c10d::Store> store_;
  std::shared_ptr<ProcessGroup> world_;
  // Ranks on a launcher's store end when it is gone (Note [A rank outlives its launcher]).
  std::unique_ptr<LauncherWatch> launcher_watch_;
  std::unique_ptr<Watchdog> watchdog_;  // last: stopped first
  int next_tag_ = 0;
  int generation_ = 0;  // how many contexts this process made before this one
};

}  // namespace fsdp
