#pragma once
// Deterministic sample sources. sample(i) is a pure function of (seed, i): it does
// not depend on which other samples were drawn before, so any rank can produce any
// global sample and a resumed run sees exactly the samples it would have seen.
#include "framework/data/options.h"
#include "models/options.h"

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace framework::data {

// Targets equal to this carry no loss (matches torch's cross_entropy ignore_index).
constexpr int64_t kIgnoreIndex = -100;

class Dataset {
 public:
  virtual ~Dataset() = default;
  // Targets per sample (tokens for a language model; 1 for a classifier):
  // the trainer's tokens/s counts seq_len() per sample.
  virtual int64_t seq_len() const { return 1; }
  virtual int64_t vocab_size() const { return 0; }  // 0: not a token dataset
  // (inputs, targets), every sample of the same shapes. The token datasets
  // give (int64 [seq_len], int64 [seq_len]); targets may be kIgnoreIndex.
  // REQUIRES: index >= 0. Thread-safe (const, no shared mutable state).
  virtual std::pair<torch::Tensor, torch::Tensor> sample(int64_t index) const = 0;
  virtual std::string describe() const = 0;
  // The files sample() reads, in the order they make the data stream (token
  // shards in name order; a text or JSONL file); empty for data made up in
  // memory. A resume's audit records their names, sizes and a fingerprint
  // (framework/train/resume_audit.h) to say what changed under a run.
  virtual std::vector<std::string> files() const { return {}; }

  // The held-out (validation) samples, disjoint from every sample(i): how
  // many there are (0: none; synthetic: unbounded) and the j-th.
  // REQUIRES: 0 <= j < eval_size().
  virtual int64_t eval_size() const { return 0; }
  virtual std::pair<torch::Tensor, torch::Tensor> eval_sample(int64_t j) const;
};

// Builds the dataset `data` names, sized for `model`. Errors name the field
// (data.kind, data.task, data.path, model.vocab_size, model.seq_len).
std::unique_ptr<Dataset> make_dataset(const DataOptions& data, const models::ModelOptions& model,
                                      uint64_t seed);

// A well-mixed 64-bit hash of (seed, index) (splitmix64 finaliser); the per-sample
// seed every dataset derives its randomness from.
uint64_t mix_seed(uint64_t seed, uint64_t index);

}  // namespace framework::data
