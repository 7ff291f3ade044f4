// The usage examples at the top of headers, compiled and run: each function body below is the
// header's example verbatim (keep them in sync), wrapped so that its FSDP_ASSIGN_OR_RETURN
// has a Status to return; the test checks what the example's comments promise.
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/status.h"
#include "device_mesh/device_mesh.h"
#include "device_mesh/mesh_shape.h"
#include "engine/config.h"
#include "engine/data.h"
#include "engine/metrics.h"
#include "tests/multirank.h"

namespace fsdp {
namespace {

// device_mesh/device_mesh.h
absl::Status DeviceMeshExample(int& shard_index_out, int& shard_group_size_out) {
  FSDP_ASSIGN_OR_RETURN(std::shared_ptr<DistContext> ctx,
                        DistContext::InitFromEnvironment(DistOptions{}));
  FSDP_ASSIGN_OR_RETURN(MeshShape shape,
                        ParseMeshSpec("replicate=2,shard=-1", ctx->world_size()));
  FSDP_ASSIGN_OR_RETURN(DeviceMesh mesh, DeviceMesh::Create(ctx, shape));
  FSDP_ASSIGN_OR_RETURN(ProcessGroup * shard, mesh.group("shard"));
  int my_shard_index = mesh.coord(mesh.shape().AxisIndex("shard"));
  // (end of the example)
  shard_index_out = my_shard_index;
  shard_group_size_out = shard->size();
  return absl::OkStatus();
}

TEST(HeaderExamplesTest, DeviceMesh) {
  // Two ranks: replicate=2, shard=1.
  testing::RunOnRanks(2, [](int rank) {
    int shard_index = -1, shard_group_size = 0;
    absl::Status status = DeviceMeshExample(shard_index, shard_group_size);
    ASSERT_TRUE(status.ok()) << "rank " << rank << ": " << status;
    EXPECT_EQ(shard_index, 0);
    EXPECT_EQ(shard_group_size, 1);
  });
}

// device_mesh/mesh_shape.h
TEST(HeaderExamplesTest, MeshShape) {
  absl::StatusOr<MeshShape> shape = ParseMeshSpec("replicate=2,shard=-1", /*world_size=*/8);
  // shape->degrees == {2, 4}
  std::vector<int> coords = RankToCoords(*shape, 6);      // {1, 2}
  std::vector<int> peers = AxisGroupRanks(*shape, 6, 1);  // {4, 5, 6, 7}
  // (end of the example)
  ASSERT_TRUE(shape.ok()) << shape.status();
  EXPECT_EQ(shape->degrees, (std::vector<int>{2, 4}));
  EXPECT_EQ(coords, (std::vector<int>{1, 2}));
  EXPECT_EQ(peers, (std::vector<int>{4, 5, 6, 7}));
}

// engine/data.h
absl::Status DataExample(const RunConfig& config, Batch& batch_out, DataPosition& position_out) {
  FSDP_ASSIGN_OR_RETURN(std::unique_ptr<TokenDataset> data,
                        OpenDataset(config.data, /*vocab_size=*/256, /*seed=*/1));
  FSDP_ASSIGN_OR_RETURN(DataLoader loader,
                        DataLoader::Create(*data, {.seq_len = 64, .micro_batch = 8,
                                                   .grad_accum = 2, .dp_rank = 1,
                                                   .dp_size = 4, .seed = 1}));
  FSDP_ASSIGN_OR_RETURN(Batch b, loader.Get(/*micro_step=*/0));  // [8, 64] int64 each
  loader.Advance();  // the next global batch; position() resumes it
  // (end of the example)
  batch_out = b;
  position_out = loader.position();
  return absl::OkStatus();
}

TEST(HeaderExamplesTest, Data) {
  RunConfig config;  // data.source: synthetic
  Batch b;
  DataPosition position;
  absl::Status status = DataExample(config, b, position);
  ASSERT_TRUE(status.ok()) << status;
  EXPECT_EQ(b.inputs.sizes(), (std::vector<int64_t>{8, 64}));
  EXPECT_EQ(b.targets.sizes(), (std::vector<int64_t>{8, 64}));
  EXPECT_EQ(b.inputs.scalar_type(), at::kLong);
  EXPECT_EQ(position.epoch * 1000000 + position.batch, 1);
}

// engine/metrics.h
absl::Status MetricsExample(const std::string& run_dir, double& peak_out) {
  FSDP_ASSIGN_OR_RETURN(MetricsWriter writer, MetricsWriter::Open(run_dir + "/metrics.jsonl"));
  writer.Write({{"step", 1}, {"loss", 5.2}});
  double peak = PeakFlopsPerDevice("NVIDIA H100 80GB HBM3", /*bf16=*/true);  // 989e12
  // (end of the example)
  peak_out = peak;
  return absl::OkStatus();
}

TEST(HeaderExamplesTest, Metrics) {
  const std::string run_dir =
      (std::filesystem::path(::testing::TempDir()) / "header_examples_metrics").string();
  std::filesystem::create_directories(run_dir);
  double peak = 0;
  absl::Status status = MetricsExample(run_dir, peak);
  ASSERT_TRUE(status.ok()) << status;
  EXPECT_EQ(peak, 989e12);
  std::ifstream in(run_dir + "/metrics.jsonl");
  std::string line;
  ASSERT_TRUE(std::getline(in, line));
  EXPECT_EQ(nlohmann::json::parse(line)["step"], 1);
}

}  // namespace
}  // namespace fsdp
