// DeviceMesh: the world's ranks laid out on named axes, with one process group per axis slice.
//
// A 2-D mesh (replicate=2, shard=4) over 8 ranks gives each rank its shard group (4 ranks of
// one replica: FSDP all-gathers and reduce-scatters there) and its replicate group (the 2 ranks
// holding the same shard: HSDP all-reduces there). Layout: see mesh_shape.h.
//
// Create is collective over the whole world: every rank calls it with the same shape, and
// all ranks create their meshes in the same order.
//
//   FSDP_ASSIGN_OR_RETURN(std::shared_ptr<DistContext> ctx,
//                         DistContext::InitFromEnvironment(DistOptions{}));
//   FSDP_ASSIGN_OR_RETURN(MeshShape shape,
//                         ParseMeshSpec("replicate=2,shard=-1", ctx->world_size()));
//   FSDP_ASSIGN_OR_RETURN(DeviceMesh mesh, DeviceMesh::Create(ctx, shape));
//   FSDP_ASSIGN_OR_RETURN(ProcessGroup * shard, mesh.group("shard"));
//   int my_shard_index = mesh.coord(mesh.shape().AxisIndex("shard"));
// (compiled and run on 2 ranks in tests/header_examples_test.cc)
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "device_mesh/dist_context.h"
#include "device_mesh/mesh_shape.h"
#include "device_mesh/process_group.h"

namespace fsdp {

class DeviceMesh {
 public:
  static absl::StatusOr<DeviceMesh> Create(std::shared_ptr<DistContext> context,
                                           MeshShape shape);

  const MeshShape& shape() const { return shape_; }
  int ndim() const { return shape_.ndim(); }
  // This rank's coordinates, one per axis.
  const std::vector<int>& coords() const { return coords_; }
  int coord(int axis) const { return coords_[axis]; }
  int size(int axis) const { return shape_.degrees[axis]; }

  // The group along `axis` that contains this rank.
  ProcessGroup& group(int axis) const { return *groups_[axis]; }
  // By axis name; kNotFound lists the mesh's axis names.
  absl::StatusOr<ProcessGroup*> group(std::string_view axis_name) const;
  std::shared_ptr<ProcessGroup> shared_group(int axis) const { return groups_[axis]; }

  DistContext& context() const { return *context_; }
  int rank() const { return context_->rank(); }

  // "rank 5 at (replicate=1, shard=1): replicate=[1, 5] shard=[4, 5, 6, 7]"
  std::string Describe() const;

 private:
  std::shared_ptr<DistContext> context_;
  MeshShape shape_;
  std::vector<int> coords_;
  std::vector<std::shared_ptr<ProcessGroup>> groups_;  // one per axis
};

}  // namespace fsdp
