// The `train` binary end to end, as a user runs it: `train --nproc 2`.
#include "checkpoint/interop/export.h"
#include "checkpoint/interop/weights_file.h"
#include "checkpoint/format/types.h"
#include "comm/device.h"
#include "framework/train/goodput.h"
#include "support/paths.h"
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <cstring>
#include <cmath>
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace fs = std::filesystem;

namespace {

struct Result {
  int status = -1;
  std::string output;
};

// build/<tool> with `args`, stdout and stderr together.
// train and generate go through test_fork (comm/fork_server.h): forked from
// a copy loaded once, as an exec'd one would run.
Result run_tool(const std::string& tool, const std::string& args, const std::string& env = "") {
  const std::string dir = testing_support::binary_dir();
  const std::string served = tool == "train" || tool == "generate" ? dir + "/test_fork " : "";
  std::string cmd = env + served + dir + "/" + tool + " " + args + " 2>&1";
  Result r;
  FILE* p = popen(cmd.c_str(), "r");
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) r.output.append(buf.data(), n);
  int raw = pclose(p);
  r.status = WIFEXITED(raw) ? WEXITSTATUS(raw) : 128 + WTERMSIG(raw);
  return r;
}

Result run(const std::string& args) { return run_tool("train", args); }

std::string cli_scratch(const std::string& tag) {
  auto dir = fs::temp_directory_path() / ("shardkit_cli_" + tag + "_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  return dir.string();
}

std::string common(const std::string& dir) {
  return "--config " + testing_support::source_dir() + "/configs/default.yaml --set run.dir=" + dir +
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
  std::string full = cli_scratch("full"), split = cli_scratch("split");
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

// The startup record's "forked" of each process (metrics.jsonl).
std::vector<bool> forked_startups(const std::string& dir) {
  std::vector<bool> out;
  std::ifstream in(dir + "/metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    const auto j = nlohmann::json::parse(line);
    if (j.value("event", "") == "startup") out.push_back(j.at("forked").get<bool>());
  }
  return out;
}

// train --nproc's ranks start from rank templates forked at the launcher's
// start (comm::fork_rank_templates) and train exactly as exec'd ones
// (SHARDKIT_FORK_RANKS=0): the same losses, bit for bit, and the same files.
// And a run finds checkpoint.direct_io auto's probe of an earlier run in
// SHARDKIT_DIRECT_IO_PROBES's file instead of probing again.
TEST(TrainCli, ForkedRanksTrainExactlyAsExecdRanksAndALaterRunReusesTheProbe) {
  const std::string forked = cli_scratch("forked"), execd = cli_scratch("execd");
  const std::string steps = " --set train.steps=4 --set checkpoint.interval=2 --set checkpoint.direct_io=auto";
  const std::string probes = forked + "_probes";
  fs::remove(probes);
  Result a = run_tool("train", "--nproc 2 " + common(forked) + steps, "SHARDKIT_DIRECT_IO_PROBES=" + probes + " ");
  ASSERT_EQ(a.status, 0) << a.output;
  const auto text_of = [](const std::string& path) {
    std::ifstream in(path);
    return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  };
  const std::string probed = text_of(probes);
  Result b = run_tool("train", "--nproc 2 " + common(execd) + steps,
                      "SHARDKIT_FORK_RANKS=0 SHARDKIT_DIRECT_IO_PROBES=" + probes + " ");
  ASSERT_EQ(b.status, 0) << b.output;
  EXPECT_NE(a.output.find("checkpoint.direct_io auto: "), std::string::npos) << a.output;
  EXPECT_EQ(a.output.find("reused from"), std::string::npos) << a.output;
  EXPECT_NE(probed.find("direct_io_probe/1 "), std::string::npos) << probed;
  // b's ranks probed nothing: the file still holds a's timings, and rank 0
  // says where its probe came from (the shared file, or the run's own file
  // where its other rank copied the shared line first).
  EXPECT_EQ(text_of(probes), probed);
  const bool from_shared =
      b.output.find("probe of an earlier process, reused from " + probes + " (SHARDKIT_DIRECT_IO_PROBES)") !=
      std::string::npos;
  const bool from_run = b.output.find("probe of an earlier process of this run, reused from " + execd +
                                      "/.direct_io_probes") != std::string::npos;
  EXPECT_TRUE(from_shared || from_run) << b.output;
  fs::remove(probes);
  EXPECT_NE(a.output.find("shardkit: startup "), std::string::npos) << a.output;
  EXPECT_NE(a.output.find(" s from the fork (load "), std::string::npos) << a.output;
  EXPECT_EQ(b.output.find(" s from the fork (load "), std::string::npos) << b.output;
  EXPECT_EQ(forked_startups(forked), std::vector<bool>{true});
  EXPECT_EQ(forked_startups(execd), std::vector<bool>{false});
  const auto want = losses(execd), got = losses(forked);
  ASSERT_EQ(want.size(), 4u);
  EXPECT_EQ(got, want);
  for (const char* step : {"step_2", "step_4"}) {
    EXPECT_TRUE(fs::exists(fs::path(forked) / "ck" / step / ".metadata")) << step << "\n" << a.output;
  }
  // Both ranks' output came through the launcher's pipes with their prefixes.
  EXPECT_NE(a.output.find("[rank 0] step 4/4"), std::string::npos) << a.output;
  fs::remove_all(forked);
  fs::remove_all(execd);
}

TEST(TrainCli, ConfigErrorsExitWithStatusTwoNamingTheKey) {
  std::string dir = cli_scratch("badcfg");
  Result r = run(common(dir) + " --set checkpoint.intervl=5");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("did you mean checkpoint.interval?"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(dir));
  if (!comm::cuda_available()) {
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
  std::string dir = cli_scratch("rankfail");
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
  return "--config " + testing_support::source_dir() + "/configs/llama_tiny.yaml --set run.dir=" + dir +
         " --set checkpoint.dir=" + dir + "/ck --set train.steps=12 --set train.log_every=1"
         " --set train.eval_every=6 --set checkpoint.interval=6 --set data.kind=tokens"
         " --set data.path=" + data + "/train_*.bin --set data.eval_path=" + data + "/val.bin";
}

std::vector<char> read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<char>(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void write_bytes(const std::string& path, const std::vector<char>& bytes) {
  std::ofstream(path, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// checkpoint.resume_audit on `step6` (saved by --nproc 2 on the shards in
// `data`; step 7's loss was `loss7`): resumed at world 1 the audit passes
// and step 7 trains alike; a shard changed under its name and the shards in
// another order each exit 2 naming it (error), or warn and train on (warn),
// or pass silently (off); another run.seed allowed by allow_config_change
// is named in a warning and trains on.
// Leaves `data` as it found it.
void expect_resume_audits(const std::string& data, const std::string& step6, double loss7) {
  const std::string root = cli_scratch("resume_audit");
  int n = 0;
  const auto resume = [&](const std::string& nproc, const std::string& sets) {
    return run("--nproc " + nproc + " " + llama_on_tokens(root + "/r" + std::to_string(n++), data) +
               " --set checkpoint.resume=" + step6 + " --set train.stop_at=7 --set train.eval_every=0" + sets);
  };
  const std::string world1 = root + "/r0";
  Result one = resume("1", "");
  ASSERT_EQ(one.status, 0) << one.output;
  EXPECT_NE(one.output.find("resume audit: step 7's batch is the one " + step6 + " recorded"), std::string::npos)
      << one.output;
  EXPECT_NEAR(losses(world1).at(7), loss7, 1e-3 * loss7);

  const std::string shard0 = data + "/train_000.bin", shard1 = data + "/train_001.bin";
  const std::vector<char> original0 = read_bytes(shard0), original1 = read_bytes(shard1);
  const auto refused = [&](const Result& r, const std::string& why) {
    EXPECT_EQ(r.status, 2) << r.output;
    EXPECT_NE(r.output.find("train: checkpoint.resume_audit: resuming " + step6 + ", step 7 would train on "
                            "another batch than the saved run would have: " + why),
              std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("Exception raised from"), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("frame #"), std::string::npos) << r.output;
  };
  // A shard rewritten under its name, same size: every token one up (mod 32).
  std::vector<char> changed = original1;
  for (size_t i = 1024; i < changed.size(); i += 2) changed[i] = static_cast<char>((changed[i] + 1) % 32);
  write_bytes(shard1, changed);
  Result r = resume("2", "");
  refused(r, "a data file changed under the same name (" + shard1 + ": same size, other bytes)");
  // Said once, by rank 0.
  EXPECT_EQ(r.output.find("checkpoint.resume_audit: resuming", r.output.find("checkpoint.resume_audit: resuming") + 1),
            std::string::npos) << r.output;
  r = resume("1", " --set checkpoint.resume_audit=warn");
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("shardkit: warning: checkpoint.resume_audit: resuming " + step6), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("a data file changed under the same name"), std::string::npos) << r.output;
  r = resume("1", " --set checkpoint.resume_audit=off");
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(r.output.find("resume audit"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("checkpoint.resume_audit"), std::string::npos) << r.output;
  // The two shards swapped under each other's names.
  write_bytes(shard0, original1);
  write_bytes(shard1, original0);
  refused(resume("1", ""), "shards in another order (train_000.bin holds what train_001.bin held, train_001.bin "
                           "holds what train_000.bin held)");
  // Another seed, allowed on purpose (allow_config_change): the audit names
  // it in a warning and the run goes on.
  write_bytes(shard0, original0);
  write_bytes(shard1, original1);
  r = resume("1", " --set run.seed=99 --set checkpoint.allow_config_change=true");
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("shardkit: warning: checkpoint.resume_audit: resuming " + step6 + ", step 7 would train "
                          "on another batch than the saved run would have: another seed (saved 1234, now 99)"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("(checkpoint.allow_config_change: resuming anyway)"), std::string::npos) << r.output;
  fs::remove_all(root);
}

}  // namespace

// data.kind tokens end to end: a llama trains on llm.c shards with a
// validation shard, stops, and resumes bit-exactly; a token id the model
// has no embedding for stops the run before it starts, naming file and offset.
TEST(TrainCli, TrainsOnTokenShardsAndResumesBitExactly) {
  const std::string data = cli_scratch("tokens_data");
  fs::create_directories(data);
  for (int shard = 0; shard < 3; ++shard) {
    std::vector<uint16_t> tokens;
    for (int doc = 0; doc < 40; ++doc) {  // counting runs mod 32, one per document
      for (int t = 0; t < 24; ++t) tokens.push_back(static_cast<uint16_t>((doc + shard + t) % 32));
    }
    write_llmc_shard(data + "/" + (shard < 2 ? "train_00" + std::to_string(shard) : std::string("val")) +
                         ".bin", tokens);
  }
  const std::string full = cli_scratch("tokens_full"), split = cli_scratch("tokens_split");
  Result a = run("--nproc 2 " + llama_on_tokens(full, data));
  ASSERT_EQ(a.status, 0) << a.output;
  EXPECT_NE(a.output.find("data tokens '" + data + "/train_*.bin' (2 shards, llm.c uint16, 1920 tokens"),
            std::string::npos) << a.output;
  EXPECT_NE(a.output.find("eval_path '" + data + "/val.bin' 960 tokens"), std::string::npos) << a.output;
  // The launcher read the ids before any rank started; the ranks did not again.
  EXPECT_NE(a.output.find("ids checked: 0 files read here, 3 already checked in this job"), std::string::npos)
      << a.output;
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
  const std::string step6 = split + "/ck/step_6";
  EXPECT_NE(c.output.find("shardkit: resume audit: step 7's batch is the one " + step6 + " recorded"),
            std::string::npos) << c.output;
  expect_resume_audits(data, step6, want.at(7));

  // One id of 32 in a vocabulary of 32: exit 2, one line, nothing written.
  std::vector<uint16_t> tokens(500, 3);
  tokens[321] = 32;
  write_llmc_shard(data + "/train_001.bin", tokens);
  const std::string refused = cli_scratch("tokens_refused");
  Result r = run("--nproc 2 " + llama_on_tokens(refused, data));
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("train: data.path: '" + data + "/train_001.bin': token id 32 at byte offset " +
                          std::to_string(1024 + 321 * 2) + " (token 321) is outside [0, model.vocab_size 32)"),
            std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("Exception raised from"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(refused));
  for (const auto& d : {data, full, split}) fs::remove_all(d);
}

namespace {

Result run_ckpt(const std::string& args) { return run_tool("ckpt", args); }

// A Hugging Face Llama directory as save_pretrained lays it out: config.json,
// bf16 weights in two safetensors shards and their index.
std::map<std::string, std::vector<uint8_t>> write_hf_llama(const std::string& dir) {
  fs::create_directories(dir);
  std::ofstream(dir + "/config.json") << R"({
  "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
  "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 64,
  "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
  "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192, "rope_type": "llama3"},
  "tie_word_embeddings": false, "attention_bias": false, "mlp_bias": false,
  "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2
})";
  std::vector<std::pair<std::string, std::vector<int64_t>>> shapes = {{"model.embed_tokens.weight", {64, 32}}};
  for (int l = 0; l < 2; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    for (auto [n, s] : std::vector<std::pair<std::string, std::vector<int64_t>>>{
             {"input_layernorm.weight", {32}}, {"self_attn.q_proj.weight", {32, 32}},
             {"self_attn.k_proj.weight", {16, 32}}, {"self_attn.v_proj.weight", {16, 32}},
             {"self_attn.o_proj.weight", {32, 32}}, {"post_attention_layernorm.weight", {32}},
             {"mlp.gate_proj.weight", {64, 32}}, {"mlp.up_proj.weight", {64, 32}},
             {"mlp.down_proj.weight", {32, 64}}}) {
      shapes.push_back({p + n, s});
    }
  }
  shapes.push_back({"model.norm.weight", {32}});
  shapes.push_back({"lm_head.weight", {64, 32}});
  std::map<std::string, std::vector<uint8_t>> bytes;
  std::vector<checkpoint::SafetensorsTensor> first, second;
  uint32_t state = 12345;
  for (size_t i = 0; i < shapes.size(); ++i) {
    const auto& [name, shape] = shapes[i];
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    std::vector<uint8_t>& b = bytes[name];
    for (int64_t k = 0; k < n; ++k) {
      state = state * 1664525u + 1013904223u;
      const float v = name.find("norm") != std::string::npos
                          ? 1.0f + static_cast<float>(state >> 8) / 16777216.0f * 0.2f - 0.1f
                          : (static_cast<float>(state >> 8) / 16777216.0f - 0.5f) * 0.1f;
      const uint16_t h = checkpoint::float_to_bfloat16_bits(v);
      b.push_back(static_cast<uint8_t>(h & 0xFF));
      b.push_back(static_cast<uint8_t>(h >> 8));
    }
    checkpoint::SafetensorsTensor t{name, checkpoint::DType::kBFloat16, shape, b.data()};
    (i < shapes.size() / 2 ? first : second).push_back(t);
  }
  checkpoint::write_safetensors(dir + "/model-00001-of-00002.safetensors", first, {{"format", "pt"}});
  checkpoint::write_safetensors(dir + "/model-00002-of-00002.safetensors", second, {{"format", "pt"}});
  nlohmann::json index;
  index["metadata"]["total_size"] = 0;
  for (const auto& t : first) index["weight_map"][t.name] = "model-00001-of-00002.safetensors";
  for (const auto& t : second) index["weight_map"][t.name] = "model-00002-of-00002.safetensors";
  std::ofstream(dir + "/model.safetensors.index.json") << index.dump(2);
  return bytes;
}

}  // namespace

// Hugging Face Llama in and out: ckpt import-hf then ckpt export --format hf
// gives back the same bf16 tensors; train starts from the directory
// (model.init_from) exactly as from the imported checkpoint; a config key
// that disagrees with config.json is refused naming both values.
TEST(TrainCli, HuggingFaceLlamaRoundTripsAndTrainsFromEitherForm) {
  const std::string root = cli_scratch("hf");
  const std::string hf = root + "/hf_in";
  const auto original = write_hf_llama(hf);
  Result imp = run_ckpt("import-hf " + hf + " " + root + "/init");
  ASSERT_EQ(imp.status, 0) << imp.output;
  EXPECT_NE(imp.output.find("imported 21 tensors"), std::string::npos) << imp.output;
  Result exp = run_ckpt("export " + root + "/init --format hf --out " + root + "/hf_out --dtype bf16 --max-shard-size 10KB");
  ASSERT_EQ(exp.status, 0) << exp.output;
  ASSERT_TRUE(fs::exists(root + "/hf_out/model.safetensors.index.json"));
  int shard_files = 0;
  for (const auto& e : fs::directory_iterator(root + "/hf_out")) {
    shard_files += e.path().extension() == ".safetensors";
  }
  EXPECT_GE(shard_files, 4);  // about 45 KB of bf16 in shards of at most 10 KB (a tensor may exceed it)
  const checkpoint::WeightsFile out = checkpoint::WeightsFile::open(root + "/hf_out");
  EXPECT_EQ(out.format(), "hf");
  ASSERT_EQ(out.tensors().size(), original.size());
  for (const auto& [name, bytes] : original) {
    const checkpoint::WeightsTensorInfo* t = out.find(name);
    ASSERT_NE(t, nullptr) << name;
    EXPECT_EQ(t->dtype, checkpoint::DType::kBFloat16) << name;
    std::vector<uint8_t> got(bytes.size());
    out.read_box(name, checkpoint::full_box(t->shape), got.data());
    EXPECT_EQ(got, bytes) << name << " differs after the round trip";
  }
  nlohmann::json cfg_out, cfg_in;
  std::ifstream(root + "/hf_out/config.json") >> cfg_out;
  std::ifstream(hf + "/config.json") >> cfg_in;
  for (const char* k : {"hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                        "num_key_value_heads", "vocab_size", "rms_norm_eps", "rope_theta", "rope_scaling"}) {
    EXPECT_EQ(cfg_out[k], cfg_in[k]) << k;
  }

  // Training from the directory and from the imported checkpoint: the same run.
  const std::string yaml = root + "/from_hf.yaml";
  std::ofstream(yaml) << "model:\n  kind: llama\n  seq_len: 16\n  init_from: " << hf
                      << "\ntrain:\n  steps: 4\n  global_batch_size: 8\n  log_every: 1\n"
                         "data:\n  kind: synthetic\n  eval_fraction: 0\ncheckpoint:\n  interval: 0\n";
  Result a = run("--nproc 2 --config " + yaml + " --set run.dir=" + root + "/run_a");
  ASSERT_EQ(a.status, 0) << a.output;
  EXPECT_NE(a.output.find("shardkit: model initialised from " + hf), std::string::npos) << a.output;
  Result b = run("--nproc 2 --config " + yaml + " --set run.dir=" + root + "/run_b --set checkpoint.resume=" +
                 root + "/init --set checkpoint.model_only=true");
  ASSERT_EQ(b.status, 0) << b.output;
  auto la = losses(root + "/run_a"), lb = losses(root + "/run_b");
  ASSERT_EQ(la.size(), 4u);
  ASSERT_EQ(lb.size(), 4u);
  for (int64_t s = 1; s <= 4; ++s) EXPECT_EQ(la.at(s), lb.at(s)) << "step " << s;
  // A key the config sets to another value than config.json: refused, both named.
  Result d = run("--config " + testing_support::source_dir() + "/configs/llama_tiny.yaml --set run.dir=" +
                 root + "/run_d --set model.init_from=" + hf);
  EXPECT_EQ(d.status, 2) << d.output;
  EXPECT_NE(d.output.find("train: model.d_model (64, " + testing_support::source_dir() + "/configs/llama_tiny.yaml:"),
            std::string::npos) << d.output;
  EXPECT_NE(d.output.find(") disagrees with hidden_size 32 in " + hf + "/config.json"), std::string::npos) << d.output;
  EXPECT_FALSE(fs::exists(root + "/run_d"));
  fs::remove_all(root);
}

namespace {

Result run_generate(const std::string& args) { return run_tool("generate", args); }

// The --ids line of generate's output.
nlohmann::json ids_line(const std::string& output) {
  const size_t at = output.rfind("{\"prompt_ids\"");
  if (at == std::string::npos) return nullptr;
  return nlohmann::json::parse(output.substr(at, output.find('\n', at) - at));
}

}  // namespace

// generate: a byte-level llama trained on 2 ranks continues a prompt in one
// process from its checkpoint, and from its Hugging Face export with the
// same tokens; sampling repeats with its seed; bad input exits 2.
TEST(TrainCli, GenerateContinuesAPromptFromACheckpointOrItsHuggingFaceExport) {
  const std::string root = cli_scratch("generate");
  Result t = run("--nproc 2 --config " + testing_support::source_dir() + "/configs/text.yaml --set run.dir=" + root +
                 " --set data.path=" + testing_support::source_dir() + "/README.md --set model.kind=llama"
                 " --set model.n_kv_heads=2 --set train.steps=20 --set checkpoint.interval=20 --set train.eval_every=0"
                 " --set train.sample_every=10 --set train.sample_tokens=24 --set train.sample_prompt=Once");
  ASSERT_EQ(t.status, 0) << t.output;
  // train.sample_every: a greedy continuation at steps 10 and 20, printed and recorded.
  EXPECT_NE(t.output.find("[rank 0] sample step 10 | Once"), std::string::npos) << t.output;
  EXPECT_NE(t.output.find("[rank 0] sample step 20 | Once"), std::string::npos) << t.output;
  int samples = 0;
  std::ifstream metrics(root + "/metrics.jsonl");
  for (std::string line; std::getline(metrics, line);) {
    const auto j = nlohmann::json::parse(line);
    if (j.value("event", "") != "sample") continue;
    ++samples;
    EXPECT_EQ(j["prompt"], "Once");
    EXPECT_GE(j["text"].get<std::string>().size(), 24u) << line;  // invalid UTF-8 bytes become U+FFFD
  }
  EXPECT_EQ(samples, 2);
  const std::string ck = root + "/checkpoints/step_20";
  Result g = run_generate("--checkpoint " + ck + " --prompt 'The ' --max-new-tokens 24 --ids");
  ASSERT_EQ(g.status, 0) << g.output;
  EXPECT_EQ(g.output.rfind("The ", 0), 0u) << g.output;  // the prompt, then the continuation
  EXPECT_NE(g.output.find("generate: 24 tokens in"), std::string::npos) << g.output;
  EXPECT_NE(g.output.find("greedy, model llama with a KV cache"), std::string::npos) << g.output;
  const nlohmann::json a = ids_line(g.output);
  ASSERT_FALSE(a.is_null()) << g.output;
  EXPECT_EQ(a["prompt_ids"], nlohmann::json({84, 104, 101, 32}));
  ASSERT_EQ(a["ids"].size(), 24u);

  Result e = run_ckpt("export " + ck + " --format hf --out " + root + "/hf");
  ASSERT_EQ(e.status, 0) << e.output;
  Result h = run_generate("--checkpoint " + root + "/hf --prompt-ids 84,104,101,32 --max-new-tokens 24 --ids");
  ASSERT_EQ(h.status, 0) << h.output;
  EXPECT_EQ(ids_line(h.output)["ids"], a["ids"]) << h.output;

  const std::string sample = " --prompt 'The ' --max-new-tokens 24 --ids --temperature 0.9 --top-k 40 --top-p 0.95 --seed ";
  const nlohmann::json s1 = ids_line(run_generate("--checkpoint " + ck + sample + "5").output);
  const nlohmann::json s2 = ids_line(run_generate("--checkpoint " + ck + sample + "5").output);
  const nlohmann::json s3 = ids_line(run_generate("--checkpoint " + ck + sample + "6").output);
  EXPECT_EQ(s1, s2);
  EXPECT_NE(s1["ids"], s3["ids"]);

  Result bad = run_generate("--checkpoint " + ck + " --prompt-ids 84,300");
  EXPECT_EQ(bad.status, 2) << bad.output;
  EXPECT_NE(bad.output.find("generate: --prompt-ids: id 300 is outside [0, model.vocab_size 256)"), std::string::npos)
      << bad.output;
  Result missing = run_generate("--checkpoint " + root + "/nope --prompt x");
  EXPECT_EQ(missing.status, 2) << missing.output;
  EXPECT_NE(missing.output.find("generate: --checkpoint: " + root + "/nope is not a directory"), std::string::npos)
      << missing.output;
  fs::remove_all(root);
}

// A llama mixture of experts through the binaries, as a user takes it to
// Hugging Face and back (docs/moe.md, "Hugging Face in and out"), for each
// format: trained on 2 ranks, ckpt export --format hf writes Qwen3-MoE (q/k
// norm) or Mixtral; generate gives the same greedy tokens from the
// checkpoint, the directory and its ckpt import-hf; import-hf then export
// gives the directory's tensors back bit for bit; train --nproc 2 from the
// directory (model.init_from) and from the imported checkpoint are the same
// run; an MoE neither format expresses is refused in one line naming the
// key.
TEST(TrainCli, MoeHuggingFaceRoundTripsGeneratesAndTrainsFromEitherForm) {
  for (const bool qwen3 : {true, false}) {
    const std::string root = cli_scratch(qwen3 ? "moe_hf_qwen3" : "moe_hf_mixtral");
    const std::string yaml = root + ".yaml";
    std::ofstream(yaml) << "model:\n  kind: llama\n  vocab_size: 32\n  seq_len: 16\n  d_model: 32\n  n_layers: 3\n"
                           "  n_heads: 4\n  n_kv_heads: 2\n  d_ff: 48\n  qk_norm: "
                        << (qwen3 ? "true" : "false")
                        // Qwen3-30B-A3B's kind of attention: heads of 12 where 32 / 4 is 8.
                        << "\n  head_dim: " << (qwen3 ? 12 : 0)
                        << "\n  moe:\n    num_experts: 4\n    top_k: 2\n    d_ff: 24\n    route_norm: true\n"
                           "    first_dense_layers: "
                        << (qwen3 ? 1 : 0)
                        << "\n    aux_loss_coef: 0.01\n"
                           "train:\n  steps: 3\n  global_batch_size: 8\n  log_every: 1\n"
                           "data:\n  kind: synthetic\n  task: copy\n  eval_fraction: 0\n"
                           "checkpoint:\n  interval: 3\n  direct_io: \"false\"\n";
    Result t = run("--nproc 2 --config " + yaml + " --set run.dir=" + root + "/run");
    ASSERT_EQ(t.status, 0) << t.output;
    const std::string ck = root + "/run/checkpoints/step_3", hf = root + "/hf";
    Result e = run_ckpt("export " + ck + " --format hf --out " + hf);
    ASSERT_EQ(e.status, 0) << e.output;
    nlohmann::json config;
    std::ifstream(hf + "/config.json") >> config;
    EXPECT_EQ(config["architectures"][0], qwen3 ? "Qwen3MoeForCausalLM" : "MixtralForCausalLM");
    EXPECT_EQ(config["head_dim"], qwen3 ? 12 : 8);
    const checkpoint::WeightsFile exported = checkpoint::WeightsFile::open(hf);
    EXPECT_NE(exported.find(qwen3 ? "model.layers.2.mlp.experts.3.down_proj.weight"
                                  : "model.layers.2.block_sparse_moe.experts.3.w2.weight"),
              nullptr);

    Result i = run_ckpt("import-hf " + hf + " " + root + "/imported");
    ASSERT_EQ(i.status, 0) << i.output;
    Result b = run_ckpt("export " + root + "/imported --format hf --out " + root + "/hf_back");
    ASSERT_EQ(b.status, 0) << b.output;
    const checkpoint::WeightsFile back = checkpoint::WeightsFile::open(root + "/hf_back");
    nlohmann::json config_back;
    std::ifstream(root + "/hf_back/config.json") >> config_back;
    EXPECT_EQ(config_back["head_dim"], qwen3 ? 12 : 8);
    ASSERT_EQ(back.tensors().size(), exported.tensors().size());
    for (const checkpoint::WeightsTensorInfo& want : exported.tensors()) {
      const checkpoint::WeightsTensorInfo* got = back.find(want.name);
      ASSERT_NE(got, nullptr) << want.name;
      std::vector<uint8_t> a(want.nbytes), c(want.nbytes);
      exported.read_box(want.name, checkpoint::full_box(want.shape), a.data());
      back.read_box(want.name, checkpoint::full_box(want.shape), c.data());
      EXPECT_EQ(a, c) << want.name << " differs after import-hf and export";
    }

    nlohmann::json ids;
    for (const std::string& from : {ck, hf, root + "/imported"}) {
      Result g = run_generate("--checkpoint " + from + " --prompt-ids 1,2,3,4 --max-new-tokens 12 --ids");
      ASSERT_EQ(g.status, 0) << g.output;
      if (ids.is_null()) ids = ids_line(g.output)["ids"];
      EXPECT_EQ(ids_line(g.output)["ids"], ids) << from;
    }
    ASSERT_EQ(ids.size(), 12u);

    Result a = run("--nproc 2 --config " + yaml + " --set run.dir=" + root + "/from_hf --set model.init_from=" + hf +
                   " --set checkpoint.interval=0");
    ASSERT_EQ(a.status, 0) << a.output;
    Result m = run("--nproc 2 --config " + yaml + " --set run.dir=" + root + "/from_import --set checkpoint.resume=" +
                   root + "/imported --set checkpoint.model_only=true --set checkpoint.interval=0");
    ASSERT_EQ(m.status, 0) << m.output;
    const auto la = losses(root + "/from_hf"), lm = losses(root + "/from_import");
    ASSERT_EQ(la.size(), 3u);
    EXPECT_EQ(la, lm);

    // Shared experts: neither format has them.
    Result s = run("--config " + yaml + " --set run.dir=" + root + "/shared --set model.moe.num_shared_experts=1"
                   " --set train.steps=1 --set checkpoint.interval=1");
    ASSERT_EQ(s.status, 0) << s.output;
    Result r = run_ckpt("export " + root + "/shared/checkpoints/step_1 --format hf --out " + root + "/hf_shared");
    EXPECT_EQ(r.status, 1) << r.output;
    EXPECT_NE(r.output.find("model.moe.num_shared_experts is 1: Qwen3MoeForCausalLM and MixtralForCausalLM have no "
                            "shared experts"),
              std::string::npos)
        << r.output;
    EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << r.output;
    EXPECT_FALSE(fs::exists(root + "/hf_shared"));

    // A bad model.head_dim, or none where d_model does not split into the heads.
    for (const std::string& bad : {std::string("--set model.head_dim=-4"),
                                   std::string("--set model.d_model=30 --set model.head_dim=0")}) {
      Result h = run("--config " + yaml + " --set run.dir=" + root + "/bad_head_dim " + bad);
      EXPECT_EQ(h.status, 2) << bad << ": " << h.output;
      EXPECT_NE(h.output.find("model.head_dim"), std::string::npos) << bad << ": " << h.output;
      EXPECT_EQ(std::count(h.output.begin(), h.output.end(), '\n'), 1) << bad << ": " << h.output;
    }
    EXPECT_FALSE(fs::exists(root + "/bad_head_dim"));
    fs::remove_all(root);
    fs::remove(yaml);
  }
}

namespace {

// A float tensor of a weights file, whole, as doubles.
std::vector<double> tensor_reals(const checkpoint::WeightsFile& f, const std::string& name) {
  const checkpoint::WeightsTensorInfo* t = f.find(name);
  if (t == nullptr) return {};
  std::vector<uint8_t> raw(t->nbytes);
  f.read_box(name, checkpoint::full_box(t->shape), raw.data());
  const size_t esize = checkpoint::element_size(t->dtype);
  std::vector<double> out(raw.size() / esize);
  for (size_t i = 0; i < out.size(); ++i) {
    if (t->dtype == checkpoint::DType::kBFloat16) {
      uint32_t bits = static_cast<uint32_t>(raw[i * 2] | (raw[i * 2 + 1] << 8)) << 16;
      float v;
      std::memcpy(&v, &bits, 4);
      out[i] = v;
    } else {
      float v;
      std::memcpy(&v, raw.data() + i * 4, 4);
      out[i] = v;
    }
  }
  return out;
}

}  // namespace

// LoRA end to end through the binaries: a LoRA run from a Hugging Face
// llama saves only its adapters (and their AdamW state) with a record of
// the base; it resumes bit-exactly, from a copy of the base too, and
// refuses a different base naming both; ckpt export writes PEFT's adapter
// layout and the merged model (W + alpha/rank B A, checked here against
// the base and the adapters); generate gives the same tokens from the LoRA
// checkpoint (base found from its record, or --base) and from the merge.
TEST(TrainCli, LoraRunSavesAdaptersResumesOnItsBaseAndExportsPeftAndMerged) {
  const std::string root = cli_scratch("lora");
  const std::string hf = root + "/base";
  write_hf_llama(hf);
  fs::copy(hf, root + "/base_copy");
  fs::copy(hf, root + "/base_other");
  {  // another base: one bf16 value of lm_head changed
    std::fstream f(root + "/base_other/model-00002-of-00002.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(-1, std::ios::end);
    const char last = static_cast<char>(f.get());
    f.seekp(-1, std::ios::end);
    f.put(static_cast<char>(last ^ 0x01));
  }
  const std::string yaml = root + "/lora.yaml";
  std::ofstream(yaml) << "model:\n  kind: llama\n  seq_len: 16\n  init_from: " << hf
                      << "\n  lora:\n    rank: 4\n    alpha: 8\n    targets: [q_proj, v_proj, o_proj, down_proj]\n"
                         "train:\n  steps: 6\n  global_batch_size: 8\n  log_every: 1\n"
                         "data:\n  kind: synthetic\n  eval_fraction: 0\n"
                         "checkpoint:\n  interval: 3\n  mode: async\n  keep_last: 0\n";
  Result a = run("--nproc 2 --config " + yaml + " --set run.dir=" + root + "/full");
  ASSERT_EQ(a.status, 0) << a.output;
  EXPECT_NE(a.output.find("trainable: LoRA rank 4, alpha 8 on q_proj, v_proj, o_proj, down_proj"), std::string::npos)
      << a.output;
  Result b1 = run("--nproc 2 --config " + yaml + " --set run.dir=" + root + "/split --set train.stop_at=3");
  ASSERT_EQ(b1.status, 0) << b1.output;
  // Resumed onto a copy of the base (same weights, another path).
  Result b2 = run("--nproc 2 --config " + yaml + " --set run.dir=" + root + "/split --set model.init_from=" + root +
                  "/base_copy");
  ASSERT_EQ(b2.status, 0) << b2.output;
  EXPECT_NE(b2.output.find("resumed from " + root + "/split/checkpoints/step_3"), std::string::npos) << b2.output;
  const auto want = losses(root + "/full"), got = losses(root + "/split");
  ASSERT_EQ(want.size(), 6u);
  for (const auto& [step, loss] : want) EXPECT_EQ(got.at(step), loss) << "step " << step;

  // model.lora.base_dtype bf16: the base's shards in half the bytes; a bf16
  // base loads into them exactly, so the run is the same bit for bit.
  Result c = run("--nproc 2 --config " + yaml + " --set run.dir=" + root + "/bf16 --set model.lora.base_dtype=bf16");
  ASSERT_EQ(c.status, 0) << c.output;
  const auto bf16 = losses(root + "/bf16");
  for (const auto& [step, loss] : want) EXPECT_EQ(bf16.at(step), loss) << "base_dtype bf16, step " << step;
  auto rank_mib = [](const std::string& out) {
    const size_t at = out.find(" MiB on this rank");
    return at == std::string::npos ? -1.0 : std::stod(out.substr(out.rfind(", ", at) + 2));
  };
  // 0.03 against 0.05 MiB (the banner's 2 decimals)
  EXPECT_LT(rank_mib(c.output), 0.7 * rank_mib(a.output)) << a.output << c.output;

  // Under a pipeline (2 stages, each reading its blocks of the base): the
  // same run within rounding (micro-batches sum in another order).
  Result pp = run("--nproc 2 --config " + yaml + " --set run.dir=" + root + "/pp --set parallel.pipeline=2"
                  " --set train.micro_batch_size=2");
  ASSERT_EQ(pp.status, 0) << pp.output;
  const auto piped = losses(root + "/pp");
  for (const auto& [step, loss] : want) EXPECT_NEAR(piped.at(step), loss, 1e-5 * std::abs(loss)) << "pipeline, step " << step;

  // The checkpoint holds the adapters and their moments, not the base.
  const std::string ck = root + "/full/checkpoints/step_6";
  Result st = run_ckpt("export " + ck + " --format safetensors --out " + root + "/all.safetensors");
  ASSERT_EQ(st.status, 0) << st.output;
  const checkpoint::WeightsFile all = checkpoint::WeightsFile::open(root + "/all.safetensors");
  EXPECT_EQ(all.find("model.model.layers.0.self_attn.q_proj.weight"), nullptr);
  EXPECT_EQ(all.find("model.model.embed_tokens.weight"), nullptr);
  EXPECT_NE(all.find("model.model.layers.1.mlp.down_proj.lora_B.weight"), nullptr);
  EXPECT_NE(all.find("optim.model.layers.0.self_attn.v_proj.lora_A.weight.exp_avg"), nullptr);
  EXPECT_EQ(all.tensors().size(), 2u * 4 * 2 * 3);  // 2 layers x 4 targets x {A, B} x {param, m, v}

  // A different base: refused before anything starts, both named.
  Result other = run("--nproc 2 --config " + yaml + " --set run.dir=" + root + "/split --set train.steps=8"
                     " --set model.init_from=" + root + "/base_other");
  EXPECT_EQ(other.status, 2) << other.output;
  EXPECT_NE(other.output.find("train: model.init_from '" + root + "/base_other' has weights xxh3:"), std::string::npos)
      << other.output;
  // (the split run's record names the copy it resumed on)
  EXPECT_NE(other.output.find("not those of the base '" + root + "/base_copy' (xxh3:"), std::string::npos)
      << other.output;
  EXPECT_EQ(other.output.find("Exception raised from"), std::string::npos) << other.output;

  // PEFT's adapter directory.
  Result pe = run_ckpt("export " + ck + " --format peft --out " + root + "/peft");
  ASSERT_EQ(pe.status, 0) << pe.output;
  nlohmann::json adapter_config;
  std::ifstream(root + "/peft/adapter_config.json") >> adapter_config;
  EXPECT_EQ(adapter_config["peft_type"], "LORA");
  EXPECT_EQ(adapter_config["task_type"], "CAUSAL_LM");
  EXPECT_EQ(adapter_config["r"], 4);
  EXPECT_EQ(adapter_config["lora_alpha"], 8.0);
  EXPECT_EQ(adapter_config["target_modules"], nlohmann::json({"q_proj", "v_proj", "o_proj", "down_proj"}));
  EXPECT_EQ(adapter_config["base_model_name_or_path"], hf);
  const checkpoint::WeightsFile peft = checkpoint::WeightsFile::open(root + "/peft/adapter_model.safetensors");
  EXPECT_EQ(peft.tensors().size(), 16u);
  const std::string q = "base_model.model.model.layers.0.self_attn.q_proj.";
  ASSERT_NE(peft.find(q + "lora_A.weight"), nullptr);
  EXPECT_EQ(peft.find(q + "lora_A.weight")->shape, (std::vector<int64_t>{4, 32}));
  EXPECT_EQ(peft.find(q + "lora_B.weight")->shape, (std::vector<int64_t>{32, 4}));

  // The merged model: W + (8 / 4) B A for every adapted projection, the rest as the base.
  Result refused = run_ckpt("export " + ck + " --format hf --out " + root + "/hf_plain");
  EXPECT_EQ(refused.status, 1) << refused.output;  // ckpt's status for a refused request
  EXPECT_NE(refused.output.find("holds LoRA adapters, not the base model: give --merge-lora"), std::string::npos)
      << refused.output;
  Result me = run_ckpt("export " + ck + " --format hf --merge-lora --out " + root + "/merged");
  ASSERT_EQ(me.status, 0) << me.output;
  const checkpoint::WeightsFile base = checkpoint::WeightsFile::open(hf), merged = checkpoint::WeightsFile::open(root + "/merged");
  ASSERT_EQ(merged.tensors().size(), base.tensors().size());
  double worst = 0;
  for (const auto& t : base.tensors()) {
    const std::vector<double> w = tensor_reals(base, t.name), m = tensor_reals(merged, t.name);
    ASSERT_EQ(m.size(), w.size()) << t.name;
    const std::string stem = t.name.substr(0, t.name.size() - 6);  // without "weight"
    const std::vector<double> A = tensor_reals(peft, "base_model.model." + stem + "lora_A.weight"),
                              B = tensor_reals(peft, "base_model.model." + stem + "lora_B.weight");
    const bool adapted = !A.empty();
    EXPECT_EQ(adapted, t.name.find("q_proj") != std::string::npos || t.name.find("v_proj") != std::string::npos ||
                           t.name.find("o_proj") != std::string::npos || t.name.find("down_proj") != std::string::npos)
        << t.name;
    const int64_t in = t.shape.size() == 2 ? t.shape[1] : 0;
    for (size_t i = 0; i < w.size(); ++i) {
      double want_v = w[i];
      if (adapted) {
        const int64_t r = static_cast<int64_t>(i) / in, c = static_cast<int64_t>(i) % in;
        double ba = 0;
        for (int64_t k = 0; k < 4; ++k) ba += B[static_cast<size_t>(r * 4 + k)] * A[static_cast<size_t>(k * in + c)];
        want_v += 2.0 * ba;
      }
      worst = std::max(worst, std::abs(m[i] - want_v));
    }
  }
  EXPECT_LT(worst, 1e-6);
  Result wrong_base = run_ckpt("export " + ck + " --format hf --merge-lora --out " + root + "/merged2 --base " + root +
                               "/base_other");
  EXPECT_EQ(wrong_base.status, 1) << wrong_base.output;
  EXPECT_NE(wrong_base.output.find("the LoRA base " + root + "/base_other has weights xxh3:"), std::string::npos)
      << wrong_base.output;
  EXPECT_FALSE(fs::exists(root + "/merged2"));

  // generate: the LoRA checkpoint (its recorded base, or --base) and the merge agree.
  const std::string ask = " --prompt-ids 3,1,4,1,5 --max-new-tokens 12 --ids";
  Result g1 = run_generate("--checkpoint " + ck + ask);
  ASSERT_EQ(g1.status, 0) << g1.output;
  EXPECT_NE(g1.output.find("generate: LoRA adapters of " + ck + " on the base " + hf), std::string::npos) << g1.output;
  Result g2 = run_generate("--checkpoint " + ck + " --base " + root + "/base_copy" + ask);
  ASSERT_EQ(g2.status, 0) << g2.output;
  Result g3 = run_generate("--checkpoint " + root + "/merged" + ask);
  ASSERT_EQ(g3.status, 0) << g3.output;
  ASSERT_FALSE(ids_line(g1.output).is_null()) << g1.output;
  EXPECT_EQ(ids_line(g1.output)["ids"].size(), 12u);
  EXPECT_EQ(ids_line(g2.output)["ids"], ids_line(g1.output)["ids"]);
  EXPECT_EQ(ids_line(g3.output)["ids"], ids_line(g1.output)["ids"]);
  Result g4 = run_generate("--checkpoint " + ck + " --base " + root + "/base_other" + ask);
  EXPECT_EQ(g4.status, 2) << g4.output;
  EXPECT_NE(g4.output.find("generate: --base " + root + "/base_other has weights xxh3:"), std::string::npos)
      << g4.output;
  fs::remove_all(root);
}

// data.kind sft through the binary: prompt/completion records train a
// byte-level llama with LoRA on a random base (its checkpoint records
// that, and resumes); the banner counts prompt and completion tokens; a
// bad record exits 2 naming the file and line before any rank starts.
TEST(TrainCli, SftRecordsTrainWithTheirTokenCountsAndBadRecordsExitTwo) {
  const std::string root = cli_scratch("sft");
  fs::create_directories(root);
  const std::string data = root + "/train.jsonl";
  {
    std::ofstream out(data);
    for (int i = 0; i < 40; ++i) {
      out << nlohmann::json{{"prompt", "Q" + std::to_string(i) + ": reverse abc? "}, {"completion", "cba."}}.dump()
          << "\n";
    }
  }
  const std::string args = "--nproc 2 --config " + testing_support::source_dir() +
                           "/configs/default.yaml --set model.kind=llama --set model.vocab_size=256"
                           " --set model.seq_len=48 --set data.kind=sft --set data.path=" + data +
                           " --set model.lora.rank=4 --set train.steps=4 --set train.log_every=1"
                           " --set data.eval_fraction=0.1 --set train.eval_every=2 --set checkpoint.interval=2";
  Result a = run(args + " --set run.dir=" + root + "/run --set train.stop_at=2");
  ASSERT_EQ(a.status, 0) << a.output;
  // 40 records: "Qi: reverse abc? " is 17 or 18 bytes, "cba." 4.
  EXPECT_NE(a.output.find("data sft '" + data + "' (40 records: 710 prompt and 160 completion tokens; "),
            std::string::npos) << a.output;
  EXPECT_NE(a.output.find("eval step 2 | val_loss"), std::string::npos) << a.output;
  Result b = run(args + " --set run.dir=" + root + "/run");
  ASSERT_EQ(b.status, 0) << b.output;
  EXPECT_NE(b.output.find("resumed from " + root + "/run/checkpoints/step_2"), std::string::npos) << b.output;
  EXPECT_EQ(losses(root + "/run").size(), 4u);

  std::ofstream(data, std::ios::app) << "{\"prompt\": \"x\"}\n";
  Result bad = run(args + " --set run.dir=" + root + "/bad");
  EXPECT_EQ(bad.status, 2) << bad.output;
  EXPECT_NE(bad.output.find("train: data.path '" + data + "' line 41: a record needs \"prompt\" and \"completion\""),
            std::string::npos) << bad.output;
  EXPECT_EQ(bad.output.find("Exception raised from"), std::string::npos) << bad.output;
  EXPECT_FALSE(fs::exists(root + "/bad/metrics.jsonl"));
  fs::remove_all(root);
}

// parallel.tensor through the train binary: configs/llama_tiny.yaml (bf16
// compute, activation checkpointing, micro-batches, async saves) at TP 2 x
// FSDP 2 on 4 processes; its checkpoint resumes under FSDP 2 on 2; the dry
// run shows the 3-D mesh; sizes that do not divide exit 2 naming the keys.
TEST(TrainCli, TensorParallelLlamaTrainsAndItsCheckpointResumesUnderFsdp) {
  const std::string dir = cli_scratch("tp");
  const std::string llama = "--config " + testing_support::source_dir() + "/configs/llama_tiny.yaml --set run.dir=" +
                            dir + " --set train.steps=6 --set train.log_every=1 --set train.eval_every=3"
                            " --set checkpoint.interval=3";
  Result a = run("--nproc 4 " + llama + " --set parallel.tensor=2 --set train.stop_at=3");
  ASSERT_EQ(a.status, 0) << a.output;
  EXPECT_NE(a.output.find("layout fsdp+tp replicate=1 shard=2 tensor=2"), std::string::npos) << a.output;
  EXPECT_NE(a.output.find("eval step 3 | val_loss"), std::string::npos) << a.output;
  Result b = run("--nproc 2 " + llama);
  ASSERT_EQ(b.status, 0) << b.output;
  EXPECT_NE(b.output.find("resumed from " + dir + "/checkpoints/step_3 (step 3, saved by 4 ranks, "
                          "fsdp+tp replicate=1 shard=2 tensor=2)"),
            std::string::npos) << b.output;
  EXPECT_EQ(losses(dir).size(), 6u);

  Result d = run("--dry-run --nproc 4 " + llama + " --set parallel.tensor=2");
  EXPECT_EQ(d.status, 0) << d.output;
  EXPECT_NE(d.output.find("layout fsdp+tp replicate=1 shard=2 tensor=2"), std::string::npos) << d.output;

  const std::string refused = cli_scratch("tp_refused");
  Result heads = run("--nproc 4 " + llama + " --set run.dir=" + refused + " --set parallel.tensor=4");
  EXPECT_EQ(heads.status, 2) << heads.output;
  EXPECT_NE(heads.output.find("parallel.tensor (4, --set) must divide model.n_heads (4, "), std::string::npos)
      << heads.output;
  EXPECT_NE(heads.output.find("model.n_kv_heads (2, "), std::string::npos) << heads.output;
  Result world = run("--nproc 3 " + llama + " --set run.dir=" + refused + " --set parallel.tensor=2");
  EXPECT_EQ(world.status, 2) << world.output;
  EXPECT_NE(world.output.find("parallel.tensor (2) does not divide the world size 3"), std::string::npos)
      << world.output;
  EXPECT_EQ(world.output.find("Exception raised from"), std::string::npos) << world.output;
  EXPECT_FALSE(fs::exists(refused));
  fs::remove_all(dir);
}

// Context parallelism (#72) from the train binary: llama_tiny (bf16,
// activation checkpointing, 2 micro-batches) with each sequence split over
// 2 ranks trains, evaluates, samples and says so in its banner; a sequence that does
// not split into the chunks, a combination not supported and a model kind
// that does not split along the sequence exit 2 with one line naming the
// keys, before anything is written.
TEST(TrainCli, ContextParallelLlamaTrainsWithTheOtherAxesAndBadSplitsExitTwo) {
  const std::string dir = cli_scratch("cp");
  const std::string llama = "--config " + testing_support::source_dir() + "/configs/llama_tiny.yaml --set run.dir=" +
                            dir + " --set train.steps=4 --set train.log_every=1 --set train.eval_every=2"
                            " --set checkpoint.interval=0";
  // A byte-level sample (vocabulary 256) generates on whole sequences, the
  // split turned off around it and on again for the next step.
  Result a = run("--nproc 2 " + llama + " --set parallel.context=2 --set model.vocab_size=256"
                 " --set train.sample_every=3 --set train.sample_tokens=4");
  ASSERT_EQ(a.status, 0) << a.output;
  EXPECT_NE(a.output.find("sample step 3 | The "), std::string::npos) << a.output;
  EXPECT_NE(a.output.find("layout fsdp replicate=1 shard=2 context=2 (16 tokens per rank of each sequence's 32, "
                          "head_tail)"),
            std::string::npos) << a.output;
  EXPECT_NE(a.output.find("eval step 2 | val_loss"), std::string::npos) << a.output;
  EXPECT_EQ(losses(dir).size(), 4u);
  // Each rank's seconds in ring attention and, of them, waiting for blocks
  // (what bench/context_parallel.py reads).
  std::ifstream metrics(dir + "/metrics.jsonl");
  int timed = 0;
  for (std::string l; std::getline(metrics, l);) {
    const auto j = nlohmann::json::parse(l);
    if (!j.contains("loss")) continue;
    ++timed;
    ASSERT_TRUE(j.contains("context_attention_s") && j.contains("context_wait_s")) << l;
    ASSERT_EQ(j["context_attention_s"].size(), 2u) << l;
    ASSERT_EQ(j["context_wait_s"].size(), 2u) << l;
    for (size_t r = 0; r < 2; ++r) {
      const double attention = j["context_attention_s"][r].get<double>(), wait = j["context_wait_s"][r].get<double>();
      EXPECT_GT(attention, 0) << l;
      EXPECT_GT(wait, 0) << l;
      EXPECT_LE(wait, attention) << l;
      EXPECT_LT(attention, j["step_time_s"].get<double>() + 1.0) << l;
    }
  }
  EXPECT_EQ(timed, 4);
  // The dry run: a rank's activations with each sequence over 1, 2, 4, 8 ranks.
  Result dry = run("--dry-run --nproc 2 " + llama + " --set parallel.context=2 --set model.seq_len=24");
  EXPECT_EQ(dry.status, 0) << dry.output;
  EXPECT_NE(dry.output.find("train: dry run: activations per rank at model.seq_len 24, each sequence over C ranks "
                            "(parallel.context; the batch split 1 way(s) as configured): C=1 "),
            std::string::npos) << dry.output;
  EXPECT_NE(dry.output.find(", C=8 - (model.seq_len does not split)"), std::string::npos) << dry.output;
  // With tensor parallelism (heads split inside each context group): the
  // layout and the same line.
  Result dry_tp = run("--dry-run --nproc 4 " + llama + " --set parallel.context=2 --set parallel.tensor=2");
  EXPECT_EQ(dry_tp.status, 0) << dry_tp.output;
  EXPECT_NE(dry_tp.output.find("context=2 tensor=2"), std::string::npos) << dry_tp.output;
  EXPECT_NE(dry_tp.output.find("each sequence over C ranks (parallel.context; the batch split 1 way(s) as configured)"),
            std::string::npos) << dry_tp.output;
  // With pipeline and expert parallelism and a mixture of experts
  // (moe_tiny.yaml sets parallel.expert 2): PP 2 x CP 2 x EP 2 at world 4
  // trains and logs its auxiliary loss.
  const std::string moe_dir = cli_scratch("cp_moe");
  Result m = run("--nproc 4 --config " + testing_support::source_dir() + "/configs/moe_tiny.yaml --set run.dir=" +
                 moe_dir + " --set train.stop_at=2 --set train.log_every=1 --set checkpoint.interval=0"
                 " --set parallel.context=2 --set parallel.pipeline=2");
  ASSERT_EQ(m.status, 0) << m.output;
  EXPECT_NE(m.output.find("layout pipeline=2 (1f1b, 2 stages, 4 micro-batches) x fsdp replicate=1 shard=2 expert=2 "
                          "context=2 (16 tokens per rank"),
            std::string::npos) << m.output;
  EXPECT_NE(m.output.find("step 2/200 | loss "), std::string::npos) << m.output;
  EXPECT_NE(m.output.find("| moe aux "), std::string::npos) << m.output;
  fs::remove_all(moe_dir);

  const std::string refused = cli_scratch("cp_refused");
  const auto expect_one_line = [&](const std::string& args, const std::string& want) {
    Result r = run(args);
    EXPECT_EQ(r.status, 2) << args << "\n" << r.output;
    const size_t at = r.output.find(want);
    ASSERT_NE(at, std::string::npos) << r.output;
    const size_t begin = r.output.rfind('\n', at), end = r.output.find('\n', at);
    const std::string line = r.output.substr(begin == std::string::npos ? 0 : begin + 1, end - begin - 1);
    EXPECT_NE(line.find("parallel.context"), std::string::npos) << line;
    EXPECT_EQ(r.output.find("Exception raised from"), std::string::npos) << r.output;
    EXPECT_FALSE(fs::exists(refused)) << args;
  };
  const std::string bad = "--nproc 2 " + llama + " --set run.dir=" + refused;
  // 30 tokens: not 4 equal chunks (head-tail), but 2 (none).
  expect_one_line(bad + " --set parallel.context=2 --set model.seq_len=30",
                  "model.seq_len (30) must split into 2 x parallel.context (2) = 4 equal chunks");
  expect_one_line(bad + " --set parallel.context=2 --set parallel.context_load_balance=none --set model.seq_len=31",
                  "model.seq_len (31) must split into parallel.context (2) equal chunks");
  expect_one_line("--nproc 2 " + common(refused) + " --set parallel.context=2",  // default.yaml: gpt
                  "parallel.context 2 needs model.kind llama (model.kind is gpt");
  expect_one_line("--nproc 3 " + llama + " --set run.dir=" + refused + " --set parallel.context=2",
                  "parallel.context (2) must divide the shard degree 3");
  fs::remove_all(dir);
}

// The shipped configs/llama_tiny.yaml must visibly learn: a newcomer's first
// run. Stopped at step 60 of its 200 (its own learning-rate schedule), copy
// measures val_loss 0.90 there; chance is ln 32 = 3.47, and the reverse task
// it used to train, which RoPE's relative positions cannot express, measures
// 3.29 at step 60 and 2.86 at step 200.
TEST(TrainCli, LlamaTinyConfigVisiblyLearnsBySixtySteps) {
  const std::string dir = cli_scratch("llama_tiny_learns");
  Result r = run("--nproc 2 --config " + testing_support::source_dir() + "/configs/llama_tiny.yaml --set run.dir=" +
                 dir + " --set train.stop_at=60 --set train.eval_every=60 --set checkpoint.interval=0");
  ASSERT_EQ(r.status, 0) << r.output;
  double val_loss = -1;
  std::ifstream metrics(dir + "/metrics.jsonl");
  for (std::string line; std::getline(metrics, line);) {
    const auto j = nlohmann::json::parse(line);
    if (j.value("event", "") == "eval" && j["step"] == 60) val_loss = j["val_loss"].get<double>();
  }
  ASSERT_GE(val_loss, 0) << "no eval at step 60:\n" << r.output;
  EXPECT_LT(val_loss, 2.0) << r.output;
  fs::remove_all(dir);
}

// configs/moe_tiny.yaml (docs/moe.md) end to end on 2 ranks: the banner's
// active parameters, every step's expert loads (top_k x the global batch's
// tokens per MoE block) and auxiliary loss in metrics.jsonl, learning by
// step 60 (val_loss 0.27 there when written; chance is ln 32 = 3.47), a
// bit-exact resume (the balancing bias is in the checkpoint: a resume
// without it routes differently), and bad MoE keys exit 2 naming them.
TEST(TrainCli, MoeTinyLearnsResumesBitExactlyAndLogsItsExperts) {
  const std::string config = "--nproc 2 --config " + testing_support::source_dir() + "/configs/moe_tiny.yaml";
  auto args = [&](const std::string& dir) {
    return config + " --set run.dir=" + dir + " --set train.log_every=1 --set train.eval_every=60"
                    " --set checkpoint.interval=45 --set checkpoint.mode=sync";
  };
  const std::string full = cli_scratch("moe_full"), split = cli_scratch("moe_split");
  Result a = run(args(full) + " --set train.stop_at=60");
  ASSERT_EQ(a.status, 0) << a.output;
  EXPECT_NE(a.output.find("active per token (top-2 of 8 experts in 3 of 4 blocks)"), std::string::npos) << a.output;
  double val_loss = -1;
  int64_t steps_with_loads = 0;
  std::ifstream metrics(full + "/metrics.jsonl");
  for (std::string line; std::getline(metrics, line);) {
    const auto j = nlohmann::json::parse(line);
    if (j.value("event", "") == "eval" && j["step"] == 60) val_loss = j["val_loss"].get<double>();
    if (!j.contains("loss")) continue;
    ASSERT_TRUE(j.contains("expert_load")) << line;
    ASSERT_EQ(j["expert_load"].size(), 3u) << line;
    for (const auto& layer : j["expert_load"]) {
      double sum = 0;
      for (const auto& l : layer) sum += l.get<double>();
      EXPECT_EQ(sum, 16.0 * 32 * 2) << line;
    }
    EXPECT_GT(j["moe_aux_loss"].get<double>(), 0.5) << line;
    EXPECT_GE(j["expert_load_max_over_mean"][0].get<double>(), 1.0) << line;
    ++steps_with_loads;
  }
  EXPECT_EQ(steps_with_loads, 60);
  EXPECT_LT(val_loss, 2.0) << a.output;
  // The resumed run starts from the step-45 checkpoint the full run
  // committed (interval 45), copied alone into a run directory of its own
  // (no metrics.jsonl: every loss compared below is the resumed run's).
  // train.stop_at's own stop-and-resume path: ResumeAfterStopAtIsBitExact.
  ASSERT_TRUE(fs::is_directory(full + "/checkpoints/step_45")) << a.output;
  fs::create_directories(split + "/checkpoints");
  fs::copy(full + "/checkpoints/step_45", split + "/checkpoints/step_45", fs::copy_options::recursive);
  Result c = run(args(split) + " --set train.stop_at=60");
  ASSERT_EQ(c.status, 0) << c.output;
  EXPECT_NE(c.output.find("resumed from " + split + "/checkpoints/step_45"), std::string::npos) << c.output;
  auto want = losses(full), got = losses(split);
  ASSERT_EQ(got.size(), 15u);
  ASSERT_EQ(got.begin()->first, 46);
  for (int64_t s = 46; s <= 60; ++s) EXPECT_EQ(got.at(s), want.at(s)) << "step " << s << " is not bit-identical";

  const std::string refused = cli_scratch("moe_refused");
  Result k = run(config + " --set run.dir=" + refused + " --set model.moe.top_k=9");
  EXPECT_EQ(k.status, 2) << k.output;
  EXPECT_NE(k.output.find("model.moe.top_k (9, "), std::string::npos) << k.output;
  EXPECT_NE(k.output.find("must be in [1, model.moe.num_experts (8, "), std::string::npos) << k.output;
  Result t = run(config + " --set run.dir=" + refused + " --set model.lora.rank=4 --set model.lora.targets=q_proj,up_proj");
  EXPECT_EQ(t.status, 2) << t.output;
  EXPECT_NE(t.output.find("model.lora.targets names up_proj with model.moe.num_experts 8"), std::string::npos)
      << t.output;
  EXPECT_FALSE(fs::exists(refused));
  fs::remove_all(full);
  fs::remove_all(split);
}

namespace {

// A process whose stdout and stderr (together) the test reads line by line
// as they come: build/<tool> with `args`, exec'd directly (its pid is the
// launcher's).
class StreamedRun {
 public:
  StreamedRun(const std::string& tool, const std::vector<std::string>& args) {
    int fds[2];
    if (pipe(fds) != 0) throw std::runtime_error("pipe failed");
    std::vector<std::string> argv{testing_support::binary_dir() + "/" + tool};
    argv.insert(argv.end(), args.begin(), args.end());
    std::vector<char*> cargv;
    for (std::string& a : argv) cargv.push_back(a.data());
    cargv.push_back(nullptr);
    // Its first attempt probes direct_io itself and its restarts reuse the
    // run's own file (what the restart test checks), whatever probe of the
    // suite's scripts/test put in SHARDKIT_DIRECT_IO_PROBES.
    ::unsetenv("SHARDKIT_DIRECT_IO_PROBES");
    std::fflush(nullptr);
    pid_ = fork();
    if (pid_ == 0) {
      dup2(fds[1], 1);
      dup2(fds[1], 2);
      close(fds[0]);
      close(fds[1]);
      execv(cargv[0], cargv.data());
      _exit(127);
    }
    close(fds[1]);
    in_ = fdopen(fds[0], "r");
  }
  ~StreamedRun() {
    if (in_ != nullptr) fclose(in_);
    if (pid_ > 0 && !reaped_) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
  }
  pid_t pid() const { return pid_; }
  // The next line (without its newline); false at EOF.
  bool next_line(std::string& line) {
    line.clear();
    int c;
    while ((c = fgetc(in_)) != EOF && c != '\n') line.push_back(static_cast<char>(c));
    return c != EOF || !line.empty();
  }
  int wait() {
    int raw = 0;
    waitpid(pid_, &raw, 0);
    reaped_ = true;
    return WIFEXITED(raw) ? WEXITSTATUS(raw) : 128 + WTERMSIG(raw);
  }

 private:
  pid_t pid_ = -1;
  FILE* in_ = nullptr;
  bool reaped_ = false;
};

// The child of `parent` whose environment has RANK=<rank>; -1 if none.
pid_t child_with_rank(pid_t parent, int rank) {
  for (const auto& entry : fs::directory_iterator("/proc")) {
    const std::string name = entry.path().filename();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream status(entry.path() / "status");
    std::string line;
    pid_t ppid = -1;
    while (std::getline(status, line)) {
      if (line.rfind("PPid:", 0) == 0) ppid = std::atoi(line.c_str() + 5);
    }
    if (ppid != parent) continue;
    std::ifstream environ_file(entry.path() / "environ", std::ios::binary);
    std::string var;
    while (std::getline(environ_file, var, '\0')) {
      if (var == "RANK=" + std::to_string(rank)) return static_cast<pid_t>(std::atoi(name.c_str()));
    }
  }
  return -1;
}

// The children of `parent` waiting as standbys (comm::wait_if_standby names
// them "standby-rank").
int standby_children(pid_t parent) {
  int n = 0;
  for (const auto& entry : fs::directory_iterator("/proc")) {
    const std::string name = entry.path().filename();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream status(entry.path() / "status");
    std::string line, comm;
    pid_t ppid = -1;
    while (std::getline(status, line)) {
      if (line.rfind("PPid:", 0) == 0) ppid = std::atoi(line.c_str() + 5);
      if (line.rfind("Name:", 0) == 0) comm = line.substr(line.find_first_not_of(" \t", 5));
    }
    if (ppid == parent && comm == "standby-rank") ++n;
  }
  return n;
}

}  // namespace

// train --nproc 2 --max-restarts 2, as torchrun --max_restarts: one worker
// is killed with SIGKILL after the first commit; the launcher says so,
// stops the other, starts both again (TORCHELASTIC_RESTART_COUNT 1), which
// resume from the newest committed checkpoint without probing direct_io
// again, and the run ends 0 with every step's loss equal to an
// uninterrupted run's, bit for bit. Each process logs its start-up once.
// Both restarts activate the standbys (dist.standby) the launcher started
// ahead of them: the second kill finds rank 1 by its RANK in
// /proc/<pid>/environ, which an activated standby shows as an exec'd rank.
TEST(TrainCli, MaxRestartsRestartsTheGroupAfterAWorkerIsKilledAndTheRunResumesBitExactly) {
  const std::string full = cli_scratch("restart_full"), faulted = cli_scratch("restart_faulted");
  auto args = [](const std::string& dir) {
    return std::vector<std::string>{
        "--nproc", "2", "--config", testing_support::source_dir() + "/configs/default.yaml", "--set",
        "run.dir=" + dir, "--set", "train.steps=100", "--set", "train.log_every=1", "--set", "train.eval_every=0",
        "--set", "checkpoint.interval=10", "--set", "checkpoint.mode=async", "--set", "dist.stop_grace_s=3"};
  };
  std::string joined;
  for (const std::string& a : args(full)) joined += a + " ";
  Result a = run(joined);
  ASSERT_EQ(a.status, 0) << a.output;

  std::vector<std::string> restart_args = args(faulted);
  restart_args.push_back("--max-restarts=2");
  for (const char* set : {"dist.standby_delay_s=0"}) {
    restart_args.push_back("--set");
    restart_args.push_back(set);
  }
  StreamedRun b("train", restart_args);
  std::string out, line;
  pid_t killed = -1, killed_again = -1;
  int64_t seen_commit = -1;  // the newest commit line read so far, before the restart
  size_t restart_at = std::string::npos, restarted_at = std::string::npos;
  while (b.next_line(line)) {
    out += line + "\n";
    const size_t commit = line.find("checkpoint step ");
    if (restart_at == std::string::npos && commit != std::string::npos &&
        line.find(" committed ") != std::string::npos) {
      seen_commit = std::atoll(line.c_str() + commit + 16);
    }
    if (killed < 0 && seen_commit >= 10 && standby_children(b.pid()) == 2) {
      killed = child_with_rank(b.pid(), 1);
      ASSERT_GT(killed, 0) << "no rank 1 under the launcher\n" << out;
      ASSERT_EQ(kill(killed, SIGKILL), 0);
    }
    if (restart_at == std::string::npos && line.find("restarting the group") != std::string::npos) {
      restart_at = out.size() - line.size() - 1;
    }
    // The restarted group's first step (its ledger line): lines of the dead
    // group (the survivor's save on SIGTERM) come before it, never after.
    if (restart_at != std::string::npos && restarted_at == std::string::npos &&
        line.find("shardkit: restart 1 of this run: lost ") != std::string::npos) {
      restarted_at = out.size() - line.size() - 1;
    }
    // Once the restarted group committed again and its own standbys wait:
    // the second kill, of an activated standby.
    if (restarted_at != std::string::npos && killed_again < 0 && commit != std::string::npos &&
        line.find(" committed ") != std::string::npos && out.size() - line.size() - 1 > restarted_at &&
        standby_children(b.pid()) == 2) {
      killed_again = child_with_rank(b.pid(), 1);
      ASSERT_GT(killed_again, 0) << "no rank 1 (an activated standby) in /proc/<pid>/environ\n" << out;
      ASSERT_NE(killed_again, killed);
      ASSERT_EQ(kill(killed_again, SIGKILL), 0);
    }
  }
  const int status = b.wait();
  ASSERT_EQ(status, 0) << out;
  ASSERT_GT(killed, 0) << "the run never committed step 10\n" << out;
  EXPECT_NE(out.find("launcher: rank 1 killed by signal 9 (SIGKILL); restarting the group (restart 1 of 2)"),
            std::string::npos)
      << out;
  ASSERT_GT(killed_again, 0) << "the restarted group never committed with its standbys up\n" << out;
  EXPECT_NE(out.find("launcher: rank 1 killed by signal 9 (SIGKILL); restarting the group (restart 2 of 2)"),
            std::string::npos)
      << out;
  ASSERT_NE(restart_at, std::string::npos) << out;
  const std::string before = out.substr(0, restart_at), after = out.substr(restart_at);
  // The newest checkpoint the first group committed: its lines all come
  // before the restarted group's first (ledger) line. Not the newest one read
  // when rank 1 was killed: the ranks run on while the test reads their
  // lines, and may commit again before the kill lands.
  ASSERT_NE(restarted_at, std::string::npos) << out;
  int64_t newest_commit = -1;
  {
    std::istringstream first_group(out.substr(0, restarted_at));
    for (std::string l; std::getline(first_group, l);) {
      const size_t commit = l.find("checkpoint step ");
      if (commit != std::string::npos && l.find(" committed ") != std::string::npos) {
        newest_commit = std::max<int64_t>(newest_commit, std::atoll(l.c_str() + commit + 16));
      }
    }
  }
  ASSERT_GE(newest_commit, 10) << out;
  EXPECT_NE(after.find("shardkit: world 2 (train --nproc, restart 1)"), std::string::npos) << after;
  EXPECT_NE(after.find("resumed from " + faulted + "/checkpoints/step_" + std::to_string(newest_commit) + " "),
            std::string::npos)
      << "not resumed from the newest commit, step " << newest_commit << "\n" << after;
  EXPECT_NE(out.find("finished at step 100"), std::string::npos) << out;
  // The first attempt probed direct_io and remembered it; the restarted
  // ranks reused it.
  EXPECT_NE(before.find("checkpoint.direct_io auto: "), std::string::npos) << before;
  EXPECT_EQ(before.find("probe of an earlier process of this run, reused from"), std::string::npos) << before;
  EXPECT_NE(after.find("probe of an earlier process of this run, reused from " + faulted + "/.direct_io_probes"),
            std::string::npos)
      << after;
  EXPECT_TRUE(fs::exists(faulted + "/.direct_io_probes"));
  // One start-up record per attempt.
  std::vector<int> startups;
  std::ifstream metrics(faulted + "/metrics.jsonl");
  for (std::string l; std::getline(metrics, l);) {
    const auto j = nlohmann::json::parse(l);
    if (j.value("event", "") != "startup") continue;
    startups.push_back(j["restart"].get<int>());
    // Attempts 1 and 2 ran on activated standbys: start-up counts from the
    // activation, with no program load in it.
    EXPECT_EQ(j.at("standby").get<bool>(), j["restart"].get<int>() > 0) << l;
    // Attempt 0's ranks were forked from the launcher's rank templates.
    EXPECT_EQ(j.at("forked").get<bool>(), j["restart"].get<int>() == 0) << l;
    for (const char* key : {"startup_s", "load_s", "rendezvous_s", "groups_s", "model_s", "data_s", "checkpoint_s",
                            "resume_s", "other_s"}) {
      EXPECT_GE(j.at(key).get<double>(), 0) << l;
    }
  }
  EXPECT_EQ(startups, (std::vector<int>{0, 1, 2}));
  EXPECT_NE(after.find("shardkit: startup "), std::string::npos) << after;
  EXPECT_NE(after.find(" s from the standby's activation (load "), std::string::npos) << after;
  // The goodput ledger: one restart record per restart, at the resumed
  // run's first step, costing the dead attempt's steps past the checkpoint
  // and the time from its last record; a run that never failed has none.
  std::vector<nlohmann::json> restarts;
  int starts = 0;
  std::map<int, int64_t> last_step;  // attempt (1: the first) -> its last logged step
  std::map<int, double> last_time;   // -> its last record's time
  std::ifstream ledger(faulted + "/metrics.jsonl");
  for (std::string l; std::getline(ledger, l);) {
    const auto j = nlohmann::json::parse(l);
    ASSERT_TRUE(j.contains("time")) << l;
    const std::string event = j.value("event", "");
    starts += event == "start";
    if (event == "restart") restarts.push_back(j);
    last_time[starts] = framework::train::parse_utc_timestamp(j["time"]);
    if (event.empty()) last_step[starts] = std::max(last_step[starts], j["step"].get<int64_t>());
  }
  ASSERT_EQ(restarts.size(), 2u) << "restart records in " << faulted << "/metrics.jsonl";
  double all_lost = 0, all_redone = 0;
  for (size_t i = 0; i < restarts.size(); ++i) {
    const nlohmann::json& r = restarts[i];
    const int dead = static_cast<int>(i) + 1;  // the attempt that died
    EXPECT_EQ(r["restart"].get<int>(), dead) << r;
    if (i == 0) {
      EXPECT_EQ(r["step"].get<int64_t>(), newest_commit) << r;
    }
    EXPECT_GE(last_step[dead], r["step"].get<int64_t>()) << r;
    EXPECT_EQ(r["redone_steps"].get<int64_t>(), last_step[dead] - r["step"].get<int64_t>()) << r;
    EXPECT_GE(r["redone_s"].get<double>(), 0) << r;
    // From the dead attempt's last record to the restart record's time.
    const double lost = r["lost_s"].get<double>();
    EXPECT_GT(lost, 0) << r;
    EXPECT_NEAR(lost, framework::train::parse_utc_timestamp(r["time"]) - last_time[dead], 0.05) << r;
    all_lost += lost;
    all_redone += r["redone_s"].get<double>();
    const double goodput = r["goodput"].get<double>(), wall = r["run_wall_s"].get<double>();
    EXPECT_GT(wall, all_lost) << r;
    EXPECT_GT(goodput, 0) << r;
    EXPECT_LT(goodput, 1) << r;
    EXPECT_NEAR(goodput, (wall - all_lost - all_redone) / wall, 1e-9) << r;
  }
  EXPECT_NE(after.find("shardkit: restart 1 of this run: lost "), std::string::npos) << after;
  EXPECT_NE(after.find("shardkit: restart 2 of this run: lost "), std::string::npos) << after;
  std::ifstream fresh(full + "/metrics.jsonl");
  for (std::string l; std::getline(fresh, l);) {
    EXPECT_NE(nlohmann::json::parse(l).value("event", ""), "restart") << "a run that never failed: " << l;
  }

  const auto want = losses(full), got = losses(faulted);
  ASSERT_EQ(want.size(), 100u);
  ASSERT_EQ(got.size(), 100u);
  for (int64_t s = 1; s <= 100; ++s) EXPECT_EQ(got.at(s), want.at(s)) << "step " << s << " is not bit-identical";
  fs::remove_all(full);
  fs::remove_all(faulted);
}
