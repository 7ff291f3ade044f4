// The emulated kernels library's dispatch, in place of kernels/dispatch.cc's: every (CPU)
// tensor counts as a CUDA tensor, so the kernels' CUDA branches in kernels/*.cc (their
// autograd functions, buffer sizes, strides and launcher arguments) run on the CPU through the
// emulated launchers. Used by kernels_emulated_test.cc only.
#include "emulated/kernels/dispatch.h"

#include <c10/util/Exception.h>

#include "tests/cuda_emulation/emulator.h"

namespace fsdp::kernels_emulated {

bool CudaKernelsBuilt() { return true; }

bool OnCuda(const at::Tensor& t, const char* kernel) {
  TORCH_CHECK(t.is_cpu(), "emulated fsdp kernel ", kernel, ": a ", t.device(),
              " tensor; the emulator runs on CPU tensors");
  return true;
}

cuda::Stream CurrentStream(const at::Tensor& /*t*/) { return nullptr; }

void CheckLaunch(cuda::LaunchStatus status, const char* kernel) {
  TORCH_CHECK(status == 0, "emulated fsdp kernel ", kernel, ": launch failed (", status,
              "): ", fsdp_emu::LastErrorMessage());
}

}  // namespace fsdp::kernels_emulated
