// Training data: token streams cut into windows of seq_len + 1 tokens (inputs and targets),
// split into a training and a held-out part, and dealt out to data-parallel ranks.
//
// Sources:
//   synthetic  a learnable stream generated from the seed (no file): tokens follow a fixed
//              random order-1 Markov chain with a few likely successors per token, so the loss
//              can fall well below log(vocab) within a short run
//   tokens     a binary file of uint16 or uint32 token ids, memory-mapped: headerless (nanoGPT's
//              prepare.py, data.token_dtype says the width) or with llm.c's 256 x int32 header
//              (its dev/data scripts; recognised by the magic, Note [llm.c token files])
//   text       any file, read as bytes (vocab 256)
//
// Sampling: the training part is cut into non-overlapping windows; each epoch visits them in a
// permutation drawn from (seed, epoch); global batch b of the epoch takes windows
// [b * B, (b + 1) * B) of the permutation, B = dp_size * micro_batch * grad_accum, and data-
// parallel rank r takes the r-th consecutive slice of micro_batch windows per micro-step. So
// every rank (all replicate x shard ranks) gets distinct samples, and the whole run depends only
// on (seed, global batch), not on how it is sharded. The position (epoch, batch, and the global
// batch it counts in) is all the state, so resuming is exact, at another global batch too (Note
// [Resuming at another global batch]). Every id read is checked against the vocabulary: an id
// at or past it is an error naming the file and position, not an index error in the model.
//
//   FSDP_ASSIGN_OR_RETURN(std::unique_ptr<TokenDataset> data,
//                         OpenDataset(config.data, /*vocab_size=*/256, /*seed=*/1));
//   FSDP_ASSIGN_OR_RETURN(DataLoader loader,
//                         DataLoader::Create(*data, {.seq_len = 64, .micro_batch = 8,
//                                                    .grad_accum = 2, .dp_rank = 1,
//                                                    .dp_size = 4, .seed = 1}));
//   FSDP_ASSIGN_OR_RETURN(Batch b, loader.Get(/*micro_step=*/0));  // [8, 64] int64 each
//   loader.Advance();  // the next global batch; position() resumes it
// (compiled and run in tests/header_examples_test.cc)
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/config.h"

namespace fsdp {

// A read-only sequence of token ids.
class TokenDataset {
 public:
  virtual ~TokenDataset() = default;
  virtual int64_t size() const = 0;             // number of tokens
  virtual int64_t vocab_size() const = 0;       // upper bound of the ids (exclusive)
  // Copies tokens [begin, begin + count) into `out` (int64).
  virtual void Read(int64_t begin, int64_t count, int64_t* out) const = 0;
  virtual std::string Describe() const = 0;     // "synthetic, 1048576 tokens, vocab 256"
  // What an error names: "data.path 'train.bin'", "data.source synthetic".
  virtual std::string Name() const { return Describe(); }
  // kDataLoss when the source changed since it was opened (a file truncated in place).
  virtual absl::Status CheckUnchanged() const { return absl::OkStatus(); }
};

// data.synthetic_tokens at most: the stream is generated in memory at start-up, 4 bytes a
// token (16 GiB and minutes at the bound); a larger value failed deep in std::vector, or took
// the host's memory. The config's validation and OpenDataset both hold it.
inline constexpr int64_t kMaxSyntheticTokens = int64_t{1} << 32;

// kNotFound for a missing file, kInvalidArgument for a bad source/dtype or a synthetic_tokens
// too large to generate in memory, kDataLoss for a file whose size is not a multiple of the
// token size, an llm.c header with a wrong magic, version or token count, or an id >= vocab
// (checked on a sample here; every id is checked again as the loader reads it), each naming
// the file and values. `vocab_size` is the model's.
absl::StatusOr<std::unique_ptr<TokenDataset>> OpenDataset(const DataSection& data,
                                                          int64_t vocab_size, uint64_t seed);

struct Batch {
  at::Tensor inputs;   // [micro_batch, seq_len] int64
  at::Tensor targets;  // [micro_batch, seq_len] int64 (inputs shifted by one)
};

struct LoaderOptions {
  int64_t seq_len = 64;
  int64_t micro_batch = 8;
  int64_t grad_accum = 1;
  int dp_rank = 0;
  int dp_size = 1;
  uint64_t seed = 0;
  double val_fraction = 0.05;
};

// The loader options of data-parallel rank `dp_rank` of `dp_size` for a run configuration
// (what the trainer uses; `fsdp bench` writes the same batches for the FSDP2 side).
LoaderOptions LoaderOptionsFor(const RunConfig& config, int dp_rank, int dp_size);

// Resumable position in the training stream: `batch * global_batch` windows of the epoch's
// permutation are done.
struct DataPosition {
  int64_t epoch = 0;
  int64_t batch = 0;         // global batches done in this epoch
  int64_t global_batch = 0;  // windows per global batch `batch` counts in; 0: the loader's own
  // What the permutation depends on besides the epoch, as the run that reached this position
  // had them (0: not recorded): a resume on other data or another seed is said (trainer.cc).
  int64_t train_windows = 0;
  uint64_t seed = 0;
};

class DataLoader {
 public:
  // kInvalidArgument when the training part has fewer windows than one global batch.
  static absl::StatusOr<DataLoader> Create(const TokenDataset& dataset,
                                           const LoaderOptions& options);

  // This rank's micro-batch `micro_step` (0..grad_accum-1) of the current global batch;
  // kDataLoss naming the file and position for an id at or past the dataset's vocab_size.
  absl::StatusOr<Batch> Get(int micro_step) const;
  // Moves to the next global batch (next epoch, reshuffled, when this one is used up).
  void Advance();
  // {epoch, batch, global_batch}; after a resume at another global batch that left the cursor
  // between two of this loader's batches, counted in windows (global_batch 1).
  DataPosition position() const;
  // Requires epoch, batch >= 0 and global_batch >= 0.
  void set_position(const DataPosition& position);
  int64_t batches_per_epoch() const;
  int64_t global_batch() const;  // dp_size * micro_batch * grad_accum

  // Held-out batch `index` (0..): the same windows on every call, this rank's slice.
  absl::StatusOr<Batch> ValBatch(int64_t index) const;
  int64_t num_val_batches() const;  // full held-out batches available
  int64_t num_val_windows() const { return val_windows_; }
  int64_t num_train_windows() const { return train_windows_; }

 private:
  DataLoader() = default;
  absl::StatusOr<Batch> Windows(const std::vector<int64_t>& starts) const;
  void Shuffle();

  const TokenDataset* dataset_ = nullptr;
  LoaderOptions options_;
  int64_t train_windows_ = 0;
  int64_t val_begin_ = 0;  // first token of the held-out part
  int64_t val_windows_ = 0;
  std::vector<int64_t> order_;  // permutation of training windows for the current epoch
  int64_t epoch_ = 0;
  int64_t window_ = 0;  // index into order_ of the current global batch's first window
};

}  // namespace fsdp
