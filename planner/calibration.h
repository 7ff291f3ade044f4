// The cost model's constants: bytes that operations move and the factors measured runs fitted.
// One line each; what each was fitted on, and when, is the table "Calibration history" in
// docs/cost_model.md.
#pragma once

namespace fsdp::plan {

// --- bytes moved (counted from the kernels; Note [Offload] in cost_model.cc) ----------------
// Elementwise ops per activation byte kept: written in forward, read in backward, its gradient
// written and read.
inline constexpr double kActivationTrafficPasses = 4;
// A recomputed activation byte: written again, its inputs read again.
inline constexpr double kRecomputeTrafficPasses = 2;
// The gradient norm per parameter: one read on CUDA (_foreach_norm); on a CPU each gradient's
// square is a temporary, written and read.
inline constexpr double kDeviceNormBytesPerParam = 4;
inline constexpr double kCpuNormBytesPerParam = 12;
// Clipping's multiplication of an fp32 gradient (read and write), on the device or the host.
inline constexpr double kClipMultiplyBytesPerParam = 8;
// ATen's fused Adam(W): reads parameter, gradient and both moments, writes three.
inline constexpr double kFusedAdamBytesPerParam = 28;
// The foreach (and per-tensor) Adam: nine passes (Note [Fused optimizer steps] in
// engine/optimizer.cc); AdamW's decay adds 8, Adam's L2 decay 12.
inline constexpr double kForeachAdamBytesPerParam = 80;
// After each reduction: the division of the reduce output (read, write) and the shard written.
inline constexpr double kFinishDivisionPasses = 2;
// Offload: ATen's fused CPU AdamW (28) and clipping's read of the gradient (4).
inline constexpr double kHostOptimizerBytesPerParam = 32;
// Offload params: an extra micro-batch's fp32 gradient accumulated on the host (copy 4, add
// 8 + 4).
inline constexpr double kHostAccumulateBytesPerParam = 16;
// The same for a gradient that lands in a 2-byte compute dtype (copy 2, convert-and-add 2 + 4
// + 4), and the first micro-batch's conversion into the .grad (2 + 2 + 4).
inline constexpr double kHostAccumulateNarrowBytesPerParam = 12;
inline constexpr double kHostConvertNarrowBytesPerParam = 8;
// The step's one loop besides the gradient and the loaded copy: master and moments, read and
// written.
inline constexpr double kHostLoopBytesPerParam = 24;

// --- fitted factors (docs/cost_model.md, "Calibration history") ------------------------------
// Host work that converts between dtypes (ATen's copy_ and chunked additions), per byte against
// the fused AdamW's rate.
inline constexpr double kHostCastCost = 2;
// The one loops (HostAddConverted, the host Adam pass) per byte against the fused AdamW's rate,
// unless the hardware profile has its own (`fsdp plan --calibrate-host`).
inline constexpr double kHostAddLoopCost = 1.1;
inline constexpr double kHostLoopCost = 1.2;
// The delayed update's host work beside the device's whole next step, against alone.
inline constexpr double kHostBesideStepCost = 1.2;
// Share of host memory offload's buffers and state may use: the OS, the page cache and the
// data loader keep the rest.
inline constexpr double kUsableHostFraction = 0.8;

}  // namespace fsdp::plan
