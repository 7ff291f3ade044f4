// The on-disk checkpoint format: per-rank shard files plus one metadata index. Safe to open:
// no pickle, no code; JSON metadata of bounded size, validated field by field; a CRC-32 per
// chunk (checked on every read) and per file. Documented in docs/checkpoint.md.
//
// A checkpoint is a folder:
//   step_000000120/metadata.json   the index (written last, by rank 0)
//   step_000000120/rank00000.bin   rank 0's chunks: raw little-endian tensor bytes, 64-aligned
//   step_000000120/rank00001.bin   ...
// A tensor is stored as dim-0 row ranges ("chunks"), each in one rank's file; a reader needing
// rows [a, b) of a tensor reads only the chunks (byte ranges) that overlap them, so a checkpoint
// saved with one sharding loads into any other.
//
//   ShardWriter w(tmp_dir, rank);
//   w.Add("model/layers.0.attention.wq", local_rows, /*row_begin=*/first_row, full_shape);
//   absl::StatusOr<RankManifest> m = w.Finish();          // fsync'd; chunks + file CRC
//   ... rank 0 merges every rank's manifest into Metadata, WriteMetadata, CommitCheckpoint ...
//   absl::StatusOr<CheckpointReader> r = CheckpointReader::Open(dir);
//   r->ReadRows("model/layers.0.attention.wq", 10, 20, out);   // any rows, any sharding
//
// The structs and JSON schemas are in metadata.h (included); the code is split by task:
// shard_writer.cc, commit.cc (metadata.json, commit, latest, prune), reader.cc,
// metadata_json.cc, tensor_layout.cc, crc32.cc, file_io.cc.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "checkpoint/metadata.h"

namespace fsdp::ckpt {

// Writes one rank's file. Tensors are copied to CPU (contiguous) as they are added.
class ShardWriter {
 public:
  ShardWriter(std::string dir, int rank);
  ShardWriter(ShardWriter&& other) noexcept;
  ShardWriter(const ShardWriter&) = delete;
  ShardWriter& operator=(const ShardWriter&) = delete;
  ShardWriter& operator=(ShardWriter&&) = delete;
  ~ShardWriter();
  // `rows` holds rows [row_begin, row_begin + rows.size(0)) of a tensor of `global_shape`
  // (a scalar: a 0-dim tensor, row_begin 0). Empty row ranges are skipped.
  absl::Status Add(const std::string& name, const at::Tensor& rows, int64_t row_begin,
                   const std::vector<int64_t>& global_shape);
  // Flushes and fsyncs the file; returns what was written.
  absl::StatusOr<RankManifest> Finish();

 private:
  std::string dir_;
  int rank_;
  std::string file_name_;
  int fd_ = -1;
  int64_t size_ = 0;
  uint32_t file_crc_ = 0;
  RankManifest manifest_;
};

std::string RankFileName(int rank);  // "rank00003.bin"

// Writes metadata.json into `dir` (temp file + fsync + rename).
absl::Status WriteMetadata(const std::string& dir, const Metadata& metadata);

// Makes `tmp_dir` visible as `final_dir` (rename, then fsync of the parent folder). A folder
// that was never committed is never mistaken for a checkpoint.
absl::Status CommitCheckpoint(const std::string& tmp_dir, const std::string& final_dir);

// "step_000000120" for step 120 (9 digits, more for larger steps); the temp folder of a save in
// progress adds ".tmp". LatestCheckpoint and PruneCheckpoints accept any "step_<digits>".
std::string StepDirName(int64_t step);
// The newest committed checkpoint under `root` (folders step_N with a metadata.json), or
// kNotFound naming root.
absl::StatusOr<std::string> LatestCheckpoint(const std::string& root);
// Removes committed checkpoints beyond the newest `keep` (never the newest, nor `committed`:
// the step a save has just committed) and stale .tmp folders older than the newest committed
// one.
absl::Status PruneCheckpoints(const std::string& root, int keep,
                              std::optional<int64_t> committed = std::nullopt);

// Note [A run that goes back]
// A run that starts at step S (resumed from S, or from scratch: 0) in a folder that holds
// committed checkpoints of later steps continues another timeline than theirs: they were
// written by an earlier run that went further (a rewind past a loss spike, a restart from an
// older checkpoint). Left in place, they would stay "latest" for load: latest (a later resume
// would jump back into the abandoned run), and keep_latest_k, which keeps the highest steps,
// would delete this run's own saves in their favour as soon as they were committed.
// metrics.jsonl is truncated to S for the same reason (MetricsWriter). They are not deleted
// either: SetAsideCheckpointsAfter moves them into <root>/superseded/, where neither
// LatestCheckpoint nor PruneCheckpoints looks, and returns their new paths; a name already
// taken there gets a ".2", ".3", ... suffix.
inline constexpr char kSupersededDir[] = "superseded";
absl::StatusOr<std::vector<std::string>> SetAsideCheckpointsAfter(const std::string& root,
                                                                  int64_t step);

class CheckpointReader {
 public:
  // Reads and validates metadata.json and checks every file exists with its recorded size:
  // kNotFound (no metadata: not a checkpoint, or a save that never committed), kDataLoss
  // (truncated or missing file, corrupt metadata), each naming the file.
  static absl::StatusOr<CheckpointReader> Open(const std::string& dir);

  const Metadata& metadata() const { return metadata_; }
  const std::string& dir() const { return dir_; }
  const TensorEntry* Find(const std::string& name) const;
  // Reads rows [row_begin, row_end) of `name` into `out` (CPU, contiguous, the entry's dtype
  // and shape [row_end - row_begin, shape[1:]...]; for a scalar, rows [0, 1) into a 0-dim
  // tensor). Reads only the overlapping chunks and checks their CRC: kDataLoss naming the file
  // and tensor on a mismatch or short read, kNotFound for an unknown tensor.
  absl::Status ReadRows(const std::string& name, int64_t row_begin, int64_t row_end,
                        at::Tensor& out) const;
  // Recomputes every file's CRC (inspect --verify).
  absl::Status VerifyFiles() const;

 private:
  std::string dir_;
  Metadata metadata_;
  std::map<std::string, size_t> index_;
};

}  // namespace fsdp::ckpt
