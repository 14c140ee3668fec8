#pragma once
// Dataset choice (config section `data`).
#include <string>

namespace framework::data {

struct DataOptions {
  std::string kind = "synthetic";  // synthetic | text | tokens
  std::string task = "reverse";    // synthetic task: copy | reverse | add
  // text: the text file. tokens: the shards, a file, a directory, a glob or
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
};

}  // namespace framework::data
