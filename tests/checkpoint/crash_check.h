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
// More writers are checked with the same model and their own rules:
//   * overlap mode and the tiers (node-local commit, partner copies, the
//     durable flush): the checkpoint resume would choose (choose_resume_tiers
//     on the recovered node directories and checkpoint.dir) loads
//     bit-exactly, and is never older than the newest save that returned;
//   * a failed fsync (EIO, fsyncgate semantics: crash_storage.h): for each
//     fsync of one save in turn, that fsync fails. The save must fail on
//     every rank and not be committed in the live directory afterwards, and
//     in no crash state after the failure was reported is it the latest;
//     the previous checkpoint stays loadable;
//   * the set-aside rename of a damaged checkpoint (resume with fallback):
//     the damaged directory is always whole under exactly one of its names,
//     and set aside for good once resume returned;
//   * ckpt export (safetensors, torch.save, DCP, the second export replacing
//     the first): the output is absent or byte for byte one complete export.
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
  kRetryFailedFsync,  // a sync that fails (EIO) is retried, and the retry trusted
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
  size_t runs = 0;             // scenario runs behind the report (EIO: one per failing fsync)
  size_t operations = 0;       // recorded file-system operations
  size_t crash_points = 0;
  size_t states = 0;           // (crash point, loss pattern) pairs checked
  size_t distinct_states = 0;  // different disk images among them
  size_t exhaustive_points = 0;  // crash points enumerated completely
  size_t max_uncertain = 0;      // the most uncertain items at one crash point
  size_t correct = 0;
  size_t violations = 0;
  // The most crash states (disk images) held in memory at once. Each state
  // is made, checked and freed before the next, and identical states are
  // recognised by a 128-bit fingerprint, not by a kept copy, so this stays
  // 1 whatever the number of states (holding every distinct image took
  // 21.8 GB at scripts/crash-check 16).
  size_t peak_states_held = 0;
  // Violations by kind ("committed but not intact", "lost the durable
  // commit", ...), and the first violation of each kind, explained.
  std::map<std::string, size_t> violation_kinds;
  // eio_*: one line per run, "<the failed fsync>: failed on R of 2 ranks,
  // S states, V violations".
  std::vector<std::string> runs_detail;
  std::vector<std::string> examples;
};

// The scenarios: "sync" (save_state_dict, steps 1-2, into a checkpoint.dir
// that does not exist yet), "sync_zstd" (the same, zstd, 4 KiB blocks),
// "async_zstd_retention" (CheckpointManager async, zstd, keep_last 1, steps
// 1-3), "sync_retention" (CheckpointManager sync, keep_last 2, steps 1-3),
// "overlap_retention" (overlap, keep_last 1, steps 1-3), "tiers_sync" and
// "tiers_async" (2 ranks on 2 nodes, node-local tier with partner copies,
// local keep_last 1, the durable flush every 2nd save and for the final
// step 3), "eio_sync" and "eio_async" (manager saves of steps 1-3; one
// fsync of step 2's save fails, a run per fsync; the trainer's retry of the
// save is step 3), "set_aside" (resume with fallback past a damaged step 2),
// "export" (safetensors, torch.save and DCP exports of a committed step,
// the safetensors one exported twice).
std::vector<std::string> scenario_names();

// Runs `scenario` once with real Gloo groups (2 ranks as threads on loopback)
// and checks every crash state within `bound`.
Report check_scenario(const std::string& scenario, Protocol protocol, const Bound& bound);

}  // namespace checkpoint::crash
