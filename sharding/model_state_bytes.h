// Bytes of model state (parameter shards and their gradients) by where they live: what
// FsdpModel::model_state_bytes() returns and the trainer logs. The optimizer's state is its
// owner's to count (it lives with the parameters it steps).
//
//   ModelStateBytes bytes = sharded->model_state_bytes();
//   int64_t host = bytes.host + bytes.host_untouched;  // reserved on the host
#pragma once

#include <cstdint>

namespace fsdp {

struct ModelStateBytes {
  int64_t device = 0;  // padded shards and gradient shards resident on the device
  int64_t host = 0;    // offload: host shards (with their compute-dtype copies) and
                       // gradient buffers, those committed on demand as far as written
  int64_t host_untouched = 0;  // gradient buffers committed on demand, the part never written
                               // (Note [Gradients committed on demand] in
                               // sharding/offload/host_buffers.cc)
};

}  // namespace fsdp
