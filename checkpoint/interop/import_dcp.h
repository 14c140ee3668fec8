#pragma once
// Loading a PyTorch DCP checkpoint (dcp.h) into a StateDict: what resuming a
// torchtitan or FSDP2 run from its DCP checkpoint needs, at any world size
// and layout. Each rank reads only the boxes of its own entries.
//
// Names. Every DCP key is mapped to a shardkit name (dcp_to_shardkit_name,
// after the caller's prefix rewrites), then matched with the state's
// entries:
//   model.<fqn>                      -> model.<fqn>      (DCP get_state_dict)
//   <fqn> (no known top-level key)   -> model.<fqn>      (torchtitan's model)
//   optim.state.<fqn>.<moment>       -> optim.<fqn>.<moment>
//   optimizer.state.<fqn>.<moment>   -> optim.<fqn>.<moment>  (torchtitan)
//   train_state.step                 -> the training step
//   everything else (param_groups, lr_scheduler, dataloader, extra.*)
//                                    -> not loaded (listed in `ignored`)
// An AdamW `step` (a 0-d float tensor in DCP) fills the bytes entry
// optim.<fqn>.step as the 8-byte little-endian integer shardkit keeps.
//
// Call sequence: (every rank) build the state dict as for a checkpoint load
// (e.g. framework::train::get_state_dict), then load_dcp_into; tensors are
// written in place. Thread safety: none on `state`.
#include "checkpoint/interop/dcp.h"
#include "checkpoint/state_dict.h"

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace checkpoint {

struct DcpLoadOptions {
  std::vector<DcpRename> renames;
  // Entries under this prefix must all be found (default: the model);
  // other entries (optimizer state) may be missing: `missing` lists them.
  std::string required_prefix = "model.";
  std::shared_ptr<Storage> storage;  // null: the POSIX file system
};

struct DcpLoadStats {
  int64_t step = -1;                 // train_state.step, else the largest AdamW step, else -1
  uint64_t tensors = 0;              // entries filled
  uint64_t bytes_read = 0;
  std::vector<std::string> missing;  // state entries the checkpoint lacks (not required)
  std::vector<std::string> ignored;  // DCP keys not loaded
};

// Fills `state` from the DCP checkpoint `dir`. Throws FormatError naming the
// directory and the entries when a required entry is missing, or a shape
// or dtype differs (nothing is changed then), and as read_dcp_box does.
DcpLoadStats load_dcp_into(StateDict& state, const std::string& dir, const DcpLoadOptions& options);

}  // namespace checkpoint
