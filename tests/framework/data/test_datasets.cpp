// Synthetic and text datasets: determinism, correct answers, file errors.
#include "framework/data/dataset.h"
#include "framework/data/sft_dataset.h"
#include "framework/data/synthetic_dataset.h"
#include "framework/tokenizer/hf_bpe.h"
#include "framework/tokenizer/tokenizer.h"
#include "framework/data/text_dataset.h"

#include "support/chat_tokenizer.h"
#include "support/paths.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <functional>
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

// ------------------------------------------------------------------ sft

// The chat tokenizer (tests/support/chat_tokenizer.h), written as a
// tokenizer.json.
std::string chat_tokenizer_json() {
  const std::string path = "/tmp/shardkit_sft_tokenizer_" + std::to_string(::getpid()) + ".json";
  std::ofstream(path) << testing_support::chat_tokenizer_json_text(testing_support::source_dir());
  return path;
}

// prompt/completion, bytes: the prompt's tokens train nothing, the
// completion's do; whole records share a window (packed) or get one each.
TEST(SftDataset, PromptCompletionMasksThePromptAndPacksWholeRecords) {
  TempFile file("{\"prompt\": \"ab\", \"completion\": \"CD\"}\n\n"
                "{\"prompt\": \"ef\", \"completion\": \"GH\"}\n"
                "{\"prompt\": \"ij\", \"completion\": \"KLMNOPQRSTUV\"}\n");
  SftDataset ds(file.path(), "bytes", 9, 256, 7, 0, true);
  EXPECT_EQ(ds.stats().records, 3);
  EXPECT_EQ(ds.stats().prompt_tokens, 6);
  EXPECT_EQ(ds.stats().completion_tokens, 16);
  EXPECT_EQ(ds.stats().truncated, 1);  // 14 tokens, cut to 10
  EXPECT_EQ(ds.stats().windows, 2);    // "abCDefGH" + padding, then "ijKLMNOPQR"
  const auto [w0, t0] = ds.window(0);
  EXPECT_EQ(w0, (std::vector<int64_t>{'a', 'b', 'C', 'D', 'e', 'f', 'G', 'H', -1, -1}));
  EXPECT_EQ(t0, (std::vector<uint8_t>{0, 0, 1, 1, 0, 0, 1, 1, 0, 0}));
  // The samples: inputs and next-token targets, ignored where the next token
  // is a prompt's, a record's first or padding.
  std::set<std::vector<int64_t>> seen;
  for (int64_t i = 0; i < 2; ++i) {
    const auto [x, y] = ds.sample(i);
    seen.insert(to_vector(x));
    if (to_vector(x)[0] == 'a') {
      const int64_t I = kIgnoreIndex;
      EXPECT_EQ(to_vector(x), (std::vector<int64_t>{'a', 'b', 'C', 'D', 'e', 'f', 'G', 'H', 0}));
      EXPECT_EQ(to_vector(y), (std::vector<int64_t>{I, 'C', 'D', I, I, 'G', 'H', I, I}));
    }
  }
  EXPECT_EQ(seen.size(), 2u);  // an epoch visits every window once
  EXPECT_NE(ds.describe().find("3 records: 6 prompt and 16 completion tokens, 1 cut to seq_len + 1; 2 packed windows"),
            std::string::npos) << ds.describe();
  SftDataset unpacked(file.path(), "bytes", 9, 256, 7, 0, false);
  EXPECT_EQ(unpacked.stats().windows, 3);
  EXPECT_EQ(unpacked.window(1).first, (std::vector<int64_t>{'e', 'f', 'G', 'H', -1, -1, -1, -1, -1, -1}));
  // Every epoch is a shuffle of all windows, different from the last.
  SftDataset many(file.path(), "bytes", 3, 256, 11, 0, false);
  ASSERT_EQ(many.stats().windows, 3);
  std::vector<std::vector<int64_t>> order;
  for (int64_t e = 0; e < 4; ++e) {
    std::set<std::vector<int64_t>> epoch;
    for (int64_t i = 0; i < 3; ++i) epoch.insert(to_vector(many.sample(e * 3 + i).first));
    EXPECT_EQ(epoch.size(), 3u) << "epoch " << e;
    order.push_back(to_vector(many.sample(e * 3).first));
  }
  // (epochs 0, 1, 2 start at three different windows)
  EXPECT_EQ(std::set<std::vector<int64_t>>(order.begin(), order.begin() + 3).size(), 3u);
}

// messages: the Llama 3 chat template's tokens, exactly as the tokenizer
// encodes the rendered text; only the assistant's content and <|eot_id|> train.
TEST(SftDataset, MessagesRenderTheLlama3ChatFormatAndTrainOnlyTheAssistant) {
  const std::string tok_path = chat_tokenizer_json();
  const auto tok = framework::tokenizer::load_tokenizer(tok_path);
  const int64_t begin = tok->special_token("<|begin_of_text|>"), sh = tok->special_token("<|start_header_id|>"),
                eh = tok->special_token("<|end_header_id|>"), eot = tok->special_token("<|eot_id|>");
  ASSERT_GE(begin, 0);
  ASSERT_GE(eot, 0);
  TempFile file(R"({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "  What is the )"
                R"(time?\n"}, {"role": "assistant", "content": "It is late."}, {"role": "user", "content": "Why?"}, )"
                R"({"role": "assistant", "content": "Because the sun set."}]})"
                "\n");
  SftDataset ds(file.path(), tok_path, 255, tok->vocab_size(), 1, 0, true);
  const std::string rendered =
      "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
      "<|start_header_id|>user<|end_header_id|>\n\nWhat is the time?<|eot_id|>"
      "<|start_header_id|>assistant<|end_header_id|>\n\nIt is late.<|eot_id|>"
      "<|start_header_id|>user<|end_header_id|>\n\nWhy?<|eot_id|>"
      "<|start_header_id|>assistant<|end_header_id|>\n\nBecause the sun set.<|eot_id|>";
  const std::vector<int64_t> want = tok->encode(rendered);
  const auto [tokens, trained] = ds.window(0);
  ASSERT_GE(tokens.size(), want.size());
  EXPECT_EQ(std::vector<int64_t>(tokens.begin(), tokens.begin() + static_cast<std::ptrdiff_t>(want.size())), want);
  EXPECT_EQ(tokens[want.size()], -1);  // padding after the one record
  // What trains: exactly the assistant contents and their <|eot_id|>.
  std::vector<int64_t> trained_ids;
  for (size_t t = 0; t < want.size(); ++t) {
    if (trained[t]) trained_ids.push_back(tokens[t]);
  }
  std::vector<int64_t> expect = tok->encode("It is late.");
  expect.push_back(eot);
  for (int64_t id : tok->encode("Because the sun set.")) expect.push_back(id);
  expect.push_back(eot);
  EXPECT_EQ(trained_ids, expect);
  EXPECT_EQ(ds.stats().completion_tokens, static_cast<int64_t>(expect.size()));
  EXPECT_EQ(ds.stats().prompt_tokens, static_cast<int64_t>(want.size() - expect.size()));
  (void)sh;
  (void)eh;
  std::remove(tok_path.c_str());
}

TEST(SftDataset, BadRecordsNameTheFileAndLine) {
  auto error_for = [](const std::string& text, const std::string& tokenizer = "bytes") {
    TempFile file(text);
    const std::string message = error_of([&] { SftDataset(file.path(), tokenizer, 16, 1024, 0, 0, true); });
    return std::make_pair(file.path(), message);
  };
  const std::string ok = "{\"prompt\": \"a\", \"completion\": \"b\"}\n";
  {
    const auto [path, m] = error_for(ok + "\n{\"prompt\": \"a\", \"completion\": \n");
    EXPECT_NE(m.find("data.path '" + path + "' line 3: not JSON"), std::string::npos) << m;
  }
  {
    const auto [path, m] = error_for(ok + "{\"text\": \"hello\"}\n");
    EXPECT_NE(m.find("data.path '" + path + "' line 2: a record needs \"prompt\" and \"completion\" strings, or "
                     "\"messages\""), std::string::npos) << m;
  }
  {
    const auto [path, m] = error_for("{\"prompt\": \"a\", \"completion\": 3}\n");
    EXPECT_NE(m.find("line 1: \"prompt\" and \"completion\" must be strings"), std::string::npos) << m;
  }
  {
    const auto [path, m] = error_for("{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}\n");
    EXPECT_NE(m.find("line 1: the messages format needs Llama 3's chat tokens"), std::string::npos) << m;
  }
  {
    const std::string tok = chat_tokenizer_json();
    const auto [path, m] = error_for("{\"messages\": [{\"role\": \"bot\", \"content\": \"hi\"}]}\n", tok);
    EXPECT_NE(m.find("line 1: messages[0].role 'bot' is not system, user, assistant, tool or ipython"),
              std::string::npos) << m;
    const auto [path2, m2] = error_for("{\"messages\": [{\"role\": \"user\", \"content\": 5}]}\n", tok);
    EXPECT_NE(m2.find("line 1: messages[0] must be an object with \"role\" and \"content\" strings"),
              std::string::npos) << m2;
    std::remove(tok.c_str());
  }
  {
    const auto [path, m] = error_for("\n  \n");
    EXPECT_NE(m.find("data.path '" + path + "' holds no records"), std::string::npos) << m;
  }
}

// Found by fuzz/fuzz_tokenizer_json: a token id that is a float (2.2e39:
// converting it to an integer is undefined behaviour), negative (an added
// token's wrote before the id table) or huge (it sized the table) is
// refused naming the token.
TEST(HfTokenizer, AFloatNegativeOrHugeTokenIdIsRefusedNamingTheToken) {
  nlohmann::json fixture;
  std::ifstream(testing_support::source_dir() + "/tests/tools/data/bpe_fixture.json") >> fixture;
  const nlohmann::json good = fixture["tokenizers"]["learnt_split"];
  auto error_with = [&](const std::function<void(nlohmann::json&)>& change) {
    nlohmann::json tok = good;
    change(tok);
    return error_of([&] { framework::tokenizer::parse_hf_tokenizer(tok.dump(), "t.json"); });
  };
  EXPECT_EQ(error_with([](nlohmann::json&) {}), "");
  const std::string first = good["model"]["vocab"].items().begin().key();
  EXPECT_EQ(error_with([&](nlohmann::json& t) { t["model"]["vocab"][first] = 2.22222e39; }),
            "t.json: model.vocab '" + first + "' has an id that is not an integer");
  EXPECT_EQ(error_with([](nlohmann::json& t) { t["added_tokens"][0]["id"] = -5; }),
            "t.json: added token '<|endoftext|>' has id -5, outside [0, 4194304)");
  EXPECT_EQ(error_with([&](nlohmann::json& t) { t["model"]["vocab"][first] = 1000000000000LL; }),
            "t.json: model.vocab '" + first + "' has id 1000000000000, outside [0, 4194304)");
}

}  // namespace
}  // namespace framework::data
