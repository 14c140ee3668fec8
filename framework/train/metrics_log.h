#pragma once
// Rank 0's record of a run: the console's progress lines and
// <run.dir>/metrics.jsonl, one JSON object per line (docs/training.md,
// "metrics.jsonl"): a record per logged step, and events (start, eval,
// checkpoint, retention, resume_skipped, profile, sample, end). The
// Trainer decides what happened; this sink only writes it down (the
// observability issue adds TensorBoard here).
//
// Call sequence (rank 0 only): MetricsLog(cfg); start(...); then step(),
// eval(), checkpoint(), ... as they happen; end(). Each record is flushed.
// Thread safety: one thread.
#include "checkpoint/async/manager.h"
#include "checkpoint/event.h"
#include "framework/config/config.h"
#include "framework/train/trainer.h"

#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdint>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

namespace framework::train {

// Where a run segment starts (the "start" record).
struct RunStart {
  int64_t step = 0;                          // the last step taken before it
  std::optional<std::string> resumed_from;   // nullopt: a fresh run
  checkpoint::LoadStats resumed;             // of resumed_from
  std::string resume_tier, resume_reason;    // tiers: local | durable, and why
  int world = 1;
  std::string layout, device;
  int64_t params = 0;
  std::optional<double> memory_estimate_mib;  // built-in models
};

// Where the step is within the run() (for the ETA) and the ranks' peaks.
struct StepProgress {
  int64_t first_step = 0;  // the first step this run() takes
  int64_t last_step = 0;   // train.steps, or train.stop_at when it comes first
  double run_s = 0;        // since this run() started
  std::vector<double> peak_rss_mib;  // per rank
  std::vector<double> peak_gpu_mib;  // per rank; empty on the CPU
};

class MetricsLog {
 public:
  // Creates run.dir with the effective config (config.yaml) and opens
  // metrics.jsonl to append to; wall_s counts from `started` (the
  // process's run). Throws std::runtime_error naming the path.
  MetricsLog(const config::Config& cfg, std::chrono::steady_clock::time_point started);

  void start(const RunStart& start);
  // Damaged checkpoints resume set aside: a warning each on stderr.
  void resume_skipped(const std::vector<checkpoint::SkippedCheckpoint>& skipped);
  // The progress line and the step's record.
  void step(const StepRecord& rec, const StepProgress& progress);
  void eval(const EvalRecord& rec);
  // A finished save (`tiered`: with the tier fields).
  void checkpoint(const checkpoint::CheckpointEvent& ev, bool tiered);
  void checkpoint_skipped(int64_t step);
  void retention_failure(const checkpoint::RetentionFailure& failure);
  void profile(int64_t first_step, int64_t step, const std::string& backend, const std::string& dir);
  void sample(int64_t step, const std::string& prompt, const std::string& text);
  void end(int64_t step, bool stopped_by_signal);

 private:
  void write(const nlohmann::json& record);

  const config::Config& cfg_;
  std::ofstream out_;
  std::chrono::steady_clock::time_point started_;
};

}  // namespace framework::train
