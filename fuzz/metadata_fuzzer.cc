// libFuzzer harness for the checkpoint metadata readers (checkpoint/metadata.h, format.h). Each
// input is JSON text, taken through:
//   - ParseJson, then MetadataFromJson and RankManifestFromJson on the result: a status or a
//     value; an accepted value must survive ToJson -> FromJson unchanged (what a reader accepts,
//     the writer can write back), and an accepted manifest must merge (or fail) with a status;
//   - CheckpointReader::Open on a folder whose metadata.json is the input, next to the shard
//     files of a real checkpoint ($FSDP_FUZZ_CHECKPOINT, written by fsdp_fuzz_seeds): if it
//     opens, every tensor's rows read OK or fail with a CRC mismatch (kDataLoss), the only
//     thing Open does not check; VerifyFiles answers a status.
// Anything else is a finding (fuzz_util.h).
//
//   FSDP_FUZZ_CHECKPOINT=build/fuzz/seeds/checkpoint \
//     build/fuzz/sanitized/fsdp_fuzz_metadata -timeout=1 CORPUS build/fuzz/seeds/metadata
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <string>
#include <string_view>

#include <ATen/ATen.h>

#include "checkpoint/format.h"
#include "checkpoint/metadata.h"
#include "checkpoint/tensor_layout.h"
#include "fuzz/fuzz_util.h"

namespace {

namespace ckpt = fsdp::ckpt;
using fsdp::fuzz::Expect;

const std::string* g_dir = nullptr;  // the scratch checkpoint folder

void CheckJsonReaders(std::string_view text) {
  absl::StatusOr<nlohmann::json> json = ckpt::ParseJson(text, "input");
  if (!json.ok()) return;
  if (absl::StatusOr<ckpt::Metadata> m = ckpt::MetadataFromJson(*json, "input"); m.ok()) {
    const nlohmann::json written = ckpt::ToJson(*m);
    absl::StatusOr<ckpt::Metadata> again = ckpt::MetadataFromJson(written, "round trip");
    Expect(again.ok(), "MetadataFromJson refuses what ToJson wrote of what it accepted",
           again.status());
    Expect(ckpt::ToJson(*again) == written, "metadata changes through ToJson -> FromJson");
  }
  if (absl::StatusOr<ckpt::RankManifest> r = ckpt::RankManifestFromJson(*json, "input"); r.ok()) {
    const nlohmann::json written = ckpt::RankManifestToJson(*r);
    absl::StatusOr<ckpt::RankManifest> again = ckpt::RankManifestFromJson(written, "round trip");
    Expect(again.ok(), "RankManifestFromJson refuses what RankManifestToJson wrote",
           again.status());
    Expect(ckpt::RankManifestToJson(*again) == written, "manifest changes through a round trip");
    (void)ckpt::MergeManifests({*r});  // a status either way
  }
}

void CheckReader() {
  absl::StatusOr<ckpt::CheckpointReader> reader = ckpt::CheckpointReader::Open(*g_dir);
  if (!reader.ok()) return;
  for (const ckpt::TensorEntry& t : reader->metadata().tensors) {
    at::Tensor out;
    absl::Status s = reader->ReadRows(t.name, 0, ckpt::NumRows(t.shape), out);
    Expect(s.ok() || (s.code() == absl::StatusCode::kDataLoss &&
                      s.message().find("CRC mismatch") != std::string_view::npos),
           "Open accepted tensor '" + t.name + "' but reading it failed other than by its CRC", s);
    if (s.ok()) {
      Expect(out.scalar_type() == *ckpt::DtypeFromName(t.dtype), "read dtype differs");
      Expect(t.shape.empty() ? out.dim() == 0 : out.sizes().vec() == t.shape,
             "read shape differs from the metadata's");
    }
    Expect(!reader->ReadRows(t.name, 0, ckpt::NumRows(t.shape) + 1, out).ok(),
           "rows past the end read OK");
  }
  (void)reader->VerifyFiles();
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  g_dir = new std::string(fsdp::fuzz::ScratchDir("metadata"));
  // The shard files a seed metadata.json describes, so that mutants get past Open's file checks
  // to the reads.
  const char* shards = std::getenv("FSDP_FUZZ_CHECKPOINT");
  if (shards == nullptr || *shards == '\0') {
    std::fprintf(stderr, "fsdp fuzz: FSDP_FUZZ_CHECKPOINT is not set: CheckpointReader::Open "
                         "will stop at the missing shard files\n");
    return 0;
  }
  for (const auto& e : std::filesystem::directory_iterator(shards)) {
    if (e.is_regular_file() && e.path().filename() != ckpt::kMetadataFile) {
      std::filesystem::copy_file(e.path(), std::filesystem::path(*g_dir) / e.path().filename());
    }
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  fsdp::fuzz::WriteInput(*g_dir + "/" + ckpt::kMetadataFile, data, size);
  fsdp::fuzz::Run([&] {
    CheckJsonReaders(text);
    CheckReader();
  });
  return 0;
}
