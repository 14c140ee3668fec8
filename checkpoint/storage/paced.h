#pragma once
// A storage device of a given bandwidth, emulated over `inner`: every read
// and every write is booked on one shared timeline at `mb_per_s` (1e6 B/s);
// a read returns when the device would have delivered it, writes are
// buffered (like the page cache) and sync() returns when the device would
// have written everything booked so far. Models a network file system or a
// cloud volume on a machine whose own disk is as fast as its memory. Used by ckpt_bench to emulate a slow
// shared file system (e.g. 250 MB/s) on a fast local disk; labelled as an
// emulation wherever its figures appear.
#include "checkpoint/storage/storage.h"

#include <memory>

namespace checkpoint {

// REQUIRES: mb_per_s > 0 (10^6 bytes per second), else std::invalid_argument.
std::shared_ptr<Storage> paced_storage(std::shared_ptr<Storage> inner, double mb_per_s);

}  // namespace checkpoint
