// RMSNorm launchers (kernels/cuda/rms_norm.cu), with the residual add fused in optionally.
// x, residual, h, y, grad_*: rows x cols, contiguous, one dtype; weight and grad_weight: cols
// elements of weight_dtype (dtype or kFloat); rstd: rows fp32. fp32 arithmetic throughout.
// One thread block per row (one warp when cols <= 256); rows may be any number (grid-stride).
#pragma once

#include <cstdint>

#include "kernels/cuda/types.h"

namespace fsdp::kernels::cuda {

// y = v * rstd * weight, rstd = 1 / sqrt(mean(v^2) + eps) over each row, rounded once to dtype,
// where v = x, or with a residual (not nullptr) v = h = x + residual rounded to dtype and
// written to h (the statistics are of the rounded h that the backward will read).
LaunchStatus RmsNormForward(const void* x, const void* residual, const void* weight, void* h,
                            void* y, float* rstd, int64_t rows, int64_t cols, float eps,
                            DType dtype, DType weight_dtype, Stream stream);

// How many partial rows of grad_weight RmsNormBackward sums (its blocks): a pure function of
// the sizes, so that grad_weight does not depend on the GPU model. The caller allocates the
// scratch, RmsNormBackwardPartials(rows, cols) x cols floats.
int64_t RmsNormBackwardPartials(int64_t rows, int64_t cols);

// With v the normalised input (x, or h for the fused add), xhat = v * rstd, g = grad_y * weight:
//   grad_x = rstd * (g - xhat * mean(g * xhat)) (+ grad_h when not nullptr: another gradient of
//   v, read once and added in fp32 before grad_x's one rounding; AddRmsNorm's gradient of h,
//   ForkRmsNorm's of the passed-through x)
//   grad_weight = sum over rows of grad_y * xhat (skipped when grad_weight is nullptr; then
//   partials may be nullptr too)
LaunchStatus RmsNormBackward(const void* v, const float* rstd, const void* weight,
                             const void* grad_y, const void* grad_h, void* grad_x,
                             void* grad_weight, float* partials, int64_t rows, int64_t cols,
                             DType dtype, DType weight_dtype, Stream stream);

}  // namespace fsdp::kernels::cuda
