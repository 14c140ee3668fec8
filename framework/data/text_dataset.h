#pragma once
// Byte-level language modelling over one text file (vocab 256). sample(i) is the
// window of seq_len + 1 bytes starting at mix_seed(seed, i) mod (file_len - seq_len):
// inputs are its first seq_len bytes, targets the next byte at each position.
// The whole file is read into memory once at construction.
#include "framework/data/dataset.h"

#include <vector>

namespace framework::data {

class TextDataset : public Dataset {
 public:
  static constexpr int64_t kVocabSize = 256;

  // Errors: unreadable file (path + strerror); file shorter than seq_len + 1 bytes
  // (path and both sizes).
  TextDataset(const std::string& path, int64_t seq_len, uint64_t seed);

  int64_t seq_len() const override { return seq_len_; }
  int64_t vocab_size() const override { return kVocabSize; }
  std::pair<torch::Tensor, torch::Tensor> sample(int64_t index) const override;
  std::string describe() const override;

  // Byte offset of sample(index)'s window in the file.
  int64_t window_start(int64_t index) const;

 private:
  std::string path_;
  int64_t seq_len_;
  uint64_t seed_;
  std::vector<uint8_t> bytes_;
};

}  // namespace framework::data
