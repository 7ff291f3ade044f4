// The shape of a DeviceMesh and the pure arithmetic on it: no processes, no sockets.
//
// Ranks are laid out row-major over the axes, the last axis varying fastest (as torch's
// DeviceMesh: mesh = arange(world).view(degrees)). For HSDP (replicate=2, shard=4) ranks 0-3
// form the first shard group and {0, 4} the first replicate group, so the shard axis stays
// inside a node when ranks are packed node by node.
//
//   absl::StatusOr<MeshShape> shape = ParseMeshSpec("replicate=2,shard=-1", /*world_size=*/8);
//   // shape->degrees == {2, 4}
//   std::vector<int> coords = RankToCoords(*shape, 6);      // {1, 2}
//   std::vector<int> peers = AxisGroupRanks(*shape, 6, 1);  // {4, 5, 6, 7}
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace fsdp {

struct MeshShape {
  std::vector<std::string> axis_names;  // unique, non-empty
  std::vector<int> degrees;             // all >= 1 once resolved

  int ndim() const { return static_cast<int>(degrees.size()); }
  int num_ranks() const;
  // -1 if there is no axis of that name.
  int AxisIndex(std::string_view name) const;
  // "(replicate=2, shard=4)"
  std::string ToString() const;
};

// Default axis names for an unnamed mesh: 1-D {"shard"}, 2-D {"replicate", "shard"},
// otherwise {"axis0", "axis1", ...}.
std::vector<std::string> DefaultAxisNames(int ndim);

// Checks names and degrees and infers at most one -1 degree so that the degrees multiply to
// world_size. Errors (kInvalidArgument) list every factor, e.g.
// "mesh (replicate=2, shard=3) needs 2 x 3 = 6 ranks but the world size is 4".
absl::StatusOr<MeshShape> ResolveMeshShape(std::vector<std::string> axis_names,
                                           std::vector<int> degrees, int world_size);

// Parses "4", "2,2", "2x2", "replicate=2,shard=-1" (names optional; all named or none) and
// resolves it against world_size. An empty spec is the 1-D mesh over the whole world.
absl::StatusOr<MeshShape> ParseMeshSpec(std::string_view spec, int world_size);

std::vector<int> RankToCoords(const MeshShape& shape, int rank);
int CoordsToRank(const MeshShape& shape, const std::vector<int>& coords);
// The global ranks of the slice along `axis` that contains `rank`, in axis order.
std::vector<int> AxisGroupRanks(const MeshShape& shape, int rank, int axis);
// Every slice along `axis` (each a list of global ranks), ordered by their first rank.
std::vector<std::vector<int>> AllAxisGroups(const MeshShape& shape, int axis);

}  // namespace fsdp
