#include "framework/data/synthetic_dataset.h"

#include <algorithm>
#include <limits>
#include <sstream>

namespace framework::data {

namespace {
constexpr int64_t kEvalFirstIndex = int64_t{1} << 62;
}  // namespace
namespace {

// splitmix64 stream: a tiny, version-independent generator, seeded per sample.
class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t state) : state_(state) {}
  uint64_t next() {
    uint64_t z = (state_ += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
  }
  // Uniform in [0, n); the modulo bias is < n / 2^64, irrelevant here.
  int64_t below(int64_t n) { return static_cast<int64_t>(next() % static_cast<uint64_t>(n)); }

 private:
  uint64_t state_;
};

// The most digits whose full sequence fits in seq_len + 1 tokens.
int64_t max_digits(SyntheticTask task, int64_t seq_len) {
  if (task == SyntheticTask::kAdd) return (seq_len - 2) / 3;  // n + 1 + n + 1 + (n + 1)
  return seq_len / 2;                                         // k + 1 + k
}

}  // namespace

SyntheticDataset::SyntheticDataset(SyntheticTask task, int64_t vocab_size, int64_t seq_len,
                                   uint64_t seed, int64_t num_digits, bool eval)
    : task_(task), vocab_size_(vocab_size), seq_len_(seq_len), seed_(seed), eval_(eval) {
  TORCH_CHECK(vocab_size >= 4, "model.vocab_size must be >= 4 for synthetic task ", to_string(task),
              " (two special tokens + at least base-2 digits), got ", vocab_size);
  const int64_t most = max_digits(task, seq_len);
  TORCH_CHECK(most >= 1, "model.seq_len ", seq_len, " is too short for synthetic task ",
              to_string(task));
  TORCH_CHECK(num_digits >= 0 && num_digits <= most, "synthetic task ", to_string(task), " with model.seq_len ",
              seq_len, " fits at most ", most, " digits, asked for ", num_digits);
  num_digits_ = num_digits == 0 ? most : num_digits;
}

int64_t SyntheticDataset::answer_start() const {
  return task_ == SyntheticTask::kAdd ? 2 * num_digits_ + 2 : num_digits_ + 1;
}

int64_t SyntheticDataset::answer_len() const {
  return task_ == SyntheticTask::kAdd ? num_digits_ + 1 : num_digits_;
}

std::vector<int64_t> SyntheticDataset::sequence(int64_t index) const {
  TORCH_CHECK(index >= 0, "sample index must be >= 0, got ", index);
  SplitMix64 rng(mix_seed(seed_, static_cast<uint64_t>(index)));
  const int64_t n = num_digits_;
  const int64_t b = base();
  std::vector<int64_t> seq;
  seq.reserve(seq_len_ + 1);
  if (task_ == SyntheticTask::kAdd) {
    std::vector<int64_t> a(n), c(n);
    for (auto& d : a) d = rng.below(b);
    for (auto& d : c) d = rng.below(b);
    seq.insert(seq.end(), a.begin(), a.end());
    seq.push_back(sep_token());
    seq.insert(seq.end(), c.begin(), c.end());
    seq.push_back(sep_token());
    int64_t carry = 0;
    for (int64_t i = 0; i < n; ++i) {  // little-endian: least significant digit first
      const int64_t s = a[i] + c[i] + carry;
      seq.push_back(s % b);
      carry = s / b;
    }
    seq.push_back(carry);
  } else {
    std::vector<int64_t> x(n);
    for (auto& d : x) d = rng.below(b);
    seq.insert(seq.end(), x.begin(), x.end());
    seq.push_back(sep_token());
    if (task_ == SyntheticTask::kReverse) std::reverse(x.begin(), x.end());
    seq.insert(seq.end(), x.begin(), x.end());
  }
  seq.resize(seq_len_ + 1, pad_token());
  return seq;
}

std::pair<torch::Tensor, torch::Tensor> SyntheticDataset::sample(int64_t index) const {
  const auto seq = sequence(index);
  auto inputs = torch::empty({seq_len_}, torch::kLong);
  auto targets = torch::empty({seq_len_}, torch::kLong);
  auto* in = inputs.data_ptr<int64_t>();
  auto* tg = targets.data_ptr<int64_t>();
  const int64_t first = answer_start();
  const int64_t last = first + answer_len();  // exclusive
  for (int64_t t = 0; t < seq_len_; ++t) {
    in[t] = seq[t];
    tg[t] = (t + 1 >= first && t + 1 < last) ? seq[t + 1] : kIgnoreIndex;
  }
  return {inputs, targets};
}

int64_t SyntheticDataset::eval_size() const {
  return eval_ ? std::numeric_limits<int64_t>::max() - kEvalFirstIndex : 0;
}

std::pair<torch::Tensor, torch::Tensor> SyntheticDataset::eval_sample(int64_t j) const {
  TORCH_CHECK(j >= 0 && j < eval_size(), "eval sample ", j, " out of range");
  return sample(kEvalFirstIndex + j);
}

std::string SyntheticDataset::describe() const {
  std::ostringstream out;
  out << "synthetic " << to_string(task_) << " (" << num_digits_ << " digits, base " << base()
      << ", seq_len " << seq_len_ << ", seed " << seed_ << ")";
  return out.str();
}

}  // namespace framework::data
