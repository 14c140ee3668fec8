#pragma once
// The checkpoint.dir layout: discovery of saved steps, the latest committed
// one, retention and resume resolution, all through a Storage (so they run on
// POSIX, in memory, or behind a test wrapper alike). Torch-free.
//
// Layout (FORMAT.md, "Directory layout"):
//   <checkpoint.dir>/step_<N>/   N decimal, no sign, no leading zeros ("step_0")
//     .metadata                  present iff the checkpoint is committed
// Nothing else in checkpoint.dir is a checkpoint. Names are never trusted:
// "step_x", "step_-1", "step_01", a step overflowing int64, a regular file or
// a symlink named step_5 are all ignored.
//
// Thread safety: the functions are stateless; they observe the filesystem
// once and tolerate entries that appear or vanish meanwhile (a save may be
// writing a step directory while they run).
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/storage/storage.h"

namespace checkpoint {

struct CheckpointEntry {
  int64_t step = 0;
  std::string path;          // <checkpoint.dir>/step_<N>
  bool committed = false;    // .metadata is present (a regular file)
  uint64_t bytes = 0;        // sum of the regular files inside (not following symlinks)
  int64_t mtime_unix_s = 0;  // of the step directory; for a committed one ~ the commit
};

// "step_<N>". REQUIRES: step >= 0.
std::string step_dir_name(int64_t step);

// The step of a canonical step directory name, else nullopt (wrong prefix,
// sign, leading zeros, non-digits, empty or overflowing number).
std::optional<int64_t> parse_step_dir_name(const std::string& name);

// Every step directory in `checkpoint_dir`, committed or not, sorted by step.
// A missing `checkpoint_dir` gives an empty list; one that exists but cannot
// be read (or is not a directory) throws std::runtime_error naming it.
std::vector<CheckpointEntry> list_checkpoints(Storage& storage, const std::string& checkpoint_dir);

// The committed entry with the highest step, or nullopt.
std::optional<CheckpointEntry> latest_committed(Storage& storage, const std::string& checkpoint_dir);

// The committed checkpoints to delete so that only the newest `keep_last`
// committed remain (keep_last 0: keep all, nothing is a victim). Never returns
// the newest committed one, never an uncommitted one (it may be being
// written), never the step `protect` (e.g. one being saved or loaded). Pure:
// `entries` need not be sorted; the result is sorted by step. Throws
// std::invalid_argument for keep_last < 0.
std::vector<CheckpointEntry> retention_victims(const std::vector<CheckpointEntry>& entries,
                                               int64_t keep_last,
                                               std::optional<int64_t> protect = std::nullopt);

// (coordinator only) Deletes the retention victims of `checkpoint_dir`. Each
// victim is first renamed out of the step_<N> namespace (atomically
// un-committing it), then removed, so a crash mid-delete never leaves a
// committed but partial checkpoint; leftovers of such a crash are swept by
// the next call. Victims that vanished meanwhile are ignored; other failures
// are attempted for every victim, then thrown together (std::runtime_error
// naming the paths).
void apply_retention(Storage& storage, const std::string& checkpoint_dir, int64_t keep_last,
                     std::optional<int64_t> protect = std::nullopt);

// Resolves checkpoint.resume:
//   "auto"  -> the latest committed checkpoint's path, or nullopt if none
//   "never" -> nullopt
//   a path  -> that path, which must be a committed checkpoint directory;
//              otherwise std::runtime_error naming the path and why (missing,
//              not a directory, not committed (no .metadata)).
std::optional<std::string> resolve_resume(Storage& storage, const std::string& resume,
                                          const std::string& checkpoint_dir);

}  // namespace checkpoint
