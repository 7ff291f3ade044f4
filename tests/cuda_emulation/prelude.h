// Force-included (-include) before each kernel source that translate.cmake turned into host
// C++: the CUDA headers in their host form (bf16/fp16 conversions, dim3, error codes), then
// the device built-ins and intrinsics our kernels use, mapped onto the emulator
// (tests/cuda_emulation/emulator.h). A kernel using a built-in missing here fails to compile,
// which is the cue to add it.
#pragma once

#include <cassert>
#include <cmath>
#include <cstdio>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "tests/cuda_emulation/emulator.h"

// Host compilation defines __global__, __device__ and __forceinline__ (to nothing or inline);
// not these.
#define __launch_bounds__(...)
#define threadIdx (::fsdp_emu::Current().thread_idx)
#define blockIdx (::fsdp_emu::Current().block_idx)
#define blockDim (::fsdp_emu::Current().block_dim)
#define gridDim (::fsdp_emu::Current().grid_dim)

#define __syncthreads() ::fsdp_emu::SyncThreads()
#define __shfl_xor_sync(mask, value, lane_mask) ::fsdp_emu::ShflXor(mask, value, lane_mask)
#define __trap() ::fsdp_emu::Trap()
#define __assert_fail(assertion, file, line, function) \
  ::fsdp_emu::AssertFail(assertion, file, line, function)
#define cudaGetLastError() ::fsdp_emu::GetLastError()

// Math: the host's correctly rounded functions stand in for the device's approximations
// (__expf: 2 + 2|x| ulp; rsqrtf: 2 ulp), so results differ from a GPU's in the last bits.
#define __expf(x) ::expf(x)
#define rsqrtf(x) (1.0f / ::sqrtf(x))
// Round-to-nearest arithmetic that is never contracted into an FMA: the translation units are
// compiled with -ffp-contract=off, so the plain operators are exactly that.
#define __fmul_rn(a, b) ((a) * (b))
#define __fadd_rn(a, b) ((a) + (b))
#define __fsub_rn(a, b) ((a) - (b))
