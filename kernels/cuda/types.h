// What the launchers' declarations (kernels/cuda/<name>.h) share with their .cc callers: the
// dtype codes and the stream type, in plain C++ (no nvcc, no torch, no CUDA headers).
#pragma once

namespace fsdp::kernels::cuda {

// The element types a launcher accepts; kernels/dispatch.h maps at::ScalarType onto these.
enum class DType : int { kFloat = 0, kBFloat16 = 1, kHalf = 2 };

// A cudaStream_t, passed opaquely so that declarations need no CUDA header.
using Stream = void*;

// Launchers return the launch's cudaError_t as an int (0: success); kernels/dispatch.h's
// CheckLaunch turns a failure into an error naming the kernel.
using LaunchStatus = int;

}  // namespace fsdp::kernels::cuda
