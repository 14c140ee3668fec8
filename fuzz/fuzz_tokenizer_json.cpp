// libFuzzer target: a Hugging Face tokenizer.json (byte-level BPE), through
// framework::tokenizer::parse_hf_tokenizer -- what data.tokenizer, generate
// and tokenize load -- then, when it loads, encoding and decoding text with
// it. The input is the file's text, optionally followed by a NUL byte and
// the text to encode (else a fixed sample with specials and non-ASCII
// text). Anything the reader does not accept, and text that is not UTF-8,
// must end in TokenizerError (a std::invalid_argument, which every caller
// names the file with); never another exception, a crash, a hang or a
// sanitizer report. Ids that encode gives must lie in [0, vocab_size).
#include <cstdint>
#include <cstdlib>
#include <string>

#include "framework/tokenizer/hf_bpe.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string input(reinterpret_cast<const char*>(data), size);
  const size_t nul = input.find('\0');
  const std::string file = input.substr(0, nul);
  const std::string text = nul == std::string::npos
                               ? std::string("Hello, world! <|endoftext|> caf\xc3\xa9 \xe4\xbd\xa0\xe5\xa5\xbd 123 'll\n\n")
                               : input.substr(nul + 1);
  std::unique_ptr<framework::tokenizer::Tokenizer> tok;
  try {
    tok = framework::tokenizer::parse_hf_tokenizer(file, "tokenizer.json");
  } catch (const framework::tokenizer::TokenizerError&) {
    return 0;
  }
  (void)tok->special_token("<|eot_id|>");
  (void)tok->end_of_text();
  try {
    const std::vector<int64_t> ids = tok->encode(text);
    for (int64_t id : ids) {
      if (id < 0 || id >= tok->vocab_size()) std::abort();  // an id outside the vocabulary
    }
    (void)tok->decode(ids);
  } catch (const framework::tokenizer::TokenizerError&) {
  }
  return 0;
}
