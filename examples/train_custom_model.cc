// fsdp.cpp as a library: shard your own libtorch model and train it. The C++ counterpart of
// PyTorch's FSDP tutorial script. Run it under any launcher, e.g.
//
//   build/bin/fsdp launch --nproc-per-node 2 -- build/bin/train_custom_model
//
// The model: a residual MLP classifier on a synthetic task (is the sum of the features
// positive?). Each residual block is an FSDP unit; the root unit holds the input and output
// layers.
#include <iostream>

#include <torch/torch.h>

#include "device_mesh/device_mesh.h"
#include "sharding/fsdp_model.h"
#include "sharding/unit_forward.h"

// A block of the user's model. The only FSDP-specific line: forward goes through
// fsdp::UnitForward, which is a plain call when the module is not sharded.
struct ResidualBlockImpl : torch::nn::Module {
  explicit ResidualBlockImpl(int64_t dim)
      : norm(register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})))),
        fc1(register_module("fc1", torch::nn::Linear(dim, 4 * dim))),
        fc2(register_module("fc2", torch::nn::Linear(4 * dim, dim))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    return fsdp::UnitForward(this, x, [&](const torch::Tensor& h) {
      return h + fc2->forward(torch::relu(fc1->forward(norm->forward(h))));
    });
  }
  torch::nn::LayerNorm norm;
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(ResidualBlock);

struct ClassifierImpl : torch::nn::Module {
  ClassifierImpl(int64_t features, int64_t dim, int64_t depth)
      : input(register_module("input", torch::nn::Linear(features, dim))),
        blocks(register_module("blocks", torch::nn::ModuleList())),
        head(register_module("head", torch::nn::Linear(dim, 2))) {
    for (int64_t i = 0; i < depth; ++i) blocks->push_back(ResidualBlock(dim));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return fsdp::UnitForward(this, x, [&](const torch::Tensor& features) {
      torch::Tensor h = input->forward(features);
      for (const auto& block : *blocks) h = block->as<ResidualBlockImpl>()->forward(h);
      return head->forward(h);
    });
  }
  torch::nn::Linear input;
  torch::nn::ModuleList blocks;
  torch::nn::Linear head;
};
TORCH_MODULE(Classifier);

int main() {
  // 1. Join the job (RANK/WORLD_SIZE/MASTER_* from the launcher) and lay out a 1-D mesh.
  auto ctx = fsdp::DistContext::InitFromEnvironment({.device = "auto"});
  if (!ctx.ok()) {
    std::cerr << ctx.status().message() << "\n";
    return 1;
  }
  const int rank = (*ctx)->rank(), world = (*ctx)->world_size();
  auto mesh = fsdp::DeviceMesh::Create(*ctx, *fsdp::ParseMeshSpec("replicate=1,shard=-1", world));

  // 2. Build the model (same seed everywhere), then shard it: one unit per residual block.
  torch::manual_seed(0);
  Classifier model(/*features=*/16, /*dim=*/64, /*depth=*/4);
  model->to((*ctx)->device());
  auto units = fsdp::SelectUnits(*model, {.module_types = {"ResidualBlockImpl"}});
  auto sharded = fsdp::FsdpModel::Wrap(model.ptr(), *mesh, units,
                                       fsdp::OptionsForStrategy(fsdp::Strategy::kFullShard));
  if (!sharded.ok()) {
    std::cerr << sharded.status().message() << "\n";
    return 1;
  }

  // 3. The optimizer updates this rank's shards only.
  torch::optim::AdamW optimizer((*sharded)->parameters(), torch::optim::AdamWOptions(3e-3));

  // 4. Train: each rank draws its own batches (a different seed per rank).
  torch::manual_seed(1000 + rank);
  double first = 0, last = 0;
  for (int step = 1; step <= 60; ++step) {
    torch::Tensor x = torch::randn({64, 16}, torch::TensorOptions().device((*ctx)->device()));
    torch::Tensor y = (x.sum(1) > 0).to(torch::kLong);
    torch::Tensor loss = torch::nn::functional::cross_entropy(model->forward(x), y);
    loss.backward();
    (*sharded)->ClipGradNorm(1.0);
    optimizer.step();
    optimizer.zero_grad();
    // The mean loss over ranks, for the log (a collective: every rank takes part).
    torch::Tensor mean = loss.detach().clone();
    (*ctx)->world().AllReduce(mean)->wait();
    double value = mean.item<double>() / world;
    if (step == 1) first = value;
    last = value;
    if (rank == 0 && step % 10 == 0) std::cout << "step " << step << " loss " << value << "\n";
  }
  if (rank == 0) {
    std::cout << "loss " << first << " -> " << last
              << (last < 0.5 * first ? " (learned)" : " (did not learn)") << "\n";
  }
  return last < 0.5 * first ? 0 : 1;
}
