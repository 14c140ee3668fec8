#pragma once
// Rank 0's record of a run: the console's progress lines and
// <run.dir>/metrics.jsonl, one JSON object per line (docs/training.md,
// "metrics.jsonl"): a record per logged step, and events (start, eval,
// startup, restart, checkpoint, checkpoint_interval, retention,
// resume_skipped, profile, sample, end), each with its "time", and with
// metrics.tensorboard the same scalars as TensorBoard event files in
// <run.dir>/tb (tensorboard.h). The Trainer decides what happened; this
// sink only writes it down.
//
// Call sequence (rank 0 only): MetricsLog(cfg); start(...); then step(),
// eval(), checkpoint(), ... as they happen; end(). Each record is flushed.
// Thread safety: one thread.
#include "checkpoint/async/manager.h"
#include "checkpoint/event.h"
#include "framework/config/config.h"
#include "framework/train/checkpoint_interval.h"
#include "framework/train/goodput.h"
#include "framework/train/tensorboard.h"
#include "framework/train/trainer.h"

#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdint>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace framework::train {

// Model FLOPs utilisation (torchtitan's): the model's training FLOPs per
// token x tokens/s, over the peak of all the job's devices.
struct MfuBasis {
  double flops_per_token = 0;  // UserModel::flops_per_token; 0: unknown
  double peak_flops = 0;       // one device's, FLOP/s; 0: unknown
  int64_t devices = 1;         // the world: every rank one device
  std::string peak_source;     // "train.peak_tflops", "NVIDIA H100 80GB HBM3 (bf16 dense)"
  std::string missing;         // why MFU is not reported ("" when it is)
  // Percent of peak at `tokens_per_s` (the job's); 0 when unknown.
  double percent(double tokens_per_s) const;
};

// One device's bf16 dense peak in TFLOP/s for a CUDA device name, from the
// vendors' data sheets (torchtitan's table: H100 SXM and H200 989, H100 PCIe
// 756, H100 NVL 835, H20 148, B200 2250, A100 312, L40S 362); nullopt for a name not in the table.
std::optional<double> known_peak_tflops(const std::string& gpu_name);

// train.peak_tflops (0: auto) on `gpu_name` ("" for the CPU): the peak, or
// why there is none (on the CPU MFU needs the peak set).
MfuBasis mfu_basis(double flops_per_token, double peak_tflops, const std::string& gpu_name,
                   int64_t devices);

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

// Where one process's start-up went, from its exec to the start of its
// first step (the "startup" record), in seconds. Rank 0's, once per
// process: after a restart it is the restarted rank's.
struct StartupPhases {
  // From exec, or for a standby of the local launcher from its activation
  // (comm::wait_if_standby: it was loaded before the failure), or for a
  // rank forked from a template from its activation (comm::fork_rank_templates).
  double total_s = 0;       // exec (or activation) to the first step
  double load_s = 0;        // exec (or activation) to the rendezvous: the program and LibTorch loaded, config, checks
  double rendezvous_s = 0;  // connected to the store, job id checked
  double groups_s = 0;      // the train and ckpt process groups built
  double model_s = 0;       // mesh, model built and sharded, optimizer (not the dataset)
  double data_s = 0;        // the dataset opened and its loader made
  double checkpoint_s = 0;  // the checkpoint manager: direct_io probe (or its reuse), staging buffers
  double resume_s = 0;      // the newest checkpoint found and loaded, the data positioned
  double other_s = 0;       // the rest: total less the phases above
  int restart = 0;          // the attempt (TORCHELASTIC_RESTART_COUNT)
  bool standby = false;     // an activated standby (comm::activated_standby)
  bool forked = false;      // forked from a rank template (comm::forked_rank)
};

// Where the step is within the run() (for the ETA) and the ranks' peaks.
struct StepProgress {
  int64_t first_step = 0;  // the first step this run() takes
  int64_t last_step = 0;   // train.steps, or train.stop_at when it comes first
  double run_s = 0;        // since this run() started
  std::vector<double> peak_rss_mib;  // per rank
  std::vector<double> peak_gpu_mib;  // per rank; empty on the CPU
  // parallel.context > 1: each rank's StepRecord::context_attention_s and
  // context_wait_s; empty without context parallelism.
  std::vector<double> context_attention_s;
  std::vector<double> context_wait_s;
};

// Every rank's own record of its checkpoints,
// <run.dir>/checkpoint_events/rank<r>.jsonl, one JSON object per save: when
// each phase ran on this rank (wall clock) and how long it took, for
// scripts/plot-run's per-rank timeline. Created at the first event,
// appended to across restarts; a failed write warns once and stops it.
class RankEventLog {
 public:
  RankEventLog(std::string run_dir, int rank) : run_dir_(std::move(run_dir)), rank_(rank) {}
  void checkpoint(const checkpoint::CheckpointEvent& ev);

 private:
  std::string run_dir_;
  int rank_ = 0;
  std::ofstream out_;
  bool failed_ = false;
};

class MetricsLog {
 public:
  // Creates run.dir with the effective config (config.yaml) and opens
  // metrics.jsonl to append to, having read what earlier attempts wrote
  // there (earlier_attempts()); wall_s counts from `started` (the
  // process's run). Throws std::runtime_error naming the path.
  MetricsLog(const config::Config& cfg, std::chrono::steady_clock::time_point started);

  // An attempt before this one that did not finish (goodput.h), as
  // metrics.jsonl held it when this log opened.
  const EarlierAttempts& earlier_attempts() const { return earlier_; }

  void start(const RunStart& start);
  // "shardkit: startup 1.23 s (load 0.45, ...)" and the "startup" record.
  void startup(int64_t step, const StartupPhases& phases);
  // Damaged checkpoints resume set aside: a warning each on stderr.
  void resume_skipped(const std::vector<checkpoint::SkippedCheckpoint>& skipped);
  // The progress line and the step's record.
  void step(const StepRecord& rec, const StepProgress& progress);
  void eval(const EvalRecord& rec);
  // A finished save (`tiered`: with the tier fields).
  void checkpoint(const checkpoint::CheckpointEvent& ev, bool tiered);
  void checkpoint_skipped(int64_t step);
  // checkpoint.interval auto: a (re)derived interval at `step`, the next
  // save at `next_save`; a console line and the "checkpoint_interval" record.
  void checkpoint_interval(int64_t step, const IntervalChoice& choice, int64_t next_save);
  // A restart's cost and the goodput so far: a console line, the "restart"
  // record and TensorBoard's goodput/* at the step resumed from.
  void restart(const RestartLedger& ledger);
  void retention_failure(const checkpoint::RetentionFailure& failure);
  void profile(int64_t first_step, int64_t step, const std::string& backend, const std::string& dir);
  // profile.memory_snapshot: rank 0's snapshot of a window's end ("memory snapshot step N: PATH").
  void memory_snapshot(int64_t step, const std::string& path);
  void sample(int64_t step, const std::string& prompt, const std::string& text);
  void end(int64_t step, bool stopped_by_signal);

 private:
  void write(const nlohmann::json& record);

  const config::Config& cfg_;
  std::ofstream out_;
  std::unique_ptr<TensorBoardWriter> tb_;  // metrics.tensorboard; from start()
  std::chrono::steady_clock::time_point started_;
  EarlierAttempts earlier_;
};

}  // namespace framework::train
