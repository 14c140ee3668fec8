#pragma once
// A Storage held in process memory: files and directories in a map, for
// tests (the planner, save/load, retention and resume suites run on it as
// well as on POSIX), the fuzz targets, and tools that want no disk.
//
// It follows POSIX where the checkpoint code depends on it: create_file needs
// an existing parent directory; rename replaces a file or an empty directory
// atomically and moves a directory with everything under it; a path that is
// a directory cannot be opened as a file. Writes are visible at once (like
// the page cache); sync and sync_dir only check that their target exists.
// Paths are compared as strings: callers build them with join_path.
//
// Thread safety: every call takes one mutex, so concurrent writes to
// disjoint ranges of one file are safe (and serialized).
#include "checkpoint/storage/storage.h"

#include <memory>

namespace checkpoint {

// A new, empty memory storage. Its root ("/" and ".", and any path with no
// directory part) always exists.
std::shared_ptr<Storage> memory_storage();

}  // namespace checkpoint
