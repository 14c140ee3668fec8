#pragma once
// The one place where the pieces are wired together: mesh, model, FSDP,
// optimizer, data, metrics and checkpoints.
//
// Call sequence (all ranks): Trainer(config, runtime); run().
#include "framework/config/config.h"
#include "checkpoint/async/manager.h"
#include "checkpoint/storage/storage.h"
#include "framework/dist/runtime.h"

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace framework::fsdp {
class FullyShardedModel;
}
namespace framework::optim {
class ShardedAdamW;
}

namespace framework::train {

// Exit status of a run stopped by SIGTERM/SIGINT after its final save: the
// job was preempted and should be resumed.
inline constexpr int kExitPreempted = 75;

struct StepRecord {
  int64_t step = 0;
  double loss = 0;
  double lr = 0;
  double grad_norm = 0;
  double step_time_s = 0;
  double tokens_per_s = 0;
};

// What the caller of a Trainer may plug in besides the config.
struct TrainerHooks {
  // Where checkpoints are read and written; null: the POSIX file system.
  std::shared_ptr<checkpoint::Storage> storage;
  // Called at the start of every training step, before its collectives.
  std::function<void(int64_t step, int rank)> before_step;
  // Passed to the checkpoint manager (checkpoint/async/manager.h).
  checkpoint::ManagerHooks checkpoint;
};

class Trainer {
 public:
  // REQUIRES: runtime outlives the trainer; every rank constructs it with the
  // same config.
  Trainer(const config::Config& config, dist::Runtime& runtime, TrainerHooks hooks = {});
  ~Trainer();

  // Trains from the current step to train.steps (or train.stop_at). Returns
  // the process exit status: 0, or kExitPreempted after a stop signal.
  int run();

  // The step the next call to run() starts after (0 for a fresh run).
  int64_t step() const;
  const std::vector<StepRecord>& history() const;
  fsdp::FullyShardedModel& model();
  optim::ShardedAdamW& optimizer();

  // Set from a signal handler: finish the current step, save, and return.
  static std::atomic<int>& stop_signal();

  struct State;

 private:
  std::unique_ptr<State> s_;
};

}  // namespace framework::train
