#include "framework/tokenizer/tokenizer.h"

#include "framework/tokenizer/hf_bpe.h"

#include <nlohmann/json.hpp>

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>

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

// A SentencePiece model run by the tokenize binary beside this executable
// (its --info, --encode and --decode modes): see tokenizer.h for why.
class SubprocessTokenizer : public Tokenizer {
 public:
  explicit SubprocessTokenizer(std::string path) : path_(std::move(path)) {
    char self[4096];
    const ssize_t n = ::readlink("/proc/self/exe", self, sizeof(self) - 1);
    const std::string exe = n > 0 ? std::string(self, static_cast<size_t>(n)) : std::string("./x");
    tool_ = exe.substr(0, exe.find_last_of('/') + 1) + "tokenize";
    if (::access(tool_.c_str(), X_OK) != 0) {
      throw TokenizerError(path_ + ": a SentencePiece model needs the tokenize binary beside this one, and " + tool_ +
                           " is not there (build the tokenize target)");
    }
    const auto info = nlohmann::json::parse(run("--info", ""));
    vocab_size_ = info.at("vocab_size").get<int64_t>();
    end_of_text_ = info.at("end_of_text").get<int64_t>();
    describe_ = info.at("describe").get<std::string>();
  }
  std::vector<int64_t> encode(const std::string& text) const override {
    return nlohmann::json::parse(run("--encode", text)).get<std::vector<int64_t>>();
  }
  std::string decode(const std::vector<int64_t>& ids) const override {
    return run("--decode", nlohmann::json(ids).dump());
  }
  int64_t vocab_size() const override { return vocab_size_; }
  int64_t end_of_text() const override { return end_of_text_; }
  std::string describe() const override { return describe_; }

 private:
  static std::string quote(const std::string& s) {
    std::string q = "'";
    for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
    return q + "'";
  }
  std::string run(const char* mode, const std::string& input) const {
    char tmpl[] = "/tmp/shardkit_tokens_XXXXXX";
    const int fd = ::mkstemp(tmpl);
    if (fd < 0) throw std::runtime_error(std::string("cannot create a temporary file: ") + std::strerror(errno));
    ::close(fd);
    std::ofstream(tmpl, std::ios::binary) << input;
    const std::string cmd = quote(tool_) + " --tokenizer " + quote(path_) + " " + mode + " < " + tmpl + " 2>&1";
    std::string out;
    FILE* p = ::popen(cmd.c_str(), "r");
    char buf[4096];
    size_t got;
    while (p != nullptr && (got = std::fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, got);
    const int status = p != nullptr ? ::pclose(p) : -1;
    ::unlink(tmpl);
    if (status != 0) {
      while (!out.empty() && out.back() == '\n') out.pop_back();
      throw TokenizerError(out.rfind("tokenize: ", 0) == 0 ? out.substr(10) : path_ + ": " + out);
    }
    return out;
  }
  std::string path_, tool_, describe_;
  int64_t vocab_size_ = 0, end_of_text_ = -1;
};

}  // namespace

std::unique_ptr<Tokenizer> load_tokenizer(const std::string& spec) {
  if (spec == "bytes") return std::make_unique<ByteTokenizer>();
  struct stat st {};
  if (::stat(spec.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) {
    throw TokenizerError(spec + ": no such tokenizer file (give a Hugging Face tokenizer.json, a SentencePiece "
                                ".model, or bytes)");
  }
  if (ends_with(spec, ".json")) return load_hf_tokenizer(spec);
  if (ends_with(spec, ".model")) return std::make_unique<SubprocessTokenizer>(spec);
  throw TokenizerError(spec + ": not a tokenizer file by its name (tokenizer.json: Hugging Face; *.model: "
                              "SentencePiece)");
}

}  // namespace framework::tokenizer
