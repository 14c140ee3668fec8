#pragma once
// CheckpointEvent: one finished save, as the checkpoint manager
// (async/manager.h) reports it and rank 0 logs it. Its own header because
// the tiers' protocol (tiers/protocol.h) fills the tier fields of the
// manager's event while a save goes through the tiers.
#include <cstdint>
#include <string>

namespace checkpoint {

// One finished save, as rank 0 logs it.
struct CheckpointEvent {
  int64_t step = 0;
  std::string mode;
  std::string path;
  double blocking_s = 0;  // time the training loop was held
  double stage_s = 0;     // copy into host buffers (0 in sync mode)
  // Overlap of GPU state: "device snapshot" or "chunked" (from the live
  // state); "" otherwise.
  std::string staging;
  double write_s = 0;     // planning + writing + fsync, all ranks
  // This rank's wall clock (Unix seconds) when save() was called, and when
  // its planning and writing began (0: it did not): with the durations
  // above, when each phase ran (scripts/plot-run's timeline).
  double started_unix_s = 0;
  double write_started_unix_s = 0;
  double commit_s = 0;
  double plan_s = 0;       // part of write_s: planning, or the cached plan's agreement
  bool plan_cached = false;  // the save reused the previous save's plan
  // Tiers (checkpoint.local.dir set); otherwise tier is "durable" and the
  // rest stays empty or 0.
  std::string tier = "durable";  // where it is committed: durable | local | local+durable
  std::string local_path;        // rank 0's node's local step directory
  double local_commit_s = 0;     // from save() to the local commit on every node
  std::string partner = "off";   // ok | off | skipped: <why> | failed: <why>
  bool flushed = false;          // committed in the durable tier too
  double flush_s = 0;            // copying to the durable tier and committing there
  double exposure_s = 0;         // local commit to durable commit (flushed only)
  uint64_t bytes = 0;          // logical bytes, all ranks
  uint64_t stored_bytes = 0;   // on disk, all ranks
  bool ok = true;
  std::string error;
};

// Retention that failed after the checkpoint of `step` committed: that
// checkpoint is saved and loadable; older checkpoints beyond keep_last (in
// `tier`: durable or local) may still be on disk. Never a failed save.
struct RetentionFailure {
  int64_t step = 0;
  std::string tier = "durable";  // durable | local
  std::string error;             // names the path and strerror
};

}  // namespace checkpoint
