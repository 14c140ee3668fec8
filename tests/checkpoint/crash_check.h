#pragma once
// The crash-consistency checker (issue #21): runs a small two-rank save on
// a CrashStorage (tests/support/crash_storage.h), then, for every crash point
// of its log and every loss pattern the model allows there (bounded below),
// rebuilds the disk a power loss would leave and runs recovery on it:
// list_checkpoints / latest_committed, checkpoint_status, verify_checkpoint,
// load_state_dict (resharded: saved by 2 ranks, loaded by 1) and
// apply_retention. A state is correct when
//   * every directory listed as committed reads, verifies and loads
//     bit-exactly the tensors saved for its step;
//   * the latest committed step is the newest whose save had returned (or
//     whose .metadata rename and directory fsync had completed) before the
//     crash, or a newer one whose rename reached disk; never older, never none;
//   * retention run on the recovered directory keeps that latest one.
// Used by tests/checkpoint/test_crash_consistency.cpp (bounded, in ctest) and
// crash_check_main.cpp (scripts/crash-check, deeper).
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace checkpoint::crash {

// How the save's storage is used: the real protocol, or one deliberately
// broken (to show that the checker catches it).
enum class Protocol {
  kReal,
  kNoFileFsync,  // every WritableFile::sync does nothing
  kNoDirFsync,   // every Storage::sync_dir does nothing
};

// The bound on the enumeration, per crash point with n uncertain items (file
// blocks written since their fsync, directory entries changed since their
// directory's fsync): n <= exhaustive_limit: all 2^n loss patterns; else all
// kept, all lost, each item alone lost, each item alone kept, and `samples`
// random patterns (seeded by `seed` and the crash point).
struct Bound {
  int exhaustive_limit = 8;
  int samples = 32;
  uint64_t seed = 1;
  // The size of the saves: "w" has 64 x size rows of 48 floats (12 KiB x
  // size: 4 KiB blocks to lose), and each scenario makes extra_saves more saves.
  int size = 1;
  int extra_saves = 0;
};

struct Report {
  std::string scenario;
  size_t operations = 0;       // recorded file-system operations
  size_t crash_points = 0;
  size_t states = 0;           // (crash point, loss pattern) pairs checked
  size_t distinct_states = 0;  // different disk images among them
  size_t exhaustive_points = 0;  // crash points enumerated completely
  size_t max_uncertain = 0;      // the most uncertain items at one crash point
  size_t correct = 0;
  size_t violations = 0;
  // Violations by kind ("committed but not intact", "lost the durable
  // commit", ...), and the first violation of each kind, explained.
  std::map<std::string, size_t> violation_kinds;
  std::vector<std::string> examples;
};

// The scenarios: "sync" (save_state_dict, steps 1-2, into a checkpoint.dir
// that does not exist yet), "sync_zstd" (the same, zstd, 4 KiB blocks),
// "async_zstd_retention" (CheckpointManager async, zstd, keep_last 1, steps
// 1-3), "sync_retention" (CheckpointManager sync, keep_last 2, steps 1-3).
std::vector<std::string> scenario_names();

// Runs `scenario` once with real Gloo groups (2 ranks as threads on loopback)
// and checks every crash state within `bound`.
Report check_scenario(const std::string& scenario, Protocol protocol, const Bound& bound);

}  // namespace checkpoint::crash
