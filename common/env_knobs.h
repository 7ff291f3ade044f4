// Every environment variable fsdp.cpp reads for itself, declared once: its name, what it does,
// its default, its valid values and who reads it. Code reads a knob through its declaration
// (GetEnvKnob(kLogLevel), or GetOptionalIntEnv(env, kCollectiveTimeoutS.name, ...) where an
// EnvLookup is threaded through for tests); a knob's name string appears only in this file.
//
// Not declared here:
//   - The launcher-standard variables that say where a rank stands (RANK, LOCAL_RANK,
//     WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_*,
//     SLURM_*, OMPI_COMM_WORLD_*, PMI_*, MPI_LOCALRANKID, MPI_LOCALNRANKS): torchrun, SLURM and
//     MPI define them; device_mesh/launch_env.cc reads them as a table per launcher (and
//     launcher/launch.cc sets the torchrun ones for the ranks it starts).
//   - The test harness's own variables (FSDP_TEST_CHILD_CALL, FSDP_TEST_RANK, set for and
//     read by the rank processes of tests/multirank.cc), and FSDP_TEST_VERBOSE (listed below).
//   - Build-time knobs (FSDP_TORCH_DIR, FSDP_CUDA_MODE, JOBS...): the Makefile's, not the
//     binaries'.
//
//   if (std::optional<std::string> level = GetEnvKnob(kLogLevel)) ...;   // nullopt: unset
//   for (const EnvKnob& knob : AllEnvKnobs()) std::cout << knob.name << ": " << knob.description;
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>

namespace fsdp {

struct EnvKnob {
  std::string_view name;
  std::string_view description;    // what it does
  std::string_view default_value;  // what leaving it unset means
  std::string_view valid;          // the values it accepts
  std::string_view read_by;        // the source files that read it
};

// FSDP_LOG_LEVEL: the level of the project's rank-prefixed logger (stderr), read once when the
// logger is first used.
inline constexpr EnvKnob kLogLevel{
    "FSDP_LOG_LEVEL", "level of the fsdp logger on stderr (spdlog levels)", "info",
    "trace, debug, info, warn, err, critical, off (anything else: off)", "common/logging.cc"};

// FSDP_RENDEZVOUS_TIMEOUT_S / FSDP_COLLECTIVE_TIMEOUT_S: override the DistOptions timeouts.
inline constexpr EnvKnob kRendezvousTimeoutS{
    "FSDP_RENDEZVOUS_TIMEOUT_S",
    "seconds to wait for every rank at the rendezvous (store connection, process group "
    "creation) before failing with kDeadlineExceeded",
    "DistOptions::rendezvous_timeout", "an integer in 1..604800",
    "device_mesh/dist_context.cc"};
inline constexpr EnvKnob kCollectiveTimeoutS{
    "FSDP_COLLECTIVE_TIMEOUT_S",
    "seconds a collective (or a wait on the store, e.g. for a checkpoint manifest) may take "
    "before it fails",
    "DistOptions::collective_timeout", "an integer in 1..604800",
    "device_mesh/dist_context.cc"};

// GLOO_SOCKET_IFNAME: Gloo's own knob, honoured as PyTorch does.
inline constexpr EnvKnob kGlooSocketIfname{
    "GLOO_SOCKET_IFNAME",
    "network interface Gloo binds to (as in PyTorch); when unset: 127.0.0.1 if MASTER_ADDR "
    "is loopback or unset, otherwise Gloo's default (the host name's address)",
    "unset", "an interface name, e.g. eth0", "device_mesh/dist_context.cc"};

// OMP_NUM_THREADS: OpenMP's knob; the launcher only decides whether to set it for its ranks.
inline constexpr EnvKnob kOmpNumThreads{
    "OMP_NUM_THREADS",
    "OpenMP threads per process; when unset and `fsdp launch` starts several ranks per node, "
    "the launcher sets it to cores / ranks per node for them (as torchrun)",
    "unset (OpenMP's default: one thread per core)", "a positive integer",
    "launcher/launch.cc"};

// FSDP_CHECKPOINT_CRASH_AFTER_WRITE: fault injection for the checkpoint tests.
inline constexpr EnvKnob kCheckpointCrashAfterWrite{
    "FSDP_CHECKPOINT_CRASH_AFTER_WRITE",
    "testing only: the rank with this number exits (status 137) after writing its checkpoint "
    "shard and before reporting it to rank 0, to test that a partial save is never committed",
    "unset (no crash)", "a rank number", "engine/checkpointing.cc"};

// FSDP_PYTHON: the Python that `fsdp bench` runs the PyTorch reference with.
inline constexpr EnvKnob kPython{
    "FSDP_PYTHON",
    "Python interpreter (with torch) for the bench's PyTorch FSDP2 reference and plots, when "
    "the command line names none",
    "the build's virtualenv python (FSDP_VENV_PYTHON)", "a path to an executable",
    "bench/inputs.cc"};

// FSDP_PROGRESS_FILE: set by `fsdp train` for the ranks it starts; rank 0 writes its latest
// StepRecord there (step, total steps, elapsed seconds) at each log interval, and the launching
// process draws the progress bar from it instead of parsing rank 0's text.
inline constexpr EnvKnob kProgressFile{
    "FSDP_PROGRESS_FILE",
    "file where rank 0 publishes its latest step record for the launcher's progress bar",
    "unset (no record published)", "a writable path", "engine/train_metrics.cc, cli/train.cc"};

// FSDP_FAILURE_DIR: set by `fsdp launch` / `fsdp train` for the ranks it starts; a failing rank
// leaves its one failure line there with the time (common/failure.h), so that the launcher
// names the first rank to fail.
inline constexpr EnvKnob kFailureDir{
    "FSDP_FAILURE_DIR",
    "folder where a failing rank records its failure line and time for the launcher's headline",
    "unset (no record)", "a writable folder", "common/failure.cc, launcher/launch.cc"};

// FSDP_OFFLOAD_STEP_SLICE: the slice of offload's sliced host step, read when a run's host
// offload is created (Note [Deferred gradient conversion] in
// sharding/offload/deferred_grads.h).
inline constexpr EnvKnob kOffloadStepSlice{
    "FSDP_OFFLOAD_STEP_SLICE",
    "elements per slice of the offload host's sliced passes (parallelism.offload: params with "
    "bf16 compute): the overlapped step's conversion, clipping, update and cast of each slice, "
    "and the bf16 gradients' conversion and addition, one op after the other, each on all of "
    "ATen's threads; the same values at any slice (a tuning knob for a host's caches, and the "
    "tests' way to cut small tensors into slices)",
    "4194304 (2^22)", "a multiple of 16 in 16..1073741824",
    "sharding/offload/host_offload.cc"};

// FSDP_OFFLOAD_HOST_PASS: whether offload's host step may use the optimizer's one loop (Note
// [Host Adam pass] in engine/host_adam.cc), read when a run's host offload is created.
inline constexpr EnvKnob kOffloadHostPass{
    "FSDP_OFFLOAD_HOST_PASS",
    "off makes offload's host work use ATen's ops in slices instead of fsdp.cpp's one loops: "
    "the host step's update of deferred bf16 gradients (the optimizer's one loop) and the bf16 "
    "gradients' addition into the fp32 sum (the same values; for measuring one against the "
    "other, as `fsdp bench host` does outside a run)",
    "on", "on, off", "sharding/offload/host_offload.cc"};

// FSDP_OFFLOAD_HOST_THREADS: the threads of offload's one loops (Note [Host loops]).
inline constexpr EnvKnob kOffloadHostThreads{
    "FSDP_OFFLOAD_HOST_THREADS",
    "threads that run offload's one loops on the host (the AdamW update of deferred bf16 "
    "gradients, the bf16 gradients' addition), the adder's own included; fewer than the cores "
    "leaves some to the training thread and the copies (`fsdp bench host --threads` measures "
    "the choice)",
    "at::get_num_threads() (OMP_NUM_THREADS; the launcher gives each rank cores / ranks)",
    "an integer in 1..1024", "sharding/offload/host_offload.cc"};

// FSDP_OFFLOAD_OVERLAP_STEP: debugging switch for offload's overlapped host step (Note
// [Overlapped host step] in engine/trainable.cc), read by ShardingPlanFor.
inline constexpr EnvKnob kOffloadOverlapStep{
    "FSDP_OFFLOAD_OVERLAP_STEP",
    "0 runs offload's host optimizer step on the training thread before the next forward "
    "instead of a unit at a time beside it (the same values bit for bit; for debugging and "
    "for measuring the overlap); not with parallelism.offload_delayed_update",
    "1", "0, 1", "engine/config.cc"};

// FSDP_OFFLOAD_COMPUTE_COPY: forces offload params' compute-dtype host copy (Note [Compute
// copy] in sharding/offload/offload_plan.h), read by ShardingPlanFor.
inline constexpr EnvKnob kOffloadComputeCopy{
    "FSDP_OFFLOAD_COMPUTE_COPY",
    "1 keeps, 0 drops offload params' compute-dtype copy of each shard on the host (2 bytes "
    "per parameter of host memory against twice the host->device bytes; the same values); "
    "unset, it is kept unless host memory only fits without it",
    "unset (automatic)", "0, 1", "engine/config.cc"};

// FSDP_TEST_SIGSTOP: fault injection for the watchdog tests.
inline constexpr EnvKnob kTestSigstop{
    "FSDP_TEST_SIGSTOP",
    "testing only: 'R@S' makes rank R stop itself with SIGSTOP when it begins step S (as if the "
    "process hung), to test the collective watchdog",
    "unset (no stop)", "R@S with a rank R and a step S", "device_mesh/watchdog.cc"};

// FSDP_TEST_SIGTERM: fault injection for the preemption tests.
inline constexpr EnvKnob kTestSigterm{
    "FSDP_TEST_SIGTERM",
    "testing only: 'R@S' makes rank R send itself SIGTERM when it begins step S (a preemption "
    "that reaches one rank only)",
    "unset (no signal)", "R@S with a rank R and a step S", "device_mesh/watchdog.cc"};

// FSDP_TEST_NONFINITE: fault injection for the on_nonfinite tests.
inline constexpr EnvKnob kTestNonFinite{
    "FSDP_TEST_NONFINITE",
    "testing only: 'R@S' makes rank R's loss not a number in step S (its first micro-batch's, "
    "before the backward), so that every gradient and the step's global norm are NaN: one "
    "non-finite step between finite ones, to test training.on_nonfinite",
    "unset (no injection)", "R@S with a rank R and a step S", "engine/trainer.cc"};

// FSDP_TEST_VERBOSE: the multi-rank test harness prints every rank's output.
inline constexpr EnvKnob kTestVerbose{
    "FSDP_TEST_VERBOSE",
    "testing only: the multi-rank test harness prints every rank's output, not only a failed "
    "rank's",
    "unset (quiet)", "set to anything", "tests/multirank.cc"};

// Every knob above, in this order.
std::span<const EnvKnob> AllEnvKnobs();

// A fault-injection knob's 'R@S' (FSDP_TEST_SIGSTOP, ...): {R, S}, or {-1, -1} when it is unset
// or malformed (a test's typo injects nothing rather than stopping a run).
std::pair<int, int64_t> GetRankAtStepKnob(const EnvKnob& knob);

// The knob's value in the process environment; nullopt when it is unset (an empty value is
// returned as "", as getenv would).
std::optional<std::string> GetEnvKnob(const EnvKnob& knob);

}  // namespace fsdp
