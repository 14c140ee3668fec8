#pragma once
// The checkpoint.dir layout: discovery of saved steps, the latest committed
// one, retention and resume resolution, all through a Storage (so they run on
// POSIX, in memory, or behind a test wrapper alike). Torch-free.
//
// Layout (FORMAT.md, "Directory layout"):
//   <checkpoint.dir>/step_<N>/   N decimal, no sign, no leading zeros ("step_0")
//     .metadata                  present iff the checkpoint is committed
//   <checkpoint.dir>/step_<N>.damaged[.<K>]/
//                                set aside by resume (CheckpointManager) after
//                                it failed to load; never loaded or deleted
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

// The suffix resume appends to a step directory that failed to load
// ("step_6.damaged"; "step_6.damaged.1", ... when that name is taken).
constexpr const char* kSetAsideSuffix = ".damaged";

struct CheckpointEntry {
  int64_t step = 0;
  std::string path;          // <checkpoint.dir>/step_<N>
  // .metadata is present (a regular file): the commit marker, not a promise
  // that it decodes. Discovery, retention and resume go by this alone (resume
  // finds out about damage by loading); checkpoint_status reads the file.
  bool committed = false;
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

// The committed entry with the highest step, or nullopt. Committed means
// CheckpointEntry::committed: a damaged .metadata still counts (loading it
// fails and names the file; resume with fallback sets it aside).
std::optional<CheckpointEntry> latest_committed(Storage& storage, const std::string& checkpoint_dir);

// What a step directory is, judged by reading its metadata.
enum class CheckpointStatus {
  kCommitted,    // .metadata present, and read_committed_metadata accepts it
  kDamaged,      // .metadata present, but it cannot be read, decoded or validated
  kUncommitted,  // no .metadata: a save still running, or one that never finished
  kSetAside,     // step_<N>.damaged[.<K>]: set aside by resume; not read
};

// "committed", "damaged", "uncommitted", "set-aside".
const char* checkpoint_status_name(CheckpointStatus status);

struct CheckpointStatusEntry {
  CheckpointEntry entry;  // for kSetAside: the step of its name, its own path
  CheckpointStatus status = CheckpointStatus::kUncommitted;
  std::string error;      // kDamaged: why, naming the file; otherwise empty
};

// The step of a set-aside directory name, "step_<N>.damaged" or
// "step_<N>.damaged.<K>" (N canonical as for step directories, K a positive
// number without leading zeros), else nullopt.
std::optional<int64_t> parse_set_aside_dir_name(const std::string& name);

// The status of a step directory listed by list_checkpoints: committed only if
// its metadata reads and validates (read_committed_metadata: size limit,
// decoding, checksums, semantic checks). Checks no data file (that is
// verify_checkpoint's job). Reads the whole .metadata, so it costs what
// opening the checkpoint costs. A .metadata that vanishes meanwhile makes the
// entry kUncommitted.
CheckpointStatusEntry checkpoint_status(Storage& storage, const CheckpointEntry& entry);

// Every step directory of `checkpoint_dir` with its checkpoint_status, plus
// the set-aside directories, sorted by step; for one step, the step directory
// comes before its set-aside ones. Entries that vanish meanwhile are left
// out. Errors as list_checkpoints. For tools (ckpt list); the trainer does
// not call it.
std::vector<CheckpointStatusEntry> list_checkpoints_with_status(Storage& storage,
                                                                const std::string& checkpoint_dir);

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

// (coordinator only) Removes the step directory `path` the way retention
// removes a victim: renamed to .deleting.step_<N> in its parent, which is
// fsynced, then deleted, so that no crash or power loss leaves it committed
// but partial. For a save that failed after its commit may have reached the
// disk. False, with `error` set, when a step failed (a .deleting. leftover
// is swept by the next apply_retention); a missing `path` is fine.
bool remove_step_dir(Storage& storage, const std::string& path, std::string* error);

// Resolves checkpoint.resume:
//   "auto"  -> the latest committed checkpoint's path, or nullopt if none
//   "never" -> nullopt
//   a path  -> that path, which must be a committed checkpoint directory;
//              otherwise std::runtime_error naming the path and why (missing,
//              not a directory, not committed (no .metadata)).
std::optional<std::string> resolve_resume(Storage& storage, const std::string& resume,
                                          const std::string& checkpoint_dir);

}  // namespace checkpoint
