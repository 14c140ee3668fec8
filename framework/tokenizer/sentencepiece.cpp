#include "framework/tokenizer/sentencepiece.h"

#include <sentencepiece_processor.h>

#include <sys/stat.h>

namespace framework::tokenizer {
namespace {

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
    for (int64_t id : ids) {
      if (id < 0 || id >= sp_.GetPieceSize()) {
        throw TokenizerError(path_ + ": id " + std::to_string(id) + " is not in the vocabulary (" +
                             std::to_string(sp_.GetPieceSize()) + " ids)");
      }
      in.push_back(static_cast<int>(id));
    }
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

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

}  // namespace

std::unique_ptr<Tokenizer> load_tokenizer_in_process(const std::string& spec) {
  struct stat st {};
  if (ends_with(spec, ".model") && ::stat(spec.c_str(), &st) == 0 && S_ISREG(st.st_mode)) {
    return std::make_unique<SentencePieceTokenizer>(spec);
  }
  return load_tokenizer(spec);
}

}  // namespace framework::tokenizer
