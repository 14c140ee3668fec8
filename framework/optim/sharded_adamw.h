#pragma once
// LibTorch's AdamW on the local shards of a FullyShardedModel. Its state
// (exp_avg, exp_avg_sq) has the shape of each local shard, so it is sharded
// exactly like the parameter and is exposed as DTensors of the same layout.
#include "framework/fsdp/fully_shard.h"
#include "framework/optim/options.h"

#include <torch/torch.h>

#include <memory>
#include <vector>

namespace framework::optim {

struct AdamWParamState {
  int64_t step = 0;
  dtensor::DTensor exp_avg;
  dtensor::DTensor exp_avg_sq;
};

class ShardedAdamW {
 public:
  // REQUIRES: `model` outlives this optimizer.
  ShardedAdamW(fsdp::FullyShardedModel& model, OptimOptions options, int64_t total_steps);

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

  fsdp::FullyShardedModel& model_;
  OptimOptions options_;
  int64_t total_steps_;
  std::vector<torch::Tensor> params_;
  std::unique_ptr<torch::optim::AdamW> adamw_;
};

}  // namespace framework::optim
