// P2pCollectives: all-gather and reduce-scatter for CPU tensors, built on the point-to-point
// send/recv of a c10d Gloo backend and run in order by one worker thread per process group.
//
// Note [Collectives over Gloo's point-to-point transport]: libtorch's Gloo backend implements
// reduce-scatter as clone + full all-reduce + chunk (LIBTORCH-NOTES), so every rank moves
// 2(N-1)/N of the input where (N-1)/N suffices, holds a full-size temporary, and does the
// copy-out on the waiting thread; its flat all-gather gathers into a temporary and copies the
// result into the output. These replace both with the bandwidth-optimal algorithms, on the same
// Gloo transport (same sockets, same timeout):
// - reduce-scatter: a ring. In step s (0..N-2) rank r sends its running sum of chunk
//   (r-s-1) mod N to rank r+1 and receives the running sum of chunk (r-s-2) mod N from rank
//   r-1, adding its own contribution; after N-1 steps it holds the full sum of chunk r. Each
//   chunk moves in segments, and a segment is forwarded as soon as it has been added, so the
//   steps overlap. (N-1)/N of the input on the wire per rank; the partial sums live in up to
//   three chunks of scratch (the last step receives into the output), the input is only read.
// - all-gather: every rank sends its input to every other rank and receives each peer's input
//   straight into that peer's rows of the output: (N-1)/N of the output on the wire per rank,
//   no temporary, no copy-out.
// The worker thread runs one collective at a time, in issue order; since every member issues
// the same collectives in the same order, the orders agree. A failure (a peer gone, a timeout)
// fails that collective's Work and every later one on the group with the same message.
//
//   P2pCollectives p2p(gloo_backend, group_rank, group_size, "mesh0/shard");
//   p2p.ReduceScatterSum(out, in)->wait();
//   p2p.AllGatherInto(full, shard)->wait();
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

namespace fsdp {

class P2pCollectives {
 public:
  // `gloo` is the group's Gloo backend; rank and size are group ranks (size >= 2).
  P2pCollectives(c10::intrusive_ptr<c10d::Backend> gloo, int rank, int size, std::string name);
  ~P2pCollectives();
  P2pCollectives(const P2pCollectives&) = delete;
  P2pCollectives& operator=(const P2pCollectives&) = delete;

  // output (contiguous, size * input.numel()) = concat of all members' inputs by group rank.
  c10::intrusive_ptr<c10d::Work> AllGatherInto(at::Tensor output, at::Tensor input);
  // For every i: outputs[i] (contiguous, size * inputs[i].numel()) = concat of all members'
  // inputs[i] by group rank. One collective for several buffers, each received straight into
  // place (e.g. into parameters' storage, with no gather buffer and no copy-out).
  c10::intrusive_ptr<c10d::Work> AllGatherPieces(std::vector<at::Tensor> outputs,
                                                 std::vector<at::Tensor> inputs);
  // output = sum over members of their input chunk `rank` (input: size * output.numel()
  // contiguous elements; not modified).
  c10::intrusive_ptr<c10d::Work> ReduceScatterSum(at::Tensor output, at::Tensor input);
  // The same over an input given in pieces: inputs[i] holds size * p_i contiguous elements,
  // chunk g of the whole input is the concat over i of the p_i elements of row g of each
  // inputs[i], and output has sum_i p_i elements. Sent straight from the pieces (e.g. from
  // the parameters' gradients, with no gather into one buffer).
  c10::intrusive_ptr<c10d::Work> ReduceScatterPieces(at::Tensor output,
                                                     std::vector<at::Tensor> inputs);

  // Bytes per point-to-point message of the reduce-scatter ring.
  static constexpr int64_t kSegmentBytes = int64_t{1} << 21;

 private:
  void Enqueue(c10::intrusive_ptr<c10d::Work> work, std::function<void()> body);
  void Loop();
  void RunAllGather(const std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& inputs,
                    int tag);
  void RunReduceScatter(const at::Tensor& output, const std::vector<at::Tensor>& inputs, int tag);
  int NextTag();

  c10::intrusive_ptr<c10d::Backend> gloo_;
  const int rank_;
  const int size_;
  const std::string name_;
  int next_tag_ = 0;  // touched by the issuing thread only

  std::mutex mu_;
  std::condition_variable cv_;
  struct Task {
    c10::intrusive_ptr<c10d::Work> work;
    std::function<void()> body;
  };
  std::deque<Task> queue_;
  bool stop_ = false;
  std::exception_ptr failed_;  // the first failure; every later collective fails with it
  std::thread worker_;
};

}  // namespace fsdp
