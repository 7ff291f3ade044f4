// fsdp_fuzz_seeds OUT: writes the fuzzers' seed corpora with the project's own writers, so the
// seeds follow the formats as they are written today:
//   OUT/safetensors/*.safetensors  SaveSafetensors files: every dtype, scalars, empty tensors
//   OUT/checkpoint/                a 3-rank checkpoint (ShardWriter, MergeManifests,
//                                  WriteMetadata): metadata.json and rank0000{0,1,2}.bin
//   OUT/metadata/                  that metadata.json (as written, and on one line), and each
//                                  rank's manifest as JSON
// Built with the main build (not sanitized); the harnesses read OUT (see fuzz/run_fuzzer.sh).
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "checkpoint/format.h"
#include "checkpoint/safetensors.h"
#include "common/status.h"
#include "common/strings.h"

namespace {

namespace ckpt = fsdp::ckpt;
namespace fs = std::filesystem;

int Fail(const absl::Status& s) {
  std::fprintf(stderr, "fsdp_fuzz_seeds: %s\n", s.ToString().c_str());
  return 1;
}

// Small tensors with distinct values (the fuzzer keeps inputs small; a few bytes each).
at::Tensor Values(at::IntArrayRef shape, at::ScalarType dtype) {
  return at::arange(static_cast<double>(c10::multiply_integers(shape)), at::kDouble)
      .reshape(shape)
      .to(dtype);
}

absl::Status WriteSafetensors(const std::string& dir) {
  const std::map<std::string, std::map<std::string, at::Tensor>> files = {
      {"mixed", {{"w", Values({3, 2}, at::kFloat)},
                 {"b", Values({3}, at::kBFloat16)},
                 {"step", Values({}, at::kLong)},
                 {"h", Values({2, 1, 2}, at::kHalf)},
                 {"d", Values({1}, at::kDouble)},
                 {"i", Values({2, 2}, at::kInt)},
                 {"empty", Values({0, 4}, at::kFloat)}}},
      {"one_f32", {{"layers.0.attention.wq", Values({4, 2}, at::kFloat)}}},
      {"scalar", {{"s", Values({}, at::kDouble)}}},
      {"empty_only", {{"e", Values({0}, at::kBFloat16)}}},
  };
  for (const auto& [name, tensors] : files) {
    FSDP_RETURN_IF_ERROR(ckpt::SaveSafetensors(tensors, dir + "/" + name + ".safetensors"));
  }
  return absl::OkStatus();
}

// A checkpoint as 3 ranks of a FULL_SHARD job save it: rows split unevenly, one rank without a
// piece of some tensors, a scalar on one rank, an empty tensor on none.
absl::Status WriteCheckpoint(const std::string& dir, const std::string& metadata_dir) {
  struct Part {
    int rank;
    int64_t begin, end;
  };
  struct Item {
    std::string name;
    at::Tensor value;
    std::vector<Part> parts;
  };
  const std::vector<Item> items = {
      {"model/w", Values({10, 3}, at::kFloat), {{0, 0, 4}, {1, 4, 8}, {2, 8, 10}}},
      {"model/b", Values({3}, at::kBFloat16), {{0, 0, 1}, {1, 1, 2}, {2, 2, 3}}},
      {"model/h", Values({2, 2, 2}, at::kHalf), {{2, 0, 2}}},
      {"optim/step", Values({}, at::kLong), {{1, 0, 1}}},
      {"optim/d", Values({4}, at::kDouble), {{0, 0, 3}, {1, 3, 4}}},
      {"optim/i", Values({5, 1}, at::kInt), {{0, 0, 2}, {2, 2, 5}}},
  };
  std::vector<ckpt::RankManifest> manifests;
  ckpt::Metadata metadata;
  for (int rank = 0; rank < 3; ++rank) {
    ckpt::ShardWriter writer(dir, rank);
    for (const Item& item : items) {
      for (const Part& p : item.parts) {
        if (p.rank != rank) continue;
        at::Tensor rows = item.value.dim() == 0 ? item.value : item.value.slice(0, p.begin, p.end);
        FSDP_RETURN_IF_ERROR(writer.Add(item.name, rows, p.begin, item.value.sizes().vec()));
      }
    }
    FSDP_ASSIGN_OR_RETURN(ckpt::RankManifest manifest, writer.Finish());
    std::ofstream(fsdp::StrCat(metadata_dir, "/manifest_rank", rank, ".json"))
        << ckpt::RankManifestToJson(manifest).dump();
    metadata.files.push_back(manifest.file);
    manifests.push_back(std::move(manifest));
  }
  FSDP_ASSIGN_OR_RETURN(metadata.tensors, ckpt::MergeManifests(manifests));
  metadata.tensors.push_back({"model/empty", "F32", {0, 4}, {}});
  metadata.step = 120;
  metadata.world_size = 3;
  metadata.mesh_axes = {"shard"};
  metadata.mesh_degrees = {3};
  metadata.strategy = "full_shard";
  metadata.extra = {{"data_position", 1234}, {"rng", {1, 2, 3}}, {"config", {{"lr", 0.5}}}};
  FSDP_RETURN_IF_ERROR(ckpt::WriteMetadata(dir, metadata));
  fs::copy_file(dir + "/" + ckpt::kMetadataFile, metadata_dir + "/metadata.json",
                fs::copy_options::overwrite_existing);
  // The same index on one line: shorter inputs, so mutations land on values more often.
  std::ofstream(metadata_dir + "/metadata_compact.json") << ckpt::ToJson(metadata).dump();
  return absl::OkStatus();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: fsdp_fuzz_seeds OUT\n");
    return 2;
  }
  const std::string out = argv[1];
  fs::remove_all(out);
  for (const char* sub : {"safetensors", "checkpoint", "metadata"}) {
    fs::create_directories(out + "/" + sub);
  }
  if (absl::Status s = WriteSafetensors(out + "/safetensors"); !s.ok()) return Fail(s);
  if (absl::Status s = WriteCheckpoint(out + "/checkpoint", out + "/metadata"); !s.ok()) {
    return Fail(s);
  }
  std::printf("fsdp_fuzz_seeds: wrote %s/{safetensors,checkpoint,metadata}\n", out.c_str());
  return 0;
}
