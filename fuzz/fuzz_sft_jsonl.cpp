// libFuzzer target: instruction data (data.kind sft), through
// framework::data::read_sft_records -- what SftDataset runs on data.path --
// with the chat tokenizer of the SftDataset tests
// (tests/support/chat_tokenizer.h) or the bytes tokenizer. Byte 0 picks: bits 0-5 model.seq_len - 1, bit 6
// data.packed, bit 7 the bytes tokenizer; the rest is the JSONL file. Anything
// not accepted must end in DataError naming the file; what is accepted must
// be whole windows of seq_len + 1 tokens, each -1 (padding) or an id of the
// vocabulary, with as many trained flags.
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>

#include "framework/data/sft_records.h"
#include "framework/tokenizer/hf_bpe.h"
#include "tests/support/chat_tokenizer.h"

namespace {

std::unique_ptr<framework::tokenizer::Tokenizer> chat_tokenizer() {
  return framework::tokenizer::parse_hf_tokenizer(testing_support::chat_tokenizer_json_text(SHARDKIT_SOURCE_DIR),
                                                  "bpe_fixture.json");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::unique_ptr<framework::tokenizer::Tokenizer> chat = chat_tokenizer();
  static const std::unique_ptr<framework::tokenizer::Tokenizer> bytes = framework::tokenizer::load_tokenizer("bytes");
  if (size == 0) return 0;
  const int64_t seq_len = 1 + (data[0] & 63);
  const bool packed = (data[0] & 64) != 0;
  const framework::tokenizer::Tokenizer& tok = (data[0] & 128) != 0 ? *bytes : *chat;
  std::istringstream in(std::string(reinterpret_cast<const char*>(data + 1), size - 1));
  framework::data::SftWindows w;
  try {
    w = framework::data::read_sft_records(in, "sft.jsonl", tok, seq_len, packed);
  } catch (const framework::data::DataError&) {
    return 0;
  }
  const auto window = static_cast<size_t>(seq_len + 1);
  if (w.stats.records < 1 || w.tokens.empty() || w.tokens.size() % window != 0 ||
      w.trained.size() != w.tokens.size()) {
    std::abort();
  }
  for (size_t t = 0; t < w.tokens.size(); ++t) {
    if (w.tokens[t] < -1 || w.tokens[t] >= tok.vocab_size()) std::abort();
    if (w.tokens[t] == -1 && w.trained[t] != 0) std::abort();  // padding never trains
  }
  return 0;
}
