#include "device_mesh/device_mesh.h"
#include "common/strings.h"

#include "common/status.h"

namespace fsdp {

absl::StatusOr<DeviceMesh> DeviceMesh::Create(std::shared_ptr<DistContext> context,
                                              MeshShape shape) {
  if (shape.num_ranks() != context->world_size()) {
    // Resolve again for the error message that lists every factor.
    FSDP_RETURN_IF_ERROR(
        ResolveMeshShape(shape.axis_names, shape.degrees, context->world_size()).status());
  }
  DeviceMesh mesh;
  mesh.context_ = std::move(context);
  mesh.shape_ = std::move(shape);
  mesh.coords_ = RankToCoords(mesh.shape_, mesh.rank());
  std::string tag = mesh.context_->NextTag("mesh");
  // Axes in order: each rank belongs to exactly one group per axis, so every member of a group
  // is creating that same group at the same time and nobody waits on a group out of order.
  for (int axis = 0; axis < mesh.ndim(); ++axis) {
    std::vector<int> ranks = AxisGroupRanks(mesh.shape_, mesh.rank(), axis);
    if (static_cast<int>(ranks.size()) == mesh.context_->world_size()) {
      // The whole world: reuse its group rather than connecting everyone again.
      mesh.groups_.push_back(std::shared_ptr<ProcessGroup>(mesh.context_,
                                                           &mesh.context_->world()));
      continue;
    }
    FSDP_ASSIGN_OR_RETURN(
        std::shared_ptr<ProcessGroup> group,
        mesh.context_->NewGroup(std::move(ranks),
                                StrCat(tag, "/", mesh.shape_.axis_names[axis])));
    mesh.groups_.push_back(std::move(group));
  }
  return mesh;
}

absl::StatusOr<ProcessGroup*> DeviceMesh::group(std::string_view axis_name) const {
  int axis = shape_.AxisIndex(axis_name);
  if (axis < 0) {
    return absl::NotFoundError(StrCat("mesh ", shape_.ToString(), " has no axis '",
                                            axis_name, "'; axes: ",
                                            StrJoin(shape_.axis_names, ", ")));
  }
  return groups_[axis].get();
}

std::string DeviceMesh::Describe() const {
  std::vector<std::string> at;
  std::vector<std::string> groups;
  for (int axis = 0; axis < ndim(); ++axis) {
    at.push_back(StrCat(shape_.axis_names[axis], "=", coords_[axis]));
    groups.push_back(StrCat(shape_.axis_names[axis], "=", groups_[axis]->RanksString()));
  }
  return StrCat("rank ", rank(), " at (", StrJoin(at, ", "),
                      "): ", StrJoin(groups, " "));
}

}  // namespace fsdp
