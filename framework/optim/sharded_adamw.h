#pragma once
// AdamW on the local shards of a FullyShardedModel. Its state (exp_avg,
// exp_avg_sq) has the shape of each local shard, so it is sharded exactly like
// the parameter and is exposed as DTensors of the same layout.
//
// Three implementations of the same update (train.optimizer_impl), all on the
// one state, so a checkpoint written under one resumes under another:
//   for_loop: LibTorch's C++ torch::optim::AdamW, a few kernels per parameter;
//   foreach:  torch.optim.AdamW(foreach=True)'s sequence of multi-tensor
//             _foreach_* ops over all parameters at once;
//   fused:    torch.optim.AdamW(fused=True)'s _fused_adamw_ kernel (LibTorch
//             2.4+, CPU and CUDA).
#include "framework/fsdp/fully_shard.h"
#include "framework/optim/options.h"

#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

namespace framework::optim {

struct AdamWParamState {
  int64_t step = 0;
  dtensor::DTensor exp_avg;
  dtensor::DTensor exp_avg_sq;
};

enum class AdamWImpl { kForLoop, kForeach, kFused };

// "for_loop" | "foreach" | "fused".
const char* adamw_impl_name(AdamWImpl impl);
// Whether this build of LibTorch has the implementation (fused: 2.4+).
bool adamw_impl_available(AdamWImpl impl);
// train.optimizer_impl. auto is the fastest this build has on `device`:
// fused where LibTorch has it (2.4+), else foreach on CUDA and for_loop on
// the CPU (1.13's CPU _foreach_ ops are per-tensor loops with extra
// temporaries: 12% slower than the for-loop on the CPU llama of
// bench/step_compare.py). Throws std::invalid_argument naming the key for an
// implementation this build lacks.
AdamWImpl resolve_adamw_impl(OptimizerImpl choice, const torch::Device& device);

class ShardedAdamW {
 public:
  // REQUIRES: `model` outlives this optimizer.
  ShardedAdamW(fsdp::FullyShardedModel& model, OptimOptions options, int64_t total_steps,
               AdamWImpl impl = AdamWImpl::kForLoop);

  AdamWImpl impl() const { return impl_; }

  // Sets the learning rate for `step` (1-based) and applies one AdamW update
  // with the gradients now on the local shards. Returns the lr used.
  double step(int64_t step);

  // The state of parameter `index`; zeros (step 0) before the first update.
  AdamWParamState state(size_t index);
  // Overwrites the state of parameter `index` (resume). REQUIRES: shapes of
  // the locals match the parameter's local shard.
  void set_state(size_t index, int64_t step, const torch::Tensor& exp_avg,
                 const torch::Tensor& exp_avg_sq);

 private:
  torch::optim::AdamWParamState* find_state(size_t index);
  // The state of parameter `index`, made (zeros, step 0) where it has none.
  torch::optim::AdamWParamState& state_for_update(size_t index);
  void step_multi_tensor(double lr);

  fsdp::FullyShardedModel& model_;
  OptimOptions options_;
  int64_t total_steps_;
  std::vector<torch::Tensor> params_;
  AdamWImpl impl_;
  // for_loop runs it; foreach and fused use it to hold the state.
  std::unique_ptr<torch::optim::AdamW> adamw_;
  // fused: each parameter's step as the float32 scalar on its device that the
  // kernel reads; undefined until first needed and after set_state.
  std::vector<torch::Tensor> step_tensors_;
};

}  // namespace framework::optim
