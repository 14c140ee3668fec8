#pragma once
// Instruction data (data.kind sft): a JSONL file of records, each
//   {"prompt": "...", "completion": "..."}
// or
//   {"messages": [{"role": "system" | "user" | "assistant" | "tool" | "ipython",
//                  "content": "..."}, ...]}
// tokenized with data.tokenizer; the loss covers only the completion or
// the assistant messages' tokens. Implemented in text_dataset.cpp.
//
// Rendering:
//   prompt/completion: [<|begin_of_text|> when the tokenizer has it]
//     encode(prompt) encode(completion) [end of text, when it has one];
//     trained: the completion's tokens and the end of text.
//   messages: the Llama 3 chat format, as its chat template renders it
//     (content trimmed):
//       <|begin_of_text|> then for each message
//       <|start_header_id|> ROLE <|end_header_id|> "\n\n" CONTENT <|eot_id|>
//     the specials by their ids (Tokenizer::special_token), the text between
//     them encoded as one piece, as the Hugging Face tokenizer does with
//     the rendered string; trained: each assistant message's CONTENT tokens
//     and its <|eot_id|>. A tokenizer without those four specials is refused.
//
// Packing (data.packed, default true): whole records, in file order, fill
// windows of model.seq_len + 1 tokens greedily (a record that does not fit
// starts the next window; one longer than a window is cut to it, and
// counted); the rest of a window is padding that trains nothing. Inputs are
// a window's first seq_len tokens, targets the next token at each position,
// kIgnoreIndex where the next token is not trained (prompts, headers,
// padding, a record's first token). Attention is causal over the whole
// window: a packed record attends to the records before it in its window.
// data.packed false gives each record a window of its own (padding the rest):
// no record sees another.
//
// Sample order: sample(i) is window perm_e((i mod W)) of epoch e = i / W,
// a seeded shuffle that differs each epoch; data.eval_fraction holds out the
// trailing windows (at least one when above 0).
//
// Errors (DataError, one line): a record that is not JSON, or not one of
// the two shapes, or has a role or content of the wrong kind names the file
// and its line; a file with no records, or a tokenizer too large for
// model.vocab_size, names data.path / data.tokenizer.
#include "framework/data/sft_records.h"
#include "framework/data/token_dataset.h"

#include <cstdint>
#include <string>
#include <vector>

namespace framework::data {

class SftDataset : public Dataset {
 public:
  // vocab_limit: model.vocab_size. packed: data.packed.
  SftDataset(const std::string& path, const std::string& tokenizer, int64_t seq_len, int64_t vocab_limit,
             uint64_t seed, double eval_fraction, bool packed);

  int64_t seq_len() const override { return seq_len_; }
  int64_t vocab_size() const override { return vocab_size_; }
  std::pair<torch::Tensor, torch::Tensor> sample(int64_t index) const override;
  std::string describe() const override;
  std::vector<std::string> files() const override { return {path_}; }
  int64_t eval_size() const override { return stats_.eval_windows; }
  std::pair<torch::Tensor, torch::Tensor> eval_sample(int64_t j) const override;

  const SftStats& stats() const { return stats_; }
  // Window w's seq_len + 1 tokens and whether each is trained (the input
  // side of a target): REQUIRES 0 <= w < windows + eval_windows.
  std::pair<std::vector<int64_t>, std::vector<uint8_t>> window(int64_t w) const;

 private:
  std::pair<torch::Tensor, torch::Tensor> make_sample(int64_t w) const;

  std::string path_;
  std::string tokenizer_;  // its describe()
  int64_t seq_len_;
  int64_t vocab_size_ = 0;
  uint64_t seed_;
  bool packed_;
  SftStats stats_;
  // Windows of seq_len + 1 tokens, back to back; -1 is padding.
  std::vector<int32_t> tokens_;
  std::vector<uint8_t> trained_;
  std::vector<int64_t> perm_;  // a seeded shuffle of the training windows
};

}  // namespace framework::data
