#include "device_mesh/mesh_shape.h"
#include "common/strings.h"

#include <algorithm>
#include <cstdint>
#include <set>


namespace fsdp {
namespace {

std::string JoinFactors(const std::vector<std::string>& names, const std::vector<int>& degrees) {
  std::vector<std::string> parts;
  for (size_t i = 0; i < degrees.size(); ++i) {
    parts.push_back(StrCat(names[i], "=", degrees[i]));
  }
  return StrCat("(", StrJoin(parts, ", "), ")");
}

}  // namespace

int MeshShape::num_ranks() const {
  int n = 1;
  for (int d : degrees) n *= d;
  return n;
}

int MeshShape::AxisIndex(std::string_view name) const {
  for (int i = 0; i < ndim(); ++i) {
    if (axis_names[i] == name) return i;
  }
  return -1;
}

std::string MeshShape::ToString() const { return JoinFactors(axis_names, degrees); }

std::vector<std::string> DefaultAxisNames(int ndim) {
  if (ndim == 1) return {"shard"};
  if (ndim == 2) return {"replicate", "shard"};
  std::vector<std::string> names;
  for (int i = 0; i < ndim; ++i) names.push_back(StrCat("axis", i));
  return names;
}

absl::StatusOr<MeshShape> ResolveMeshShape(std::vector<std::string> axis_names,
                                           std::vector<int> degrees, int world_size) {
  if (degrees.empty()) return absl::InvalidArgumentError("a mesh needs at least one axis");
  if (axis_names.empty()) axis_names = DefaultAxisNames(static_cast<int>(degrees.size()));
  if (axis_names.size() != degrees.size()) {
    return absl::InvalidArgumentError(StrCat("mesh has ", degrees.size(),
                                                   " degrees but ", axis_names.size(),
                                                   " axis names"));
  }
  std::set<std::string> seen;
  for (const std::string& name : axis_names) {
    if (name.empty()) return absl::InvalidArgumentError("mesh axis names must not be empty");
    if (!seen.insert(name).second) {
      return absl::InvalidArgumentError(StrCat("mesh axis name '", name,
                                                     "' appears twice; names must be unique"));
    }
  }
  if (world_size < 1) {
    return absl::InvalidArgumentError(StrCat("world size ", world_size, " is not positive"));
  }
  int infer = -1;
  // 64-bit and capped above world_size: the product of user-given degrees must not wrap.
  int64_t known = 1;
  for (size_t i = 0; i < degrees.size(); ++i) {
    if (degrees[i] == -1) {
      if (infer >= 0) {
        return absl::InvalidArgumentError(StrCat(
            "mesh ", JoinFactors(axis_names, degrees), " has more than one -1 degree ('",
            axis_names[infer], "' and '", axis_names[i], "'); at most one may be inferred"));
      }
      infer = static_cast<int>(i);
    } else if (degrees[i] < 1) {
      return absl::InvalidArgumentError(StrCat(
          "mesh degree ", axis_names[i], "=", degrees[i],
          " is invalid; a degree is a positive integer, or -1 to infer it from the world size"));
    } else {
      known = std::min<int64_t>(known * degrees[i], int64_t{world_size} + 1);
    }
  }
  std::vector<std::string> factors;
  int64_t product = 1;  // for the message only; may exceed int
  for (size_t i = 0; i < degrees.size(); ++i) {
    if (static_cast<int>(i) != infer) {
      factors.push_back(StrCat(degrees[i]));
      product *= degrees[i];
      if (product > (int64_t{1} << 40)) product = int64_t{1} << 40;
    }
  }
  if (infer >= 0) {
    if (known > world_size || world_size % known != 0) {
      return absl::InvalidArgumentError(StrCat(
          "cannot infer mesh degree '", axis_names[infer], "' in ",
          JoinFactors(axis_names, degrees), ": the world size ", world_size,
          " is not divisible by the other degrees ", StrJoin(factors, " x "), " = ",
          product));
    }
    degrees[infer] = static_cast<int>(world_size / known);
  } else if (known != world_size) {
    return absl::InvalidArgumentError(StrCat(
        "mesh ", JoinFactors(axis_names, degrees), " needs ", StrJoin(factors, " x "),
        " = ", product, " ranks but the world size is ", world_size,
        "; the degrees must multiply to the world size (use -1 for one degree to infer it)"));
  }
  return MeshShape{std::move(axis_names), std::move(degrees)};
}

absl::StatusOr<MeshShape> ParseMeshSpec(std::string_view spec, int world_size) {
  spec = Strip(spec);
  if (spec.empty()) return ResolveMeshShape({}, {world_size}, world_size);
  std::vector<std::string> names;
  std::vector<int> degrees;
  // "2x2" is accepted for unnamed meshes only: axis names may contain an 'x'.
  const char* separators = spec.find('=') == std::string_view::npos ? ",x" : ",";
  for (std::string_view raw : Split(spec, separators)) {
    std::string_view item = Strip(raw);
    std::string_view value = item;
    size_t eq = item.find('=');
    if (eq != std::string_view::npos) {
      names.emplace_back(Strip(item.substr(0, eq)));
      value = Strip(item.substr(eq + 1));
    }
    std::optional<int> degree = ParseInt(value);
    if (!degree) {
      return absl::InvalidArgumentError(StrCat(
          "mesh spec '", spec, "': '", item,
          "' is not a degree; write degrees like '2,2' or named axes like 'replicate=2,shard=-1'"));
    }
    degrees.push_back(*degree);
  }
  if (!names.empty() && names.size() != degrees.size()) {
    return absl::InvalidArgumentError(StrCat(
        "mesh spec '", spec, "' names some axes but not all; name every axis or none"));
  }
  return ResolveMeshShape(std::move(names), std::move(degrees), world_size);
}

std::vector<int> RankToCoords(const MeshShape& shape, int rank) {
  std::vector<int> coords(shape.ndim());
  for (int axis = shape.ndim() - 1; axis >= 0; --axis) {
    coords[axis] = rank % shape.degrees[axis];
    rank /= shape.degrees[axis];
  }
  return coords;
}

int CoordsToRank(const MeshShape& shape, const std::vector<int>& coords) {
  int rank = 0;
  for (int axis = 0; axis < shape.ndim(); ++axis) rank = rank * shape.degrees[axis] + coords[axis];
  return rank;
}

std::vector<int> AxisGroupRanks(const MeshShape& shape, int rank, int axis) {
  std::vector<int> coords = RankToCoords(shape, rank);
  std::vector<int> ranks;
  for (int i = 0; i < shape.degrees[axis]; ++i) {
    coords[axis] = i;
    ranks.push_back(CoordsToRank(shape, coords));
  }
  return ranks;
}

std::vector<std::vector<int>> AllAxisGroups(const MeshShape& shape, int axis) {
  std::vector<std::vector<int>> groups;
  for (int rank = 0; rank < shape.num_ranks(); ++rank) {
    if (RankToCoords(shape, rank)[axis] == 0) groups.push_back(AxisGroupRanks(shape, rank, axis));
  }
  return groups;
}

}  // namespace fsdp
