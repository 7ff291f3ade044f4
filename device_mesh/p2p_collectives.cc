#include "device_mesh/p2p_collectives.h"

#include <algorithm>
#include <stdexcept>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include "common/strings.h"

namespace fsdp {
namespace {

// A Work completed by the worker thread (c10d::Work::finish is protected).
class P2pWork : public c10d::Work {
 public:
  explicit P2pWork(c10d::OpType type) : c10d::Work(-1, type) {}
  void Finish(std::exception_ptr error) { finish(std::move(error)); }
};

// c10d's send/recv take a vector of exactly one contiguous tensor.
c10::intrusive_ptr<c10d::Work> Send(c10d::Backend& gloo, at::Tensor t, int dst, int tag) {
  std::vector<at::Tensor> one{std::move(t)};
  return gloo.send(one, dst, tag);
}

c10::intrusive_ptr<c10d::Work> Recv(c10d::Backend& gloo, at::Tensor t, int src, int tag) {
  std::vector<at::Tensor> one{std::move(t)};
  return gloo.recv(one, src, tag);
}

void WaitAll(std::vector<c10::intrusive_ptr<c10d::Work>>& works) {
  for (auto& w : works) w->wait();
  works.clear();
}

}  // namespace

P2pCollectives::P2pCollectives(c10::intrusive_ptr<c10d::Backend> gloo, int rank, int size,
                               std::string name)
    : gloo_(std::move(gloo)), rank_(rank), size_(size), name_(std::move(name)) {
  TORCH_CHECK(size_ >= 2 && rank_ >= 0 && rank_ < size_, "P2pCollectives on '", name_,
              "': rank ", rank_, " of ", size_, " (needs 2+ ranks)");
  worker_ = std::thread([this] { Loop(); });
}

P2pCollectives::~P2pCollectives() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  worker_.join();
}

int P2pCollectives::NextTag() {
  // c10d wants tags >= 0; each collective gets its own so that no two share a message slot.
  int tag = next_tag_;
  next_tag_ = (next_tag_ + 1) & 0x3fffffff;
  return tag;
}

void P2pCollectives::Enqueue(c10::intrusive_ptr<c10d::Work> work, std::function<void()> body) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(Task{std::move(work), std::move(body)});
  }
  cv_.notify_all();
}

void P2pCollectives::Loop() {
  while (true) {
    Task task;
    std::exception_ptr failed;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stop_ and nothing left to run
      task = std::move(queue_.front());
      queue_.pop_front();
      failed = failed_;
    }
    std::exception_ptr error = failed;
    if (!error) {
      try {
        task.body();
      } catch (const std::exception& e) {
        error = std::make_exception_ptr(std::runtime_error(
            StrCat("collective on group '", name_, "' (rank ", rank_, " of ", size_,
                   ") failed: ", e.what())));
        std::lock_guard<std::mutex> lock(mu_);
        failed_ = error;
      }
    }
    task.body = nullptr;  // drops the tensors before the waiter hears of completion
    static_cast<P2pWork*>(task.work.get())->Finish(error);
  }
}

c10::intrusive_ptr<c10d::Work> P2pCollectives::AllGatherInto(at::Tensor output,
                                                             at::Tensor input) {
  return AllGatherPieces({std::move(output)}, {std::move(input)});
}

c10::intrusive_ptr<c10d::Work> P2pCollectives::AllGatherPieces(std::vector<at::Tensor> outputs,
                                                               std::vector<at::Tensor> inputs) {
  TORCH_CHECK(outputs.size() == inputs.size(), "AllGather on '", name_, "': ", outputs.size(),
              " outputs for ", inputs.size(), " inputs");
  for (size_t i = 0; i < inputs.size(); ++i) {
    TORCH_CHECK(outputs[i].is_contiguous() && inputs[i].is_contiguous() &&
                    outputs[i].numel() == inputs[i].numel() * size_,
                "AllGather on '", name_, "': needs contiguous tensors and ", size_,
                " x the input's ", inputs[i].numel(), " elements in the output, got ",
                outputs[i].numel(), " (buffer ", i, ")");
  }
  auto work = c10::make_intrusive<P2pWork>(c10d::OpType::_ALLGATHER_BASE);
  int tag = NextTag();
  Enqueue(work, [this, outputs = std::move(outputs), inputs = std::move(inputs), tag] {
    RunAllGather(outputs, inputs, tag);
  });
  return work;
}

c10::intrusive_ptr<c10d::Work> P2pCollectives::ReduceScatterSum(at::Tensor output,
                                                                at::Tensor input) {
  return ReduceScatterPieces(std::move(output), {std::move(input)});
}

c10::intrusive_ptr<c10d::Work> P2pCollectives::ReduceScatterPieces(
    at::Tensor output, std::vector<at::Tensor> inputs) {
  int64_t total = 0;
  for (size_t i = 0; i < inputs.size(); ++i) {
    TORCH_CHECK(inputs[i].is_contiguous() && inputs[i].numel() % size_ == 0 &&
                    inputs[i].scalar_type() == output.scalar_type(),
                "ReduceScatter on '", name_, "': input ", i, " must be contiguous, of ",
                output.scalar_type(), " and a multiple of ", size_, " elements, got ",
                inputs[i].numel(), " of ", inputs[i].scalar_type());
    total += inputs[i].numel();
  }
  TORCH_CHECK(output.is_contiguous() && total == output.numel() * size_, "ReduceScatter on '",
              name_, "': needs contiguous tensors and ", size_, " x the output's ",
              output.numel(), " elements in the input, got ", total);
  auto work = c10::make_intrusive<P2pWork>(c10d::OpType::_REDUCE_SCATTER_BASE);
  int tag = NextTag();
  Enqueue(work, [this, output = std::move(output), inputs = std::move(inputs), tag] {
    RunReduceScatter(output, inputs, tag);
  });
  return work;
}

void P2pCollectives::RunAllGather(const std::vector<at::Tensor>& outputs,
                                  const std::vector<at::Tensor>& inputs, int tag) {
  const int n = size_;
  std::vector<c10::intrusive_ptr<c10d::Work>> pending;
  pending.reserve(2 * (n - 1) * inputs.size());
  // Peers in ring order from this rank, so that at any moment the ranks talk to different
  // peers; between two ranks the buffers go in index order on both sides, which is how Gloo
  // matches the messages.
  for (int d = 1; d < n; ++d) {
    const int src = (rank_ - d + n) % n;
    for (size_t i = 0; i < inputs.size(); ++i) {
      if (inputs[i].numel() == 0) continue;
      pending.push_back(Recv(*gloo_, outputs[i].view({n, inputs[i].numel()})[src], src, tag));
    }
  }
  for (int d = 1; d < n; ++d) {
    for (const at::Tensor& input : inputs) {
      if (input.numel() > 0) pending.push_back(Send(*gloo_, input, (rank_ + d) % n, tag));
    }
  }
  for (size_t i = 0; i < inputs.size(); ++i) {
    outputs[i].view({n, inputs[i].numel()})[rank_].copy_(inputs[i]);
  }
  WaitAll(pending);
}

void P2pCollectives::RunReduceScatter(const at::Tensor& output,
                                      const std::vector<at::Tensor>& inputs, int tag) {
  const int n = size_;
  const int64_t chunk = output.numel();
  // The messages: every piece's row split at kSegmentBytes, in piece order. Every rank
  // computes the same list, so sends and receives pair up one to one.
  struct Segment {
    size_t piece;
    int64_t in_row;  // offset inside the piece's row
    int64_t offset;  // offset inside a chunk
    int64_t numel;
  };
  const int64_t seg = std::max<int64_t>(1, kSegmentBytes / output.element_size());
  std::vector<Segment> segments;
  std::vector<at::Tensor> rows;  // [n, p_i] views
  int64_t offset = 0;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const int64_t row = inputs[i].numel() / n;
    rows.push_back(inputs[i].view({n, row}));
    for (int64_t at = 0; at < row; at += seg) {
      segments.push_back({i, at, offset + at, std::min(seg, row - at)});
    }
    offset += row;
  }
  // This rank's contribution to chunk c, segment s.
  auto own = [&](int c, const Segment& s) { return rows[s.piece][c].narrow(0, s.in_row, s.numel); };
  auto in_chunk = [&](const at::Tensor& t, const Segment& s) { return t.narrow(0, s.offset, s.numel); };
  auto chunk_of = [&](int k) { return ((k % n) + n) % n; };
  const int next = (rank_ + 1) % n;
  const int prev = (rank_ - 1 + n) % n;
  // Step s receives the running sum of chunk (r-s-2) mod N, adds this rank's rows of it and
  // forwards it (the next step's send); the last step receives straight into the output.
  // Partial sums live in up to three scratch chunks, so the inputs are only read.
  const int steps = n - 1;
  std::vector<at::Tensor> scratch(std::min(3, steps - 1));
  for (at::Tensor& t : scratch) t = at::empty({chunk}, output.options());
  auto dest = [&](int s) { return s + 1 == steps ? output : scratch[s % 3]; };
  std::vector<std::vector<c10::intrusive_ptr<c10d::Work>>> recvs(steps), sends(steps + 1);
  auto post_recvs = [&](int s) {
    if (s >= 3) WaitAll(sends[s - 2]);  // the forwards out of scratch[s % 3], posted in step s-3
    at::Tensor into = dest(s);
    for (const Segment& g : segments) recvs[s].push_back(Recv(*gloo_, in_chunk(into, g), prev, tag));
  };
  post_recvs(0);
  for (const Segment& g : segments) {
    sends[0].push_back(Send(*gloo_, own(chunk_of(rank_ - 1), g), next, tag));
  }
  for (int s = 0; s < steps; ++s) {
    if (s + 1 < steps) post_recvs(s + 1);
    at::Tensor sum = dest(s);
    const int c = chunk_of(rank_ - s - 2);
    for (size_t j = 0; j < segments.size(); ++j) {
      recvs[s][j]->wait();
      at::Tensor part = in_chunk(sum, segments[j]);
      part.add_(own(c, segments[j]));
      // Forwarded while the later pieces of this step are still arriving.
      if (s + 1 < steps) sends[s + 1].push_back(Send(*gloo_, part, next, tag));
    }
  }
  for (auto& step : sends) WaitAll(step);
}

}  // namespace fsdp
