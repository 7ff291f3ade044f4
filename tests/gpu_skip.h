// The one way a test skips without a GPU (tests/multirank.h and tests/kernels_testing.h include
// it). It asks this build, not libtorch: in a CPU-only build of fsdp.cpp (the toolkit did not
// match torch) on a machine with a GPU, torch sees the device but our CUDA code is not there.
#pragma once

#include <gtest/gtest.h>

#include "device_mesh/cuda_support.h"

// In a GPU test's body: skips, saying why, unless a CUDA device is visible to this build.
#define FSDP_SKIP_WITHOUT_GPU()                                                            \
  if (::fsdp::CudaDeviceCount() == 0) {                                                    \
    GTEST_SKIP() << (::fsdp::IsCudaBuild() ? "no CUDA device visible on this machine"      \
                                           : "CPU-only build (CUDA toolkit did not match "  \
                                             "torch)");                                     \
  }
