// Parity of every strategy with a single-process reference on CPU, over Gloo: see parity.h.
#include <gtest/gtest.h>

#include "tests/multirank.h"
#include "tests/parity.h"

namespace fsdp::testing {
namespace {

class ParityTest : public ::testing::TestWithParam<ParityCase> {};

TEST_P(ParityTest, MatchesSingleProcessReference) {
  const ParityCase c = GetParam();
  RunOnRanks(c.world, [&](int rank) { RunParity(c, rank); });
}

std::vector<ParityCase> Cases() {
  std::vector<ParityCase> cases;
  for (int w : {1, 2, 3, 4}) cases.push_back({"full_shard", w});
  for (int w : {1, 2, 3, 4}) cases.push_back({"shard_grad_op", w});
  for (int w : {2, 3, 4}) cases.push_back({"no_shard", w});
  cases.push_back({"hybrid_shard", 2, 2});
  cases.push_back({"hybrid_shard", 4, 2});
  cases.push_back({"hybrid_shard_zero2", 4, 2});
  cases.push_back({"full_shard", 4, 1, 2});
  cases.push_back({"full_shard", 2, 1, 0, Accumulate::kNoSyncUntilLast});
  cases.push_back({"hybrid_shard", 4, 2, 0, Accumulate::kNoAllReduceUntilLast});
  cases.push_back({"full_shard", 3, 1, 0, Accumulate::kReduceEveryMicroBatch, true});
  cases.push_back({"full_shard", 4, 1, 0, Accumulate::kReduceEveryMicroBatch, true});
  cases.push_back({"hybrid_shard", 4, 2, 0, Accumulate::kReduceEveryMicroBatch, true});
  // bf16 with no_sync: the micro-batches' gradients added in bf16 before the reduction.
  cases.push_back({"full_shard", 2, 1, 0, Accumulate::kNoSyncUntilLast, true});
  // One rank, bf16: the gradients added into the fp32 shards' .grad in place.
  cases.push_back({"full_shard", 1, 1, 0, Accumulate::kReduceEveryMicroBatch, true});
  // Units kept unsharded across the micro-batches of a step.
  for (ParityCase c : {ParityCase{"full_shard", 2}, ParityCase{"shard_grad_op", 3},
                       ParityCase{"full_shard", 2, 1, 0, Accumulate::kNoSyncUntilLast},
                       ParityCase{"full_shard", 1, 1, 0, Accumulate::kReduceEveryMicroBatch, true},
                       ParityCase{"hybrid_shard", 4, 2, 0, Accumulate::kNoAllReduceUntilLast}}) {
    c.keep = true;
    cases.push_back(c);
  }
  // Through the flat buffers (cpu_collectives: gloo), the path of every NCCL run: the shards
  // copied into one all-gather input (cast to bf16), the output copied out per parameter, the
  // gradients packed by rows with padding (3 ranks: uneven shards) for one reduce-scatter.
  for (ParityCase c : {ParityCase{"full_shard", 4},
                       ParityCase{"full_shard", 3, 1, 0, Accumulate::kReduceEveryMicroBatch, true},
                       ParityCase{"full_shard", 4, 1, 0, Accumulate::kReduceEveryMicroBatch, true},
                       ParityCase{"shard_grad_op", 2},
                       ParityCase{"full_shard", 4, 1, 2},
                       ParityCase{"hybrid_shard", 4, 2, 0, Accumulate::kNoAllReduceUntilLast},
                       ParityCase{"full_shard", 2, 1, 0, Accumulate::kNoSyncUntilLast, false,
                                  "cpu", "nccl", /*keep=*/true}}) {
    c.cpu_collectives = "gloo";
    cases.push_back(c);
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Strategies, ParityTest, ::testing::ValuesIn(Cases()),
                         [](const ::testing::TestParamInfo<ParityCase>& info) {
                           return info.param.Name();
                         });

}  // namespace
}  // namespace fsdp::testing
