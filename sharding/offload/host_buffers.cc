#include "sharding/offload/host_buffers.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>
#include <utility>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/strides.h>

#include "common/status.h"
#include "common/strings.h"
#include "device_mesh/cuda_support.h"
#include "sharding/memory_tracker.h"

namespace fsdp {
namespace {

// Host buffers start on 64-byte boundaries (a cache line; the fused optimizer's vectors).
constexpr int64_t kAlignBytes = 64;

int64_t RoundUp(int64_t n, int64_t multiple) { return (n + multiple - 1) / multiple * multiple; }

double GiB(int64_t bytes) { return static_cast<double>(bytes) / (1 << 30); }

// A tensor of `sizes` over `arena`'s memory from element `offset`: a fresh TensorImpl, not a
// view, so that it can be an optimizer's parameter or a .grad (zero_grad detaches .grad in
// place, which a view refuses).
at::Tensor Carve(const at::Tensor& arena, int64_t offset, at::IntArrayRef sizes) {
  at::Tensor t = at::empty({0}, arena.options());
  t.set_(arena.storage(), offset, sizes, c10::contiguous_strides(sizes));
  return t;
}

// Note [Gradients committed on demand]
// With offload params and one shard in a narrower compute dtype, each gradient lands in bf16
// (HostShard::compute_grad) and the fp32 HostShard::grad is written only by the host:
// converting or adding into it (several micro-batches summed on the host), or a deferred
// gradient materialized. With the deferred conversion and the optimizer's one loop (Note
// [Deferred gradient conversion]) nothing writes it at all. So those gradients are not in the
// pinned arena (no copy ever targets them) but in an anonymous mapping reserved without
// committing memory (MAP_NORESERVE): a page takes host memory when it is first written, and one
// never written takes none. Each starts on a 64 KiB boundary (a page for every page size of
// Linux on x86-64 and ARM64) and the mapping takes no transparent huge pages (a write would
// commit the 2 MiB around it), so that a gradient's pages are its own, and ModelStateBytes
// counts what is resident (mincore) in `host` and the rest in `host_untouched` (on a CPU device
// the resident part counts in DevicePeakBytes too, as the arena's allocations do:
// memory_tracker.h).
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

// 1-D, `numel` elements of `dtype` in host memory, page-locked when `pinned` (cudaHostAlloc,
// exactly its size: libtorch's pinned allocator would round it up to a power of two).
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

// Where a parameter's buffers start in their arenas (elements); -1: none.
struct Slot {
  int64_t shard = 0, grad = -1, compute = -1, compute_grad = -1;
  int64_t compute_spare = -1, compute_grad_spare = -1;
  bool grad_on_demand = false;  // `grad` is in the on-demand mapping
};

}  // namespace

absl::StatusOr<std::unique_ptr<HostBuffers>> HostBuffers::Allocate(
    Offload mode, c10::Device device, const std::vector<FsdpParam*>& params,
    const HostBufferLayout& layout) {
  std::unique_ptr<HostBuffers> buffers(new HostBuffers());
  at::NoGradGuard no_grad;
  // Layout: per dtype, each parameter's padded shard, then (trainable) its gradient buffer;
  // kParams with a narrower compute dtype: the shard's compute-dtype copy in that dtype's arena
  // (unless !compute_copy) and, with one shard, its gradient's landing buffer there (its fp32
  // gradient then in the on-demand mapping); with a delayed update (Note [Delayed parameter
  // update]) the compute-dtype copy whatever the dtype, and a second of each.
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
    slot.grad_on_demand = mode == Offload::kParams && narrower && layout.one_shard &&
                          p->requires_grad && dtype == at::kFloat;
    if (slot.grad_on_demand) {
      slot.grad = on_demand_numel;
      on_demand_numel += RoundUp(p->sharded.numel(), kOnDemandAlignBytes / 4);
    } else if (p->requires_grad) {
      slot.grad = place(dtype, p->sharded.numel());
    }
    if (mode == Offload::kParams && (narrower || layout.delayed)) {
      if (layout.compute_copy) slot.compute = place(p->compute_dtype, p->padded_shard.numel());
      if (layout.delayed) slot.compute_spare = place(p->compute_dtype, p->padded_shard.numel());
      if (narrower && layout.one_shard && p->requires_grad) {
        slot.compute_grad = place(p->compute_dtype, p->sharded.numel());
        if (layout.delayed) {
          slot.compute_grad_spare = place(p->compute_dtype, p->sharded.numel());
        }
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
    buffers->arenas_[dtype] = *std::move(arena);
  }
  if (on_demand_numel > 0) {
    absl::StatusOr<at::Tensor> arena = OnDemandHostArena(on_demand_numel);
    if (!arena.ok()) {
      return absl::ResourceExhaustedError(StrCat(
          "parallelism.offload=", OffloadName(mode), ": cannot reserve ", GiB(on_demand_numel * 4),
          " GiB of host address space for the fp32 gradients of this rank (",
          std::string(arena.status().message()), ")"));
    }
    buffers->on_demand_grads_ = *std::move(arena);
  }
  buffers->shards_.resize(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    FsdpParam& p = *params[i];
    HostShard& h = buffers->shards_[i];
    const Slot& slot = slots[i];
    const at::Tensor& arena = buffers->arenas_.at(p.padded_shard.scalar_type());
    h.shard = Carve(arena, slot.shard, p.padded_shard.sizes());
    h.shard.copy_(p.padded_shard);
    // The master: the real rows, at the start of the padded shard (padding rows stay zero).
    at::Tensor master = Carve(arena, slot.shard, p.sharded.sizes());
    master.set_requires_grad(p.requires_grad);
    p.sharded = master;
    if (slot.grad_on_demand) {
      h.grad = Carve(buffers->on_demand_grads_, slot.grad, p.sharded.sizes());
      h.grad_on_demand = true;
    } else if (p.requires_grad) {
      h.grad = Carve(arena, slot.grad, p.sharded.sizes());
    }
    if (slot.compute >= 0) {
      h.compute_shard =
          Carve(buffers->arenas_.at(p.compute_dtype), slot.compute, p.padded_shard.sizes());
    }
    if (slot.compute_grad >= 0) {
      h.compute_grad =
          Carve(buffers->arenas_.at(p.compute_dtype), slot.compute_grad, p.sharded.sizes());
    }
    if (slot.compute_spare >= 0) {
      h.compute_shard_spare =
          Carve(buffers->arenas_.at(p.compute_dtype), slot.compute_spare, p.padded_shard.sizes());
      h.compute_shard_spare.copy_(h.shard);
    }
    if (slot.compute_grad_spare >= 0) {
      h.compute_grad_spare =
          Carve(buffers->arenas_.at(p.compute_dtype), slot.compute_grad_spare, p.sharded.sizes());
    }
    p.host = &h;
    if (mode == Offload::kParams) p.padded_shard.reset();  // loaded before each all-gather
  }
  return buffers;
}

void AddModelStateBytes(const FsdpParam& p, ModelStateBytes& bytes) {
  auto size = [](const at::Tensor& t) {
    return t.defined() ? static_cast<int64_t>(t.nbytes()) : 0;
  };
  bytes.device += size(p.padded_shard);
  if (p.host == nullptr) {
    bytes.device += size(p.sharded.grad());
    return;
  }
  const HostShard& h = *p.host;
  bytes.device += size(h.device_grad);
  bytes.host += size(h.shard) + size(h.compute_shard) + size(h.compute_grad) +
                size(h.compute_shard_spare) + size(h.compute_grad_spare);
  // Note [Gradients committed on demand]: its written part by CountResidentBytes.
  (h.grad_on_demand ? bytes.host_untouched : bytes.host) += size(h.grad);
}

void CountResidentBytes(const FsdpParam& p, ModelStateBytes& bytes) {
  if (p.host == nullptr || !p.host->grad_on_demand) return;
  const int64_t resident = ResidentBytes(p.host->grad.data_ptr(), p.host->grad.nbytes());
  bytes.host += resident;
  bytes.host_untouched -= resident;
}

}  // namespace fsdp
