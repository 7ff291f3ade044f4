// Sharded-vs-single-process parity, shared by the CPU suite (fsdp_parity_test.cc) and the
// CUDA variants (gpu_test.cc): train the tiny GPT for 10 optimizer steps with gradient clipping
// and two micro-batches per step, sharded over real processes, and compare every step's loss,
// gradient norm, gradients and every local shard against a single-process reference that each
// rank computes itself: on the whole global batch in fp32; in bf16 slice by slice with the
// engine's mixed-precision arithmetic (Note [Mixed-precision gradients, exactly], parity.cc).
#pragma once

#include <string>

namespace fsdp::testing {

enum class Accumulate { kReduceEveryMicroBatch, kNoSyncUntilLast, kNoAllReduceUntilLast };

struct ParityCase {
  std::string strategy;
  int world;
  int replicate = 1;      // hybrid strategies
  int reshard_group = 0;  // reshard_after_forward = k
  Accumulate accumulate = Accumulate::kReduceEveryMicroBatch;
  bool bf16 = false;
  std::string device = "cpu";        // "cuda": model, reference and data on this rank's GPU
  std::string cuda_backend = "nccl";  // for CUDA tensors
  // reshard_between_micro_batches = false: units gathered once per step (Note [Keeping
  // parameters across micro-batches] in sharding/fsdp_model.h).
  bool keep = false;
  // CPU all-gather / reduce-scatter: "p2p" (straight from and into the parameters) or "gloo"
  // (the flat buffers: the copy-in, copy-out and gradient packing that NCCL runs use).
  std::string cpu_collectives = "p2p";
  std::string Name() const;
};

void PrintTo(const ParityCase& c, std::ostream* os);

// The body of one rank (inside RunOnRanks).
void RunParity(const ParityCase& c, int rank);

}  // namespace fsdp::testing
