#pragma once
// Test-only and not installed: a point where a test stalls a training step
// (the reliability tests' hung peer, tests/reliability/train_faults.cpp).
// The product never sets one; without one nothing is called. Save points:
// checkpoint/save_seam.h.
#include <cstdint>
#include <functional>

namespace framework::train::test_seam {

// Called at the start of every training step, before its collectives.
// REQUIRES: called before any Trainer of this process trains.
void set_before_step(std::function<void(int64_t step, int rank)> callback);
// Calls the callback, if one was set (the trainer).
void before_step(int64_t step, int rank);

}  // namespace framework::train::test_seam
