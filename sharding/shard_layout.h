// Pure shard arithmetic: how a parameter is split on dim 0 across a group, and how a unit's
// parameters are packed into the one flat buffer that a single collective moves. No tensors,
// no processes: every function here is a function of shapes and ranks, tested exhaustively in
// tests/shard_layout_test.cc.
//
// Note [Dim-0 sharding with padding]
// A parameter of shape [d0, ...] (a scalar counts as [1]) is split into `num_shards` equal
// shards of `rows_per_shard = ceil(d0 / num_shards)` rows; the last shards may be partly or
// wholly padding (d0 = 3 over 4 ranks: 1, 1, 1, 0 real rows). Every rank's shard therefore has
// the same size, which is what all-gather and reduce-scatter need.
//
// Note [Unit flat buffer]
// A unit's collective buffer is rank-major: [chunk of group rank 0 | chunk of rank 1 | ...],
// each chunk holding that rank's piece of every parameter in unit order, padded. A parameter's
// full (padded) tensor is then the strided slice [group_size, piece] at its offset, which is
// copied out into the parameter's own storage (a strided view cannot be handed to a module as
// a [d0, ...] tensor).
//
//   ParamSharding s = ShardParam({10, 4}, /*num_shards=*/4);   // 3 rows per shard, 12 padded
//   s.LocalRows(3);                                             // 1 (rows 9..9)
//   UnitLayout layout = LayoutUnit({s, ...}, /*group_size=*/4);
//   layout.offsets[0], layout.chunk_numel;                      // piece offsets per chunk
#pragma once

#include <cstdint>
#include <vector>

namespace fsdp {

struct ParamSharding {
  std::vector<int64_t> shape;  // the parameter's full shape
  int64_t dim0 = 1;            // rows (1 for a scalar)
  int64_t row_numel = 1;       // elements per row: product of shape[1:]
  int num_shards = 1;
  int64_t rows_per_shard = 1;  // ceil(dim0 / num_shards)

  int64_t numel() const { return dim0 * row_numel; }
  int64_t padded_rows() const { return rows_per_shard * num_shards; }
  int64_t padded_numel() const { return padded_rows() * row_numel; }
  int64_t shard_numel() const { return rows_per_shard * row_numel; }  // padded, every rank
  // Real (unpadded) rows of shard `shard`: 0..rows_per_shard.
  int64_t LocalRows(int shard) const;
  // First global row of shard `shard` (may be >= dim0 for an all-padding shard).
  int64_t FirstRow(int shard) const { return shard * rows_per_shard; }
  // The local shard's shape: [LocalRows(shard), shape[1:]...] ([rows] for 1-D and scalars).
  std::vector<int64_t> LocalShape(int shard) const;
};

ParamSharding ShardParam(const std::vector<int64_t>& shape, int num_shards);

// Packing of a unit's parameters for a collective over `group_size` ranks, where the
// parameters are sharded `num_shards` ways (group_size divides num_shards; smaller groups
// carry num_shards / group_size consecutive shards per rank: Note [Reshard to a sub-group]).
struct UnitLayout {
  int group_size = 1;
  int shards_per_rank = 1;
  std::vector<int64_t> offsets;  // per parameter, its piece's offset inside one chunk
  std::vector<int64_t> pieces;   // per parameter, piece numel = shards_per_rank * shard_numel
  int64_t chunk_numel = 0;       // one rank's chunk
  int64_t total_numel() const { return chunk_numel * group_size; }
};

// Every parameter must share one num_shards, and group_size must divide it.
UnitLayout LayoutUnit(const std::vector<ParamSharding>& params, int group_size);

}  // namespace fsdp
