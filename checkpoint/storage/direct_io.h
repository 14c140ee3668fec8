#pragma once
// Whether POSIX checkpoint writes bypass the page cache (O_DIRECT):
// checkpoint.direct_io, PosixOptions::direct_io. auto measures it: one probe
// per file system and process writes the same bytes both ways and the faster
// one is used (posix.cpp asks at a file's first large write; the trainer asks
// at start, to say in its banner what it chose). Torch-free.
//
// Why measure: which way is faster depends on the machine. Page-cache writes
// cost a copy into the cache and the kernel's write-back, both on CPU time
// the job shares; O_DIRECT writes go from the caller's memory to the device,
// but wait for it on every write. docs/benchmarks.md has the numbers.
#include <cstdint>
#include <string>

#include "checkpoint/options.h"  // DirectIo, parse_direct_io

namespace checkpoint {

// What a probe of one directory's file system found.
struct DirectIoProbe {
  std::string dir;           // where the probe file was written
  bool accepted = false;     // O_DIRECT opened and wrote (false also when the probe failed)
  bool failed = false;       // an I/O error stopped the probe; `detail` names it
  uint64_t bytes = 0;        // written per trial, each way
  double buffered_s = 0;     // fastest page-cache write + fsync
  double direct_s = 0;       // fastest O_DIRECT write + fsync; 0 when not accepted
  bool use_direct = false;   // prefer_direct(*this)
  std::string detail;        // one line for a log: what was measured and chosen, or why not
};

// The choice from the timings: O_DIRECT only where it was accepted and
// strictly faster (a tie keeps the page cache, the old default). Pure.
bool prefer_direct(const DirectIoProbe& probe);

// Writes `bytes` (rounded up to whole 1 MiB pieces) into a scratch file in
// the existing directory `dir`, `trials` times each way, page cache and
// O_DIRECT interleaved, each followed by fsync, then deletes it. Never throws
// for I/O: an error (no such directory, no space) gives failed = true and
// use_direct = false, with the error in `detail`.
DirectIoProbe probe_direct_io(const std::string& dir, uint64_t bytes = uint64_t{64} << 20, int trials = 2);

// probe_direct_io(dir) for the file system `dir` is on (a missing `dir`: its
// nearest existing ancestor's), once per process: later calls for the same
// file system (device number) return the first result. Thread-safe;
// concurrent first calls wait for one probe.
DirectIoProbe cached_direct_io_probe(const std::string& dir);

// Whether writes into `dir` should try O_DIRECT under `mode`: kOn yes, kOff
// no, kAuto cached_direct_io_probe(dir).use_direct.
bool use_direct_io(DirectIo mode, const std::string& dir);

}  // namespace checkpoint
