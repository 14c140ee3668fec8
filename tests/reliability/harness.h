#pragma once
// The reliability harness: runs build/train as a user would (a process, two
// local ranks, a small fast model), injects faults (kill -9 of a rank or of
// everything, SIGTERM, full disk, hung peers), and checks what a user relies
// on afterwards: committed checkpoints verify, resume picks the newest one,
// and the resumed losses equal an uninterrupted run's bit for bit.
// Torch-free: checks run in-process with checkpoint_core.
//
// Used by the GoogleTest binary test_reliability (CI, a few trials) and the
// soak driver fault_soak (scripts/fault-soak, any number of trials).
#include <cstdint>
#include <filesystem>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "reliability/process.h"

namespace reliability {

namespace fs = std::filesystem;

// Paths of the binaries under test (the build tree, testing_support::binary_dir(),
// or the directory given to set_binary_dir).
void set_binary_dir(const std::string& dir);
std::string train_binary();
// Which build of train that is (size and modification time): results cached
// across the tests' processes are keyed by it.
std::string train_binary_key();
std::string ckpt_binary();
std::string default_config();  // configs/default.yaml in the source tree

// One `train` invocation: a config file plus --set overrides.
struct TrainSpec {
  fs::path run_dir;
  fs::path ckpt_dir;
  std::string config;                 // default_config() when empty
  std::vector<std::string> sets;      // key=value, after the small-model ones
  int nproc = 2;
  int nodes = 1;                      // > 1: --nodes (simulated nodes of nproc/nodes ranks)
  EnvVars env;
  bool small_model = true;            // prepend small_model_sets()
  // The program run: "train", or "train_faults" (tests/reliability/
  // train_faults.cpp) for runs whose env asks for injected faults.
  std::string binary = "train";
};

// The fast configuration every trial uses: a 1-layer GPT of width 32, 40
// steps, a checkpoint every 2 steps, metrics every step.
std::vector<std::string> small_model_sets();
std::vector<std::string> train_argv(const TrainSpec& spec);

// Losses by step from <run_dir>/metrics.jsonl (the last line for a step wins).
std::map<int64_t, double> read_losses(const fs::path& metrics_jsonl);

struct CommittedCheckpoint {
  int64_t step = 0;
  fs::path path;
};
// The committed checkpoints (step_<N> with .metadata) of a checkpoint.dir.
std::vector<CommittedCheckpoint> committed_checkpoints(const fs::path& ckpt_dir);
// Step directories without .metadata.
std::vector<fs::path> uncommitted_dirs(const fs::path& ckpt_dir);

// In-process `ckpt verify`: "" when intact, else the problems (or the error
// that stopped verification), one per line.
std::string verify_problems(const fs::path& step_dir);

// The reference: losses of an uninterrupted run of the small config in
// `mode`, cached under <cache_dir> keyed by the train binary's size and
// mtime and by the shared libraries it resolves to (the BLAS chosen by
// update-alternatives or LD_PRELOAD changes the losses); runs train once when
// there is no valid cache.
std::map<int64_t, double> reference_losses(const std::string& mode, const fs::path& cache_dir,
                                           std::string* error);

// Compares the resumed losses (steps > after_step) with the reference: ""
// when every step from after_step+1 to the reference's last is present and
// bit-identical, else what differs.
std::string compare_losses(const std::map<int64_t, double>& resumed,
                           const std::map<int64_t, double>& reference, int64_t after_step);

// ---- kill -9 trials ---------------------------------------------------------------

struct KillTrial {
  int index = 0;
  std::string mode;        // sync | async | overlap
  std::string kill_point;  // random | during_save | after_commit
  std::string victim;      // rank0 | rank1 | all | launcher
  double delay_s = 0;      // random: after the first step line
  fs::path root;           // fresh directory for this trial
};

struct KillOutcome {
  bool ok = false;
  std::string summary;   // e.g. "resumed@12 ok" or the first failure
  std::string detail;    // what happened, for the log
  int64_t killed_after_committed = -1;  // newest committed step before the kill
  int64_t resumed_from = -1;            // -1: started fresh
  std::string state_at_kill;            // e.g. "uncommitted step_6"
};

// Draws a trial (mode, kill point, victim, delay) from `rng`.
KillTrial draw_kill_trial(int index, std::mt19937_64& rng, const fs::path& root);

// Runs one trial: start, kill, check every committed checkpoint verifies and
// the newest committed before the kill survived, resume, check exit 0, the
// "resumed from" line and the losses against `reference`.
KillOutcome run_kill_trial(const KillTrial& trial, const std::map<int64_t, double>& reference);

// ---- corruption sweep ---------------------------------------------------------------

struct FlipStats {
  int64_t flips = 0;
  int64_t in_stored_bytes = 0;       // inside a chunk's stored range or the metadata
  int64_t detected = 0;              // of those
  int64_t benign = 0;                // decoded to identical logical bytes (compressed frames)
  int64_t unreferenced = 0;          // outside every chunk (meaningless bytes)
  int64_t unreferenced_detected = 0;
  std::vector<std::string> misses;   // flips in stored bytes that verify accepted
  std::vector<std::string> messages_sample;
};

// Flips one byte at `count` random offsets (drawn with `seed`) across every
// file of `step_dir` (restoring it after each), runs verify (and for the
// metadata decode_metadata) on each; a crash would end the process. A flip
// inside a transformed (zstd) block that verify accepts decoded to the same
// logical bytes (verify checked every block checksum): counted as benign.
FlipStats corruption_sweep(const fs::path& step_dir, int64_t count, uint64_t seed);

}  // namespace reliability
