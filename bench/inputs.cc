// What both engines of `fsdp bench compare` start from: the initial weights, the token
// batches, and the Python that runs the FSDP2 side.
#include <sys/wait.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include "bench/bench.h"
#include "checkpoint/safetensors.h"
#include "common/env_knobs.h"
#include "common/status.h"
#include "common/strings.h"
#include "engine/data.h"
#include "models/gpt/gpt.h"

namespace fsdp::bench {

absl::Status WriteInitialWeights(const RunConfig& config, const std::string& path) {
  Gpt model(static_cast<const GptConfig&>(config.model));
  model->MaterializeSeeded(static_cast<uint64_t>(config.run.seed));
  std::map<std::string, at::Tensor> tensors;
  for (const auto& item : model->named_parameters()) tensors.emplace(item.key(), item.value());
  return ckpt::SaveSafetensors(tensors, path);
}

absl::Status WriteBatches(const RunConfig& config, int world_size, int steps,
                          const std::string& path) {
  FSDP_ASSIGN_OR_RETURN(std::unique_ptr<TokenDataset> dataset,
                        OpenDataset(config.data, config.model.vocab_size,
                                    static_cast<uint64_t>(config.run.seed)));
  const TrainingSection& t = config.training;
  std::vector<DataLoader> loaders;
  for (int r = 0; r < world_size; ++r) {
    FSDP_ASSIGN_OR_RETURN(DataLoader loader,
                          DataLoader::Create(*dataset, LoaderOptionsFor(config, r, world_size)));
    loaders.push_back(std::move(loader));
  }
  std::string tmp = path + ".tmp";
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  if (f == nullptr) {
    return absl::FailedPreconditionError(StrCat("cannot create ", tmp, ": ", std::strerror(errno)));
  }
  bool ok = true;
  for (int step = 0; step < steps && ok; ++step) {
    for (int64_t m = 0; m < t.grad_accum_steps && ok; ++m) {
      for (DataLoader& loader : loaders) {
        absl::StatusOr<Batch> b = loader.Get(static_cast<int>(m));
        if (!b.ok()) {  // no half-written file left behind
          std::fclose(f);
          std::remove(tmp.c_str());
          return b.status();
        }
        for (const at::Tensor& part : {b->inputs, b->targets}) {
          at::Tensor values = part.to(at::kInt).contiguous();
          ok = ok && std::fwrite(values.data_ptr(), values.nbytes(), 1, f) == 1;
        }
      }
    }
    for (DataLoader& loader : loaders) loader.Advance();
  }
  ok = std::fclose(f) == 0 && ok;
  if (!ok || std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    return absl::FailedPreconditionError(StrCat("cannot write ", path, ": ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

std::string PythonPath(const std::string& requested) {
  if (!requested.empty()) return requested;
  if (std::optional<std::string> env = GetEnvKnob(kPython); env && !env->empty()) return *env;
  return FSDP_VENV_PYTHON;
}

std::string ScriptPath(const std::string& name) {
  return (std::filesystem::path(FSDP_SOURCE_DIR) / "bench" / name).string();
}

namespace {

// Runs argv, its output going to ours; its exit status (-1 if it could not start).
int RunQuiet(const std::vector<std::string>& argv) {
  std::string command;
  for (const std::string& a : argv) {
    command += "'";
    for (char c : a) command += c == '\'' ? std::string("'\\''") : std::string(1, c);
    command += "' ";
  }
  command += ">/dev/null 2>&1";
  int status = std::system(command.c_str());
  return status == -1 || !WIFEXITED(status) ? -1 : WEXITSTATUS(status);
}

}  // namespace

// Note [Bench Python]
// The FSDP2 side needs torch (the same 2.11.0 wheel the build links), safetensors and numpy;
// the plots need matplotlib. scripts/bootstrap.sh puts all four into the build's venv. For
// any other Python (--python, FSDP_PYTHON) the bench checks each import and pip-installs what
// is missing, but never torch: a different torch would not be the comparison asked for.
absl::Status EnsurePythonPackages(const std::string& python) {
  if (!std::filesystem::exists(python)) {
    return absl::FailedPreconditionError(StrCat(
        "python '", python, "' does not exist; give --python or FSDP_PYTHON, or run "
        "scripts/bootstrap.sh to create the venv"));
  }
  if (RunQuiet({python, "-c", "import torch"}) != 0) {
    return absl::FailedPreconditionError(StrCat(
        python, " cannot import torch; the FSDP2 side needs torch==2.11.0 (scripts/bootstrap.sh "
        "installs it into the build's venv)"));
  }
  std::vector<std::string> missing;
  for (const char* package : {"safetensors", "numpy", "matplotlib"}) {
    if (RunQuiet({python, "-c", StrCat("import ", package)}) != 0) missing.push_back(package);
  }
  if (missing.empty()) return absl::OkStatus();
  std::fprintf(stderr, "fsdp bench: installing %s into %s\n", StrJoin(missing, " ").c_str(),
               python.c_str());
  std::vector<std::string> pip = {python, "-m", "pip", "install", "-q", "--disable-pip-version-check"};
  pip.insert(pip.end(), missing.begin(), missing.end());
  if (RunQuiet(pip) != 0) {
    return absl::FailedPreconditionError(StrCat("pip could not install ", StrJoin(missing, ", "),
                                                " for ", python));
  }
  return absl::OkStatus();
}

}  // namespace fsdp::bench
