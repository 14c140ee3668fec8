#pragma once
// Continuing a sequence of token ids with a trained model: greedy, or
// sampled with temperature, top-k and top-p from a seeded generator. A llama
// keeps a KV cache (one forward of the new token per step); other kinds
// re-run the whole window (the last model.seq_len tokens) each step.
#include "models/layered_model.h"

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <vector>

namespace models {

struct SamplingOptions {
  double temperature = 0;  // 0: greedy (argmax)
  int64_t top_k = 0;       // keep the k most likely tokens; 0: all
  double top_p = 1.0;      // keep the smallest set whose probability reaches p; 1: all
  uint64_t seed = 0;       // of the sampling generator
};

// The next token from the logits of the last position ([vocab], any float
// dtype). Greedy picks the first of equal maxima.
int64_t sample_next(const torch::Tensor& logits, const SamplingOptions& options, at::Generator& gen);

// `max_new` tokens after `prompt` (REQUIRES: prompt not empty, ids below the
// vocabulary). `on_token` (may be null) sees each one as it is made.
// `seq_len`: the window re-run models see (model.seq_len). use_cache false
// makes a llama re-run the whole sequence too (for tests).
// `forward` (optional, for the re-run path): how to run the model on
// tokens [1, T], e.g. inside FullyShardedModel::forward for a sharded model.
std::vector<int64_t> generate(LayeredModelImpl& model, int64_t seq_len, const std::vector<int64_t>& prompt,
                              int64_t max_new,
                              const SamplingOptions& options, const std::function<void(int64_t)>& on_token = {},
                              bool use_cache = true,
                              const std::function<torch::Tensor(const torch::Tensor&)>& forward = {});

}  // namespace models
