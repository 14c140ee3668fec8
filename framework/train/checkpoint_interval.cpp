#include "framework/train/checkpoint_interval.h"

#include <algorithm>
#include <cmath>

namespace framework::train {

IntervalChoice young_daly_interval(double save_stall_s, double step_s, double mtbf_s, double restart_s) {
  IntervalChoice c;
  c.save_stall_s = std::max(0.0, save_stall_s);
  c.step_s = std::max(step_s, 1e-9);
  c.mtbf_s = mtbf_s;
  c.interval_s = std::sqrt(2.0 * c.save_stall_s * mtbf_s);
  c.steps = std::max<int64_t>(1, std::llround(c.interval_s / c.step_s));
  c.expected_loss_s = static_cast<double>(c.steps) / 2.0 * c.step_s + std::max(0.0, restart_s);
  return c;
}

void AutoIntervalTracker::add_step(double step_s) {
  if (!first_step_seen_) {
    first_step_seen_ = true;
    first_step_s_ = step_s;
    return;
  }
  sum_s_ += step_s;
  ++count_;
}

double AutoIntervalTracker::local_step_s() const {
  if (count_ > 0) return sum_s_ / static_cast<double>(count_);
  return first_step_seen_ ? first_step_s_ : 0.0;
}

IntervalChoice AutoIntervalTracker::derive(double save_stall_s, double step_s, double restart_s) {
  const auto smooth = [](std::optional<double>& value, double sample) {
    value = value ? 0.5 * *value + 0.5 * sample : sample;
    return *value;
  };
  const double stall = smooth(stall_s_, save_stall_s);
  // No step since the last save (interval 1 right after a derivation that
  // saw none): keep the step time as it was.
  const double step = step_s > 0 || !step_s_ ? smooth(step_s_, step_s) : *step_s_;
  sum_s_ = 0;
  count_ = 0;
  return young_daly_interval(stall, step, mtbf_s_, restart_s);
}

}  // namespace framework::train
