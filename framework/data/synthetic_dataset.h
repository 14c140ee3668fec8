#pragma once
// Algorithmic tasks a small GPT learns in a few hundred steps.
//
// Tokens: digits 0 .. base-1 with base = vocab_size - 2, kSep = vocab_size - 2,
// kPad = vocab_size - 1. A sequence of seq_len + 1 tokens is
//   copy:    x_1 .. x_k  SEP  x_1 .. x_k                 PAD...
//   reverse: x_1 .. x_k  SEP  x_k .. x_1                 PAD...
//   add:     a_0 .. a_{n-1} SEP b_0 .. b_{n-1} SEP s_0 .. s_n  PAD...
// (add: little-endian digits, s = a + b has n + 1 digits.) inputs = seq[0:T],
// targets = seq[1:T+1] with every target that is not an answer digit set to
// kIgnoreIndex, so the loss is only on f(x).
#include "framework/data/dataset.h"
#include "framework/data/options.h"

#include <vector>

namespace framework::data {

class SyntheticDataset : public Dataset {
 public:
  // num_digits: k for copy/reverse, n (digits per operand) for add; 0 picks the
  // most that fits in seq_len. Errors name model.vocab_size / model.seq_len.
  SyntheticDataset(SyntheticTask task, int64_t vocab_size, int64_t seq_len, uint64_t seed,
                   int64_t num_digits = 0, bool eval = false);

  int64_t seq_len() const override { return seq_len_; }
  int64_t vocab_size() const override { return vocab_size_; }
  std::pair<torch::Tensor, torch::Tensor> sample(int64_t index) const override;
  std::string describe() const override;
  // With eval: unbounded; eval_sample(j) comes from indices 2^62 + j, which
  // training (step * batch + row) never reaches.
  int64_t eval_size() const override;
  std::pair<torch::Tensor, torch::Tensor> eval_sample(int64_t j) const override;

  int64_t num_digits() const { return num_digits_; }
  int64_t base() const { return vocab_size_ - 2; }
  int64_t sep_token() const { return vocab_size_ - 2; }
  int64_t pad_token() const { return vocab_size_ - 1; }
  // Index of the first answer token in the full sequence (answer digits follow).
  int64_t answer_start() const;
  int64_t answer_len() const;

  // The full token sequence of length seq_len + 1 (for tests and debugging).
  std::vector<int64_t> sequence(int64_t index) const;

 private:
  SyntheticTask task_;
  int64_t vocab_size_;
  int64_t seq_len_;
  uint64_t seed_;
  bool eval_ = false;
  int64_t num_digits_;
};

}  // namespace framework::data
