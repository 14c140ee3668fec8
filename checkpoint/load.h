#pragma once
// Loading a checkpoint into this rank's state: no communication. Every rank
// reads the metadata, and for each box it holds now reads only the saved byte
// ranges (blocks) that overlap it -- resharding to any world size and layout.
#include "checkpoint/errors.h"  // CheckpointError
#include "checkpoint/state_dict.h"
#include "checkpoint/storage/storage.h"

#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace checkpoint {

struct LoadOptions {
  // Strict by default: an item of `state` missing from the checkpoint, or an
  // item of the checkpoint that `state` lacks, is an error listing both.
  bool allow_partial = false;
  // Only checkpoint items for which this returns true are considered (e.g.
  // model-only loading); null: all.
  std::function<bool(const std::string&)> filter;
  // State entries for which this returns true may be missing from the
  // checkpoint even when strict: they keep their values and are listed in
  // LoadStats::missing. Null: none.
  std::function<bool(const std::string&)> optional;
  int io_threads = 4;
  std::shared_ptr<Storage> storage;  // null: the POSIX file system
};

struct LoadStats {
  uint64_t bytes_read = 0;           // logical bytes copied into the state
  uint64_t metadata_bytes_read = 0;  // of .metadata: the head and this rank's records
  int64_t step = 0;                  // from the metadata
  int32_t saved_world_size = 0;
  std::string saved_layout;
  std::vector<std::string> missing;     // tolerated with allow_partial
  std::vector<std::string> unexpected;  // tolerated with allow_partial
};

// (any rank or process; no communication) Fills every entry of `state` from
// the committed checkpoint in `step_dir`, verifying checksums. Tensors are
// written in place, so the caller's tensors (which the StateDict shares) hold
// the result. Throws CheckpointError/FormatError/ChecksumError/IoError
// naming the checkpoint, the item and the file; the state is then partly
// overwritten and must not be used.
// REQUIRES: every tensor entry's `local` is contiguous, with the saved dtype
// and global shape (else CheckpointError / c10::Error naming the item).
// Thread safety: loads into different states may run concurrently; nothing
// else may use `state` meanwhile.
LoadStats load_state_dict(StateDict& state, const std::string& step_dir, const LoadOptions& options);

// The data file names a load_state_dict of `state` with `options` (its
// filter) reads from the checkpoint whose encoded .metadata is `metadata`:
// the files of the chunks overlapping this rank's boxes. Sorted, each once.
// Items the checkpoint lacks, or of another kind, are left out (the load
// reports them). Throws FormatError for damaged metadata.
std::vector<std::string> files_needed(const StateDict& state, const std::vector<uint8_t>& metadata,
                                      const LoadOptions& options);

}  // namespace checkpoint
