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
// on (seed, global batch), not on how it is sharded. The position (epoch, batch) is all the
// state, so resuming is exact.
//
//   FSDP_ASSIGN_OR_RETURN(std::unique_ptr<TokenDataset> data,
//                         OpenDataset(config.data, /*vocab_size=*/256, /*seed=*/1));
//   FSDP_ASSIGN_OR_RETURN(DataLoader loader,
//                         DataLoader::Create(*data, {.seq_len = 64, .micro_batch = 8,
//                                                    .grad_accum = 2, .dp_rank = 1,
//                                                    .dp_size = 4, .seed = 1}));
//   Batch b = loader.Get(/*micro_step=*/0);  // b.inputs, b.targets: [8, 64] int64
//   loader.Advance();                        // the next global batch; position() resumes it
// (compiled and run in tests/header_examples_test.cc)
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

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
};

// kNotFound for a missing file, kInvalidArgument for a bad source/dtype, kDataLoss for a file
// whose size is not a multiple of the token size, an llm.c header with a wrong magic, version
// or token count, or an id >= vocab (checked on a sample), each naming the file and values.
// `vocab_size` is the model's.
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

// Resumable position in the training stream.
struct DataPosition {
  int64_t epoch = 0;
  int64_t batch = 0;  // global batches done in this epoch
};

class DataLoader {
 public:
  // kInvalidArgument when the training part has fewer windows than one global batch.
  static absl::StatusOr<DataLoader> Create(const TokenDataset& dataset,
                                           const LoaderOptions& options);

  // This rank's micro-batch `micro_step` (0..grad_accum-1) of the current global batch.
  Batch Get(int micro_step) const;
  // Moves to the next global batch (next epoch, reshuffled, when this one is used up).
  void Advance();
  const DataPosition& position() const { return position_; }
  void set_position(const DataPosition& position);
  int64_t batches_per_epoch() const;

  // Held-out batch `index` (0..): the same windows on every call, this rank's slice.
  Batch ValBatch(int64_t index) const;
  int64_t num_val_batches() const;  // full held-out batches available

 private:
  DataLoader() = default;
  Batch Windows(const std::vector<int64_t>& starts) const;
  void Shuffle();

  const TokenDataset* dataset_ = nullptr;
  LoaderOptions options_;
  int64_t train_windows_ = 0;
  int64_t val_begin_ = 0;  // first token of the held-out part
  int64_t val_windows_ = 0;
  std::vector<int64_t> order_;  // permutation of training windows for the current epoch
  DataPosition position_;
};

}  // namespace fsdp
