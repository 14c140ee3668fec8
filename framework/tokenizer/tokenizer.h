#pragma once
// Text to token ids and back, through libraries made for it. Torch-free.
//   - "bytes": byte-level, ids 0-255 (no end-of-text token);
//   - a Hugging Face tokenizer.json with a byte-level BPE model (GPT-2, the
//     Llama 3 family): hf_bpe.h, regexes through PCRE2;
//   - a SentencePiece model (tokenizer.model, Llama 2 style), through
//     Debian's libsentencepiece: the ids spm_encode gives.
// libsentencepiece carries its own protobuf-lite, which crashes at load time
// in a process that also loads LibTorch's libprotobuf. So load_tokenizer runs
// a .model through the `tokenize` binary beside the running executable
// (--encode/--decode), and only the torch-free tokenize links it
// (framework_tokenizer_spm, load_tokenizer_in_process).
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace framework::tokenizer {

class TokenizerError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  // Thread-safe (const; every tokenizer is read-only once loaded).
  virtual std::vector<int64_t> encode(const std::string& text) const = 0;
  virtual std::string decode(const std::vector<int64_t>& ids) const = 0;
  virtual int64_t vocab_size() const = 0;
  // The token put between documents (<|endoftext|>, <|end_of_text|>, </s>);
  // -1: none.
  virtual int64_t end_of_text() const = 0;
  virtual std::string describe() const = 0;
  // The id of the special (added) token spelled `content`, e.g. Llama 3's
  // "<|start_header_id|>"; -1 when this tokenizer has none.
  virtual int64_t special_token(const std::string& /*content*/) const { return -1; }
};

// "bytes", a *.json (Hugging Face) or a *.model (SentencePiece, through the
// tokenize binary). Errors name the path.
std::unique_ptr<Tokenizer> load_tokenizer(const std::string& spec);

}  // namespace framework::tokenizer
