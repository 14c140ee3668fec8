#pragma once
// Saving a checkpoint: the DCP-style protocol over one process group.
//
// Call sequence, all on the checkpoint group; rank 0 is the coordinator, and
// no other rank receives more than its own share (save_protocol.h):
//   (all ranks)   local plan: what each rank holds         -- gather to rank 0
//   (coordinator) global plan: one writer per region; replicated data split
//                 and balanced; each rank's assignments    -- scatter
//   (all ranks)   write: each rank writes its chunks to rank_<r>.data in
//                 parallel blocks, fsyncs                  -- gather of the
//                 chunk locations or of the rank's error
//   (coordinator) commit: .metadata.tmp, fsync, rename to .metadata, fsync
//                 dir                                      -- broadcast of
//                 the verdict
// With a SavePlanCache whose plan still fits every rank, the first two steps
// are one all-reduce of three integers (see SavePlanCache).
// A failure on any rank reaches every rank as a CheckpointError naming the
// rank and its cause; nothing is committed then.
#include "checkpoint/errors.h"  // CheckpointError, CheckpointDamagedError
#include "checkpoint/options.h"
#include "checkpoint/plan/planner.h"
#include "checkpoint/state_dict.h"
#include "checkpoint/storage/storage.h"
#include "comm/process_group.h"

#include <map>
#include <memory>
#include <stdexcept>
#include <string>

namespace checkpoint {

struct CoordinatorPlan;  // save_protocol.h

// Save-plan caching (DCP's enable_plan_caching, Megatron's
// --ckpt-assume-constant-structure, but checked): keep one per process group
// and pass it to every save on that group. A save whose every rank holds the
// same structure as at the cached plan (names, kinds, dtypes, shapes, boxes,
// bytes items' sizes; hashed with the plan options, world and rank) skips the
// plan exchange: one all-reduce (MIN over [fits, id, -id]) proves that every
// rank fits and that all hold the same plan; any change or failure on any
// rank falls back to full planning, which refills the cache. A cached plan is
// the plan full planning would make, so the files are byte-identical.
// Filled by save_state_dict only; one thread at a time (the group's).
struct SavePlanCache {
  bool valid = false;
  uint64_t structure = 0;  // this rank's structure hash at the cached plan
  uint64_t plan_id = 0;    // the coordinator's id of the plan, < 2^62
  std::vector<WriteAssignment> assignments;             // this rank's
  std::shared_ptr<const CoordinatorPlan> coordinator;  // rank 0 only
  int64_t hits = 0;    // saves that used the cached plan
  int64_t misses = 0;  // saves that planned in full
};

struct SaveOptions {
  int64_t step = 0;
  std::string layout;                          // e.g. "fsdp replicate=1 shard=2"
  std::map<std::string, std::string> info;     // free-form, recorded in the metadata
  CompressionOptions compression;
  int io_threads = 4;
  PlanOptions plan;
  std::shared_ptr<Storage> storage;            // null: the POSIX file system
  std::shared_ptr<SavePlanCache> plan_cache;   // null: plan every save in full
  // The node-local tier (CheckpointManager, checkpoint.local.dir): `step_dir`
  // is this rank's own node's directory, so it differs between nodes. Every
  // rank creates it; nothing is committed: the encoded metadata comes back in
  // SaveStats::metadata on every rank, and the caller commits it on each node.
  bool node_local = false;
};

struct SaveStats {
  uint64_t logical_bytes = 0;        // written by this rank, before transforms
  uint64_t stored_bytes = 0;         // written by this rank, on disk
  uint64_t total_logical_bytes = 0;  // all ranks
  uint64_t total_stored_bytes = 0;
  // This rank's write memory bound at work: the most batches (about 1 MiB
  // each, or a block) that were queued or being coded at once, at most
  // 2 x io_threads.
  size_t peak_batches_in_flight = 0;
  bool plan_cached = false;          // the plan came from options.plan_cache
  double plan_s = 0;
  double write_s = 0;
  double commit_s = 0;
  std::vector<uint8_t> metadata;     // SaveOptions::node_local: the encoded metadata
};

// (all ranks of `group`) Saves `state` as the checkpoint directory `step_dir`
// (created) and commits it. Returns only after the commit; throws
// CheckpointError on every rank if any rank failed.
// REQUIRES: every rank passes the same `step_dir`, on a file system every
// rank sees (unless options.node_local); the distinct boxes of each item tile its global shape (ranks
// holding the same box hold equal replicas); `step_dir` holds no committed
// checkpoint (saving over one rewrites its data files while its old .metadata
// still names them). The tensors of `state` are read in place: they must not
// change until this returns.
// Thread safety: `group` must not be used by another thread meanwhile.
SaveStats save_state_dict(const StateDict& state, const std::string& step_dir,
                          comm::Group& group, const SaveOptions& options);

}  // namespace checkpoint
