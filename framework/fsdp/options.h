#pragma once
// Data-parallel layout (config section `parallel`).
#include <cstdint>
#include <string>

namespace framework::fsdp {

// FSDP2's MixedPrecisionPolicy (config keys train.mixed_precision.*). The
// sharded parameters the optimizer updates keep their own dtype (fp32
// master weights); a unit all-gathers and computes in param_dtype and
// reduce-scatters its gradients in reduce_dtype, then converts them into
// the shards' dtype. "fp32" or "bf16"; fp32 leaves a parameter as it is.
struct MixedPrecisionPolicy {
  std::string param_dtype = "fp32";
  std::string reduce_dtype = "fp32";
};

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
  // Set from train.mixed_precision by the trainer. Not a parallel.* key.
  MixedPrecisionPolicy mixed_precision;
};

}  // namespace framework::fsdp
