#pragma once
// Checks that a run can start, made once before any rank does work: by the
// local launcher (`train --nproc N`) for the whole job, or by each rank that
// torchrun or SLURM started. Everything here is a user mistake in the config
// or on the command line, reported as one PreflightError line that names the
// key, file or checkpoint; train exits 2. Nothing is created or deleted.
//
//   - data.*: the text file exists, is a regular file and holds at least one
//     sample plus the held-out part; the synthetic task fits model.seq_len.
//   - model.init_from: exists and is a regular file (when not resuming).
//   - run.dir and checkpoint.dir: a directory (or creatable in one) that this
//     user can write; checkpoint.dir not a regular file.
//   - memory: parameters, gradients, AdamW moments, the gathered FSDP unit,
//     activations and checkpoint staging per rank, times the ranks on this
//     machine, against its available memory.
//   - checkpoint.resume: a named checkpoint exists and is committed; `never`
//     refuses a checkpoint.dir that already holds committed checkpoints (they
//     would be overwritten and pruned); `auto` refuses a checkpoint saved with
//     other model, data, run.seed or train.global_batch_size values, naming
//     each key, unless checkpoint.allow_config_change.
//
// Example:
//   const PreflightReport report = preflight(cfg, world, local_ranks);
//   for (const auto& w : report.warnings) std::cerr << "train: warning: " << w << "\n";
#include "framework/config/config.h"

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace framework::train {

class PreflightError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Bytes per rank, estimated from the config alone: shards, their gradients
// and AdamW in fp32; gathered units and activations in param_dtype, with
// activation checkpointing and micro-batches counted.
struct MemoryEstimate {
  double params = 0;       // this rank's parameter shards
  double grads = 0;        // their gradients
  double optimizer = 0;    // AdamW's two moments
  double gathered = 0;     // the largest FSDP unit, all-gathered, with its gradient
  double activations = 0;  // kept for backward, this rank's micro-batch
  double staging = 0;      // host copy of the state for async/overlap saves
  // Host memory of a node-local checkpoint tier on tmpfs (checkpoint.local.dir
  // on /dev/shm): this rank's files of the newest checkpoint.local.keep_last
  // commits and the one being written, and as much again for the partner
  // copies (checkpoint.local.partner, with more than one node). 0 for a
  // tier on disk.
  double local_tier = 0;
  double total() const { return params + grads + optimizer + gathered + activations + staging + local_tier; }
  double host_only() const { return staging + local_tier; }  // off the GPU on a CUDA run
};

// `nodes`: the job's nodes (partner copies need more than one).
MemoryEstimate estimate_memory(const config::Config& cfg, int world_size, int nodes = 1);

// Context parallelism's effect on activations (train --dry-run): the
// activations per rank (MemoryEstimate::activations) at model.seq_len with
// each sequence split over C = 1, 2, 4 and 8 ranks, the ranks the batch
// splits over as configured (a world of world_size / parallel.context x C).
// `splits` false: model.seq_len does not split into C's chunks
// (parallel.context_load_balance).
struct ContextActivations {
  int64_t context = 1;
  bool splits = true;
  double bytes = 0;
};
std::vector<ContextActivations> activations_by_context(const config::Config& cfg, int world_size);

// True when `dir_pattern` (checkpoint.local.dir, "{node}" left in) lies on
// tmpfs or ramfs: its files are held in memory. Checks the deepest existing
// directory above it.
bool local_tier_in_memory(const std::string& dir_pattern);

// The config's parallel layout for a job of `world_size` ranks, with the
// config's model and batch: the degrees (parallel::resolve), the model
// kind's tensor-parallel plan (models::check_tensor_parallel_plan), the
// batch's split (parallel::split_batch: data-parallel ranks, micro-batches,
// the pipeline schedule's rule) and, with a pipeline, that the kind splits
// into stages at parallel.pipeline_split_points. Throws PreflightError
// naming the keys and values. The dry run and preflight call it before any
// rank starts; each rule lives where it is named.
void check_parallel(const config::Config& cfg, int world_size);
// train.sample_every with parallel.pipeline above 1: no rank holds the
// whole model to generate from. Throws PreflightError naming both keys;
// check_parallel and the Trainer (splitting its stages) call it.
void check_pipeline_sampling(const config::Config& cfg);

// "412.3 MiB (params 10.0 MiB, grads 10.0 MiB, optimizer 20.0 MiB, ...)"
std::string describe(const MemoryEstimate& m);

// MemAvailable of /proc/meminfo in bytes, or nullopt where unknown.
std::optional<double> available_memory_bytes();

struct PreflightReport {
  MemoryEstimate memory;                   // per rank
  std::optional<std::string> resume_from;  // the checkpoint resume will try first
  std::vector<std::string> warnings;       // e.g. config changes allowed by the user
};

// The run.dir and checkpoint.dir checks alone (before the run's lock is
// taken, which creates run.dir). Throws PreflightError.
void check_directories(const config::Config& cfg);

// Runs every check above for a job of `world_size` ranks, `local_ranks` of
// them on this machine. Throws PreflightError (one line) on the first problem.
PreflightReport preflight(const config::Config& cfg, int world_size, int local_ranks);

// The keys whose change makes a checkpoint belong to another run, as
// "key (saved -> now)" items; empty when `saved_yaml` matches `cfg` on them.
// `model_only`: only the model's shape counts. Throws PreflightError when the
// saved config cannot be read.
std::vector<std::string> resume_conflicts(const std::string& saved_yaml, const std::string& source,
                                          const config::Config& cfg, bool model_only);

// The changes resume allows but a user may want to know of: train.steps,
// train.stop_at, optim.*, parallel.*, as "key (saved -> now)" items.
std::vector<std::string> resume_changes(const std::string& saved_yaml, const std::string& source,
                                        const config::Config& cfg);

// Where checkpoint.resume takes the run from. A PyTorch DCP directory is an
// initial load, like torchtitan's initial_load_path: used while the run's
// checkpoint directory holds no committed checkpoint; once it does, the run
// resumes its own newest, as with "auto".
enum class ResumeSource {
  kConfig,        // auto, never, or a shardkit checkpoint path: as configured
  kDcp,           // load the DCP directory checkpoint.resume names
  kAutoAfterDcp,  // checkpoint.resume names a DCP directory, but the run has its own: auto
};
ResumeSource resume_source(const config::Config& cfg);

}  // namespace framework::train
