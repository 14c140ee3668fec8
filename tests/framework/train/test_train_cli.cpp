// The `train` binary end to end, as a user runs it: `train --nproc 2`.
#include "checkpoint/interop/weights_file.h"
#include "framework/dist/device.h"
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

namespace fs = std::filesystem;

namespace {

struct Result {
  int status = -1;
  std::string output;
};

Result run(const std::string& args) {
  std::string cmd = std::string(SHARDKIT_BINARY_DIR) + "/train " + args + " 2>&1";
  Result r;
  FILE* p = popen(cmd.c_str(), "r");
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) r.output.append(buf.data(), n);
  int raw = pclose(p);
  r.status = WIFEXITED(raw) ? WEXITSTATUS(raw) : 128 + WTERMSIG(raw);
  return r;
}

std::string scratch(const std::string& tag) {
  auto dir = fs::temp_directory_path() / ("shardkit_cli_" + tag + "_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  return dir.string();
}

std::string common(const std::string& dir) {
  return "--config " + std::string(SHARDKIT_SOURCE_DIR) + "/configs/default.yaml --set run.dir=" + dir +
         " --set checkpoint.dir=" + dir + "/ck --set train.steps=20 --set train.log_every=1"
         " --set checkpoint.interval=5 --set checkpoint.mode=async";
}

// step -> loss, as metrics.jsonl records it (later lines win).
std::map<int64_t, double> losses(const std::string& dir) {
  std::map<int64_t, double> out;
  std::ifstream in(dir + "/metrics.jsonl");
  std::string line;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line);
    if (j.contains("loss")) out[j["step"].get<int64_t>()] = j["loss"].get<double>();
  }
  return out;
}

}  // namespace

TEST(TrainCli, ResumeAfterStopAtIsBitExact) {
  std::string full = scratch("full"), split = scratch("split");
  Result a = run("--nproc 2 " + common(full));
  ASSERT_EQ(a.status, 0) << a.output;
  Result b = run("--nproc 2 " + common(split) + " --set train.stop_at=10");
  ASSERT_EQ(b.status, 0) << b.output;
  EXPECT_NE(b.output.find("checkpoint step 10 (async) committed"), std::string::npos) << b.output;
  Result c = run("--nproc 2 " + common(split));
  ASSERT_EQ(c.status, 0) << c.output;
  EXPECT_NE(c.output.find("resumed from " + split + "/ck/step_10"), std::string::npos) << c.output;
  auto want = losses(full), got = losses(split);
  ASSERT_EQ(want.size(), 20u);
  ASSERT_EQ(got.size(), 20u);
  for (int64_t s = 11; s <= 20; ++s) {
    EXPECT_EQ(got.at(s), want.at(s)) << "step " << s << " is not bit-identical";
  }
  EXPECT_LT(want.at(20), want.at(1));
  fs::remove_all(full);
  fs::remove_all(split);
}

TEST(TrainCli, ConfigErrorsExitWithStatusTwoNamingTheKey) {
  std::string dir = scratch("badcfg");
  Result r = run(common(dir) + " --set checkpoint.intervl=5");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("did you mean checkpoint.interval?"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(dir));
  if (!framework::dist::cuda_available()) {
    // Without a usable GPU, cuda is refused as a config error, before anything is written.
    Result d = run(common(dir) + " --set train.device=cuda");
    EXPECT_EQ(d.status, 2) << d.output;
    EXPECT_NE(d.output.find("train.device: cuda, but"), std::string::npos) << d.output;
    EXPECT_FALSE(fs::exists(dir));
  }
  Result w = run("--nproc 2 " + common(dir) + " --set parallel.replicate=3 --set parallel.shard=1");
  EXPECT_EQ(w.status, 2) << w.output;
  EXPECT_NE(w.output.find("parallel.replicate"), std::string::npos) << w.output;
  EXPECT_FALSE(fs::exists(dir));
}

TEST(TrainCli, ARankThatFailsStopsTheJobAndIsNamed) {
  std::string dir = scratch("rankfail");
  // A real weights file (so the checks before the ranks start pass) whose
  // tensor does not belong to this model: every rank fails loading it.
  fs::create_directories(dir);
  const std::string weights = dir + "/other_model.safetensors";
  {
    checkpoint::SafetensorsTensor t;
    t.name = "not.a.parameter";
    t.dtype = checkpoint::DType::kFloat32;
    t.shape = {2};
    const float values[2] = {1.0f, 2.0f};
    t.data = reinterpret_cast<const uint8_t*>(values);
    checkpoint::write_safetensors(weights, {t});
  }
  Result r = run("--nproc 2 " + common(dir + "/run") + " --set model.init_from=" + weights);
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("launcher: rank"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("not.a.parameter"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("frame #"), std::string::npos) << r.output;
  fs::remove_all(dir);
}

namespace {

// An llm.c gpt-2 shard (header of 256 int32, then uint16 tokens).
void write_llmc_shard(const std::string& path, const std::vector<uint16_t>& tokens) {
  std::vector<int32_t> header(256, 0);
  header[0] = 20240520;
  header[1] = 1;
  header[2] = static_cast<int32_t>(tokens.size());
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(header.data()), 1024);
  out.write(reinterpret_cast<const char*>(tokens.data()), static_cast<std::streamsize>(tokens.size() * 2));
}

std::string llama_on_tokens(const std::string& dir, const std::string& data) {
  return "--config " + std::string(SHARDKIT_SOURCE_DIR) + "/configs/llama_tiny.yaml --set run.dir=" + dir +
         " --set checkpoint.dir=" + dir + "/ck --set train.steps=12 --set train.log_every=1"
         " --set train.eval_every=6 --set checkpoint.interval=6 --set data.kind=tokens"
         " --set data.path=" + data + "/train_*.bin --set data.eval_path=" + data + "/val.bin";
}

}  // namespace

// data.kind tokens end to end: a llama trains on llm.c shards with a
// validation shard, stops, and resumes bit-exactly; a token id the model
// has no embedding for stops the run before it starts, naming file and offset.
TEST(TrainCli, TrainsOnTokenShardsAndResumesBitExactly) {
  const std::string data = scratch("tokens_data");
  fs::create_directories(data);
  for (int shard = 0; shard < 3; ++shard) {
    std::vector<uint16_t> tokens;
    for (int doc = 0; doc < 40; ++doc) {  // counting runs mod 32, one per document
      for (int t = 0; t < 24; ++t) tokens.push_back(static_cast<uint16_t>((doc + shard + t) % 32));
    }
    write_llmc_shard(data + "/" + (shard < 2 ? "train_00" + std::to_string(shard) : std::string("val")) +
                         ".bin", tokens);
  }
  const std::string full = scratch("tokens_full"), split = scratch("tokens_split");
  Result a = run("--nproc 2 " + llama_on_tokens(full, data));
  ASSERT_EQ(a.status, 0) << a.output;
  EXPECT_NE(a.output.find("data tokens '" + data + "/train_*.bin' (2 shards, llm.c uint16, 1920 tokens"),
            std::string::npos) << a.output;
  EXPECT_NE(a.output.find("eval_path '" + data + "/val.bin' 960 tokens"), std::string::npos) << a.output;
  Result b = run("--nproc 2 " + llama_on_tokens(split, data) + " --set train.stop_at=6");
  ASSERT_EQ(b.status, 0) << b.output;
  Result c = run("--nproc 2 " + llama_on_tokens(split, data));
  ASSERT_EQ(c.status, 0) << c.output;
  EXPECT_NE(c.output.find("resumed from " + split + "/ck/step_6"), std::string::npos) << c.output;
  auto want = losses(full), got = losses(split);
  ASSERT_EQ(want.size(), 12u);
  ASSERT_EQ(got.size(), 12u);
  for (int64_t s = 7; s <= 12; ++s) EXPECT_EQ(got.at(s), want.at(s)) << "step " << s;
  EXPECT_LT(want.at(12), want.at(1));

  // One id of 32 in a vocabulary of 32: exit 2, one line, nothing written.
  std::vector<uint16_t> tokens(500, 3);
  tokens[321] = 32;
  write_llmc_shard(data + "/train_001.bin", tokens);
  const std::string refused = scratch("tokens_refused");
  Result r = run("--nproc 2 " + llama_on_tokens(refused, data));
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("train: data.path: '" + data + "/train_001.bin': token id 32 at byte offset " +
                          std::to_string(1024 + 321 * 2) + " (token 321) is outside [0, model.vocab_size 32)"),
            std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("Exception raised from"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(refused));
  for (const auto& d : {data, full, split}) fs::remove_all(d);
}
