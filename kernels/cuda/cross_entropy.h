// The fused softmax + cross-entropy (+ its gradient) over one chunk of logits
// (kernels/cuda/cross_entropy.cu), after llm.c's fused_classifier: one block per row reads the
// row, reduces max and sum of exp in fp32, writes the row's loss, and when asked overwrites the
// row IN PLACE with d loss / d logits = (softmax - onehot(target)) * grad_scale.
//   logits   rows x vocab, row-major and contiguous, in `dtype` (read, then overwritten)
//   targets  rows, int64: a class in [0, vocab) or ignore_index (loss 0, gradient row 0)
//   losses   rows, fp32: lse - logit[target] (0 for ignored rows)
//   grad_scale  one fp32 on the device (1 / the number of counted rows), read by the kernel so
//               that the host need not know it (no sync)
// A target outside [0, vocab) that is not ignore_index stops the kernel with a device-side
// assert after printing the row, the target and vocab (as ATen's cross_entropy on CUDA: the
// CUDA context is unusable afterwards). Checking on the host would cost a sync.
#pragma once

#include <cstdint>

#include "kernels/cuda/types.h"

namespace fsdp::kernels::cuda {

LaunchStatus SoftmaxCrossEntropy(void* logits, const int64_t* targets, float* losses,
                                 const float* grad_scale, int64_t rows, int64_t vocab,
                                 int64_t ignore_index, bool write_grad, DType dtype, Stream stream);

}  // namespace fsdp::kernels::cuda
