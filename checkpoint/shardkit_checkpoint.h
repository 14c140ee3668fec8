#pragma once
// The checkpoint library's public API in one include (installed as
// <prefix>/include/shardkit/checkpoint/shardkit_checkpoint.h; CMake package
// ShardkitCheckpoint, target shardkit::checkpoint). Each declaration's full
// contract is in the header named next to it; this file says how they fit.
//
// The model: every rank describes what it holds as a StateDict (state_dict.h):
// named boxes of global tensors (a dim-0 slice, a column block, or the whole
// tensor) and small byte strings. A StateDict holds torch::Tensor handles, not
// copies: saving reads the caller's tensors, loading writes into them. A
// checkpoint is one directory (FORMAT.md): rank_<r>.data files plus a
// .metadata index whose presence means "committed".
//
//   save    save_state_dict (save.h)
//           (all ranks of the group) Collective; returns after the commit.
//           Any rank failing makes every rank throw CheckpointError.
//   async   CheckpointManager (manager.h), CheckpointOptions::mode kAsync:
//           (all ranks) save(step, state) copies the state into reused host
//           buffers and returns; a background thread writes and commits into
//           <dir>/step_<step>. (all ranks) finish() waits and rethrows a
//           failure. The manager owns its group while a save is in flight.
//           Mode kOverlap returns even earlier (see wait_staged()).
//   load    load_state_dict (load.h)
//           (any rank, any process) No communication. Fills every entry of the
//           state from the checkpoint, whatever the world size and split it
//           was saved with (resharding). Strict by default about names; dtypes
//           and global shapes must match. Destinations must be contiguous CPU
//           tensors. CheckpointManager::load is the all-ranks variant that
//           fails on every rank when one rank fails.
//   inspect read_committed_metadata(storage, dir) (format/metadata.h)
//           -> CheckpointMeta: step, world size, layout, items, their global
//           shapes, dtypes and chunks. list_checkpoints / latest_committed
//           (checkpoint_dir.h) find step_<N> directories. Any process.
//   verify  verify_checkpoint(*posix_storage(), dir) (codec/chunk_reader.h) re-reads
//           every chunk and checks every checksum; returns a report listing
//           each bad chunk. Any single process; no communication.
//   export  export_checkpoint (export.h): one safetensors or torch.save file
//           of full tensors, or a PyTorch DCP directory. load_weights_into
//           (import_weights.h): the reverse, filling a (sharded) state from
//           such a file or a DCP directory's model. load_dcp_into
//           (import_dcp.h): model and optimizer state from a PyTorch DCP
//           checkpoint (dcp.h reads its metadata). Any process.
//   options CompressionOptions (options.h): codec kNone | kZstd, level,
//           byte grouping, block size; recorded per chunk, so loading needs no
//           options. io_threads in SaveOptions, LoadOptions, ExportOptions and
//           CheckpointOptions: threads per process that encode, write, read
//           and decode blocks.
//
// Process groups without the trainer (comm/runtime.h):
//   LaunchEnv env = comm::detect_launch_env(comm::process_env());
//   auto rt = comm::init_runtime(env, comm::DistOptions{},
//                                           comm::DeviceKind::kCpu);
//   // rt->checkpoint: a Gloo group over all ranks, for save_state_dict or a
//   // CheckpointManager; rt->train: a second group for anything else.
// detect_launch_env reads torchrun (RANK, WORLD_SIZE, MASTER_ADDR, ...) or
// SLURM variables; run_local_launcher (local_launcher.h) starts N local ranks
// with those variables set, like `torchrun --standalone`. Rendezvous::new_group
// makes further groups over subsets of ranks.
//
// Thread safety, in short: a Group is used by one thread at a time, so a
// group given to a CheckpointManager is not used for anything else while a
// save is in flight, and save_state_dict calls on one group do not overlap.
// load_state_dict, verify_checkpoint, read_committed_metadata and
// export_checkpoint share no state and may run concurrently on different
// arguments. A StateDict is not synchronised: one thread at a time.
//
// Errors: CheckpointError (save.h) for the save and load protocols;
// FormatError (metadata.h), ChecksumError (chunk_io.h), IoError (storage.h)
// and TransformError (transforms.h) name the checkpoint, item, chunk and file;
// comm::DistError for a collective that timed out or lost a peer.
//
// Example: examples/checkpoint_basic/main.cpp.

// Every installed header, directly or through another (the packaging test
// compiles the example against the installed tree, so each must be there).
#include "checkpoint/layout/checkpoint_dir.h"
#include "checkpoint/codec/chunk_reader.h"
#include "checkpoint/codec/chunk_writer.h"
#include "checkpoint/interop/export.h"
#include "checkpoint/interop/dcp.h"
#include "checkpoint/interop/import_dcp.h"
#include "checkpoint/interop/import_weights.h"
#include "checkpoint/load.h"
#include "checkpoint/async/manager.h"
#include "checkpoint/format/metadata.h"
#include "checkpoint/options.h"
#include "checkpoint/plan/planner.h"
#include "checkpoint/plan/resharding.h"
#include "checkpoint/save.h"
#include "checkpoint/state_dict.h"
#include "checkpoint/storage/storage.h"
#include "checkpoint/codec/transforms.h"
#include "checkpoint/format/types.h"
#include "checkpoint/interop/weights_file.h"
#include "comm/launch_env.h"
#include "comm/local_launcher.h"
#include "comm/process_group.h"
#include "comm/runtime.h"
