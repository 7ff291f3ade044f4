// ProcessGroup: one set of ranks that run collectives together, on libtorch's c10d backends.
//
// CPU tensors go through c10d::ProcessGroupGloo; CUDA tensors through ProcessGroupNCCL (or
// through Gloo when GroupOptions::cuda_backend is "gloo", e.g. several ranks sharing one GPU).
// Every call returns the c10d::Work; call wait() on it before touching the tensors. Every
// collective is recorded in the FlightRecorder (device_mesh/watchdog.h), which the collective
// watchdog reads.
//
// Cross-rank contract: every member calls Create with the same name and member list, and all
// members issue the same collectives in the same order. Group ranks count 0..size()-1 in the
// order of global_ranks().
//
//   auto group = ProcessGroup::Create(store, "mesh0/shard", {0, 1, 2, 3}, my_rank, options);
//   at::Tensor t = at::ones({4});
//   (*group)->AllReduce(t)->wait();            // t == 4 everywhere
//   at::Tensor full = at::empty({16});
//   (*group)->AllGatherInto(full, t)->wait();  // group rank g's t lands in full[4g:4g+4]
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "absl/status/statusor.h"
#include "device_mesh/p2p_collectives.h"

namespace fsdp {

struct GroupOptions {
  std::chrono::milliseconds timeout{std::chrono::minutes(10)};
  // Backend for CUDA tensors: "nccl" or "gloo".
  std::string cuda_backend = "nccl";
  // This rank's CUDA device, or -1 when it uses none.
  int cuda_device = -1;
  // Address Gloo binds to: a host name or IP of this machine; empty for Gloo's default.
  std::string gloo_hostname;
  // Network interface for Gloo (GLOO_SOCKET_IFNAME); wins over gloo_hostname when set.
  std::string gloo_interface;
  // All-gather and reduce-scatter of CPU tensors: "p2p" (our algorithms over Gloo's send/recv,
  // see Note [Collectives over Gloo's point-to-point transport]) or "gloo" (c10d's Gloo
  // collectives: the reduce-scatter is an all-reduce underneath).
  std::string cpu_collectives = "p2p";
};

// The store barrier that ends ProcessGroup::Create (Note [A group is created when every member
// has created it]): marks `my_global_rank` as having created group `name`, then waits until
// every one of `global_ranks` has. After `timeout` the error names the members that did not.
absl::Status WaitForGroupMembers(c10d::Store& store, const std::string& name,
                                 const std::vector<int>& global_ranks, int my_global_rank,
                                 std::chrono::milliseconds timeout);

class ProcessGroup {
 public:
  // Collective over the members (blocks until all have joined, up to options.timeout).
  // `name` must be unique per group and identical on all members; it prefixes the store keys.
  static absl::StatusOr<std::shared_ptr<ProcessGroup>> Create(
      const c10::intrusive_ptr<c10d::Store>& store, std::string name,
      std::vector<int> global_ranks, int my_global_rank, const GroupOptions& options);

  const std::string& name() const { return name_; }
  int rank() const { return rank_; }
  int size() const { return static_cast<int>(global_ranks_.size()); }
  const std::vector<int>& global_ranks() const { return global_ranks_; }
  // "[0, 2]"
  std::string RanksString() const;

  // In place: every member ends with op(all members' tensors).
  c10::intrusive_ptr<c10d::Work> AllReduce(at::Tensor& tensor,
                                           c10d::ReduceOp op = c10d::ReduceOp::SUM);
  // output (contiguous, size() * input.numel() elements) = concat of all inputs by group rank.
  c10::intrusive_ptr<c10d::Work> AllGatherInto(at::Tensor& output, at::Tensor& input);
  // True when AllGatherPieces can take tensors on `device`: CPU tensors over the p2p path.
  bool SupportsPieces(const c10::Device& device) const { return p2p_ && device.is_cpu(); }
  // For every i, outputs[i] (contiguous, size() * inputs[i].numel()) = concat of all inputs[i]
  // by group rank, each received straight into place. Needs SupportsPieces.
  c10::intrusive_ptr<c10d::Work> AllGatherPieces(std::vector<at::Tensor> outputs,
                                                 std::vector<at::Tensor> inputs);
  // Reduce-scatter (SUM) of an input given in pieces, sent straight from them: see
  // P2pCollectives::ReduceScatterPieces. Needs SupportsPieces.
  c10::intrusive_ptr<c10d::Work> ReduceScatterPieces(at::Tensor output,
                                                     std::vector<at::Tensor> inputs);
  // input has size() * output.numel() elements; group rank g receives op over members of
  // input chunk g. CPU tensors with SUM take the p2p ring unless cpu_collectives is "gloo"
  // (then libtorch's emulation: an all-reduce of a copy).
  c10::intrusive_ptr<c10d::Work> ReduceScatter(at::Tensor& output, at::Tensor& input,
                                               c10d::ReduceOp op = c10d::ReduceOp::SUM);
  // root is a group rank.
  c10::intrusive_ptr<c10d::Work> Broadcast(at::Tensor& tensor, int root);
  c10::intrusive_ptr<c10d::Work> Barrier();

  // The c10d backend used for tensors on `device` ("gloo" or "nccl").
  c10d::Backend& BackendFor(const c10::Device& device);

  // Aborts the NCCL communicators, if any (Note [Ending NCCL process groups]).
  ~ProcessGroup();

 private:
  // `work`, recorded in the FlightRecorder (device_mesh/watchdog.h).
  c10::intrusive_ptr<c10d::Work> Record(std::string_view op, int64_t bytes,
                                        c10::intrusive_ptr<c10d::Work> work);

  ProcessGroup(std::string name, std::vector<int> global_ranks, int rank)
      : name_(std::move(name)), global_ranks_(std::move(global_ranks)), rank_(rank) {}

  std::string name_;
  std::vector<int> global_ranks_;
  int rank_;
  c10::intrusive_ptr<c10d::Backend> gloo_;
  c10::intrusive_ptr<c10d::Backend> nccl_;  // null unless CUDA tensors use NCCL
  // CPU all-gather / reduce-scatter (null when cpu_collectives is "gloo" or size() == 1).
  std::unique_ptr<P2pCollectives> p2p_;
};

}  // namespace fsdp
