// `fsdp bench`: the shared inputs (weights, batches) are exactly what the trainer uses;
// `compare` runs fsdp.cpp and PyTorch FSDP2 to the same losses; `sweep` counts the bytes the
// ring formulas predict. (Speed is reported by the benchmarks, never asserted here.)
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "bench/bench.h"
#include "checkpoint/safetensors.h"
#include "common/strings.h"
#include "device_mesh/cuda_support.h"
#include "engine/data.h"
#include "models/gpt/gpt.h"
#include "planner/cost_model.h"
#include "tests/multirank.h"

namespace fsdp {
namespace {

using testing::CommandResult;
using testing::FreshTempDir;
using testing::FsdpBinary;
using testing::RunCommand;
using testing::SourceDir;
namespace fs = std::filesystem;

nlohmann::json ReadJson(const std::string& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in);
}

RunConfig SmallConfig(std::vector<std::string> sets = {}) {
  absl::StatusOr<RunConfig> c = LoadRunConfig(SourceDir() + "/configs/default.yaml", sets);
  EXPECT_TRUE(c.ok()) << c.status();
  return *c;
}

TEST(BenchInputs, BatchesAreTheTrainersBatches) {
  RunConfig config = SmallConfig({"training.micro_batch_size=3", "training.grad_accum_steps=2"});
  std::string dir = FreshTempDir("batches");
  const int world = 3, steps = 4;
  ASSERT_TRUE(bench::WriteBatches(config, world, steps, dir + "/b.bin").ok());
  const int64_t seq = config.model.seq_len, micro = 3, accum = 2;
  ASSERT_EQ(fs::file_size(dir + "/b.bin"),
            static_cast<uintmax_t>(steps * accum * world * 2 * micro * seq * 4));
  std::ifstream in(dir + "/b.bin", std::ios::binary);
  std::vector<int32_t> all(steps * accum * world * 2 * micro * seq);
  in.read(reinterpret_cast<char*>(all.data()), static_cast<std::streamsize>(all.size() * 4));
  at::Tensor file = at::from_blob(all.data(), {steps, accum, world, 2, micro, seq}, at::kInt).to(at::kLong);

  // Rank 1's loader, built as the trainer builds it, step by step.
  absl::StatusOr<std::unique_ptr<TokenDataset>> data =
      OpenDataset(config.data, config.model.vocab_size, config.run.seed);
  ASSERT_TRUE(data.ok());
  absl::StatusOr<DataLoader> loader = DataLoader::Create(
      **data, {.seq_len = seq, .micro_batch = micro, .grad_accum = accum, .dp_rank = 1,
               .dp_size = world, .seed = static_cast<uint64_t>(config.run.seed),
               .val_fraction = config.data.val_fraction});
  ASSERT_TRUE(loader.ok());
  for (int s = 0; s < steps; ++s) {
    for (int m = 0; m < accum; ++m) {
      Batch b = loader->Get(m).value();
      EXPECT_TRUE(at::equal(file[s][m][1][0], b.inputs)) << "step " << s << " micro " << m;
      EXPECT_TRUE(at::equal(file[s][m][1][1], b.targets)) << "step " << s << " micro " << m;
    }
    loader->Advance();
  }
  fs::remove_all(dir);
}

TEST(BenchInputs, InitialWeightsAreTheSeededModel) {
  RunConfig config = SmallConfig({"model.tie_embeddings=false"});
  std::string dir = FreshTempDir("weights");
  ASSERT_TRUE(bench::WriteInitialWeights(config, dir + "/init.safetensors").ok());
  absl::StatusOr<ckpt::SafetensorsFile> file = ckpt::SafetensorsFile::Open(dir + "/init.safetensors");
  ASSERT_TRUE(file.ok()) << file.status();
  Gpt model(static_cast<const GptConfig&>(config.model));
  model->MaterializeSeeded(static_cast<uint64_t>(config.run.seed));
  auto params = model->named_parameters();
  ASSERT_EQ(file->entries().size(), params.size());
  for (const auto& item : params) {
    at::Tensor read;
    ASSERT_TRUE(file->ReadRows(item.key(), 0, item.value().size(0), read).ok()) << item.key();
    EXPECT_TRUE(at::equal(read, item.value())) << item.key();
  }
  fs::remove_all(dir);
}

struct CompareCase {
  std::string name;
  int nproc;
  std::vector<std::string> sets;
};

class BenchCompareTest : public ::testing::TestWithParam<CompareCase> {};

// The fsdp2-parity reference mirrors the model and the step (the optimizer with the same
// optimizer.implementation): both engines start from the same weights and batches, so the
// losses agree to fp32 rounding (a different reduction order).
TEST_P(BenchCompareTest, LossesAgreeWithFsdp2Parity) {
  const CompareCase& c = GetParam();
  std::string dir = FreshTempDir("compare-" + c.name);
  std::vector<std::string> argv = {FsdpBinary(), "bench", "compare",
                                   SourceDir() + "/configs/default.yaml", "--nproc",
                                   StrCat(c.nproc), "--steps", "5", "--warmup", "1", "--no-plot",
                                   "--reference", "fsdp2-parity", "--out", dir};
  for (const std::string& s : c.sets) argv.insert(argv.end(), {"--set", s});
  CommandResult r = RunCommand(argv, {}, std::chrono::seconds(240));
  ASSERT_TRUE(r.exit.ok()) << r.Output();
  nlohmann::json report = ReadJson(dir + "/compare.json");
  EXPECT_LT(report["max_loss_rel_diff"].get<double>(), 1e-5) << report.dump(1);
  EXPECT_EQ(report["primary_reference"], "fsdp2-parity");
  EXPECT_EQ(report["references"]["fsdp2-parity"]["loss_check"], "PASS") << report.dump(1);
  EXPECT_FALSE(report["engines"].contains("fsdp2")) << "only the modes asked for run";
  for (const char* engine : {"fsdp.cpp", "fsdp2-parity"}) {
    EXPECT_GT(report["engines"][engine]["median_step_s"].get<double>(), 0) << engine;
    EXPECT_GT(report["engines"][engine]["peak_rss_bytes"].get<int64_t>(), 0) << engine;
  }
  // Both engines move the same bytes per step (full collective buffers, padding included).
  double cpp_bytes = report["engines"]["fsdp.cpp"]["comm_bytes_per_step"].get<double>();
  double ref_bytes = report["engines"]["fsdp2-parity"]["comm_bytes_per_step"].get<double>();
  if (c.nproc == 1) {
    EXPECT_EQ(cpp_bytes, 0);  // nothing to exchange
    EXPECT_EQ(ref_bytes, 0);
  } else {
    EXPECT_NEAR(cpp_bytes / ref_bytes, 1.0, 0.02) << cpp_bytes << " vs " << ref_bytes;
  }
  EXPECT_TRUE(fs::exists(dir + "/compare.csv"));
  EXPECT_TRUE(r.StdoutHas("fsdp.cpp / fsdp2-parity: step time")) << r.Output();
  // On one rank the plain model runs too (parallelism.strategy none): same losses, and each
  // wrapper's overhead against it.
  EXPECT_EQ(report["engines"].contains("unwrapped"), c.nproc == 1) << report.dump(1);
  if (c.nproc == 1) {
    for (const char* engine : {"fsdp.cpp", "fsdp2-parity"}) {
      const nlohmann::json& v = report["vs_unwrapped"][engine];
      EXPECT_LT(v["max_loss_rel_diff"].get<double>(), 1e-5) << engine << " " << report.dump(1);
      EXPECT_TRUE(v["overhead"].is_number()) << engine;
    }
    EXPECT_TRUE(r.StdoutHas("fsdp.cpp vs unwrapped: wrapper overhead")) << r.Output();
    // The Python reference is another implementation of the model, not a wrapper of ours.
    EXPECT_TRUE(r.StdoutHas("fsdp2-parity vs unwrapped: step time (another implementation)"))
        << r.Output();
  }
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(
    Engines, BenchCompareTest,
    ::testing::Values(
        CompareCase{"gpt_full_shard", 2, {}},
        CompareCase{"gpt_one_rank_with_unwrapped", 1, {}},
        // The per-tensor optimizer on both sides (fsdp.cpp's default is fused).
        // Grouped-query attention: 4 query heads over 2 key/value heads.
        CompareCase{"llama_shard_grad_op_per_tensor_adamw", 2,
                    {"optimizer.implementation=per_tensor", "model.arch=llama", "model.n_kv_heads=2",
                     "model.norm=rmsnorm", "model.activation=swiglu",
                     "model.positions=rope", "model.tie_embeddings=false",
                     "parallelism.strategy=shard_grad_op", "training.grad_accum_steps=2",
                     "training.micro_batch_size=4"}}),
    [](const ::testing::TestParamInfo<CompareCase>& info) { return info.param.name; });

TEST(BenchCompare, UnwrappedNeedsOneRank) {
  CommandResult r = RunCommand({FsdpBinary(), "bench", "compare", SourceDir() + "/configs/default.yaml",
                                "--nproc", "2", "--unwrapped"},
                               {}, std::chrono::seconds(60));
  EXPECT_EQ(r.exit.code, 2) << r.Output();
  EXPECT_TRUE(r.StderrHas("--unwrapped runs the plain model on one rank, so it needs --nproc 1 (got 2)"))
      << r.Output();
}

// The fast FSDP2 mode (fused AdamW, no host sync per step) computes the same training to fp32
// rounding of a different order: within its 1e-4 tolerance, and the report says which mode.
TEST(BenchCompare, FastFsdp2AgreesWithinItsTolerance) {
  std::string dir = FreshTempDir("compare-fsdp2");
  CommandResult r = RunCommand({FsdpBinary(), "bench", "compare", SourceDir() + "/configs/default.yaml",
                                "--nproc", "2", "--steps", "5", "--warmup", "1", "--no-plot",
                                "--reference", "fsdp2", "--out", dir},
                               {}, std::chrono::seconds(240));
  ASSERT_TRUE(r.exit.ok()) << r.Output();
  nlohmann::json report = ReadJson(dir + "/compare.json");
  const nlohmann::json& v = report["references"]["fsdp2"];
  EXPECT_EQ(v["loss_check"], "PASS") << report.dump(1);
  EXPECT_EQ(v["loss_rtol"].get<double>(), 1e-4);
  EXPECT_LT(v["max_loss_rel_diff"].get<double>(), 1e-4) << report.dump(1);
  EXPECT_GT(v["step_time_ratio"].get<double>(), 0);
  EXPECT_EQ(report["primary_reference"], "fsdp2");
  EXPECT_FALSE(report["engines"].contains("fsdp2-parity"));
  EXPECT_GT(report["engines"]["fsdp2"]["comm_bytes_per_step"].get<double>(), 0);
  EXPECT_TRUE(r.StdoutHas("fsdp2: FSDP2 on 2 rank(s)")) << r.Output();
  EXPECT_TRUE(r.StdoutHas("fused optimizer, no host sync per step")) << r.Output();
  EXPECT_TRUE(r.StdoutHas("fsdp.cpp / fsdp2: step time")) << r.Output();
  EXPECT_TRUE(r.StdoutHas("tolerance 1e-04): PASS")) << r.Output();
  fs::remove_all(dir);
}

// The plain PyTorch model on one rank, no wrapper: the same losses, its own row; beside FSDP2,
// FSDP2's own wrapper overhead (over the eager model it wraps).
TEST(BenchCompare, EagerOnOneRank) {
  std::string dir = FreshTempDir("compare-eager");
  CommandResult r = RunCommand({FsdpBinary(), "bench", "compare", SourceDir() + "/configs/default.yaml",
                                "--nproc", "1", "--steps", "4", "--warmup", "1", "--no-plot",
                                "--no-unwrapped", "--reference", "fsdp2,eager", "--out", dir},
                               {}, std::chrono::seconds(240));
  ASSERT_TRUE(r.exit.ok()) << r.Output();
  nlohmann::json report = ReadJson(dir + "/compare.json");
  EXPECT_EQ(report["references"]["eager"]["loss_check"], "PASS") << report.dump(1);
  EXPECT_GT(report["engines"]["eager"]["median_step_s"].get<double>(), 0);
  EXPECT_EQ(report["engines"]["eager"]["comm_bytes_per_step"].get<double>(), 0);
  EXPECT_EQ(report["engines"].size(), 3u) << report.dump(1);  // fsdp.cpp, fsdp2, eager
  EXPECT_TRUE(r.StdoutHas("eager: the plain model, fused adamw")) << r.Output();
  EXPECT_TRUE(report["vs_eager"]["fsdp2"]["overhead"].is_number()) << report.dump(1);
  EXPECT_FALSE(report.contains("vs_unwrapped")) << report.dump(1);
  EXPECT_TRUE(r.StdoutHas("fsdp2 vs eager: wrapper overhead")) << r.Output();
  EXPECT_FALSE(r.StdoutHas("compare.png")) << "--no-plot draws nothing";
  EXPECT_TRUE(fs::exists(dir + "/eager_0/metrics.jsonl"));
  fs::remove_all(dir);
}

// Offload params against FSDP2 with CPUOffloadPolicy (the same losses), with no unwrapped run by
// default (the plain model cannot offload) and --unwrapped refused, naming the key.
TEST(BenchCompare, OffloadAgainstFsdp2CpuOffloadPolicy) {
  std::string dir = FreshTempDir("compare-offload");
  CommandResult r = RunCommand({FsdpBinary(), "bench", "compare", SourceDir() + "/configs/default.yaml",
                                "--nproc", "1", "--steps", "4", "--warmup", "1", "--no-plot",
                                "--reference", "fsdp2", "--out", dir, "--set",
                                "parallelism.offload=params"},
                               {}, std::chrono::seconds(240));
  ASSERT_TRUE(r.exit.ok()) << r.Output();
  nlohmann::json report = ReadJson(dir + "/compare.json");
  EXPECT_EQ(report["references"]["fsdp2"]["loss_check"], "PASS") << report.dump(1);
  EXPECT_EQ(report["engines"].size(), 2u) << report.dump(1);  // fsdp.cpp, fsdp2
  EXPECT_TRUE(r.StdoutHas("CPUOffloadPolicy")) << r.Output();
  fs::remove_all(dir);
  CommandResult refused = RunCommand(
      {FsdpBinary(), "bench", "compare", SourceDir() + "/configs/default.yaml", "--nproc", "1",
       "--unwrapped", "--set", "parallelism.offload=params"},
      {}, std::chrono::seconds(60));
  EXPECT_EQ(refused.exit.code, 2) << refused.Output();
  EXPECT_TRUE(refused.StderrHas("cannot offload (parallelism.offload params)")) << refused.Output();
}

TEST(BenchCompare, UnknownReferenceModeIsAnError) {
  CommandResult r = RunCommand({FsdpBinary(), "bench", "compare", SourceDir() + "/configs/default.yaml",
                                "--reference", "fsdp2,torchtitan"},
                               {}, std::chrono::seconds(60));
  EXPECT_EQ(r.exit.code, 2) << r.Output();
  EXPECT_TRUE(r.StderrHas("--reference 'torchtitan' is not a reference mode; valid: fsdp2, eager, "
                          "compile, fsdp2-parity"))
      << r.Output();
}

TEST(BenchCompare, PlainModelModesNeedOneRank) {
  CommandResult r = RunCommand({FsdpBinary(), "bench", "compare", SourceDir() + "/configs/default.yaml",
                                "--nproc", "2", "--reference", "compile"},
                               {}, std::chrono::seconds(60));
  EXPECT_EQ(r.exit.code, 2) << r.Output();
  EXPECT_TRUE(r.StderrHas("--reference compile runs the plain PyTorch model on one rank, so it "
                          "needs --nproc 1 (got 2)"))
      << r.Output();
}

TEST(BenchCompare, DefaultModesAndTolerances) {
  EXPECT_EQ(bench::DefaultReferences(2), std::vector<std::string>({"fsdp2"}));
  EXPECT_EQ(bench::DefaultReferences(1), std::vector<std::string>({"fsdp2", "eager", "compile"}));
  EXPECT_EQ(bench::LossTolerance("fsdp2-parity", false), 1e-5);
  EXPECT_EQ(bench::LossTolerance("fsdp2", false), 1e-4);
  EXPECT_EQ(bench::LossTolerance("compile", true), 2e-2);
}

TEST(BenchCompare, CudaConfigWithoutGpuWritesNothing) {
  if (CudaDeviceCount() > 0) GTEST_SKIP() << "a GPU is visible: the comparison would run";
  const std::string out = testing::FreshTempDir("nogpu") + "/out";
  CommandResult r =
      RunCommand({FsdpBinary(), "bench", "compare", SourceDir() + "/configs/llama_1b.yaml",
                  "--nproc", "1", "--steps", "3", "--out", out},
                 {}, std::chrono::seconds(60));
  EXPECT_EQ(r.exit.code, 2) << r.Output();
  EXPECT_TRUE(r.StderrHas("no GPU was found")) << r.Output();
  EXPECT_TRUE(r.StderrHas("training.device=cpu")) << r.Output();
  EXPECT_FALSE(std::filesystem::exists(out)) << "inputs written to " << out;
}

TEST(BenchCompare, BadConfigKeyIsAnError) {
  CommandResult r = RunCommand({FsdpBinary(), "bench", "compare", SourceDir() + "/configs/default.yaml",
                                "--set", "training.stpes=3"},
                               {}, std::chrono::seconds(60));
  EXPECT_EQ(r.exit.code, 2) << r.Output();
  EXPECT_TRUE(r.StderrHas("did you mean 'steps'")) << r.Output();
}

// The engine's counters, turned into bytes on the wire, equal the ring formulas within 1% when
// they count what the engine does (the root unit is not gathered again in backward; padding
// is the only difference left); memory columns are filled.
TEST(BenchSweep, WireBytesMatchTheory) {
  std::string dir = FreshTempDir("sweep");
  CommandResult r = RunCommand(
      {FsdpBinary(), "bench", "sweep", SourceDir() + "/configs/default.yaml", "--world-sizes",
       "1,2,4", "--strategies", "full_shard,shard_grad_op,no_shard,hybrid_shard", "--steps", "3",
       "--warmup", "1", "--hardware", "cpu", "--no-plot", "--out", dir},
      {}, std::chrono::seconds(280));
  ASSERT_TRUE(r.exit.ok()) << r.Output();
  std::ifstream csv(dir + "/sweep.csv");
  std::string header, line;
  std::getline(csv, header);
  std::vector<std::string_view> names = Split(header, ",");
  auto column = [&](const std::string& name) {
    auto it = std::find(names.begin(), names.end(), name);
    EXPECT_NE(it, names.end()) << name;
    return it - names.begin();
  };
  int rows = 0;
  while (std::getline(csv, line)) {
    std::vector<std::string_view> cells = Split(line, ",");
    ++rows;
    int world = std::stoi(std::string(cells[column("world_size")]));
    double wire = std::stod(std::string(cells[column("comm_wire_bytes_per_step")]));
    double theory = std::stod(std::string(cells[column("engine_wire_bytes_per_step")]));
    double textbook = std::stod(std::string(cells[column("theory_wire_bytes_per_step")]));
    if (world == 1) {
      EXPECT_EQ(wire, 0) << line;
    } else {
      EXPECT_NEAR(wire / theory, 1.0, 0.01) << line;
      // The textbook volume re-gathers the root in backward too: never below the engine's.
      EXPECT_GE(textbook, theory * 0.999) << line;
    }
    EXPECT_GT(std::stod(std::string(cells[column("peak_tensor_bytes")])), 0) << line;
    EXPECT_GT(std::stod(std::string(cells[column("state_bytes")])), 0) << line;
    EXPECT_FALSE(cells[column("predicted_step_time_s")].empty()) << line;
  }
  EXPECT_EQ(rows, 3 * 3 + 1) << r.Output();  // hybrid only at 4 ranks (2 x 2)
  fs::remove_all(dir);
}

// run.name is the user's: it once named the folder the sweep removes and rewrites, so
// run.name=/tmp/x replaced --out and run.name=../../x climbed out of it, deleting what was
// there. The run folders now always lie in --out/runs.
TEST(BenchSweep, RunNameCannotLeaveTheOutputFolder) {
  const std::string dir = FreshTempDir("sweep-name");
  const std::string out = dir + "/a/b/out";
  for (const std::string& name : {dir + "/victim", std::string("../../../victim")}) {
    // Where the old code put the run folder: out/runs/<name>-full_shard-1, normalized.
    const fs::path target = (fs::path(out) / "runs" / (name + "-full_shard-1")).lexically_normal();
    fs::create_directories(target);
    std::ofstream(target / "keep.txt") << "x\n";
    CommandResult r = RunCommand(
        {FsdpBinary(), "bench", "sweep", SourceDir() + "/configs/default.yaml", "--set",
         "run.name=" + name, "--world-sizes", "1", "--strategies", "full_shard", "--steps", "2",
         "--warmup", "0", "--hardware", "cpu", "--no-plot", "--out", out},
        {}, std::chrono::seconds(120));
    ASSERT_TRUE(r.exit.ok()) << r.Output();
    EXPECT_TRUE(fs::exists(target / "keep.txt")) << target << " was removed\n" << r.Output();
    EXPECT_FALSE(fs::exists(target / "metrics.jsonl")) << target << " was written";
    int run_folders = 0;
    for (const auto& entry : fs::directory_iterator(fs::path(out) / "runs")) {
      ++run_folders;
      EXPECT_TRUE(fs::exists(entry.path() / "metrics.jsonl")) << entry.path();
    }
    EXPECT_EQ(run_folders, 1);
    fs::remove_all(fs::path(out) / "runs");
  }
  fs::remove_all(dir);
}

// A run.name with a comma or a quote once shifted sweep.csv's columns; it is one quoted field.
TEST(BenchSweep, RunNameWithACommaStaysOneCsvField) {
  const std::string dir = FreshTempDir("sweep-csv");
  CommandResult r = RunCommand(
      {FsdpBinary(), "bench", "sweep", SourceDir() + "/configs/default.yaml", "--set",
       "run.name=exp,\"1\"", "--world-sizes", "1", "--strategies", "full_shard", "--steps", "2",
       "--warmup", "0", "--hardware", "cpu", "--no-plot", "--out", dir},
      {}, std::chrono::seconds(120));
  ASSERT_TRUE(r.exit.ok()) << r.Output();
  std::ifstream csv(dir + "/sweep.csv");
  std::string header, row;
  ASSERT_TRUE(std::getline(csv, header));
  ASSERT_TRUE(std::getline(csv, row));
  const std::string field = "\"exp,\"\"1\"\"\",";
  ASSERT_EQ(row.substr(0, field.size()), field) << row;
  EXPECT_EQ(std::count(header.begin(), header.end(), ','),
            std::count(row.begin() + field.size(), row.end(), ',') + 1)
      << header << "\n" << row;
  fs::remove_all(dir);
}

// Two configs whose run.names sanitise to one folder would share run folders (the second row
// removing the first's): refused before anything runs.
TEST(BenchSweep, ConfigsThatNameTheSameRunFoldersAreRefused) {
  const std::string out = FreshTempDir("sweep-same");
  CommandResult r = RunCommand(
      {FsdpBinary(), "bench", "sweep", SourceDir() + "/configs/default.yaml",
       SourceDir() + "/configs/sweep_medium.yaml", "--set", "run.name=exp", "--world-sizes", "1",
       "--strategies", "full_shard", "--steps", "2", "--warmup", "0", "--hardware", "cpu",
       "--no-plot", "--out", out},
      {}, std::chrono::seconds(120));
  EXPECT_EQ(r.exit.code, 2) << r.Output();
  EXPECT_TRUE(r.StderrHas("name the same run folders (run.name 'exp')")) << r.Output();
  EXPECT_FALSE(fs::exists(fs::path(out) / "sweep.csv")) << r.Output();
  fs::remove_all(out);
}

// Skipped combinations are named; a sweep with none left is an error, not an empty CSV.
TEST(BenchSweep, CombinationsWithoutALayoutAreNamed) {
  const std::string out = FreshTempDir("sweep-none");
  CommandResult r = RunCommand(
      {FsdpBinary(), "bench", "sweep", SourceDir() + "/configs/default.yaml", "--world-sizes",
       "1,3", "--strategies", "hybrid_shard", "--hardware", "cpu", "--no-plot", "--out", out},
      {}, std::chrono::seconds(60));
  EXPECT_EQ(r.exit.code, 2) << r.Output();
  EXPECT_TRUE(
      r.StderrHas("skipping hybrid_shard at world size 1, 3: it needs an even world size "
                  "of at least 4"))
      << r.Output();
  EXPECT_TRUE(r.StderrHas("fsdp bench sweep: nothing to run")) << r.Output();
  EXPECT_FALSE(fs::exists(out + "/sweep.csv")) << r.Output();
}

// Bad inputs are found before anything is written: a FIFO as the config blocked the sweep
// (after it had written sweep.csv's header); --hardware's error named --gpu.
TEST(BenchSweep, BadInputsWriteNothing) {
  const std::string dir = FreshTempDir("sweep-inputs");
  const std::string fifo = dir + "/config.yaml", out = dir + "/out";
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  CommandResult r = RunCommand(
      {FsdpBinary(), "bench", "sweep", fifo, "--hardware", "cpu", "--no-plot", "--out", out}, {},
      std::chrono::seconds(30));
  EXPECT_FALSE(r.timed_out) << "blocked on the FIFO";
  EXPECT_EQ(r.exit.code, 2) << r.Output();
  EXPECT_TRUE(r.StderrHas("is a FIFO (named pipe), not a YAML file")) << r.Output();
  EXPECT_FALSE(fs::exists(out)) << r.Output();
  CommandResult hw =
      RunCommand({FsdpBinary(), "bench", "sweep", SourceDir() + "/configs/default.yaml",
                  "--hardware", "bogus", "--no-plot", "--out", out},
                 {}, std::chrono::seconds(30));
  EXPECT_EQ(hw.exit.code, 2) << hw.Output();
  EXPECT_TRUE(
      hw.StderrHas("fsdp bench sweep: --hardware 'bogus' is neither calibrate, a profile "
                   "name (h100"))
      << hw.Output();
  EXPECT_FALSE(hw.StderrHas("--gpu")) << hw.Output();
  EXPECT_FALSE(fs::exists(out)) << hw.Output();
  fs::remove_all(dir);
}

// --tokens the machine cannot hold died with "internal: uncaught exception" (exit 70); a count
// RoPE cannot split into sequences timed another count than the header said; a bad --out was
// found after the whole benchmark.
TEST(BenchKernels, TokensAndOutAreCheckedFirst) {
  const std::string config = SourceDir() + "/configs/default.yaml";
  CommandResult huge = RunCommand({FsdpBinary(), "bench", "kernels", config, "--device", "cpu",
                                   "--tokens", "1000000000000", "--repeats", "1", "--warmup", "0"},
                                  {}, std::chrono::seconds(60));
  EXPECT_EQ(huge.exit.code, 2) << huge.Output();
  EXPECT_TRUE(huge.StderrHas("fsdp bench kernels: --tokens 1000000000000 needs about"))
      << huge.Output();
  EXPECT_FALSE(huge.StdoutHas("rms_norm")) << huge.Output();

  CommandResult rope = RunCommand({FsdpBinary(), "bench", "kernels", config, "--device", "cpu",
                                   "--tokens", "1", "--set", "model.positions=rope"},
                                  {}, std::chrono::seconds(60));
  EXPECT_EQ(rope.exit.code, 2) << rope.Output();
  EXPECT_TRUE(rope.StderrHas("--tokens 1 is not a multiple of model.seq_len")) << rope.Output();

  CommandResult whole = RunCommand(
      {FsdpBinary(), "bench", "kernels", config, "--device", "cpu", "--tokens", "128", "--set",
       "model.positions=rope", "--set", "model.seq_len=64", "--repeats", "1", "--warmup", "0"},
      {}, std::chrono::seconds(120));
  ASSERT_TRUE(whole.exit.ok()) << whole.Output();
  EXPECT_TRUE(whole.StdoutHas("128 tokens")) << whole.Output();
  bool rope_row = false;  // the shape column: 128 positions (2 sequences of 64)
  for (const std::string& line : whole.stdout_lines) {
    rope_row |= StartsWith(line, "rope (q and k)") && line.find(" 128 x ") != std::string::npos;
  }
  EXPECT_TRUE(rope_row) << whole.Output();

  for (const std::string& out :
       {std::string("/nonexistent/x.json"), fs::temp_directory_path().string()}) {
    CommandResult r =
        RunCommand({FsdpBinary(), "bench", "kernels", config, "--device", "cpu", "--out", out}, {},
                   std::chrono::seconds(60));
    EXPECT_EQ(r.exit.code, 2) << r.Output();
    EXPECT_TRUE(r.StderrHas("fsdp bench kernels: --out " + out)) << r.Output();
    EXPECT_FALSE(r.StdoutHas("lm_head")) << "the benchmark ran first\n" << r.Output();
  }
}

// `fsdp bench host` (offload's host passes): the loops' values are ATen's (checked by the
// command itself: exit 1 otherwise), every pass is timed at each --busy, the JSON has each row;
// a size the machine cannot hold and an unwritable --out are refused before anything runs.
TEST(BenchHost, TimesEachPassAfterCheckingTheValues) {
  const std::string dir = FreshTempDir("bench_host");
  const std::string out = dir + "/host.json";
  CommandResult r = RunCommand({FsdpBinary(), "bench", "host", "--elements", "300013", "--busy",
                                "0,1", "--repeats", "1", "--warmup", "0", "--out", out},
                               {}, std::chrono::seconds(120));
  ASSERT_TRUE(r.exit.ok()) << r.Output();
  const bool loops = !r.StdoutHas("not available here");
  if (loops) {
    EXPECT_TRUE(r.StdoutHas("the one-loop step (from bf16 and from fp32 gradients) equals bit for "
                            "bit ATen's ops"))
        << r.Output();
    EXPECT_TRUE(r.StdoutHas("the one-loop add equals ATen's bit for bit")) << r.Output();
  }
  const nlohmann::json report = ReadJson(out);
  EXPECT_EQ(report["elements"], 300013);
  // 8 passes (ATen's fused AdamW alone, 4 of ATen's paths, 3 loops) at each of 2 --busy; each
  // row's cost is its time per byte against the AdamW's at the same --busy (1 for that one).
  EXPECT_EQ(report["rows"].size(), loops ? 16u : 10u) << report.dump();
  for (const nlohmann::json& row : report["rows"]) {
    EXPECT_GT(row["ms"].get<double>(), 0);
    EXPECT_GT(row["cost_vs_adamw"].get<double>(), 0) << row.dump();
    if (row["pass"].get<std::string>().starts_with("AdamW alone")) {
      EXPECT_EQ(row["cost_vs_adamw"].get<double>(), 1.0) << row.dump();
    }
  }

  CommandResult huge = RunCommand({FsdpBinary(), "bench", "host", "--elements", "1000000000000"},
                                  {}, std::chrono::seconds(60));
  EXPECT_EQ(huge.exit.code, 2) << huge.Output();
  EXPECT_TRUE(huge.StderrHas("fsdp bench host: --elements 1000000000000 needs about"))
      << huge.Output();
  CommandResult bad_out = RunCommand(
      {FsdpBinary(), "bench", "host", "--elements", "1000", "--out", "/nonexistent/x.json"}, {},
      std::chrono::seconds(60));
  EXPECT_EQ(bad_out.exit.code, 2) << bad_out.Output();
  EXPECT_TRUE(bad_out.StderrHas("fsdp bench host: --out /nonexistent/x.json")) << bad_out.Output();
  EXPECT_FALSE(bad_out.StdoutHas("step: one loop")) << bad_out.Output();
}

}  // namespace
}  // namespace fsdp
