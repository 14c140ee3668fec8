#include "framework/data/text_dataset.h"

#include "framework/tokenizer/tokenizer.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>
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

}  // namespace

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
