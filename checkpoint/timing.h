#pragma once
// Internal: the one elapsed-time helper for the phase timings that save, the
// manager, the trainer and the benchmarks report. Not part of the public API.
#include <chrono>

namespace checkpoint {

// Seconds on the steady clock since t.
inline double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

// Seconds since the Unix epoch on the wall clock: when a phase began, for
// timelines that line up the ranks (their steady clocks do not).
inline double unix_seconds_now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace checkpoint
