// A user's program built against the installed fsdp_cpp package (tests/package/CMakeLists.txt):
// shards a small residual MLP over all ranks (one FSDP unit per block), trains 3 SGD steps, and
// checks every step's loss against an unsharded copy of the model that each rank trains on the
// whole global batch. Exit 0 and "losses match" on rank 0 when they agree.
//
//   fsdp launch --nproc-per-node 2 -- build/package_app
#include <cmath>
#include <iostream>

#include <torch/torch.h>

#include "device_mesh/device_mesh.h"
#include "sharding/fsdp_model.h"
#include "sharding/unit_forward.h"

struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(int64_t dim) : fc(register_module("fc", torch::nn::Linear(dim, dim))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    return fsdp::UnitForward(
        this, x, [&](const torch::Tensor& h) { return h + torch::tanh(fc->forward(h)); });
  }
  torch::nn::Linear fc;
};
TORCH_MODULE(Block);

struct NetImpl : torch::nn::Module {
  NetImpl() {
    for (int i = 0; i < 2; ++i) blocks->push_back(Block(16));
    register_module("blocks", blocks);
    register_module("head", head);
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return fsdp::UnitForward(this, x, [&](const torch::Tensor& h) {
      torch::Tensor y = h;
      for (const auto& block : *blocks) y = block->as<BlockImpl>()->forward(y);
      return head->forward(y);
    });
  }
  torch::nn::ModuleList blocks;
  torch::nn::Linear head{16, 1};
};
TORCH_MODULE(Net);

int main() {
  auto ctx = fsdp::DistContext::InitFromEnvironment({.device = "cpu"});
  if (!ctx.ok()) {
    std::cerr << ctx.status().message() << "\n";
    return 1;
  }
  const int rank = (*ctx)->rank(), world = (*ctx)->world_size();
  auto mesh = fsdp::DeviceMesh::Create(*ctx, *fsdp::ParseMeshSpec("replicate=1,shard=-1", world));

  torch::manual_seed(0);
  Net model;
  torch::manual_seed(0);
  Net reference;  // the same initial weights, never sharded
  auto sharded = fsdp::FsdpModel::Wrap(model.ptr(), *mesh,
                                       fsdp::SelectUnits(*model, {.module_types = {"BlockImpl"}}),
                                       fsdp::OptionsForStrategy(fsdp::Strategy::kFullShard));
  if (!sharded.ok()) {
    std::cerr << sharded.status().message() << "\n";
    return 1;
  }
  torch::optim::SGD optimizer((*sharded)->parameters(), torch::optim::SGDOptions(0.1));
  torch::optim::SGD ref_optimizer(reference->parameters(), torch::optim::SGDOptions(0.1));

  bool match = true;
  for (int step = 1; step <= 3; ++step) {
    // The global batch, the same on every rank; this rank trains on its slice of it.
    torch::manual_seed(100 + step);
    torch::Tensor x = torch::randn({8 * world, 16});
    torch::Tensor y = x.sum(1, /*keepdim=*/true).sin();
    torch::Tensor loss =
        torch::mse_loss(model->forward(x.chunk(world)[rank]), y.chunk(world)[rank]);
    loss.backward();
    optimizer.step();
    optimizer.zero_grad();
    torch::Tensor mean = loss.detach().clone();
    (*ctx)->world().AllReduce(mean)->wait();
    const double sharded_loss = mean.item<double>() / world;

    torch::Tensor ref_loss = torch::mse_loss(reference->forward(x), y);
    ref_loss.backward();
    ref_optimizer.step();
    ref_optimizer.zero_grad();
    const double expected = ref_loss.item<double>();
    match = match && std::abs(sharded_loss - expected) <= 1e-5 * std::max(1.0, std::abs(expected));
    if (rank == 0) {
      std::cout << "step " << step << " loss " << sharded_loss << " reference " << expected << "\n";
    }
  }
  if (rank == 0) {
    std::cout << (match ? "losses match" : "losses differ") << " the unsharded reference on "
              << world << " ranks\n";
  }
  return match ? 0 : 1;
}
