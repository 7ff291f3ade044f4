#include "sharding/offload.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <optional>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>
#include <ATen/record_function.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/strides.h>

#include "common/env.h"
#include "common/env_knobs.h"
#include "common/logging.h"
#include "common/status.h"
#include "common/strings.h"
#include "device_mesh/cuda_support.h"
#include "sharding/fsdp_model.h"
#include "sharding/host_loops.h"
#include "sharding/memory_tracker.h"

namespace fsdp {
namespace {

// Host buffers start on 64-byte boundaries (a cache line; the fused optimizer's vectors).
constexpr int64_t kAlignBytes = 64;

int64_t RoundUp(int64_t n, int64_t multiple) { return (n + multiple - 1) / multiple * multiple; }

// A tensor of `sizes` over `arena`'s memory from element `offset`: a fresh TensorImpl, not a
// view, so that it can be an optimizer's parameter or a .grad (zero_grad detaches .grad in
// place, which a view refuses).
at::Tensor Carve(const at::Tensor& arena, int64_t offset, at::IntArrayRef sizes) {
  at::Tensor t = at::empty({0}, arena.options());
  t.set_(arena.storage(), offset, sizes, c10::contiguous_strides(sizes));
  return t;
}

double GiB(int64_t bytes) { return static_cast<double>(bytes) / (1 << 30); }

// Adds the wall time of its scope to `seconds` (HostOffload::Stats).
class PhaseTimer {
 public:
  explicit PhaseTimer(double& seconds)
      : seconds_(seconds), start_(std::chrono::steady_clock::now()) {}
  ~PhaseTimer() {
    seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  }

 private:
  double& seconds_;
  std::chrono::steady_clock::time_point start_;
};

// Note [Gradients committed on demand]
// With offload params and one shard in a narrower compute dtype, each gradient lands in bf16
// (host_compute_grad) and the fp32 host_grad is written only by the host: converting or adding
// into it (several micro-batches summed on the host), or a deferred gradient materialized. With
// the deferred conversion and the optimizer's one loop (Note [Deferred gradient conversion]),
// the common case of a big model on one GPU, nothing writes it at all. So those gradients are
// not in the pinned arena (no copy ever targets them) but in an anonymous mapping reserved
// without committing memory (MAP_NORESERVE): a page takes host memory when it is first written,
// and one never written takes none. Each starts on a 64 KiB boundary (a page for every page
// size of Linux on x86-64 and ARM64) and the mapping takes no transparent huge pages (a write
// would commit the 2 MiB around it), so that a gradient's pages are its own, and
// ModelStateBytes counts what is resident (mincore) in `host` and the rest in
// `host_untouched` (on a CPU device the resident part counts in DevicePeakBytes too, as the
// arena's allocations do: memory_tracker.h). For llama3_8b_one_gpu.yaml this is 4 of the 20
// bytes per parameter of host memory (30 GiB).
constexpr int64_t kOnDemandAlignBytes = 64 * 1024;

// 1-D, `numel` fp32 elements in memory committed on first write (MapOnDemand); zero until
// then (Note [Gradients committed on demand]).
absl::StatusOr<at::Tensor> OnDemandHostArena(int64_t numel) {
  const size_t bytes = static_cast<size_t>(numel) * 4;
  void* memory = MapOnDemand(bytes);
  if (memory == nullptr) {
    return absl::ResourceExhaustedError(StrCat("mmap of ", bytes, " bytes: ", strerror(errno)));
  }
  return at::from_blob(memory, {numel}, &UnmapOnDemand,
                       at::TensorOptions().dtype(at::kFloat).device(c10::kCPU));
}

// 1-D, `numel` elements of `dtype` in host memory, page-locked when `pinned`.
absl::StatusOr<at::Tensor> HostArena(int64_t numel, c10::ScalarType dtype, bool pinned) {
  at::TensorOptions opts = at::TensorOptions().dtype(dtype).device(c10::kCPU);
  if (!pinned) {
    try {
      return at::empty({numel}, opts);
    } catch (const c10::Error& e) {
      return absl::ResourceExhaustedError(e.what_without_backtrace());
    }
  }
  const size_t bytes = static_cast<size_t>(numel) * c10::elementSize(dtype);
  absl::StatusOr<c10::DataPtr> memory = AllocatePinnedHost(bytes);
  if (!memory.ok()) return memory.status();
  c10::Storage storage(c10::Storage::use_byte_size_t(), bytes, *std::move(memory),
                       /*allocator=*/nullptr, /*resizable=*/false);
  at::Tensor arena = at::empty({0}, opts);
  arena.set_(std::move(storage), 0, {numel}, {1});
  return arena;
}

// The narrow type whose addition into dst HostAddConverted does here (Note [Host loops]): an
// fp32 dst and a bf16 or fp16 src, both contiguous; else nullopt (AddConvertedInChunks).
std::optional<HostNarrow> OneLoopAdd(const at::Tensor& dst, const at::Tensor& src) {
  if (dst.scalar_type() != at::kFloat || !dst.is_cpu() || !src.is_cpu() ||
      !dst.is_contiguous() || !src.is_contiguous() ||
      dst.numel() != src.numel()) {
    return std::nullopt;
  }
  std::optional<HostNarrow> narrow;
  if (src.scalar_type() == at::kBFloat16) narrow = HostNarrow::kBFloat16;
  if (src.scalar_type() == at::kHalf) narrow = HostNarrow::kHalf;
  if (!narrow.has_value() || !HostAddConvertedAvailable(*narrow)) return std::nullopt;
  return narrow;
}

// Elements per slice of a sliced step (Note [Deferred gradient conversion]; the default of
// FSDP_OFFLOAD_STEP_SLICE), a multiple of 16 (Note [Prepared steps]). Each of a slice's four ops
// forks and joins ATen's threads (at::parallel_for in our code does not mark a parallel region:
// docs/architecture.md), so the slice must be large enough to amortise that: on the H100
// machine (16 cores, 0.48e9 parameters in a microbenchmark) 2^18-element slices took 582 ms on
// a worker thread against 236 for whole-tensor passes, 2^20 278 ms, 2^22 236 ms, and 2^16 1714
// ms (~200 us per slice). The slice's arrays (~80 MiB at 2^22) may stay in the shared L3 between
// its ops; measured in the engine, the pass took what the separate passes take (docs/offload.md).
constexpr int64_t kDefaultStepSlice = int64_t{1} << 22;

}  // namespace

absl::StatusOr<std::unique_ptr<HostOffload>> HostOffload::Create(Offload mode, c10::Device device,
                                                                 std::vector<FsdpParam*> params,
                                                                 bool one_shard, bool delayed,
                                                                 bool compute_copy) {
  TORCH_INTERNAL_ASSERT(mode != Offload::kNone);
  TORCH_INTERNAL_ASSERT(compute_copy || !delayed, "a delayed update loads the compute copies");
  std::unique_ptr<HostOffload> offload(new HostOffload(mode, device));
  offload->can_delay_ = delayed;
  // Slices start at multiples of 16 elements (Note [Prepared steps]).
  FSDP_ASSIGN_OR_RETURN(std::optional<int> slice,
                        GetOptionalIntEnv(ProcessEnv(), kOffloadStepSlice.name, 16, 1 << 30));
  if (slice.has_value() && *slice % 16 != 0) {
    return absl::InvalidArgumentError(StrCat(kOffloadStepSlice.name, "=", *slice,
                                             " is not a multiple of 16; valid: ",
                                             kOffloadStepSlice.valid));
  }
  offload->step_slice_ = slice.value_or(kDefaultStepSlice);
  const std::string host_pass = GetEnvKnob(kOffloadHostPass).value_or("on");
  if (host_pass != "on" && host_pass != "off") {
    return absl::InvalidArgumentError(StrCat(kOffloadHostPass.name, "=", host_pass,
                                             ": valid: ", kOffloadHostPass.valid));
  }
  offload->host_pass_ = host_pass == "on";
  FSDP_ASSIGN_OR_RETURN(std::optional<int> host_threads,
                        GetOptionalIntEnv(ProcessEnv(), kOffloadHostThreads.name, 1, 1024));
  if (host_threads.has_value()) SetHostLoopThreads(*host_threads);
  at::NoGradGuard no_grad;
  // Layout: per dtype, each parameter's padded shard, then (trainable) its gradient buffer;
  // kParams with a narrower compute dtype: the shard's compute-dtype copy in that dtype's arena
  // (unless !compute_copy) and, with one shard, its gradient's landing buffer there (its fp32
  // gradient then in the on-demand mapping); with a delayed update (Note [Delayed parameter
  // update]) the compute-dtype copy whatever the dtype, and a second of each.
  struct Slot {
    int64_t shard = 0, grad = -1, compute = -1, compute_grad = -1;
    int64_t compute_spare = -1, compute_grad_spare = -1;
    bool grad_on_demand = false;  // Note [Gradients committed on demand]
  };
  int64_t on_demand_numel = 0;
  std::map<c10::ScalarType, int64_t> numel;
  std::vector<Slot> slots;
  auto place = [&](c10::ScalarType dtype, int64_t n) {
    const int64_t align = std::max<int64_t>(1, kAlignBytes / c10::elementSize(dtype));
    int64_t offset = RoundUp(numel[dtype], align);
    numel[dtype] = offset + n;
    return offset;
  };
  for (FsdpParam* p : params) {
    const c10::ScalarType dtype = p->padded_shard.scalar_type();
    Slot slot;
    slot.shard = place(dtype, p->padded_shard.numel());
    const bool narrower = c10::elementSize(p->compute_dtype) < c10::elementSize(dtype);
    slot.grad_on_demand = mode == Offload::kParams && narrower && one_shard &&
                          p->requires_grad && dtype == at::kFloat;
    if (slot.grad_on_demand) {
      slot.grad = on_demand_numel;
      on_demand_numel += RoundUp(p->sharded.numel(), kOnDemandAlignBytes / 4);
    } else if (p->requires_grad) {
      slot.grad = place(dtype, p->sharded.numel());
    }
    if (mode == Offload::kParams && (narrower || delayed)) {
      if (compute_copy) slot.compute = place(p->compute_dtype, p->padded_shard.numel());
      if (delayed) slot.compute_spare = place(p->compute_dtype, p->padded_shard.numel());
      if (narrower && one_shard && p->requires_grad) {
        slot.compute_grad = place(p->compute_dtype, p->sharded.numel());
        if (delayed) slot.compute_grad_spare = place(p->compute_dtype, p->sharded.numel());
      }
    }
    slots.push_back(slot);
  }
  // Pinned on a GPU: non_blocking copies from and to it are DMA transfers that overlap compute.
  const bool pinned = device.is_cuda();
  for (const auto& [dtype, n] : numel) {
    const int64_t bytes = n * static_cast<int64_t>(c10::elementSize(dtype));
    absl::StatusOr<at::Tensor> arena = HostArena(n, dtype, pinned);
    if (!arena.ok()) {
      return absl::ResourceExhaustedError(
          StrCat("parallelism.offload=", OffloadName(mode), ": cannot allocate ", GiB(bytes),
                 " GiB of ", pinned ? "pinned " : "", "host memory for the ", c10::toString(dtype),
                 " shards and gradients of this rank (", std::string(arena.status().message()),
                 "); use more ranks, more host memory, or parallelism.offload: none"));
    }
    offload->arenas_[dtype] = *std::move(arena);
  }
  if (on_demand_numel > 0) {
    absl::StatusOr<at::Tensor> arena = OnDemandHostArena(on_demand_numel);
    if (!arena.ok()) {
      return absl::ResourceExhaustedError(
          StrCat("parallelism.offload=", OffloadName(mode), ": cannot reserve ",
                 GiB(on_demand_numel * 4), " GiB of host address space for the fp32 gradients "
                 "of this rank (", std::string(arena.status().message()), ")"));
    }
    offload->on_demand_grads_ = *std::move(arena);
  }
  for (size_t i = 0; i < params.size(); ++i) {
    FsdpParam& p = *params[i];
    const at::Tensor& arena = offload->arenas_.at(p.padded_shard.scalar_type());
    p.host_shard = Carve(arena, slots[i].shard, p.padded_shard.sizes());
    p.host_shard.copy_(p.padded_shard);
    // The master: the real rows, at the start of the padded shard (padding rows stay zero).
    at::Tensor master = Carve(arena, slots[i].shard, p.sharded.sizes());
    master.set_requires_grad(p.requires_grad);
    p.sharded = master;
    if (slots[i].grad_on_demand) {
      p.host_grad = Carve(offload->on_demand_grads_, slots[i].grad, p.sharded.sizes());
      p.host_grad_on_demand = true;
    } else if (p.requires_grad) {
      p.host_grad = Carve(arena, slots[i].grad, p.sharded.sizes());
    }
    if (slots[i].compute >= 0) {
      p.host_compute_shard =
          Carve(offload->arenas_.at(p.compute_dtype), slots[i].compute, p.padded_shard.sizes());
    }
    if (slots[i].compute_grad >= 0) {
      p.host_compute_grad =
          Carve(offload->arenas_.at(p.compute_dtype), slots[i].compute_grad, p.sharded.sizes());
    }
    if (slots[i].compute_spare >= 0) {
      p.host_compute_shard_spare = Carve(offload->arenas_.at(p.compute_dtype),
                                         slots[i].compute_spare, p.padded_shard.sizes());
      p.host_compute_shard_spare.copy_(p.host_shard);
    }
    if (slots[i].compute_grad_spare >= 0) {
      p.host_compute_grad_spare = Carve(offload->arenas_.at(p.compute_dtype),
                                        slots[i].compute_grad_spare, p.sharded.sizes());
    }
    if (mode == Offload::kParams) p.padded_shard.reset();  // loaded before each all-gather
  }
  offload->params_ = std::move(params);
  offload->RefreshComputeShards();
  if (device.is_cuda()) {
    const auto* impl = c10::impl::getDeviceGuardImpl(device.type());
    offload->to_host_ = impl->getStreamFromGlobalPool(device);
  }
  return offload;
}

HostOffload::~HostOffload() {
  // The adder stops after its current task; what is still queued is dropped (a run that
  // stopped mid-backward: the gradients are not read any more).
  if (adder_.joinable()) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    changed_.notify_all();
    adder_.join();
  }
  // Copies may still read or write the host buffers (a run that stopped mid-backward).
  try {
    for (InFlight& f : in_flight_) f.done->synchronize();
    if (to_device_done_) to_device_done_->synchronize();
  } catch (const std::exception& e) {
    // A sticky CUDA error: the device runs nothing more, so no copy still touches the buffers.
    // The error is the training thread's to report; a destructor must not throw it.
    FSDP_LOG_WARN("offload: waiting for the host copies at exit failed: {}", e.what());
  }
}

// ---- parameters -------------------------------------------------------------------------------

void HostOffload::RecordHostToDevice() {
  if (!device_.is_cuda()) return;
  const auto* impl = c10::impl::getDeviceGuardImpl(device_.type());
  to_device_done_ = std::make_shared<c10::Event>(device_.type());
  to_device_done_->record(impl->getStream(device_));
}

void HostOffload::PushShards(DeviceStreams& streams) {
  if (mode_ == Offload::kParams) RefreshComputeShards();
  if (mode_ != Offload::kOptimizer) return;
  at::NoGradGuard no_grad;
  // The copy-in stream waits for the compute stream first: with one rank the unsharded
  // parameters alias the device shards, which a backward still queued there may read.
  streams.BeginCopyIn();
  RECORD_FUNCTION("fsdp::offload_push", std::vector<c10::IValue>());
  PhaseTimer timer(stats_.push_s);
  std::optional<c10::StreamGuard> on_copy_in;
  if (streams.enabled()) on_copy_in.emplace(*streams.copy_in());
  for (FsdpParam* p : params_) {
    p->padded_shard.copy_(p->host_shard, /*non_blocking=*/true);
    stats_.to_device_bytes += p->padded_shard.nbytes();
  }
  RecordHostToDevice();
}

void HostOffload::RefreshComputeShards() {
  const bool any = std::any_of(params_.begin(), params_.end(),
                               [](const FsdpParam* p) { return p->host_compute_shard.defined(); });
  if (!any) return;
  // A host->device copy still in flight may read the buffers about to be written (a load for
  // an all-gather that never came, an evaluation forward's last units).
  if (to_device_done_) to_device_done_->synchronize();
  RECORD_FUNCTION("fsdp::offload_refresh", std::vector<c10::IValue>());
  PhaseTimer timer(stats_.refresh_s);
  at::NoGradGuard no_grad;
  // The cast the device does without offload (round to nearest even; Note [CPU offload]).
  for (FsdpParam* p : params_) {
    if (p->host_compute_shard.defined()) p->host_compute_shard.copy_(p->host_shard);
  }
}

bool HostOffload::LoadShards(std::vector<FsdpParam>& params, bool wait) {
  // kOptimizer: not from a prefetch, whose copy-in stream was not ordered after the compute
  // stream, which may still read the device shards (one rank: the parameters alias them).
  if (mode_ == Offload::kOptimizer && !wait) return false;
  std::optional<std::vector<FsdpParam*>> stepped = TakeStepped(params, wait);
  if (!stepped) return false;
  if (mode_ == Offload::kOptimizer) {
    Push(*stepped);
    return true;
  }
  if (mode_ != Offload::kParams) return true;
  at::NoGradGuard no_grad;
  bool issued = false;
  for (FsdpParam& p : params) {
    if (p.padded_shard.defined()) continue;  // loaded ahead (prefetch)
    // See Note [CPU offload]: the compute-dtype copy when there is one.
    const at::Tensor& source = p.host_compute_shard.defined() ? p.host_compute_shard : p.host_shard;
    p.padded_shard = at::empty(source.sizes(), source.options().device(device_));
    p.padded_shard.copy_(source, /*non_blocking=*/true);
    loaded_bytes_ += p.padded_shard.nbytes();
    stats_.to_device_bytes += p.padded_shard.nbytes();
    issued = true;
  }
  peak_loaded_bytes_ = std::max(peak_loaded_bytes_, loaded_bytes_);
  if (issued) RecordHostToDevice();
  return true;
}

// ---- the optimizer step, overlapped -----------------------------------------------------------

void HostOffload::StepInOrder(const std::vector<std::vector<FsdpParam*>>& groups,
                              HostStep step, bool delayed) {
  TORCH_CHECK(!step_pending(), "HostOffload: a host step is already in flight");
  TORCH_CHECK(!delayed || can_delay_,
              "HostOffload: a delayed step needs FsdpOptions::offload_delayed_update");
  // Copies still reading the host shards or their compute copies (a load for an all-gather that
  // never came; offload optimizer's push of the last delayed update) finish before the adder
  // writes them: the adder waits for them, the training thread goes on.
  std::shared_ptr<c10::Event> loads_done = to_device_done_;
  ++stats_.overlapped_steps;
  if (delayed) ++stats_.delayed_steps;
  step_delayed_ = delayed;
  auto shared_step = std::make_shared<HostStep>(std::move(step));
  // Note [Deferred gradient conversion]: the clipping coefficient for the deferred gradients
  // (the device's, copied for the host: read on the adder once the copy is done).
  at::Tensor scale = std::exchange(clipped_, false) ? clip_scale_host_ : at::Tensor();
  std::shared_ptr<c10::Event> scale_ready = scale.defined() ? clip_scale_ready_ : nullptr;
  // Note [Deferred clipping multiplication]: the fp32 .grads clipping left to this step (a CPU
  // scalar, ready).
  const std::set<const FsdpParam*> to_scale = std::exchange(scale_pending_, {});
  const at::Tensor grad_scale = to_scale.empty() ? at::Tensor() : clip_scale_host_;
  // A parameter stepped in slices (Note [Deferred gradient conversion]): where its deferred
  // gradient landed (undefined: its .grad is final already), and the loaded copy its updated
  // master is cast into (undefined: none).
  struct Sliced {
    FsdpParam* p;
    at::Tensor landed, compute;
    at::Tensor scale;  // what to multiply the gradient by first (undefined: nothing)
  };
  // A delayed step runs the groups in the order the next backward sends their gradients.
  std::vector<const std::vector<FsdpParam*>*> order;
  for (const std::vector<FsdpParam*>& group : groups) order.push_back(&group);
  if (delayed) std::reverse(order.begin(), order.end());
  // Every group's job is made before the first is queued: a job removes the masters it stepped
  // from the shared step, whose can_run_slices this loop asks, so the loop must not overlap the
  // adder running the jobs queued before it (a data race on the optimizer's map of parameters,
  // found by ThreadSanitizer: docs/architecture.md).
  std::vector<std::pair<const std::vector<FsdpParam*>*, HostTask>> jobs;
  for (const std::vector<FsdpParam*>* group_ptr : order) {
    const std::vector<FsdpParam*>& group = *group_ptr;
    if (group.empty()) continue;
    std::vector<at::Tensor> masters;
    std::vector<at::Tensor> scaled_grads;  // masters' gradients, multiplied before their step
    std::vector<std::pair<at::Tensor, at::Tensor>> casts;  // (loaded copy, host_shard)
    // Stepped in slices: deferred gradients (converted and clipped there) and, with a loaded copy
    // to cast, the others too (the cast of each slice while it is in cache); the deferred ones
    // whose step cannot run slices are converted first.
    std::vector<Sliced> sliced, converted;
    bool any_deferred = false;
    for (FsdpParam* p : group) {
      // The loaded copy the update writes: with a delayed step, the one the loads do not read.
      const at::Tensor& compute = delayed ? p->host_compute_shard_spare : p->host_compute_shard;
      const bool deferred = deferred_.erase(p) > 0;
      const bool sliceable = shared_step->can_run_slices && shared_step->can_run_slices(p->sharded);
      const bool casts_copy = mode_ == Offload::kParams && compute.defined();
      // Note [Host Adam pass]: with the one loop, every parameter it may cover goes through
      // StepInSlices, which tries it first (an fp32 gradient too: several shards, gradients
      // summed on the host, fp32 compute, offload optimizer).
      const bool one_loop = sliceable && host_pass_ && shared_step->run_host_pass != nullptr;
      const bool scaled = to_scale.contains(p);
      stats_.clip_multiplies_deferred += scaled ? 1 : 0;
      if (deferred || (sliceable && casts_copy) || one_loop) {
        any_deferred = any_deferred || deferred;
        Sliced d{p, deferred ? p->host_compute_grad : at::Tensor(),
                 casts_copy ? compute : at::Tensor(),
                 deferred ? scale : (scaled ? grad_scale : at::Tensor())};
        if (sliceable) {
          stats_.deferred_steps += deferred ? 1 : 0;
          sliced.push_back(std::move(d));
          continue;
        }
        converted.push_back(std::move(d));
      }
      masters.push_back(p->sharded);
      if (scaled) scaled_grads.push_back(p->host_grad);
      if (casts_copy) casts.emplace_back(compute, p->host_shard);
    }
    stats_.deferred_materialized += static_cast<int64_t>(converted.size());
    HostTask task;
    task.job = [this, shared_step, masters = std::move(masters), casts = std::move(casts),
                scaled_grads = std::move(scaled_grads), sliced = std::move(sliced),
                converted = std::move(converted), scale, grad_scale,
                scale_ready = any_deferred ? scale_ready : nullptr,
                loads_done = jobs.empty() ? loads_done : nullptr] {
      RECORD_FUNCTION("fsdp::offload_host_step", std::vector<c10::IValue>());
      PhaseTimer timer(stats_.host_step_s);
      at::NoGradGuard no_grad;
      if (loads_done) loads_done->synchronize();
      if (scale_ready) scale_ready->synchronize();
      for (const Sliced& d : converted) ConvertDeferred(*d.p, d.landed, scale);
      for (const at::Tensor& g : scaled_grads) g.mul_(grad_scale);  // clipping's
      if (!masters.empty()) shared_step->run(masters);
      for (const Sliced& d : sliced) StepInSlices(*d.p, d.landed, d.compute, *shared_step, d.scale);
      if (casts.empty()) return;
      PhaseTimer refresh(stats_.refresh_s);
      // The cast the device does without offload, as RefreshComputeShards.
      for (const auto& [compute, master] : casts) compute.copy_(master);
    };
    jobs.emplace_back(&group, std::move(task));
  }
  for (auto& [group, task] : jobs) {
    const uint64_t seq = EnqueueTask(std::move(task));
    for (FsdpParam* p : *group) step_task_[p] = seq;
  }
  // Note [Delayed parameter update]: the next backward's gradients land in the other buffer.
  if (delayed) {
    for (FsdpParam* p : params_) std::swap(p->host_compute_grad, p->host_compute_grad_spare);
  }
}

void HostOffload::ConvertDeferred(FsdpParam& p, const at::Tensor& landed, const at::Tensor& scale) {
  at::NoGradGuard no_grad;
  p.host_grad.copy_(landed.view(p.host_grad.sizes()));  // exact: a wider dtype
  if (scale.defined()) p.host_grad.mul_(scale);  // clipping's multiplication
}

void HostOffload::StepInSlices(FsdpParam& p, const at::Tensor& landed_grad,
                               const at::Tensor& compute_shard, const HostStep& step,
                               const at::Tensor& scale) {
  at::NoGradGuard no_grad;
  const at::Tensor master = p.sharded.view(-1);
  const at::Tensor grad = p.host_grad.view(-1);
  const at::Tensor landed = landed_grad.defined() ? landed_grad.view(-1) : at::Tensor();
  const at::Tensor compute = compute_shard.defined() ? compute_shard.view(-1) : at::Tensor();
  const int64_t n = master.numel();
  // The optimizer's one loop over the elements (Note [Host Adam pass]): from a deferred bf16
  // gradient, which it converts and clips (host_grad stays unwritten: its .grad slot is empty
  // by now), or from the fp32 gradient the step took, clipped already; it writes the loaded
  // copy itself. Else, or when it cannot, ATen's ops slice after slice, each slice converted,
  // clipped, stepped and cast, each op on ATen's intra-op threads (kDefaultStepSlice says why
  // the slices are large); or, with neither a deferred gradient nor a copy, ATen's fused step
  // on the whole tensor, as the unit's other masters.
  const bool one_loop =
      host_pass_ && step.run_host_pass &&
      step.run_host_pass(p.sharded, landed, scale.defined() ? scale.item<float>() : 1.0f,
                         compute);
  stats_.host_passes += one_loop ? 1 : 0;
  if (!one_loop && !landed.defined() && !compute.defined()) {
    if (scale.defined()) p.host_grad.mul_(scale);  // clipping's (Note [Deferred clipping ...])
    step.run({p.sharded});
    return;
  }
  for (int64_t begin = 0; !one_loop && begin < n; begin += step_slice_) {
    const int64_t len = std::min(step_slice_, n - begin);
    // A deferred gradient, converted here; then clipping's multiplication, when left to the
    // step (Note [Deferred clipping multiplication]).
    if (landed.defined() || scale.defined()) {
      at::Tensor g = grad.narrow(0, begin, len);
      if (landed.defined()) g.copy_(landed.narrow(0, begin, len));
      if (scale.defined()) g.mul_(scale);
    }
    step.run_slice(p.sharded, begin, len);
    if (compute.defined()) compute.narrow(0, begin, len).copy_(master.narrow(0, begin, len));
  }
  // The compute copy's padding rows: the cast of the master's, as the refresh does.
  if (compute.defined() && compute.numel() > n) {
    const int64_t pad = compute.numel() - n;
    compute.narrow(0, n, pad).copy_(p.host_shard.view(-1).narrow(0, n, pad));
  }
  step.slices_done(p.sharded);
}

std::optional<at::Tensor> HostOffload::ClipDeferred(const std::vector<FsdpParam*>& with_grad,
                                                    double max_norm, c10::Device device) {
  at::NoGradGuard no_grad;
  clipped_ = false;
  // Entries of parameters without a gradient now are stale (a step skipped after their
  // backward): their .grad was reset.
  std::erase_if(deferred_,
                [](const auto& entry) { return !entry.first->sharded.grad().defined(); });
  // ClipGradientsByNorm's arithmetic on the terms, in the parameters' order; one shard, so
  // nothing to sum over ranks.
  std::vector<at::Tensor> terms;
  for (FsdpParam* p : with_grad) {
    auto it = deferred_.find(p);
    if (it == deferred_.end()) break;
    terms.push_back(it->second);
  }
  if (terms.empty() || terms.size() != with_grad.size()) {
    MaterializeDeferred();
    return std::nullopt;
  }
  const ClipNorm clip = ClipNormFromTerms(terms, max_norm, device, /*sum_over=*/nullptr);
  // No clipping: clipped_ stays false, so the deferred gradients are converted unscaled.
  if (!clip.coef.defined()) return clip.norm;
  if (device.is_cuda()) {
    // A new pinned scalar each time: a delayed update may still read the last one (Note
    // [Delayed parameter update]; the caching host allocator reuses it once that is done).
    clip_scale_host_ = at::empty({}, at::TensorOptions().dtype(at::kFloat).pinned_memory(true));
    clip_scale_host_.copy_(clip.coef, /*non_blocking=*/true);
    const auto* impl = c10::impl::getDeviceGuardImpl(device.type());
    clip_scale_ready_ = std::make_shared<c10::Event>(device.type());
    clip_scale_ready_->record(impl->getStream(device));
  } else {
    clip_scale_host_ = clip.coef;
    clip_scale_ready_.reset();
  }
  clipped_ = true;
  return clip.norm;
}

void HostOffload::DeferClipMultiply(const std::vector<FsdpParam*>& with_grad, at::Tensor coef) {
  clip_scale_host_ = std::move(coef);
  clip_scale_ready_.reset();
  scale_pending_.clear();
  for (const FsdpParam* p : with_grad) scale_pending_.insert(p);
}

void HostOffload::MaterializeDeferred() {
  at::NoGradGuard no_grad;
  // Note [Deferred clipping multiplication]: the multiplications the step was to do.
  for (const FsdpParam* p : std::exchange(scale_pending_, {})) {
    FsdpParam& param = *const_cast<FsdpParam*>(p);
    WaitForHostGrad(param);
    param.host_grad.mul_(clip_scale_host_);
  }
  if (deferred_.empty()) return;
  at::Tensor scale;
  if (std::exchange(clipped_, false)) {
    if (clip_scale_ready_) clip_scale_ready_->synchronize();
    scale = clip_scale_host_;
  }
  for (auto& [p, contribution] : deferred_) {
    FsdpParam& param = *const_cast<FsdpParam*>(p);
    WaitForHostGrad(param);
    ConvertDeferred(param, param.host_compute_grad, scale);
    ++stats_.deferred_materialized;
  }
  deferred_.clear();
}

std::optional<std::vector<FsdpParam*>> HostOffload::TakeStepped(std::vector<FsdpParam>& params,
                                                                bool wait) {
  std::vector<FsdpParam*> stepped;
  // Note [Delayed parameter update]: the loads read the copies from before it; FinishStep.
  if (step_delayed_) return stepped;
  uint64_t seq = 0;
  for (FsdpParam& p : params) {
    auto it = step_task_.find(&p);
    if (it == step_task_.end()) continue;
    stepped.push_back(&p);
    seq = std::max(seq, it->second);
  }
  if (stepped.empty()) return stepped;
  if (!wait) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (finished_ < seq) return std::nullopt;  // still stepping: the unit's own unshard waits
  }
  {
    RECORD_FUNCTION("fsdp::offload_step_wait", std::vector<c10::IValue>());
    PhaseTimer timer(stats_.step_wait_s);
    WaitForTask(seq);  // rethrows the step's error
  }
  for (FsdpParam* p : stepped) step_task_.erase(p);
  return stepped;
}

void HostOffload::WaitForHostGrad(FsdpParam& p) {
  if (auto last = last_task_.find(&p); last != last_task_.end()) WaitForTask(last->second);
  WaitForDelayedStep(p);  // Note [Delayed parameter update]: it may still use host_grad
}

void HostOffload::WaitForDelayedStep(FsdpParam& p) {
  if (!step_delayed_) return;
  auto it = step_task_.find(&p);
  if (it == step_task_.end()) return;
  RECORD_FUNCTION("fsdp::offload_step_wait", std::vector<c10::IValue>());
  PhaseTimer timer(stats_.step_wait_s);
  WaitForTask(it->second);
}

void HostOffload::Push(const std::vector<FsdpParam*>& params) {
  if (params.empty()) return;
  at::NoGradGuard no_grad;
  for (FsdpParam* p : params) {
    p->padded_shard.copy_(p->host_shard, /*non_blocking=*/true);
    stats_.to_device_bytes += p->padded_shard.nbytes();
  }
  RecordHostToDevice();
}

void HostOffload::FinishStep(DeviceStreams& streams) {
  if (!step_pending()) return;
  uint64_t seq = 0;
  std::vector<FsdpParam*> stepped;
  for (const auto& [p, task] : step_task_) {
    seq = std::max(seq, task);
    stepped.push_back(p);
  }
  {
    RECORD_FUNCTION("fsdp::offload_step_wait", std::vector<c10::IValue>());
    PhaseTimer timer(stats_.step_wait_s);
    WaitForTask(seq);
  }
  step_task_.clear();
  // Note [Delayed parameter update]: the copies the update wrote are the ones to load now.
  if (std::exchange(step_delayed_, false) && mode_ == Offload::kParams) {
    for (FsdpParam* p : params_) std::swap(p->host_compute_shard, p->host_compute_shard_spare);
  }
  if (mode_ != Offload::kOptimizer) return;
  // As PushShards: the copy-in stream waits for the compute stream first.
  streams.BeginCopyIn();
  RECORD_FUNCTION("fsdp::offload_push", std::vector<c10::IValue>());
  PhaseTimer timer(stats_.push_s);
  std::optional<c10::StreamGuard> on_copy_in;
  if (streams.enabled()) on_copy_in.emplace(*streams.copy_in());
  Push(stepped);
}

void HostOffload::ReleaseShards(std::vector<FsdpParam>& params, DeviceStreams& streams) {
  if (mode_ != Offload::kParams) return;
  std::vector<at::Tensor> freed;
  for (FsdpParam& p : params) {
    if (!p.padded_shard.defined()) continue;
    loaded_bytes_ -= p.padded_shard.nbytes();
    freed.push_back(std::move(p.padded_shard));
    p.padded_shard.reset();
  }
  // The compute stream (one rank: aliased parameters) or an all-gather may still read them.
  if (!freed.empty()) streams.Stash(std::move(freed));
}

void HostOffload::WaitForShardsOnCurrentStream() {
  if (!to_device_done_) return;
  const auto* impl = c10::impl::getDeviceGuardImpl(device_.type());
  to_device_done_->block(impl->getStream(device_));
}

// ---- gradients --------------------------------------------------------------------------------

void HostOffload::ReapFinished() {
  std::vector<InFlight> still;
  for (InFlight& f : in_flight_) {
    if (!f.done->query()) still.push_back(std::move(f));
  }
  in_flight_ = std::move(still);
}

at::Tensor* HostOffload::DeviceGrad(FsdpParam& p) {
  return accumulate_on_device_ || p.device_grad.defined() ? &p.device_grad : nullptr;
}

void HostOffload::DeviceGradUpdated(FsdpParam& p) {
  if (accumulate_on_device_) return;
  SendToHost(p, p.device_grad);  // kept alive by the copy in flight (CUDA)
  p.device_grad.reset();
}

void HostOffload::AccumulateGrad(FsdpParam& p, const at::Tensor& g, bool owned) {
  at::NoGradGuard no_grad;
  if (at::Tensor* sum = DeviceGrad(p)) {
    // The additions of the run without offload (collectives.cc), on the same device.
    if (sum->defined()) {
      sum->add_(g);
    } else if (owned && g.is_contiguous() && !g.is_view()) {
      *sum = g;
    } else {
      *sum = g.clone(at::MemoryFormat::Contiguous);
    }
    DeviceGradUpdated(p);
    return;
  }
  SendToHost(p, g);
}

bool HostOffload::SendComputeGrad(FsdpParam& p, const at::Tensor& grad) {
  if (!p.host_compute_grad.defined() || accumulate_on_device_ || p.device_grad.defined() ||
      grad.scalar_type() != p.host_compute_grad.scalar_type() ||
      grad.numel() != p.host_compute_grad.numel()) {
    return false;
  }
  SendToHost(p, grad.reshape(p.sharded.sizes()));
  return true;
}

void HostOffload::SendToHost(FsdpParam& p, const at::Tensor& g) {
  at::NoGradGuard no_grad;
  at::Tensor& grad = p.sharded.mutable_grad();
  // Note [Deferred clipping multiplication]: a new gradient; the last one's step never came,
  // and its term is the old gradient's.
  scale_pending_.erase(&p);
  clip_terms_.erase(&p);
  stats_.to_host_bytes += g.nbytes();
  // Note [CPU offload], "params": the compute dtype's gradient lands in host_compute_grad.
  const bool narrow = g.scalar_type() != p.sharded.scalar_type();
  if (narrow) stats_.to_host_compute_bytes += g.nbytes();
  TORCH_INTERNAL_ASSERT(!narrow || p.host_compute_grad.defined());
  const bool add = grad.defined();
  // p's landing buffer is written again only after the adder's last task for it is done.
  if (auto last = last_task_.find(&p); last != last_task_.end()) {
    RECORD_FUNCTION("fsdp::offload_wait", std::vector<c10::IValue>());
    PhaseTimer timer(stats_.wait_s);
    WaitForTask(last->second);
  }
  // Note [Deferred gradient conversion]: a deferred gradient is converted before a second one
  // lands over it (accumulation on the host); an entry whose .grad was reset since is stale.
  auto deferred = deferred_.find(&p);
  const bool converts_deferred = deferred != deferred_.end() && add;
  // Note [Delayed parameter update]: host_grad, written here by the conversion or the copy, is
  // the .grad a delayed update may still read.
  if (converts_deferred || (!narrow && !add)) WaitForDelayedStep(p);
  if (converts_deferred) {
    ConvertDeferred(p, p.host_compute_grad, at::Tensor());
    ++stats_.deferred_materialized;
  }
  if (deferred != deferred_.end()) deferred_.erase(deferred);
  const bool defer = defer_conversion_ && narrow && !add;
  if (defer) {
    deferred_[&p] = ClipNormTerms({g}).front();  // on the device, from the bf16 values
    clipped_ = false;  // a new backward: the last coefficient is not these gradients'
  }
  // The norm's term once the .grad is complete (Note [Deferred clipping multiplication]).
  const bool term = final_gradients_ && defer_clip_multiply_ && !defer;
  if (!device_.is_cuda()) {
    // Synchronous copies; the adder does the same additions as without offload (collectives.cc).
    if (narrow) {
      p.host_compute_grad.copy_(g);
      if (!defer) Enqueue(p, {add ? grad : p.host_grad, p.host_compute_grad, add, nullptr, {}});
    } else if (add) {
      Enqueue(p, {grad, g, /*add=*/true, nullptr, {}});  // g is not written again: kept by the task
    } else {
      p.host_grad.copy_(g);
    }
    if (!add) grad = p.host_grad;
    if (term) QueueClipTerm(p, nullptr);
    return;
  }
  ReapFinished();
  const auto* impl = c10::impl::getDeviceGuardImpl(device_.type());
  c10::Event produced(device_.type());
  produced.record(impl->getStream(device_));  // the compute stream made `g`
  produced.block(*to_host_);
  c10::StreamGuard on_to_host(*to_host_);
  at::Tensor target;
  if (narrow) {
    target = p.host_compute_grad;
  } else if (add) {
    at::Tensor& staging = staging_[&p];
    if (!staging.defined()) {
      staging = at::empty(p.sharded.sizes(),
                          p.sharded.options().requires_grad(false).pinned_memory(true));
    }
    target = staging;
  } else {
    target = p.host_grad;
  }
  target.copy_(g, /*non_blocking=*/true);
  auto copied = std::make_shared<c10::Event>(device_.type());
  copied->record(*to_host_);
  in_flight_.push_back(InFlight{g, copied});
  if (defer) {
    Enqueue(p, {at::Tensor(), target, false, copied, {}});  // the landing only
  } else if (narrow || add) {
    Enqueue(p, {add ? grad : p.host_grad, target, add, copied, {}});
  }
  if (term) QueueClipTerm(p, std::move(copied));  // after p's addition: the adder is FIFO
  if (!add) grad = p.host_grad;  // not to be read before WaitForCopies
}

void HostOffload::QueueClipTerm(FsdpParam& p, std::shared_ptr<c10::Event> copied) {
  auto slot = std::make_shared<at::Tensor>();
  clip_terms_[&p] = slot;
  HostTask task;
  task.job = [this, slot, grad = p.host_grad, copied = std::move(copied)] {
    if (copied) copied->synchronize();
    RECORD_FUNCTION("fsdp::offload_clip_term", std::vector<c10::IValue>());
    PhaseTimer timer(stats_.clip_term_s);
    *slot = ClipNormTerms({grad}).front();
    ++stats_.clip_terms_on_adder;
  };
  Enqueue(p, std::move(task));
}

std::vector<at::Tensor> HostOffload::TakeClipTerms(const std::vector<FsdpParam*>& with_grad) {
  std::vector<at::Tensor> terms;
  terms.reserve(with_grad.size());
  for (const FsdpParam* p : with_grad) {
    auto it = clip_terms_.find(p);
    terms.push_back(it != clip_terms_.end() ? *it->second : at::Tensor());
  }
  clip_terms_.clear();
  return terms;
}

// ---- the adder (Note [CPU offload], "Host additions") -----------------------------------------

void HostOffload::Enqueue(FsdpParam& p, HostTask task) {
  last_task_[&p] = EnqueueTask(std::move(task));
}

uint64_t HostOffload::EnqueueTask(HostTask task) {
  if (!adder_.joinable()) adder_ = std::thread([this] { RunAdder(); });
  uint64_t seq = 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    tasks_.push_back(std::move(task));
    seq = ++queued_;
  }
  changed_.notify_all();
  return seq;
}

void HostOffload::WaitForTask(uint64_t seq) {
  std::unique_lock<std::mutex> lock(mutex_);
  changed_.wait(lock, [&] { return finished_ >= seq; });
  if (adder_error_) std::rethrow_exception(std::exchange(adder_error_, nullptr));
}

void HostOffload::RunAdder() {
  at::init_num_threads();  // ATen's intra-op threads, as on the training thread
  at::NoGradGuard no_grad;
  while (true) {
    HostTask task;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      changed_.wait(lock, [&] { return stop_ || !tasks_.empty(); });
      if (stop_) return;
      task = std::move(tasks_.front());
      tasks_.pop_front();
    }
    std::exception_ptr error;
    try {
      FinishOnHost(task);
    } catch (...) {
      error = std::current_exception();
    }
    task = HostTask{};  // the buffers' references go before the training thread reuses them
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (error && !adder_error_) adder_error_ = error;
      ++finished_;
    }
    changed_.notify_all();
  }
}

void HostOffload::FinishOnHost(const HostTask& task) {
  if (task.job) {
    task.job();
    return;
  }
  if (task.copied) task.copied->synchronize();
  if (!task.dst.defined()) return;  // a deferred gradient's landing (see SendToHost)
  RECORD_FUNCTION("fsdp::offload_host_add", std::vector<c10::IValue>());
  PhaseTimer timer(stats_.add_s);
  if (!task.add) {
    task.dst.copy_(task.src);  // exact: a wider float dtype
  } else if (task.src.scalar_type() == task.dst.scalar_type()) {
    task.dst.add_(task.src);
  } else if (std::optional<HostNarrow> narrow = OneLoopAdd(task.dst, task.src);
             host_pass_ && narrow.has_value()) {
    HostAddConverted(task.dst.data_ptr<float>(),
                     static_cast<const uint16_t*>(task.src.const_data_ptr()), *narrow,
                     task.dst.numel());
    ++stats_.host_add_passes;
  } else {
    // The adder's own scratch (only the adder runs tasks), allocated at its first addition.
    if (!add_scratch_.defined()) add_scratch_ = at::empty({step_slice_}, task.dst.options());
    AddConvertedInChunks(task.dst, task.src, add_scratch_);
  }
  if (task.add) ++stats_.host_adds;
}

void HostOffload::WaitForCopies(DeviceStreams& streams) {
  Drain();
  // The copy-in stream waits for the compute stream, so the stash may go (Note [Copy-in
  // stream]): otherwise the last units' device shards would stay allocated until the next
  // forward's first all-gather.
  if (mode_ == Offload::kParams) streams.BeginCopyIn();
}

void HostOffload::Drain() {
  RECORD_FUNCTION("fsdp::offload_wait", std::vector<c10::IValue>());
  PhaseTimer timer(stats_.wait_s);
  // The gradients' tasks, not a step's queued before them: its groups are waited for by the
  // loads, by FinishStep, or (a delayed one: Note [Delayed parameter update]) by the gradients
  // that would write what it reads, so that it runs through every micro-batch of the next step.
  uint64_t last_gradient = 0;
  for (const auto& [p, seq] : last_task_) last_gradient = std::max(last_gradient, seq);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (last_gradient > finished_) stats_.late_adds += static_cast<int64_t>(last_gradient - finished_);
  }
  for (InFlight& f : in_flight_) f.done->synchronize();
  in_flight_.clear();
  if (to_device_done_) to_device_done_->synchronize();
  last_task_.clear();
  WaitForTask(last_gradient);  // also rethrows an earlier task's error
}

void AddModelStateBytes(const FsdpParam& p, ModelStateBytes& bytes) {
  auto size = [](const at::Tensor& t) {
    return t.defined() ? static_cast<int64_t>(t.nbytes()) : 0;
  };
  bytes.device += size(p.padded_shard) + size(p.device_grad);
  if (p.host_shard.defined()) {
    bytes.host += size(p.host_shard) + size(p.host_compute_shard) + size(p.host_compute_grad) +
                  size(p.host_compute_shard_spare) + size(p.host_compute_grad_spare);
    // Note [Gradients committed on demand]: its written part by CountResidentBytes.
    (p.host_grad_on_demand ? bytes.host_untouched : bytes.host) += size(p.host_grad);
  } else {
    bytes.device += size(p.sharded.grad());
  }
}

void CountResidentBytes(const FsdpParam& p, ModelStateBytes& bytes) {
  if (!p.host_grad_on_demand) return;
  const int64_t resident = ResidentBytes(p.host_grad.data_ptr(), p.host_grad.nbytes());
  bytes.host += resident;
  bytes.host_untouched -= resident;
}

}  // namespace fsdp
