#pragma once
// Periodic checkpoints for a training loop: when to save, sync / async /
// overlap saving, retention, and which checkpoint to resume from.
//
// Modes (checkpoint.mode):
//   sync    save() writes and commits before returning. Retention (deleting
//           older checkpoints, which takes a second or more per few GiB on
//           some file systems) runs on its own thread after the commit; the
//           next save() and finish() wait for it.
//   async   save() copies the state into host buffers that are allocated once
//           and reused (the only part the loop waits for), then a background
//           thread plans, writes and commits over the checkpoint group.
//   overlap save() only hands the state to the background thread, which
//           stages it while the loop runs the next forward and backward; the
//           loop calls wait_staged() before it changes the state (before the
//           optimizer step).
// State on a GPU is staged into one pinned host slab on a dedicated copy
// stream (checkpoint/async/staging.h): async waits only for that copy. Overlap
// (checkpoint.device_snapshot) first copies the state into a reused device
// buffer on the compute stream when that fits, and the loop goes on at once;
// the background thread copies it to the host in chunks, so the step's own
// small device-to-host reads never wait behind the whole state. Without a
// snapshot the chunks are read from the live state and wait_staged() waits
// for the last one. Loading into GPU state goes through the same
// pinned buffers, host to device.
// At most one save is in flight; save() first waits for the previous one.
// A background failure is rethrown by the next save(), wait_staged() or
// finish() as a CheckpointError naming the step. Retention that fails after
// a commit is not a failed save, in any mode: the save stands, and the
// failure is reported apart (take_retention_failures).
//
// Tiers (checkpoint.local.dir set; docs/checkpoints.md, "Multi-level checkpoints",
// tiers/local_tier.h; the protocol is tiers/protocol.h): a save commits to
// every node's local tier first (what sync mode waits for), then the
// background thread copies each rank's file to its partner rank on the next
// node (L2) and, every durable.every-th save
// and for a final one, flushes the committed local files to checkpoint.dir
// and commits them there. Resume (auto) takes the newest checkpoint some
// tier holds complete, preferring the local tier, and says which and why.
//
// Thread safety: all public methods from the training thread. The checkpoint
// group is used only by this manager: by the calling thread in resume(),
// load() and a sync save's write, by the background thread while a save is
// in flight (save() and finish() wait for that save first; REQUIRES: no save
// in flight when resume() or load() is called).
#include "checkpoint/event.h"
#include "checkpoint/load.h"
#include "checkpoint/options.h"
#include "checkpoint/save.h"
#include "checkpoint/async/staging.h"
#include "checkpoint/state_dict.h"
#include "checkpoint/tiers/local_tier.h"

#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace checkpoint {

class TierProtocol;  // tiers/protocol.h

// What a caller may plug into the manager. (Test-only save points, e.g. the
// reliability tests' hung peer, are set through checkpoint/save_seam.h,
// which is not installed.)
struct ManagerHooks {
  // Entries a resume may find missing from a checkpoint (LoadOptions::optional),
  // e.g. what an imported checkpoint cannot carry. Null: none.
  std::function<bool(const std::string& name)> optional_items;
};

// Where this rank sits, for the local tier.
struct TierPlacement {
  int node = 0;  // this rank's node (LaunchEnv::node)
  // Storage for the local tier; null: the manager's storage.
  std::shared_ptr<Storage> local_storage;
};

// A committed checkpoint that resume could not load, and why. It was renamed
// to `moved_to` (out of the step_<N> names: never listed, loaded or deleted
// by retention again; nothing is deleted).
struct SkippedCheckpoint {
  std::string path;
  std::string moved_to;
  std::string error;
};

// What CheckpointManager::save_if_due did after a step.
struct DueSave {
  bool started = false;   // save() was called for the step
  bool skipped = false;   // due, but a save was still in flight (when_busy: skip)
  double blocking_s = 0;  // how long the save held the caller
  // checkpoint.on_error warn: the failure that did not stop training ("" none).
  std::string warning;
};

struct ResumeResult {
  std::string path;  // the checkpoint loaded (local tier: this rank's node's copy)
  std::string tier = "durable";  // local | durable
  std::string reason;            // tiers: why this tier ("" without a local tier)
  std::vector<std::string> notes;  // tiers: why newer local checkpoints were not usable
  LoadStats stats;
  std::vector<SkippedCheckpoint> skipped;  // newer ones that failed to load, newest first
};

class CheckpointManager {
 public:
  // `default_dir` is used when options.dir is empty. `layout` is recorded in
  // the metadata. Every byte (saves, loads, discovery, retention) goes
  // through `storage`. REQUIRES: `group` outlives the manager.
  CheckpointManager(CheckpointOptions options, std::string default_dir,
                    comm::Group& group, std::string layout,
                    std::shared_ptr<Storage> storage = posix_storage(), ManagerHooks hooks = {});
  // Waits for an in-flight save; swallows its error (call finish() first).
  ~CheckpointManager();

  const std::string& dir() const { return dir_; }
  const CheckpointOptions& options() const { return options_; }
  bool enabled() const { return options_.interval > 0; }
  // interval > 0 and (step is a multiple of it, or step == last_step); after
  // set_interval, (step - from_step) a multiple of it instead.
  bool due(int64_t step, int64_t last_step) const;
  // (all ranks, the same values) Saves every `interval` steps counted from
  // `from_step` from now on (checkpoint.interval auto re-derives it after
  // each save). REQUIRES: interval > 0. With tiers, durable.every then
  // counts saves rather than multiples of the interval.
  void set_interval(int64_t interval, int64_t from_step);
  // True while a save is in flight on this rank.
  bool busy() const;
  // Whether saves stage into host buffers (async and overlap modes, or
  // state on a device): reserve_staging() then saves the first save's wait.
  bool stages(bool state_on_device) const;

  // (all ranks) The checkpoint policy a training loop runs after each step:
  // saves `state()` when due (every interval steps and at last_step) or on a
  // stop (stop_requested, with save_on_signal); a final save (last_step, a
  // stop) is flushed to every tier. With when_busy skip a due save is
  // skipped while one is still in flight anywhere (`busy_anywhere`: the
  // ranks' agreed flag, so all skip together), but never a final one. A
  // failed save throws with on_error fail; with warn its message is
  // returned in DueSave::warning and, in async modes, this step's save is
  // started after all.
  DueSave save_if_due(int64_t step, int64_t last_step, bool stop_requested, bool busy_anywhere,
                      const std::function<StateDict()>& state);
  // finish(), but with on_error warn a failure is returned ("" none)
  // instead of thrown.
  std::string finish_or_warn();

  // (all ranks) Resolves checkpoint.resume and loads it into `state`.
  // nullopt: nothing to resume (start fresh). With resume "auto" and
  // resume_fallback, a committed checkpoint that fails to load on any rank
  // (damaged metadata or data, a checksum mismatch, a truncated file) is
  // renamed to <step dir>.damaged and reported in `skipped`, and the next
  // older committed one is tried; when every one fails, throws
  // CheckpointError listing them. Otherwise a failure throws as load() does.
  // A skipped checkpoint may have filled part of `state`: the one loaded
  // after it overwrites every item it has (all of them, unless
  // allow_partial or model_only).
  std::optional<ResumeResult> resume(StateDict& state);
  // (all ranks) Loads `state` from `path`; if any rank fails, every rank
  // throws a CheckpointError naming the failing ranks and causes.
  LoadStats load(StateDict& state, const std::string& path);

  // (all ranks) Starts the save of `state` at `step` (see the modes above).
  // The tensors of `state` must stay valid and unchanged until save() returns
  // (sync, async) or until wait_staged() returns (overlap).
  // `final`: the run's last save (last step, or on a signal); with tiers it
  // is flushed to the durable tier whatever durable.every says.
  void save(int64_t step, StateDict state, bool final = false);
  // Tiers: this rank's node and local storage. Call before the first save or
  // resume (default: node 0, the manager's storage).
  void set_placement(TierPlacement placement);
  bool tiered() const { return !options_.local.dir.empty(); }
  // This rank's node's local tier directory ("" without tiers).
  const std::string& local_dir() const { return local_dir_; }
  // Overlap mode: blocks until the last save's staging finished. No-op otherwise.
  void wait_staged();
  // Waits for the in-flight save (and sync mode's retention) and rethrows
  // its failure. A failed retention is not a failed save: see
  // take_retention_failures.
  void finish();
  // Finished saves not yet taken, oldest first.
  std::vector<CheckpointEvent> take_events();
  // Retention that failed on this rank after a save committed (rank 0's
  // durable tier; a node leader's local tier), not yet taken, oldest first.
  // Such a save stands and is reported ok by take_events; what was not
  // deleted stays on disk until a later retention deletes it.
  std::vector<RetentionFailure> take_retention_failures();

  // Allocates the host staging buffers for `state` now (pinned for GPU
  // state), so that the first save does not pay for the allocation while
  // the training loop waits. Optional; save() allocates them otherwise.
  void reserve_staging(const StateDict& state);
  // Staging memory held for reuse across saves (bytes), and whether it is
  // page-locked.
  uint64_t staging_bytes() const;
  // Device memory held for overlap's device snapshots (bytes).
  uint64_t snapshot_bytes() const { return staging_.device_bytes(); }
  bool staging_pinned() const;

 private:
  struct Job;
  // Saving.
  SaveOptions save_options(std::shared_ptr<Storage> storage) const;
  void stage_in_background(Job& job);
  // Overlap on a GPU: checkpoint.device_snapshot (auto: when it fits).
  bool use_device_snapshot(const StateDict& state) const;
  void persist(std::shared_ptr<Job> job);
  void write_durable(Job& job);
  void retain_durable(int64_t step);
  void commit_local(Job& job);
  void persist_tiered(Job& job);
  std::shared_ptr<Job> start_job(int64_t step, bool final, std::chrono::steady_clock::time_point t0);
  void save_sync(std::shared_ptr<Job> job, StateDict state, bool on_device);
  void save_tiered_sync(std::shared_ptr<Job> job);
  void record_failure(Job& job);
  void wait_in_flight();
  // Sync mode: waits for the background retention.
  void wait_retention();
  void record_retention_failures(std::vector<RetentionFailure> failures);
  // Resuming.
  std::vector<ResumeCandidate> resume_candidates(std::vector<std::string>& notes);
  std::vector<std::string> durable_candidates();
  LoadStats load_candidate(StateDict& state, const ResumeCandidate& candidate, std::string& path);
  LoadStats load_from(StateDict& state, const std::string& path, const std::shared_ptr<Storage>& storage);
  std::string set_aside(const std::string& path);

  CheckpointOptions options_;
  std::string dir_;
  comm::Group& group_;
  std::string layout_;
  std::shared_ptr<SavePlanCache> plan_cache_;  // null: checkpoint.plan_cache false
  std::thread worker_;
  std::shared_ptr<Job> in_flight_;
  std::thread retention_;        // sync mode: retention after the last commit
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<CheckpointEvent> events_;
  std::vector<RetentionFailure> retention_failures_;  // guarded by mu_
  // Host buffers reused across saves. The training thread stages into it;
  // the worker only waits on it and reads the staged copy (overlap on CPU:
  // the worker stages, while the training thread waits in wait_staged()).
  HostStaging staging_;
  std::shared_ptr<Storage> storage_;
  ManagerHooks hooks_;
  // Tiers.
  TierPlacement placement_;
  std::string local_dir_;
  std::shared_ptr<Storage> local_storage_;
  std::unique_ptr<TierProtocol> tiers_;  // null without tiers
  int64_t local_saves_ = 0;
  std::optional<int64_t> interval_from_;  // set_interval's from_step
};

}  // namespace checkpoint
