#include "device_mesh/mesh_shape.h"

#include <algorithm>
#include <functional>
#include <numeric>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "common/strings.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/status_matchers.h"

namespace fsdp {

// Outside the anonymous namespace so that gtest finds it by argument-dependent lookup.
static void PrintTo(const absl::StatusOr<MeshShape>& shape, std::ostream* os) {
  testing::PrintStatusOr(shape, os, [](const MeshShape& value) { return value.ToString(); });
}

namespace {

using testing::InvalidArgumentWith;
using testing::IsOkAndHolds;

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

MeshShape Resolved(std::vector<int> degrees) {
  int world = std::accumulate(degrees.begin(), degrees.end(), 1, std::multiplies<int>());
  absl::StatusOr<MeshShape> shape = ResolveMeshShape({}, std::move(degrees), world);
  EXPECT_TRUE(shape.ok()) << shape.status();
  return shape.ok() ? *shape : MeshShape{};
}

TEST(DefaultAxisNamesTest, NamesByDimension) {
  EXPECT_THAT(DefaultAxisNames(1), ElementsAre("shard"));
  EXPECT_THAT(DefaultAxisNames(2), ElementsAre("replicate", "shard"));
  EXPECT_THAT(DefaultAxisNames(3), ElementsAre("axis0", "axis1", "axis2"));
  EXPECT_THAT(DefaultAxisNames(4), ElementsAre("axis0", "axis1", "axis2", "axis3"));
  EXPECT_THAT(DefaultAxisNames(0), IsEmpty());
}

TEST(MeshShapeTest, ToStringAxisIndexAndNumRanks) {
  MeshShape shape{{"replicate", "shard"}, {2, 4}};
  EXPECT_EQ(shape.ToString(), "(replicate=2, shard=4)");
  EXPECT_EQ(shape.ndim(), 2);
  EXPECT_EQ(shape.num_ranks(), 8);
  EXPECT_EQ(shape.AxisIndex("replicate"), 0);
  EXPECT_EQ(shape.AxisIndex("shard"), 1);
  EXPECT_EQ(shape.AxisIndex("tensor"), -1);
  EXPECT_EQ(shape.AxisIndex(""), -1);
  EXPECT_EQ(shape.AxisIndex("Shard"), -1);

  MeshShape three{{"a", "b", "c"}, {2, 3, 1}};
  EXPECT_EQ(three.ToString(), "(a=2, b=3, c=1)");
  EXPECT_EQ(three.num_ranks(), 6);
  EXPECT_EQ(three.AxisIndex("c"), 2);

  MeshShape empty;
  EXPECT_EQ(empty.ndim(), 0);
  EXPECT_EQ(empty.num_ranks(), 1);
  EXPECT_EQ(empty.ToString(), "()");
}

TEST(ResolveMeshShapeTest, ExactDegreesWithDefaultNames) {
  absl::StatusOr<MeshShape> shape = ResolveMeshShape({}, {2, 3}, 6);
  ASSERT_TRUE(shape.ok()) << shape.status();
  EXPECT_THAT(shape->axis_names, ElementsAre("replicate", "shard"));
  EXPECT_THAT(shape->degrees, ElementsAre(2, 3));
  EXPECT_EQ(shape->ToString(), "(replicate=2, shard=3)");
}

TEST(ResolveMeshShapeTest, KeepsGivenNames) {
  absl::StatusOr<MeshShape> shape = ResolveMeshShape({"dp", "tp", "pp"}, {2, 1, -1}, 8);
  ASSERT_TRUE(shape.ok()) << shape.status();
  EXPECT_THAT(shape->axis_names, ElementsAre("dp", "tp", "pp"));
  EXPECT_THAT(shape->degrees, ElementsAre(2, 1, 4));
}

TEST(ResolveMeshShapeTest, InfersTheOneMinusOneDegree) {
  struct Case {
    std::vector<int> degrees;
    int world;
    std::vector<int> want;
  };
  for (const Case& c : std::vector<Case>{{{-1}, 1, {1}},
                                         {{-1}, 3, {3}},
                                         {{-1, 2}, 4, {2, 2}},
                                         {{2, -1}, 8, {2, 4}},
                                         {{-1, 3}, 6, {2, 3}},
                                         {{2, -1, 2}, 8, {2, 2, 2}},
                                         {{6, -1}, 6, {6, 1}}}) {
    absl::StatusOr<MeshShape> shape = ResolveMeshShape({}, c.degrees, c.world);
    ASSERT_TRUE(shape.ok()) << shape.status();
    EXPECT_EQ(shape->degrees, c.want) << "world " << c.world;
    EXPECT_EQ(shape->num_ranks(), c.world);
  }
}

TEST(ResolveMeshShapeTest, RejectsNoAxes) {
  EXPECT_THAT(ResolveMeshShape({}, {}, 4), InvalidArgumentWith(HasSubstr("at least one axis")));
}

TEST(ResolveMeshShapeTest, RejectsNameCountMismatch) {
  EXPECT_THAT(ResolveMeshShape({"shard"}, {2, 2}, 4),
              InvalidArgumentWith(HasSubstr("mesh has 2 degrees but 1 axis names")));
}

TEST(ResolveMeshShapeTest, RejectsEmptyAndDuplicateNames) {
  EXPECT_THAT(ResolveMeshShape({"dp", ""}, {2, 2}, 4),
              InvalidArgumentWith(HasSubstr("must not be empty")));
  EXPECT_THAT(ResolveMeshShape({"dp", "dp"}, {2, 2}, 4),
              InvalidArgumentWith(AllOf(HasSubstr("'dp' appears twice"), HasSubstr("unique"))));
  EXPECT_THAT(ResolveMeshShape({"a", "b", "a"}, {1, 2, 2}, 4),
              InvalidArgumentWith(HasSubstr("'a' appears twice")));
}

TEST(ResolveMeshShapeTest, RejectsZeroAndNegativeDegrees) {
  EXPECT_THAT(ResolveMeshShape({}, {0}, 4),
              InvalidArgumentWith(AllOf(HasSubstr("mesh degree shard=0 is invalid"),
                                        HasSubstr("positive integer"))));
  EXPECT_THAT(ResolveMeshShape({}, {2, -2}, 4),
              InvalidArgumentWith(HasSubstr("mesh degree shard=-2 is invalid")));
  EXPECT_THAT(ResolveMeshShape({}, {0, -1}, 4),
              InvalidArgumentWith(HasSubstr("mesh degree replicate=0 is invalid")));
  EXPECT_THAT(ResolveMeshShape({}, {2, 2, -3}, 4),
              InvalidArgumentWith(HasSubstr("mesh degree axis2=-3 is invalid")));
}

TEST(ResolveMeshShapeTest, RejectsTwoInferredDegrees) {
  EXPECT_THAT(ResolveMeshShape({}, {-1, -1}, 4),
              InvalidArgumentWith(AllOf(HasSubstr("(replicate=-1, shard=-1)"),
                                        HasSubstr("more than one -1 degree"),
                                        HasSubstr("'replicate' and 'shard'"))));
  EXPECT_THAT(ResolveMeshShape({}, {-1, 2, -1}, 8),
              InvalidArgumentWith(HasSubstr("'axis0' and 'axis2'")));
}

TEST(ResolveMeshShapeTest, RejectsNonDivisibleInference) {
  EXPECT_THAT(
      ResolveMeshShape({}, {4, -1}, 6),
      InvalidArgumentWith(AllOf(HasSubstr("cannot infer mesh degree 'shard'"),
                                HasSubstr("(replicate=4, shard=-1)"),
                                HasSubstr("world size 6 is not divisible"), HasSubstr("4 = 4"))));
  EXPECT_THAT(ResolveMeshShape({}, {2, -1, 3}, 8),
              InvalidArgumentWith(
                  AllOf(HasSubstr("'axis1'"), HasSubstr("world size 8"), HasSubstr("2 x 3 = 6"))));
  EXPECT_THAT(ResolveMeshShape({}, {-1, 2}, 3),
              InvalidArgumentWith(HasSubstr("world size 3 is not divisible")));
}

TEST(ResolveMeshShapeTest, RejectsProductMismatchListingEveryFactor) {
  EXPECT_THAT(ResolveMeshShape({}, {2, 3}, 4),
              InvalidArgumentWith(AllOf(HasSubstr("mesh (replicate=2, shard=3)"),
                                        HasSubstr("needs 2 x 3 = 6 ranks"),
                                        HasSubstr("world size is 4"), HasSubstr("-1"))));
  EXPECT_THAT(ResolveMeshShape({}, {2, 2, 2}, 4),
              InvalidArgumentWith(AllOf(HasSubstr("2 x 2 x 2 = 8"), HasSubstr("world size is 4"))));
  EXPECT_THAT(ResolveMeshShape({}, {4}, 1),
              InvalidArgumentWith(AllOf(HasSubstr("(shard=4)"), HasSubstr("4 = 4 ranks"),
                                        HasSubstr("world size is 1"))));
  EXPECT_THAT(ResolveMeshShape({}, {1}, 3), InvalidArgumentWith(HasSubstr("world size is 3")));
}

TEST(ResolveMeshShapeTest, RejectsDegreesWhoseProductOverflows) {
  EXPECT_THAT(ResolveMeshShape({}, {4, 1073741825}, 4),
              InvalidArgumentWith(HasSubstr("world size is 4")));
}

TEST(ResolveMeshShapeTest, WorldSizeMustBePositive) {
  EXPECT_THAT(ResolveMeshShape({}, {-1}, 0), InvalidArgumentWith(HasSubstr("world size 0")));
}

TEST(ResolveMeshShapeTest, InferenceSurvivesOverflowingDegrees) {
  EXPECT_THAT(ResolveMeshShape({}, {65536, 65536, -1}, 8),
              InvalidArgumentWith(HasSubstr("world size 8")));
}

struct SpecCase {
  std::string spec;
  int world;
  std::vector<std::string> names;
  std::vector<int> degrees;
};

void PrintTo(const SpecCase& c, std::ostream* os) {
  *os << "'" << c.spec << "' over " << c.world << " ranks";
}

class ParseMeshSpecTest : public ::testing::TestWithParam<SpecCase> {};

TEST_P(ParseMeshSpecTest, Parses) {
  const SpecCase& c = GetParam();
  absl::StatusOr<MeshShape> shape = ParseMeshSpec(c.spec, c.world);
  ASSERT_TRUE(shape.ok()) << "'" << c.spec << "': " << shape.status();
  EXPECT_EQ(shape->axis_names, c.names) << "'" << c.spec << "'";
  EXPECT_EQ(shape->degrees, c.degrees) << "'" << c.spec << "'";
}

INSTANTIATE_TEST_SUITE_P(
    Specs, ParseMeshSpecTest,
    ::testing::Values(SpecCase{"", 1, {"shard"}, {1}}, SpecCase{"", 4, {"shard"}, {4}},
                    SpecCase{"  \t", 6, {"shard"}, {6}}, SpecCase{"1", 1, {"shard"}, {1}},
                    SpecCase{"3", 3, {"shard"}, {3}}, SpecCase{"-1", 8, {"shard"}, {8}},
                    SpecCase{"2,2", 4, {"replicate", "shard"}, {2, 2}},
                    SpecCase{"2x2", 4, {"replicate", "shard"}, {2, 2}},
                    SpecCase{" 2 x 3 ", 6, {"replicate", "shard"}, {2, 3}},
                    SpecCase{"2,-1", 8, {"replicate", "shard"}, {2, 4}},
                    SpecCase{"-1x3", 6, {"replicate", "shard"}, {2, 3}},
                    SpecCase{"2x2x2", 8, {"axis0", "axis1", "axis2"}, {2, 2, 2}},
                    SpecCase{"2,1x-1", 8, {"axis0", "axis1", "axis2"}, {2, 1, 4}},
                    SpecCase{"1,1,1", 1, {"axis0", "axis1", "axis2"}, {1, 1, 1}},
                    SpecCase{"replicate=2,shard=-1", 8, {"replicate", "shard"}, {2, 4}},
                    SpecCase{" shard = 4 ", 4, {"shard"}, {4}},
                    SpecCase{"dp=3, tp=2", 6, {"dp", "tp"}, {3, 2}},
                    SpecCase{"axis0=2,axis1=2", 4, {"axis0", "axis1"}, {2, 2}},
                    SpecCase{"x=2,xx=-1", 6, {"x", "xx"}, {2, 3}},
                    SpecCase{"box=1,max=2,ext=2", 4, {"box", "max", "ext"}, {1, 2, 2}}));

TEST(ParseMeshSpecErrorsTest, RejectsNonDegrees) {
  EXPECT_THAT(
      ParseMeshSpec("two", 2),
      InvalidArgumentWith(AllOf(HasSubstr("mesh spec 'two'"), HasSubstr("'two' is not a degree"))));
  EXPECT_THAT(ParseMeshSpec("2,", 2), InvalidArgumentWith(HasSubstr("'' is not a degree")));
  EXPECT_THAT(ParseMeshSpec("2x", 2), InvalidArgumentWith(HasSubstr("is not a degree")));
  EXPECT_THAT(ParseMeshSpec("2,,2", 4), InvalidArgumentWith(HasSubstr("is not a degree")));
  EXPECT_THAT(ParseMeshSpec("+2", 2), InvalidArgumentWith(HasSubstr("'+2' is not a degree")));
  EXPECT_THAT(ParseMeshSpec("2X2", 4), InvalidArgumentWith(HasSubstr("'2X2' is not a degree")));
  EXPECT_THAT(ParseMeshSpec("2.5", 4), InvalidArgumentWith(HasSubstr("is not a degree")));
  EXPECT_THAT(ParseMeshSpec("shard=", 4), InvalidArgumentWith(HasSubstr("is not a degree")));
  EXPECT_THAT(ParseMeshSpec("shard=four", 4),
              InvalidArgumentWith(HasSubstr("'shard=four' is not a degree")));
}

TEST(ParseMeshSpecErrorsTest, NamedSpecDoesNotSplitAtX) {
  EXPECT_THAT(ParseMeshSpec("dp=2,2x2", 8),
              InvalidArgumentWith(HasSubstr("'2x2' is not a degree")));
  EXPECT_THAT(ParseMeshSpec("dp=2x2", 4),
              InvalidArgumentWith(HasSubstr("'dp=2x2' is not a degree")));
}

TEST(ParseMeshSpecErrorsTest, RejectsPartialNaming) {
  EXPECT_THAT(ParseMeshSpec("replicate=2,4", 8),
              InvalidArgumentWith(
                  AllOf(HasSubstr("names some axes but not all"), HasSubstr("'replicate=2,4'"))));
  EXPECT_THAT(ParseMeshSpec("2,shard=4", 8),
              InvalidArgumentWith(HasSubstr("names some axes but not all")));
  EXPECT_THAT(ParseMeshSpec("a=2,2,c=2", 8),
              InvalidArgumentWith(HasSubstr("names some axes but not all")));
}

TEST(ParseMeshSpecErrorsTest, PassesResolutionErrorsThrough) {
  EXPECT_THAT(ParseMeshSpec("2,3", 4),
              InvalidArgumentWith(AllOf(HasSubstr("2 x 3 = 6"), HasSubstr("world size is 4"))));
  EXPECT_THAT(ParseMeshSpec("4x-1", 6),
              InvalidArgumentWith(HasSubstr("world size 6 is not divisible")));
  EXPECT_THAT(ParseMeshSpec("-1,-1", 4), InvalidArgumentWith(HasSubstr("more than one -1")));
  EXPECT_THAT(ParseMeshSpec("0", 4), InvalidArgumentWith(HasSubstr("shard=0 is invalid")));
  EXPECT_THAT(ParseMeshSpec("dp=2,dp=2", 4), InvalidArgumentWith(HasSubstr("'dp' appears twice")));
  EXPECT_THAT(ParseMeshSpec("=2,b=2", 4), InvalidArgumentWith(HasSubstr("must not be empty")));
  EXPECT_THAT(ParseMeshSpec("a=2,b=-2", 4), InvalidArgumentWith(HasSubstr("b=-2 is invalid")));
  EXPECT_THAT(ParseMeshSpec("8", 4), InvalidArgumentWith(HasSubstr("world size is 4")));
}

TEST(RankCoordsTest, HsdpExampleFromTheHeader) {
  MeshShape shape = Resolved({2, 4});
  EXPECT_THAT(RankToCoords(shape, 6), ElementsAre(1, 2));
  EXPECT_THAT(AxisGroupRanks(shape, 6, 1), ElementsAre(4, 5, 6, 7));
  EXPECT_THAT(AxisGroupRanks(shape, 6, 0), ElementsAre(2, 6));
  EXPECT_THAT(AxisGroupRanks(shape, 0, 1), ElementsAre(0, 1, 2, 3));
  EXPECT_THAT(AxisGroupRanks(shape, 0, 0), ElementsAre(0, 4));
}

TEST(RankCoordsTest, LastAxisVariesFastest) {
  MeshShape shape = Resolved({2, 3, 2});
  EXPECT_THAT(RankToCoords(shape, 0), ElementsAre(0, 0, 0));
  EXPECT_THAT(RankToCoords(shape, 1), ElementsAre(0, 0, 1));
  EXPECT_THAT(RankToCoords(shape, 2), ElementsAre(0, 1, 0));
  EXPECT_THAT(RankToCoords(shape, 5), ElementsAre(0, 2, 1));
  EXPECT_THAT(RankToCoords(shape, 6), ElementsAre(1, 0, 0));
  EXPECT_THAT(RankToCoords(shape, 11), ElementsAre(1, 2, 1));
  EXPECT_EQ(CoordsToRank(shape, {1, 1, 0}), 8);
  EXPECT_THAT(AxisGroupRanks(shape, 8, 0), ElementsAre(2, 8));
  EXPECT_THAT(AxisGroupRanks(shape, 8, 1), ElementsAre(6, 8, 10));
  EXPECT_THAT(AxisGroupRanks(shape, 8, 2), ElementsAre(8, 9));
}

TEST(RankCoordsTest, OneDimensionalAndTrivialAxes) {
  MeshShape line = Resolved({3});
  for (int r = 0; r < 3; ++r) EXPECT_THAT(RankToCoords(line, r), ElementsAre(r));
  EXPECT_THAT(AxisGroupRanks(line, 2, 0), ElementsAre(0, 1, 2));
  EXPECT_THAT(AllAxisGroups(line, 0), ElementsAre(ElementsAre(0, 1, 2)));

  MeshShape single = Resolved({1});
  EXPECT_THAT(RankToCoords(single, 0), ElementsAre(0));
  EXPECT_EQ(CoordsToRank(single, {0}), 0);
  EXPECT_THAT(AllAxisGroups(single, 0), ElementsAre(ElementsAre(0)));

  MeshShape column = Resolved({4, 1});
  EXPECT_THAT(AllAxisGroups(column, 1),
              ElementsAre(ElementsAre(0), ElementsAre(1), ElementsAre(2), ElementsAre(3)));
  EXPECT_THAT(AllAxisGroups(column, 0), ElementsAre(ElementsAre(0, 1, 2, 3)));
}

TEST(RankCoordsTest, AllAxisGroupsOfTwoByThree) {
  MeshShape shape = Resolved({2, 3});
  EXPECT_THAT(AllAxisGroups(shape, 0),
              ElementsAre(ElementsAre(0, 3), ElementsAre(1, 4), ElementsAre(2, 5)));
  EXPECT_THAT(AllAxisGroups(shape, 1), ElementsAre(ElementsAre(0, 1, 2), ElementsAre(3, 4, 5)));
}

class MeshArithmeticTest : public ::testing::TestWithParam<std::vector<int>> {};

TEST_P(MeshArithmeticTest, CoordsRoundTripForEveryRank) {
  MeshShape shape = Resolved(GetParam());
  std::vector<std::vector<int>> seen;
  for (int rank = 0; rank < shape.num_ranks(); ++rank) {
    std::vector<int> coords = RankToCoords(shape, rank);
    ASSERT_EQ(static_cast<int>(coords.size()), shape.ndim());
    for (int axis = 0; axis < shape.ndim(); ++axis) {
      EXPECT_GE(coords[axis], 0);
      EXPECT_LT(coords[axis], shape.degrees[axis]);
    }
    EXPECT_EQ(CoordsToRank(shape, coords), rank) << shape.ToString();
    seen.push_back(coords);
  }
  EXPECT_TRUE(std::is_sorted(seen.begin(), seen.end())) << "row-major order";
  EXPECT_EQ(std::adjacent_find(seen.begin(), seen.end()), seen.end()) << "coords are distinct";
}

TEST_P(MeshArithmeticTest, AllAxisGroupsPartitionTheWorld) {
  MeshShape shape = Resolved(GetParam());
  for (int axis = 0; axis < shape.ndim(); ++axis) {
    std::vector<std::vector<int>> groups = AllAxisGroups(shape, axis);
    ASSERT_EQ(static_cast<int>(groups.size()), shape.num_ranks() / shape.degrees[axis]);
    std::vector<int> count(shape.num_ranks(), 0);
    int previous_first = -1;
    for (const std::vector<int>& group : groups) {
      ASSERT_EQ(static_cast<int>(group.size()), shape.degrees[axis]);
      EXPECT_GT(group.front(), previous_first) << "groups ordered by first rank";
      previous_first = group.front();
      for (int i = 0; i < static_cast<int>(group.size()); ++i) {
        int rank = group[i];
        ASSERT_GE(rank, 0);
        ASSERT_LT(rank, shape.num_ranks());
        ++count[rank];
        EXPECT_EQ(RankToCoords(shape, rank)[axis], i) << "members in axis order";
        EXPECT_EQ(AxisGroupRanks(shape, rank, axis), group) << shape.ToString();
        std::vector<int> a = RankToCoords(shape, rank);
        std::vector<int> b = RankToCoords(shape, group.front());
        a[axis] = b[axis] = 0;
        EXPECT_EQ(a, b) << "members differ only along axis " << axis;
      }
    }
    for (int rank = 0; rank < shape.num_ranks(); ++rank) {
      EXPECT_EQ(count[rank], 1) << "rank " << rank << " axis " << axis << " " << shape.ToString();
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, MeshArithmeticTest,
                         ::testing::Values(std::vector<int>{1}, std::vector<int>{3},
                                         std::vector<int>{8}, std::vector<int>{2, 2},
                                         std::vector<int>{2, 3}, std::vector<int>{3, 2},
                                         std::vector<int>{2, 4}, std::vector<int>{1, 6},
                                         std::vector<int>{6, 1}, std::vector<int>{2, 2, 2},
                                         std::vector<int>{3, 1, 2}, std::vector<int>{2, 3, 4, 1}),
                         [](const ::testing::TestParamInfo<std::vector<int>>& info) {
                           return StrJoin(info.param, "x");
                         });

}  // namespace
}  // namespace fsdp
