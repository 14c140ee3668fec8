#pragma once
// Dataset choice (config section `data`).
#include <string>

#include "comm/enum_text.h"

namespace framework::data {

// data.kind: synthetic tasks, a text file, pre-tokenized shards, or
// instruction records (sft_dataset.h).
enum class DataKind { kSynthetic, kText, kTokens, kSft };
// data.task: the synthetic task (synthetic_dataset.h).
enum class SyntheticTask { kCopy, kReverse, kAdd };

inline constexpr comm::EnumName<DataKind> kDataKinds[] = {
    {DataKind::kSynthetic, "synthetic"}, {DataKind::kText, "text"}, {DataKind::kTokens, "tokens"},
    {DataKind::kSft, "sft"}};
inline constexpr comm::EnumName<SyntheticTask> kSyntheticTasks[] = {
    {SyntheticTask::kCopy, "copy"}, {SyntheticTask::kReverse, "reverse"}, {SyntheticTask::kAdd, "add"}};

inline const char* to_string(DataKind kind) { return comm::enum_text(kind, kDataKinds); }
inline const char* to_string(SyntheticTask task) { return comm::enum_text(task, kSyntheticTasks); }

// Each throws std::invalid_argument naming the key and the allowed values.
inline DataKind parse_data_kind(const std::string& kind) {
  return comm::parse_enum("data.kind", kind, kDataKinds);
}
inline SyntheticTask parse_synthetic_task(const std::string& task) {
  return comm::parse_enum("data.task", task, kSyntheticTasks);
}

struct DataOptions {
  DataKind kind = DataKind::kSynthetic;
  SyntheticTask task = SyntheticTask::kReverse;  // data.kind synthetic
  // text: the text file. sft: the JSONL records. tokens: the shards, a file, a directory, a glob or
  // a Megatron path prefix (framework/data/token_dataset.h).
  std::string path = "";
  // Held out for validation, never trained on. text: this fraction of the
  // file, its tail; tokens: the trailing whole documents holding at least
  // this fraction; synthetic: any value > 0 turns on a separate stream of
  // samples that training never draws. 0: none.
  double eval_fraction = 0.0;
  // tokens: validation shards of their own (then eval_fraction is unused).
  std::string eval_path = "";
  // tokens: read every token once at start and refuse an id >= vocab_size.
  bool check_tokens = true;
  // The tokenizer (framework/tokenizer): a Hugging Face tokenizer.json, a
  // SentencePiece .model, or bytes. text: tokenizes the file at start
  // (empty: bytes). tokens: the one the shards were made with. Either way
  // train.sample_prompt, generate and the Hugging Face export use it.
  std::string tokenizer = "";
  // sft: pack whole records into each window (attention then crosses the
  // records of a window, causally); false: one record per window.
  bool packed = true;
};

}  // namespace framework::data
