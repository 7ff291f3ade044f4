#include "device_mesh/process_group.h"
#include "common/strings.h"

#include <algorithm>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include "common/logging.h"
#include "common/status.h"
#include "device_mesh/cuda_support.h"
#include "device_mesh/torch_status.h"
#include "device_mesh/watchdog.h"

namespace fsdp {
namespace {

int64_t Bytes(const at::Tensor& t) { return t.numel() * t.element_size(); }

}  // namespace

// Note [A group is created when every member has created it]
// Gloo's connectFullMesh returns on a rank once its own end of every pair is connected, which
// can be before the peer's end has seen the connection: the side that makes the connection is
// done when it has written its hello, the side that accepts it when it has read that hello. A
// rank that returns and then ends (a test, or a run that stops right after building its mesh)
// closes the socket, and a peer whose event loop sees that EOF before its own connect call has
// woken fails with "Connection closed by peer" while creating a group that was fine. Like
// torch.distributed.new_group's store barrier, no member leaves Create until every member's
// Gloo backend exists; a member that never gets there is named after `timeout`.
absl::Status WaitForGroupMembers(c10d::Store& store, const std::string& name,
                                 const std::vector<int>& global_ranks, int my_global_rank,
                                 std::chrono::milliseconds timeout) {
  const std::string group = StrCat("process group '", name, "' [", StrJoin(global_ranks, ", "),
                                   "] on rank ", my_global_rank);
  const std::string created = name + "/created/";
  const std::string all = name + "/all_created";
  FSDP_RETURN_IF_ERROR(CallTorch(StrCat(group, ": counting the members that created it"), [&] {
    store.set(StrCat(created, my_global_rank), std::vector<uint8_t>{1});
    if (store.add(name + "/created_count", 1) == static_cast<int64_t>(global_ranks.size())) {
      store.set(all, std::vector<uint8_t>{1});
    }
  }));
  absl::Status waited = CallTorch("", [&] { store.wait({all}, timeout); });
  if (waited.ok()) return waited;
  std::vector<int> missing;
  for (int r : global_ranks) {
    bool there = true;
    CallTorch("", [&] { there = store.check({StrCat(created, r)}); }).IgnoreError();
    if (!there) missing.push_back(r);
  }
  return absl::Status(
      waited.code(),
      StrCat(group, ": ",
             missing.empty() ? "not every member" : StrCat("rank(s) ", StrJoin(missing, ", ")),
             " did not finish creating it within ", timeout.count(), " ms (this rank did)",
             std::string(waited.message())));
}

absl::StatusOr<std::shared_ptr<ProcessGroup>> ProcessGroup::Create(
    const c10::intrusive_ptr<c10d::Store>& store, std::string name,
    std::vector<int> global_ranks, int my_global_rank, const GroupOptions& options) {
  auto it = std::find(global_ranks.begin(), global_ranks.end(), my_global_rank);
  if (it == global_ranks.end()) {
    return absl::InvalidArgumentError(StrCat("rank ", my_global_rank,
                                                   " is not a member of group '", name, "' [",
                                                   StrJoin(global_ranks, ", "), "]"));
  }
  int rank = static_cast<int>(it - global_ranks.begin());
  int size = static_cast<int>(global_ranks.size());
  std::shared_ptr<ProcessGroup> group(new ProcessGroup(name, global_ranks, rank));
  std::string where = StrCat("creating process group '", name, "' [",
                                   StrJoin(global_ranks, ", "), "] on rank ",
                                   my_global_rank);
  absl::Status status = CallTorch(where, [&] {
    auto gloo_options = c10d::ProcessGroupGloo::Options::create(options.timeout);
    if (!options.gloo_interface.empty()) {
      gloo_options->devices.push_back(
          c10d::ProcessGroupGloo::createDeviceForInterface(options.gloo_interface));
    } else if (!options.gloo_hostname.empty()) {
      gloo_options->devices.push_back(
          c10d::ProcessGroupGloo::createDeviceForHostname(options.gloo_hostname));
    } else {
      gloo_options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
    }
    auto gloo_store = c10::make_intrusive<c10d::PrefixStore>(name + "/gloo", store);
    group->gloo_ = c10::make_intrusive<c10d::ProcessGroupGloo>(gloo_store, rank, size,
                                                                 gloo_options);
  });
  if (!status.ok()) return status;
  FSDP_RETURN_IF_ERROR(
      WaitForGroupMembers(*store, name, global_ranks, my_global_rank, options.timeout));
  if (options.cpu_collectives != "p2p" && options.cpu_collectives != "gloo") {
    return absl::InvalidArgumentError(StrCat("cpu_collectives is '", options.cpu_collectives,
                                             "'; valid: p2p, gloo"));
  }
  if (options.cpu_collectives == "p2p" && size > 1) {
    group->p2p_ = std::make_unique<P2pCollectives>(group->gloo_, rank, size, name);
  }
  if (options.cuda_device >= 0 && options.cuda_backend == "nccl") {
    auto nccl_store = c10::make_intrusive<c10d::PrefixStore>(name + "/nccl", store);
    absl::StatusOr<c10::intrusive_ptr<c10d::Backend>> nccl =
        CreateNcclBackend(nccl_store, rank, size, options.timeout, options.cuda_device);
    if (!nccl.ok()) return nccl.status();
    group->nccl_ = *std::move(nccl);
  }
  return group;
}

// Note [Ending NCCL process groups]
// A ProcessGroupNCCL destroyed without shutdown() or abort() aborts its communicators itself,
// after printing "destroy_process_group() was not called before program exit" on every node:
// libtorch assumes a Python program whose process groups outlive their last use only at exit.
// Ours are owned by the mesh and go when the run ends, whether it ended well (every collective
// waited for) or with an error (a peer gone, a collective timed out). Aborting is right in both
// cases and never blocks: after a good run nothing is in flight, and after a failure a graceful
// shutdown() would wait for collectives that cannot finish. So the group aborts them itself,
// which is what libtorch's destructor would do, without the warning.
ProcessGroup::~ProcessGroup() {
  if (!nccl_) return;
  try {
    nccl_->abort();
  } catch (const std::exception& e) {
    FSDP_LOG_WARN("process group '{}': aborting the NCCL communicators failed: {}", name_,
                  e.what());
  }
}

std::string ProcessGroup::RanksString() const {
  return StrCat("[", StrJoin(global_ranks_, ", "), "]");
}

c10d::Backend& ProcessGroup::BackendFor(const c10::Device& device) {
  if (device.is_cuda() && nccl_) return *nccl_;
  return *gloo_;
}

c10::intrusive_ptr<c10d::Work> ProcessGroup::AllReduce(at::Tensor& tensor, c10d::ReduceOp op) {
  std::vector<at::Tensor> tensors{tensor};
  c10d::AllreduceOptions opts;
  opts.reduceOp = op;
  return Record("all_reduce", Bytes(tensor), BackendFor(tensor.device()).allreduce(tensors, opts));
}

c10::intrusive_ptr<c10d::Work> ProcessGroup::AllGatherInto(at::Tensor& output,
                                                           at::Tensor& input) {
  TORCH_CHECK(output.numel() == input.numel() * size(), "AllGatherInto on '", name_,
              "': output has ", output.numel(), " elements, expected ", size(), " x ",
              input.numel());
  if (p2p_ && input.device().is_cpu() && output.device().is_cpu()) {
    return Record("all_gather", Bytes(output), p2p_->AllGatherInto(output, input));
  }
  return Record("all_gather", Bytes(output), BackendFor(input.device())._allgather_base(output, input));
}

c10::intrusive_ptr<c10d::Work> ProcessGroup::AllGatherPieces(std::vector<at::Tensor> outputs,
                                                             std::vector<at::Tensor> inputs) {
  TORCH_CHECK(p2p_, "AllGatherPieces on '", name_, "': needs cpu_collectives p2p and 2+ ranks");
  int64_t bytes = 0;
  for (const at::Tensor& t : outputs) bytes += Bytes(t);
  return Record("all_gather", bytes, p2p_->AllGatherPieces(std::move(outputs), std::move(inputs)));
}

c10::intrusive_ptr<c10d::Work> ProcessGroup::ReduceScatterPieces(
    at::Tensor output, std::vector<at::Tensor> inputs) {
  TORCH_CHECK(p2p_, "ReduceScatterPieces on '", name_,
              "': needs cpu_collectives p2p and 2+ ranks");
  int64_t bytes = 0;
  for (const at::Tensor& t : inputs) bytes += Bytes(t);
  return Record("reduce_scatter", bytes,
                p2p_->ReduceScatterPieces(std::move(output), std::move(inputs)));
}

c10::intrusive_ptr<c10d::Work> ProcessGroup::ReduceScatter(at::Tensor& output, at::Tensor& input,
                                                           c10d::ReduceOp op) {
  TORCH_CHECK(input.numel() == output.numel() * size(), "ReduceScatter on '", name_,
              "': input has ", input.numel(), " elements, expected ", size(), " x ",
              output.numel());
  if (p2p_ && op == c10d::ReduceOp::SUM && input.device().is_cpu() &&
      output.device().is_cpu()) {
    return Record("reduce_scatter", Bytes(input), p2p_->ReduceScatterSum(output, input));
  }
  c10d::ReduceScatterOptions opts;
  opts.reduceOp = op;
  return Record("reduce_scatter", Bytes(input),
                BackendFor(input.device())._reduce_scatter_base(output, input, opts));
}

c10::intrusive_ptr<c10d::Work> ProcessGroup::Broadcast(at::Tensor& tensor, int root) {
  std::vector<at::Tensor> tensors{tensor};
  c10d::BroadcastOptions opts;
  opts.rootRank = root;
  return Record("broadcast", Bytes(tensor), BackendFor(tensor.device()).broadcast(tensors, opts));
}

c10::intrusive_ptr<c10d::Work> ProcessGroup::Barrier() { return Record("barrier", 0, gloo_->barrier()); }

c10::intrusive_ptr<c10d::Work> ProcessGroup::Record(std::string_view op, int64_t bytes,
                                                    c10::intrusive_ptr<c10d::Work> work) {
  return RecordCollective(op, name_, global_ranks_, bytes, std::move(work));
}

}  // namespace fsdp
