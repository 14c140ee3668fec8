#pragma once
// Data-parallel layout (config section `parallel`).
#include <cstdint>

namespace framework::fsdp {

struct ParallelOptions {
  // Degrees of the 2-D mesh (replicate x shard). Their product is the world
  // size; -1 means "whatever the world size leaves". replicate 1 = FSDP,
  // shard 1 = DDP, both > 1 = HSDP.
  int64_t replicate = 1;
  int64_t shard = -1;
  // Free each unit's gathered parameters after its forward and gather them
  // again for its backward (less memory, one more all-gather per unit).
  bool reshard_after_forward = true;
  // Training forwards broadcast the module's buffers (e.g. BatchNorm running
  // statistics) from the mesh's first rank, as DDP does. Not a config key.
  bool broadcast_buffers = true;
};

}  // namespace framework::fsdp
