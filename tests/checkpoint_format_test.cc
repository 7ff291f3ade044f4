// The checkpoint format (checkpoint/format.h): shard files, metadata, commit, resharded reads.
#include "checkpoint/format.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "absl/status/status.h"
#include "checkpoint/crc32.h"
#include "common/strings.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/status_matchers.h"

namespace fsdp::ckpt {
namespace {

namespace fs = std::filesystem;
using ::fsdp::testing::InvalidArgumentWith;
using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::MatchesRegex;
using ::testing::StartsWith;

MATCHER_P2(StatusIs, code, message_matcher, "") {
  const absl::Status& status = ::fsdp::testing::StatusOf(arg);
  if (status.code() != code) {
    *result_listener << "status is " << status.ToString();
    return false;
  }
  return ::testing::ExplainMatchResult(message_matcher, std::string(status.message()),
                                       result_listener);
}

// A bitwise CRC-32 (zlib / IEEE), independent of the table-driven one in crc32.cc.
uint32_t ReferenceCrc32(const std::string& bytes) {
  uint32_t crc = 0xFFFFFFFFu;
  for (unsigned char b : bytes) {
    crc ^= b;
    for (int k = 0; k < 8; ++k) crc = (crc >> 1) ^ (0xEDB88320u & (0u - (crc & 1u)));
  }
  return ~crc;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

void WriteFile(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

void FlipByte(const std::string& path, int64_t offset) {
  std::string bytes = ReadFile(path);
  ASSERT_LT(offset, static_cast<int64_t>(bytes.size()));
  bytes[offset] = static_cast<char>(bytes[offset] ^ 0x5A);
  WriteFile(path, bytes);
}

// One simulated rank's part: rows [begin, end) of a tensor.
struct Part {
  int rank;
  int64_t begin, end;
};

struct ModelTensor {
  std::string name;
  at::Tensor value;
  std::vector<Part> parts;
};

// 3 ranks with uneven row splits, a scalar, a tensor some ranks hold no rows of, and an empty one.
std::vector<ModelTensor> TestModel(const std::string& prefix = "") {
  at::manual_seed(7);
  return {
      {prefix + "w", at::randn({10, 3}), {{0, 0, 4}, {1, 4, 8}, {2, 8, 10}}},
      {prefix + "b", at::randn({3}).to(at::kBFloat16), {{0, 0, 1}, {1, 1, 2}, {2, 2, 3}}},
      {prefix + "count", at::scalar_tensor(42, at::kLong), {{0, 0, 1}}},
      {prefix + "e", at::randn({5, 2}).to(at::kDouble), {{0, 0, 0}, {1, 0, 5}, {2, 5, 5}}},
      {prefix + "none", at::zeros({0, 4}, at::kInt), {{0, 0, 0}, {1, 0, 0}}},
  };
}

class CheckpointFormatTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = StrCat("/tmp/fsdp_ckpt_test_", ::getpid(), "_",
                   ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(root_);
    fs::create_directories(root_);
  }
  void TearDown() override { fs::remove_all(root_); }

  std::string Dir(int64_t step) const { return StrCat(root_, "/", StepDirName(step)); }

  // Writes `model` as 3 ranks would into DIR.tmp, merges, writes metadata; commits if asked.
  Metadata Save(int64_t step, const std::vector<ModelTensor>& model, bool commit = true) {
    const std::string tmp = Dir(step) + ".tmp";
    std::vector<RankManifest> manifests;
    std::vector<FileEntry> files;
    for (int rank = 0; rank < 3; ++rank) {
      ShardWriter writer(tmp, rank);
      for (const ModelTensor& t : model) {
        for (const Part& p : t.parts) {
          if (p.rank != rank) continue;
          at::Tensor rows = t.value.dim() == 0 ? t.value : t.value.slice(0, p.begin, p.end);
          std::vector<int64_t> shape(t.value.sizes().begin(), t.value.sizes().end());
          EXPECT_TRUE(writer.Add(t.name, rows, p.begin, shape).ok()) << t.name;
        }
      }
      absl::StatusOr<RankManifest> m = writer.Finish();
      EXPECT_TRUE(m.ok()) << m.status();
      files.push_back(m->file);
      manifests.push_back(*std::move(m));
    }
    absl::StatusOr<std::vector<TensorEntry>> merged = MergeManifests(manifests);
    EXPECT_TRUE(merged.ok()) << merged.status();
    Metadata metadata;
    metadata.step = step;
    metadata.world_size = 3;
    metadata.mesh_axes = {"shard"};
    metadata.mesh_degrees = {3};
    metadata.strategy = "full_shard";
    metadata.extra = {{"data_position", 1234}, {"rng", "abc"}};
    metadata.tensors = *std::move(merged);
    metadata.files = files;
    EXPECT_TRUE(WriteMetadata(tmp, metadata).ok());
    if (commit) {
      EXPECT_TRUE(CommitCheckpoint(tmp, Dir(step)).ok());
    }
    return metadata;
  }

  std::string root_;
};

at::Tensor Rows(const at::Tensor& t, int64_t begin, int64_t end) {
  return t.dim() == 0 ? t : t.slice(0, begin, end);
}

TEST_F(CheckpointFormatTest, NamesAndDtypes) {
  EXPECT_EQ(StepDirName(120), "step_000000120");
  EXPECT_EQ(StepDirName(1234567890), "step_1234567890");
  EXPECT_EQ(RankFileName(3), "rank00003.bin");
  EXPECT_STREQ(DtypeName(at::kFloat), "F32");
  EXPECT_STREQ(DtypeName(at::kBFloat16), "BF16");
  EXPECT_STREQ(DtypeName(at::kBool), "");
  for (c10::ScalarType t :
       {at::kFloat, at::kBFloat16, at::kHalf, at::kDouble, at::kLong, at::kInt}) {
    EXPECT_EQ(*DtypeFromName(DtypeName(t)), t);
  }
  EXPECT_THAT(DtypeFromName("f32"), InvalidArgumentWith(HasSubstr("unknown dtype 'f32'")));
  EXPECT_EQ(ReferenceCrc32("123456789"), 0xCBF43926u);
}

// Note [Sliced CRC-32]: the eight-byte steps and the byte tail agree with the bitwise CRC at
// every length and alignment, and when a CRC is continued across calls.
TEST(Crc32Test, MatchesTheBitwiseReferenceAtEveryLengthAndAlignment) {
  std::mt19937 rng(7);
  std::string bytes(256, '\0');
  for (char& c : bytes) c = static_cast<char>(rng());
  for (size_t offset = 0; offset < 9; ++offset) {
    for (size_t n = 0; offset + n <= 200; ++n) {
      ASSERT_EQ(Crc32(0, bytes.data() + offset, n), ReferenceCrc32(bytes.substr(offset, n)))
          << "offset " << offset << ", " << n << " bytes";
    }
  }
  for (size_t split = 0; split <= 100; ++split) {
    uint32_t crc = Crc32(0, bytes.data(), split);
    EXPECT_EQ(Crc32(crc, bytes.data() + split, 100 - split), ReferenceCrc32(bytes.substr(0, 100)))
        << "split at " << split;
  }
  EXPECT_EQ(Crc32(0, "123456789", 9), 0xCBF43926u);
}

TEST(Crc32Test, CombineIsTheCrcOfTheConcatenation) {
  std::mt19937 rng(11);
  std::string bytes(300, '\0');
  for (char& c : bytes) c = static_cast<char>(rng());
  for (size_t split : {0, 1, 7, 8, 9, 64, 150, 299, 300}) {
    const uint32_t a = Crc32(0, bytes.data(), split);
    const uint32_t b = Crc32(0, bytes.data() + split, bytes.size() - split);
    EXPECT_EQ(Crc32Combine(a, b, bytes.size() - split), ReferenceCrc32(bytes)) << split;
  }
  // A second part of 2^29 + 5 bytes: its length has bits past the 32 powers of x the combine
  // keeps (x^(2^k), k from 3 for bytes), so this checks that they wrap around correctly.
  const uint64_t n = (uint64_t{1} << 29) + 5;
  const std::vector<char> zeros(1 << 20, '\0');
  uint32_t crc_b = 0;
  uint32_t crc_ab = Crc32(0, bytes.data(), 17);
  for (uint64_t done = 0; done < n;) {
    const size_t step = static_cast<size_t>(std::min<uint64_t>(zeros.size(), n - done));
    crc_b = Crc32(crc_b, zeros.data(), step);
    crc_ab = Crc32(crc_ab, zeros.data(), step);
    done += step;
  }
  EXPECT_EQ(Crc32Combine(Crc32(0, bytes.data(), 17), crc_b, n), crc_ab);
}

// Crc32Parallel: the serial CRC on any thread count, for lengths around its block size (8 MiB)
// and tails of every size class.
TEST(Crc32Test, ParallelEqualsSerial) {
  std::mt19937 rng(13);
  std::vector<unsigned char> bytes((size_t{8} << 20) * 5 + 777);
  for (unsigned char& c : bytes) c = static_cast<unsigned char>(rng());
  for (size_t n : {size_t{0}, size_t{5}, (size_t{8} << 20) * 2 - 1, (size_t{8} << 20) * 2,
                   (size_t{8} << 20) * 3 + 1, bytes.size()}) {
    const uint32_t serial = Crc32(0, bytes.data(), n);
    for (int threads : {1, 2, 3, 8}) {
      EXPECT_EQ(Crc32Parallel(bytes.data(), n, threads), serial) << n << " bytes, " << threads;
    }
  }
}

TEST_F(CheckpointFormatTest, RoundTripAndResharding) {
  std::vector<ModelTensor> model = TestModel();
  Save(120, model);
  ASSERT_FALSE(fs::exists(Dir(120) + ".tmp"));
  absl::StatusOr<CheckpointReader> reader = CheckpointReader::Open(Dir(120));
  ASSERT_TRUE(reader.ok()) << reader.status();
  const Metadata& m = reader->metadata();
  EXPECT_EQ(m.version, 1);
  EXPECT_EQ(m.step, 120);
  EXPECT_EQ(m.world_size, 3);
  EXPECT_EQ(m.mesh_axes, std::vector<std::string>{"shard"});
  EXPECT_EQ(m.mesh_degrees, std::vector<int>{3});
  EXPECT_EQ(m.strategy, "full_shard");
  EXPECT_EQ(m.extra["data_position"], 1234);
  ASSERT_EQ(m.files.size(), 3u);
  ASSERT_EQ(m.tensors.size(), model.size());

  // Files: sizes and whole-file CRCs as recorded; chunks 64-aligned with their own CRCs.
  for (const FileEntry& f : m.files) {
    std::string bytes = ReadFile(Dir(120) + "/" + f.file);
    EXPECT_EQ(static_cast<int64_t>(bytes.size()), f.size) << f.file;
    EXPECT_EQ(ReferenceCrc32(bytes), f.crc32) << f.file;
  }
  for (const TensorEntry& t : m.tensors) {
    for (const Chunk& c : t.chunks) {
      EXPECT_EQ(c.offset % 64, 0) << t.name;
      std::string bytes = ReadFile(Dir(120) + "/" + c.file).substr(c.offset, c.nbytes);
      EXPECT_EQ(ReferenceCrc32(bytes), c.crc32) << t.name;
    }
  }
  EXPECT_EQ(reader->Find("w")->chunks.size(), 3u);
  EXPECT_EQ(reader->Find("e")->chunks.size(), 1u);
  EXPECT_EQ(reader->Find("none")->chunks.size(), 0u);
  EXPECT_EQ(reader->Find("count")->shape, std::vector<int64_t>{});
  EXPECT_EQ(reader->Find("b")->dtype, "BF16");

  for (const ModelTensor& t : model) {
    SCOPED_TRACE(t.name);
    int64_t rows = t.value.dim() == 0 ? 1 : t.value.size(0);
    at::Tensor whole;
    ASSERT_TRUE(reader->ReadRows(t.name, 0, rows, whole).ok());
    EXPECT_TRUE(at::equal(whole, t.value));
    EXPECT_EQ(whole.sizes(), t.value.sizes());
    EXPECT_EQ(whole.scalar_type(), t.value.scalar_type());
    // Read back as 2 and as 4 ranks would (ceil-divided rows, windows crossing chunks).
    for (int64_t ranks : {2, 4}) {
      int64_t per = (rows + ranks - 1) / ranks;
      std::vector<at::Tensor> pieces;
      for (int64_t r = 0; r < ranks; ++r) {
        int64_t begin = std::min(rows, r * per), end = std::min(rows, begin + per);
        if (t.value.dim() == 0 && r > 0) continue;
        at::Tensor out;
        ASSERT_TRUE(reader->ReadRows(t.name, begin, end, out).ok()) << begin << " " << end;
        EXPECT_TRUE(at::equal(out, Rows(t.value, begin, end))) << begin << " " << end;
        pieces.push_back(out);
      }
      if (t.value.dim() > 0) {
        EXPECT_TRUE(at::equal(at::cat(pieces), t.value));
      }
    }
  }
  // Windows crossing two and three chunks of w, into a caller-allocated tensor.
  at::Tensor out = at::empty({6, 3});
  ASSERT_TRUE(reader->ReadRows("w", 3, 9, out).ok());
  EXPECT_TRUE(at::equal(out, model[0].value.slice(0, 3, 9)));
  at::Tensor b;
  ASSERT_TRUE(reader->ReadRows("b", 1, 3, b).ok());
  EXPECT_TRUE(at::equal(b, model[1].value.slice(0, 1, 3)));
  at::Tensor none;
  ASSERT_TRUE(reader->ReadRows("w", 5, 5, none).ok());
  EXPECT_EQ(none.sizes(), (std::vector<int64_t>{0, 3}));
  EXPECT_TRUE(reader->VerifyFiles().ok());
}

TEST_F(CheckpointFormatTest, ReadRowsArgumentErrors) {
  Save(1, TestModel());
  absl::StatusOr<CheckpointReader> reader = CheckpointReader::Open(Dir(1));
  ASSERT_TRUE(reader.ok()) << reader.status();
  at::Tensor wrong = at::empty({2, 3}, at::kDouble);
  EXPECT_THAT(reader->ReadRows("w", 0, 2, wrong),
              InvalidArgumentWith("w: out is Double [2, 3] on cpu, expected a contiguous CPU "
                                  "F32 [2, 3]"));
  at::Tensor shape = at::empty({3, 3});
  EXPECT_THAT(reader->ReadRows("w", 0, 2, shape), InvalidArgumentWith(HasSubstr("F32 [2, 3]")));
  at::Tensor out;
  EXPECT_THAT(reader->ReadRows("w", 4, 11, out),
              InvalidArgumentWith("w: rows [4, 11) are not within [0, 10)"));
  EXPECT_THAT(reader->ReadRows("count", 0, 0, out),
              InvalidArgumentWith("count: a scalar is read as rows [0, 1)"));
}

TEST_F(CheckpointFormatTest, ShardWriterRejectsRowsThatDoNotFit) {
  ShardWriter writer(root_ + "/w", 0);
  EXPECT_THAT(writer.Add("x", at::zeros({3, 2}), 8, {10, 2}),
              InvalidArgumentWith("x: rows of shape [3, 2] at row 8 do not fit the global shape "
                                  "[10, 2]"));
  EXPECT_THAT(writer.Add("x", at::zeros({3, 4}), 0, {10, 2}),
              InvalidArgumentWith(HasSubstr("x: ")));
  EXPECT_THAT(writer.Add("s", at::zeros({1}), 0, {}),
              InvalidArgumentWith(HasSubstr("s: a scalar is stored as rows [0, 1)")));
  EXPECT_THAT(writer.Add("u", at::zeros({2}, at::kBool), 0, {2}),
              InvalidArgumentWith("u: dtype Bool is not supported"));
  ASSERT_TRUE(writer.Add("x", at::ones({2, 2}), 1, {10, 2}).ok());
  EXPECT_THAT(writer.Add("x", at::ones({2}), 5, {10}),
              InvalidArgumentWith("x: added as F32 [10, 2] and as F32 [10]"));
  absl::StatusOr<RankManifest> m = writer.Finish();
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(m->file.file, "rank00000.bin");
  EXPECT_EQ(m->file.size, 16);
  EXPECT_EQ(m->tensors.size(), 1u);
  EXPECT_EQ(m->tensors[0].chunks[0].row_begin, 1);
  EXPECT_EQ(m->tensors[0].chunks[0].row_end, 3);
  EXPECT_THAT(writer.Finish(), StatusIs(absl::StatusCode::kFailedPrecondition,
                                        HasSubstr("rank00000.bin: Finish twice")));
}

TEST_F(CheckpointFormatTest, OpenErrors) {
  Save(1, TestModel());
  const std::string dir = Dir(1);
  const int64_t size1 = static_cast<int64_t>(fs::file_size(dir + "/rank00001.bin"));
  const int64_t size2 = static_cast<int64_t>(fs::file_size(dir + "/rank00002.bin"));

  fs::copy(dir, root_ + "/trunc", fs::copy_options::recursive);
  fs::resize_file(root_ + "/trunc/rank00001.bin", 10);
  EXPECT_THAT(
      CheckpointReader::Open(root_ + "/trunc"),
      StatusIs(absl::StatusCode::kDataLoss,
               StrCat(root_, "/trunc/rank00001.bin: truncated: 10 bytes, expected ", size1)));

  fs::copy(dir, root_ + "/missing", fs::copy_options::recursive);
  fs::remove(root_ + "/missing/rank00002.bin");
  EXPECT_THAT(
      CheckpointReader::Open(root_ + "/missing"),
      StatusIs(absl::StatusCode::kDataLoss,
               StrCat(root_, "/missing/rank00002.bin: missing (metadata.json lists it with ", size2,
                      " bytes)")));

  fs::create_directories(root_ + "/empty");
  EXPECT_THAT(CheckpointReader::Open(root_ + "/empty"),
              StatusIs(absl::StatusCode::kNotFound,
                       StrCat(root_,
                              "/empty: no metadata.json: not a checkpoint, or a save that "
                              "never completed")));
  // A save that died before its metadata.
  Save(2, TestModel(), /*commit=*/false);
  fs::remove(Dir(2) + ".tmp/metadata.json");
  EXPECT_THAT(CheckpointReader::Open(Dir(2) + ".tmp"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("no metadata.json")));

  fs::copy(dir, root_ + "/corrupt", fs::copy_options::recursive);
  WriteFile(root_ + "/corrupt/metadata.json", "{\"format\": \"fsdp.cpp-checkpoint\", \"vers");
  EXPECT_THAT(CheckpointReader::Open(root_ + "/corrupt"),
              StatusIs(absl::StatusCode::kDataLoss,
                       AllOf(StartsWith(StrCat(root_, "/corrupt/metadata.json: not valid JSON: ")),
                             HasSubstr("parse_error"))));

  fs::copy(dir, root_ + "/v2", fs::copy_options::recursive);
  nlohmann::json json = nlohmann::json::parse(ReadFile(dir + "/metadata.json"));
  json["version"] = 2;
  WriteFile(root_ + "/v2/metadata.json", json.dump());
  EXPECT_THAT(CheckpointReader::Open(root_ + "/v2"),
              StatusIs(absl::StatusCode::kUnimplemented,
                       StrCat(root_,
                              "/v2/metadata.json: format version 2 is newer than this "
                              "build reads (1)")));

  // A FIFO in metadata.json's place is refused at once (opening it would wait for a writer),
  // and so is a directory.
  fs::copy(dir, root_ + "/fifo", fs::copy_options::recursive);
  fs::remove(root_ + "/fifo/metadata.json");
  ASSERT_EQ(::mkfifo((root_ + "/fifo/metadata.json").c_str(), 0600), 0);
  EXPECT_THAT(CheckpointReader::Open(root_ + "/fifo"),
              StatusIs(absl::StatusCode::kDataLoss,
                       StrCat(root_, "/fifo/metadata.json: not a regular file (a FIFO); "
                                     "metadata.json must be a file")));
  fs::copy(dir, root_ + "/folder", fs::copy_options::recursive);
  fs::remove(root_ + "/folder/metadata.json");
  fs::create_directories(root_ + "/folder/metadata.json");
  EXPECT_THAT(CheckpointReader::Open(root_ + "/folder"),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("not a regular file (a directory)")));

  // A committed step folder whose metadata names another step (found by the red-team pass:
  // it resumed as the metadata's step while load=latest and pruning went by the name).
  const std::string renamed = StrCat(root_, "/", StepDirName(7));
  fs::copy(dir, renamed, fs::copy_options::recursive);
  EXPECT_THAT(CheckpointReader::Open(renamed),
              StatusIs(absl::StatusCode::kDataLoss,
                       StrCat(renamed, "/metadata.json: step 1, but the folder is ",
                              StepDirName(7), " (step 7)")));
  EXPECT_TRUE(CheckpointReader::Open(renamed + "/").status().message().find("(step 7)") !=
              std::string::npos);
  // Any other folder name is not a claim about the step.
  EXPECT_TRUE(CheckpointReader::Open(root_ + "/trunc").status().message().find("folder is") ==
              std::string::npos);
}

TEST_F(CheckpointFormatTest, FlippedChunkByteFailsItsReadOnly) {
  Save(1, TestModel());
  const std::string dir = Dir(1);
  absl::StatusOr<CheckpointReader> reader = CheckpointReader::Open(dir);
  ASSERT_TRUE(reader.ok());
  const Chunk& c = reader->Find("w")->chunks[1];
  ASSERT_EQ(c.file, "rank00001.bin");
  FlipByte(dir + "/rank00001.bin", c.offset + 5);
  at::Tensor out;
  EXPECT_THAT(reader->ReadRows("w", 2, 6, out),
              StatusIs(absl::StatusCode::kDataLoss,
                       MatchesRegex(StrCat(dir,
                                           "/rank00001.bin: CRC mismatch in tensor w rows "
                                           "\\[4, 8\\) at offset 0: stored 0x[0-9a-f]{8}, "
                                           "computed 0x[0-9a-f]{8}"))));
  out = at::Tensor();
  EXPECT_TRUE(reader->ReadRows("w", 0, 4, out).ok());  // other chunks still read
  EXPECT_THAT(reader->VerifyFiles(),
              StatusIs(absl::StatusCode::kDataLoss,
                       StartsWith(StrCat(dir, "/rank00001.bin: CRC mismatch: stored 0x"))));
}

TEST_F(CheckpointFormatTest, VerifyFilesCatchesFlippedPadding) {
  Save(1, TestModel());
  const std::string dir = Dir(1);
  absl::StatusOr<CheckpointReader> reader = CheckpointReader::Open(dir);
  ASSERT_TRUE(reader.ok());
  // rank 0 holds w rows [0, 4) (48 bytes at 0) and then b at 64: bytes 48..63 are padding.
  ASSERT_EQ(reader->Find("w")->chunks[0].nbytes, 48);
  ASSERT_EQ(reader->Find("b")->chunks[0].offset, 64);
  FlipByte(dir + "/rank00000.bin", 50);
  for (const TensorEntry& t : reader->metadata().tensors) {
    at::Tensor out;
    EXPECT_TRUE(reader->ReadRows(t.name, 0, t.shape.empty() ? 1 : t.shape[0], out).ok());
  }
  EXPECT_THAT(reader->VerifyFiles(),
              StatusIs(absl::StatusCode::kDataLoss,
                       StartsWith(StrCat(dir, "/rank00000.bin: CRC mismatch: stored 0x"))));
}

TEST_F(CheckpointFormatTest, MetadataFromAnotherModel) {
  Save(1, TestModel("model/"));
  absl::StatusOr<CheckpointReader> reader = CheckpointReader::Open(Dir(1));
  ASSERT_TRUE(reader.ok());
  at::Tensor out;
  EXPECT_THAT(reader->ReadRows("w", 0, 10, out),
              StatusIs(absl::StatusCode::kNotFound, StrCat(Dir(1), ": no tensor w")));
  EXPECT_EQ(reader->Find("w"), nullptr);
  EXPECT_NE(reader->Find("model/w"), nullptr);
}

TEST_F(CheckpointFormatTest, MetadataJsonSchemaRoundTrip) {
  Metadata m = Save(1, TestModel(), /*commit=*/false);
  nlohmann::json json = ToJson(m);
  for (const char* key : {"format", "version", "step", "world_size", "mesh", "strategy", "extra",
                          "files", "tensors"}) {
    EXPECT_TRUE(json.contains(key)) << key;
  }
  EXPECT_EQ(json["format"], "fsdp.cpp-checkpoint");
  EXPECT_EQ(json["tensors"][0]["chunks"][1]["rows"], nlohmann::json::array({4, 8}));
  EXPECT_EQ(json, nlohmann::json::parse(ReadFile(Dir(1) + ".tmp/metadata.json")));
  absl::StatusOr<Metadata> back = MetadataFromJson(json, "src");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(ToJson(*back), json);
}

// Each mutation of a valid metadata.json and the exact error it must produce.
TEST_F(CheckpointFormatTest, MetadataValidation) {
  const nlohmann::json good = ToJson(Save(1, TestModel(), /*commit=*/false));
  const int64_t size1 = good["files"][1]["size"];
  using J = nlohmann::json;
  struct Case {
    std::function<void(J&)> mutate;
    std::string message;
  };
  std::vector<Case> cases = {
      {[](J& j) { j["tensors"][0]["chunks"][1]["offset"] = j["files"][1]["size"]; },
       StrCat("src: tensors[0].chunks[1].nbytes: bytes [", size1, ", ", size1 + 48,
              ") are beyond the end of rank00001.bin (", size1, " bytes)")},
      {[](J& j) {
         j["tensors"][0]["chunks"][1]["rows"] = {3, 7};
       },
       "src: tensors[0].chunks: overlap: rows [3, 4) are in more than one chunk (the second in "
       "rank00001.bin)"},
      {[](J& j) { j["tensors"][0]["chunks"].erase(1); },
       "src: tensors[0].chunks: gap: rows [4, 8) are in no chunk"},
      {[](J& j) { j["tensors"][0]["chunks"][1]["nbytes"] = 44; },
       "src: tensors[0].chunks[1].nbytes: 44 bytes, but rows [4, 8) of F32 [10, 3] take 4 x 12 "
       "bytes"},
      {[](J& j) { j["tensors"][1]["dtype"] = "F8"; },
       "src: tensors[1].dtype: unknown dtype 'F8' (expected one of F32, BF16, F16, F64, I64, "
       "I32)"},
      {[](J& j) { j["tensors"][0]["shape"][1] = -3; },
       "src: tensors[0].shape[1]: -3 is out of range [0, 9223372036854775807]"},
      {[](J& j) { j["tensors"][3]["name"] = "w"; }, "src: tensors[3].name: 'w' is also tensors[0]"},
      {[](J& j) { j["tensors"][0]["chunks"][0]["file"] = "../rank00000.bin"; },
       "src: tensors[0].chunks[0].file: '../rank00000.bin' is not a plain file name"},
      {[](J& j) { j["tensors"][0]["chunks"][0]["file"] = "rank00009.bin"; },
       "src: tensors[0].chunks[0].file: 'rank00009.bin' is not listed in files"},
      {[](J& j) { j["files"][2]["file"] = "a/b"; },
       "src: files[2].file: 'a/b' is not a plain file name"},
      {[](J& j) { j["step"] = "120"; }, "src: step: expected an integer, got string"},
      {[](J& j) { j.erase("world_size"); }, "src: world_size: missing"},
      {[](J& j) { j["version"] = 0; }, "src: version: 0 is out of range [1, 9223372036854775807]"},
      {[](J& j) { j["format"] = "pickle"; },
       "src: format: 'pickle', expected 'fsdp.cpp-checkpoint'"},
      {[](J& j) {
         j["mesh"]["degrees"] = {2, 3};
       },
       "src: mesh: 1 axes but 2 degrees"},
      {[](J& j) { j["files"][0]["crc32"] = 1ll << 32; },
       "src: files[0].crc32: 4294967296 is out of range [0, 4294967295]"},
      {[](J& j) { j["tensors"][2]["chunks"][0]["rows"] = {0}; },
       "src: tensors[2].chunks[0].rows: expected [begin, end]"},
      {[](J& j) { j = J::array(); }, "src: (root): expected an object, got array"},
  };
  for (const Case& c : cases) {
    J json = good;
    c.mutate(json);
    EXPECT_THAT(MetadataFromJson(json, "src"), StatusIs(absl::StatusCode::kDataLoss, c.message));
  }
  J v2 = good;
  v2["version"] = 2;
  EXPECT_THAT(MetadataFromJson(v2, "src"),
              StatusIs(absl::StatusCode::kUnimplemented,
                       "src: format version 2 is newer than this build reads (1)"));
}

// The rank manifest (what a rank reports to rank 0): round trip and validation.
TEST_F(CheckpointFormatTest, RankManifestJson) {
  at::Tensor w = at::randn({10, 3});
  ShardWriter writer(root_ + "/m.tmp", 1);
  ASSERT_TRUE(writer.Add("w", w.slice(0, 4, 8), 4, {10, 3}).ok());
  ASSERT_TRUE(writer.Add("none", at::zeros({0, 4}), 0, {0, 4}).ok());
  absl::StatusOr<RankManifest> written = writer.Finish();
  ASSERT_TRUE(written.ok()) << written.status();
  const nlohmann::json good = RankManifestToJson(*written);
  absl::StatusOr<RankManifest> back = RankManifestFromJson(good, "src");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->rank, 1);
  EXPECT_EQ(back->file.file, "rank00001.bin");
  EXPECT_EQ(back->file.crc32, written->file.crc32);
  ASSERT_EQ(back->tensors.size(), 2u);
  EXPECT_EQ(back->tensors[0].chunks[0].row_end, 8);
  EXPECT_EQ(RankManifestToJson(*back), good);

  // A rank that held no rows reports no file.
  RankManifest empty;
  empty.rank = 2;
  absl::StatusOr<RankManifest> empty_back = RankManifestFromJson(RankManifestToJson(empty), "e");
  ASSERT_TRUE(empty_back.ok()) << empty_back.status();
  EXPECT_EQ(empty_back->rank, 2);
  EXPECT_TRUE(empty_back->file.file.empty());

  using J = nlohmann::json;
  struct Case {
    std::function<void(J&)> mutate;
    std::string message;
  };
  std::vector<Case> cases = {
      {[](J& j) { j.erase("rank"); }, "src: rank: missing"},
      {[](J& j) { j["rank"] = -1; }, "src: rank: -1 is out of range [0, 2147483647]"},
      {[](J& j) { j.erase("file"); }, "src: file: missing"},
      {[](J& j) { j["file"]["size"] = -1; },
       "src: file.size: -1 is out of range [0, 9223372036854775807]"},
      {[](J& j) { j["tensors"] = J::object(); }, "src: tensors: expected an array, got object"},
      {[](J& j) { j["tensors"][0].erase("shape"); }, "src: tensors[0].shape: missing"},
      {[](J& j) { j["tensors"][0]["chunks"][0]["crc32"] = "x"; },
       "src: tensors[0].chunks[0].crc32: expected an integer, got string"},
      {[](J& j) { j["tensors"][0]["chunks"][0]["file"] = "rank00002.bin"; },
       "src: tensors[0].chunks[0].file: 'rank00002.bin' is not listed in files"},
      {[](J& j) { j["tensors"][0]["chunks"][0]["rows"] = {8, 12}; },
       "src: tensors[0].chunks: rows [8, 12) are beyond the 10 rows of shape [10, 3]"},
      {[](J& j) { j = J::array(); }, "src: (root): expected an object, got array"},
  };
  for (const Case& c : cases) {
    J json = good;
    c.mutate(json);
    EXPECT_THAT(RankManifestFromJson(json, "src"),
                StatusIs(absl::StatusCode::kDataLoss, c.message));
  }
  EXPECT_THAT(ParseJson(R"({"rank": )", "rank 3's manifest"),
              StatusIs(absl::StatusCode::kDataLoss, StartsWith("rank 3's manifest: not valid JSON")));
}

// Found by fuzz/metadata_fuzzer.cc and inputs crafted from its reports: a shape whose zero last
// dim hides an overflow let at::empty throw out of ReadRows; deep nesting overflowed the stack
// (nlohmann copies and compares recursively).
TEST_F(CheckpointFormatTest, MetadataRefusesShapesBeyondATensorAndDeepNesting) {
  const std::string dir = Dir(1);
  Save(1, TestModel());
  nlohmann::json json = nlohmann::json::parse(ReadFile(dir + "/metadata.json"));
  const int64_t big = int64_t{1} << 62;
  json["tensors"].push_back({{"name", "z"},
                             {"dtype", "F32"},
                             {"shape", {big, big, 0}},
                             {"chunks", {{{"file", "rank00000.bin"},
                                          {"offset", 0},
                                          {"nbytes", 0},
                                          {"rows", {0, big}},
                                          {"crc32", 0}}}}});
  EXPECT_THAT(MetadataFromJson(json, "src"),
              StatusIs(absl::StatusCode::kDataLoss,
                       StrCat("src: tensors[", json["tensors"].size() - 1, "].shape: [", big, ", ",
                              big, ", 0] is too large")));
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  EXPECT_THAT(ParseJson(deep, "src"),
              StatusIs(absl::StatusCode::kDataLoss,
                       "src: not valid JSON: nested deeper than 128 levels"));
  const std::string ok = std::string(kMaxJsonDepth, '[') + std::string(kMaxJsonDepth, ']');
  EXPECT_TRUE(ParseJson(ok, "src").ok());
  EXPECT_FALSE(ParseJson("[" + ok + "]", "src").ok());
}

TEST_F(CheckpointFormatTest, MergeRejectsNonTilingRows) {
  auto manifest = [](int rank, std::vector<std::pair<int64_t, int64_t>> rows,
                     std::string dtype = "F32") {
    RankManifest m;
    m.rank = rank;
    m.file.file = RankFileName(rank);
    TensorEntry t{"w", dtype, {10, 3}, {}};
    for (auto [b, e] : rows) t.chunks.push_back(Chunk{m.file.file, 0, (e - b) * 12, b, e, 0});
    m.tensors.push_back(t);
    return m;
  };
  absl::StatusOr<std::vector<TensorEntry>> ok =
      MergeManifests({manifest(1, {{4, 10}}), manifest(0, {{0, 4}})});
  ASSERT_TRUE(ok.ok()) << ok.status();
  ASSERT_EQ((*ok)[0].chunks.size(), 2u);
  EXPECT_EQ((*ok)[0].chunks[0].file, "rank00000.bin");

  EXPECT_THAT(MergeManifests({manifest(0, {{0, 4}}), manifest(1, {{6, 10}})}),
              StatusIs(absl::StatusCode::kInternal, "tensor w: gap: rows [4, 6) are in no chunk"));
  EXPECT_THAT(MergeManifests({manifest(0, {{0, 4}}), manifest(1, {{4, 8}})}),
              StatusIs(absl::StatusCode::kInternal, "tensor w: gap: rows [8, 10) are in no chunk"));
  // HSDP replicas both reporting the same shard.
  EXPECT_THAT(MergeManifests({manifest(0, {{0, 5}}), manifest(1, {{0, 5}, {5, 10}})}),
              StatusIs(absl::StatusCode::kInternal,
                       "tensor w: overlap: rows [0, 5) are in more than one chunk (the second in "
                       "rank00001.bin)"));
  EXPECT_THAT(MergeManifests({manifest(0, {{0, 5}}), manifest(1, {{5, 10}}, "BF16")}),
              StatusIs(absl::StatusCode::kInternal,
                       "tensor w: rank 1 has BF16 [10, 3], another rank has F32 [10, 3]"));
  EXPECT_THAT(
      MergeManifests({manifest(0, {{0, 5}}), manifest(0, {{5, 10}})}),
      StatusIs(absl::StatusCode::kInternal, "ranks 0 and 0 both report the file rank00000.bin"));
}

TEST_F(CheckpointFormatTest, CommitAndLatest) {
  EXPECT_THAT(LatestCheckpoint(root_ + "/nope"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr(root_ + "/nope")));
  std::vector<ModelTensor> model = TestModel();
  Save(5, model, /*commit=*/false);  // complete, but not committed
  EXPECT_THAT(LatestCheckpoint(root_), StatusIs(absl::StatusCode::kNotFound, HasSubstr(root_)));
  ASSERT_TRUE(CommitCheckpoint(Dir(5) + ".tmp", Dir(5)).ok());
  EXPECT_THAT(LatestCheckpoint(root_), ::fsdp::testing::IsOkAndHolds(Dir(5)));

  // A folder without metadata cannot be committed.
  fs::create_directories(root_ + "/half.tmp");
  EXPECT_THAT(CommitCheckpoint(root_ + "/half.tmp", Dir(6)),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("refusing to commit an incomplete checkpoint")));

  // Re-saving the same step replaces it.
  model[0].value = model[0].value + 1;
  Save(5, model);
  EXPECT_FALSE(fs::exists(Dir(5) + ".old"));
  EXPECT_FALSE(fs::exists(Dir(5) + ".tmp"));
  absl::StatusOr<CheckpointReader> reader = CheckpointReader::Open(Dir(5));
  ASSERT_TRUE(reader.ok());
  at::Tensor w;
  ASSERT_TRUE(reader->ReadRows("w", 0, 10, w).ok());
  EXPECT_TRUE(at::equal(w, model[0].value));

  // The highest step wins, numerically; uncommitted and foreign folders are ignored.
  Save(20, model);
  Save(100, model);
  Save(300, model, /*commit=*/false);
  fs::create_directories(root_ + "/step_000000400");  // no metadata.json
  fs::create_directories(root_ + "/step_12x");
  EXPECT_THAT(LatestCheckpoint(root_), ::fsdp::testing::IsOkAndHolds(Dir(100)));
  fs::create_directories(root_ + "/step_1000000000");
  WriteFile(root_ + "/step_1000000000/metadata.json", "{}");
  EXPECT_THAT(LatestCheckpoint(root_), ::fsdp::testing::IsOkAndHolds(root_ + "/step_1000000000"));
}

TEST_F(CheckpointFormatTest, Prune) {
  std::vector<ModelTensor> model = TestModel();
  for (int step : {1, 2, 3, 4, 5}) Save(step, model);
  Save(3, model, /*commit=*/false);         // died: older than the newest
  Save(9, model, /*commit=*/false);         // in progress: newer
  fs::create_directories(Dir(5) + ".old");  // an interrupted re-save of step 5
  EXPECT_THAT(PruneCheckpoints(root_, 0), InvalidArgumentWith("keep must be at least 1, got 0"));
  ASSERT_TRUE(PruneCheckpoints(root_, 2).ok());
  std::vector<std::string> left;
  for (const auto& e : fs::directory_iterator(root_)) left.push_back(e.path().filename());
  std::sort(left.begin(), left.end());
  EXPECT_EQ(left,
            (std::vector<std::string>{StepDirName(4), StepDirName(5), StepDirName(9) + ".tmp"}));
  ASSERT_TRUE(PruneCheckpoints(root_, 1).ok());
  EXPECT_TRUE(fs::exists(Dir(5)));
  EXPECT_FALSE(fs::exists(Dir(4)));
  EXPECT_THAT(LatestCheckpoint(root_), ::fsdp::testing::IsOkAndHolds(Dir(5)));
  // The step a save has just committed is kept even when higher steps exist.
  Save(3, model);
  ASSERT_TRUE(PruneCheckpoints(root_, 1, /*committed=*/3).ok());
  EXPECT_TRUE(fs::exists(Dir(3)));
  EXPECT_TRUE(fs::exists(Dir(5)));
}

// Note [A run that goes back]
TEST_F(CheckpointFormatTest, SetAsideCheckpointsAfter) {
  std::vector<ModelTensor> model = TestModel();
  EXPECT_THAT(SetAsideCheckpointsAfter(root_ + "/nope", 0),
              ::fsdp::testing::IsOkAndHolds(std::vector<std::string>{}));
  for (int step : {4, 8, 12}) Save(step, model);
  Save(16, model, /*commit=*/false);  // a save that died: not a checkpoint, left for pruning
  const std::string aside = root_ + "/" + kSupersededDir;
  EXPECT_THAT(SetAsideCheckpointsAfter(root_, 12),
              ::fsdp::testing::IsOkAndHolds(std::vector<std::string>{}));
  EXPECT_THAT(SetAsideCheckpointsAfter(root_, 5),
              ::fsdp::testing::IsOkAndHolds(std::vector<std::string>{
                  aside + "/" + StepDirName(8), aside + "/" + StepDirName(12)}));
  EXPECT_THAT(LatestCheckpoint(root_), ::fsdp::testing::IsOkAndHolds(Dir(4)));
  EXPECT_TRUE(fs::exists(Dir(16) + ".tmp"));
  ASSERT_TRUE(CheckpointReader::Open(aside + "/" + StepDirName(12)).ok());
  // Going back again: a name already taken gets a suffix; pruning does not look there.
  Save(8, model);
  EXPECT_THAT(SetAsideCheckpointsAfter(root_, 0),
              ::fsdp::testing::IsOkAndHolds(std::vector<std::string>{
                  aside + "/" + StepDirName(4), aside + "/" + StepDirName(8) + ".2"}));
  Save(2, model);
  ASSERT_TRUE(PruneCheckpoints(root_, 1).ok());
  EXPECT_TRUE(fs::exists(aside + "/" + StepDirName(8)));
  EXPECT_TRUE(fs::exists(aside + "/" + StepDirName(8) + ".2"));
}

}  // namespace
}  // namespace fsdp::ckpt
