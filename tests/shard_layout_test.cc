#include "sharding/shard_layout.h"

#include <cstdint>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "sharding/offload/offload_plan.h"
#include "sharding/options.h"

namespace fsdp {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

std::vector<int64_t> AllLocalRows(const ParamSharding& s) {
  std::vector<int64_t> rows;
  for (int k = 0; k < s.num_shards; ++k) rows.push_back(s.LocalRows(k));
  return rows;
}

TEST(ShardParamTest, ScalarCountsAsOneRow) {
  ParamSharding s = ShardParam({}, 4);
  EXPECT_THAT(s.shape, IsEmpty());
  EXPECT_EQ(s.dim0, 1);
  EXPECT_EQ(s.row_numel, 1);
  EXPECT_EQ(s.numel(), 1);
  EXPECT_EQ(s.rows_per_shard, 1);
  EXPECT_EQ(s.padded_rows(), 4);
  EXPECT_EQ(s.padded_numel(), 4);
  EXPECT_EQ(s.shard_numel(), 1);
  EXPECT_THAT(AllLocalRows(s), ElementsAre(1, 0, 0, 0));
  EXPECT_THAT(s.LocalShape(0), ElementsAre(1));
  EXPECT_THAT(s.LocalShape(3), ElementsAre(0));
}

TEST(ShardParamTest, OneDimensionalUnevenSplit) {
  ParamSharding s = ShardParam({10}, 4);
  EXPECT_EQ(s.dim0, 10);
  EXPECT_EQ(s.row_numel, 1);
  EXPECT_EQ(s.rows_per_shard, 3);
  EXPECT_EQ(s.padded_rows(), 12);
  EXPECT_EQ(s.padded_numel(), 12);
  EXPECT_EQ(s.shard_numel(), 3);
  EXPECT_THAT(AllLocalRows(s), ElementsAre(3, 3, 3, 1));
  EXPECT_EQ(s.FirstRow(3), 9);
  EXPECT_THAT(s.LocalShape(0), ElementsAre(3));
  EXPECT_THAT(s.LocalShape(3), ElementsAre(1));
}

TEST(ShardParamTest, ThreeDimensionalUnevenSplit) {
  ParamSharding s = ShardParam({10, 4, 5}, 4);
  EXPECT_EQ(s.dim0, 10);
  EXPECT_EQ(s.row_numel, 20);
  EXPECT_EQ(s.numel(), 200);
  EXPECT_EQ(s.rows_per_shard, 3);
  EXPECT_EQ(s.shard_numel(), 60);
  EXPECT_EQ(s.padded_numel(), 240);
  EXPECT_THAT(AllLocalRows(s), ElementsAre(3, 3, 3, 1));
  EXPECT_THAT(s.LocalShape(0), ElementsAre(3, 4, 5));
  EXPECT_THAT(s.LocalShape(3), ElementsAre(1, 4, 5));
  EXPECT_THAT(s.shape, ElementsAre(10, 4, 5));
}

TEST(ShardParamTest, SevenRowsOverThree) {
  ParamSharding s = ShardParam({7, 2}, 3);
  EXPECT_EQ(s.rows_per_shard, 3);
  EXPECT_EQ(s.padded_rows(), 9);
  EXPECT_THAT(AllLocalRows(s), ElementsAre(3, 3, 1));
  EXPECT_THAT(s.LocalShape(2), ElementsAre(1, 2));
}

TEST(ShardParamTest, FewerRowsThanShardsLeavesLaterShardsEmpty) {
  ParamSharding one = ShardParam({1, 8}, 4);
  EXPECT_EQ(one.rows_per_shard, 1);
  EXPECT_EQ(one.shard_numel(), 8);
  EXPECT_EQ(one.padded_numel(), 32);
  EXPECT_THAT(AllLocalRows(one), ElementsAre(1, 0, 0, 0));
  EXPECT_GE(one.FirstRow(3), one.dim0);
  EXPECT_THAT(one.LocalShape(2), ElementsAre(0, 8));

  ParamSharding three = ShardParam({3, 2}, 4);
  EXPECT_EQ(three.rows_per_shard, 1);
  EXPECT_THAT(AllLocalRows(three), ElementsAre(1, 1, 1, 0));
  EXPECT_THAT(three.LocalShape(3), ElementsAre(0, 2));
}

TEST(ShardParamTest, EvenSplitHasNoPadding) {
  ParamSharding s = ShardParam({12, 3}, 4);
  EXPECT_EQ(s.rows_per_shard, 3);
  EXPECT_EQ(s.padded_rows(), s.dim0);
  EXPECT_EQ(s.padded_numel(), s.numel());
  EXPECT_THAT(AllLocalRows(s), ElementsAre(3, 3, 3, 3));
}

TEST(ShardParamTest, SingleShardHoldsEverything) {
  ParamSharding s = ShardParam({5, 3}, 1);
  EXPECT_EQ(s.rows_per_shard, 5);
  EXPECT_EQ(s.padded_numel(), s.numel());
  EXPECT_EQ(s.shard_numel(), 15);
  EXPECT_EQ(s.LocalRows(0), 5);
  EXPECT_EQ(s.FirstRow(0), 0);
  EXPECT_THAT(s.LocalShape(0), ElementsAre(5, 3));
}

TEST(ShardParamTest, ZeroRows) {
  ParamSharding s = ShardParam({0, 3}, 4);
  EXPECT_EQ(s.dim0, 0);
  EXPECT_EQ(s.numel(), 0);
  EXPECT_EQ(s.rows_per_shard, 0);
  EXPECT_EQ(s.padded_numel(), 0);
  EXPECT_EQ(s.shard_numel(), 0);
  EXPECT_THAT(AllLocalRows(s), ElementsAre(0, 0, 0, 0));
  EXPECT_THAT(s.LocalShape(1), ElementsAre(0, 3));
}

class ShardParamGridTest : public ::testing::TestWithParam<std::tuple<int64_t, int>> {};

TEST_P(ShardParamGridTest, ShardsPartitionTheRows) {
  const auto [dim0, num_shards] = GetParam();
  ParamSharding s = ShardParam({dim0, 3}, num_shards);
  EXPECT_EQ(s.numel(), dim0 * 3);
  EXPECT_EQ(s.shard_numel() * num_shards, s.padded_numel());
  EXPECT_GE(s.padded_rows(), dim0);
  EXPECT_LT(s.padded_rows(), dim0 + num_shards);
  if (dim0 > 0) {
    EXPECT_LT((s.rows_per_shard - 1) * num_shards, dim0);
  }

  std::vector<int> covered(dim0, 0);
  int64_t sum = 0;
  for (int k = 0; k < num_shards; ++k) {
    SCOPED_TRACE(::testing::Message() << "shard " << k);
    const int64_t rows = s.LocalRows(k);
    EXPECT_GE(rows, 0);
    EXPECT_LE(rows, s.rows_per_shard);
    EXPECT_THAT(s.LocalShape(k), ElementsAre(rows, 3));
    if (k + 1 < num_shards) {
      if (s.LocalRows(k + 1) > 0) {
        EXPECT_EQ(s.FirstRow(k) + rows, s.FirstRow(k + 1));
      }
      if (rows < s.rows_per_shard) {
        EXPECT_EQ(s.LocalRows(k + 1), 0);
      }
    }
    for (int64_t r = s.FirstRow(k); r < s.FirstRow(k) + rows; ++r) {
      ASSERT_LT(r, dim0);
      ++covered[r];
    }
    sum += rows;
  }
  EXPECT_EQ(sum, dim0);
  EXPECT_THAT(covered, ::testing::Each(1));
}

INSTANTIATE_TEST_SUITE_P(
    Grid, ShardParamGridTest,
    ::testing::Combine(::testing::Range<int64_t>(0, 14), ::testing::Range(1, 9)),
    [](const ::testing::TestParamInfo<ShardParamGridTest::ParamType>& info) {
      return "dim0_" + std::to_string(std::get<0>(info.param)) + "_over_" +
             std::to_string(std::get<1>(info.param));
    });

TEST(LayoutUnitTest, OffsetsAreCumulativePieces) {
  UnitLayout layout = LayoutUnit(
      {ShardParam({10, 4}, 4), ShardParam({3}, 4), ShardParam({}, 4), ShardParam({7, 2, 3}, 4)},
      /*group_size=*/4);
  EXPECT_EQ(layout.group_size, 4);
  EXPECT_EQ(layout.shards_per_rank, 1);
  EXPECT_THAT(layout.pieces, ElementsAre(12, 1, 1, 12));
  EXPECT_THAT(layout.offsets, ElementsAre(0, 12, 13, 14));
  EXPECT_EQ(layout.chunk_numel, 26);
  EXPECT_EQ(layout.total_numel(), 104);
}

TEST(LayoutUnitTest, SubGroupCarriesConsecutiveShards) {
  std::vector<ParamSharding> params = {ShardParam({10, 4}, 8), ShardParam({3}, 8),
                                       ShardParam({}, 8)};
  const struct {
    int group_size, shards_per_rank;
    std::vector<int64_t> pieces, offsets;
  } kCases[] = {
      {8, 1, {8, 1, 1}, {0, 8, 9}},
      {4, 2, {16, 2, 2}, {0, 16, 18}},
      {2, 4, {32, 4, 4}, {0, 32, 36}},
      {1, 8, {64, 8, 8}, {0, 64, 72}},
  };
  for (const auto& c : kCases) {
    SCOPED_TRACE(::testing::Message() << "group_size " << c.group_size);
    UnitLayout layout = LayoutUnit(params, c.group_size);
    EXPECT_EQ(layout.group_size, c.group_size);
    EXPECT_EQ(layout.shards_per_rank, c.shards_per_rank);
    EXPECT_EQ(layout.pieces, c.pieces);
    EXPECT_EQ(layout.offsets, c.offsets);
    EXPECT_EQ(layout.total_numel(), 80);
  }
}

TEST(LayoutUnitTest, EmptyUnit) {
  UnitLayout layout = LayoutUnit({}, 4);
  EXPECT_THAT(layout.offsets, IsEmpty());
  EXPECT_THAT(layout.pieces, IsEmpty());
  EXPECT_EQ(layout.chunk_numel, 0);
  EXPECT_EQ(layout.total_numel(), 0);
}

TEST(LayoutUnitTest, PropertiesOverShardCountsAndGroups) {
  const std::vector<std::vector<int64_t>> kShapes = {{}, {0, 3}, {1}, {3, 2}, {7, 2, 3},
                                                     {10, 4}, {13}, {8, 5}};
  for (int num_shards = 1; num_shards <= 8; ++num_shards) {
    std::vector<ParamSharding> params;
    int64_t padded_total = 0;
    for (const auto& shape : kShapes) {
      params.push_back(ShardParam(shape, num_shards));
      padded_total += params.back().padded_numel();
    }
    for (int group_size = 1; group_size <= num_shards; ++group_size) {
      if (num_shards % group_size != 0) continue;
      SCOPED_TRACE(::testing::Message() << num_shards << " shards, group " << group_size);
      UnitLayout layout = LayoutUnit(params, group_size);
      const int spr = num_shards / group_size;
      EXPECT_EQ(layout.shards_per_rank, spr);
      ASSERT_EQ(layout.offsets.size(), params.size());
      ASSERT_EQ(layout.pieces.size(), params.size());
      int64_t offset = 0;
      for (size_t i = 0; i < params.size(); ++i) {
        EXPECT_EQ(layout.offsets[i], offset);
        EXPECT_EQ(layout.pieces[i], spr * params[i].shard_numel());
        offset += layout.pieces[i];
      }
      EXPECT_EQ(layout.chunk_numel, offset);
      EXPECT_EQ(layout.total_numel(), layout.chunk_numel * group_size);
      EXPECT_EQ(layout.total_numel(), padded_total);
    }
  }
}

at::Tensor PaddedShard(const at::Tensor& full, const ParamSharding& s, int shard) {
  std::vector<int64_t> padded_shape = s.LocalShape(0);
  padded_shape[0] = s.rows_per_shard;
  at::Tensor padded = at::zeros(padded_shape, full.options());
  const int64_t rows = s.LocalRows(shard);
  if (rows > 0) {
    padded.narrow(0, 0, rows).copy_(
        full.reshape({s.dim0, s.row_numel}).narrow(0, s.FirstRow(shard), rows).view(
            padded.narrow(0, 0, rows).sizes()));
  }
  return padded.view(-1);
}

at::Tensor PackRankMajor(const std::vector<at::Tensor>& full,
                         const std::vector<ParamSharding>& shardings, const UnitLayout& layout) {
  std::vector<at::Tensor> parts;
  for (int rank = 0; rank < layout.group_size; ++rank) {
    for (size_t i = 0; i < full.size(); ++i) {
      for (int j = 0; j < layout.shards_per_rank; ++j) {
        parts.push_back(PaddedShard(full[i], shardings[i], rank * layout.shards_per_rank + j));
      }
    }
  }
  return at::cat(parts);
}

at::Tensor UnpackPadded(const at::Tensor& buffer, const UnitLayout& layout, size_t i,
                        const ParamSharding& s) {
  at::Tensor rows = buffer.view({layout.group_size, layout.chunk_numel});
  at::Tensor padded = at::empty({s.padded_numel()}, buffer.options());
  padded.view({layout.group_size, layout.pieces[i]})
      .copy_(rows.narrow(1, layout.offsets[i], layout.pieces[i]));
  return padded;
}

class LayoutRoundTripTest : public ::testing::TestWithParam<std::pair<int, int>> {};

TEST_P(LayoutRoundTripTest, SlicingTheBufferReconstructsEveryParameter) {
  const auto [num_shards, group_size] = GetParam();
  const std::vector<std::vector<int64_t>> kShapes = {{10, 4}, {3}, {}, {7, 2, 3},
                                                     {1, 5}, {0, 3}, {16}};
  std::vector<at::Tensor> full;
  std::vector<ParamSharding> shardings;
  for (size_t i = 0; i < kShapes.size(); ++i) {
    shardings.push_back(ShardParam(kShapes[i], num_shards));
    full.push_back(at::arange(shardings.back().numel(), at::kLong)
                       .add(1 + 1000 * static_cast<int64_t>(i))
                       .view(kShapes[i]));
  }
  UnitLayout layout = LayoutUnit(shardings, group_size);
  ASSERT_EQ(layout.shards_per_rank, num_shards / group_size);
  at::Tensor buffer = PackRankMajor(full, shardings, layout);
  ASSERT_EQ(buffer.numel(), layout.total_numel());

  for (size_t i = 0; i < kShapes.size(); ++i) {
    SCOPED_TRACE(::testing::Message() << "parameter " << i << " " << full[i].sizes());
    const ParamSharding& s = shardings[i];
    at::Tensor padded = UnpackPadded(buffer, layout, i, s);
    EXPECT_TRUE(at::equal(padded.narrow(0, s.numel(), s.padded_numel() - s.numel()),
                          at::zeros({s.padded_numel() - s.numel()}, at::kLong)));
    at::Tensor rebuilt = padded.narrow(0, 0, s.numel()).view(s.shape);
    EXPECT_EQ(rebuilt.sizes(), full[i].sizes());
    EXPECT_TRUE(at::equal(rebuilt, full[i])) << rebuilt << "\nvs\n" << full[i];
  }
}

INSTANTIATE_TEST_SUITE_P(
    ShardsAndGroups, LayoutRoundTripTest,
    ::testing::Values(std::pair{1, 1}, std::pair{3, 3}, std::pair{4, 4}, std::pair{8, 8},
                    std::pair{8, 4}, std::pair{8, 2}, std::pair{8, 1}, std::pair{6, 3},
                    std::pair{6, 2}),
    [](const ::testing::TestParamInfo<LayoutRoundTripTest::ParamType>& info) {
      return "shards" + std::to_string(info.param.first) + "_group" +
             std::to_string(info.param.second);
    });

constexpr Strategy kAllStrategies[] = {Strategy::kFullShard, Strategy::kShardGradOp,
                                       Strategy::kHybridShard, Strategy::kHybridShardZero2,
                                       Strategy::kNoShard};

TEST(ParseStrategyTest, NamesRoundTrip) {
  std::vector<std::string> names;
  for (Strategy strategy : kAllStrategies) {
    names.push_back(StrategyName(strategy));
    absl::StatusOr<Strategy> parsed = ParseStrategy(names.back());
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_EQ(*parsed, strategy) << names.back();
  }
  EXPECT_THAT(names, ElementsAre("full_shard", "shard_grad_op", "hybrid_shard",
                                 "hybrid_shard_zero2", "no_shard"));
}

TEST(ParseStrategyTest, UnknownNameListsValidNames) {
  for (const char* bad : {"fully_shard", "", "hybrid"}) {
    SCOPED_TRACE(bad);
    absl::StatusOr<Strategy> parsed = ParseStrategy(bad);
    ASSERT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument) << parsed.status();
    const std::string message(parsed.status().message());
    EXPECT_THAT(message, HasSubstr(std::string("'") + bad + "'"));
    for (Strategy strategy : kAllStrategies) {
      EXPECT_THAT(message, HasSubstr(StrategyName(strategy)));
    }
  }
}

TEST(OptionsForStrategyTest, ReshardAfterForward) {
  EXPECT_TRUE(OptionsForStrategy(Strategy::kFullShard).reshard_after_forward);
  EXPECT_TRUE(OptionsForStrategy(Strategy::kHybridShard).reshard_after_forward);
  EXPECT_FALSE(OptionsForStrategy(Strategy::kShardGradOp).reshard_after_forward);
  EXPECT_FALSE(OptionsForStrategy(Strategy::kHybridShardZero2).reshard_after_forward);
  EXPECT_FALSE(OptionsForStrategy(Strategy::kNoShard).reshard_after_forward);
  for (Strategy strategy : kAllStrategies) {
    FsdpOptions options = OptionsForStrategy(strategy);
    EXPECT_EQ(options.reshard_group_size, 0) << StrategyName(strategy);
    EXPECT_FALSE(options.mixed_precision.param_dtype.has_value());
  }
}

void ExpectMesh(const absl::StatusOr<MeshShape>& shape, std::vector<int> degrees) {
  ASSERT_TRUE(shape.ok()) << shape.status();
  EXPECT_THAT(shape->axis_names, ElementsAre("replicate", "shard"));
  EXPECT_EQ(shape->degrees, degrees);
}

void ExpectInvalid(const absl::StatusOr<MeshShape>& shape) {
  EXPECT_EQ(shape.status().code(), absl::StatusCode::kInvalidArgument)
      << (shape.ok() ? shape->ToString() : shape.status().ToString());
}

TEST(MeshShapeForStrategyTest, ShardingStrategiesUseOneShardAxis) {
  ExpectMesh(MeshShapeForStrategy(Strategy::kFullShard, 8, -1), {1, 8});
  ExpectMesh(MeshShapeForStrategy(Strategy::kShardGradOp, 8, -1), {1, 8});
  ExpectMesh(MeshShapeForStrategy(Strategy::kFullShard, 1, -1), {1, 1});
  ExpectMesh(MeshShapeForStrategy(Strategy::kNoShard, 8, -1), {8, 1});
  ExpectMesh(MeshShapeForStrategy(Strategy::kNoShard, 3, -1), {3, 1});
}

TEST(MeshShapeForStrategyTest, HybridFromEitherDegree) {
  for (Strategy hybrid : {Strategy::kHybridShard, Strategy::kHybridShardZero2}) {
    SCOPED_TRACE(StrategyName(hybrid));
    ExpectMesh(MeshShapeForStrategy(hybrid, 8, /*replicate=*/2), {2, 4});
    ExpectMesh(MeshShapeForStrategy(hybrid, 8, /*replicate=*/-1, /*shard=*/4), {2, 4});
    ExpectMesh(MeshShapeForStrategy(hybrid, 8, /*replicate=*/2, /*shard=*/4), {2, 4});
  }
}

TEST(MeshShapeForStrategyTest, HybridRejectsMissingOrMisfittingDegrees) {
  for (Strategy hybrid : {Strategy::kHybridShard, Strategy::kHybridShardZero2}) {
    SCOPED_TRACE(StrategyName(hybrid));
    absl::StatusOr<MeshShape> missing = MeshShapeForStrategy(hybrid, 8, -1);
    ExpectInvalid(missing);
    EXPECT_THAT(std::string(missing.status().message()), HasSubstr(StrategyName(hybrid)));
    ExpectInvalid(MeshShapeForStrategy(hybrid, 8, /*replicate=*/3));
    ExpectInvalid(MeshShapeForStrategy(hybrid, 8, /*replicate=*/-1, /*shard=*/3));
    ExpectInvalid(MeshShapeForStrategy(hybrid, 8, /*replicate=*/2, /*shard=*/2));
  }
}

}  // namespace
// Note [Compute copy]: kept when it fits, dropped only when that is what makes the state fit,
// always kept for the delayed update or when host memory is unknown; the knob forces it.
TEST(ComputeCopyTest, KeptUnlessHostMemoryFitsOnlyWithoutIt) {
  auto keep = [](ComputeCopy requested, bool delayed, double without, double copy,
                 double available) {
    return ChooseComputeCopy({.requested = requested,
                              .delayed_update = delayed,
                              .host_bytes_without = without,
                              .copy_bytes = copy,
                              .host_available = available})
        .keep;
  };
  constexpr ComputeCopy kAuto = ComputeCopy::kAuto;
  EXPECT_TRUE(keep(kAuto, false, 14, 2, 16));    // fits with it
  EXPECT_FALSE(keep(kAuto, false, 14, 2, 15));   // fits only without it
  EXPECT_TRUE(keep(kAuto, false, 14, 2, 13));    // fits neither way: the copy is not the cause
  EXPECT_TRUE(keep(kAuto, true, 14, 2, 15));     // the delayed update loads the copies
  EXPECT_TRUE(keep(kAuto, false, 14, 2, 0));     // unknown host memory
  EXPECT_TRUE(keep(ComputeCopy::kKeep, false, 14, 2, 15));
  EXPECT_FALSE(keep(ComputeCopy::kDrop, false, 14, 2, 16));
  EXPECT_THAT(ChooseComputeCopy({.host_bytes_without = 14.0 * (1 << 30),
                                 .copy_bytes = 2.0 * (1 << 30),
                                 .host_available = 15.0 * (1 << 30)})
                  .reason,
              ::testing::HasSubstr("16.00 GiB of host memory with it, 14.00 GiB without"));
  EXPECT_GT(HostMemoryAvailablePerRank(1), HostMemoryAvailablePerRank(4));
}

}  // namespace fsdp
