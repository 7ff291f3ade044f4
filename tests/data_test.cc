#include "engine/data.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <memory>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/strings.h"
#include "engine/config.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/status_matchers.h"

namespace fsdp {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;
using testing::InvalidArgumentWith;

MATCHER_P2(StatusIs, code, message_matcher,
           "has code " + ::testing::PrintToString(code) + " and a message that " +
               ::testing::DescribeMatcher<std::string>(message_matcher)) {
  const absl::Status& status = testing::StatusOf(arg);
  if (status.code() != code) {
    *result_listener << "status is " << status.ToString();
    return false;
  }
  return ::testing::ExplainMatchResult(message_matcher, std::string(status.message()),
                                       result_listener);
}

// Token i is i: a window's first input tells which window it is.
class IotaDataset : public TokenDataset {
 public:
  explicit IotaDataset(int64_t size) : size_(size) {}
  int64_t size() const override { return size_; }
  int64_t vocab_size() const override { return size_; }
  void Read(int64_t begin, int64_t count, int64_t* out) const override {
    ASSERT_LE(begin + count, size_);
    for (int64_t i = 0; i < count; ++i) out[i] = begin + i;
  }
  std::string Describe() const override { return "iota"; }

 private:
  int64_t size_;
};

std::vector<int64_t> ToVector(const at::Tensor& t) {
  const at::Tensor c = t.contiguous();
  const int64_t* p = c.data_ptr<int64_t>();
  return std::vector<int64_t>(p, p + c.numel());
}

std::vector<int64_t> ReadAll(const TokenDataset& dataset) {
  std::vector<int64_t> tokens(dataset.size());
  dataset.Read(0, dataset.size(), tokens.data());
  return tokens;
}

// The training windows (index = first input / seq_len) of `batch`, one per row.
std::vector<int64_t> WindowsOf(const Batch& batch, int64_t seq_len) {
  std::vector<int64_t> inputs = ToVector(batch.inputs);
  std::vector<int64_t> windows;
  for (size_t i = 0; i < inputs.size(); i += seq_len) windows.push_back(inputs[i] / seq_len);
  return windows;
}

// Every rank's windows of the current global batch, in (micro-step, rank) order.
std::vector<int64_t> GlobalBatchWindows(const TokenDataset& dataset, LoaderOptions options,
                                        const DataPosition& position) {
  std::vector<int64_t> windows;
  for (int m = 0; m < options.grad_accum; ++m) {
    for (int r = 0; r < options.dp_size; ++r) {
      options.dp_rank = r;
      absl::StatusOr<DataLoader> loader = DataLoader::Create(dataset, options);
      EXPECT_TRUE(loader.ok()) << loader.status();
      loader->set_position(position);
      std::vector<int64_t> w = WindowsOf(loader->Get(m).value(), options.seq_len);
      windows.insert(windows.end(), w.begin(), w.end());
    }
  }
  return windows;
}

DataSection Synthetic(int64_t tokens) {
  DataSection data;
  data.source = DataSource::kSynthetic;
  data.synthetic_tokens = tokens;
  return data;
}

std::unique_ptr<TokenDataset> OpenOrDie(const DataSection& data, int64_t vocab, uint64_t seed) {
  absl::StatusOr<std::unique_ptr<TokenDataset>> dataset = OpenDataset(data, vocab, seed);
  EXPECT_TRUE(dataset.ok()) << dataset.status();
  return dataset.ok() ? std::move(*dataset) : nullptr;
}

std::string TempPath(const std::string& name) {
  return StrCat(::testing::TempDir(), "fsdp_data_test_", ::getpid(), "_", name);
}

std::string WriteBytes(const std::string& name, const std::string& bytes) {
  const std::string path = TempPath(name);
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
  return path;
}

template <typename Int>
std::string LittleEndian(const std::vector<int64_t>& ids) {
  std::string bytes;
  for (int64_t id : ids) {
    for (size_t b = 0; b < sizeof(Int); ++b) bytes.push_back(static_cast<char>(id >> (8 * b)));
  }
  return bytes;
}

DataSection TokensFile(const std::string& path, const std::string& dtype) {
  DataSection data;
  data.source = DataSource::kTokens;
  data.path = path;
  data.token_dtype = dtype == "uint32" ? TokenDtype::kUint32 : TokenDtype::kUint16;
  return data;
}

// --- Synthetic source ---------------------------------------------------------------------------

TEST(SyntheticDataTest, SameSeedSameTokensDifferentSeedDifferentTokens) {
  std::unique_ptr<TokenDataset> a = OpenOrDie(Synthetic(10000), 256, 7);
  std::unique_ptr<TokenDataset> b = OpenOrDie(Synthetic(10000), 256, 7);
  std::unique_ptr<TokenDataset> c = OpenOrDie(Synthetic(10000), 256, 8);
  ASSERT_TRUE(a && b && c);
  EXPECT_EQ(a->size(), 10000);
  EXPECT_EQ(a->vocab_size(), 256);
  EXPECT_EQ(a->Describe(), "synthetic, 10000 tokens, vocab 256");
  EXPECT_EQ(ReadAll(*a), ReadAll(*b));
  EXPECT_NE(ReadAll(*a), ReadAll(*c));
  std::vector<int64_t> tokens = ReadAll(*a);
  EXPECT_GE(*std::min_element(tokens.begin(), tokens.end()), 0);
  EXPECT_LT(*std::max_element(tokens.begin(), tokens.end()), 256);
  EXPECT_GT(std::set<int64_t>(tokens.begin(), tokens.end()).size(), 200u);

  std::vector<int64_t> middle(5);
  a->Read(100, 5, middle.data());
  EXPECT_THAT(middle, ElementsAreArray(tokens.begin() + 100, tokens.begin() + 105));
}

TEST(SyntheticDataTest, LargeVocabStaysInRange) {
  std::unique_ptr<TokenDataset> data = OpenOrDie(Synthetic(50000), 50304, 1);
  ASSERT_TRUE(data);
  std::vector<int64_t> tokens = ReadAll(*data);
  EXPECT_LT(*std::max_element(tokens.begin(), tokens.end()), 50304);
  EXPECT_GT(*std::max_element(tokens.begin(), tokens.end()), 40000);
}

// Cross-entropy of the second half under order-2 counts of the first half (additive smoothing):
// an estimate from above of what a model can reach, far below log(vocab).
double HeldOutCrossEntropy(const std::vector<int64_t>& tokens, int64_t vocab) {
  const size_t half = tokens.size() / 2;
  std::unordered_map<int64_t, std::unordered_map<int64_t, double>> counts;
  std::unordered_map<int64_t, double> totals;
  for (size_t i = 2; i < half; ++i) {
    const int64_t context = tokens[i - 2] * vocab + tokens[i - 1];
    counts[context][tokens[i]] += 1;
    totals[context] += 1;
  }
  constexpr double kAlpha = 0.01;
  double nats = 0;
  for (size_t i = half; i < tokens.size(); ++i) {
    const int64_t context = tokens[i - 2] * vocab + tokens[i - 1];
    auto seen = counts.find(context);
    double count = 0;
    double total = 0;
    if (seen != counts.end()) {
      auto token = seen->second.find(tokens[i]);
      count = token == seen->second.end() ? 0.0 : token->second;
      total = totals[context];
    }
    nats -= std::log((count + kAlpha) / (total + kAlpha * vocab));
  }
  return nats / static_cast<double>(tokens.size() - half);
}

TEST(SyntheticDataTest, StreamIsLearnable) {
  std::unique_ptr<TokenDataset> data = OpenOrDie(Synthetic(1 << 21), 256, 1234);
  ASSERT_TRUE(data);
  const double entropy = HeldOutCrossEntropy(ReadAll(*data), 256);
  EXPECT_LT(entropy, std::log(256.0) - 1.0);

  // The estimate itself does not go below log(vocab) on a stream with no structure.
  std::vector<int64_t> noise(1 << 16);
  uint64_t x = 1;
  for (int64_t& t : noise) {
    x = x * 6364136223846793005ULL + 1442695040888963407ULL;
    t = static_cast<int64_t>(x >> 56);
  }
  EXPECT_GT(HeldOutCrossEntropy(noise, 256), std::log(256.0));
}

TEST(SyntheticDataTest, RejectsBadSettings) {
  EXPECT_THAT(OpenDataset(Synthetic(0), 256, 1),
              InvalidArgumentWith(HasSubstr("data.synthetic_tokens")));
  EXPECT_THAT(OpenDataset(Synthetic(100), 0, 1),
              InvalidArgumentWith(HasSubstr("model.vocab_size")));
  // Generated in memory: past 2^32 tokens (16 GiB) it is refused, not attempted (2^63 failed
  // inside std::vector as an internal error).
  EXPECT_THAT(OpenDataset(Synthetic((int64_t{1} << 32) + 1), 256, 1),
              InvalidArgumentWith(AllOf(HasSubstr("data.synthetic_tokens: must be in [1, "),
                                        HasSubstr("got 4294967297"))));
  // An unknown data.source or token_dtype cannot get past the parser (config_test.cc).
}

// --- Token and text files -----------------------------------------------------------------------

TEST(TokenFileDataTest, ReadsUint16File) {
  std::vector<int64_t> ids;
  for (int64_t i = 0; i < 1000; ++i) ids.push_back((i * 7919) % 50304);
  const std::string path = WriteBytes("u16.bin", LittleEndian<uint16_t>(ids));
  std::unique_ptr<TokenDataset> data = OpenOrDie(TokensFile(path, "uint16"), 50304, 1);
  ASSERT_TRUE(data);
  EXPECT_EQ(data->size(), 1000);
  EXPECT_EQ(data->vocab_size(), 50304);
  EXPECT_EQ(data->Describe(), StrCat("tokens '", path, "', 1000 tokens (uint16), vocab 50304"));
  EXPECT_EQ(ReadAll(*data), ids);

  absl::StatusOr<DataLoader> loader =
      DataLoader::Create(*data, {.seq_len = 10, .micro_batch = 2, .val_fraction = 0.1});
  ASSERT_TRUE(loader.ok()) << loader.status();
  std::vector<int64_t> inputs = ToVector(loader->Get(0).value().inputs);
  std::vector<int64_t> targets = ToVector(loader->Get(0).value().targets);
  for (int row = 0; row < 2; ++row) {
    auto start = std::find(ids.begin(), ids.end(), inputs[row * 10]) - ids.begin();
    ASSERT_EQ(start % 10, 0);
    for (int j = 0; j < 10; ++j) {
      EXPECT_EQ(inputs[row * 10 + j], ids[start + j]);
      EXPECT_EQ(targets[row * 10 + j], ids[start + j + 1]);
    }
  }
  ::unlink(path.c_str());
}

TEST(TokenFileDataTest, ReadsUint32File) {
  const std::vector<int64_t> ids = {0, 1, 70000, 65536, 99999, 3, 255, 256};
  const std::string path = WriteBytes("u32.bin", LittleEndian<uint32_t>(ids));
  std::unique_ptr<TokenDataset> data = OpenOrDie(TokensFile(path, "uint32"), 100000, 1);
  ASSERT_TRUE(data);
  EXPECT_EQ(data->size(), 8);
  EXPECT_EQ(ReadAll(*data), ids);
  std::vector<int64_t> part(3);
  data->Read(2, 3, part.data());
  EXPECT_THAT(part, ElementsAre(70000, 65536, 99999));
  ::unlink(path.c_str());
}

TEST(TokenFileDataTest, ReportsEveryFileError) {
  const std::string missing = TempPath("missing.bin");
  EXPECT_THAT(
      OpenDataset(TokensFile(missing, "uint16"), 50304, 1),
      StatusIs(absl::StatusCode::kNotFound, StrCat("data.path '", missing, "': no such file")));

  const std::string odd = WriteBytes("odd.bin", std::string(7, '\1'));
  EXPECT_THAT(OpenDataset(TokensFile(odd, "uint16"), 50304, 1),
              StatusIs(absl::StatusCode::kDataLoss,
                       StrCat("data.path '", odd,
                              "': size 7 bytes is not a multiple of 2 (uint16 tokens)")));
  const std::string six = WriteBytes("six.bin", std::string(6, '\1'));
  EXPECT_THAT(
      OpenDataset(TokensFile(six, "uint32"), 50304, 1),
      StatusIs(absl::StatusCode::kDataLoss, AllOf(HasSubstr(six), HasSubstr("size 6 bytes"))));

  const std::string empty = WriteBytes("empty.bin", "");
  EXPECT_THAT(OpenDataset(TokensFile(empty, "uint16"), 50304, 1),
              StatusIs(absl::StatusCode::kDataLoss, AllOf(HasSubstr(empty), HasSubstr("empty"))));

  const std::string big_id = WriteBytes("big.bin", LittleEndian<uint32_t>({5, 6, 70000, 7}));
  EXPECT_THAT(OpenDataset(TokensFile(big_id, "uint32"), 50304, 1),
              StatusIs(absl::StatusCode::kDataLoss,
                       HasSubstr(StrCat("data.path '", big_id,
                                        "': token id 70000 at position 2 is >= model.vocab_size "
                                        "50304 (max id 70000 in the uint32 ids checked)"))));

  // Past the first 64K tokens: found in the sampled tail.
  std::vector<int64_t> long_ids(200000, 1);
  long_ids[199990] = 1000;
  const std::string tail = WriteBytes("tail.bin", LittleEndian<uint16_t>(long_ids));
  EXPECT_THAT(OpenDataset(TokensFile(tail, "uint16"), 512, 1),
              StatusIs(absl::StatusCode::kDataLoss,
                       HasSubstr("token id 1000 at position 199990 is >= model.vocab_size 512")));

  EXPECT_THAT(OpenDataset(TokensFile("", "uint16"), 50304, 1),
              InvalidArgumentWith(HasSubstr("data.path")));
  EXPECT_THAT(OpenDataset(TokensFile(::testing::TempDir(), "uint16"), 50304, 1),
              InvalidArgumentWith(HasSubstr("not a regular file")));
  for (const std::string& path : {odd, six, empty, big_id, tail}) ::unlink(path.c_str());
}

// llm.c's dev/data layout (Note [llm.c token files] in data.cc): 256 int32 (magic, version,
// token count, zeros), then the tokens.
std::string LlmcFile(int32_t magic, int32_t version, int32_t count, const std::string& tokens) {
  std::vector<int64_t> header(256, 0);
  header[0] = magic;
  header[1] = version;
  header[2] = count;
  return LittleEndian<uint32_t>(header) + tokens;
}

TEST(TokenFileDataTest, ReadsLlmcFilesByTheirHeader) {
  std::vector<int64_t> ids;
  for (int64_t i = 0; i < 500; ++i) ids.push_back((i * 7919) % 50257);
  const std::string gpt2 =
      WriteBytes("llmc_gpt2.bin", LlmcFile(20240520, 1, 500, LittleEndian<uint16_t>(ids)));
  // data.token_dtype is for headerless files: the header's width wins.
  std::unique_ptr<TokenDataset> data = OpenOrDie(TokensFile(gpt2, "uint32"), 50304, 1);
  ASSERT_TRUE(data);
  EXPECT_EQ(data->size(), 500);
  EXPECT_EQ(ReadAll(*data), ids);
  EXPECT_EQ(data->Describe(),
            StrCat("tokens '", gpt2, "', 500 tokens (llm.c GPT-2 v1, uint16), vocab 50304"));

  const std::vector<int64_t> wide = {0, 128000, 70000, 5, 128255};
  const std::string llama3 =
      WriteBytes("llmc_llama3.bin", LlmcFile(20240801, 7, 5, LittleEndian<uint32_t>(wide)));
  data = OpenOrDie(TokensFile(llama3, "uint16"), 128256, 1);
  ASSERT_TRUE(data);
  EXPECT_EQ(ReadAll(*data), wide);

  // data.header none: the same bytes are raw uint16 ids (the header's become tokens too).
  DataSection raw = TokensFile(gpt2, "uint16");
  raw.header = TokenHeader::kNone;
  EXPECT_THAT(OpenDataset(raw, 50304, 1),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("token id 55432 at position 0")));
  for (const std::string& path : {gpt2, llama3}) ::unlink(path.c_str());
}

TEST(TokenFileDataTest, ReportsBadLlmcHeaders) {
  const std::string tokens = LittleEndian<uint16_t>({1, 2, 3, 4});
  const std::string version = WriteBytes("llmc_v2.bin", LlmcFile(20240520, 2, 4, tokens));
  EXPECT_THAT(OpenDataset(TokensFile(version, "uint16"), 512, 1),
              StatusIs(absl::StatusCode::kDataLoss,
                       StrCat("data.path '", version,
                              "': llm.c GPT-2 magic 20240520 with version 2 (valid: 1)")));
  const std::string truncated = WriteBytes("llmc_short.bin", LlmcFile(20240520, 1, 6, tokens));
  EXPECT_THAT(OpenDataset(TokensFile(truncated, "uint16"), 512, 1),
              StatusIs(absl::StatusCode::kDataLoss,
                       StrCat("data.path '", truncated,
                              "': the llm.c GPT-2 header announces 6 tokens (1036 bytes with the "
                              "header) but the file has 1032 bytes (truncated?)")));
  DataSection required =
      TokensFile(WriteBytes("llmc_magic.bin", LlmcFile(7, 1, 4, tokens)), "uint16");
  required.header = TokenHeader::kLlmc;
  EXPECT_THAT(OpenDataset(required, 512, 1),
              StatusIs(absl::StatusCode::kDataLoss,
                       AllOf(HasSubstr(required.path), HasSubstr("the magic is 7"),
                             HasSubstr("20240520"), HasSubstr("data.header: none"))));
  required.path = WriteBytes("llmc_tiny.bin", "\x01\x02");
  EXPECT_THAT(OpenDataset(required, 512, 1),
              StatusIs(absl::StatusCode::kDataLoss,
                       AllOf(HasSubstr(required.path), HasSubstr("2 bytes, shorter than"))));
  // Ids past the vocabulary in a file with a header: the header is not the suspect.
  const std::string big =
      WriteBytes("llmc_big.bin", LlmcFile(20240520, 1, 4, LittleEndian<uint16_t>({1, 900, 2, 3})));
  EXPECT_THAT(OpenDataset(TokensFile(big, "uint16"), 512, 1),
              StatusIs(absl::StatusCode::kDataLoss,
                       AllOf(HasSubstr("token id 900 at position 1"), HasSubstr("max id 900"),
                             HasSubstr("its header (llm.c GPT-2 v1, uint16)"))));
  for (const std::string& path :
       {version, truncated, std::string(TempPath("llmc_magic.bin")), required.path, big}) {
    ::unlink(path.c_str());
  }
}

TEST(TokenFileDataTest, IdsPastTheVocabSuggestAHeaderOrTheDtype) {
  // uint32 ids read as uint16: every odd position is a high half (0), the others are the ids;
  // here uint16 ids read as uint32 instead: pairs merge into ids far past the vocabulary.
  const std::string path =
      WriteBytes("narrow.bin", LittleEndian<uint16_t>({10, 20, 30, 40, 50, 60}));
  EXPECT_THAT(
      OpenDataset(TokensFile(path, "uint32"), 50304, 1),
      StatusIs(absl::StatusCode::kDataLoss,
               AllOf(HasSubstr(path), HasSubstr("token id 1310730 at position 0"),
                     HasSubstr("max id 3932210"), HasSubstr("model.vocab_size 50304"),
                     HasSubstr("may have a header"), HasSubstr("data.token_dtype uint32"))));
  ::unlink(path.c_str());
}

// OpenDataset checks a sample of the ids (both ends and 16 strided chunks). An id past the
// vocabulary elsewhere reached the embedding as an index error ("internal: index out of range
// in self", exit 70; a device-side assert on a GPU). Now the loader checks every id it reads.
TEST(TokenFileDataTest, EveryIdReadIsCheckedAgainstTheVocab) {
  constexpr int64_t kTokens = 400000, kSeqLen = 16, kVocab = 512;
  // A position in none of the sampled ranges: past the first 64K tokens, before the third
  // strided chunk (which starts at 3 * (kTokens / 17) = 70587).
  constexpr int64_t kBad = 70000;
  std::vector<int64_t> ids(kTokens);
  for (int64_t i = 0; i < kTokens; ++i) ids[i] = i % kVocab;
  ids[kBad] = 9999;
  const std::string path = WriteBytes("bad_middle.bin", LittleEndian<uint16_t>(ids));
  std::unique_ptr<TokenDataset> data = OpenOrDie(TokensFile(path, "uint16"), kVocab, 1);
  ASSERT_TRUE(data) << "the sample does not include position " << kBad;
  // The windows holding the position as an input or as the last target, in epoch 0's order:
  // the first batch that reads one of them is refused, every batch before it is read.
  absl::StatusOr<DataLoader> loader =
      DataLoader::Create(*data, {.seq_len = kSeqLen, .micro_batch = 50, .seed = 3});
  ASSERT_TRUE(loader.ok()) << loader.status();
  bool refused = false;
  for (int64_t b = 0; b < loader->batches_per_epoch() && !refused; ++b) {
    absl::StatusOr<Batch> batch = loader->Get(0);
    if (!batch.ok()) {
      EXPECT_THAT(batch.status(),
                  StatusIs(absl::StatusCode::kDataLoss,
                           AllOf(HasSubstr(StrCat("data.path '", path, "'")),
                                 HasSubstr(StrCat("token id 9999 at position ", kBad)),
                                 HasSubstr("model.vocab_size 512"))));
      refused = true;
      break;
    }
    for (int64_t t : ToVector(batch->inputs)) ASSERT_LT(t, kVocab);
    for (int64_t t : ToVector(batch->targets)) ASSERT_LT(t, kVocab);
    loader->Advance();
  }
  EXPECT_TRUE(refused) << "an epoch reads every window, the one holding position " << kBad
                       << " included";
  // The held-out part is checked the same way: half the file held out, an id past the
  // vocabulary at 250001, between the strided chunks at 10 and 11 x 23529.
  ids[kBad] = kBad % kVocab;
  constexpr int64_t kBadHeldOut = 250001;
  ids[kBadHeldOut] = 7777;
  const std::string held_out = WriteBytes("bad_held_out.bin", LittleEndian<uint16_t>(ids));
  std::unique_ptr<TokenDataset> val_data = OpenOrDie(TokensFile(held_out, "uint16"), kVocab, 1);
  ASSERT_TRUE(val_data);
  absl::StatusOr<DataLoader> val_loader = DataLoader::Create(
      *val_data, {.seq_len = kSeqLen, .micro_batch = 50, .seed = 3, .val_fraction = 0.5});
  ASSERT_TRUE(val_loader.ok()) << val_loader.status();
  int refused_val = 0;
  for (int64_t v = 0; v < val_loader->num_val_batches(); ++v) {
    absl::StatusOr<Batch> batch = val_loader->ValBatch(v);
    if (batch.ok()) continue;
    ++refused_val;
    EXPECT_THAT(batch.status(),
                StatusIs(absl::StatusCode::kDataLoss,
                         HasSubstr(StrCat("token id 7777 at position ", kBadHeldOut))));
  }
  EXPECT_EQ(refused_val, 1) << "one held-out batch holds the position (windows of 16, 50 a batch)";
  ::unlink(path.c_str());
  ::unlink(held_out.c_str());
}

// Note [A token file that shrinks]: a token file truncated in place during the run made the
// next read past its new end a SIGBUS ("Bus error", no message). Each batch now checks the size.
TEST(TokenFileDataTest, AFileTruncatedDuringTheRunIsAnError) {
  std::vector<int64_t> ids(16 * 1000 + 1);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int64_t>(i % 256);
  const std::string path = WriteBytes("shrinks.bin", LittleEndian<uint16_t>(ids));
  std::unique_ptr<TokenDataset> data = OpenOrDie(TokensFile(path, "uint16"), 256, 1);
  ASSERT_TRUE(data);
  absl::StatusOr<DataLoader> loader =
      DataLoader::Create(*data, {.seq_len = 16, .micro_batch = 8, .seed = 1});
  ASSERT_TRUE(loader.ok()) << loader.status();
  ASSERT_TRUE(loader->Get(0).ok());
  const int64_t bytes = static_cast<int64_t>(ids.size()) * 2;
  ASSERT_EQ(::truncate(path.c_str(), 64), 0);
  EXPECT_THAT(loader->Get(0).status(),
              StatusIs(absl::StatusCode::kDataLoss,
                       AllOf(HasSubstr(StrCat("data.path '", path, "'")),
                             HasSubstr(StrCat("changed size during the run (", bytes,
                                              " bytes when opened, 64 now)")))));
  EXPECT_FALSE(loader->ValBatch(0).ok());
  ::unlink(path.c_str());
}

TEST(TextFileDataTest, ReadsBytesAsTokens) {
  const std::string text = "hello, world\n\xff\x01";
  const std::string path = WriteBytes("text.txt", text);
  DataSection section;
  section.source = DataSource::kText;
  section.path = path;
  std::unique_ptr<TokenDataset> data = OpenOrDie(section, 512, 1);
  ASSERT_TRUE(data);
  EXPECT_EQ(data->vocab_size(), 256);
  EXPECT_EQ(data->size(), static_cast<int64_t>(text.size()));
  EXPECT_EQ(data->Describe(), StrCat("text '", path, "', 15 bytes, vocab 256"));
  std::vector<int64_t> expected;
  for (char c : text) expected.push_back(static_cast<unsigned char>(c));
  EXPECT_EQ(ReadAll(*data), expected);

  EXPECT_THAT(OpenDataset(section, 100, 1),
              InvalidArgumentWith(AllOf(HasSubstr("model.vocab_size >= 256"), HasSubstr("100"))));
  const std::string empty = WriteBytes("empty.txt", "");
  section.path = empty;
  EXPECT_THAT(OpenDataset(section, 256, 1),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr(empty)));
  ::unlink(path.c_str());
  ::unlink(empty.c_str());
}

// --- DataLoader ---------------------------------------------------------------------------------

TEST(DataLoaderTest, TargetsAreInputsShiftedByOne) {
  IotaDataset data(10000);
  absl::StatusOr<DataLoader> loader =
      DataLoader::Create(data, {.seq_len = 16, .micro_batch = 4, .grad_accum = 2, .seed = 3});
  ASSERT_TRUE(loader.ok()) << loader.status();
  for (int m = 0; m < 2; ++m) {
    Batch batch = loader->Get(m).value();
    EXPECT_THAT(batch.inputs.sizes(), ElementsAre(4, 16));
    EXPECT_THAT(batch.targets.sizes(), ElementsAre(4, 16));
    EXPECT_EQ(batch.inputs.scalar_type(), at::kLong);
    EXPECT_EQ(batch.targets.scalar_type(), at::kLong);
    EXPECT_TRUE(batch.inputs.device().is_cpu());
    std::vector<int64_t> inputs = ToVector(batch.inputs);
    std::vector<int64_t> targets = ToVector(batch.targets);
    for (int row = 0; row < 4; ++row) {
      EXPECT_EQ(inputs[row * 16] % 16, 0) << "windows start at multiples of seq_len";
      for (int j = 0; j < 16; ++j) {
        EXPECT_EQ(inputs[row * 16 + j], inputs[row * 16] + j);
        EXPECT_EQ(targets[row * 16 + j], inputs[row * 16 + j] + 1);
      }
    }
  }
}

TEST(DataLoaderTest, SameSeedSameBatchesDifferentSeedDifferent) {
  std::unique_ptr<TokenDataset> data = OpenOrDie(Synthetic(1 << 16), 256, 5);
  ASSERT_TRUE(data);
  LoaderOptions options{.seq_len = 32, .micro_batch = 4, .seed = 11};
  absl::StatusOr<DataLoader> a = DataLoader::Create(*data, options);
  absl::StatusOr<DataLoader> b = DataLoader::Create(*data, options);
  options.seed = 12;
  absl::StatusOr<DataLoader> c = DataLoader::Create(*data, options);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  bool any_different = false;
  for (int step = 0; step < 5; ++step) {
    EXPECT_EQ(ToVector(a->Get(0).value().inputs), ToVector(b->Get(0).value().inputs));
    EXPECT_EQ(ToVector(a->Get(0).value().targets), ToVector(b->Get(0).value().targets));
    any_different |= ToVector(a->Get(0).value().inputs) != ToVector(c->Get(0).value().inputs);
    a->Advance();
    b->Advance();
    c->Advance();
  }
  EXPECT_TRUE(any_different);
}

TEST(DataLoaderTest, RanksGetDistinctWindowsThatMakeUpTheGlobalBatch) {
  IotaDataset data(16 * 500 + 1);
  const LoaderOptions options{
      .seq_len = 16, .micro_batch = 2, .grad_accum = 3, .dp_size = 4, .seed = 9, .val_fraction = 0};
  absl::StatusOr<DataLoader> single =
      DataLoader::Create(data, {.seq_len = 16, .micro_batch = 24, .seed = 9, .val_fraction = 0});
  ASSERT_TRUE(single.ok());
  for (int64_t b : {0, 1, 7}) {
    std::vector<int64_t> windows = GlobalBatchWindows(data, options, {.epoch = 0, .batch = b});
    ASSERT_EQ(windows.size(), 24u);
    EXPECT_EQ(std::set<int64_t>(windows.begin(), windows.end()).size(), 24u);
    // The same windows in the same order as one rank taking the whole global batch.
    single->set_position({.epoch = 0, .batch = b});
    EXPECT_EQ(windows, WindowsOf(single->Get(0).value(), 16));
  }
  // Sharded differently, same global batch size: same batches.
  const LoaderOptions other{
      .seq_len = 16, .micro_batch = 6, .grad_accum = 1, .dp_size = 4, .seed = 9, .val_fraction = 0};
  EXPECT_EQ(GlobalBatchWindows(data, options, {.epoch = 2, .batch = 3}),
            GlobalBatchWindows(data, other, {.epoch = 2, .batch = 3}));
}

TEST(DataLoaderTest, EpochsCoverEveryWindowOnceInANewOrder) {
  IotaDataset data(8 * 64 + 1);  // 64 windows of seq_len 8
  absl::StatusOr<DataLoader> loader = DataLoader::Create(
      data, {.seq_len = 8, .micro_batch = 4, .grad_accum = 2, .seed = 1, .val_fraction = 0});
  ASSERT_TRUE(loader.ok()) << loader.status();
  ASSERT_EQ(loader->batches_per_epoch(), 8);
  std::vector<std::vector<int64_t>> epochs(3);
  for (int64_t e = 0; e < 3; ++e) {
    for (int64_t b = 0; b < 8; ++b) {
      EXPECT_EQ(loader->position().epoch, e);
      EXPECT_EQ(loader->position().batch, b);
      for (int m = 0; m < 2; ++m) {
        std::vector<int64_t> w = WindowsOf(loader->Get(m).value(), 8);
        epochs[e].insert(epochs[e].end(), w.begin(), w.end());
      }
      loader->Advance();
    }
  }
  std::vector<int64_t> all(64);
  for (int64_t i = 0; i < 64; ++i) all[i] = i;
  for (const std::vector<int64_t>& order : epochs) {
    std::vector<int64_t> sorted = order;
    std::sort(sorted.begin(), sorted.end());
    EXPECT_EQ(sorted, all);
  }
  EXPECT_NE(epochs[0], epochs[1]);
  EXPECT_NE(epochs[1], epochs[2]);
  EXPECT_NE(epochs[0], all);
}

TEST(DataLoaderTest, DropsTheRemainderOfAnEpoch) {
  IotaDataset data(8 * 67 + 1);  // 67 windows, global batch 8
  absl::StatusOr<DataLoader> loader =
      DataLoader::Create(data, {.seq_len = 8, .micro_batch = 8, .seed = 2, .val_fraction = 0});
  ASSERT_TRUE(loader.ok());
  EXPECT_EQ(loader->batches_per_epoch(), 8);
  std::set<int64_t> seen;
  for (int b = 0; b < 8; ++b) {
    for (int64_t w : WindowsOf(loader->Get(0).value(), 8)) EXPECT_TRUE(seen.insert(w).second) << w;
    loader->Advance();
  }
  EXPECT_EQ(seen.size(), 64u);
  EXPECT_EQ(loader->position().epoch, 1);
}

TEST(DataLoaderTest, ResumesExactlyFromAPosition) {
  std::unique_ptr<TokenDataset> data = OpenOrDie(Synthetic(20000), 256, 4);
  ASSERT_TRUE(data);
  const LoaderOptions options{
      .seq_len = 16, .micro_batch = 4, .grad_accum = 2, .dp_rank = 1, .dp_size = 2, .seed = 7};
  absl::StatusOr<DataLoader> run = DataLoader::Create(*data, options);
  ASSERT_TRUE(run.ok()) << run.status();
  const int64_t per_epoch = run->batches_per_epoch();
  ASSERT_GT(per_epoch, 10);
  for (int64_t k : {int64_t{0}, int64_t{3}, per_epoch - 1, per_epoch + 5}) {
    absl::StatusOr<DataLoader> original = DataLoader::Create(*data, options);
    ASSERT_TRUE(original.ok());
    for (int64_t i = 0; i < k; ++i) original->Advance();
    absl::StatusOr<DataLoader> resumed = DataLoader::Create(*data, options);
    ASSERT_TRUE(resumed.ok());
    resumed->set_position(original->position());
    EXPECT_EQ(resumed->position().epoch, original->position().epoch);
    EXPECT_EQ(resumed->position().batch, original->position().batch);
    for (int step = 0; step < 4; ++step) {
      for (int m = 0; m < 2; ++m) {
        EXPECT_EQ(ToVector(resumed->Get(m).value().inputs), ToVector(original->Get(m).value().inputs)) << k;
        EXPECT_EQ(ToVector(resumed->Get(m).value().targets), ToVector(original->Get(m).value().targets)) << k;
      }
      original->Advance();
      resumed->Advance();
    }
  }
  // Going back to an earlier epoch re-derives its permutation.
  absl::StatusOr<DataLoader> fresh = DataLoader::Create(*data, options);
  ASSERT_TRUE(fresh.ok());
  std::vector<int64_t> first = ToVector(fresh->Get(0).value().inputs);
  fresh->set_position({.epoch = 3, .batch = 2});
  fresh->set_position({.epoch = 0, .batch = 0});
  EXPECT_EQ(ToVector(fresh->Get(0).value().inputs), first);
}

// Note [Resuming at another global batch]: a position counted in one global batch, resumed at
// another (other world size, micro_batch_size or grad_accum_steps), goes on from the same
// window of the epoch's permutation. It was read in the new run's batches, repeating windows
// already trained on (a smaller batch) or skipping some (a larger one).
TEST(DataLoaderTest, ResumesAtAnotherGlobalBatchFromTheSameWindow) {
  IotaDataset data(8 * 200 + 1);  // 200 windows of seq_len 8
  auto options = [](int64_t micro_batch, int dp_size = 1) {
    return LoaderOptions{.seq_len = 8, .micro_batch = micro_batch, .dp_size = dp_size,
                         .seed = 5, .val_fraction = 0};
  };
  // The reference: epoch e's permutation, one window at a time (global batch 1).
  auto permutation = [&](int64_t epoch) {
    absl::StatusOr<DataLoader> one = DataLoader::Create(data, options(1));
    EXPECT_TRUE(one.ok());
    one->set_position({.epoch = epoch, .batch = 0});
    std::vector<int64_t> order;
    for (int64_t i = 0; i < 200; ++i) {
      order.push_back(WindowsOf(one->Get(0).value(), 8).at(0));
      one->Advance();
    }
    return order;
  };
  const std::vector<int64_t> epoch0 = permutation(0), epoch1 = permutation(1);
  // Saved at global batch 6 (2 ranks x 3) after 7 batches: 42 windows done.
  absl::StatusOr<DataLoader> saved = DataLoader::Create(data, options(3, 2));
  ASSERT_TRUE(saved.ok());
  for (int i = 0; i < 7; ++i) saved->Advance();
  const DataPosition at = saved->position();
  EXPECT_EQ(at.epoch, 0);
  EXPECT_EQ(at.batch, 7);
  EXPECT_EQ(at.global_batch, 6);
  for (int64_t b : {4, 6, 7, 10}) {
    absl::StatusOr<DataLoader> resumed = DataLoader::Create(data, options(b));
    ASSERT_TRUE(resumed.ok());
    resumed->set_position(at);
    int64_t next = 42;
    for (int step = 0; step < 5; ++step) {
      const std::vector<int64_t> expected(epoch0.begin() + next, epoch0.begin() + next + b);
      EXPECT_EQ(WindowsOf(resumed->Get(0).value(), 8), expected) << "batch " << b;
      next += b;
      resumed->Advance();
    }
    // Its own position says where it is, in windows where that is not a multiple of b.
    const DataPosition now = resumed->position();
    EXPECT_EQ(now.epoch, 0);
    EXPECT_EQ(now.batch * now.global_batch, next) << "batch " << b;
    if (next % b == 0) {
      EXPECT_EQ(now.global_batch, b);
    }
  }
  // The rest of the epoch cannot fill a batch of 64 after 180 windows: the next epoch.
  absl::StatusOr<DataLoader> large = DataLoader::Create(data, options(64));
  ASSERT_TRUE(large.ok());
  large->set_position({.epoch = 0, .batch = 30, .global_batch = 6});
  EXPECT_EQ(large->position().epoch, 1);
  EXPECT_EQ(large->position().batch, 0);
  EXPECT_EQ(WindowsOf(large->Get(0).value(), 8),
            std::vector<int64_t>(epoch1.begin(), epoch1.begin() + 64));
  // Also past this loader's last whole batch of the epoch (3 x 64 = 192) but within the epoch
  // (195 of 200 windows): the next epoch from its start, not its window 3.
  large->set_position({.epoch = 0, .batch = 1, .global_batch = 195});
  EXPECT_EQ(large->position().epoch, 1);
  EXPECT_EQ(large->position().batch, 0);
  EXPECT_EQ(WindowsOf(large->Get(0).value(), 8),
            std::vector<int64_t>(epoch1.begin(), epoch1.begin() + 64));
  // A position without global_batch (a checkpoint from before it was recorded) counts in the
  // loader's own: batch 3 of 10 is window 30.
  absl::StatusOr<DataLoader> legacy = DataLoader::Create(data, options(10));
  ASSERT_TRUE(legacy.ok());
  legacy->set_position({.epoch = 0, .batch = 3});
  EXPECT_EQ(WindowsOf(legacy->Get(0).value(), 8),
            std::vector<int64_t>(epoch0.begin() + 30, epoch0.begin() + 40));
}

// dp x micro_batch x grad_accum past 2^63 wrapped into a small or negative global batch that
// passed the size check; the run then failed inside std::vector (exit 70).
TEST(DataLoaderTest, GlobalBatchThatOverflowsIsAnError) {
  IotaDataset data(10000);
  EXPECT_THAT(DataLoader::Create(data, {.seq_len = 8, .micro_batch = int64_t{1} << 62,
                                        .grad_accum = 4, .val_fraction = 0}),
              InvalidArgumentWith(AllOf(HasSubstr("training.micro_batch_size 4611686018427387904"),
                                        HasSubstr("training.grad_accum_steps 4"))));
  EXPECT_THAT(DataLoader::Create(data, {.seq_len = 8, .micro_batch = int64_t{1} << 61,
                                        .grad_accum = 1, .dp_size = 8, .val_fraction = 0}),
              InvalidArgumentWith(HasSubstr("larger than any dataset")));
}

TEST(DataLoaderTest, HeldOutWindowsNeverAppearInTraining) {
  IotaDataset data(10000);
  LoaderOptions options{
      .seq_len = 10, .micro_batch = 3, .dp_size = 2, .seed = 1, .val_fraction = 0.1};
  absl::StatusOr<DataLoader> loader = DataLoader::Create(data, options);
  ASSERT_TRUE(loader.ok()) << loader.status();
  // The last 1000 tokens: 99 windows, 16 batches of 2 ranks x 3.
  EXPECT_EQ(loader->batches_per_epoch(), 899 / 6);
  EXPECT_EQ(loader->num_val_batches(), 16);
  for (int64_t b = 0; b < 2 * loader->batches_per_epoch(); ++b) {
    for (int r = 0; r < 2; ++r) {
      options.dp_rank = r;
      absl::StatusOr<DataLoader> rank = DataLoader::Create(data, options);
      rank->set_position(loader->position());
      for (int64_t t : ToVector(rank->Get(0).value().targets)) ASSERT_LT(t, 9000);
    }
    loader->Advance();
  }
  std::set<int64_t> val_windows;
  for (int64_t v = 0; v < loader->num_val_batches(); ++v) {
    for (int r = 0; r < 2; ++r) {
      options.dp_rank = r;
      absl::StatusOr<DataLoader> rank = DataLoader::Create(data, options);
      Batch batch = rank->ValBatch(v).value();
      EXPECT_EQ(ToVector(batch.inputs), ToVector(rank->ValBatch(v).value().inputs));
      for (int64_t t : ToVector(batch.inputs)) EXPECT_GE(t, 9000);
      for (int64_t w : WindowsOf(batch, 10)) EXPECT_TRUE(val_windows.insert(w).second) << w;
      EXPECT_EQ(ToVector(batch.targets)[0], ToVector(batch.inputs)[0] + 1);
    }
  }
  EXPECT_EQ(val_windows.size(), 96u);
  EXPECT_EQ(*val_windows.begin(), 900);
}

TEST(DataLoaderTest, HoldsOutAtLeastOneWindow) {
  IotaDataset data(64 * 40 + 1);
  absl::StatusOr<DataLoader> loader =
      DataLoader::Create(data, {.seq_len = 64, .micro_batch = 1, .val_fraction = 0.001});
  ASSERT_TRUE(loader.ok()) << loader.status();
  // 65 tokens held out (one window), so the training part ends one token short of window 38.
  EXPECT_EQ(loader->num_val_batches(), 1);
  EXPECT_EQ(loader->batches_per_epoch(), 38);
  absl::StatusOr<DataLoader> none =
      DataLoader::Create(data, {.seq_len = 64, .micro_batch = 1, .val_fraction = 0});
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(none->num_val_batches(), 0);
  EXPECT_EQ(none->batches_per_epoch(), 40);
}

TEST(DataLoaderTest, TooShortDataIsAnError) {
  IotaDataset data(1000);
  EXPECT_THAT(
      DataLoader::Create(
          data,
          {.seq_len = 64, .micro_batch = 8, .grad_accum = 1, .dp_size = 4, .val_fraction = 0}),
      InvalidArgumentWith("data: 1000 tokens give 15 training windows of seq_len 64, "
                          "fewer than one global batch of 32 (dp 4 x micro_batch 8 x "
                          "grad_accum 1)"));
  EXPECT_THAT(DataLoader::Create(data, {.seq_len = 64, .micro_batch = 15, .val_fraction = 0.05}),
              InvalidArgumentWith("data: 1000 tokens give 14 training windows of seq_len 64 "
                                  "(after holding out the last 65 tokens for validation), fewer "
                                  "than one global batch of 15 (dp 1 x micro_batch 15 x "
                                  "grad_accum 1)"));
  IotaDataset tiny(50);
  EXPECT_THAT(DataLoader::Create(tiny, {.seq_len = 64, .micro_batch = 1}),
              InvalidArgumentWith(HasSubstr("50 tokens give 0 training windows")));
}

TEST(DataLoaderTest, RejectsBadOptions) {
  IotaDataset data(10000);
  EXPECT_THAT(DataLoader::Create(data, {.dp_rank = 2, .dp_size = 2}),
              InvalidArgumentWith(HasSubstr("dp_rank 2")));
  EXPECT_THAT(DataLoader::Create(data, {.seq_len = 0}), InvalidArgumentWith(HasSubstr("seq_len")));
  EXPECT_THAT(DataLoader::Create(data, {.val_fraction = 1.0}),
              InvalidArgumentWith(HasSubstr("data.val_fraction")));
}

}  // namespace
}  // namespace fsdp
