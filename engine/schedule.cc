#include "engine/schedule.h"

#include <algorithm>
#include <cmath>

namespace fsdp {

double LearningRate(const LrSchedulerSection& s, double peak_lr, int64_t step,
                    int64_t total_steps) {
  if (step < s.warmup_steps) {
    return peak_lr * static_cast<double>(step + 1) / static_cast<double>(s.warmup_steps);
  }
  if (s.decay == LrDecay::kConstant) return peak_lr;
  int64_t decay_steps = std::max<int64_t>(1, total_steps - s.warmup_steps - 1);
  double progress =
      std::clamp(static_cast<double>(step - s.warmup_steps) / decay_steps, 0.0, 1.0);
  double factor = s.decay == LrDecay::kCosine ? 0.5 * (1.0 + std::cos(M_PI * progress)) : 1.0 - progress;
  return s.min_lr + (peak_lr - s.min_lr) * factor;
}

}  // namespace fsdp
