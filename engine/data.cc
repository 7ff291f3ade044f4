#include "engine/data.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <numeric>
#include <random>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include "absl/status/status.h"
#include "common/status.h"
#include "common/strings.h"

namespace fsdp {
namespace {

// --- Hashing and random numbers, specified here so streams are the same on every platform ----

uint64_t Mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ULL;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

uint64_t HashWords(std::initializer_list<uint64_t> words) {
  uint64_t h = 0x6A09E667F3BCC908ULL;
  for (uint64_t w : words) h = Mix64(h ^ Mix64(w + 0x9E3779B97F4A7C15ULL));
  return h;
}

// Tags keep the hash streams of different uses apart.
constexpr uint64_t kChainTag = 0x636861696E;     // successors of a context
constexpr uint64_t kStreamTag = 0x73747265616D;  // the sampling of the synthetic stream
constexpr uint64_t kShuffleTag = 0x73687566;     // epoch permutations

class SplitMix64 {
 public:
  using result_type = uint64_t;
  explicit SplitMix64(uint64_t seed) : state_(seed) {}
  static constexpr uint64_t min() { return 0; }
  static constexpr uint64_t max() { return std::numeric_limits<uint64_t>::max(); }
  uint64_t operator()() {
    state_ += 0x9E3779B97F4A7C15ULL;
    return Mix64(state_);
  }

 private:
  uint64_t state_;
};

// Uniform in [0, n) without modulo bias (std::uniform_int_distribution is not specified exactly).
template <typename Rng>
uint64_t UniformBelow(Rng& rng, uint64_t n) {
  const uint64_t limit =
      std::numeric_limits<uint64_t>::max() - std::numeric_limits<uint64_t>::max() % n;
  uint64_t x = rng();
  while (x >= limit) x = rng();
  return x % n;
}

double UniformUnit(SplitMix64& rng) { return static_cast<double>(rng() >> 11) * 0x1.0p-53; }

// --- Synthetic source -------------------------------------------------------------------------

// Order-1 Markov chain: after b comes, with probability kNoise, a uniform token, otherwise one
// of kSuccessors tokens derived from hash(seed, b, k) with weights 8:4:2:1. Entropy per token:
// about 1.28 + 0.05 * log(vocab) nats (1.56 for vocab 256, against log(256) = 5.55). One
// context per token keeps it learnable in a few hundred steps by a tiny model (an order-2
// chain has vocab^2 contexts, too many to see in a short run).
constexpr int kSuccessors = 4;
constexpr const char* kSyntheticTokensNote =
    "the synthetic stream is generated in memory at start, 4 bytes a token; use data.source "
    "tokens for more";
constexpr double kNoise = 0.05;
constexpr double kSuccessorCdf[kSuccessors] = {8.0 / 15, 12.0 / 15, 14.0 / 15, 1.0};

class SyntheticDataset : public TokenDataset {
 public:
  SyntheticDataset(int64_t num_tokens, int64_t vocab_size, uint64_t seed)
      : vocab_size_(vocab_size), tokens_(num_tokens) {
    const uint64_t vocab = static_cast<uint64_t>(vocab_size);
    SplitMix64 rng(HashWords({seed, kStreamTag}));
    uint64_t a = UniformBelow(rng, vocab);
    uint64_t b = UniformBelow(rng, vocab);
    for (int64_t i = 0; i < num_tokens; ++i) {
      uint64_t next;
      if (i < 2) {
        next = i == 0 ? a : b;
      } else {
        const double u = UniformUnit(rng);
        if (u < kNoise) {
          next = UniformBelow(rng, vocab);
        } else {
          const double v = (u - kNoise) / (1.0 - kNoise);
          int k = 0;
          while (k + 1 < kSuccessors && v >= kSuccessorCdf[k]) ++k;
          next = HashWords({seed, kChainTag, b, static_cast<uint64_t>(k)}) % vocab;
        }
        a = b;
        b = next;
      }
      tokens_[i] = static_cast<int32_t>(next);
    }
  }

  int64_t size() const override { return static_cast<int64_t>(tokens_.size()); }
  int64_t vocab_size() const override { return vocab_size_; }
  void Read(int64_t begin, int64_t count, int64_t* out) const override {
    TORCH_CHECK(begin >= 0 && count >= 0 && begin + count <= size(), "Read(", begin, ", ", count,
                ") out of range of ", size(), " synthetic tokens");
    std::copy(tokens_.begin() + begin, tokens_.begin() + begin + count, out);
  }
  std::string Describe() const override {
    return StrCat("synthetic, ", size(), " tokens, vocab ", vocab_size_);
  }
  std::string Name() const override { return "data.source synthetic"; }

 private:
  int64_t vocab_size_;
  std::vector<int32_t> tokens_;
};

// --- File sources -----------------------------------------------------------------------------

class MappedFile {
 public:
  // kNotFound for a missing file; size() 0 (no mapping) for an empty one.
  static absl::StatusOr<std::unique_ptr<MappedFile>> Open(const std::string& path) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      const int error = errno;
      if (error == ENOENT || error == ENOTDIR) {
        return absl::NotFoundError(StrCat("data.path '", path, "': no such file"));
      }
      return absl::PermissionDeniedError(
          StrCat("data.path '", path, "': cannot open: ", std::strerror(error)));
    }
    struct stat info;
    if (::fstat(fd, &info) != 0 || !S_ISREG(info.st_mode)) {
      ::close(fd);
      return absl::InvalidArgumentError(StrCat("data.path '", path, "': not a regular file"));
    }
    std::unique_ptr<MappedFile> file(new MappedFile(path, static_cast<int64_t>(info.st_size)));
    if (file->size_ > 0) {
      void* data = ::mmap(nullptr, static_cast<size_t>(file->size_), PROT_READ, MAP_PRIVATE, fd, 0);
      const int error = errno;
      if (data == MAP_FAILED) {
        ::close(fd);
        return absl::InternalError(
            StrCat("data.path '", path, "': mmap failed: ", std::strerror(error)));
      }
      file->data_ = static_cast<const uint8_t*>(data);
      file->fd_ = fd;  // kept for CurrentSize
    } else {
      ::close(fd);
    }
    return file;
  }

  ~MappedFile() {
    if (data_ != nullptr) ::munmap(const_cast<uint8_t*>(data_), static_cast<size_t>(size_));
    if (fd_ >= 0) ::close(fd_);
  }
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const std::string& path() const { return path_; }
  const uint8_t* data() const { return data_; }
  int64_t size() const { return size_; }
  // The file's size now (size() when it cannot be read): Note [A token file that shrinks].
  int64_t CurrentSize() const {
    struct stat info;
    if (fd_ < 0 || ::fstat(fd_, &info) != 0) return size_;
    return static_cast<int64_t>(info.st_size);
  }

 private:
  MappedFile(std::string path, int64_t size) : path_(std::move(path)), size_(size) {}

  std::string path_;
  const uint8_t* data_ = nullptr;
  int64_t size_ = 0;
  int fd_ = -1;  // open while mapped
};

// Note [A token file that shrinks]
// The mapping is the file itself (MAP_PRIVATE copies only on write): a token file truncated or
// rewritten in place during the run (a preparation script run again writes with O_TRUNC) makes
// every read past its new end a SIGBUS, which ended the run with "Bus error" and no word. So
// each batch first compares the file's size with the size it was opened with (one fstat a
// batch), and stops naming the file; a truncation between that check and the reads can still
// SIGBUS. A file replaced by rename keeps the old one mapped and is safe.

// Little-endian ids of 1 (text), 2 or 4 bytes, after `header_bytes` (llm.c's header, or 0).
class FileDataset : public TokenDataset {
 public:
  FileDataset(std::unique_ptr<MappedFile> file, int token_bytes, int64_t vocab_size,
              int64_t header_bytes = 0, std::string format = "")
      : file_(std::move(file)),
        token_bytes_(token_bytes),
        vocab_size_(vocab_size),
        header_bytes_(header_bytes),
        format_(std::move(format)) {}

  int64_t size() const override { return (file_->size() - header_bytes_) / token_bytes_; }
  int64_t vocab_size() const override { return vocab_size_; }
  void Read(int64_t begin, int64_t count, int64_t* out) const override {
    TORCH_CHECK(begin >= 0 && count >= 0 && begin + count <= size(), "Read(", begin, ", ", count,
                ") out of range of ", size(), " tokens in '", file_->path(), "'");
    for (int64_t i = 0; i < count; ++i) out[i] = TokenAt(begin + i);
  }
  std::string Describe() const override {
    if (token_bytes_ == 1) {
      return StrCat("text '", file_->path(), "', ", size(), " bytes, vocab ", vocab_size_);
    }
    return StrCat("tokens '", file_->path(), "', ", size(), " tokens (", format_, "uint",
                  8 * token_bytes_, "), vocab ", vocab_size_);
  }
  std::string Name() const override { return StrCat("data.path '", file_->path(), "'"); }
  absl::Status CheckUnchanged() const override {  // See Note [A token file that shrinks].
    const int64_t now = file_->CurrentSize();
    if (now == file_->size()) return absl::OkStatus();
    return absl::DataLossError(StrCat(
        "data.path '", file_->path(), "': the file changed size during the run (", file_->size(),
        " bytes when opened, ", now, " now): it was truncated or rewritten in place; write a new "
        "file and rename it over the old one, or restart the run"));
  }

  int64_t TokenAt(int64_t i) const {
    const uint8_t* p = file_->data() + header_bytes_ + i * token_bytes_;
    switch (token_bytes_) {
      case 1:
        return p[0];
      case 2:
        return static_cast<int64_t>(p[0]) | static_cast<int64_t>(p[1]) << 8;
      default:
        return static_cast<int64_t>(p[0]) | static_cast<int64_t>(p[1]) << 8 |
               static_cast<int64_t>(p[2]) << 16 | static_cast<int64_t>(p[3]) << 24;
    }
  }

  // Ids must be < vocab_size; checked on the first and last 64K tokens and 16 strided chunks of
  // 4K (a full scan of a multi-GB file would take longer than many runs).
  absl::Status CheckIdsOnSample() const {
    constexpr int64_t kEnds = 1 << 16;
    constexpr int64_t kChunk = 1 << 12;
    constexpr int64_t kChunks = 16;
    const int64_t n = size();
    std::vector<std::pair<int64_t, int64_t>> ranges = {{0, std::min(n, kEnds)},
                                                       {std::max<int64_t>(0, n - kEnds), n}};
    for (int64_t c = 1; c <= kChunks; ++c) {
      const int64_t begin = n / (kChunks + 1) * c;
      ranges.push_back({begin, std::min(n, begin + kChunk)});
    }
    int64_t max_id = -1, first_bad = -1;
    for (const auto& [begin, end] : ranges) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t id = TokenAt(i);
        max_id = std::max(max_id, id);
        if (id >= vocab_size_ && (first_bad < 0 || i < first_bad)) first_bad = i;
      }
    }
    if (first_bad < 0) return absl::OkStatus();
    const std::string dtype = StrCat("uint", 8 * token_bytes_);
    std::string hint;
    if (header_bytes_ > 0) {
      hint = StrCat("its header (", format_, dtype,
                    ") was written for a larger vocabulary than model.vocab_size");
    } else {
      hint = StrCat(
          "the file may have a header (llm.c's start with 256 x int32; data.header: llmc reads "
          "them) or hold ids of another width (read as data.token_dtype ",
          dtype, "; valid: uint16, uint32), or model.vocab_size is too small");
    }
    return absl::DataLossError(StrCat("data.path '", file_->path(), "': token id ",
                                      TokenAt(first_bad), " at position ", first_bad,
                                      " is >= model.vocab_size ", vocab_size_, " (max id ", max_id,
                                      " in the ", dtype, " ids checked): ", hint));
  }

 private:
  std::unique_ptr<MappedFile> file_;
  int token_bytes_;
  int64_t vocab_size_;
  int64_t header_bytes_;
  std::string format_;  // "llm.c v1, " for a file with a header, else ""
};

absl::StatusOr<std::unique_ptr<MappedFile>> OpenNonEmpty(const DataSection& data) {
  if (data.path.empty()) {
    return absl::InvalidArgumentError(StrCat(
        "data.path: required for data.source ", data.source == DataSource::kText ? "text" : "tokens"));
  }
  FSDP_ASSIGN_OR_RETURN(std::unique_ptr<MappedFile> file, MappedFile::Open(data.path));
  if (file->size() == 0) {
    return absl::DataLossError(StrCat("data.path '", data.path, "': empty file (0 tokens)"));
  }
  return file;
}

// Windows of seq_len + 1 tokens at stride seq_len in `tokens` tokens.
int64_t WindowsIn(int64_t tokens, int64_t seq_len) {
  return tokens > seq_len ? (tokens - 1) / seq_len : 0;
}

// Note [llm.c token files]
// llm.c's dev/data scripts (data_common.py write_datafile) write a header of 256 little-endian
// int32: [0] magic, [1] version, [2] number of tokens, the rest 0; then the tokens. Two kinds:
//   magic 20240520, version 1: GPT-2 tokens, uint16
//   magic 20240801, version 7: Llama 3 tokens, uint32
// With data.header auto a file is read this way when its first int32 is one of the magics
// (a raw uint16 stream starting with ids 55432, 308 would be misread: data.header none);
// data.header llmc requires the header. The header decides the token width, and the file must
// hold exactly the tokens it announces (kDataLoss otherwise: a truncated download or copy).
constexpr int64_t kLlmcHeaderInts = 256;
constexpr int64_t kLlmcHeaderBytes = kLlmcHeaderInts * 4;
struct LlmcKind {
  int32_t magic;
  int32_t version;
  int token_bytes;
  const char* name;
};
constexpr LlmcKind kLlmcKinds[] = {{20240520, 1, 2, "llm.c GPT-2"},
                                   {20240801, 7, 4, "llm.c Llama 3"}};

int32_t Int32At(const MappedFile& file, int64_t index) {
  int32_t v;
  std::memcpy(&v, file.data() + 4 * index, 4);  // little-endian hosts only, as the id reader
  return v;
}

// The token width and header length of an llm.c file, or kDataLoss naming the values read.
absl::StatusOr<std::pair<const LlmcKind*, int64_t>> ReadLlmcHeader(const MappedFile& file) {
  const std::string& path = file.path();
  if (file.size() < kLlmcHeaderBytes) {
    return absl::DataLossError(StrCat("data.path '", path, "': ", file.size(),
                                      " bytes, shorter than llm.c's header of 256 int32 (",
                                      kLlmcHeaderBytes, " bytes)"));
  }
  const int32_t magic = Int32At(file, 0), version = Int32At(file, 1), count = Int32At(file, 2);
  const LlmcKind* kind = nullptr;
  for (const LlmcKind& k : kLlmcKinds) {
    if (k.magic == magic) kind = &k;
  }
  if (kind == nullptr) {
    return absl::DataLossError(StrCat(
        "data.path '", path, "': data.header llmc, but the magic is ", magic,
        " (llm.c writes 20240520 for GPT-2 uint16 tokens, 20240801 for Llama 3 uint32); for a "
        "file without header set data.header: none"));
  }
  if (version != kind->version) {
    return absl::DataLossError(StrCat("data.path '", path, "': ", kind->name, " magic ", magic,
                                      " with version ", version, " (valid: ", kind->version, ")"));
  }
  const int64_t expected = kLlmcHeaderBytes + int64_t{count} * kind->token_bytes;
  if (count < 0 || file.size() != expected) {
    return absl::DataLossError(StrCat("data.path '", path, "': the ", kind->name,
                                      " header announces ", count, " tokens (", expected,
                                      " bytes with the header) but the file has ", file.size(),
                                      " bytes", file.size() < expected ? " (truncated?)" : ""));
  }
  return std::make_pair(kind, int64_t{count});
}

// A file of uint16 / uint32 token ids (data.source tokens), with llm.c's header or none.
absl::StatusOr<std::unique_ptr<TokenDataset>> OpenTokenFile(const DataSection& data,
                                                            int64_t vocab_size) {
  FSDP_ASSIGN_OR_RETURN(std::unique_ptr<MappedFile> file, OpenNonEmpty(data));
  bool llmc = data.header == TokenHeader::kLlmc;
  if (data.header == TokenHeader::kAuto && file->size() >= 4) {
    for (const LlmcKind& k : kLlmcKinds) llmc = llmc || Int32At(*file, 0) == k.magic;
  }
  if (llmc) {  // See Note [llm.c token files].
    FSDP_ASSIGN_OR_RETURN(auto header, ReadLlmcHeader(*file));
    if (header.second == 0) {
      return absl::DataLossError(
          StrCat("data.path '", data.path, "': ", header.first->name, " file with 0 tokens"));
    }
    auto dataset = std::make_unique<FileDataset>(
        std::move(file), header.first->token_bytes, vocab_size, kLlmcHeaderBytes,
        StrCat(header.first->name, " v", header.first->version, ", "));
    FSDP_RETURN_IF_ERROR(dataset->CheckIdsOnSample());
    return dataset;
  }
  const bool wide = data.token_dtype == TokenDtype::kUint32;
  const int token_bytes = wide ? 4 : 2;
  if (file->size() % token_bytes != 0) {
    return absl::DataLossError(StrCat("data.path '", data.path, "': size ", file->size(),
                                      " bytes is not a multiple of ", token_bytes, " (",
                                      wide ? "uint32" : "uint16", " tokens)"));
  }
  auto dataset = std::make_unique<FileDataset>(std::move(file), token_bytes, vocab_size);
  FSDP_RETURN_IF_ERROR(dataset->CheckIdsOnSample());
  return dataset;
}

}  // namespace

absl::StatusOr<std::unique_ptr<TokenDataset>> OpenDataset(const DataSection& data,
                                                          int64_t vocab_size, uint64_t seed) {
  if (vocab_size < 1 || vocab_size > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(
        StrCat("model.vocab_size: must be in [1, 2^31), got ", vocab_size));
  }
  switch (data.source) {
    case DataSource::kSynthetic:
      break;
    case DataSource::kTokens:
      return OpenTokenFile(data, vocab_size);
    case DataSource::kText: {
      if (vocab_size < 256) {
        return absl::InvalidArgumentError(StrCat(
            "data.source text reads bytes (ids 0..255) and needs model.vocab_size >= 256, got ",
            vocab_size));
      }
      FSDP_ASSIGN_OR_RETURN(std::unique_ptr<MappedFile> file, OpenNonEmpty(data));
      return std::make_unique<FileDataset>(std::move(file), 1, 256);
    }
  }
  if (data.synthetic_tokens < 1 || data.synthetic_tokens > kMaxSyntheticTokens) {
    return absl::InvalidArgumentError(StrCat("data.synthetic_tokens: must be in [1, ",
                                             kMaxSyntheticTokens, "] (", kSyntheticTokensNote,
                                             "), got ", data.synthetic_tokens));
  }
  return std::make_unique<SyntheticDataset>(data.synthetic_tokens, vocab_size, seed);
}

// Layout of the token stream:
//   [0, val_begin_)     training part; window w = tokens [w * seq_len, w * seq_len + seq_len + 1),
//                       so the target of one window's last position is the next window's first
//                       input (windows share one token, every token is a target once).
//   [val_begin_, size)  held-out part, the last max(round(val_fraction * size), seq_len + 1)
//                       tokens (none when val_fraction is 0), cut into windows the same way.
// No training window reaches into the held-out part.
//
// Global batch b of an epoch with permutation `order` (B = dp_size * micro_batch * grad_accum):
// rank r, micro-step m, row i reads training window order[b * B + (m * dp_size + r) * micro_batch
// + i]. Concatenating every (m, r) slice in that order gives order[b * B, (b + 1) * B), so the
// sequence of windows depends on (seed, B) only. The last train_windows % B windows of each
// permutation are dropped. Held-out batch j: rank r, row i reads held-out window
// (j * dp_size + r) * micro_batch + i, with no shuffling.
absl::StatusOr<DataLoader> DataLoader::Create(const TokenDataset& dataset,
                                              const LoaderOptions& options) {
  if (options.seq_len < 1 || options.micro_batch < 1 || options.grad_accum < 1) {
    return absl::InvalidArgumentError(
        StrCat("data loader: seq_len, micro_batch and grad_accum must be >= 1, got seq_len ",
               options.seq_len, ", micro_batch ", options.micro_batch, ", grad_accum ",
               options.grad_accum));
  }
  if (options.dp_size < 1 || options.dp_rank < 0 || options.dp_rank >= options.dp_size) {
    return absl::InvalidArgumentError(StrCat("data loader: dp_rank ", options.dp_rank,
                                             " is not in [0, dp_size ", options.dp_size, ")"));
  }
  // The product of three user values: a product past 2^62 (no dataset has that many windows)
  // would overflow and wrap into a small or negative global batch.
  int64_t global_batch = 0;
  if (__builtin_mul_overflow(int64_t{options.dp_size}, options.micro_batch, &global_batch) ||
      __builtin_mul_overflow(global_batch, options.grad_accum, &global_batch) ||
      global_batch > (int64_t{1} << 62)) {
    return absl::InvalidArgumentError(
        StrCat("data: a global batch of dp ", options.dp_size, " x training.micro_batch_size ",
               options.micro_batch, " x training.grad_accum_steps ", options.grad_accum,
               " windows is larger than any dataset (at most 2^62)"));
  }
  if (!(options.val_fraction >= 0.0 && options.val_fraction < 1.0)) {
    return absl::InvalidArgumentError(
        StrCat("data.val_fraction: must be in [0, 1), got ", options.val_fraction));
  }
  DataLoader loader;
  loader.dataset_ = &dataset;
  loader.options_ = options;
  const int64_t total = dataset.size();
  int64_t held_out = 0;
  if (options.val_fraction > 0.0) {
    const auto share = static_cast<int64_t>(std::llround(options.val_fraction * total));
    held_out = std::min(total, std::max(share, options.seq_len + 1));
  }
  loader.val_begin_ = total - held_out;
  loader.train_windows_ = WindowsIn(loader.val_begin_, options.seq_len);
  loader.val_windows_ = WindowsIn(held_out, options.seq_len);
  if (loader.train_windows_ < global_batch) {
    const std::string held_out_note =
        held_out > 0 ? StrCat(" (after holding out the last ", held_out, " tokens for validation)")
                     : "";
    return absl::InvalidArgumentError(
        StrCat("data: ", total, " tokens give ", loader.train_windows_,
               " training windows of seq_len ", options.seq_len, held_out_note,
               ", fewer than one global batch of ", global_batch, " (dp ", options.dp_size,
               " x micro_batch ", options.micro_batch, " x grad_accum ", options.grad_accum, ")"));
  }
  loader.Shuffle();
  return loader;
}

void DataLoader::Shuffle() {
  order_.resize(static_cast<size_t>(train_windows_));
  std::iota(order_.begin(), order_.end(), int64_t{0});
  std::mt19937_64 rng(HashWords({options_.seed, kShuffleTag, static_cast<uint64_t>(epoch_)}));
  for (int64_t i = train_windows_ - 1; i > 0; --i) {
    const auto j = static_cast<int64_t>(UniformBelow(rng, static_cast<uint64_t>(i + 1)));
    std::swap(order_[i], order_[j]);
  }
}

absl::StatusOr<Batch> DataLoader::Get(int micro_step) const {
  TORCH_CHECK(micro_step >= 0 && micro_step < options_.grad_accum, "DataLoader::Get: micro_step ",
              micro_step, " is not in [0, grad_accum ", options_.grad_accum, ")");
  const int64_t first =
      window_ + (micro_step * options_.dp_size + options_.dp_rank) * options_.micro_batch;
  std::vector<int64_t> starts(static_cast<size_t>(options_.micro_batch));
  for (int64_t i = 0; i < options_.micro_batch; ++i) {
    starts[i] = order_[first + i] * options_.seq_len;
  }
  return Windows(starts);
}

// An epoch ends when the rest of its permutation cannot fill a global batch (that rest is
// dropped: Note on the layout above).
void DataLoader::Advance() {
  window_ += global_batch();
  if (window_ + global_batch() > train_windows_) {
    window_ = 0;
    ++epoch_;
    Shuffle();
  }
}

// Note [Resuming at another global batch]
// An epoch's permutation depends on (seed, epoch, number of training windows) only, not on the
// global batch B, so a position is a cursor into it: `batch * global_batch` windows done. A run
// resumed at another B (another world size, micro_batch_size or grad_accum_steps) goes on from
// that window: it neither repeats the windows the earlier run trained on nor skips any. Its
// cursor then need not be a multiple of its own B; position() says so by counting in windows
// (global_batch 1). A cursor whose rest of the epoch cannot fill a batch starts the next epoch,
// as Advance does; one past the epoch (global_batch 0, the loader's own B, from a checkpoint
// written before global_batch was recorded) carries over into the following epochs.
void DataLoader::set_position(const DataPosition& position) {
  TORCH_CHECK(position.epoch >= 0 && position.batch >= 0 && position.global_batch >= 0,
              "DataLoader::set_position: epoch ", position.epoch, ", batch ", position.batch,
              " and global_batch ", position.global_batch, " must be >= 0");
  const int64_t b = global_batch();
  const int64_t per_batch = position.global_batch > 0 ? position.global_batch : b;
  int64_t epoch = position.epoch;
  int64_t window = 0;
  const int64_t epoch_windows = batches_per_epoch() * b;
  if (position.batch > std::numeric_limits<int64_t>::max() / per_batch) {
    epoch += position.batch / batches_per_epoch();  // absurd; only keeps the arithmetic defined
  } else {
    window = position.batch * per_batch;
    if (position.global_batch == 0) {  // counted in this loader's own batches: may carry over
      epoch += window / epoch_windows;
      window %= epoch_windows;
    }
    if (window + b > train_windows_) {
      window = 0;
      ++epoch;
    }
  }
  const bool reshuffle = epoch != epoch_;
  epoch_ = epoch;
  window_ = window;
  if (reshuffle) Shuffle();
}

DataPosition DataLoader::position() const {
  const int64_t b = global_batch();
  DataPosition p{.epoch = epoch_, .batch = window_ / b, .global_batch = b,
                 .train_windows = train_windows_, .seed = options_.seed};
  if (window_ % b != 0) {
    p.batch = window_;
    p.global_batch = 1;
  }
  return p;
}

int64_t DataLoader::batches_per_epoch() const { return train_windows_ / global_batch(); }

int64_t DataLoader::global_batch() const {
  return options_.dp_size * options_.micro_batch * options_.grad_accum;
}

absl::StatusOr<Batch> DataLoader::ValBatch(int64_t index) const {
  TORCH_CHECK(index >= 0 && index < num_val_batches(), "DataLoader::ValBatch: index ", index,
              " is not in [0, ", num_val_batches(), ")");
  const int64_t first = (index * options_.dp_size + options_.dp_rank) * options_.micro_batch;
  std::vector<int64_t> starts(static_cast<size_t>(options_.micro_batch));
  for (int64_t i = 0; i < options_.micro_batch; ++i) {
    starts[i] = val_begin_ + (first + i) * options_.seq_len;
  }
  return Windows(starts);
}

int64_t DataLoader::num_val_batches() const {
  return val_windows_ / (options_.dp_size * options_.micro_batch);
}

absl::StatusOr<Batch> DataLoader::Windows(const std::vector<int64_t>& starts) const {
  FSDP_RETURN_IF_ERROR(dataset_->CheckUnchanged());
  const int64_t seq_len = options_.seq_len;
  const int64_t vocab = dataset_->vocab_size();
  const auto rows = static_cast<int64_t>(starts.size());
  Batch batch{.inputs = at::empty({rows, seq_len}, at::kLong),
              .targets = at::empty({rows, seq_len}, at::kLong)};
  int64_t* inputs = batch.inputs.data_ptr<int64_t>();
  int64_t* targets = batch.targets.data_ptr<int64_t>();
  std::vector<int64_t> window(static_cast<size_t>(seq_len + 1));
  for (int64_t r = 0; r < rows; ++r) {
    dataset_->Read(starts[r], seq_len + 1, window.data());
    // OpenDataset checks a sample of a file's ids; this checks every id a batch reads (an id
    // past the vocabulary would otherwise fail inside the embedding as an index error, or as a
    // device-side assert on a GPU). One comparison per token, beside the copy.
    for (int64_t j = 0; j <= seq_len; ++j) {
      if (window[j] < 0 || window[j] >= vocab) {
        return absl::DataLossError(StrCat(
            dataset_->Name(), ": token id ", window[j], " at position ", starts[r] + j,
            " is >= model.vocab_size ", vocab,
            " (the check when the file was opened reads a sample of it; this id was read for a "
            "batch): the file holds ids of a larger vocabulary, or is corrupt there"));
      }
    }
    std::copy(window.begin(), window.end() - 1, inputs + r * seq_len);
    std::copy(window.begin() + 1, window.end(), targets + r * seq_len);
  }
  return batch;
}

LoaderOptions LoaderOptionsFor(const RunConfig& config, int dp_rank, int dp_size) {
  LoaderOptions lo;
  lo.seq_len = config.model.seq_len;
  lo.micro_batch = config.training.micro_batch_size;
  lo.grad_accum = config.training.grad_accum_steps;
  lo.dp_rank = dp_rank;
  lo.dp_size = dp_size;
  lo.seed = static_cast<uint64_t>(config.run.seed);
  lo.val_fraction = config.data.val_fraction;
  return lo;
}

}  // namespace fsdp
