#include "framework/data/text_dataset.h"

#include "framework/data/sft_dataset.h"
#include "framework/tokenizer/tokenizer.h"


#include <algorithm>
#include <fstream>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>
#include <stdexcept>

#include <sys/stat.h>
#include <unistd.h>
#include <sstream>

namespace framework::data {
namespace {

std::vector<uint8_t> read_file(const std::string& path) {
  std::unique_ptr<FILE, int (*)(FILE*)> file(std::fopen(path.c_str(), "rb"), &std::fclose);
  TORCH_CHECK(file, "data.path: cannot open '", path, "': ", std::strerror(errno));
  std::vector<uint8_t> bytes;
  uint8_t buffer[1 << 16];
  size_t got = 0;
  while ((got = std::fread(buffer, 1, sizeof(buffer), file.get())) > 0) {
    bytes.insert(bytes.end(), buffer, buffer + got);
  }
  TORCH_CHECK(!std::ferror(file.get()), "data.path: cannot read '", path, "': ", std::strerror(errno));
  return bytes;
}

[[noreturn]] void refuse(const std::string& message) { throw std::invalid_argument(message); }

std::string quoted(const std::string& path) { return "'" + path + "'"; }

}  // namespace

void check_text_file(const std::string& path, int64_t seq_len, double eval_fraction) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) refuse("data.path: cannot open " + quoted(path) + ": " + std::strerror(errno));
  if (S_ISDIR(st.st_mode)) refuse("data.path: " + quoted(path) + " is a directory, not a text file");
  if (!S_ISREG(st.st_mode)) refuse("data.path: " + quoted(path) + " is not a regular file");
  if (::access(path.c_str(), R_OK) != 0) refuse("data.path: cannot read " + quoted(path) + ": " + std::strerror(errno));
  const auto size = static_cast<int64_t>(st.st_size);
  const int64_t need = seq_len + 1;
  if (size < need) {
    refuse("data.path: " + quoted(path) + " has " + std::to_string(size) + " bytes; model.seq_len " +
           std::to_string(seq_len) + " needs at least " + std::to_string(need));
  }
  if (eval_fraction <= 0) return;
  const auto held_out = static_cast<int64_t>(static_cast<double>(size) * eval_fraction);
  if (held_out < need || size - held_out < need) {
    std::ostringstream fraction;
    fraction << eval_fraction;
    refuse("data.eval_fraction " + fraction.str() + " splits " + quoted(path) + " (" + std::to_string(size) +
           " bytes) into " + std::to_string(size - held_out) + " training and " + std::to_string(held_out) +
           " held-out bytes; each part needs at least model.seq_len + 1 = " + std::to_string(need));
  }
}

TextDataset::TextDataset(const std::string& path, int64_t seq_len, uint64_t seed,
                         double eval_fraction, const std::string& tokenizer, int64_t vocab_limit)
    : path_(path), seq_len_(seq_len), seed_(seed) {
  TORCH_CHECK(seq_len > 0, "model.seq_len must be positive, got ", seq_len);
  bytes_ = read_file(path);
  const char* unit = "bytes";
  if (!tokenizer.empty() && tokenizer != "bytes") {
    const auto tok = framework::tokenizer::load_tokenizer(tokenizer);
    vocab_size_ = tok->vocab_size();
    tokenizer_ = tok->describe();
    if (vocab_size_ > vocab_limit) {
      throw framework::tokenizer::TokenizerError("data.tokenizer " + tok->describe() + " has " +
                                                 std::to_string(vocab_size_) + " tokens, more than model.vocab_size " +
                                                 std::to_string(vocab_limit));
    }
    std::vector<int64_t> ids;
    try {
      ids = tok->encode(std::string(bytes_.begin(), bytes_.end()));
    } catch (const framework::tokenizer::TokenizerError& e) {
      throw framework::tokenizer::TokenizerError("data.path '" + path + "': " + e.what());
    }
    ids_.assign(ids.begin(), ids.end());
    std::vector<uint8_t>().swap(bytes_);
    unit = "tokens";
  }
  size_ = ids_.empty() ? static_cast<int64_t>(bytes_.size()) : static_cast<int64_t>(ids_.size());
  const int64_t size = size_;
  TORCH_CHECK(size >= seq_len + 1, "data.path '", path, "' has ", size, " ", unit,
              ", fewer than model.seq_len + 1 = ", seq_len + 1);
  const auto held_out = static_cast<int64_t>(static_cast<double>(size) * eval_fraction);
  train_bytes_ = size - held_out;
  if (eval_fraction > 0) {
    TORCH_CHECK(held_out >= seq_len + 1 && train_bytes_ >= seq_len + 1, "data.eval_fraction ",
                eval_fraction, " splits data.path '", path, "' (", size, " ", unit, ") into ",
                train_bytes_, " training and ", held_out,
                " held-out ", unit, "; each part needs at least model.seq_len + 1 = ", seq_len + 1);
  }
}

int64_t TextDataset::eval_size() const {
  const auto held_out = size_ - train_bytes_;
  return held_out > seq_len_ ? (held_out - 1) / seq_len_ : 0;
}

std::pair<torch::Tensor, torch::Tensor> TextDataset::eval_sample(int64_t j) const {
  TORCH_CHECK(j >= 0 && j < eval_size(), "eval sample ", j, " out of range [0, ", eval_size(), ")");
  return window(train_bytes_ + j * seq_len_);
}

int64_t TextDataset::window_start(int64_t index) const {
  TORCH_CHECK(index >= 0, "sample index must be >= 0, got ", index);
  // Valid starts are 0 .. size - seq_len - 1 (the window holds seq_len + 1 bytes).
  const auto starts = static_cast<uint64_t>(train_bytes_) - static_cast<uint64_t>(seq_len_);
  return static_cast<int64_t>(mix_seed(seed_, static_cast<uint64_t>(index)) % starts);
}

std::pair<torch::Tensor, torch::Tensor> TextDataset::sample(int64_t index) const {
  return window(window_start(index));
}

std::pair<torch::Tensor, torch::Tensor> TextDataset::window(int64_t start) const {
  auto out = torch::empty({seq_len_ + 1}, torch::kLong);
  auto* w = out.data_ptr<int64_t>();
  if (ids_.empty()) {
    for (int64_t t = 0; t <= seq_len_; ++t) w[t] = bytes_[start + t];
  } else {
    for (int64_t t = 0; t <= seq_len_; ++t) w[t] = ids_[start + t];
  }
  return {out.slice(0, 0, seq_len_).clone(), out.slice(0, 1, seq_len_ + 1).clone()};
}

std::string TextDataset::describe() const {
  std::ostringstream out;
  out << "text '" << path_ << "' (" << size_ << (ids_.empty() ? " bytes" : " tokens of " + tokenizer_);
  if (train_bytes_ < size_) out << ", last " << size_ - train_bytes_ << " held out";
  out << ", seq_len " << seq_len_ << ", seed " << seed_ << ")";
  return out.str();
}

}  // namespace framework::data

// ------------------------------------------------------------------ sft
// (sft_dataset.h; the records are read and packed in sft_records.cpp)

namespace framework::data {

SftDataset::SftDataset(const std::string& path, const std::string& tokenizer, int64_t seq_len,
                       int64_t vocab_limit, uint64_t seed, double eval_fraction, bool packed)
    : path_(path), seq_len_(seq_len), seed_(seed), packed_(packed) {
  if (seq_len <= 0) throw DataError("model.seq_len must be positive, got " + std::to_string(seq_len));
  const auto tok = framework::tokenizer::load_tokenizer(tokenizer.empty() ? "bytes" : tokenizer);
  tokenizer_ = tok->describe();
  vocab_size_ = tok->vocab_size();
  if (vocab_size_ > vocab_limit) {
    throw DataError("data.tokenizer " + tokenizer_ + " has " + std::to_string(vocab_size_) +
                    " tokens, more than model.vocab_size " + std::to_string(vocab_limit));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) throw DataError("data.path: cannot open '" + path + "': " + std::strerror(errno));
  SftWindows packed_windows = read_sft_records(in, path, *tok, seq_len, packed);
  tokens_ = std::move(packed_windows.tokens);
  trained_ = std::move(packed_windows.trained);
  stats_ = packed_windows.stats;
  const int64_t window = seq_len + 1;
  const int64_t total = static_cast<int64_t>(tokens_.size()) / window;
  stats_.eval_windows = eval_fraction > 0
                            ? std::max<int64_t>(1, static_cast<int64_t>(static_cast<double>(total) * eval_fraction))
                            : 0;
  stats_.windows = total - stats_.eval_windows;
  if (stats_.windows < 1) {
    throw DataError("data.eval_fraction " + std::to_string(eval_fraction) + " holds out every one of the " +
                    std::to_string(total) + " windows of data.path '" + path + "'");
  }
  perm_.resize(static_cast<size_t>(stats_.windows));
  for (int64_t w = 0; w < stats_.windows; ++w) perm_[static_cast<size_t>(w)] = w;
  for (int64_t w = stats_.windows - 1; w > 0; --w) {  // Fisher-Yates from the seed
    const auto k = static_cast<int64_t>(mix_seed(seed_, static_cast<uint64_t>(w)) % static_cast<uint64_t>(w + 1));
    std::swap(perm_[static_cast<size_t>(w)], perm_[static_cast<size_t>(k)]);
  }
}

std::pair<std::vector<int64_t>, std::vector<uint8_t>> SftDataset::window(int64_t w) const {
  TORCH_CHECK(w >= 0 && w < stats_.windows + stats_.eval_windows, "sft window ", w, " out of range");
  const int64_t n = seq_len_ + 1;
  const auto b = static_cast<size_t>(w * n);
  return {std::vector<int64_t>(tokens_.begin() + static_cast<std::ptrdiff_t>(b),
                               tokens_.begin() + static_cast<std::ptrdiff_t>(b + static_cast<size_t>(n))),
          std::vector<uint8_t>(trained_.begin() + static_cast<std::ptrdiff_t>(b),
                               trained_.begin() + static_cast<std::ptrdiff_t>(b + static_cast<size_t>(n)))};
}

std::pair<torch::Tensor, torch::Tensor> SftDataset::make_sample(int64_t w) const {
  const auto [tokens, trained] = window(w);
  auto inputs = torch::empty({seq_len_}, torch::kLong);
  auto targets = torch::empty({seq_len_}, torch::kLong);
  auto* x = inputs.data_ptr<int64_t>();
  auto* y = targets.data_ptr<int64_t>();
  for (int64_t t = 0; t < seq_len_; ++t) {
    x[t] = tokens[static_cast<size_t>(t)] < 0 ? 0 : tokens[static_cast<size_t>(t)];  // padding reads token 0
    const int64_t next = tokens[static_cast<size_t>(t + 1)];
    y[t] = next >= 0 && trained[static_cast<size_t>(t + 1)] ? next : kIgnoreIndex;
  }
  return {inputs, targets};
}

std::pair<torch::Tensor, torch::Tensor> SftDataset::sample(int64_t index) const {
  TORCH_CHECK(index >= 0, "sample index must be >= 0, got ", index);
  const int64_t n = stats_.windows;
  const int64_t epoch = index / n, pos = index % n;
  // Epoch e: the shuffle, shifted by e, through the shuffle again.
  const int64_t w = perm_[static_cast<size_t>((perm_[static_cast<size_t>(pos)] + epoch) % n)];
  return make_sample(w);
}

std::pair<torch::Tensor, torch::Tensor> SftDataset::eval_sample(int64_t j) const {
  TORCH_CHECK(j >= 0 && j < stats_.eval_windows, "eval sample ", j, " out of range [0, ", stats_.eval_windows, ")");
  return make_sample(stats_.windows + j);
}

std::string SftDataset::describe() const {
  std::ostringstream out;
  out << "sft '" << path_ << "' (" << stats_.records << " records: " << stats_.prompt_tokens << " prompt and "
      << stats_.completion_tokens << " completion tokens";
  if (stats_.truncated > 0) out << ", " << stats_.truncated << " cut to seq_len + 1";
  out << "; " << stats_.windows << (packed_ ? " packed" : " unpacked") << " windows of " << seq_len_ + 1;
  if (stats_.eval_windows > 0) out << ", last " << stats_.eval_windows << " held out";
  out << "; " << tokenizer_ << ", seed " << seed_ << ")";
  return out.str();
}

}  // namespace framework::data
