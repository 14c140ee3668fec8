#pragma once
// FSDP's options: resharding, prefetch, mixed precision, frozen shards, and
// how tensor parallelism split the parameters it shards. Torch-free.
#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "comm/enum_text.h"

namespace framework::dtensor {
class DeviceMesh;
}

namespace framework::fsdp {

// A dtype of train.mixed_precision (param_dtype, reduce_dtype).
enum class PrecisionDtype { kFp32, kBf16 };

inline constexpr comm::EnumName<PrecisionDtype> kPrecisionDtypes[] = {{PrecisionDtype::kFp32, "fp32"},
                                                                      {PrecisionDtype::kBf16, "bf16"}};
inline const char* to_string(PrecisionDtype dtype) { return comm::enum_text(dtype, kPrecisionDtypes); }

// "fp32" | "bf16"; throws std::invalid_argument naming `key` (e.g.
// "train.mixed_precision.param_dtype") and the allowed values.
inline PrecisionDtype parse_precision_dtype(const std::string& dtype, const char* key) {
  return comm::parse_enum(key, dtype, kPrecisionDtypes);
}

// FSDP2's MixedPrecisionPolicy (config keys train.mixed_precision.*). The
// sharded parameters the optimizer updates keep their own dtype (fp32
// master weights); a unit all-gathers and computes in param_dtype and
// reduce-scatters its gradients in reduce_dtype, then converts them into
// the shards' dtype. fp32 leaves a parameter as it is.
struct MixedPrecisionPolicy {
  PrecisionDtype param_dtype = PrecisionDtype::kFp32;
  PrecisionDtype reduce_dtype = PrecisionDtype::kFp32;
};

// How tensor parallelism (framework/tp) split one parameter of the module:
// the module holds this rank's part of `global_shape`, split along `dim`
// over the mesh's "tensor" axis by the chunk rule (dim -1: whole on every
// rank of the axis, e.g. a norm's weight).
struct TensorParallelParam {
  int64_t dim = -1;
  std::vector<int64_t> global_shape;
  // Whole on every TP rank (dim -1), each rank's gradient a part of the
  // whole one (tp::Style sum_grads): summed over the tensor axis.
  bool sum_grads = false;
};

// FSDP's own options (FSDP2's fully_shard arguments). The degrees of the
// mesh it shards over are the parallel layout's (framework/parallel); the
// config keys parallel.reshard_after_forward and parallel.prefetch are set
// here by the trainer.
struct FsdpOptions {
  // Free each unit's gathered parameters after its forward and gather them
  // again for its backward (less memory, one more all-gather per unit).
  bool reshard_after_forward = true;
  // Overlap (FSDP2's implicit prefetch): how many units ahead a unit's
  // all-gather is issued -- in forward order during the forward, in
  // reverse order during the backward -- and how many gradient reductions
  // may stay in flight while the backward goes on. 0: every collective runs
  // where it is needed and is waited for at once (no overlap). Results are
  // bit-identical either way. The trainer gives the mesh a second channel
  // (its own process groups) when it is above 0, so all-gathers do not
  // queue behind reduce-scatters.
  int64_t prefetch = 1;
  // Training forwards broadcast the module's buffers (e.g. BatchNorm running
  // statistics) from the mesh's first rank, as DDP does. Not a config key.
  bool broadcast_buffers = true;
  // Set from train.mixed_precision by the trainer. Not a parallel.* key.
  MixedPrecisionPolicy mixed_precision;
  // The dtype of the shards of frozen (requires_grad false) floating-point
  // parameters: kBf16 halves them (a LoRA base, model.lora.base_dtype);
  // they are gathered into the module's dtype all the same. Not a parallel.* key.
  PrecisionDtype frozen_dtype = PrecisionDtype::kFp32;
  // Set from tp::parallelize_module's result (by parameter name) when the
  // module was made tensor-parallel first; FSDP then shards each TP part
  // over the data-parallel axes and its DTensors carry both placements.
  // Not a config key.
  std::unordered_map<std::string, TensorParallelParam> tensor_parallel;
  // Expert parallelism (framework/ep): `params` (name -> the whole
  // parameter's shape) hold this rank's rows of dim 0 only, its experts,
  // split over the mesh's expert axis, which borrows its ranks from the
  // shard axis. FSDP shards those rows further over the rest of the shard
  // axis only, and gathers and reduces them over that group: `mesh` is
  // {replicate, expert_shard, expert}, the same ranks as the stage mesh
  // (shard = expert_shard x expert, expert innermost), with the stage's
  // tensor axis fourth when the stage mesh has one (the experts whole on
  // every tensor rank). Their gradients already hold every
  // expert-parallel rank's tokens. Not a config key.
  struct ExpertParallel {
    std::shared_ptr<dtensor::DeviceMesh> mesh;
    std::unordered_map<std::string, std::vector<int64_t>> params;
  };
  ExpertParallel expert_parallel;
};

}  // namespace framework::fsdp
