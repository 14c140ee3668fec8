#include "framework/data/sft_records.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace framework::data {
namespace {

struct SftRecord {
  std::vector<int32_t> tokens;
  std::vector<uint8_t> trained;
  void add(const std::vector<int64_t>& ids, bool train) {
    for (int64_t id : ids) {
      tokens.push_back(static_cast<int32_t>(id));
      trained.push_back(train ? 1 : 0);
    }
  }
  void add(int64_t id, bool train) { add(std::vector<int64_t>{id}, train); }
};

std::string trim(const std::string& s) {
  const char* ws = " \t\n\r\f\v";
  const size_t b = s.find_first_not_of(ws);
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(ws) - b + 1);
}

// Llama 3's chat specials, by id.
struct ChatSpecials {
  int64_t begin = -1, start_header = -1, end_header = -1, eot = -1;
};

}  // namespace

SftWindows read_sft_records(std::istream& in, const std::string& path, const tokenizer::Tokenizer& tok,
                            int64_t seq_len, bool packed) {
  if (seq_len <= 0) throw DataError("model.seq_len must be positive, got " + std::to_string(seq_len));
  SftWindows out;
  ChatSpecials chat;
  chat.begin = tok.special_token("<|begin_of_text|>");
  chat.start_header = tok.special_token("<|start_header_id|>");
  chat.end_header = tok.special_token("<|end_header_id|>");
  chat.eot = tok.special_token("<|eot_id|>");
  const int64_t eos = tok.end_of_text();
  const std::vector<int64_t> blank = tok.encode("\n\n");

  const int64_t window = seq_len + 1;
  std::vector<SftRecord> records;
  std::string line;
  int64_t line_no = 0;
  while (std::getline(in, line)) {
    ++line_no;
    if (trim(line).empty()) continue;
    const std::string where = "data.path '" + path + "' line " + std::to_string(line_no) + ": ";
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      throw DataError(where + "not JSON (" + std::string(e.what()) + ")");
    }
    SftRecord r;
    try {
      if (j.is_object() && j.contains("messages")) {
        const nlohmann::json& messages = j["messages"];
        if (!messages.is_array() || messages.empty()) throw DataError(where + "\"messages\" must be a non-empty array");
        if (chat.start_header < 0 || chat.end_header < 0 || chat.eot < 0 || chat.begin < 0) {
          throw DataError(where + "the messages format needs Llama 3's chat tokens <|begin_of_text|>, "
                          "<|start_header_id|>, <|end_header_id|> and <|eot_id|>, which data.tokenizer " + tok.describe() +
                          " lacks");
        }
        r.add(chat.begin, false);
        for (size_t m = 0; m < messages.size(); ++m) {
          const nlohmann::json& msg = messages[m];
          const std::string at = "messages[" + std::to_string(m) + "]";
          if (!msg.is_object() || !msg.contains("role") || !msg["role"].is_string() || !msg.contains("content") ||
              !msg["content"].is_string()) {
            throw DataError(where + at + " must be an object with \"role\" and \"content\" strings");
          }
          const std::string role = msg["role"].get<std::string>();
          if (role != "system" && role != "user" && role != "assistant" && role != "tool" && role != "ipython") {
            throw DataError(where + at + ".role '" + role + "' is not system, user, assistant, tool or ipython");
          }
          const bool train = role == "assistant";
          r.add(chat.start_header, false);
          r.add(tok.encode(role), false);
          r.add(chat.end_header, false);
          // "\n\n" + content is one piece between two specials; its leading
          // blank-line tokens are the header's.
          const std::vector<int64_t> body = tok.encode("\n\n" + trim(msg["content"].get<std::string>()));
          const bool prefix = body.size() >= blank.size() && std::equal(blank.begin(), blank.end(), body.begin());
          const size_t head = prefix ? blank.size() : 0;
          r.add(std::vector<int64_t>(body.begin(), body.begin() + static_cast<std::ptrdiff_t>(head)), false);
          r.add(std::vector<int64_t>(body.begin() + static_cast<std::ptrdiff_t>(head), body.end()), train);
          r.add(chat.eot, train);
        }
      } else if (j.is_object() && j.contains("prompt") && j.contains("completion")) {
        if (!j["prompt"].is_string() || !j["completion"].is_string()) {
          throw DataError(where + "\"prompt\" and \"completion\" must be strings");
        }
        if (chat.begin >= 0) r.add(chat.begin, false);
        r.add(tok.encode(j["prompt"].get<std::string>()), false);
        r.add(tok.encode(j["completion"].get<std::string>()), true);
        if (eos >= 0) r.add(eos, true);
      } else {
        throw DataError(where + "a record needs \"prompt\" and \"completion\" strings, or \"messages\"");
      }
    } catch (const framework::tokenizer::TokenizerError& e) {
      throw DataError(where + e.what());
    }
    for (size_t t = 0; t < r.tokens.size(); ++t) {
      (r.trained[t] ? out.stats.completion_tokens : out.stats.prompt_tokens) += 1;
    }
    if (static_cast<int64_t>(r.tokens.size()) > window) {
      r.tokens.resize(static_cast<size_t>(window));
      r.trained.resize(static_cast<size_t>(window));
      ++out.stats.truncated;
    }
    records.push_back(std::move(r));
  }
  if (in.bad()) throw DataError("data.path: cannot read '" + path + "': " + std::strerror(errno));
  out.stats.records = static_cast<int64_t>(records.size());
  if (records.empty()) throw DataError("data.path '" + path + "' holds no records");

  // Windows: whole records, greedily (data.packed), or one each.
  int64_t used = window;  // of the current window; a full one starts the next
  for (const SftRecord& r : records) {
    const auto n = static_cast<int64_t>(r.tokens.size());
    if (!packed || used + n > window) {
      out.tokens.resize(out.tokens.size() + static_cast<size_t>(window), -1);
      out.trained.resize(out.trained.size() + static_cast<size_t>(window), 0);
      used = 0;
    }
    const size_t at = out.tokens.size() - static_cast<size_t>(window - used);
    std::copy(r.tokens.begin(), r.tokens.end(), out.tokens.begin() + static_cast<std::ptrdiff_t>(at));
    std::copy(r.trained.begin(), r.trained.end(), out.trained.begin() + static_cast<std::ptrdiff_t>(at));
    used += n;
  }
  return out;
}

}  // namespace framework::data
