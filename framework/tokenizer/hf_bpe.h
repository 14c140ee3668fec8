#pragma once
// Hugging Face tokenizer.json, byte-level BPE (GPT-2, the Llama 3 family):
// the ids the Rust `tokenizers` crate gives with add_special_tokens=False.
// The pre-tokenizer regexes run on PCRE2 (Debian's libpcre2-dev) with
// Unicode properties. Torch-free, no SentencePiece: links into any process.
#include "framework/tokenizer/tokenizer.h"

namespace framework::tokenizer {

// Errors (TokenizerError) name the file and the part it does not support.
std::unique_ptr<Tokenizer> load_hf_tokenizer(const std::string& path);
// The same from the file's text; errors name `name` (fuzz/fuzz_tokenizer_json.cpp).
std::unique_ptr<Tokenizer> parse_hf_tokenizer(const std::string& json_text, const std::string& name);

}  // namespace framework::tokenizer
