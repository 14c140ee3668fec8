#pragma once
// Language modelling over one text file: its bytes (vocab 256), or the ids
// of a tokenizer (data.tokenizer: tokenizer.json or a SentencePiece .model,
// framework/tokenizer), the whole file encoded once at construction. sample(i)
// is the window of seq_len + 1 tokens starting at mix_seed(seed, i) mod
// (tokens - seq_len): inputs are its first seq_len tokens, targets the next
// token at each position. The whole file is read into memory once.
#include "framework/data/dataset.h"

#include <vector>

namespace framework::data {

// A text file's rules, from its size alone (nothing is read): data.path is
// a readable regular file of at least seq_len + 1 bytes, and eval_fraction
// leaves both parts that long. Throws std::invalid_argument naming the key,
// the file and the sizes. Preflight runs it before any rank reads the file.
void check_text_file(const std::string& path, int64_t seq_len, double eval_fraction);

class TextDataset : public Dataset {
 public:
  static constexpr int64_t kVocabSize = 256;

  // Errors: unreadable file (path + strerror); file shorter than seq_len + 1 bytes
  // (path and both sizes).
  // eval_fraction: the file's tail held out for eval_sample (disjoint,
  // consecutive windows); sample() draws from the rest. Errors name
  // data.eval_fraction when either part is shorter than seq_len + 1 bytes.
  // tokenizer: "" or "bytes" for bytes; else a tokenizer file, whose
  // vocabulary must fit vocab_limit (model.vocab_size; errors name both).
  TextDataset(const std::string& path, int64_t seq_len, uint64_t seed, double eval_fraction = 0,
              const std::string& tokenizer = "", int64_t vocab_limit = kVocabSize);

  int64_t seq_len() const override { return seq_len_; }
  int64_t vocab_size() const override { return vocab_size_; }
  std::pair<torch::Tensor, torch::Tensor> sample(int64_t index) const override;
  std::string describe() const override;
  std::vector<std::string> files() const override { return {path_}; }
  int64_t eval_size() const override;
  std::pair<torch::Tensor, torch::Tensor> eval_sample(int64_t j) const override;

  // Byte offset of sample(index)'s window in the file.
  int64_t window_start(int64_t index) const;

 private:
  std::string path_;
  int64_t seq_len_;
  uint64_t seed_;
  std::vector<uint8_t> bytes_;      // bytes: the file
  std::vector<int32_t> ids_;        // a tokenizer: the file's ids (bytes_ then empty)
  int64_t size_ = 0;                // tokens (bytes or ids)
  int64_t vocab_size_ = kVocabSize;
  std::string tokenizer_;           // describe(): the tokenizer's own
  int64_t train_bytes_ = 0;  // tokens [0, train_bytes_) train; the rest is held out
  std::pair<torch::Tensor, torch::Tensor> window(int64_t start) const;
};

}  // namespace framework::data
