#pragma once
// Which samples make up each step's global batch, independent of world size, and
// the bytes that record a loader's position in that sequence.
//
// Loader state format (29 bytes, little-endian):
//   0..3   magic "SKDL"
//   4      version (1)
//   5..12  next_step          int64
//   13..20 seed               uint64
//   21..28 global_batch_size  int64
#include <cstdint>
#include <vector>

namespace framework::data {

class GlobalBatchSampler {
 public:
  // REQUIRES: global_batch_size > 0 (TORCH_CHECK, names train.global_batch_size).
  GlobalBatchSampler(int64_t global_batch_size, uint64_t seed);

  // Sample indices of step `step`'s global batch: step*G .. step*G+G-1. Datasets
  // hash (seed, index), so consecutive indices are already independent samples;
  // the seed lives in the dataset and is kept here only to validate resumes.
  std::vector<int64_t> global_indices(int64_t step) const;

  // Rows [rank*G/n, (rank+1)*G/n) of global_indices(step). REQUIRES: G % dp_size == 0
  // (TORCH_CHECK naming train.global_batch_size and the data-parallel size).
  std::vector<int64_t> local_indices(int64_t step, int dp_rank, int dp_size) const;

  int64_t global_batch_size() const { return global_batch_size_; }
  uint64_t seed() const { return seed_; }

 private:
  int64_t global_batch_size_;
  uint64_t seed_;
};

// Throws c10::Error unless global_batch_size splits evenly over dp_size ranks and
// 0 <= dp_rank < dp_size.
void check_data_parallel_split(int64_t global_batch_size, int dp_rank, int dp_size);

// A loader's world-size-independent position: the next global step to load.
struct LoaderState {
  int64_t next_step = 0;
  uint64_t seed = 0;
  int64_t global_batch_size = 0;
};

std::vector<uint8_t> encode_loader_state(const LoaderState& state);
// Throws std::runtime_error on a wrong size, magic or version.
LoaderState decode_loader_state(const std::vector<uint8_t>& bytes);

}  // namespace framework::data
