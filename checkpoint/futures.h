#pragma once
// Waiting for a batch of pool tasks (internal; not installed).
#include <exception>
#include <future>
#include <vector>

namespace checkpoint {

// Waits for every task, even after one failed (their captures must stay
// valid until all are done), then rethrows the first failure.
inline void wait_all(std::vector<std::future<void>>& tasks) {
  std::exception_ptr error;
  for (auto& t : tasks) {
    try {
      t.get();
    } catch (...) {
      if (!error) error = std::current_exception();
    }
  }
  if (error) std::rethrow_exception(error);
}

}  // namespace checkpoint
