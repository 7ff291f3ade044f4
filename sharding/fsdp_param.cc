#include "sharding/fsdp_param.h"

#include <ATen/ATen.h>
#include <c10/core/StorageImpl.h>

namespace fsdp {

int64_t FsdpParam::unsharded_nbytes() const {
  return sharding.padded_numel() * c10::elementSize(compute_dtype);
}

bool FsdpParam::unsharded_allocated() const {
  return param.storage().unsafeGetStorageImpl()->nbytes() > 0;
}

// See Note [Freeing unsharded storage].
void FsdpParam::AllocateUnsharded() {
  c10::StorageImpl* storage = param.storage().unsafeGetStorageImpl();
  if (storage->nbytes() > 0) return;
  size_t nbytes = static_cast<size_t>(unsharded_nbytes());
  storage->set_data_ptr_noswap(storage->allocator()->allocate(nbytes));
  storage->set_nbytes(nbytes);
}

void FsdpParam::AliasShard() {
  c10::StorageImpl* storage = param.storage().unsafeGetStorageImpl();
  // Non-owning: padded_shard lives as long as this FsdpParam.
  storage->set_data_ptr_noswap(c10::DataPtr(padded_shard.data_ptr(), padded_shard.device()));
  storage->set_nbytes(static_cast<size_t>(unsharded_nbytes()));
}

void FsdpParam::FreeUnsharded() {
  c10::StorageImpl* storage = param.storage().unsafeGetStorageImpl();
  storage->set_data_ptr_noswap(c10::DataPtr(nullptr, storage->device()));
  storage->set_nbytes(0);
}

at::Tensor FsdpParam::UnshardedFlat() const {
  // A fresh TensorImpl on P's storage: its own version counter and no autograd meta.
  at::Tensor alias = at::empty({0}, param.options().requires_grad(false));
  alias.set_(param.storage(), 0, {sharding.padded_numel()}, {1});
  return alias;
}

}  // namespace fsdp
