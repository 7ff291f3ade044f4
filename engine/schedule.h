// Learning-rate schedule: linear warmup from 0 to the peak over warmup_steps, then cosine or
// linear decay to min_lr at the last step, or constant.
//
//   double lr = LearningRate(config.lr_scheduler, config.optimizer.lr, step, config.training.steps);
#pragma once

#include <cstdint>

#include "engine/config.h"

namespace fsdp {

// `step` counts from 0; the value is for the update made at that step.
double LearningRate(const LrSchedulerSection& schedule, double peak_lr, int64_t step,
                    int64_t total_steps);

}  // namespace fsdp
