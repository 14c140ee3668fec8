#pragma once
// SentencePiece in this process (libsentencepiece), for the torch-free
// tokenize binary only: see tokenizer.h for why nothing with LibTorch links it.
#include "framework/tokenizer/tokenizer.h"

namespace framework::tokenizer {

// As load_tokenizer, with a *.model loaded here rather than through tokenize.
std::unique_ptr<Tokenizer> load_tokenizer_in_process(const std::string& spec);

}  // namespace framework::tokenizer
