#pragma once
// checkpoint.interval auto: how often to save, from the Young/Daly rule
// (Young 1974, Daly 2006): with a save that stalls training for C seconds
// and failures every M seconds on average, saving every sqrt(2 C M) seconds
// of work minimises the expected time lost to saves plus the work redone
// after a failure. C and the step time are this run's own, measured; M is
// checkpoint.mtbf_s. Pure functions and a small tracker: no I/O, no
// collectives (the trainer agrees the measurements across ranks first).
#include <cstdint>
#include <optional>

namespace framework::train {

// The interval one derivation chose.
struct IntervalChoice {
  int64_t steps = 1;           // save every this many steps, >= 1
  double interval_s = 0;       // sqrt(2 x save_stall_s x mtbf_s), before rounding to steps
  double save_stall_s = 0;     // the stall it used (smoothed)
  double step_s = 0;           // the step time it used (smoothed)
  double mtbf_s = 0;
  // Expected time lost per failure: half an interval of steps redone, plus
  // the restart (restart_s, the measured start-up of this process).
  double expected_loss_s = 0;
};

// Young/Daly: interval_s = sqrt(2 x save_stall_s x mtbf_s), steps =
// max(1, round(interval_s / step_s)); expected_loss_s = steps / 2 x step_s
// + restart_s. REQUIRES: mtbf_s > 0; negative times count as 0, a step time
// of 0 as 1 ns.
IntervalChoice young_daly_interval(double save_stall_s, double step_s, double mtbf_s, double restart_s);

// The first save of a process under auto comes this many steps after it
// started (or resumed): the first step is the slow one (allocations,
// warm-up), so the second's time and the first save's stall are the first
// measurements.
inline constexpr int64_t kAutoIntervalFirstSave = 2;

// One rank's measurements between saves, and the smoothed values the
// derivations use. Call sequence: add_step() after every step;
// local_step_s() and then derive() after each save (derive with the values
// the ranks agreed on, so that every rank picks the same interval).
class AutoIntervalTracker {
 public:
  explicit AutoIntervalTracker(double mtbf_s) : mtbf_s_(mtbf_s) {}

  // A step's time; the process's first step counts only when no other has.
  void add_step(double step_s);
  // The mean step time since the last derive() (the first step's when
  // there was no other); 0 when no step was added.
  double local_step_s() const;
  // A new choice from a save's stall and the steps' time since the last
  // one: each is smoothed (half the new, half the old; the first taken as
  // it is). Starts a new span of steps.
  IntervalChoice derive(double save_stall_s, double step_s, double restart_s);

 private:
  double mtbf_s_;
  bool first_step_seen_ = false;
  double first_step_s_ = 0;
  double sum_s_ = 0;  // of the steps since the last derive(), the first excluded
  int64_t count_ = 0;
  std::optional<double> stall_s_, step_s_;  // smoothed
};

}  // namespace framework::train
