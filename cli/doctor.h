// `fsdp doctor`: the first thing to run on a new cluster. Under any launcher it prints
// versions, devices and this rank's place in the mesh, then checks all-reduce, all-gather into
// one tensor and reduce-scatter on every mesh axis against closed-form values and reports bus
// bandwidth per collective and size (nccl-tests' definition). Exit code 1 on any wrong element
// on any rank, 2 on bad options or environment (--device cuda without a GPU), 3 when the
// rendezvous or a collective fails.
//
//   build/bin/fsdp launch --nproc-per-node 4 -- build/bin/fsdp doctor --mesh 2,2
#pragma once

#include <cstdint>
#include <string>

namespace fsdp {

struct DoctorOptions {
  std::string mesh;             // "" = 1-D over the world; see ParseMeshSpec
  std::string device = "auto";  // cpu | cuda | auto
  std::string backend = "nccl";  // for CUDA tensors: nccl | gloo
  std::string cpu_collectives = "p2p";  // CPU all-gather / reduce-scatter: p2p | gloo
  int64_t min_bytes = 1 << 10;
  int64_t max_bytes = 4 << 20;
  int iters = 5;
  int warmup = 1;
  int timeout_s = 120;
};

int RunDoctor(const DoctorOptions& options);

}  // namespace fsdp
