#pragma once
// fully_shard for models::LayeredModelImpl: FSDP, DDP and HSDP over a 2-D
// device mesh {replicate, shard}.
//
// Each block of the model is one unit; everything else (embeddings, final
// norm, head) is the root unit. Every parameter is stored as this rank's
// Shard(0) chunk (torch.chunk rows) of the mesh's shard axis -- the tensor the
// optimizer updates. The module's own parameter tensors keep their full
// shapes but have no storage except while their unit is gathered:
//
//   forward : all-gather a unit's shards into its parameters, run the unit,
//             free them again (reshard_after_forward);
//   backward: a hook on the unit's output gathers them again before the
//             unit's backward runs; once the last gradient of the unit is
//             accumulated, its gradients are reduce-scattered (summed) into
//             the shards' .grad and the full parameters and gradients freed.
//
// Only one unit is ever gathered besides the root, so parameter plus
// gradient memory per rank is the sharded total plus the largest unit.
// With shard size 1 (DDP) the local tensor is the module parameter itself
// and gradients are all-reduced; with replicate > 1 (HSDP) the reduce-scatter
// is followed by an all-reduce across replicas.
//
// Gradients are SUMMED across data-parallel ranks: the caller scales its loss
// by the global normaliser (e.g. the global token count), which makes results
// independent of the world size.
//
// Thread safety: one training thread drives it. The CPU autograd engine runs
// backward (and so the gather and reduce hooks) on the calling thread; for
// CUDA tensors it runs them on its own per-device thread while the calling
// thread blocks in backward(). Either way the hooks' collectives never run
// concurrently with the training thread's, they run in the same backward
// order on every rank, and on the stream the engine runs each unit's
// backward on (the current stream of the device thread, which is the
// forward's stream): NCCL's wait() orders that stream after the collective,
// and Gloo stages CUDA tensors through the host synchronously.
#include "framework/dtensor/dtensor.h"
#include "framework/fsdp/options.h"
#include "models/layered_model.h"

#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

namespace framework::fsdp {

struct MemoryStats {
  int64_t sharded_param_bytes = 0;   // local shards (this rank)
  int64_t full_param_bytes = 0;      // the whole model, unsharded
  int64_t largest_unit_bytes = 0;    // parameters of the largest unit
  int64_t peak_gathered_bytes = 0;   // peak of gathered params + full grads
};

class FullyShardedModel {
 public:
  // REQUIRES: every rank passes an identically initialised model and the same
  // mesh (axes {replicate, shard}). Takes over the model's parameters.
  FullyShardedModel(std::shared_ptr<models::LayeredModelImpl> model,
                    std::shared_ptr<dtensor::DeviceMesh> mesh, ParallelOptions options);
  ~FullyShardedModel();

  // Forward of the whole model with per-unit gather/free. Under
  // torch::NoGradGuard the parameters are freed again before returning.
  torch::Tensor forward(const torch::Tensor& tokens);

  // After loss.backward(): checks that every unit reduced its gradients (a
  // unit whose parameters got no gradient is reduced with zeros, on every
  // rank alike) and frees what is still gathered.
  void finish_backward();

  // The tensors the optimizer owns, in parameter order: local shards (FSDP,
  // HSDP) or the module parameters themselves (DDP).
  std::vector<torch::Tensor> local_params() const;
  // Parameter names (the model's named_parameters order) and their DTensors.
  std::vector<std::string> param_names() const;
  dtensor::DTensor param_dtensor(size_t index) const;
  // A DTensor with the same layout as parameter `index` around `local`
  // (e.g. an optimizer moment of that parameter).
  dtensor::DTensor like_param(size_t index, torch::Tensor local) const;

  // L2 norm of all gradients across all shards (replicas counted once).
  double grad_norm();
  // Scales all gradients so their global norm is at most max_norm; returns
  // the norm before clipping.
  double clip_grad_norm(double max_norm);
  void zero_grad();

  const MemoryStats& memory_stats() const { return stats_; }
  void reset_peak_memory();
  dtensor::DeviceMesh& mesh() { return *mesh_; }
  models::LayeredModelImpl& model() { return *model_; }

  struct Unit;  // one FSDP unit; defined in fully_shard.cpp

 private:
  void gather(Unit& unit);
  void release(Unit& unit);
  void reduce_grads(Unit& unit);
  void on_grad_accumulated(Unit& unit);

  std::shared_ptr<models::LayeredModelImpl> model_;
  std::shared_ptr<dtensor::DeviceMesh> mesh_;
  ParallelOptions options_;
  int shard_axis_ = 1;
  int replicate_axis_ = 0;
  std::vector<std::unique_ptr<Unit>> units_;  // units_[0] is the root
  std::vector<std::pair<Unit*, size_t>> param_index_;  // model parameter order -> (unit, slot)
  MemoryStats stats_;
  int64_t live_bytes_ = 0;
};

// The {replicate, shard} mesh for `world` ranks from parallel.replicate and
// parallel.shard (-1 = the rest). Throws std::invalid_argument naming the keys
// when they do not multiply to the world size.
std::vector<int64_t> mesh_shape_for(const ParallelOptions& options, int world);
std::string layout_name(const std::vector<int64_t>& mesh_shape);  // "fsdp", "ddp", "hsdp"

}  // namespace framework::fsdp
