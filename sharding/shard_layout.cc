#include "sharding/shard_layout.h"

#include <algorithm>

namespace fsdp {

int64_t ParamSharding::LocalRows(int shard) const {
  return std::clamp<int64_t>(dim0 - FirstRow(shard), 0, rows_per_shard);
}

std::vector<int64_t> ParamSharding::LocalShape(int shard) const {
  std::vector<int64_t> local = shape.empty() ? std::vector<int64_t>{1} : shape;
  local[0] = LocalRows(shard);
  return local;
}

ParamSharding ShardParam(const std::vector<int64_t>& shape, int num_shards) {
  ParamSharding s;
  s.shape = shape;
  s.dim0 = shape.empty() ? 1 : shape[0];
  s.row_numel = 1;
  for (size_t i = 1; i < shape.size(); ++i) s.row_numel *= shape[i];
  s.num_shards = num_shards;
  s.rows_per_shard = (s.dim0 + num_shards - 1) / num_shards;
  return s;
}

UnitLayout LayoutUnit(const std::vector<ParamSharding>& params, int group_size) {
  UnitLayout layout;
  layout.group_size = group_size;
  layout.shards_per_rank = params.empty() ? 1 : params[0].num_shards / group_size;
  for (const ParamSharding& p : params) {
    int64_t piece = layout.shards_per_rank * p.shard_numel();
    layout.offsets.push_back(layout.chunk_numel);
    layout.pieces.push_back(piece);
    layout.chunk_numel += piece;
  }
  return layout;
}

}  // namespace fsdp
