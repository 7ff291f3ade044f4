// Internal to sharding/offload/: the host memory of CPU offload. HostBuffers allocates, once at
// wrap time, one arena per dtype (page-locked on CUDA) and, for gradients that only the host
// writes, a mapping committed on demand; it carves each parameter's buffers out of them into a
// HostShard and points FsdpParam::host at it. Note [CPU offload] (host_offload.h) says what each
// buffer is for.
//
// Cross-rank contract: none; every buffer is local to the rank.
//
//   FSDP_ASSIGN_OR_RETURN(HostBuffers buffers,
//                         HostBuffers::Allocate(Offload::kParams, device, params, layout));
//   params[0]->host->shard;  // the padded shard in host memory; params[0]->sharded its rows
//   ModelStateBytes bytes;
//   AddModelStateBytes(*params[0], bytes);
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "absl/status/statusor.h"
#include "sharding/fsdp_param.h"
#include "sharding/model_state_bytes.h"
#include "sharding/options.h"

namespace fsdp {

// The host side of one offloaded parameter (FsdpParam::host). Tensors are undefined where the
// configuration has no use for them.
struct HostShard {
  // padded_shard's layout in host memory; its real rows are the master (FsdpParam::sharded,
  // Note [CPU offload]).
  at::Tensor shard;
  // kParams, compute dtype narrower than the shard's (or any, with a delayed update): `shard`
  // cast to it, what is loaded.
  at::Tensor compute_shard;
  // Trainable only: sharded's shape; becomes sharded's .grad. Its pages are committed when
  // first written when grad_on_demand (Note [Gradients committed on demand], host_buffers.cc).
  at::Tensor grad;
  bool grad_on_demand = false;
  // kParams, one shard, trainable, compute dtype narrower: sharded's shape in the compute
  // dtype; where each backward's gradient lands before `grad`.
  at::Tensor compute_grad;
  // With a delayed update (Note [Delayed parameter update], host_step.h): the second buffer of
  // compute_shard and compute_grad, written by the update in flight while the next step reads
  // (compute_shard) or writes (compute_grad) the first.
  at::Tensor compute_shard_spare;
  at::Tensor compute_grad_spare;
  // Between backwards that accumulate on the device: sharded's shape and dtype, on the device
  // (Note [CPU offload], "Accumulating on the device").
  at::Tensor device_grad;
  // CUDA, allocated the first time an fp32 gradient is added on the host: pinned, sharded's
  // shape; where that gradient lands before the addition.
  at::Tensor staging;
  // The adder's last task queued for this parameter's gradient (HostWorker's number), until the
  // end of backward; 0: none.
  uint64_t last_task = 0;
};

// What HostBuffers::Allocate lays out besides each padded shard and gradient buffer.
struct HostBufferLayout {
  bool one_shard = false;    // gradients arrive unreduced: kParams lands narrower ones as is
  bool delayed = false;      // the second buffers of Note [Delayed parameter update]
  bool compute_copy = true;  // kParams keeps the compute-dtype copies of the shards
};

class HostBuffers {
 public:
  // Allocates the host memory of `params` (kResourceExhausted naming parallelism.offload when
  // it cannot), copies each padded shard in, points p->host at its HostShard and p->sharded at
  // its master, and with kParams frees the device shards. The compute-dtype copies are not
  // filled (HostOffload::RefreshComputeShards), except the spare ones.
  static absl::StatusOr<std::unique_ptr<HostBuffers>> Allocate(
      Offload mode, c10::Device device, const std::vector<FsdpParam*>& params,
      const HostBufferLayout& layout);

  HostBuffers(const HostBuffers&) = delete;
  HostBuffers& operator=(const HostBuffers&) = delete;

 private:
  HostBuffers() = default;

  std::map<c10::ScalarType, at::Tensor> arenas_;  // 1-D each: shards (host and compute copies)
                                                  // and gradient buffers
  // Note [Gradients committed on demand]: 1-D fp32, the gradients that land in the compute
  // dtype; pages taken when first written.
  at::Tensor on_demand_grads_;
  std::vector<HostShard> shards_;  // one per parameter, in Allocate's order; never resized
};

// Adds p's shard and gradient bytes to `bytes` (the shards' gradients as they are now; with
// offload, a gradient sum kept on the device counts as device bytes). A gradient committed on
// demand counts whole as host_untouched: CountResidentBytes moves its written part to host.
void AddModelStateBytes(const FsdpParam& p, ModelStateBytes& bytes);
// Moves what is resident of p's gradient committed on demand (if it has one) from
// bytes.host_untouched to bytes.host. Asks the kernel about every page (mincore): not for
// every step.
void CountResidentBytes(const FsdpParam& p, ModelStateBytes& bytes);

}  // namespace fsdp
