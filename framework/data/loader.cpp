#include "framework/data/loader.h"

#include <vector>

namespace framework::data {

DataLoader::DataLoader(std::shared_ptr<Dataset> dataset, int64_t global_batch_size, uint64_t seed,
                       int dp_rank, int dp_size)
    : dataset_(std::move(dataset)), sampler_(global_batch_size, seed), dp_rank_(dp_rank), dp_size_(dp_size) {
  TORCH_CHECK(dataset_, "DataLoader: dataset is null");
  check_data_parallel_split(global_batch_size, dp_rank, dp_size);
}

std::pair<torch::Tensor, torch::Tensor> DataLoader::next() {
  const auto indices = sampler_.local_indices(next_step_, dp_rank_, dp_size_);
  std::vector<torch::Tensor> inputs;
  std::vector<torch::Tensor> targets;
  inputs.reserve(indices.size());
  targets.reserve(indices.size());
  for (int64_t index : indices) {
    auto [x, y] = dataset_->sample(index);
    inputs.push_back(std::move(x));
    targets.push_back(std::move(y));
  }
  ++next_step_;
  return {torch::stack(inputs), torch::stack(targets)};
}

LoaderState DataLoader::state() const {
  LoaderState state;
  state.next_step = next_step_;
  state.seed = sampler_.seed();
  state.global_batch_size = sampler_.global_batch_size();
  return state;
}

void DataLoader::load_state(const LoaderState& state) {
  TORCH_CHECK(state.seed == sampler_.seed(), "loader state has seed ", state.seed,
              " but this run's seed is ", sampler_.seed());
  TORCH_CHECK(state.global_batch_size == sampler_.global_batch_size(),
              "loader state has train.global_batch_size ", state.global_batch_size, " but this run's is ",
              sampler_.global_batch_size());
  TORCH_CHECK(state.next_step >= 0, "loader state has negative next_step ", state.next_step);
  next_step_ = state.next_step;
}

}  // namespace framework::data
