#include "cli/doctor.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <iostream>
#include <thread>

#include <ATen/ATen.h>

#include "common/logging.h"
#include "common/strings.h"
#include "device_mesh/cuda_support.h"
#include "device_mesh/device_mesh.h"
#include "device_mesh/torch_status.h"
#include "engine/host_adam.h"
#include "sharding/host_loops.h"

#ifndef FSDP_TORCH_WHEEL_VERSION
#define FSDP_TORCH_WHEEL_VERSION "unknown"
#endif

namespace fsdp {
namespace {

enum class Kind { kAllReduce, kAllGather, kReduceScatter };
constexpr Kind kKinds[] = {Kind::kAllReduce, Kind::kAllGather, Kind::kReduceScatter};

const char* Name(Kind k) {
  switch (k) {
    case Kind::kAllReduce: return "all_reduce";
    case Kind::kAllGather: return "all_gather";
    case Kind::kReduceScatter: return "reduce_scatter";
  }
  return "";
}

// nccl-tests' bus bandwidth factor: what each link carries relative to the buffer size.
double BusFactor(Kind k, int n) {
  if (n <= 1) return 0.0;
  return k == Kind::kAllReduce ? 2.0 * (n - 1) / n : static_cast<double>(n - 1) / n;
}

// One collective of `numel` float32 elements (the full buffer: all-reduce's tensor,
// all-gather's output, reduce-scatter's input) on `group`. Inputs are small integers so the
// expected values are exact in float32:
//   all_reduce     in[i] = (g+1) + i%7          -> n(n+1)/2 + n*(i%7)
//   all_gather     in[i] = 8g + i%8             -> out[k*m + i] = 8k + i%8
//   reduce_scatter in[j] = (g+1) * (1 + j%5)    -> out[i] = n(n+1)/2 * (1 + (g*m + i)%5)
struct Case {
  at::Tensor input, output, expected;
  void Fill(Kind k, int g, int n, int64_t numel, const at::TensorOptions& opts) {
    int64_t m = numel / n;
    double tri = n * (n + 1) / 2.0;
    at::Tensor idx = at::arange(numel, opts);
    switch (k) {
      case Kind::kAllReduce:
        input = idx.remainder(7).add(g + 1);
        output = input;
        expected = idx.remainder(7).mul(n).add(tri);
        break;
      case Kind::kAllGather: {
        at::Tensor local = at::arange(m, opts);
        input = local.remainder(8).add(8.0 * g);
        output = at::empty({numel}, opts);
        expected = at::arange(m, opts).remainder(8).repeat({n}) +
                   at::arange(n, opts).repeat_interleave(m).mul(8);
        break;
      }
      case Kind::kReduceScatter:
        input = idx.remainder(5).add(1).mul(g + 1);
        output = at::empty({m}, opts);
        expected = at::arange(g * m, (g + 1) * m, opts).remainder(5).add(1).mul(tri);
        break;
    }
  }
  void Refill(Kind k, int g) {
    // all_reduce works in place: restore its input before each run.
    if (k == Kind::kAllReduce) {
      int64_t numel = input.numel();
      input.copy_(at::arange(numel, input.options()).remainder(7).add(g + 1));
    }
  }
};

c10::intrusive_ptr<c10d::Work> Launch(Kind k, ProcessGroup& group, Case& c) {
  switch (k) {
    case Kind::kAllReduce: return group.AllReduce(c.input);
    case Kind::kAllGather: return group.AllGatherInto(c.output, c.input);
    case Kind::kReduceScatter: return group.ReduceScatter(c.output, c.input);
  }
  return {};
}

std::string Bytes(int64_t b) {
  if (b >= (int64_t{1} << 30) && b % (int64_t{1} << 30) == 0) return StrCat(b >> 30, "G");
  if (b >= (1 << 20) && b % (1 << 20) == 0) return StrCat(b >> 20, "M");
  if (b >= (1 << 10) && b % (1 << 10) == 0) return StrCat(b >> 10, "K");
  return StrCat(b);
}

// What parallelism.offload's host work runs here (Note [Host loops], Note [Host Adam pass]):
// fsdp.cpp's one loops, or ATen's ops and why.
std::string OffloadHostLine() {
  const std::string kernels = at::get_cpu_capability();
  std::string line = StrCat("host loops on ", HostLoopThreads(), " threads: AdamW update ");
  if (HostAdamPassAvailable()) {
    line += StrCat("one loop (bit for bit ATen's ", kernels, " kernels)");
  } else {
    line += StrCat("ATen's ops (ATen runs its ", kernels,
                   " kernels here; the loop needs an AVX2 + FMA CPU and ATen's AVX2 or AVX512 "
                   "kernels, and checks itself against them)");
  }
  line += HostAddConvertedAvailable(HostNarrow::kBFloat16)
              ? ", bf16 gradient addition one loop"
              : ", bf16 gradient addition ATen's ops (no AVX2)";
  return line;
}

void PrintHeader(const DistContext& ctx) {
  std::cout << "fsdp doctor\n"
            << "  torch      " << FSDP_TORCH_WHEEL_VERSION << " (libtorch from the PyPI wheel)\n"
            << "  build      " << (IsCudaBuild() ? "CUDA + NCCL code paths" : "CPU-only") << "\n"
            << "  CUDA       runtime " << CudaRuntimeVersion() << ", NCCL " << NcclVersion()
            << "\n"
            << "  devices    cpu (" << std::thread::hardware_concurrency() << " threads)";
  int gpus = CudaDeviceCount();
  for (int i = 0; i < gpus; ++i) std::cout << ", cuda:" << i << " " << CudaDeviceDescription(i);
  if (gpus == 0) std::cout << ", no CUDA device";
  std::cout << "\n  launch     " << ctx.env().source << ", world size " << ctx.world_size()
            << ", compute on " << ctx.device().str() << "\n";
  std::cout << "  offload    " << OffloadHostLine() << "\n";
  std::cout.flush();
}

}  // namespace

int RunDoctor(const DoctorOptions& o) {
  if (o.min_bytes < 4 || o.max_bytes < o.min_bytes || o.iters < 1 || o.warmup < 0) {
    std::cerr << "fsdp doctor: need 4 <= --min-bytes <= --max-bytes, --iters >= 1, "
                 "--warmup >= 0\n";
    return 2;
  }
  // A buffer above the machine's memory cannot be allocated (on a GPU neither): say so now,
  // not after every smaller size ran.
  const int64_t memory = static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGESIZE);
  if (memory > 0 && o.max_bytes > memory) {
    std::cerr << "fsdp doctor: --max-bytes " << Bytes(o.max_bytes) << " is more than this "
              << "machine's memory (" << fmt::format("{:.1f} GiB", memory / 1073741824.0) << ")\n";
    return 2;
  }
  DistOptions dist;
  dist.device = o.device;
  dist.cuda_backend = o.backend;
  dist.cpu_collectives = o.cpu_collectives;
  dist.rendezvous_timeout = std::chrono::seconds(o.timeout_s);
  dist.collective_timeout = std::chrono::seconds(o.timeout_s);
  absl::StatusOr<std::shared_ptr<DistContext>> ctx_or = DistContext::InitFromEnvironment(dist);
  if (!ctx_or.ok()) {
    std::cerr << "fsdp doctor: " << ctx_or.status().message() << "\n";
    // Bad options or environment (a launcher variable, --device cuda without a GPU, two NCCL
    // ranks on one GPU): 2; the rendezvous or the backend failing: 3.
    const absl::StatusCode code = ctx_or.status().code();
    return code == absl::StatusCode::kInvalidArgument ||
                   code == absl::StatusCode::kFailedPrecondition
               ? 2
               : 3;
  }
  std::shared_ptr<DistContext> ctx = *ctx_or;
  absl::StatusOr<MeshShape> shape = ParseMeshSpec(o.mesh, ctx->world_size());
  if (!shape.ok()) {
    std::cerr << "fsdp doctor: --mesh: " << shape.status().message() << "\n";
    return 2;
  }
  absl::StatusOr<DeviceMesh> mesh_or = DeviceMesh::Create(ctx, *shape);
  if (!mesh_or.ok()) {
    std::cerr << "fsdp doctor: " << mesh_or.status().message() << "\n";
    return 3;
  }
  DeviceMesh& mesh = *mesh_or;
  const int rank = ctx->rank();
  if (rank == 0) PrintHeader(*ctx);
  ctx->world().Barrier()->wait();
  std::cout << "rank " << rank << ": " << ctx->env().Describe() << "; mesh " << shape->ToString()
            << "; " << mesh.Describe() << "\n";
  std::cout.flush();
  ctx->world().Barrier()->wait();

  at::TensorOptions opts = at::TensorOptions().dtype(at::kFloat).device(ctx->device());
  int64_t total_wrong = 0;
  int checks = 0;
  auto stat_opts = at::TensorOptions().dtype(at::kDouble);
  if (rank == 0) {
    std::cout << fmt::format("\n{:<15} {:<10} {:>5} {:>8} {:>11} {:>11} {:>11} {:>6}\n",
                             "collective", "axis", "ranks", "bytes", "time_us", "algbw_GB/s",
                             "busbw_GB/s", "wrong");
  }
  absl::Status run = CallTorch("running collectives", [&] {
    for (int axis = 0; axis < mesh.ndim(); ++axis) {
      ProcessGroup& group = mesh.group(axis);
      const int n = group.size();
      const int g = group.rank();
      for (Kind k : kKinds) {
        for (int64_t bytes = o.min_bytes;; bytes *= 4) {
          int64_t numel = std::max<int64_t>(n, (bytes / 4) / n * n);
          Case c;
          c.Fill(k, g, n, numel, opts);
          std::vector<double> times;
          for (int it = 0; it < o.warmup + o.iters; ++it) {
            c.Refill(k, g);
            if (ctx->device().is_cuda()) CudaSynchronize();
            auto t0 = std::chrono::steady_clock::now();
            Launch(k, group, c)->wait();
            if (ctx->device().is_cuda()) CudaSynchronize();
            auto t1 = std::chrono::steady_clock::now();
            if (it >= o.warmup) times.push_back(std::chrono::duration<double>(t1 - t0).count());
          }
          std::sort(times.begin(), times.end());
          double median = times[times.size() / 2];
          at::Tensor wrong_mask = c.output.ne(c.expected);
          int64_t wrong = wrong_mask.sum().item<int64_t>();
          if (wrong > 0) {
            int64_t first = wrong_mask.nonzero()[0][0].item<int64_t>();
            std::cout << fmt::format(
                "rank {}: {} on axis '{}' with {} bytes: {} wrong element(s), first at index {}: "
                "got {}, expected {}\n",
                rank, Name(k), shape->axis_names[axis], numel * 4, wrong, first,
                c.output[first].item<float>(), c.expected[first].item<float>());
          }
          // Every rank learns the worst time and the total of wrong elements.
          at::Tensor stats = at::tensor({median, static_cast<double>(wrong)}, stat_opts);
          at::Tensor worst = stats.narrow(0, 0, 1).clone();
          at::Tensor wrong_sum = stats.narrow(0, 1, 1).clone();
          ctx->world().AllReduce(worst, c10d::ReduceOp::MAX)->wait();
          ctx->world().AllReduce(wrong_sum)->wait();
          int64_t all_wrong = static_cast<int64_t>(wrong_sum.item<double>());
          total_wrong += all_wrong;
          ++checks;
          if (rank == 0) {
            double t = worst.item<double>();
            double algbw = numel * 4 / t / 1e9;
            std::cout << fmt::format("{:<15} {:<10} {:>5} {:>8} {:>11.1f} {:>11.3f} {:>11} {:>6}\n",
                                     Name(k), shape->axis_names[axis], n, Bytes(numel * 4),
                                     t * 1e6, algbw,
                                     n > 1 ? fmt::format("{:.3f}", algbw * BusFactor(k, n))
                                           : std::string("-"),
                                     all_wrong);
          }
          if (bytes > o.max_bytes / 4) break;  // the next size is above --max-bytes
        }
      }
    }
  });
  std::cout.flush();
  if (!run.ok()) {
    std::cerr << "fsdp doctor: rank " << rank << ": " << run.message() << "\n";
    return 3;
  }
  ctx->world().Barrier()->wait();
  if (rank == 0) {
    if (total_wrong == 0) {
      std::cout << "\nfsdp doctor: OK: " << checks << " collective checks on " << mesh.ndim()
                << " mesh axis(es) " << shape->ToString() << ", every element as expected\n";
    } else {
      std::cout << "\nfsdp doctor: FAILED: " << total_wrong
                << " wrong element(s) in total; see the per-rank lines above\n";
    }
  }
  std::cout.flush();
  return total_wrong == 0 ? 0 : 1;
}

}  // namespace fsdp
