#pragma once
// Yields this data-parallel rank's slice of each step's global batch. The position
// is a global step count, so a run saved at one data-parallel size resumes at any
// other and continues the same global sequence of batches.
#include "framework/data/dataset.h"
#include "framework/data/sampler.h"

#include <memory>
#include <utility>

namespace framework::data {

// Not thread-safe; one loader per rank.
class DataLoader {
 public:
  // REQUIRES: global_batch_size % dp_size == 0, 0 <= dp_rank < dp_size.
  DataLoader(std::shared_ptr<Dataset> dataset, int64_t global_batch_size, uint64_t seed, int dp_rank,
             int dp_size);

  // (inputs int64 [G/n, T], targets int64 [G/n, T]) for the next step; advances.
  std::pair<torch::Tensor, torch::Tensor> next();

  LoaderState state() const;
  // Continues from state.next_step. seed and global batch size must match this
  // loader's (TORCH_CHECK naming them); dp_rank/dp_size may differ from the saver's.
  void load_state(const LoaderState& state);

  const Dataset& dataset() const { return *dataset_; }

 private:
  std::shared_ptr<Dataset> dataset_;
  GlobalBatchSampler sampler_;
  int dp_rank_;
  int dp_size_;
  int64_t next_step_ = 0;
};

}  // namespace framework::data
