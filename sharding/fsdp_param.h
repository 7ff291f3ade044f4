// Internal to sharding/: one sharded parameter (FsdpParam): its shard, the optimizer's view of
// it, and the module's full-shape tensor whose storage is allocated only while unsharded.
//
// Note [Freeing unsharded storage]
// The module keeps its own handle to each parameter tensor (P), and autograd saves P (or views
// of it) for backward. So P's TensorImpl never changes: only the bytes of its StorageImpl are
// released (nbytes 0) after forward and allocated again before backward, and writes into it go
// through an alias tensor with its own version counter, so autograd's saved-tensor version
// check never sees them.
//
//   FsdpParam& p = ...;
//   p.AllocateUnsharded();                    // P's storage: padded_numel, compute dtype
//   p.UnshardedFlat().copy_(gathered);        // 1-D alias outside autograd
//   p.FreeUnsharded();                        // nbytes 0; P's TensorImpl unchanged
#pragma once

#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "sharding/shard_layout.h"

namespace fsdp {

struct HostShard;

struct FsdpParam {
  std::vector<std::string> names;  // every name of this tensor (tied parameters have several)
  at::Tensor param;                // P: the module's tensor; full shape, compute dtype
  ParamSharding sharding;
  at::Tensor padded_shard;  // [rows_per_shard, ...] original dtype; padding rows stay zero;
                            // offload params: allocated only around the unit's all-gather,
                            // in host->compute_shard's dtype when there is one
  at::Tensor sharded;       // leaf aliasing padded_shard's real rows: the optimizer's tensor
                            // (offload: host->shard's real rows, Note [CPU offload])
  HostShard* host = nullptr;  // offload only: its host buffers (sharding/offload/host_buffers.h,
                              // owned by HostOffload)
  bool requires_grad = false;
  c10::ScalarType compute_dtype = c10::kFloat;
  // Trainable only: 0 elements; P's .grad from the end of a backward that left P without one
  // until the next backward starts, so that module->zero_grad() is seen (Note [zero_grad on
  // the module] in fsdp_model.h). grad_sentinel_set: it was put there by the last backward.
  at::Tensor grad_sentinel;
  bool grad_sentinel_set = false;

  int64_t unsharded_nbytes() const;
  bool unsharded_allocated() const;
  void AllocateUnsharded();
  // P's storage is padded_shard's memory (Note [One shard]: one shard, same dtype).
  void AliasShard();
  void FreeUnsharded();
  // 1-D alias of P's whole (padded) storage in the compute dtype, outside autograd.
  at::Tensor UnshardedFlat() const;
};

}  // namespace fsdp
