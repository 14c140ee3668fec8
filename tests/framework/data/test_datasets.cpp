// Synthetic and text datasets: determinism, correct answers, file errors.
#include "framework/data/dataset.h"
#include "framework/data/synthetic_dataset.h"
#include "framework/data/text_dataset.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <set>
#include <string>
#include <unistd.h>
#include <vector>

namespace framework::data {
namespace {

std::vector<int64_t> to_vector(const torch::Tensor& t) {
  return std::vector<int64_t>(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + t.numel());
}

models::ModelOptions model_options(int64_t vocab, int64_t seq_len) {
  models::ModelOptions m;
  m.vocab_size = vocab;
  m.seq_len = seq_len;
  return m;
}

template <typename Fn>
std::string error_of(Fn fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

// A temporary file that is removed when the test ends.
class TempFile {
 public:
  explicit TempFile(const std::string& contents) {
    char name[] = "/tmp/shardkit_text_XXXXXX";
    int fd = mkstemp(name);
    EXPECT_GE(fd, 0);
    close(fd);
    path_ = name;
    std::ofstream(path_, std::ios::binary) << contents;
  }
  ~TempFile() { std::remove(path_.c_str()); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// The model's view of a sample: the answer digits it must predict, read from the
// targets (non-ignored positions), and the prompt it sees.
struct Decoded {
  std::vector<int64_t> prompt;  // inputs up to and including the answer's SEP
  std::vector<int64_t> answer;  // the non-ignored targets, in order
};

Decoded decode(const std::pair<torch::Tensor, torch::Tensor>& s, int64_t sep) {
  const auto in = to_vector(s.first);
  const auto tg = to_vector(s.second);
  Decoded d;
  int64_t first = -1;
  for (size_t t = 0; t < tg.size(); ++t) {
    if (tg[t] == kIgnoreIndex) continue;
    if (first < 0) first = static_cast<int64_t>(t);
    d.answer.push_back(tg[t]);
    // The answer is contiguous and the input at each answer position is the previous token.
    EXPECT_EQ(static_cast<int64_t>(t), first + static_cast<int64_t>(d.answer.size()) - 1);
  }
  EXPECT_GE(first, 0);
  d.prompt.assign(in.begin(), in.begin() + first + 1);
  EXPECT_EQ(d.prompt.back(), sep);
  return d;
}

TEST(SyntheticDataset, SampleIsAPureFunctionOfSeedAndIndex) {
  SyntheticDataset a(SyntheticTask::kReverse, 32, 32, 5);
  SyntheticDataset b(SyntheticTask::kReverse, 32, 32, 5);
  SyntheticDataset other_seed(SyntheticTask::kReverse, 32, 32, 6);
  auto late = b.sample(1000);  // drawn first here, last below: order must not matter
  for (int64_t i : {0, 1, 2, 999}) b.sample(i);
  EXPECT_TRUE(torch::equal(a.sample(1000).first, late.first));
  EXPECT_TRUE(torch::equal(a.sample(1000).second, late.second));
  EXPECT_TRUE(torch::equal(a.sample(3).first, a.sample(3).first));
  EXPECT_FALSE(torch::equal(a.sample(3).first, a.sample(4).first));
  EXPECT_FALSE(torch::equal(a.sample(3).first, other_seed.sample(3).first));
}

TEST(SyntheticDataset, SamplesHaveSeqLenInt64InputsAndTargets) {
  SyntheticDataset ds(SyntheticTask::kCopy, 32, 32, 1);
  auto [inputs, targets] = ds.sample(0);
  EXPECT_EQ(inputs.sizes(), (std::vector<int64_t>{32}));
  EXPECT_EQ(targets.sizes(), (std::vector<int64_t>{32}));
  EXPECT_EQ(inputs.scalar_type(), torch::kLong);
  EXPECT_EQ(targets.scalar_type(), torch::kLong);
  EXPECT_GE(inputs.min().item<int64_t>(), 0);
  EXPECT_LT(inputs.max().item<int64_t>(), 32);
}

TEST(SyntheticDataset, CopyAnswerIsThePrompt) {
  SyntheticDataset ds(SyntheticTask::kCopy, 32, 32, 1);
  EXPECT_EQ(ds.num_digits(), 16);
  for (int64_t i = 0; i < 20; ++i) {
    auto d = decode(ds.sample(i), ds.sep_token());
    std::vector<int64_t> x(d.prompt.begin(), d.prompt.end() - 1);
    EXPECT_EQ(x.size(), 16u);
    EXPECT_EQ(d.answer, x);
    for (int64_t digit : x) EXPECT_LT(digit, ds.base());
  }
}

TEST(SyntheticDataset, ReverseAnswerIsThePromptReversed) {
  SyntheticDataset ds(SyntheticTask::kReverse, 12, 20, 2, /*num_digits=*/6);
  for (int64_t i = 0; i < 20; ++i) {
    auto d = decode(ds.sample(i), ds.sep_token());
    std::vector<int64_t> x(d.prompt.begin(), d.prompt.end() - 1);
    ASSERT_EQ(x.size(), 6u);
    std::reverse(x.begin(), x.end());
    EXPECT_EQ(d.answer, x);
  }
}

TEST(SyntheticDataset, AddAnswerIsTheLittleEndianSum) {
  // Base 10 so the check reads like ordinary arithmetic.
  SyntheticDataset ds(SyntheticTask::kAdd, 12, 32, 3);
  const int64_t n = ds.num_digits();
  EXPECT_EQ(n, 10);
  auto value = [](const std::vector<int64_t>& digits) {  // little-endian base 10
    long double v = 0;
    for (size_t i = digits.size(); i-- > 0;) v = v * 10 + digits[i];
    return v;
  };
  bool saw_carry_out = false;
  for (int64_t i = 0; i < 50; ++i) {
    auto d = decode(ds.sample(i), ds.sep_token());
    ASSERT_EQ(static_cast<int64_t>(d.prompt.size()), 2 * n + 2);
    std::vector<int64_t> a(d.prompt.begin(), d.prompt.begin() + n);
    EXPECT_EQ(d.prompt[n], ds.sep_token());
    std::vector<int64_t> b(d.prompt.begin() + n + 1, d.prompt.begin() + 2 * n + 1);
    ASSERT_EQ(static_cast<int64_t>(d.answer.size()), n + 1);
    EXPECT_EQ(value(d.answer), value(a) + value(b));
    saw_carry_out |= d.answer.back() == 1;
  }
  EXPECT_TRUE(saw_carry_out);
}

TEST(SyntheticDataset, TooSmallVocabOrSequenceIsRejectedNamingTheOption) {
  EXPECT_NE(error_of([] { SyntheticDataset(SyntheticTask::kCopy, 3, 32, 0); }).find("model.vocab_size"),
            std::string::npos);
  EXPECT_NE(error_of([] { SyntheticDataset(SyntheticTask::kAdd, 32, 4, 0); }).find("model.seq_len"),
            std::string::npos);
  EXPECT_NE(error_of([] { SyntheticDataset(SyntheticTask::kCopy, 32, 8, 0, 5); }).find("model.seq_len"),
            std::string::npos);
}

TEST(MakeDataset, UnknownKindOrTaskIsRejectedNamingTheOption) {
  EXPECT_NE(error_of([] { parse_data_kind("images"); }).find("data.kind 'images'"), std::string::npos);
  EXPECT_NE(error_of([] { parse_synthetic_task("sort"); }).find("data.task 'sort'"), std::string::npos);
  DataOptions add;
  add.task = framework::data::SyntheticTask::kAdd;
  auto ds = make_dataset(add, model_options(32, 32), 0);
  EXPECT_EQ(ds->seq_len(), 32);
  EXPECT_EQ(ds->vocab_size(), 32);
  EXPECT_NE(ds->describe().find("add"), std::string::npos);
}

TEST(TextDataset, SamplesAreWindowsWhoseTargetsAreTheNextBytes) {
  std::string text;
  for (int i = 0; i < 40; ++i) text += "the quick brown fox " + std::to_string(i) + "\n";
  TempFile file(text);
  DataOptions data;
  data.kind = framework::data::DataKind::kText;
  data.path = file.path();
  auto ds = make_dataset(data, model_options(256, 16), 9);
  EXPECT_EQ(ds->vocab_size(), 256);
  EXPECT_NE(ds->describe().find(file.path()), std::string::npos);
  const auto& text_ds = dynamic_cast<const TextDataset&>(*ds);
  std::set<int64_t> starts;
  for (int64_t i = 0; i < 30; ++i) {
    auto [inputs, targets] = ds->sample(i);
    const int64_t start = text_ds.window_start(i);
    starts.insert(start);
    ASSERT_LE(start + 17, static_cast<int64_t>(text.size()));
    for (int64_t t = 0; t < 16; ++t) {
      EXPECT_EQ(inputs[t].item<int64_t>(), static_cast<uint8_t>(text[start + t]));
      EXPECT_EQ(targets[t].item<int64_t>(), static_cast<uint8_t>(text[start + t + 1]));
    }
    EXPECT_TRUE(torch::equal(inputs, ds->sample(i).first));
  }
  EXPECT_GT(starts.size(), 20u);
}

// data.eval_fraction holds the file's tail out: training windows never
// reach it, and the held-out windows tile it.
TEST(TextDataset, HeldOutTailIsNeverInATrainingWindow) {
  std::string text;
  for (int i = 0; i < 100; ++i) text += "line " + std::to_string(i) + " of the corpus\n";
  TempFile file(text);
  const int64_t size = static_cast<int64_t>(text.size());
  TextDataset ds(file.path(), 16, 3, 0.25);
  const int64_t train_bytes = size - static_cast<int64_t>(static_cast<double>(size) * 0.25);
  for (int64_t i = 0; i < 2000; ++i) {
    ASSERT_LE(ds.window_start(i) + 17, train_bytes) << "sample " << i;
  }
  ASSERT_EQ(ds.eval_size(), (size - train_bytes - 1) / 16);
  for (int64_t j = 0; j < ds.eval_size(); ++j) {
    auto [inputs, targets] = ds.eval_sample(j);
    const int64_t start = train_bytes + j * 16;
    for (int64_t t = 0; t < 16; ++t) {
      ASSERT_EQ(inputs[t].item<int64_t>(), static_cast<uint8_t>(text[start + t]));
      ASSERT_EQ(targets[t].item<int64_t>(), static_cast<uint8_t>(text[start + t + 1]));
    }
  }
  EXPECT_THROW(ds.eval_sample(ds.eval_size()), c10::Error);
  EXPECT_NE(ds.describe().find("held out"), std::string::npos);
  // Without eval_fraction nothing is held out and training covers the file.
  TextDataset all(file.path(), 16, 3);
  EXPECT_EQ(all.eval_size(), 0);
  int64_t furthest = 0;
  for (int64_t i = 0; i < 2000; ++i) furthest = std::max(furthest, all.window_start(i));
  EXPECT_GT(furthest + 17, train_bytes);
}

TEST(SyntheticDataset, HeldOutSamplesComeFromTheirOwnStream) {
  SyntheticDataset plain(SyntheticTask::kReverse, 32, 32, 5);
  EXPECT_EQ(plain.eval_size(), 0);
  SyntheticDataset ds(SyntheticTask::kReverse, 32, 32, 5, 0, true);
  EXPECT_GT(ds.eval_size(), int64_t{1} << 40);
  for (int64_t j = 0; j < 50; ++j) {
    auto held_out = ds.eval_sample(j).first;
    EXPECT_TRUE(torch::equal(held_out, ds.eval_sample(j).first));  // deterministic
    for (int64_t i = 0; i < 50; ++i) EXPECT_FALSE(torch::equal(held_out, ds.sample(i).first));
  }
}

TEST(TextDataset, FileOfExactlySeqLenPlusOneBytesHasOneWindow) {
  TempFile file("abcdefghi");  // 9 bytes, seq_len 8
  TextDataset ds(file.path(), 8, 1);
  for (int64_t i = 0; i < 5; ++i) EXPECT_EQ(ds.window_start(i), 0);
}

TEST(TextDataset, MissingFileErrorNamesThePathAndReason) {
  const std::string path = "/tmp/shardkit_definitely_missing_file.txt";
  auto message = error_of([&] { TextDataset(path, 8, 0); });
  EXPECT_NE(message.find(path), std::string::npos) << message;
  EXPECT_NE(message.find("No such file"), std::string::npos) << message;
}

TEST(TextDataset, ShortFileErrorNamesThePathAndSizes) {
  TempFile file("tiny");
  auto message = error_of([&] { TextDataset(file.path(), 8, 0); });
  EXPECT_NE(message.find(file.path()), std::string::npos) << message;
  EXPECT_NE(message.find("4 bytes"), std::string::npos) << message;
  EXPECT_NE(message.find("9"), std::string::npos) << message;
}

TEST(TextDataset, VocabOtherThan256IsRejectedNamingModelVocabSize) {
  TempFile file(std::string(100, 'x'));
  DataOptions data;
  data.kind = framework::data::DataKind::kText;
  data.path = file.path();
  auto message = error_of([&] { make_dataset(data, model_options(32, 16), 0); });
  EXPECT_NE(message.find("model.vocab_size"), std::string::npos) << message;
}

}  // namespace
}  // namespace framework::data
