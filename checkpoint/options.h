#pragma once
// Checkpoint options (config section `checkpoint`). Torch-free.
#include <cstdint>
#include <string>

namespace checkpoint {

struct CompressionOptions {
  std::string codec = "none";      // none | zstd
  int level = 3;                   // zstd level, 1..19
  std::string byte_group = "auto"; // auto | on | off (auto: on for floats)
  int64_t block_size = 8 << 20;    // bytes per independently coded block
};

struct CheckpointOptions {
  std::string dir = "";        // empty: <run.dir>/checkpoints
  int64_t interval = 0;        // save every N steps (and at the last); 0: off
  std::string mode = "sync";   // sync | async | overlap
  int64_t keep_last = 0;       // keep the newest N committed; 0: keep all
  std::string resume = "auto"; // auto | never | <path to a checkpoint>
  std::string on_error = "fail";     // fail | warn
  bool save_on_signal = true;        // SIGTERM triggers a final save
  std::string when_busy = "wait";    // wait | skip (a save still in flight)
  bool allow_partial = false;        // load: tolerate missing/unexpected items
  bool model_only = false;           // load: model weights only
  int io_threads = 4;
  CompressionOptions compression;
};

}  // namespace checkpoint
