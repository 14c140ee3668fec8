#pragma once
// Text to token ids and back, through libraries made for it. Torch-free.
//   - "bytes": byte-level, ids 0-255 (what data.kind text trains; no
//     end-of-text token);
//   - a SentencePiece model (tokenizer.model, Llama 2 style), through
//     Debian's libsentencepiece: the ids spm_encode gives;
// Hugging Face tokenizer.json (byte-level BPE) is not built in yet: loading
// one is refused by name.
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
  // Thread-safe (const; the SentencePiece processor is read-only once loaded).
  virtual std::vector<int64_t> encode(const std::string& text) const = 0;
  virtual std::string decode(const std::vector<int64_t>& ids) const = 0;
  virtual int64_t vocab_size() const = 0;
  // The token put between documents (SentencePiece: </s>); -1: none.
  virtual int64_t end_of_text() const = 0;
  virtual std::string describe() const = 0;
};

// "bytes", or a file: *.model (SentencePiece). Errors name the path.
std::unique_ptr<Tokenizer> load_tokenizer(const std::string& spec);

}  // namespace framework::tokenizer
