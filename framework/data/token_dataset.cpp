#include "framework/data/token_dataset.h"

#include <dirent.h>
#include <fcntl.h>
#include <glob.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <set>
#include <sstream>
#include <tuple>

namespace framework::data {
namespace {

[[noreturn]] void fail(const std::string& message) { throw DataError(message); }

std::string in_quotes(const std::string& s) { return "'" + s + "'"; }

// Stream tokens [start, start + n) of `shards` (stream offsets `starts`) into
// out, each checked against the vocabulary.
void gather(const std::vector<TokenShard>& shards, const std::vector<int64_t>& starts, int64_t start,
            int64_t n, int64_t vocab, const std::string& key, int64_t* out) {
  size_t s = static_cast<size_t>(std::upper_bound(starts.begin(), starts.end(), start) - starts.begin()) - 1;
  for (int64_t i = 0; i < n; ++i) {
    while (start + i - starts[s] >= shards[s].tokens) ++s;
    const int64_t t = start + i - starts[s];
    const int64_t v = shards[s].at(t);
    if (v < 0 || v >= vocab) throw_token_outside_vocab(key, shards[s], t, v, vocab);
    out[i] = v;
  }
}

std::vector<TokenShard> open_all(const std::vector<std::string>& paths, const std::string& key,
                                 std::vector<int64_t>& starts, int64_t& total) {
  std::vector<TokenShard> shards;
  starts.clear();
  total = 0;
  for (const std::string& p : paths) {
    try {
      shards.push_back(open_token_shard(p));
    } catch (const DataError& e) {
      // "data: ..." becomes "data.path: ...": the setting that led there.
      const std::string what = e.what();
      fail(what.rfind("data: ", 0) == 0 ? key + ": " + what.substr(6) : what);
    }
    starts.push_back(total);
    total += shards.back().tokens;
  }
  return shards;
}

// A bijection of [0, n) drawn from `key`: a 4-round Feistel network on the
// smallest even-bit power of two >= n, walked until it lands inside.
int64_t permute(int64_t j, int64_t n, uint64_t key) {
  int half = 1;
  while ((int64_t{1} << (2 * half)) < n) ++half;
  const uint64_t mask = (uint64_t{1} << half) - 1;
  uint64_t x = static_cast<uint64_t>(j);
  do {
    uint64_t l = x >> half, r = x & mask;
    for (uint64_t round = 0; round < 4; ++round) {
      const uint64_t f = mix_seed(key + round, r) & mask;
      const uint64_t next = l ^ f;
      l = r;
      r = next;
    }
    x = (l << half) | r;
  } while (x >= static_cast<uint64_t>(n));
  return static_cast<int64_t>(x);
}

int64_t count_docs(const std::vector<TokenShard>& shards) {
  int64_t n = 0;
  for (const auto& s : shards) n += static_cast<int64_t>(s.doc_starts.size());
  return n;
}

// data.eval_fraction's split of the stream.
struct EvalSplit {
  int64_t begin = 0;             // the first held-out token
  int64_t documents = 0;         // document starts at or after begin
  bool within_document = false;  // begin cuts a document
};

// Where data.eval_fraction's held-out part starts. Normally the latest
// document start with at least `want` tokens after it. When only the first
// document's start has (the data is one document: a single llm.c shard, as
// `tokenize` writes for one text file, carries no document index), holding
// out whole documents would leave nothing to train on, so the last `want`
// tokens are held out instead, cutting a document, as data.kind text holds
// out its file's tail.
EvalSplit split_for_eval_fraction(const std::vector<TokenShard>& shards, const std::vector<int64_t>& starts,
                                  int64_t total, int64_t want) {
  std::vector<int64_t> bounds;
  for (size_t i = 0; i < shards.size(); ++i) {
    for (int64_t d : shards[i].doc_starts) bounds.push_back(starts[i] + d);
  }
  EvalSplit out;
  for (int64_t b : bounds) {
    if (total - b >= want) out.begin = std::max(out.begin, b);
  }
  if (out.begin == 0) {
    out.begin = total - want;
    out.within_document = true;
  }
  out.documents = std::count_if(bounds.begin(), bounds.end(), [&](int64_t b) { return b >= out.begin; });
  return out;
}

std::string formats(const std::vector<TokenShard>& shards) {
  std::set<std::string> f;
  for (const auto& s : shards) f.insert(s.format);
  std::string out;
  for (const auto& x : f) out += (out.empty() ? "" : ", ") + x;
  return out;
}

}  // namespace

TokenDataset::TokenDataset(const TokenDatasetOptions& options) : options_(options) {
  const int64_t L = options.seq_len;
  if (L <= 0) fail("model.seq_len must be positive, got " + std::to_string(L));
  if (options.vocab_size <= 0) fail("model.vocab_size must be positive for data.kind tokens");
  // A directory of train_* and val_* shards (tokenize --eval-fraction,
  // llm.c) trains on the train_* ones only, and validates on the val_* ones
  // unless data.eval_path names others.
  std::vector<std::string> train_paths = resolve_token_paths(options.path, "data.path");
  DirectorySplit dir_split = split_token_directory(options.path, train_paths);
  if (!dir_split.val.empty()) train_paths = dir_split.train;
  shards_ = open_all(train_paths, "data.path", shard_starts_, total_tokens_);
  if (options.check_tokens) {
    for (const auto& s : shards_) ++(check_shard_tokens(s, options.vocab_size, "data.path") ? read_ : known_);
  }
  train_tokens_ = total_tokens_;
  eval_begin_ = total_tokens_;
  if (!options.eval_path.empty()) {
    int64_t eval_total = 0;
    eval_shards_ = open_all(resolve_token_paths(options.eval_path, "data.eval_path"), "data.eval_path",
                            eval_shard_starts_, eval_total);
    for (const auto& e : eval_shards_) {
      for (const auto& s : shards_) {
        if (e.path == s.path) {
          fail("data.eval_path: " + in_quotes(e.path) + " is also a training shard of data.path " +
               in_quotes(options.path));
        }
      }
      if (options.check_tokens) ++(check_shard_tokens(e, options.vocab_size, "data.eval_path") ? read_ : known_);
    }
    if (eval_total < L + 1) {
      fail("data.eval_path " + in_quotes(options.eval_path) + " holds " + std::to_string(eval_total) +
           " tokens, fewer than model.seq_len + 1 = " + std::to_string(L + 1));
    }
    directory_val_skipped_ = static_cast<int64_t>(dir_split.val.size());
  } else if (!dir_split.val.empty()) {
    int64_t eval_total = 0;
    eval_shards_ = open_all(dir_split.val, "data.path", eval_shard_starts_, eval_total);
    if (options.check_tokens) {
      for (const auto& e : eval_shards_) ++(check_shard_tokens(e, options.vocab_size, "data.path") ? read_ : known_);
    }
    if (eval_total < L + 1) {
      fail("data.path " + in_quotes(options.path) + ": its validation shards (val_*) hold " +
           std::to_string(eval_total) + " tokens, fewer than model.seq_len + 1 = " + std::to_string(L + 1) +
           " (set data.eval_path)");
    }
    eval_from_directory_ = true;
  } else if (options.eval_fraction > 0) {
    const auto want =
        static_cast<int64_t>(std::ceil(options.eval_fraction * static_cast<double>(total_tokens_)));
    const EvalSplit split = split_for_eval_fraction(shards_, shard_starts_, total_tokens_, want);
    if (split.begin < L + 1 || total_tokens_ - split.begin < L + 1) {
      const int64_t docs = count_docs(shards_);
      std::ostringstream m;
      m << "data.eval_fraction " << options.eval_fraction << " holds out "
        << (split.within_document ? "the last " + std::to_string(want) + " tokens"
                                  : std::string("the trailing whole documents"))
        << " of data.path " << in_quotes(options.path) << " (" << total_tokens_ << " tokens in " << docs
        << (docs == 1 ? " document" : " documents") << "): that leaves " << split.begin << " training and "
        << total_tokens_ - split.begin << " held-out tokens; each part needs model.seq_len + 1 = " << L + 1
        << " (set data.eval_path, or data.eval_fraction 0 for no validation)";
      fail(m.str());
    }
    held_out_docs_ = split.documents;
    eval_within_document_ = split.within_document;
    train_tokens_ = split.begin;
    eval_begin_ = split.begin;
  }
  if (train_tokens_ < L + 1) {
    fail("data.path " + in_quotes(options.path) + " holds " + std::to_string(train_tokens_) +
         " training tokens, fewer than model.seq_len + 1 = " + std::to_string(L + 1));
  }
  windows_ = (train_tokens_ - 1) / L;
}

int64_t TokenDataset::eval_tokens() const {
  if (!eval_shards_.empty()) {
    return eval_shard_starts_.back() + eval_shards_.back().tokens;
  }
  return total_tokens_ - eval_begin_;
}

int64_t TokenDataset::window_start(int64_t index) const {
  if (index < 0) fail("sample index must be >= 0, got " + std::to_string(index));
  const int64_t epoch = index / windows_;
  const int64_t k = permute(index % windows_, windows_,
                            mix_seed(options_.seed, static_cast<uint64_t>(epoch)));
  return k * options_.seq_len;
}

std::vector<int64_t> TokenDataset::read(int64_t start, int64_t n) const {
  std::vector<int64_t> out(static_cast<size_t>(n));
  gather(shards_, shard_starts_, start, n, options_.vocab_size, "data.path", out.data());
  return out;
}

std::pair<torch::Tensor, torch::Tensor> TokenDataset::window(const std::vector<TokenShard>& shards,
                                                             const std::vector<int64_t>& starts,
                                                             int64_t start) const {
  const int64_t L = options_.seq_len;
  auto out = torch::empty({L + 1}, torch::kLong);
  gather(shards, starts, start, L + 1, options_.vocab_size,
         &shards == &shards_ ? "data.path" : "data.eval_path", out.data_ptr<int64_t>());
  return {out.slice(0, 0, L).clone(), out.slice(0, 1, L + 1).clone()};
}

std::pair<torch::Tensor, torch::Tensor> TokenDataset::sample(int64_t index) const {
  return window(shards_, shard_starts_, window_start(index));
}

int64_t TokenDataset::eval_size() const {
  const int64_t e = eval_tokens();
  return e > options_.seq_len ? (e - 1) / options_.seq_len : 0;
}

std::pair<torch::Tensor, torch::Tensor> TokenDataset::eval_sample(int64_t j) const {
  if (j < 0 || j >= eval_size()) {
    fail("eval sample " + std::to_string(j) + " out of range [0, " + std::to_string(eval_size()) + ")");
  }
  if (!eval_shards_.empty()) return window(eval_shards_, eval_shard_starts_, j * options_.seq_len);
  return window(shards_, shard_starts_, eval_begin_ + j * options_.seq_len);
}

std::vector<std::string> TokenDataset::files() const {
  std::vector<std::string> out;
  for (const TokenShard& s : shards_) out.push_back(s.path);
  return out;
}

std::string TokenDataset::describe() const {
  std::ostringstream out;
  out << "tokens '" << options_.path << "' (" << shards_.size() << (shards_.size() == 1 ? " shard" : " shards")
      << ", " << formats(shards_) << ", " << total_tokens_ << " tokens, " << count_docs(shards_)
      << " documents";
  if (eval_from_directory_) {
    out << "; training on its " << shards_.size() << " train_* shards, validating on its " << eval_shards_.size()
        << " val_* " << (eval_shards_.size() == 1 ? "shard" : "shards") << " (" << eval_tokens() << " tokens)";
  } else if (!eval_shards_.empty()) {
    out << "; eval_path '" << options_.eval_path << "' " << eval_tokens() << " tokens";
    if (directory_val_skipped_ > 0) {
      out << " (its own " << directory_val_skipped_ << " val_* "
          << (directory_val_skipped_ == 1 ? "shard" : "shards") << " not trained on)";
    }
  } else if (eval_begin_ < total_tokens_) {
    if (eval_within_document_) {
      out << "; last " << eval_tokens() << " tokens held out (" << std::fixed;
    } else {
      out << "; last " << held_out_docs_ << " documents held out, " << eval_tokens() << " tokens (" << std::fixed;
    }
    out.precision(1);
    out << 100.0 * static_cast<double>(eval_tokens()) / static_cast<double>(total_tokens_) << "%"
        << (eval_within_document_ ? ", within a document: whole documents would leave no training tokens)"
                                  : ")");
    out.unsetf(std::ios::fixed);
  }
  out << "; seq_len " << options_.seq_len << ", " << windows_ << " windows an epoch, seed "
      << options_.seed;
  if (options_.check_tokens) {
    out << "; ids checked: " << read_ << (read_ == 1 ? " file" : " files") << " read here, " << known_
        << " already checked in this job";
  }
  out << ")";
  return out.str();
}

}  // namespace framework::data
