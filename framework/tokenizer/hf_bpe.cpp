// A Hugging Face tokenizer.json with a byte-level BPE model (GPT-2, the Llama 3
// family, ...), encoded the way the Rust `tokenizers` crate does with
// add_special_tokens=False:
//   1. added tokens (specials such as <|endoftext|>) are cut out of the text
//      first, leftmost-longest, honouring lstrip/rstrip;
//   2. the pre-tokenizer steps split the rest: Split (a regex through PCRE2
//      in UTF + Unicode-property mode; behaviour Isolated or Removed) and
//      ByteLevel (GPT-2's regex when use_regex, an optional prefix space);
//   3. each piece's bytes become GPT-2's byte-level characters and BPE merges
//      them, lowest merge rank first, leftmost among equals (ignore_merges: a
//      piece that is a whole vocabulary entry is taken as it is).
// Components a byte-level BPE file does not use (normalizers, Metaspace,
// byte_fallback, dropout, ...) are refused by name, never guessed at.
#include "framework/tokenizer/hf_bpe.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <climits>
#include <fstream>
#include <sstream>
#include <unordered_map>

namespace framework::tokenizer {
namespace {

using nlohmann::json;

// GPT-2's pre-tokenizer regex (ByteLevel with use_regex).
constexpr const char* kGpt2Pattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

std::string utf8(uint32_t cp) {
  std::string s;
  if (cp < 0x80) {
    s += static_cast<char>(cp);
  } else if (cp < 0x800) {
    s += static_cast<char>(0xC0 | (cp >> 6));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    s += static_cast<char>(0xE0 | (cp >> 12));
    s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    s += static_cast<char>(0xF0 | (cp >> 18));
    s += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  }
  return s;
}

// The byte offset of the first invalid UTF-8 sequence, or npos.
size_t invalid_utf8_at(const std::string& s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  for (size_t i = 0; i < n;) {
    const unsigned c = p[i];
    size_t len;
    uint32_t min;
    if (c < 0x80) {
      ++i;
      continue;
    } else if ((c & 0xE0) == 0xC0) {
      len = 2, min = 0x80;
    } else if ((c & 0xF0) == 0xE0) {
      len = 3, min = 0x800;
    } else if ((c & 0xF8) == 0xF0) {
      len = 4, min = 0x10000;
    } else {
      return i;
    }
    if (i + len > n) return i;
    uint32_t cp = c & (0x7F >> len);
    for (size_t k = 1; k < len; ++k) {
      if ((p[i + k] & 0xC0) != 0x80) return i;
      cp = (cp << 6) | (p[i + k] & 0x3F);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return i;
    i += len;
  }
  return std::string::npos;
}

// A compiled PCRE2 pattern; matching is thread-safe (match data per call).
class Regex {
 public:
  Regex(const std::string& pattern, bool literal, const std::string& where) {
    int err = 0;
    PCRE2_SIZE at = 0;
    const uint32_t options = PCRE2_UTF | PCRE2_UCP | PCRE2_NO_UTF_CHECK | (literal ? PCRE2_LITERAL : 0);
    code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), options, &err, &at, nullptr);
    if (code_ == nullptr) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(err, msg, sizeof(msg));
      throw TokenizerError(where + ": the regex does not compile with PCRE2 at offset " + std::to_string(at) + ": " +
                           reinterpret_cast<const char*>(msg));
    }
    pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE);  // optional: the interpreter serves where JIT is missing
  }
  ~Regex() { pcre2_code_free(code_); }
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // [start, end) of every non-empty match in order (empty matches are skipped,
  // as the Rust crate drops empty splits).
  std::vector<std::pair<size_t, size_t>> matches(const std::string& s) const {
    std::vector<std::pair<size_t, size_t>> out;
    pcre2_match_data* md = pcre2_match_data_create_from_pattern(code_, nullptr);
    size_t pos = 0;
    while (pos <= s.size()) {
      const int rc = pcre2_match(code_, reinterpret_cast<PCRE2_SPTR>(s.data()), s.size(), pos, PCRE2_NO_UTF_CHECK,
                                 md, nullptr);
      if (rc == PCRE2_ERROR_NOMATCH) break;
      if (rc < 0) {
        pcre2_match_data_free(md);
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(rc, msg, sizeof(msg));
        throw TokenizerError(std::string("regex match failed: ") + reinterpret_cast<const char*>(msg));
      }
      const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
      if (ov[1] > ov[0]) {
        out.emplace_back(ov[0], ov[1]);
        pos = ov[1];
      } else {  // empty: step one character on
        pos = ov[0] + 1;
        while (pos < s.size() && (static_cast<unsigned char>(s[pos]) & 0xC0) == 0x80) ++pos;
      }
    }
    pcre2_match_data_free(md);
    return out;
  }

 private:
  pcre2_code* code_ = nullptr;
};

struct Split {
  std::unique_ptr<Regex> regex;
  bool removed = false;  // behaviour Removed (else Isolated)
};

struct AddedToken {
  std::string content;
  int64_t id;
  bool lstrip, rstrip;
};

bool is_space(unsigned char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f'; }

class HfBpeTokenizer : public Tokenizer {
 public:
  explicit HfBpeTokenizer(const std::string& path) : path_(path) {
    std::ifstream in(path, std::ios::binary);
    if (!in) throw TokenizerError(path + ": cannot open");
    json j;
    try {
      j = json::parse(in);
    } catch (const json::exception& e) {
      throw TokenizerError(path + ": not JSON: " + e.what());
    }
    load_checked(j);
  }
  HfBpeTokenizer(const std::string& json_text, const std::string& name) : path_(name) {
    json j;
    try {
      j = json::parse(json_text);
    } catch (const json::exception& e) {
      throw TokenizerError(name + ": not JSON: " + e.what());
    }
    load_checked(j);
  }

  std::vector<int64_t> encode(const std::string& text) const override {
    const size_t bad = invalid_utf8_at(text);
    if (bad != std::string::npos) throw TokenizerError("text is not valid UTF-8 at byte " + std::to_string(bad));
    std::vector<int64_t> ids;
    size_t start = 0;
    while (start < text.size()) {
      size_t at, end, cut_from, cut_to;
      const AddedToken* tok = next_added(text, start, &at, &end, &cut_from, &cut_to);
      encode_plain(text.substr(start, (tok ? cut_from : text.size()) - start), &ids);
      if (tok == nullptr) break;
      ids.push_back(tok->id);
      start = cut_to;
    }
    return ids;
  }

  std::string decode(const std::vector<int64_t>& ids) const override {
    std::string out;
    for (int64_t id : ids) {
      if (id < 0 || id >= static_cast<int64_t>(id_to_token_.size()) || !has_id_[static_cast<size_t>(id)]) {
        throw TokenizerError(path_ + ": id " + std::to_string(id) + " is not in the vocabulary (" +
                             std::to_string(id_to_token_.size()) + " ids)");
      }
      const std::string& t = id_to_token_[static_cast<size_t>(id)];
      if (added_ids_.count(id) != 0) {  // added tokens decode as themselves
        out += t;
        continue;
      }
      for (size_t i = 0; i < t.size();) {  // byte-level characters back to bytes
        const auto c = static_cast<unsigned char>(t[i]);
        const size_t len = c < 0x80 ? 1 : (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : 4;
        const auto it = char_to_byte_.find(t.substr(i, len));
        if (it != char_to_byte_.end()) {
          out += static_cast<char>(it->second);
        } else {
          out += t.substr(i, len);
        }
        i += len;
      }
    }
    return out;
  }

  int64_t vocab_size() const override { return static_cast<int64_t>(id_to_token_.size()); }
  int64_t end_of_text() const override { return end_of_text_; }
  int64_t special_token(const std::string& content) const override {
    for (const auto& a : added_) {
      if (a.content == content) return a.id;
    }
    return -1;
  }
  std::string describe() const override {
    return "tokenizer.json '" + path_ + "' (byte-level BPE, " + std::to_string(vocab_size()) + ")";
  }

 private:
  [[noreturn]] void refuse(const std::string& what) const {
    throw TokenizerError(path_ + ": " + what + " is not supported (byte-level BPE tokenizer.json files, as GPT-2's "
                                               "and Llama 3's, are; for a SentencePiece model give its .model)");
  }

  void load_checked(const json& j) {
    try {
      load(j);
    } catch (const json::exception& e) {
      throw TokenizerError(path_ + ": not a tokenizer.json this reader knows: " + e.what());
    }
  }

  void load(const json& j) {
    make_byte_chars();
    check_pipeline(j);
    const json& m = j.at("model");
    check_model(m);
    load_vocab(m, j.contains("added_tokens") ? j["added_tokens"] : json::array());
    load_merges(m);
    for (const char* name : {"<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>"}) {
      for (const auto& a : added_) {
        if (a.content == name && end_of_text_ < 0) end_of_text_ = a.id;
      }
    }
  }

  // Byte-level characters: GPT-2's bytes_to_unicode.
  void make_byte_chars() {
    std::vector<int> bs;
    for (int b = '!'; b <= '~'; ++b) bs.push_back(b);
    for (int b = 0xA1; b <= 0xAC; ++b) bs.push_back(b);
    for (int b = 0xAE; b <= 0xFF; ++b) bs.push_back(b);
    std::vector<uint32_t> cp(256, 0);
    for (int b : bs) cp[static_cast<size_t>(b)] = static_cast<uint32_t>(b);
    uint32_t n = 0;
    for (int b = 0; b < 256; ++b) {
      if (std::find(bs.begin(), bs.end(), b) == bs.end()) cp[static_cast<size_t>(b)] = 256 + n++;
    }
    for (int b = 0; b < 256; ++b) {
      byte_char_[static_cast<size_t>(b)] = utf8(cp[static_cast<size_t>(b)]);
      char_to_byte_[byte_char_[static_cast<size_t>(b)]] = static_cast<unsigned char>(b);
    }
  }

  // No normalizer, a pre-tokenizer with ByteLevel, a ByteLevel decoder.
  void check_pipeline(const json& j) {
    if (j.contains("normalizer") && !j["normalizer"].is_null()) {
      refuse("normalizer " + j["normalizer"].value("type", std::string("?")));
    }
    load_pre_tokenizer(j.contains("pre_tokenizer") ? j["pre_tokenizer"] : json());
    if (!has_byte_level_) refuse("a pre-tokenizer without ByteLevel");
    if (j.contains("decoder") && !j["decoder"].is_null()) {
      const json& d = j["decoder"];
      const std::string type = d.value("type", "");
      if (type != "ByteLevel") refuse("decoder " + type);
    }
  }

  // A plain BPE model: no dropout, no byte fallback, no subword affixes.
  void check_model(const json& m) {
    if (m.value("type", std::string("BPE")) != "BPE") refuse("model " + m.value("type", std::string()));
    if (m.contains("dropout") && !m["dropout"].is_null()) refuse("BPE dropout");
    if (m.value("byte_fallback", false)) refuse("byte_fallback");
    for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
      if (m.contains(key) && m[key].is_string() && !m[key].get<std::string>().empty()) refuse(key);
    }
    ignore_merges_ = m.value("ignore_merges", false);
  }

  // model.vocab and the added tokens (`added_tokens`, an array): ids both
  // ways, the added tokens by their first byte (longest first), the unknown
  // token and each byte's id.
  // A token id: a JSON integer in [0, kMaxTokenId). (A float, or a huge
  // id that would size the id table, is refused naming `what`.)
  static constexpr int64_t kMaxTokenId = int64_t{1} << 22;
  int64_t token_id(const json& v, const std::string& what) const {
    if (!v.is_number_integer()) throw TokenizerError(path_ + ": " + what + " has an id that is not an integer");
    const int64_t id = v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(kMaxTokenId)
                           ? kMaxTokenId
                           : v.get<int64_t>();
    if (id < 0 || id >= kMaxTokenId) {
      throw TokenizerError(path_ + ": " + what + " has id " + v.dump() + ", outside [0, " + std::to_string(kMaxTokenId) +
                           ")");
    }
    return id;
  }

  void load_vocab(const json& m, const json& added_tokens) {
    int64_t max_id = -1;
    for (const auto& [token, id] : m.at("vocab").items()) {
      max_id = std::max(max_id, token_id(id, "model.vocab '" + token + "'"));
    }
    std::vector<AddedToken> added;
    for (const json& a : added_tokens) {
      if (a.value("single_word", false)) refuse("added token '" + a.at("content").get<std::string>() + "' single_word");
      const std::string content = a.at("content").get<std::string>();
      added.push_back({content, token_id(a.at("id"), "added token '" + content + "'"), a.value("lstrip", false),
                       a.value("rstrip", false)});
      max_id = std::max(max_id, added.back().id);
    }
    id_to_token_.assign(static_cast<size_t>(max_id + 1), std::string());
    has_id_.assign(static_cast<size_t>(max_id + 1), false);
    for (const auto& [token, id] : m.at("vocab").items()) {
      const int64_t i = token_id(id, "model.vocab '" + token + "'");
      vocab_.emplace(token, i);
      id_to_token_[static_cast<size_t>(i)] = token;
      has_id_[static_cast<size_t>(i)] = true;
    }
    for (const auto& a : added) {
      id_to_token_[static_cast<size_t>(a.id)] = a.content;
      has_id_[static_cast<size_t>(a.id)] = true;
      added_ids_.insert({a.id, true});
      if (!a.content.empty()) added_.push_back(a);
    }
    std::stable_sort(added_.begin(), added_.end(),
                     [](const AddedToken& a, const AddedToken& b) { return a.content.size() > b.content.size(); });
    for (const AddedToken& a : added_) by_first_byte_[static_cast<unsigned char>(a.content[0])].push_back(&a);
    if (m.contains("unk_token") && m["unk_token"].is_string()) {
      const auto it = vocab_.find(m["unk_token"].get<std::string>());
      if (it != vocab_.end()) unk_ = it->second;
    }
    for (size_t b = 0; b < 256; ++b) {
      const auto it = vocab_.find(byte_char_[b]);
      byte_id_[b] = it == vocab_.end() ? -1 : it->second;
    }
  }

  // model.merges, in rank order: "a b" strings or ["a", "b"] pairs.
  void load_merges(const json& m) {
    int32_t rank = 0;
    for (const json& merge : m.at("merges")) {
      std::string a, b;
      if (merge.is_string()) {  // "a b" (the older layout)
        const std::string s = merge.get<std::string>();
        const size_t sp = s.find(' ');
        if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos) {
          throw TokenizerError(path_ + ": model.merges[" + std::to_string(rank) + "] '" + s + "' is not two tokens");
        }
        a = s.substr(0, sp), b = s.substr(sp + 1);
      } else {  // ["a", "b"] (tokenizers >= 0.20)
        a = merge.at(0).get<std::string>(), b = merge.at(1).get<std::string>();
      }
      const auto ia = vocab_.find(a), ib = vocab_.find(b), iab = vocab_.find(a + b);
      if (ia == vocab_.end() || ib == vocab_.end() || iab == vocab_.end()) {
        throw TokenizerError(path_ + ": model.merges[" + std::to_string(rank) + "] '" + a + " " + b +
                             "' names a token that is not in model.vocab");
      }
      merges_.emplace(pair_key(ia->second, ib->second), std::make_pair(rank, iab->second));
      ++rank;
    }
  }

  void load_pre_tokenizer(const json& p) {
    if (p.is_null()) return;
    const std::string type = p.value("type", "");
    if (type == "Sequence") {
      for (const json& step : p.at("pretokenizers")) load_pre_tokenizer(step);
    } else if (type == "Split") {
      if (has_byte_level_) refuse("a Split after ByteLevel");
      if (p.value("invert", false)) refuse("Split with invert");
      const std::string behavior = p.value("behavior", "Isolated");
      if (behavior != "Isolated" && behavior != "Removed") refuse("Split behavior " + behavior);
      const json& pat = p.at("pattern");
      const bool literal = pat.contains("String");
      const std::string text = literal ? pat["String"].get<std::string>() : pat.at("Regex").get<std::string>();
      Split s;
      s.regex = std::make_unique<Regex>(text, literal, path_ + ": pre_tokenizer Split pattern");
      s.removed = behavior == "Removed";
      splits_.push_back(std::move(s));
    } else if (type == "ByteLevel") {
      if (has_byte_level_) refuse("two ByteLevel pre-tokenizers");
      has_byte_level_ = true;
      add_prefix_space_ = p.value("add_prefix_space", false);
      if (p.value("use_regex", true)) {
        Split s;
        s.regex = std::make_unique<Regex>(kGpt2Pattern, false, path_ + ": ByteLevel");
        byte_level_split_ = std::move(s);
      }
    } else {
      refuse("pre_tokenizer " + type);
    }
  }

  static uint64_t pair_key(int64_t a, int64_t b) {
    return (static_cast<uint64_t>(a) << 32) | static_cast<uint32_t>(b);
  }

  // The next added token at or after `from`: [at, end) is its text; the cut
  // [cut_from, cut_to) also takes the whitespace lstrip/rstrip absorb.
  const AddedToken* next_added(const std::string& text, size_t from, size_t* at, size_t* end, size_t* cut_from,
                               size_t* cut_to) const {
    if (added_.empty()) return nullptr;
    for (size_t i = from; i < text.size(); ++i) {
      for (const AddedToken* ap : by_first_byte_[static_cast<unsigned char>(text[i])]) {  // longest first
        const AddedToken& a = *ap;
        if (text.compare(i, a.content.size(), a.content) != 0) continue;
        *at = i, *end = i + a.content.size();
        *cut_from = *at, *cut_to = *end;
        if (a.lstrip) {
          while (*cut_from > from && is_space(static_cast<unsigned char>(text[*cut_from - 1]))) --*cut_from;
        }
        if (a.rstrip) {
          while (*cut_to < text.size() && is_space(static_cast<unsigned char>(text[*cut_to]))) ++*cut_to;
        }
        return &a;
      }
    }
    return nullptr;
  }

  static void split(const Split& s, const std::string& piece, std::vector<std::string>* out) {
    size_t last = 0;
    for (const auto& [b, e] : s.regex->matches(piece)) {
      if (b > last) out->push_back(piece.substr(last, b - last));
      if (!s.removed) out->push_back(piece.substr(b, e - b));
      last = e;
    }
    if (last < piece.size()) out->push_back(piece.substr(last));
  }

  void encode_plain(const std::string& text, std::vector<int64_t>* ids) const {
    if (text.empty()) return;
    std::vector<std::string> pieces{text}, next;
    for (const Split& s : splits_) {
      next.clear();
      for (const std::string& p : pieces) split(s, p, &next);
      pieces.swap(next);
    }
    if (add_prefix_space_) {
      for (std::string& p : pieces) {
        if (p[0] != ' ') p.insert(0, 1, ' ');
      }
    }
    if (byte_level_split_.regex) {
      next.clear();
      for (const std::string& p : pieces) split(byte_level_split_, p, &next);
      pieces.swap(next);
    }
    for (const std::string& p : pieces) bpe(p, ids);
  }

  void bpe(const std::string& piece, std::vector<int64_t>* ids) const {
    if (ignore_merges_) {
      std::string mapped;
      for (unsigned char c : piece) mapped += byte_char_[c];
      const auto it = vocab_.find(mapped);
      if (it != vocab_.end()) {
        ids->push_back(it->second);
        return;
      }
    }
    std::vector<int64_t> sym;
    sym.reserve(piece.size());
    for (unsigned char c : piece) {
      if (byte_id_[c] >= 0) {
        sym.push_back(byte_id_[c]);
      } else if (unk_ >= 0) {
        sym.push_back(unk_);
      } else {
        throw TokenizerError(path_ + ": byte 0x" + "0123456789abcdef"[c >> 4] + "0123456789abcdef"[c & 15] +
                             " has no token in model.vocab and there is no unk_token");
      }
    }
    // rank[i]: the merge rank of (sym[i], sym[i+1]); INT_MAX where none.
    auto rank_of = [&](size_t i) {
      const auto it = merges_.find(pair_key(sym[i], sym[i + 1]));
      return it == merges_.end() ? INT_MAX : it->second.first;
    };
    std::vector<int32_t> rank(sym.size() > 0 ? sym.size() - 1 : 0);
    for (size_t i = 0; i + 1 < sym.size(); ++i) rank[i] = rank_of(i);
    while (!rank.empty()) {
      const auto best = std::min_element(rank.begin(), rank.end());  // leftmost of the lowest
      if (*best == INT_MAX) break;
      const size_t i = static_cast<size_t>(best - rank.begin());
      sym[i] = merges_.find(pair_key(sym[i], sym[i + 1]))->second.second;
      sym.erase(sym.begin() + static_cast<ptrdiff_t>(i) + 1);
      rank.erase(rank.begin() + static_cast<ptrdiff_t>(i));
      if (i < rank.size()) rank[i] = rank_of(i);
      if (i > 0) rank[i - 1] = rank_of(i - 1);
    }
    ids->insert(ids->end(), sym.begin(), sym.end());
  }

  std::string path_;
  std::string byte_char_[256];
  std::unordered_map<std::string, unsigned char> char_to_byte_;
  int64_t byte_id_[256] = {};
  std::unordered_map<std::string, int64_t> vocab_;
  std::vector<std::string> id_to_token_;
  std::vector<bool> has_id_;
  std::unordered_map<int64_t, bool> added_ids_;
  std::vector<AddedToken> added_;                           // longest first
  std::vector<const AddedToken*> by_first_byte_[256];        // into added_, by their first byte
  std::unordered_map<uint64_t, std::pair<int32_t, int64_t>> merges_;  // (a, b) -> (rank, id of ab)
  std::vector<Split> splits_;
  Split byte_level_split_;
  bool has_byte_level_ = false, add_prefix_space_ = false, ignore_merges_ = false;
  int64_t unk_ = -1, end_of_text_ = -1;
};

}  // namespace

std::unique_ptr<Tokenizer> load_hf_tokenizer(const std::string& path) {
  return std::make_unique<HfBpeTokenizer>(path);
}

std::unique_ptr<Tokenizer> parse_hf_tokenizer(const std::string& json_text, const std::string& name) {
  return std::make_unique<HfBpeTokenizer>(json_text, name);
}

}  // namespace framework::tokenizer
