// data.kind tokens: llm.c and Megatron shards as their own writers lay them
// out (tests/framework/data/write_token_shards.py follows llm.c's
// write_datafile and Megatron-LM's _IndexWriter), windows and epochs,
// held-out documents, and one clear error per kind of bad input.
#include "framework/data/dataset.h"
#include "framework/data/token_dataset.h"
#include "support/paths.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

namespace fs = std::filesystem;

namespace framework::data {
namespace {

std::vector<int64_t> read_i64(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::vector<int64_t> v;
  int64_t x;
  while (in.read(reinterpret_cast<char*>(&x), sizeof(x))) v.push_back(x);
  return v;
}

std::vector<int64_t> token_vector(const torch::Tensor& t) {
  return std::vector<int64_t>(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + t.numel());
}

template <typename Fn>
std::string token_error_of(Fn fn) {
  try {
    fn();
  } catch (const DataError& e) {
    return e.what();
  }
  return "(no DataError)";
}

// An llm.c gpt-2 shard of `tokens`, written here byte by byte.
void write_llmc16(const std::string& path, const std::vector<uint16_t>& tokens) {
  std::vector<int32_t> header(256, 0);
  header[0] = 20240520;
  header[1] = 1;
  header[2] = static_cast<int32_t>(tokens.size());
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(header.data()), 1024);
  out.write(reinterpret_cast<const char*>(tokens.data()), static_cast<std::streamsize>(tokens.size() * 2));
}

class TokenShards : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = (fs::temp_directory_path() / ("shardkit_tokens_" + std::to_string(::getpid()))).string();
    fs::remove_all(dir_);
    const std::string cmd = "/usr/bin/python3 " + testing_support::source_dir() +
                            "/tests/framework/data/write_token_shards.py " + dir_ + " 7";
    // python3 with numpy comes with python3-torch, which bootstrap installs:
    // a failure here fails the suite.
    ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  }
  static void TearDownTestSuite() { fs::remove_all(dir_); }
  static std::string dir_;

  static TokenDatasetOptions options(const std::string& path, int64_t seq_len = 16) {
    TokenDatasetOptions o;
    o.path = path;
    o.seq_len = seq_len;
    o.vocab_size = 128256;
    o.seed = 11;
    return o;
  }
};
std::string TokenShards::dir_;

TEST_F(TokenShards, EachShardReadsAsItsWriterLaidItOut) {
  const std::vector<std::pair<std::string, std::string>> files = {
      {"llmc_000", "llm.c uint16"},       {"llmc_001", "llm.c uint16"},
      {"llama3_000", "llm.c uint32"},     {"mega_text_document", "megatron int32"},
      {"mega16", "megatron uint16"}};
  for (const auto& [stem, format] : files) {
    SCOPED_TRACE(stem);
    const TokenShard s = open_token_shard(dir_ + "/" + stem + ".bin");
    EXPECT_EQ(s.format, format);
    const auto want = read_i64(dir_ + "/" + stem + ".expected");
    ASSERT_EQ(s.tokens, static_cast<int64_t>(want.size()));
    for (int64_t t = 0; t < s.tokens; ++t) ASSERT_EQ(s.at(t), want[t]) << "token " << t;
    EXPECT_EQ(s.doc_starts, read_i64(dir_ + "/" + stem + ".docs"));
  }
  // The llama-3 shard holds ids above 65535 (it is why llm.c widened it).
  const TokenShard l3 = open_token_shard(dir_ + "/llama3_000.bin");
  int64_t top = 0;
  for (int64_t t = 0; t < l3.tokens; ++t) top = std::max(top, l3.at(t));
  EXPECT_GT(top, 65535);
}

// Found by fuzz_token_shard: a Megatron index whose last document is empty
// (its index repeats the sequence count, as _IndexWriter writes when
// end_document follows end_document) put a document start at the shard's
// end, one past its last token, where the next shard's first document
// starts: the stream counted a document too many.
TEST_F(TokenShards, AnEmptyLastMegatronDocumentStartsNoDocument) {
  const std::string stem = dir_ + "/empty_last_doc";
  const std::vector<int32_t> lengths = {3, 2, 2};
  const std::vector<int64_t> pointers = {0, 12, 20};  // bytes: int32 tokens
  const std::vector<int64_t> documents = {0, 1, 3, 3};
  {
    std::ofstream idx(stem + ".idx", std::ios::binary);
    idx.write("MMIDIDX\0\0", 9);
    const uint64_t version = 1, sequences = lengths.size(), docs = documents.size();
    const uint8_t dtype = 4;  // int32
    idx.write(reinterpret_cast<const char*>(&version), 8);
    idx.write(reinterpret_cast<const char*>(&dtype), 1);
    idx.write(reinterpret_cast<const char*>(&sequences), 8);
    idx.write(reinterpret_cast<const char*>(&docs), 8);
    idx.write(reinterpret_cast<const char*>(lengths.data()), 4 * 3);
    idx.write(reinterpret_cast<const char*>(pointers.data()), 8 * 3);
    idx.write(reinterpret_cast<const char*>(documents.data()), 8 * 4);
    const std::vector<int32_t> tokens = {1, 2, 3, 4, 5, 6, 7};
    std::ofstream(stem + ".bin", std::ios::binary).write(reinterpret_cast<const char*>(tokens.data()), 4 * 7);
  }
  const TokenShard s = open_token_shard(stem + ".bin");
  EXPECT_EQ(s.tokens, 7);
  EXPECT_EQ(s.doc_starts, (std::vector<int64_t>{0, 3}));
  fs::remove(stem + ".bin");
  fs::remove(stem + ".idx");
}

TEST_F(TokenShards, ADirectoryGlobOrPrefixIsOneStreamInNameOrder) {
  const auto all = resolve_token_paths(dir_, "data.path");
  ASSERT_EQ(all.size(), 5u);  // the .bin files, not .idx, .expected or .docs
  TokenDataset ds(options(dir_));
  std::vector<int64_t> want;
  for (const auto& p : all) {
    const auto part = read_i64(p.substr(0, p.size() - 4) + ".expected");
    want.insert(want.end(), part.begin(), part.end());
  }
  ASSERT_EQ(ds.train_tokens(), static_cast<int64_t>(want.size()));
  EXPECT_EQ(ds.read(0, ds.train_tokens()), want);
  EXPECT_EQ(resolve_token_paths(dir_ + "/llmc_*", "data.path").size(), 2u);
  EXPECT_EQ(resolve_token_paths(dir_ + "/mega16", "data.path"),
            std::vector<std::string>{dir_ + "/mega16.bin"});  // Megatron's path prefix
  EXPECT_EQ(resolve_token_paths(dir_ + "/mega16.idx", "data.path"),
            std::vector<std::string>{dir_ + "/mega16.bin"});
  EXPECT_NE(ds.describe().find("5 shards"), std::string::npos) << ds.describe();
}

TEST_F(TokenShards, ADirectoryOfTrainAndValShardsTrainsOnTrainAndValidatesOnVal) {
  // tokenize --eval-fraction's layout (and llm.c's NAME_train_* / NAME_val_*):
  // a directory as data.path must not train on the held-out val_* shards.
  for (const std::string& prefix : {std::string("tk_"), std::string("fineweb_")}) {
    const std::string d = dir_ + "/split_" + prefix;
    fs::create_directories(d);
    const bool llmc = prefix == "fineweb_";
    std::vector<uint16_t> train0(40), train1(30), val0(25);
    for (size_t i = 0; i < train0.size(); ++i) train0[i] = static_cast<uint16_t>(i);
    for (size_t i = 0; i < train1.size(); ++i) train1[i] = static_cast<uint16_t>(100 + i);
    for (size_t i = 0; i < val0.size(); ++i) val0[i] = static_cast<uint16_t>(1000 + i);
    const std::string t = llmc ? "fineweb_train_" : "train_", v = llmc ? "fineweb_val_" : "val_";
    write_llmc16(d + "/" + t + "000000.bin", train0);
    write_llmc16(d + "/" + t + "000001.bin", train1);
    write_llmc16(d + "/" + v + "000000.bin", val0);
    auto o = options(d, 8);
    o.eval_fraction = 0.5;  // the val_* shards take its place
    TokenDataset ds(o);
    EXPECT_EQ(ds.shards().size(), 2u);
    EXPECT_EQ(ds.train_tokens(), 70);
    EXPECT_EQ(ds.eval_tokens(), 25);
    std::vector<int64_t> want(train0.begin(), train0.end());
    want.insert(want.end(), train1.begin(), train1.end());
    EXPECT_EQ(ds.read(0, 70), want);
    EXPECT_EQ(token_vector(ds.eval_sample(0).second), std::vector<int64_t>(val0.begin() + 1, val0.begin() + 9));
    EXPECT_NE(ds.describe().find("training on its 2 train_* shards, validating on its 1 val_* shard (25 tokens)"),
              std::string::npos)
        << ds.describe();
    // data.eval_path says otherwise: it validates, and val_* still trains nothing.
    o.eval_path = d + "/" + t + "000001.bin";
    const std::string e = token_error_of([&] { TokenDataset x(o); });
    EXPECT_NE(e.find("also a training shard"), std::string::npos) << e;
    fs::create_directories(dir_ + "/split_eval");
    const std::string other = dir_ + "/split_eval/" + prefix + ".bin";
    write_llmc16(other, val0);
    o.eval_path = other;
    TokenDataset with_eval(o);
    EXPECT_EQ(with_eval.train_tokens(), 70);
    EXPECT_NE(with_eval.describe().find("its own 1 val_* shard not trained on"), std::string::npos)
        << with_eval.describe();
  }
  // A directory with no val_* shard is every .bin in it, as before.
  const std::string only = dir_ + "/split_train_only";
  fs::create_directories(only);
  write_llmc16(only + "/train_000000.bin", std::vector<uint16_t>(20, 3));
  write_llmc16(only + "/extra.bin", std::vector<uint16_t>(10, 4));
  EXPECT_EQ(TokenDataset(options(only, 8)).train_tokens(), 30);
}

TEST_F(TokenShards, AnEpochVisitsEveryWindowOnceInASeededOrder) {
  const int64_t L = 16;
  TokenDataset ds(options(dir_, L));
  const int64_t W = ds.windows_per_epoch();
  ASSERT_EQ(W, (ds.train_tokens() - 1) / L);
  std::set<int64_t> first, second;
  std::vector<int64_t> order1, order2;
  for (int64_t i = 0; i < W; ++i) {
    first.insert(ds.window_start(i));
    second.insert(ds.window_start(W + i));
    order1.push_back(ds.window_start(i));
    order2.push_back(ds.window_start(W + i));
  }
  EXPECT_EQ(static_cast<int64_t>(first.size()), W);
  EXPECT_EQ(first, second);
  EXPECT_EQ(*first.begin(), 0);
  EXPECT_EQ(*first.rbegin(), (W - 1) * L);
  EXPECT_NE(order1, order2);  // each epoch its own order
  // sample(i): the window, inputs and next-token targets; a pure function of (seed, i).
  TokenDataset again(options(dir_, L));
  auto other = options(dir_, L);
  other.seed = 12;
  TokenDataset reseeded(other);
  int differs = 0;
  for (int64_t i : {0L, 1L, 7L, W - 1, W, 3 * W + 5}) {
    const auto [in, tgt] = ds.sample(i);
    const auto window = ds.read(ds.window_start(i), L + 1);
    EXPECT_EQ(token_vector(in), std::vector<int64_t>(window.begin(), window.end() - 1));
    EXPECT_EQ(token_vector(tgt), std::vector<int64_t>(window.begin() + 1, window.end()));
    EXPECT_TRUE(torch::equal(in, again.sample(i).first));
    differs += ds.window_start(i) != reseeded.window_start(i);
  }
  EXPECT_GT(differs, 0);
}

TEST_F(TokenShards, EvalFractionHoldsOutTrailingWholeDocuments) {
  // One Megatron file of 7 documents: the split is a document start.
  auto o = options(dir_ + "/mega_text_document", 8);
  o.eval_fraction = 0.2;
  TokenDataset ds(o);
  const auto docs = read_i64(dir_ + "/mega_text_document.docs");
  const int64_t total = static_cast<int64_t>(read_i64(dir_ + "/mega_text_document.expected").size());
  EXPECT_NE(std::find(docs.begin(), docs.end(), ds.train_tokens()), docs.end());
  EXPECT_GE(ds.eval_tokens(), static_cast<int64_t>(0.2 * static_cast<double>(total)));
  EXPECT_EQ(ds.train_tokens() + ds.eval_tokens(), total);
  // No training window reaches a held-out token; eval windows start at the split.
  for (int64_t i = 0; i < ds.windows_per_epoch(); ++i) {
    EXPECT_LE(ds.window_start(i) + 8, ds.train_tokens() - 1);
  }
  ASSERT_GT(ds.eval_size(), 0);
  const auto held = ds.read(ds.train_tokens(), 9);
  EXPECT_EQ(token_vector(ds.eval_sample(0).first), std::vector<int64_t>(held.begin(), held.end() - 1));
  EXPECT_NE(ds.describe().find("documents held out"), std::string::npos) << ds.describe();

  // Two llm.c shards, one document each: the last shard is held out.
  auto two = options(dir_ + "/llmc_*.bin", 8);
  two.eval_fraction = 0.1;
  TokenDataset by_shard(two);
  EXPECT_EQ(by_shard.train_tokens(), by_shard.shards()[0].tokens);
}

TEST_F(TokenShards, EvalFractionOfOneDocumentHoldsOutItsLastTokens) {
  // One llm.c shard has no document index, so it is one document (as
  // `tokenize` writes one text file): whole documents would leave nothing
  // to train on, so its last tokens are held out instead.
  auto one = options(dir_ + "/llmc_000.bin", 8);
  one.eval_fraction = 0.25;
  TokenDataset tail(one);
  const int64_t n = tail.shards()[0].tokens;
  const auto want = static_cast<int64_t>(std::ceil(0.25 * static_cast<double>(n)));
  EXPECT_EQ(tail.eval_tokens(), want);
  EXPECT_EQ(tail.train_tokens(), n - want);
  for (int64_t i = 0; i < tail.windows_per_epoch(); ++i) {
    EXPECT_LE(tail.window_start(i) + 8, tail.train_tokens() - 1);
  }
  ASSERT_GT(tail.eval_size(), 0);
  const auto last = tail.read(tail.train_tokens(), 9);
  EXPECT_EQ(token_vector(tail.eval_sample(0).first), std::vector<int64_t>(last.begin(), last.end() - 1));
  EXPECT_NE(tail.describe().find("last " + std::to_string(want) + " tokens held out"), std::string::npos)
      << tail.describe();
  EXPECT_NE(tail.describe().find("within a document"), std::string::npos) << tail.describe();

  // A tail too short for one window: refused, naming the keys and the path.
  one.eval_fraction = 0.01;
  const std::string e = token_error_of([&] { TokenDataset d(one); });
  EXPECT_NE(e.find("data.eval_fraction 0.01 holds out the last"), std::string::npos) << e;
  EXPECT_NE(e.find("of data.path '" + dir_ + "/llmc_000.bin' (" + std::to_string(n) + " tokens in 1 document)"),
            std::string::npos) << e;
  EXPECT_NE(e.find("model.seq_len + 1 = 9 (set data.eval_path, or data.eval_fraction 0"), std::string::npos) << e;
}

TEST_F(TokenShards, EvalPathIsItsOwnStreamAndMustNotOverlapTraining) {
  auto o = options(dir_ + "/llmc_*.bin", 8);
  o.eval_path = dir_ + "/mega16.bin";
  TokenDataset ds(o);
  EXPECT_EQ(ds.eval_tokens(), open_token_shard(dir_ + "/mega16.bin").tokens);
  const auto want = read_i64(dir_ + "/mega16.expected");
  EXPECT_EQ(token_vector(ds.eval_sample(1).second), std::vector<int64_t>(want.begin() + 9, want.begin() + 17));
  o.eval_path = dir_ + "/llmc_001.bin";
  const std::string e = token_error_of([&] { TokenDataset d(o); });
  EXPECT_NE(e.find("also a training shard"), std::string::npos) << e;
}

TEST_F(TokenShards, BadInputIsOneErrorNamingTheFileAndOffset) {
  const std::string bad = dir_ + "/bad";
  fs::create_directories(bad);
  auto o = options(bad + "/x.bin", 8);

  {  // not a shard at all
    std::ofstream(bad + "/x.bin") << "plain text, not tokens, long enough to hold a header";
    const std::string e = token_error_of([&] { TokenDataset d(o); });
    EXPECT_NE(e.find("data.path: '" + bad + "/x.bin' is not a token shard: offset 0"), std::string::npos) << e;
  }
  {  // truncated: the header promises more tokens than the file holds
    fs::copy_file(dir_ + "/llmc_000.bin", bad + "/x.bin", fs::copy_options::overwrite_existing);
    fs::resize_file(bad + "/x.bin", fs::file_size(bad + "/x.bin") - 3);
    const std::string e = token_error_of([&] { TokenDataset d(o); });
    EXPECT_NE(e.find("'" + bad + "/x.bin' is truncated"), std::string::npos) << e;
  }
  {  // a token id the model has no embedding for
    std::vector<uint16_t> tokens(100, 5);
    tokens[37] = 900;
    write_llmc16(bad + "/x.bin", tokens);
    o.vocab_size = 512;
    const std::string e = token_error_of([&] { TokenDataset d(o); });
    EXPECT_NE(e.find("token id 900 at byte offset " + std::to_string(1024 + 37 * 2) + " (token 37)"),
              std::string::npos) << e;
    EXPECT_NE(e.find("model.vocab_size 512"), std::string::npos) << e;
    // Without the scan at start, the window that holds it is refused.
    o.check_tokens = false;
    TokenDataset lazy(o);
    std::string when_read;
    for (int64_t i = 0; i < lazy.windows_per_epoch() && when_read.empty(); ++i) {
      try {
        lazy.sample(i);
      } catch (const DataError& err) {
        when_read = err.what();
      }
    }
    EXPECT_NE(when_read.find("token id 900 at byte offset 1098"), std::string::npos) << when_read;
    o.check_tokens = true;
    o.vocab_size = 128256;
  }
  {  // a Megatron index cut short
    fs::copy_file(dir_ + "/mega16.bin", bad + "/m.bin", fs::copy_options::overwrite_existing);
    fs::copy_file(dir_ + "/mega16.idx", bad + "/m.idx", fs::copy_options::overwrite_existing);
    fs::resize_file(bad + "/m.idx", fs::file_size(bad + "/m.idx") - 8);
    o.path = bad + "/m.bin";
    const std::string e = token_error_of([&] { TokenDataset d(o); });
    EXPECT_NE(e.find("'" + bad + "/m.idx' is truncated"), std::string::npos) << e;
    // ... and its .bin cut short
    fs::copy_file(dir_ + "/mega16.idx", bad + "/m.idx", fs::copy_options::overwrite_existing);
    fs::resize_file(bad + "/m.bin", fs::file_size(bad + "/m.bin") - 2);
    const std::string f = token_error_of([&] { TokenDataset d(o); });
    EXPECT_NE(f.find("'" + bad + "/m.bin' is truncated"), std::string::npos) << f;
    EXPECT_NE(f.find("m.idx' lists"), std::string::npos) << f;
  }
  {  // an empty glob, an empty directory, a missing file
    o.path = bad + "/nothing_*.bin";
    EXPECT_NE(token_error_of([&] { TokenDataset d(o); }).find("data.path: no file matches '" + o.path + "'"),
              std::string::npos);
    fs::create_directories(bad + "/empty");
    o.path = bad + "/empty";
    EXPECT_NE(token_error_of([&] { TokenDataset d(o); }).find("holds no .bin token shards"), std::string::npos);
    o.path = bad + "/missing.bin";
    EXPECT_NE(token_error_of([&] { TokenDataset d(o); }).find("data.path: cannot open"), std::string::npos);
  }
  {  // fewer tokens than one window
    write_llmc16(bad + "/x.bin", std::vector<uint16_t>(8, 1));
    o.path = bad + "/x.bin";
    const std::string e = token_error_of([&] { TokenDataset d(o); });
    EXPECT_NE(e.find("fewer than model.seq_len + 1 = 9"), std::string::npos) << e;
  }
}

TEST_F(TokenShards, MakeDatasetBuildsTokensFromTheConfig) {
  DataOptions d;
  d.kind = framework::data::DataKind::kTokens;
  d.path = dir_ + "/llmc_*.bin";
  d.eval_fraction = 0.1;
  models::ModelOptions m;
  m.vocab_size = 50304;
  m.seq_len = 16;
  auto ds = make_dataset(d, m, 3);
  EXPECT_EQ(ds->seq_len(), 16);
  EXPECT_EQ(ds->vocab_size(), 50304);
  EXPECT_GT(ds->eval_size(), 0);
  EXPECT_EQ(ds->sample(4).first.sizes(), torch::IntArrayRef({16}));
}

}  // namespace
}  // namespace framework::data
