#pragma once
// Checkpoint options (config section `checkpoint`). Torch-free.
#include <cstdint>
#include <stdexcept>
#include <string>

namespace checkpoint {

struct CompressionOptions {
  std::string codec = "none";      // none | zstd
  int level = 3;                   // zstd level, 1..19
  std::string byte_group = "auto"; // auto | on | off (auto: on for floats)
  int64_t block_size = 8 << 20;    // bytes per independently coded block
};

// checkpoint.mode, parsed once (manager.h describes the modes).
enum class SaveMode { kSync, kAsync, kOverlap };
// checkpoint.when_busy: what a due save does while the previous one is still
// in flight.
enum class WhenBusy { kWait, kSkip };

// "sync" | "async" | "overlap"; throws std::invalid_argument naming the value.
SaveMode parse_save_mode(const std::string& mode);
// "wait" | "skip"; throws std::invalid_argument naming the value.
WhenBusy parse_when_busy(const std::string& when_busy);

// checkpoint.local: the node-local tier (docs/checkpoints.md, "Multi-level checkpoints").
struct LocalTierOptions {
  // Empty: one tier (checkpoint.dir). Else each node's local directory
  // (/dev/shm/..., local NVMe); "{node}" is replaced by the node's index,
  // which simulated nodes on one machine need.
  std::string dir = "";
  int64_t keep_last = 2;  // per node: the newest N committed; 0: keep all
  bool partner = true;    // copy each rank's file to a rank on the next node (L2)
};

// checkpoint.durable: the durable tier (checkpoint.dir) under a local tier.
struct DurableTierOptions {
  // Flush the local checkpoints of steps that are multiples of k x interval,
  // and the final one; 1: all.
  int64_t every = 1;
};

struct CheckpointOptions {
  std::string dir = "";        // empty: <run.dir>/checkpoints
  int64_t interval = 0;        // save every N steps (and at the last); 0: off
  std::string mode = "sync";   // sync | async | overlap
  int64_t keep_last = 0;       // keep the newest N committed; 0: keep all
  std::string resume = "auto"; // auto | never | <path to a checkpoint>
  // resume auto: a committed checkpoint that fails to load (damaged) is set
  // aside and the next older one is tried; false: fail instead.
  bool resume_fallback = true;
  // Resume a checkpoint saved under another model, data, seed or batch
  // configuration (the trainer refuses by default, naming the keys).
  bool allow_config_change = false;
  std::string on_error = "fail";     // fail | warn
  bool save_on_signal = true;        // SIGTERM triggers a final save
  std::string when_busy = "wait";    // wait | skip (a save still in flight)
  bool allow_partial = false;        // load: tolerate missing/unexpected items
  bool model_only = false;           // load: model weights only
  int io_threads = 4;
  // Save-plan caching (save.h, SavePlanCache): later saves of an unchanged
  // structure skip the plan exchange; proven by one small all-reduce.
  bool plan_cache = true;
  // Large data-file writes bypass the page cache (O_DIRECT; storage.h,
  // PosixOptions). Used by whoever builds the POSIX storage (the trainer).
  bool direct_io = false;
  // Overlap mode with state on a GPU: snapshot the state into device memory
  // (as much again as the state, held for the run) so the optimizer never
  // waits for the device-to-host copy. auto: when the device has that much
  // free beyond a 2 GiB margin at the first save | on | off.
  std::string device_snapshot = "auto";
  CompressionOptions compression;
  LocalTierOptions local;
  DurableTierOptions durable;
};

inline SaveMode parse_save_mode(const std::string& mode) {
  if (mode == "sync") return SaveMode::kSync;
  if (mode == "async") return SaveMode::kAsync;
  if (mode == "overlap") return SaveMode::kOverlap;
  throw std::invalid_argument("checkpoint.mode '" + mode + "' is not one of sync, async, overlap");
}

inline WhenBusy parse_when_busy(const std::string& when_busy) {
  if (when_busy == "wait") return WhenBusy::kWait;
  if (when_busy == "skip") return WhenBusy::kSkip;
  throw std::invalid_argument("checkpoint.when_busy '" + when_busy + "' is not one of wait, skip");
}

}  // namespace checkpoint
