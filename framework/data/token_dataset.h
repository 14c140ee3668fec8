#pragma once
// Pre-tokenized shards (data.kind tokens), memory-mapped and never read whole.
//
// Formats, told apart per file:
//   - llm.c's .bin: 256 little-endian int32s of header (magic 20240520 with
//     version 1 and uint16 tokens, as GPT-2 data; magic 20240801 with
//     version 7 and uint32 tokens, as llm.c's Llama 3 data; header[2] the
//     token count), the tokens from byte 1024;
//   - Megatron-LM's indexed dataset: X.bin of raw tokens beside X.idx
//     ("MMIDIDX\0\0", version 1, a dtype code, then the sequence lengths,
//     sequence pointers and document indices). Its documents are kept.
// The shards, in name order, make one stream of tokens. Document boundaries
// are Megatron's documents and the start of every shard.
//
// Samples are windows of seq_len + 1 tokens, packed across documents: window
// k covers stream tokens [k * seq_len, k * seq_len + seq_len]. An epoch visits
// every window of the training part once, in an order drawn from (seed,
// epoch): sample(i) is a pure function of (seed, i), whatever the world size.
//
// Validation: eval_path (a separate set of shards), or eval_fraction held out
// as the trailing whole documents of the stream, never overlapping training;
// where whole documents would leave no training tokens (one document, such
// as a single llm.c shard), the stream's last eval_fraction of tokens.
//
// Every error is a DataError naming the file and, for bad bytes, the offset.
#include "framework/data/dataset.h"
#include "framework/data/token_shard.h"

#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace framework::data {

struct TokenDatasetOptions {
  std::string path;            // data.path
  std::string eval_path;       // data.eval_path ("" none)
  double eval_fraction = 0;    // data.eval_fraction (ignored when eval_path is set)
  int64_t seq_len = 0;         // model.seq_len
  int64_t vocab_size = 0;      // model.vocab_size: every token id must be below it
  uint64_t seed = 0;           // run.seed
  // Read every token once at construction and refuse an id >= vocab_size
  // (data.check_tokens). Windows are checked when read either way.
  bool check_tokens = true;
};

class TokenDataset : public Dataset {
 public:
  explicit TokenDataset(const TokenDatasetOptions& options);

  int64_t seq_len() const override { return options_.seq_len; }
  int64_t vocab_size() const override { return options_.vocab_size; }
  std::pair<torch::Tensor, torch::Tensor> sample(int64_t index) const override;
  std::string describe() const override;
  std::vector<std::string> files() const override;  // the training shards, in stream order
  int64_t eval_size() const override;
  std::pair<torch::Tensor, torch::Tensor> eval_sample(int64_t j) const override;

  // Token offset in the stream of sample(index)'s window.
  int64_t window_start(int64_t index) const;
  int64_t windows_per_epoch() const { return windows_; }
  int64_t train_tokens() const { return train_tokens_; }
  int64_t eval_tokens() const;
  const std::vector<TokenShard>& shards() const { return shards_; }
  const std::vector<TokenShard>& eval_shards() const { return eval_shards_; }
  // Stream tokens [start, start + n) of the training shards (held-out part
  // included) as int64, checked against vocab_size.
  std::vector<int64_t> read(int64_t start, int64_t n) const;

 private:
  TokenDatasetOptions options_;
  std::vector<TokenShard> shards_, eval_shards_;
  std::vector<int64_t> shard_starts_, eval_shard_starts_;  // stream offset of each shard
  int64_t total_tokens_ = 0;
  int64_t train_tokens_ = 0;   // [0, train_tokens_) trains
  int64_t eval_begin_ = 0;     // the held-out tokens start here (eval_fraction)
  int64_t windows_ = 0;
  int64_t read_ = 0, known_ = 0;  // data.check_tokens: files read here, files checked before in this job
  int64_t held_out_docs_ = 0;
  bool eval_within_document_ = false;  // eval_fraction cut a document (see split_for_eval_fraction)
  bool eval_from_directory_ = false;   // data.path is a directory of train_* and val_* shards
  int64_t directory_val_skipped_ = 0;  // its val_* shards, left out of training (data.eval_path set)
  std::pair<torch::Tensor, torch::Tensor> window(const std::vector<TokenShard>& shards,
                                                 const std::vector<int64_t>& starts,
                                                 int64_t start) const;
};

}  // namespace framework::data
