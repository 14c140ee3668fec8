#pragma once
// Test-only and not installed: points where a test stalls or kills a save
// (the reliability tests' hung peer, a kill before a flush, a crash check's
// save boundaries). The product never sets one; without one nothing is
// called.
#include <cstdint>
#include <functional>

namespace checkpoint {

class CheckpointManager;

namespace test_seam {

struct SaveSeam {
  // Called on the thread that writes a save (the background thread unless
  // mode is sync), after staging and before the save's first collective.
  std::function<void(int64_t step, int rank)> before_write;
  // Tiers: called on the background thread after the local commit (and the
  // partner copies), before a flush to the durable tier starts.
  std::function<void(int64_t step, int rank)> before_flush;
  // Tiers: called before this rank sends its file to its partner.
  std::function<void(int64_t step, int rank)> before_partner;
};

// Installs `seam` in `manager`. REQUIRES: no save in flight.
void set_save_seam(CheckpointManager& manager, SaveSeam seam);
// Every CheckpointManager constructed after this call, in this process,
// starts with `seam` (for a manager a test does not construct itself, e.g.
// the trainer's). SaveSeam{} ends it.
void set_default_save_seam(SaveSeam seam);

}  // namespace test_seam
}  // namespace checkpoint
