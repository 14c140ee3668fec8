// tokenize: text files and JSONL into token shards that data.kind tokens
// reads, in llm.c's or Megatron's format.
//
//   build/tokenize --tokenizer FILE --out DIR [--format llmc|megatron]
//                  [--eval-fraction F] [--shard-tokens N] [--threads N] INPUT...
//
// A document is a whole text file, or the "text" field of one JSONL line
// (files ending in .jsonl). The tokenizer's end-of-text token follows every
// document (none for bytes). --eval-fraction holds out whole documents, each
// chosen by a hash of its index (the same on every run), into val shards.
// Files are tokenized in parallel and written in input order; a progress
// line goes to stderr. Output: llmc: DIR/train_000000.bin ... and
// DIR/val_000000.bin ... (uint16 when the vocabulary fits, else uint32);
// megatron: DIR/train_text_document.{bin,idx} and DIR/val_text_document.*.
// Each file is written as NAME.tmp and renamed. Exit status: 0 done, 2 bad
// arguments or input (one line naming the file and line), 1 I/O failures.
#include "framework/tokenizer/sentencepiece.h"
#include "tools/command_line.h"

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

namespace fs = std::filesystem;

namespace {

struct InputError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

std::string read_whole(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InputError(path + ": cannot open: " + std::strerror(errno));
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// The documents of one input: the file, or its JSONL lines' "text".
std::vector<std::string> documents_of(const std::string& path) {
  const std::string text = read_whole(path);
  if (!ends_with(path, ".jsonl")) return {text};
  std::vector<std::string> docs;
  std::istringstream in(text);
  std::string line;
  for (int n = 1; std::getline(in, line); ++n) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      throw InputError(path + ":" + std::to_string(n) + ": not JSON: " + e.what());
    }
    if (!j.is_object() || !j.contains("text") || !j["text"].is_string()) {
      throw InputError(path + ":" + std::to_string(n) + ": no string field \"text\"");
    }
    docs.push_back(j["text"].get<std::string>());
  }
  return docs;
}

uint64_t mix(uint64_t z) {  // splitmix64 finaliser
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

void write_atomically(const std::string& path, const std::vector<uint8_t>& head, const void* data, size_t n) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(head.data()), static_cast<std::streamsize>(head.size()));
    out.write(static_cast<const char*>(data), static_cast<std::streamsize>(n));
    out.flush();
    if (!out) throw std::runtime_error(tmp + ": write failed: " + std::strerror(errno));
  }
  fs::rename(tmp, path);
}

// The tokens of one split, written as they come: llm.c shards of at most
// shard_tokens tokens, or one Megatron dataset with a document per sequence.
class SplitWriter {
 public:
  SplitWriter(std::string dir, std::string name, std::string format, int64_t vocab, int64_t shard_tokens)
      : dir_(std::move(dir)), name_(std::move(name)), format_(std::move(format)), shard_tokens_(shard_tokens) {
    wide_ = format_ == "llmc" ? vocab > 65536 : vocab >= 65500;  // Megatron's optimal_dtype
  }
  void add_document(const std::vector<int64_t>& ids) {
    if (format_ == "megatron") {
      doc_lengths_.push_back(static_cast<int32_t>(ids.size()));
      pending_.insert(pending_.end(), ids.begin(), ids.end());
      tokens_ += static_cast<int64_t>(ids.size());
      return;
    }
    for (int64_t id : ids) {
      pending_.push_back(id);
      ++tokens_;
      if (static_cast<int64_t>(pending_.size()) == shard_tokens_) flush_llmc();
    }
  }
  // Writes what is pending; returns the files written.
  std::vector<std::string> finish() {
    if (format_ == "llmc") {
      if (!pending_.empty() || files_.empty()) flush_llmc();
    } else {
      finish_megatron();
    }
    return files_;
  }
  int64_t tokens() const { return tokens_; }
  const char* width_name() const {
    return format_ == "llmc" ? (wide_ ? "uint32" : "uint16") : (wide_ ? "int32" : "uint16");
  }

 private:
  template <typename T>
  std::vector<T> narrow() const {
    return std::vector<T>(pending_.begin(), pending_.end());
  }
  void flush_llmc() {
    char file[64];
    std::snprintf(file, sizeof(file), "%s_%06zu.bin", name_.c_str(), files_.size());
    std::vector<int32_t> header(256, 0);
    header[0] = wide_ ? 20240801 : 20240520;
    header[1] = wide_ ? 7 : 1;
    header[2] = static_cast<int32_t>(pending_.size());
    std::vector<uint8_t> head(1024);
    std::memcpy(head.data(), header.data(), 1024);
    const std::string path = dir_ + "/" + file;
    if (wide_) {
      const auto v = narrow<uint32_t>();
      write_atomically(path, head, v.data(), v.size() * 4);
    } else {
      const auto v = narrow<uint16_t>();
      write_atomically(path, head, v.data(), v.size() * 2);
    }
    files_.push_back(path);
    pending_.clear();
  }
  void finish_megatron() {
    const std::string prefix = dir_ + "/" + name_ + "_text_document";
    const int width = wide_ ? 4 : 2;
    if (wide_) {
      const auto v = narrow<int32_t>();
      write_atomically(prefix + ".bin", {}, v.data(), v.size() * 4);
    } else {
      const auto v = narrow<uint16_t>();
      write_atomically(prefix + ".bin", {}, v.data(), v.size() * 2);
    }
    // MMIDIDX, version 1, dtype code, counts, lengths, pointers, document indices.
    std::vector<uint8_t> idx;
    auto put = [&](const void* p, size_t n) {
      idx.insert(idx.end(), static_cast<const uint8_t*>(p), static_cast<const uint8_t*>(p) + n);
    };
    put("MMIDIDX\0\0", 9);
    const uint64_t version = 1;
    put(&version, 8);
    const uint8_t code = wide_ ? 4 : 8;  // int32 : uint16
    put(&code, 1);
    const uint64_t sequences = doc_lengths_.size(), documents = doc_lengths_.size() + 1;
    put(&sequences, 8);
    put(&documents, 8);
    put(doc_lengths_.data(), doc_lengths_.size() * 4);
    int64_t at = 0;
    for (int32_t len : doc_lengths_) {
      put(&at, 8);
      at += int64_t{len} * width;
    }
    for (uint64_t d = 0; d < documents; ++d) {
      const int64_t v = static_cast<int64_t>(d);
      put(&v, 8);
    }
    write_atomically(prefix + ".idx", idx, nullptr, 0);
    files_ = {prefix + ".bin", prefix + ".idx"};
  }

  std::string dir_, name_, format_;
  int64_t shard_tokens_;
  bool wide_ = false;
  std::vector<int64_t> pending_;
  std::vector<int32_t> doc_lengths_;
  std::vector<std::string> files_;
  int64_t tokens_ = 0;
};

struct Args {
  std::string tokenizer_spec, out, format = "llmc";
  double eval_fraction = 0;
  int64_t shard_tokens = 100'000'000;
  int threads = static_cast<int>(std::max(1L, ::sysconf(_SC_NPROCESSORS_ONLN)));
  std::vector<std::string> inputs;
  bool encode = false, decode = false, info = false;
};

void add_options(CLI::App& app, Args& a) {
  app.add_option("--tokenizer", a.tokenizer_spec,
                 "a Hugging Face tokenizer.json (byte-level BPE), a SentencePiece .model, or bytes")
      ->required();
  app.add_option("--out", a.out, "the directory to write the shards into");
  app.add_flag("--encode", a.encode, "read text on stdin, print its ids as a JSON list (for generate)");
  app.add_flag("--decode", a.decode, "read a JSON list of ids on stdin, print the text (for generate)");
  app.add_flag("--info", a.info, "print the vocabulary size, end-of-text id and a description as JSON");
  app.add_option("--format", a.format, "llmc (llm.c .bin) or megatron (.bin + .idx)")
      ->check(CLI::IsMember({"llmc", "megatron"}));
  app.add_option("--eval-fraction", a.eval_fraction, "documents held out for validation (by a hash of their index)")
      ->check(CLI::Range(0.0, 0.5));
  app.add_option("--shard-tokens", a.shard_tokens, "llmc: tokens per shard (llm.c writes 100M)")
      ->check(CLI::Range(int64_t{1}, int64_t{2'000'000'000}));
  app.add_option("--threads", a.threads, "files tokenized at once")->check(CLI::Range(1, 256));
  app.add_option("INPUT", a.inputs, "text files, or .jsonl files with a \"text\" field per line");
}

using Tokenizer = framework::tokenizer::Tokenizer;

void print_info(const Tokenizer& tok) {
  std::cout << nlohmann::json{{"vocab_size", tok.vocab_size()},
                              {"end_of_text", tok.end_of_text()},
                              {"describe", tok.describe()}}
                   .dump()
            << std::endl;
}

// One process's worth of text or ids: generate runs the tokenizers here,
// since libsentencepiece's protobuf cannot share a process with LibTorch's.
void encode_or_decode_stdin(const Tokenizer& tok, bool encode) {
  std::ostringstream in;
  in << std::cin.rdbuf();
  if (encode) {
    std::cout << nlohmann::json(tok.encode(in.str())).dump() << std::endl;
    return;
  }
  nlohmann::json ids;
  try {
    ids = nlohmann::json::parse(in.str());
  } catch (const nlohmann::json::exception& e) {
    throw InputError(std::string("--decode: stdin is not a JSON list of ids: ") + e.what());
  }
  std::cout << tok.decode(ids.get<std::vector<int64_t>>());
  std::cout.flush();
}

// The ids of every document of `path`; an encoding error names the file (and
// the document of a JSONL file).
std::vector<std::vector<int64_t>> tokenize_file(const std::string& path, const Tokenizer& tok) {
  std::vector<std::vector<int64_t>> ids;
  const auto docs = documents_of(path);
  for (size_t d = 0; d < docs.size(); ++d) {
    try {
      ids.push_back(tok.encode(docs[d]));
    } catch (const framework::tokenizer::TokenizerError& e) {
      throw InputError(path + (docs.size() > 1 ? " (document " + std::to_string(d + 1) + ")" : "") + ": " +
                       e.what());
    }
  }
  return ids;
}

// Document `index` goes to validation: a hash of the index below the fraction.
bool held_out(uint64_t index, double eval_fraction) {
  return eval_fraction > 0 &&
         static_cast<double>(mix(index + 0x9E3779B97F4A7C15ULL) >> 11) / 9007199254740992.0 < eval_fraction;
}

// What tokenize_inputs did, for the summary line.
struct Totals {
  uint64_t documents = 0, held_docs = 0, bytes = 0;
};

// Tokenizes the inputs, at most `threads` files at once, and adds their
// documents (each followed by end-of-text) to train or val in input order.
Totals tokenize_inputs(const Args& a, const Tokenizer& tok, SplitWriter& train, SplitWriter& val) {
  const int64_t eot = tok.end_of_text();
  // Files in flight, consumed in input order.
  std::vector<std::future<std::vector<std::vector<int64_t>>>> work(a.inputs.size());
  auto launch = [&](size_t i) {
    work[i] = std::async(std::launch::async, [&, i] { return tokenize_file(a.inputs[i], tok); });
  };
  size_t launched = 0;
  for (; launched < a.inputs.size() && launched < static_cast<size_t>(a.threads); ++launched) launch(launched);
  Totals t;
  const bool tty = ::isatty(2) != 0;  // the progress line only where someone watches
  for (size_t i = 0; i < a.inputs.size(); ++i) {
    std::vector<std::vector<int64_t>> docs = work[i].get();
    if (launched < a.inputs.size()) launch(launched++);
    for (auto& ids : docs) {
      if (eot >= 0) ids.push_back(eot);
      const bool held = held_out(t.documents++, a.eval_fraction);
      t.held_docs += held;
      (held ? val : train).add_document(ids);
    }
    t.bytes += fs::file_size(a.inputs[i]);
    if (tty) {
      std::fprintf(stderr, "\rtokenize: %zu/%zu files, %.1f MB, %lld tokens", i + 1, a.inputs.size(),
                   static_cast<double>(t.bytes) / 1e6, static_cast<long long>(train.tokens() + val.tokens()));
    }
  }
  if (tty) std::fprintf(stderr, "\n");
  return t;
}

// The shards of the inputs into a.out, then one summary line.
void write_token_shards(const Args& a, const Tokenizer& tok, std::chrono::steady_clock::time_point t0) {
  if (a.out.empty() || a.inputs.empty()) throw InputError("give --out DIR and at least one INPUT");
  for (const auto& in : a.inputs) {
    if (!fs::is_regular_file(in)) throw InputError(in + ": not a readable file");
  }
  fs::create_directories(a.out);
  SplitWriter train(a.out, "train", a.format, tok.vocab_size(), a.shard_tokens);
  SplitWriter val(a.out, "val", a.format, tok.vocab_size(), a.shard_tokens);
  const Totals t = tokenize_inputs(a, tok, train, val);
  const auto train_files = train.finish();
  const auto val_files = a.eval_fraction > 0 ? val.finish() : std::vector<std::string>{};
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("tokenize: %llu documents, %lld tokens with %s -> %s (%s %s): train %lld tokens in %zu files",
              static_cast<unsigned long long>(t.documents), static_cast<long long>(train.tokens() + val.tokens()),
              tok.describe().c_str(), a.out.c_str(), a.format.c_str(), train.width_name(),
              static_cast<long long>(train.tokens()), train_files.size());
  if (a.eval_fraction > 0) {
    std::printf(", val %lld tokens (%llu documents) in %zu files", static_cast<long long>(val.tokens()),
                static_cast<unsigned long long>(t.held_docs), val_files.size());
  }
  std::printf("; %.2f s (%.1f MB/s)\n", s, s > 0 ? static_cast<double>(t.bytes) / 1e6 / s : 0.0);
}

// The failure's line on stderr and the exit status: 2 for bad arguments or
// input (a tokenizer that does not load or encode), 1 for I/O failures.
int report_failure(const std::exception& e) {
  const bool tokenizer = dynamic_cast<const framework::tokenizer::TokenizerError*>(&e) != nullptr;
  const bool input = dynamic_cast<const InputError*>(&e) != nullptr;
  std::cerr << (tokenizer && !input ? "" : "\n") << "tokenize: " << e.what() << std::endl;
  return input || tokenizer ? 2 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"tokenize: text files and JSONL (the \"text\" field) into token shards for data.kind tokens"};
  Args a;
  add_options(app, a);
  if (const std::optional<int> status = tools::parse_command_line(app, argc, argv)) return *status;
  try {
    const auto t0 = std::chrono::steady_clock::now();
    std::shared_ptr<Tokenizer> tok = framework::tokenizer::load_tokenizer_in_process(a.tokenizer_spec);
    if (a.info) {
      print_info(*tok);
    } else if (a.encode || a.decode) {
      encode_or_decode_stdin(*tok, a.encode);
    } else {
      write_token_shards(a, *tok, t0);
    }
    return 0;
  } catch (const std::exception& e) {
    return report_failure(e);
  }
}
