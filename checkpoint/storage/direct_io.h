#pragma once
// Whether POSIX checkpoint writes bypass the page cache (O_DIRECT):
// checkpoint.direct_io, PosixOptions::direct_io. auto measures it, twice:
//  - first a probe, once per file system and process, writes the same bytes
//    both ways and the faster is used (posix.cpp asks at a file's first
//    large write; the trainer asks at start, to say in its banner);
//  - then the checkpoint files themselves: each file of auto of at least
//    PosixOptions::learn_min_bytes is timed: bytes over the wall time during
//    which one of its writes or its fsync was under way (the gaps between
//    writes, where the caller hashes or stages, are not the way's). Once
//    one way has such a file, the next large file tries the other way,
//    once; from then on each file goes the way whose latest file wrote
//    faster. A small probe does not predict a save-sized write
//    (bench/direct_io_probe_check.py: on this project's VM the page cache
//    wins at 64 MiB and loses at 1 GiB); the saves' own writes do.
// Torch-free.
//
// Why measure: which way is faster depends on the machine. Page-cache writes
// cost a copy into the cache and the kernel's write-back, both on CPU time
// the job shares; O_DIRECT writes go from the caller's memory to the device,
// but wait for it on every write. docs/benchmarks.md has the numbers.
#include <cstdint>
#include <optional>
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
  int refused_errno = 0;     // why O_DIRECT was refused (accepted false, failed false)
  std::string detail;        // one line for a log: what was measured and chosen, or why not
  // Not measured by this process but read back from the file that
  // remember_direct_io_probes_in names (an earlier process of the run, say
  // a rank before a restart, measured it); `detail` then says so.
  std::string reused_from;
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
// concurrent first calls wait for one probe. With a file to remember probes
// in (remember_direct_io_probes_in), a file system this process has not
// probed is first looked up there, and a new probe is added to it. With
// SHARDKIT_DIRECT_IO_PROBES=<file> in the environment (read once), that
// file is looked up next (any earlier process of this boot, of any run;
// `detail` says so) and a new probe is added to it too: a machine's many
// short jobs (a test suite) probe each file system once.
DirectIoProbe cached_direct_io_probe(const std::string& dir);

// Remembering probes beyond one process (a restarted rank must not write
// 64 MiB each way again). The file is text, one line per machine boot and
// file system, each
//   "direct_io_probe/1 <boot id> <device> <accepted 0|1> <bytes> <buffered_s>
//    <direct_s> <errno>"
// (one line; <boot id> from /proc/sys/kernel/random/boot_id, so a device
// number is never read on another machine or after a reboot, where it may
// name another file system; <errno> is why O_DIRECT was refused, else 0).
// Only probes that did not fail are remembered. A line that does not parse,
// or a file that cannot be read, counts as no line: the file system is
// probed again; nothing here ever throws or fails a run.

// From now on, cached_direct_io_probe (and everything that asks it) in this
// process reads and adds to `path`; "" (the default) remembers nothing.
// Thread-safe.
void remember_direct_io_probes_in(const std::string& path);

// The probe of file system `device` that `path` remembers for this boot,
// with reused_from = path; nullopt when there is none (or no readable,
// well-formed line for it).
std::optional<DirectIoProbe> read_remembered_probe(const std::string& path, uint64_t device);

// Writes `probe` as the line of `device` (for this boot) into `path`,
// keeping the other lines that parse: a new file next to it, renamed over
// it (a concurrent writer's line may be lost, never half-written). Makes
// the missing directories of `path`. False when it could not (or when
// `probe` failed, or this boot's id is unreadable); never throws.
bool write_remembered_probe(const std::string& path, uint64_t device, const DirectIoProbe& probe);

// What auto has measured of its own checkpoint files on one file system:
// the latest file of at least learn_min_bytes written each way: its bytes
// over the wall time during which one of its writes or its fsync was under
// way.
struct DirectIoLearned {
  double direct_bytes_per_s = 0;    // 0: no such file yet
  double buffered_bytes_per_s = 0;  // 0: no such file yet
  uint64_t direct_files = 0;        // files measured each way, in all
  uint64_t buffered_files = 0;
  // The slower way is measured again once retry_after files have been
  // measured since its latest one (a disk's or a page cache's speed
  // changes: one slow sample must not decide for ever). The interval starts
  // at kFirstRetryAfter, doubles up to kMaxRetryAfter each time a retry
  // finds that way still slower, and starts again when a retry wins.
  static constexpr uint64_t kFirstRetryAfter = 16;
  static constexpr uint64_t kMaxRetryAfter = 256;
  uint64_t direct_latest = 0;  // ordinal (1-based, over both ways) of each way's latest file
  uint64_t buffered_latest = 0;
  uint64_t retry_after = kFirstRetryAfter;
  uint64_t retries = 0;  // retries of the slower way so far
};

// auto's choice for the next large file, from the probe and the files
// measured so far. Pure:
//  - O_DIRECT refused, or the probe failed: the page cache;
//  - no file measured yet: the probe's choice;
//  - only one way measured: the other, to measure it;
//  - both: the way whose latest file wrote faster (a tie: the page cache),
//    unless retry_after files have been measured since the slower way's
//    latest: then the slower way, to measure it again.
bool choose_direct(const DirectIoProbe& probe, const DirectIoLearned& learned);

// Adds one file written `direct` or not at `bytes_per_s` to `learned`,
// moving its retry interval (above) where this file is the first of a retry.
// Pure.
void learn_auto_write(DirectIoLearned& learned, bool direct, double bytes_per_s);

// Records one file of auto written into `dir`: `bytes` in `seconds` of its
// I/O time (above), all of it the way `direct` says. Thread-safe.
void record_auto_write(const std::string& dir, bool direct, uint64_t bytes, double seconds);

// What the files written into `dir`'s file system have measured so far
// (probing it first, as cached_direct_io_probe, if it has not been).
DirectIoLearned learned_direct_io(const std::string& dir);

// One line for a log: the way auto takes next in `dir` and why, e.g.
// "O_DIRECT (latest checkpoint files: 0.61 GB/s (2 files) direct, 0.40 GB/s
// (1 file) page cache)", or the
// probe's detail while no file has been measured; a retry of the slower way
// (DirectIoLearned) says ", the slower way, measured again" after the way.
std::string describe_auto_direct_io(const std::string& dir);

// Whether writes into `dir` should try O_DIRECT under `mode`: kOn yes, kOff
// no, kAuto choose_direct(cached_direct_io_probe(dir), learned_direct_io(dir)).
bool use_direct_io(DirectIo mode, const std::string& dir);

}  // namespace checkpoint
