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

struct FsdpParam {
  std::vector<std::string> names;  // every name of this tensor (tied parameters have several)
  at::Tensor param;                // P: the module's tensor; full shape, compute dtype
  ParamSharding sharding;
  at::Tensor padded_shard;  // [rows_per_shard, ...] original dtype; padding rows stay zero;
                            // offload params: allocated only around the unit's all-gather,
                            // in host_compute_shard's dtype when there is one
  at::Tensor sharded;       // leaf aliasing padded_shard's real rows: the optimizer's tensor
                            // (offload: host_shard's real rows, Note [CPU offload])
  at::Tensor host_shard;    // offload only: padded_shard's layout in host memory
  at::Tensor host_compute_shard;  // offload params, compute dtype narrower than the shard's
                                  // (or any, with a delayed update): host_shard cast to it,
                                  // what is loaded (Note [CPU offload])
  at::Tensor host_grad;     // offload, trainable only: sharded's shape, host; becomes its .grad
  bool host_grad_on_demand = false;  // host_grad's pages are committed when first written
                                     // (Note [Gradients committed on demand], offload.cc)
  at::Tensor host_compute_grad;  // offload params, one shard, trainable, compute dtype narrower:
                                 // sharded's shape in the compute dtype, host; where each
                                 // backward's gradient lands before host_grad (Note [CPU offload])
  // Offload with a delayed update (Note [Delayed parameter update] in offload.h): the second
  // buffer of each of the two above, written by the update in flight while the next step reads
  // (host_compute_shard) or writes (host_compute_grad) the first.
  at::Tensor host_compute_shard_spare;
  at::Tensor host_compute_grad_spare;
  at::Tensor device_grad;   // offload, between backwards that accumulate on the device:
                            // sharded's shape and dtype, on the device (Note [CPU offload])
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
