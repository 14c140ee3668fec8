#include "framework/tokenizer/tokenizer.h"

#include <sentencepiece_processor.h>

#include <sys/stat.h>

namespace framework::tokenizer {
namespace {

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

class ByteTokenizer : public Tokenizer {
 public:
  std::vector<int64_t> encode(const std::string& text) const override {
    std::vector<int64_t> ids;
    ids.reserve(text.size());
    for (unsigned char c : text) ids.push_back(c);
    return ids;
  }
  std::string decode(const std::vector<int64_t>& ids) const override {
    std::string out;
    for (int64_t id : ids) out.push_back(static_cast<char>(id & 0xFF));
    return out;
  }
  int64_t vocab_size() const override { return 256; }
  int64_t end_of_text() const override { return -1; }
  std::string describe() const override { return "bytes (256)"; }
};

class SentencePieceTokenizer : public Tokenizer {
 public:
  explicit SentencePieceTokenizer(const std::string& path) : path_(path) {
    const auto status = sp_.Load(path);
    if (!status.ok()) throw TokenizerError(path + ": not a SentencePiece model: " + status.ToString());
  }
  std::vector<int64_t> encode(const std::string& text) const override {
    std::vector<int> ids;
    const auto status = sp_.Encode(text, &ids);
    if (!status.ok()) throw TokenizerError(path_ + ": encoding failed: " + status.ToString());
    return std::vector<int64_t>(ids.begin(), ids.end());
  }
  std::string decode(const std::vector<int64_t>& ids) const override {
    std::vector<int> in;
    for (int64_t id : ids) in.push_back(static_cast<int>(id));
    std::string out;
    const auto status = sp_.Decode(in, &out);
    if (!status.ok()) throw TokenizerError(path_ + ": decoding failed: " + status.ToString());
    return out;
  }
  int64_t vocab_size() const override { return sp_.GetPieceSize(); }
  int64_t end_of_text() const override { return sp_.eos_id(); }
  std::string describe() const override {
    return "sentencepiece '" + path_ + "' (" + std::to_string(sp_.GetPieceSize()) + ")";
  }

 private:
  std::string path_;
  sentencepiece::SentencePieceProcessor sp_;
};

}  // namespace

std::unique_ptr<Tokenizer> load_tokenizer(const std::string& spec) {
  if (spec == "bytes") return std::make_unique<ByteTokenizer>();
  struct stat st {};
  if (::stat(spec.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) {
    throw TokenizerError(spec + ": no such tokenizer file (give a SentencePiece .model, or bytes)");
  }
  if (ends_with(spec, ".json")) {
    throw TokenizerError(spec + ": Hugging Face tokenizer.json (byte-level BPE) is not built in yet; "
                                "a SentencePiece .model or bytes is");
  }
  return std::make_unique<SentencePieceTokenizer>(spec);
}

}  // namespace framework::tokenizer
