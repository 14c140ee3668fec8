// Reading checkpoints that PyTorch's DCP wrote (checkpoint/interop/dcp.h).
//
// Fixtures: tests/checkpoint/dcp/torch26_world2 and torch26_titan_world2 were
// written by torch 2.6's dcp.save at world 2 (gloo, DTensor Shard(0), AdamW
// after two steps) by tests/checkpoint/dcp/make_dcp.py, with the full values
// in <fixture>.expected/. Where a python3 with torch is found (the Debian 13
// leg), a fresh checkpoint is written by that script too and read the same
// way; elsewhere that test skips, saying so.
#include "framework/config/run_items.h"
#include "checkpoint/codec/chunk_reader.h"
#include "checkpoint/format/metadata.h"
#include "checkpoint/interop/export.h"
#include "checkpoint/interop/dcp.h"
#include "checkpoint/interop/import_weights.h"
#include "checkpoint/interop/weights_file.h"
#include "checkpoint/plan/resharding.h"
#include "checkpoint/state_dict.h"
#include "checkpoint/storage/storage.h"
#include "framework/data/dataset.h"
#include "framework/fsdp/fully_shard.h"
#include "framework/optim/sharded_adamw.h"
#include "framework/train/preflight.h"
#include "framework/train/trainer.h"
#include "support/multi_rank.h"
#include "support/paths.h"
#include "support/python.h"
#include "support/skip.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

namespace fs = std::filesystem;
using namespace checkpoint;

namespace {

const std::string kFixtures = testing_support::source_dir() + "/tests/checkpoint/dcp";

std::string read_all(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// The full tensors a fixture's .expected/ holds, by DCP key.
std::map<std::string, std::string> expected_tensors(const std::string& dir) {
  const nlohmann::json index = nlohmann::json::parse(read_all(fs::path(dir + ".expected") / "index.json"));
  std::map<std::string, std::string> out;
  for (auto it = index.begin(); it != index.end(); ++it) {
    if (it.value().value("kind", "") != "tensor") continue;
    out[it.key()] = read_all(fs::path(dir + ".expected") / it.value()["file"].get<std::string>());
  }
  return out;
}

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

// Rows [begin, end) of dim 0 (torch.chunk into `parts`, part `k`).
Box chunk_rows(const std::vector<int64_t>& shape, int64_t parts, int64_t k) {
  Box b = full_box(shape);
  if (shape.empty()) return b;
  const int64_t per = (shape[0] + parts - 1) / parts;
  const int64_t begin = std::min(shape[0], k * per);
  b.offsets[0] = begin;
  b.sizes[0] = std::min(shape[0], begin + per) - begin;
  return b;
}

// The row-major bytes of `box` cut from the full tensor's bytes.
std::string cut(const std::string& full, const std::vector<int64_t>& shape, const Box& box, size_t esize) {
  std::string out(static_cast<size_t>(box.numel()) * esize, '\0');
  for (const ByteRange& r : overlap_byte_ranges(full_box(shape), box, box, esize)) {
    std::memcpy(out.data() + r.dst_offset, full.data() + r.src_offset, r.length);
  }
  return out;
}

// Every tensor of `dir` read at `parts` dim-0 pieces (and for 2-D ones also
// a column split) equals the expected bytes.
void expect_every_tensor_exact(const std::string& dir, int64_t parts) {
  auto storage = posix_storage();
  const DcpMetadata meta = read_dcp_metadata(*storage, dir);
  const std::map<std::string, std::string> expected = expected_tensors(dir);
  ASSERT_EQ(meta.tensors.size(), expected.size());
  for (const DcpTensorItem& item : meta.tensors) {
    ASSERT_EQ(expected.count(item.fqn), 1u) << item.fqn;
    const std::string& full = expected.at(item.fqn);
    const size_t esize = element_size(item.dtype);
    std::vector<Box> boxes;
    for (int64_t k = 0; k < parts; ++k) boxes.push_back(chunk_rows(item.shape, parts, k));
    if (item.shape.size() == 2 && item.shape[1] > 1) {  // a column split too
      Box left = full_box(item.shape);
      left.sizes[1] = item.shape[1] / 2;
      Box right = full_box(item.shape);
      right.offsets[1] = left.sizes[1];
      right.sizes[1] = item.shape[1] - left.sizes[1];
      boxes.push_back(left);
      boxes.push_back(right);
    }
    for (const Box& box : boxes) {
      std::string got(static_cast<size_t>(box.numel()) * esize, '\0');
      read_dcp_box(*storage, dir, item, box, reinterpret_cast<uint8_t*>(got.data()));
      EXPECT_EQ(got, cut(full, item.shape, box, esize)) << item.fqn << " box " << box_to_string(box);
    }
  }
}

TEST(DcpRead, MetadataOfATorch26CheckpointIsReadWhole) {
  auto storage = posix_storage();
  const std::string dir = kFixtures + "/torch26_world2";
  ASSERT_TRUE(is_dcp_checkpoint(*storage, dir));
  const DcpMetadata meta = read_dcp_metadata(*storage, dir);
  std::map<std::string, const DcpTensorItem*> by_name;
  for (const DcpTensorItem& t : meta.tensors) by_name[t.fqn] = &t;
  ASSERT_EQ(by_name.count("model.head.weight"), 1u);
  const DcpTensorItem& head = *by_name["model.head.weight"];
  EXPECT_EQ(head.dtype, DType::kFloat32);
  EXPECT_EQ(head.shape, (std::vector<int64_t>{5, 16}));
  ASSERT_EQ(head.chunks.size(), 2u);  // Shard(0) of 5 rows: 3 + 2
  EXPECT_EQ(head.chunks[0].box.sizes, (std::vector<int64_t>{3, 16}));
  EXPECT_EQ(head.chunks[1].box.offsets, (std::vector<int64_t>{3, 0}));
  const DcpTensorItem& step = *by_name.at("optim.state.head.weight.step");
  EXPECT_TRUE(step.shape.empty()) << "AdamW's step is a 0-d tensor";
  EXPECT_EQ(by_name.count("optim.state.proj.bias.exp_avg_sq"), 1u);
  bool lr = false;
  for (const DcpBytesItem& b : meta.bytes) lr = lr || b.fqn == "optim.param_groups.0.lr";
  EXPECT_TRUE(lr) << "bytes items are listed";
  EXPECT_FALSE(is_dcp_checkpoint(*storage, kFixtures));  // no .metadata there
}

TEST(DcpRead, EveryTensorIsExactAtOneTwoAndThreeRanksAndAColumnSplit) {
  for (int64_t parts : {1, 2, 3}) {
    SCOPED_TRACE("parts " + std::to_string(parts));
    expect_every_tensor_exact(kFixtures + "/torch26_world2", parts);
    expect_every_tensor_exact(kFixtures + "/torch26_titan_world2", parts);
  }
}

TEST(DcpRead, WrittenMetadataReadsBackTheSame) {
  auto storage = posix_storage();
  const DcpMetadata meta = read_dcp_metadata(*storage, kFixtures + "/torch26_world2");
  const std::vector<uint8_t> bytes = write_dcp_metadata(meta);
  const DcpMetadata again = parse_dcp_metadata(bytes.data(), bytes.size(), "written");
  ASSERT_EQ(again.tensors.size(), meta.tensors.size());
  for (size_t i = 0; i < meta.tensors.size(); ++i) {
    EXPECT_EQ(again.tensors[i].fqn, meta.tensors[i].fqn);
    EXPECT_EQ(again.tensors[i].dtype, meta.tensors[i].dtype);
    EXPECT_EQ(again.tensors[i].shape, meta.tensors[i].shape);
    ASSERT_EQ(again.tensors[i].chunks.size(), meta.tensors[i].chunks.size());
    for (size_t c = 0; c < meta.tensors[i].chunks.size(); ++c) {
      EXPECT_EQ(again.tensors[i].chunks[c].box, meta.tensors[i].chunks[c].box);
      EXPECT_EQ(again.tensors[i].chunks[c].location.offset, meta.tensors[i].chunks[c].location.offset);
      EXPECT_EQ(again.tensors[i].chunks[c].location.file, meta.tensors[i].chunks[c].location.file);
    }
  }
  ASSERT_EQ(again.bytes.size(), meta.bytes.size());
}

// model.init_from accepts the DCP directory: at world 3 each rank reads its
// rows of every weight (resharded from the 2 chunks torch wrote), exactly;
// then training goes on from them.
class TinyImpl : public torch::nn::Module {
 public:
  TinyImpl() {
    emb = register_module("emb", torch::nn::Embedding(16, 8));
    proj = register_module("proj", torch::nn::Linear(8, 8));
    out = register_module("out", torch::nn::Linear(torch::nn::LinearOptions(8, 16).bias(false)));
    head = register_module("head", torch::nn::Linear(16, 5));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return head(out(torch::relu(proj(emb(x)))));
  }
  torch::nn::Embedding emb{nullptr};
  torch::nn::Linear proj{nullptr}, out{nullptr}, head{nullptr};
};
TORCH_MODULE(Tiny);

class RandomTokens : public framework::data::Dataset {
 public:
  std::pair<torch::Tensor, torch::Tensor> sample(int64_t index) const override {
    torch::Generator gen = at::detail::createCPUGenerator(static_cast<uint64_t>(index) + 1);
    return {torch::randint(0, 16, {4}, gen), torch::randint(0, 5, {4}, gen)};
  }
  std::string describe() const override { return "random tokens"; }
};

TEST(DcpRead, ModelInitFromADcpDirectoryReshardsToThreeRanksAndTrains) {
  const std::string dcp = kFixtures + "/torch26_world2";
  const std::map<std::string, std::string> expected = expected_tensors(dcp);
  const fs::path run = fs::temp_directory_path() / ("shardkit_dcp_init_" + std::to_string(::getpid()));
  fs::remove_all(run);
  framework::config::Config cfg;
  cfg.run.dir = run.string();
  cfg.train.steps = 2;
  cfg.train.global_batch_size = 6;
  cfg.checkpoint.interval = 0;
  cfg.model.init_from = dcp;
  testing_support::run_runtimes(3, [&](comm::Runtime& rt) {
    Tiny model;
    framework::train::UserModel user;
    user.module = model.ptr();
    user.loss = [m = model.ptr()](const torch::Tensor& x, const torch::Tensor& y) {
      torch::Tensor logits = m->forward(x);
      return framework::train::LossSum{
          torch::nn::functional::cross_entropy(
              logits.reshape({-1, 5}), y.reshape({-1}),
              torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum)),
          torch::tensor(y.numel())};
    };
    user.dataset = std::make_shared<RandomTokens>();
    framework::train::Trainer trainer(cfg, rt, user);
    auto& sharded = trainer.model();
    for (size_t i = 0; i < sharded.param_names().size(); ++i) {
      const torch::Tensor full = sharded.param_dtensor(i).full_tensor().contiguous();
      const std::string& want = expected.at("model." + sharded.param_names()[i]);
      EXPECT_EQ(std::string(static_cast<const char*>(full.data_ptr()), full.nbytes()), want)
          << sharded.param_names()[i];
    }
    const framework::train::StepRecord rec = trainer.train_step();
    EXPECT_TRUE(std::isfinite(rec.loss));
  });
  fs::remove_all(run);
}

framework::train::UserModel tiny_user_model() {
  static std::mutex mu;  // ranks are threads: one global generator
  std::lock_guard<std::mutex> lock(mu);
  torch::manual_seed(3);
  Tiny model;
  framework::train::UserModel user;
  user.module = model.ptr();
  user.loss = [m = model.ptr()](const torch::Tensor& x, const torch::Tensor& y) {
    torch::Tensor logits = m->forward(x);
    return framework::train::LossSum{
        torch::nn::functional::cross_entropy(
            logits.reshape({-1, 5}), y.reshape({-1}),
            torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum)),
        torch::tensor(y.numel())};
  };
  user.dataset = std::make_shared<RandomTokens>();
  return user;
}

// checkpoint.resume naming the DCP directory: at world 3 every rank gets its
// rows of the weights and of AdamW's moments, exactly, and the step (2);
// training goes on and saves its own checkpoints, which a restart then
// resumes (the DCP directory was only the initial load).
TEST(DcpRead, ResumeFromADcpDirectoryCarriesModelAndAdamWToThreeRanks) {
  const std::string dcp = kFixtures + "/torch26_world2";
  const std::map<std::string, std::string> expected = expected_tensors(dcp);
  const fs::path run = fs::temp_directory_path() / ("shardkit_dcp_resume_" + std::to_string(::getpid()));
  fs::remove_all(run);
  framework::config::Config cfg;
  cfg.run.dir = run.string();
  cfg.train.steps = 4;
  cfg.train.global_batch_size = 6;
  cfg.checkpoint.interval = 4;
  cfg.checkpoint.resume = dcp;
  EXPECT_EQ(framework::train::resume_source(cfg), framework::train::ResumeSource::kDcp);
  testing_support::run_runtimes(3, [&](comm::Runtime& rt) {
    framework::train::Trainer trainer(cfg, rt, tiny_user_model());
    EXPECT_EQ(trainer.step(), 2) << "AdamW's step in the DCP checkpoint";
    auto& sharded = trainer.model();
    for (size_t i = 0; i < sharded.param_names().size(); ++i) {
      const std::string name = sharded.param_names()[i];
      auto bytes = [](const torch::Tensor& t) {
        const torch::Tensor c = t.contiguous();
        return std::string(static_cast<const char*>(c.data_ptr()), c.nbytes());
      };
      EXPECT_EQ(bytes(sharded.param_dtensor(i).full_tensor()), expected.at("model." + name)) << name;
      const framework::optim::AdamWParamState st = trainer.optimizer().state(i);
      EXPECT_EQ(st.step, 2) << name;
      EXPECT_EQ(bytes(st.exp_avg.full_tensor()), expected.at("optim.state." + name + ".exp_avg")) << name;
      EXPECT_EQ(bytes(st.exp_avg_sq.full_tensor()), expected.at("optim.state." + name + ".exp_avg_sq"))
          << name;
    }
    EXPECT_EQ(trainer.run(), 0);
    EXPECT_EQ(trainer.step(), 4);
  });
  ASSERT_TRUE(fs::exists(run / "checkpoints" / "step_4" / ".metadata"));
  EXPECT_EQ(framework::train::resume_source(cfg), framework::train::ResumeSource::kAutoAfterDcp);
  testing_support::run_runtimes(3, [&](comm::Runtime& rt) {
    framework::train::Trainer restarted(cfg, rt, tiny_user_model());
    EXPECT_EQ(restarted.step(), 4) << "a restart resumes the run's own checkpoint";
  });
  fs::remove_all(run);
}

// A shardkit checkpoint of the Tiny model at step 4 (resumed from the torch
// fixture at world 3, two steps trained), and the full tensors it holds
// under their DCP keys.
struct TinyCheckpoint {
  fs::path run;
  std::string step_dir;
  std::map<std::string, std::pair<torch::Tensor, std::string>> expected;  // key -> (tensor, file)
};

TinyCheckpoint make_tiny_checkpoint(const std::string& tag) {
  TinyCheckpoint c;
  c.run = fs::temp_directory_path() / ("shardkit_dcp_" + tag + "_" + std::to_string(::getpid()));
  fs::remove_all(c.run);
  framework::config::Config cfg;
  cfg.run.dir = c.run.string();
  cfg.train.steps = 4;
  cfg.train.global_batch_size = 6;
  cfg.checkpoint.interval = 4;
  cfg.checkpoint.resume = kFixtures + "/torch26_world2";
  std::mutex mu;
  testing_support::run_runtimes(3, [&](comm::Runtime& rt) {
    framework::train::Trainer trainer(cfg, rt, tiny_user_model());
    EXPECT_EQ(trainer.run(), 0);
    auto& sharded = trainer.model();
    for (size_t i = 0; i < sharded.param_names().size(); ++i) {
      const std::string name = sharded.param_names()[i];
      const torch::Tensor p = sharded.param_dtensor(i).full_tensor().contiguous();
      const framework::optim::AdamWParamState st = trainer.optimizer().state(i);
      const torch::Tensor m = st.exp_avg.full_tensor().contiguous();
      const torch::Tensor v = st.exp_avg_sq.full_tensor().contiguous();
      std::lock_guard<std::mutex> lock(mu);
      c.expected["model." + name] = {p, ""};
      c.expected["optim.state." + name + ".exp_avg"] = {m, ""};
      c.expected["optim.state." + name + ".exp_avg_sq"] = {v, ""};
      c.expected["optim.state." + name + ".step"] = {torch::tensor(static_cast<float>(st.step)), ""};
    }
  });
  c.step_dir = (c.run / "checkpoints" / "step_4").string();
  return c;
}

std::string bytes_of(const torch::Tensor& t) {
  const torch::Tensor c = t.contiguous();
  return std::string(static_cast<const char*>(c.data_ptr()), c.nbytes());
}

// A llama trained under tensor parallelism x FSDP (TP 2 x FSDP 2, 4 ranks):
// its checkpoint's whole tensors, gathered from the 2-D placements.
// moe: a mixture of experts (docs/moe.md) at EP 2 x FSDP 2 instead of TP.
TinyCheckpoint make_tensor_parallel_checkpoint(const std::string& tag, bool moe = false) {
  TinyCheckpoint c;
  c.run = fs::temp_directory_path() / ("shardkit_dcp_" + tag + "_" + std::to_string(::getpid()));
  fs::remove_all(c.run);
  framework::config::Config cfg;
  cfg.run.dir = c.run.string();
  cfg.train.steps = 3;
  cfg.train.global_batch_size = 4;
  cfg.checkpoint.interval = 3;
  cfg.model.kind = "llama";
  cfg.model.tie_weights = false;
  cfg.model.vocab_size = 34;
  cfg.model.seq_len = 8;
  cfg.model.d_model = 32;
  cfg.model.n_heads = 4;
  cfg.model.n_kv_heads = 2;
  cfg.model.n_layers = 2;
  cfg.model.d_ff = 48;
  cfg.parallel.tensor = 2;
  if (moe) {
    cfg.parallel.tensor = 1;
    cfg.parallel.expert = 2;
    cfg.model.moe.num_experts = 4;
    cfg.model.moe.d_ff = 16;
    cfg.model.moe.load_balance_rate = 0.01;
  }
  std::mutex mu;
  testing_support::run_runtimes(4, [&](comm::Runtime& rt) {
    framework::train::Trainer trainer(cfg, rt);
    EXPECT_EQ(trainer.run(), 0);
    auto& sharded = trainer.model();
    for (size_t i = 0; i < sharded.param_names().size(); ++i) {
      const std::string name = sharded.param_names()[i];
      const torch::Tensor p = sharded.param_dtensor(i).full_tensor().contiguous();
      const framework::optim::AdamWParamState st = trainer.optimizer().state(i);
      const torch::Tensor m = st.exp_avg.full_tensor().contiguous();
      std::lock_guard<std::mutex> lock(mu);
      c.expected["model." + name] = {p, ""};
      c.expected["optim.state." + name + ".exp_avg"] = {m, ""};
    }
  });
  c.step_dir = (c.run / "checkpoints" / "step_3").string();
  return c;
}

// ckpt export --format dcp: every model and AdamW tensor reads back exactly
// (our reader), and resuming from the export at world 2 continues at step 4.
TEST(DcpExport, ExportedCheckpointReadsBackExactlyAndResumes) {
  TinyCheckpoint c = make_tiny_checkpoint("export");
  ASSERT_TRUE(fs::exists(c.step_dir + "/.metadata"));
  const std::string out = (c.run / "dcp").string();
  ExportOptions options;
  options.format = ExportFormat::kDcp;
  options.run = framework::config::make_run_adapter();  // the param group of the run
  const ExportStats stats = export_checkpoint(c.step_dir, out, options);
  EXPECT_EQ(stats.tensors, c.expected.size());
  auto storage = posix_storage();
  ASSERT_TRUE(is_dcp_checkpoint(*storage, out));
  const DcpMetadata meta = read_dcp_metadata(*storage, out);
  ASSERT_EQ(meta.tensors.size(), c.expected.size());
  for (const DcpTensorItem& item : meta.tensors) {
    ASSERT_EQ(c.expected.count(item.fqn), 1u) << item.fqn;
    std::string got(static_cast<size_t>(*checked_numel(item.shape)) * element_size(item.dtype), '\0');
    read_dcp_box(*storage, out, item, full_box(item.shape), reinterpret_cast<uint8_t*>(got.data()));
    EXPECT_EQ(got, bytes_of(c.expected.at(item.fqn).first)) << item.fqn;
  }
  bool params = false;
  for (const DcpBytesItem& b : meta.bytes) params = params || b.fqn == "optim.param_groups.0.params";
  EXPECT_TRUE(params);

  framework::config::Config cfg;
  cfg.run.dir = (c.run / "again").string();
  cfg.train.steps = 5;
  cfg.train.global_batch_size = 6;
  cfg.checkpoint.interval = 0;
  cfg.checkpoint.resume = out;
  testing_support::run_runtimes(2, [&](comm::Runtime& rt) {
    framework::train::Trainer trainer(cfg, rt, tiny_user_model());
    EXPECT_EQ(trainer.step(), 4);
    for (size_t i = 0; i < trainer.model().param_names().size(); ++i) {
      const std::string name = "model." + trainer.model().param_names()[i];
      EXPECT_EQ(bytes_of(trainer.model().param_dtensor(i).full_tensor()),
                bytes_of(c.expected.at(name).first))
          << name;
    }
  });
  fs::remove_all(c.run);
}

// ckpt import-dcp: the torch fixture becomes a committed shardkit checkpoint
// that verifies, resumes at world 3 with the exact weights, moments and
// step, and trains on; --map renames keys before the default mapping.
TEST(DcpImport, ImportedCheckpointVerifiesAndResumesAtThreeRanks) {
  const std::string dcp = kFixtures + "/torch26_world2";
  const std::map<std::string, std::string> expected = expected_tensors(dcp);
  const fs::path run = fs::temp_directory_path() / ("shardkit_dcp_import_" + std::to_string(::getpid()));
  fs::remove_all(run);
  const std::string step_dir = (run / "checkpoints" / "step_2").string();
  DcpImportOptions options;
  options.step_item = framework::config::kStepItem;  // the trainer resumes at it
  options.slab_bytes = 100;  // several chunks per DCP chunk: the streaming path
  const DcpImportStats stats = import_dcp_checkpoint(dcp, step_dir, options);
  EXPECT_EQ(stats.step, 2);
  EXPECT_EQ(stats.tensors, 24u);  // 6 weights, 6 x (exp_avg, exp_avg_sq, step)
  auto storage = posix_storage();
  const VerifyReport report = verify_checkpoint(*storage, step_dir);
  EXPECT_TRUE(report.ok());
  EXPECT_GT(read_committed_metadata(*storage, step_dir).find("model.head.weight")->chunks.size(), 2u);
  EXPECT_NE(error_of([&] { import_dcp_checkpoint(dcp, step_dir, options); }).find("exists"),
            std::string::npos);

  framework::config::Config cfg;
  cfg.run.dir = run.string();
  cfg.train.steps = 3;
  cfg.train.global_batch_size = 6;
  cfg.checkpoint.interval = 0;
  testing_support::run_runtimes(3, [&](comm::Runtime& rt) {
    framework::train::Trainer trainer(cfg, rt, tiny_user_model());
    EXPECT_EQ(trainer.step(), 2);
    for (size_t i = 0; i < trainer.model().param_names().size(); ++i) {
      const std::string name = trainer.model().param_names()[i];
      EXPECT_EQ(bytes_of(trainer.model().param_dtensor(i).full_tensor()), expected.at("model." + name))
          << name;
      const framework::optim::AdamWParamState st = trainer.optimizer().state(i);
      EXPECT_EQ(st.step, 2);
      EXPECT_EQ(bytes_of(st.exp_avg_sq.full_tensor()), expected.at("optim.state." + name + ".exp_avg_sq"))
          << name;
    }
    EXPECT_TRUE(std::isfinite(trainer.train_step().loss));
  });

  // The command line, with a rename.
  const std::string renamed = (run / "renamed").string();
  const std::string cmd = testing_support::binary_dir() + "/ckpt" + " import-dcp " + dcp + " " +
                          renamed + " --map model.emb.=model.embedding. > " + renamed + ".log 2>&1";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << read_all(renamed + ".log");
  EXPECT_NE(read_all(renamed + ".log").find("step 2"), std::string::npos) << read_all(renamed + ".log");
  const CheckpointMeta meta = read_committed_metadata(*storage, renamed);
  EXPECT_NE(meta.find("model.embedding.weight"), nullptr);
  EXPECT_EQ(meta.find("model.emb.weight"), nullptr);
  EXPECT_EQ(meta.info.at("imported_from"), "pytorch-dcp");
  fs::remove_all(run);
}

// ---- hostile input

class DcpHostile : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("shardkit_dcp_hostile_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::copy(kFixtures + "/torch26_world2", dir_, fs::copy_options::recursive);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string open_error() {
    return error_of([&] { WeightsFile::open(dir_.string()); });
  }
  fs::path dir_;
};

TEST_F(DcpHostile, AForbiddenGlobalIsRefusedByName) {
  // What a malicious .metadata would do: call os.system.
  const std::string evil = std::string("\x80\x02") + "cos\nsystem\n" + "X\x04\x00\x00\x00" +
                           "true" + "\x85R.";
  std::ofstream(dir_ / ".metadata", std::ios::binary | std::ios::trunc) << evil;
  const std::string err = open_error();
  EXPECT_NE(err.find("'os.system' is not allowed"), std::string::npos) << err;
  EXPECT_NE(err.find(".metadata"), std::string::npos) << err;
}

TEST_F(DcpHostile, ATruncatedDataFileIsNamed) {
  // Rank 0's file holds model chunks from its start: cut it after the first two.
  const fs::path data = dir_ / "__0_0.distcp";
  fs::resize_file(data, 3000);
  const std::string err = open_error();
  EXPECT_NE(err.find("__0_0.distcp"), std::string::npos) << err;
  EXPECT_NE(err.find("past the end of the file"), std::string::npos) << err;
}

TEST_F(DcpHostile, AnOffsetPastTheEndIsNamed) {
  auto storage = posix_storage();
  DcpMetadata meta = read_dcp_metadata(*storage, dir_.string());
  meta.tensors.at(0).chunks.at(0).location.offset = 1u << 30;
  const std::vector<uint8_t> bytes = write_dcp_metadata(meta);
  std::ofstream(dir_ / ".metadata", std::ios::binary | std::ios::trunc)
      .write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  const std::string err = open_error();
  EXPECT_NE(err.find(meta.tensors[0].fqn), std::string::npos) << err;
  EXPECT_NE(err.find("past the end"), std::string::npos) << err;
}

TEST_F(DcpHostile, OverlappingOrMissingChunksAreRefused) {
  auto storage = posix_storage();
  DcpMetadata meta = read_dcp_metadata(*storage, dir_.string());
  DcpMetadata overlap = meta;
  overlap.tensors.at(0).chunks.at(1).box = overlap.tensors[0].chunks[0].box;
  std::vector<uint8_t> bytes = write_dcp_metadata(overlap);
  EXPECT_NE(error_of([&] { parse_dcp_metadata(bytes.data(), bytes.size(), "m"); }).find("overlap"),
            std::string::npos);
  DcpMetadata missing = meta;
  missing.tensors.at(0).chunks.pop_back();
  bytes = write_dcp_metadata(missing);
  EXPECT_NE(error_of([&] { parse_dcp_metadata(bytes.data(), bytes.size(), "m"); }).find("cover"),
            std::string::npos);
}

TEST_F(DcpHostile, AFlippedByteInAnArchiveIsCaught) {
  auto storage = posix_storage();
  const DcpMetadata meta = read_dcp_metadata(*storage, dir_.string());
  const DcpChunk& c = meta.tensors.at(0).chunks.at(0);
  // Flip a byte of data.pkl (the first member's data, after its local header).
  std::fstream f(dir_ / c.location.file, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(static_cast<std::streamoff>(c.location.offset + 100));
  char b = 0;
  f.read(&b, 1);
  f.seekp(static_cast<std::streamoff>(c.location.offset + 100));
  b = static_cast<char>(b ^ 0x5a);
  f.write(&b, 1);
  f.close();
  const std::string err = open_error();
  EXPECT_NE(err.find(meta.tensors[0].fqn), std::string::npos) << err;
  EXPECT_NE(err.find(c.location.file), std::string::npos) << err;
}

// ---- against Python's own DCP (the Debian 13 leg)

std::string python_with_torch() {
  return testing_support::python_with("torch.distributed.checkpoint.state_dict, torch.distributed.tensor");
}

// Every Python run ends: a hung peer fails the test after 5 minutes (the
// scripts' own gloo timeouts and liveness checks should end it sooner).
const char* const kPythonTimeout = "timeout -k 10 300 env ";

const char* const kNoPythonDcp =
    "no python3 with torch.distributed.checkpoint.state_dict and DTensor (tried "
    "$SHARDKIT_PYTHON, /usr/bin/python3, python3; Debian 12's torch 1.13 has neither): the "
    "Debian 13 leg's python3-torch 2.6 runs it";

TEST(DcpPython, AFreshTorchDcpSaveAtWorldTwoReadsExactlyAtOneAndThreeRanks) {
  const std::string python = python_with_torch();
  if (python.empty()) {
    SHARDKIT_SKIP(kNoPythonDcp);
  }
  const fs::path out = fs::temp_directory_path() / ("shardkit_dcp_py_" + std::to_string(::getpid()));
  fs::remove_all(out);
  fs::remove_all(out.string() + ".expected");
  const std::string cmd = std::string(kPythonTimeout) + "USE_LIBUV=0 " + python + " " + kFixtures +
                          "/make_dcp.py " + out.string() + " > " + out.string() + ".log 2>&1";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << read_all(out.string() + ".log");
  for (int64_t parts : {1, 3}) expect_every_tensor_exact(out.string(), parts);
  // And training continues from it at world 3 (model, AdamW state, step).
  framework::config::Config cfg;
  cfg.run.dir = out.string() + ".run";
  cfg.train.steps = 3;
  cfg.train.global_batch_size = 6;
  cfg.checkpoint.interval = 0;
  cfg.checkpoint.resume = out.string();
  testing_support::run_runtimes(3, [&](comm::Runtime& rt) {
    framework::train::Trainer trainer(cfg, rt, tiny_user_model());
    EXPECT_EQ(trainer.step(), 2);
    EXPECT_TRUE(std::isfinite(trainer.train_step().loss));
  });
  fs::remove_all(cfg.run.dir);
  fs::remove_all(out);
  fs::remove_all(out.string() + ".expected");
  fs::remove(out.string() + ".log");
}

// Our export, loaded by Python's own dcp.load into get_state_dict(model,
// AdamW) of the same architecture, at world 1 and world 2: every tensor exact.
TEST(DcpPython, PythonDcpLoadReadsOurExportAtOneAndTwoRanks) {
  const std::string python = python_with_torch();
  if (python.empty()) {
    SHARDKIT_SKIP(kNoPythonDcp);
  }
  TinyCheckpoint c = make_tiny_checkpoint("pyexport");
  const std::string out = (c.run / "dcp").string();
  ExportOptions options;
  options.format = ExportFormat::kDcp;
  options.run = framework::config::make_run_adapter();  // the param group of the run
  export_checkpoint(c.step_dir, out, options);
  const fs::path expected = c.run / "expected";
  fs::create_directories(expected);
  nlohmann::json index;
  int i = 0;
  for (const auto& [key, value] : c.expected) {
    const std::string file = std::to_string(i++) + ".bin";
    std::ofstream(expected / file, std::ios::binary) << bytes_of(value.first);
    index[key] = {{"kind", "tensor"},
                  {"dtype", "float32"},
                  {"shape", value.first.sizes().vec()},
                  {"file", file}};
  }
  std::ofstream(expected / "index.json") << index.dump();
  for (int world : {1, 2}) {
    const std::string log = (c.run / ("load" + std::to_string(world) + ".log")).string();
    const std::string cmd = std::string(kPythonTimeout) + "USE_LIBUV=0 " + python + " " + kFixtures +
                            "/load_dcp.py " + out + " " + std::to_string(world) + " --expected " +
                            expected.string() + " > " + log + " 2>&1";
    EXPECT_EQ(std::system(cmd.c_str()), 0) << "world " << world << ":\n" << read_all(log);
  }
  fs::remove_all(c.run);
}


// The DCP export of a tensor-parallel checkpoint: whole tensors, read back
// exactly by our reader and, where a python3 with torch is found (the
// Debian 13 leg), by PyTorch's own DCP loader.
void check_export_loads_in_torch_dcp(TinyCheckpoint c);

TEST(DcpPython, ATensorParallelCheckpointExportLoadsInTorchDcp) {
  check_export_loads_in_torch_dcp(make_tensor_parallel_checkpoint("tpexport"));
}

// The same for an expert-parallel mixture of experts (EP 2 x FSDP 2): each
// expert at its global row of the whole tensors; and the export is a
// model.init_from of an EP 4 run, which holds exactly the same weights.
TEST(DcpPython, AnExpertParallelCheckpointExportLoadsInTorchDcpAndInitsAnotherExpertLayout) {
  TinyCheckpoint c = make_tensor_parallel_checkpoint("epexport", /*moe=*/true);
  ASSERT_TRUE(c.expected.count("model.model.layers.1.mlp.experts.up_proj.weight"));
  EXPECT_EQ(c.expected.at("model.model.layers.1.mlp.experts.up_proj.weight").first.size(0), 4);
  const std::string out = (c.run / "dcp_init").string();
  ExportOptions options;
  options.format = ExportFormat::kDcp;
  options.run = framework::config::make_run_adapter();
  export_checkpoint(c.step_dir, out, options);
  framework::config::Config cfg;
  cfg.run.dir = (c.run / "ep4").string();
  cfg.train.steps = 1;
  cfg.train.global_batch_size = 4;
  cfg.model.kind = "llama";
  cfg.model.tie_weights = false;
  cfg.model.vocab_size = 34;
  cfg.model.seq_len = 8;
  cfg.model.d_model = 32;
  cfg.model.n_heads = 4;
  cfg.model.n_kv_heads = 2;
  cfg.model.n_layers = 2;
  cfg.model.d_ff = 48;
  cfg.model.moe.num_experts = 4;
  cfg.model.moe.d_ff = 16;
  cfg.model.moe.load_balance_rate = 0.01;
  cfg.model.init_from = out;
  cfg.parallel.expert = 4;
  std::mutex mu;
  size_t compared = 0;
  testing_support::run_runtimes(4, [&](comm::Runtime& rt) {
    framework::train::Trainer trainer(cfg, rt);
    auto& sharded = trainer.model();
    for (size_t i = 0; i < sharded.param_names().size(); ++i) {
      const std::string name = sharded.param_names()[i];
      const torch::Tensor p = sharded.param_dtensor(i).full_tensor().contiguous();
      std::lock_guard<std::mutex> lock(mu);
      EXPECT_TRUE(torch::equal(p, c.expected.at("model." + name).first)) << name;
      if (rt.env.rank == 0) ++compared;
    }
  });
  EXPECT_EQ(compared * 2, c.expected.size());  // a model and an exp_avg entry each
  check_export_loads_in_torch_dcp(std::move(c));
}

void check_export_loads_in_torch_dcp(TinyCheckpoint c) {
  const std::string out = (c.run / "dcp").string();
  ExportOptions options;
  options.format = ExportFormat::kDcp;
  options.run = framework::config::make_run_adapter();  // the param group of the run
  export_checkpoint(c.step_dir, out, options);
  auto storage = posix_storage();
  const DcpMetadata meta = read_dcp_metadata(*storage, out);
  size_t checked = 0;
  for (const DcpTensorItem& item : meta.tensors) {
    auto it = c.expected.find(item.fqn);
    if (it == c.expected.end()) continue;
    std::string got(static_cast<size_t>(*checked_numel(item.shape)) * element_size(item.dtype), '\0');
    read_dcp_box(*storage, out, item, full_box(item.shape), reinterpret_cast<uint8_t*>(got.data()));
    EXPECT_EQ(got, bytes_of(it->second.first)) << item.fqn;
    ++checked;
  }
  EXPECT_EQ(checked, c.expected.size());
  const std::string python = python_with_torch();
  if (python.empty()) {
    fs::remove_all(c.run);
    SHARDKIT_SKIP(kNoPythonDcp);
  }
  const fs::path expected = c.run / "expected";
  fs::create_directories(expected);
  nlohmann::json index;
  int i = 0;
  for (const auto& [key, value] : c.expected) {
    const std::string file = std::to_string(i++) + ".bin";
    std::ofstream(expected / file, std::ios::binary) << bytes_of(value.first);
    index[key] = {{"kind", "tensor"}, {"dtype", "float32"}, {"shape", value.first.sizes().vec()}, {"file", file}};
  }
  std::ofstream(expected / "index.json") << index.dump();
  const std::string log = (c.run / "load.log").string();
  const std::string cmd = std::string(kPythonTimeout) + "USE_LIBUV=0 " + python + " " + kFixtures +
                          "/load_dcp.py " + out + " 1 --generic --expected " + expected.string() + " > " +
                          log + " 2>&1";
  EXPECT_EQ(std::system(cmd.c_str()), 0) << read_all(log);
  fs::remove_all(c.run);
}

}  // namespace
