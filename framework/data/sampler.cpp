#include "framework/data/sampler.h"

#include <c10/util/Exception.h>

#include <cstring>
#include <stdexcept>
#include <string>

namespace framework::data {
namespace {

constexpr char kMagic[4] = {'S', 'K', 'D', 'L'};
constexpr uint8_t kVersion = 1;
constexpr size_t kEncodedSize = 4 + 1 + 3 * 8;

void put_u64(std::vector<uint8_t>& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<uint8_t>(v >> (8 * i)));
}

uint64_t get_u64(const std::vector<uint8_t>& in, size_t at) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(in[at + i]) << (8 * i);
  return v;
}

}  // namespace

GlobalBatchSampler::GlobalBatchSampler(int64_t global_batch_size, uint64_t seed)
    : global_batch_size_(global_batch_size), seed_(seed) {
  TORCH_CHECK(global_batch_size > 0, "train.global_batch_size must be positive, got ", global_batch_size);
}

std::vector<int64_t> GlobalBatchSampler::global_indices(int64_t step) const {
  TORCH_CHECK(step >= 0, "step must be >= 0, got ", step);
  std::vector<int64_t> indices(global_batch_size_);
  for (int64_t j = 0; j < global_batch_size_; ++j) indices[j] = step * global_batch_size_ + j;
  return indices;
}

std::vector<int64_t> GlobalBatchSampler::local_indices(int64_t step, int dp_rank, int dp_size) const {
  check_data_parallel_split(global_batch_size_, dp_rank, dp_size);
  const auto global = global_indices(step);
  const int64_t local = global_batch_size_ / dp_size;
  return std::vector<int64_t>(global.begin() + dp_rank * local, global.begin() + (dp_rank + 1) * local);
}

void check_data_parallel_split(int64_t global_batch_size, int dp_rank, int dp_size) {
  TORCH_CHECK(dp_size > 0, "data-parallel size must be positive, got ", dp_size);
  TORCH_CHECK(dp_rank >= 0 && dp_rank < dp_size, "data-parallel rank ", dp_rank, " out of range [0, ",
              dp_size, ")");
  TORCH_CHECK(global_batch_size % dp_size == 0, "train.global_batch_size (", global_batch_size,
              ") must be divisible by the data-parallel size (", dp_size, ")");
}

std::vector<uint8_t> encode_loader_state(const LoaderState& state) {
  std::vector<uint8_t> out(kMagic, kMagic + 4);
  out.push_back(kVersion);
  put_u64(out, static_cast<uint64_t>(state.next_step));
  put_u64(out, state.seed);
  put_u64(out, static_cast<uint64_t>(state.global_batch_size));
  return out;
}

LoaderState decode_loader_state(const std::vector<uint8_t>& bytes) {
  if (bytes.size() != kEncodedSize) {
    throw std::runtime_error("loader state: expected " + std::to_string(kEncodedSize) + " bytes, got " +
                             std::to_string(bytes.size()));
  }
  if (std::memcmp(bytes.data(), kMagic, 4) != 0) throw std::runtime_error("loader state: bad magic");
  if (bytes[4] != kVersion) {
    throw std::runtime_error("loader state: unsupported version " + std::to_string(bytes[4]));
  }
  LoaderState state;
  state.next_step = static_cast<int64_t>(get_u64(bytes, 5));
  state.seed = get_u64(bytes, 13);
  state.global_batch_size = static_cast<int64_t>(get_u64(bytes, 21));
  if (state.next_step < 0 || state.global_batch_size <= 0) {
    throw std::runtime_error("loader state: invalid next_step " + std::to_string(state.next_step) +
                             " or global_batch_size " + std::to_string(state.global_batch_size));
  }
  return state;
}

}  // namespace framework::data
