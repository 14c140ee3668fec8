// Checkpointing the trainer: every saving layout loads into every loading
// layout exactly; resumed runs continue the same training; async and overlap
// saves commit exactly what a sync save commits.
#include "checkpoint/load.h"
#include "checkpoint/save.h"
#include "checkpoint/format/metadata.h"
#include "checkpoint/storage/posix_counters.h"
#include "checkpoint/storage/storage.h"
#include "framework/fsdp/fully_shard.h"
#include "framework/optim/sharded_adamw.h"
#include "framework/data/loader.h"
#include "framework/data/synthetic_dataset.h"
#include "framework/train/resume_audit.h"
#include "framework/train/checkpoint_interval.h"
#include "framework/train/goodput.h"
#include "framework/train/state_dict.h"
#include "framework/train/trainer.h"
#include "support/multi_rank.h"
#include "support/trainer_state.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

namespace fs = std::filesystem;
using framework::train::Trainer;
using testing_support::FullState;
using testing_support::expect_same_state;
using testing_support::gather_full_state;
using testing_support::read_checkpoint_items;
using testing_support::run_runtimes;

namespace {

struct CkptLayout {
  const char* name;
  int world;
  int64_t replicate;
  int64_t shard;
};

const CkptLayout kLayouts[] = {
    {"fsdp1", 1, 1, 1}, {"fsdp2", 2, 1, 2}, {"fsdp3", 3, 1, 3},
    {"fsdp4", 4, 1, 4}, {"ddp2", 2, 2, 1},  {"hsdp2x2", 4, 2, 2},
};

std::string ckpt_scratch(const std::string& tag) {
  auto dir = fs::temp_directory_path() / ("shardkit_ckpt_" + tag + "_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  return dir.string();
}

framework::config::Config base_config(const std::string& dir) {
  framework::config::Config c;
  c.run.dir = dir;
  c.run.seed = 5;
  c.train.steps = 20;
  c.train.global_batch_size = 12;
  c.train.log_every = 100;
  c.model.vocab_size = 16;
  c.model.seq_len = 16;
  c.model.d_model = 24;  // 24 rows / 48 / 72: uneven over 4 ranks in places
  c.model.n_heads = 2;
  c.model.n_layers = 2;
  c.optim.warmup_steps = 2;
  c.checkpoint.dir = dir + "/checkpoints";
  c.checkpoint.resume = "never";
  c.checkpoint.io_threads = 2;
  return c;
}

FullState run_and_gather(const framework::config::Config& cfg, const CkptLayout& l,
                         std::vector<double>* losses = nullptr, int64_t* resumed_step = nullptr) {
  auto c = cfg;
  c.parallel.replicate = l.replicate;
  c.parallel.shard = l.shard;
  FullState result;
  std::mutex mu;
  run_runtimes(l.world, [&](comm::Runtime& rt) {
    Trainer t(c, rt);
    int64_t start = t.step();
    EXPECT_EQ(t.run(), 0);
    FullState full = gather_full_state(t);
    if (rt.env.rank == 0) {
      std::lock_guard<std::mutex> lock(mu);
      result = std::move(full);
      if (resumed_step) *resumed_step = start;
      if (losses) {
        for (const auto& r : t.history()) losses->push_back(r.loss);
      }
    }
  });
  return result;
}

// The state a trainer holds right after loading `path` (no training).
FullState load_and_gather(const framework::config::Config& cfg, const CkptLayout& l, const std::string& path) {
  auto c = cfg;
  c.parallel.replicate = l.replicate;
  c.parallel.shard = l.shard;
  c.checkpoint.resume = path;
  FullState result;
  std::mutex mu;
  run_runtimes(l.world, [&](comm::Runtime& rt) {
    Trainer t(c, rt);
    FullState full = gather_full_state(t);
    if (rt.env.rank == 0) {
      std::lock_guard<std::mutex> lock(mu);
      result = std::move(full);
    }
  });
  return result;
}

}  // namespace

TEST(ReshardMatrix, EverySavingLayoutLoadsExactlyIntoEveryLoadingLayout) {
  std::string root = ckpt_scratch("matrix");
  for (const CkptLayout& saver : kLayouts) {
    auto cfg = base_config(root + "/" + saver.name);
    cfg.train.steps = 3;
    cfg.checkpoint.interval = 3;
    cfg.checkpoint.mode = checkpoint::SaveMode::kSync;
    FullState saved = run_and_gather(cfg, saver);
    ASSERT_FALSE(saved.empty());
    std::string path = cfg.checkpoint.dir + "/step_3";
    ASSERT_TRUE(fs::exists(path + "/.metadata")) << path;
    for (const CkptLayout& loader : kLayouts) {
      SCOPED_TRACE(std::string("saved by ") + saver.name + ", loaded by " + loader.name);
      FullState loaded = load_and_gather(cfg, loader, path);
      expect_same_state(saved, loaded, std::string(saver.name) + " -> " + loader.name);
    }
  }
  fs::remove_all(root);
}

TEST(ResumeAcrossWorldSizes, SavedAtTwoResumedAtThreeAndOneContinuesTheLosses) {
  std::string root = ckpt_scratch("reshard_resume");
  auto cfg = base_config(root + "/full");
  std::vector<double> reference;
  run_and_gather(cfg, kLayouts[1], &reference);  // FSDP 2, uninterrupted to 20
  ASSERT_EQ(reference.size(), 20u);

  auto stopped = base_config(root + "/stopped");
  stopped.train.stop_at = 10;
  stopped.checkpoint.interval = 10;
  stopped.checkpoint.mode = checkpoint::SaveMode::kAsync;
  run_and_gather(stopped, kLayouts[1]);
  std::string path = stopped.checkpoint.dir + "/step_10";
  ASSERT_TRUE(fs::exists(path + "/.metadata"));

  // The checkpoint records the whole global batch of step 11 (not a rank's
  // slice) and step 10's loss; each resume below audits that batch at its
  // own world size (a difference would throw ResumeAuditError).
  const auto items = read_checkpoint_items(path);
  const auto dataset = framework::data::make_dataset(stopped.data, stopped.model, 5);
  const auto record = framework::train::decode_next_batch(items.at("data.next_batch"), path);
  EXPECT_EQ(record.batch_hash, framework::train::global_batch_hash(*dataset, 12, 5, 10));
  EXPECT_NE(record.batch_hash, framework::train::global_batch_hash(*dataset, 12, 5, 9));
  EXPECT_EQ(record.data.seed, 5u);
  EXPECT_EQ(record.data.global_batch_size, 12);
  EXPECT_EQ(framework::train::bytes_double(items.at("train.last_loss"), "train.last_loss"), reference[9]);
  EXPECT_EQ(items.count("rng.cuda"), 0u);  // trained on the CPU

  for (const CkptLayout& l : {kLayouts[2], kLayouts[0], kLayouts[5]}) {
    SCOPED_TRACE(l.name);
    auto resumed = base_config(root + "/resumed_" + l.name);
    resumed.checkpoint.resume = path;
    std::vector<double> losses;
    int64_t start = -1;
    run_and_gather(resumed, l, &losses, &start);
    EXPECT_EQ(start, 10);
    ASSERT_EQ(losses.size(), 10u);
    for (size_t i = 0; i < 10; ++i) {
      EXPECT_NEAR(losses[i], reference[10 + i], 1e-5 * reference[10 + i]) << "step " << 11 + i;
    }
  }
  fs::remove_all(root);
}


TEST(AsyncCheckpointing, AsyncAndOverlapCommitExactlyWhatSyncCommits) {
  std::string root = ckpt_scratch("modes");
  std::map<std::string, std::string> dirs;
  for (const char* mode : {"sync", "async", "overlap"}) {
    auto cfg = base_config(root + "/" + mode);
    cfg.train.steps = 12;
    cfg.checkpoint.interval = 4;
    cfg.checkpoint.mode = checkpoint::parse_save_mode(mode);
    run_and_gather(cfg, kLayouts[1]);
    dirs[mode] = cfg.checkpoint.dir;
  }
  for (int step : {4, 8, 12}) {
    SCOPED_TRACE("step " + std::to_string(step));
    auto sync = read_checkpoint_items(dirs["sync"] + "/step_" + std::to_string(step));
    ASSERT_GT(sync.size(), 10u);
    for (const char* mode : {"async", "overlap"}) {
      auto other = read_checkpoint_items(dirs[mode] + "/step_" + std::to_string(step));
      ASSERT_EQ(other.size(), sync.size()) << mode;
      for (const auto& [name, bytes] : sync) {
        EXPECT_EQ(other.at(name), bytes) << mode << ": item " << name << " differs from sync";
      }
    }
  }
  fs::remove_all(root);
}

// checkpoint.direct_io: the data files' large pieces bypass the page cache;
// the checkpoints are byte-identical to page-cache ones and load exactly.
// The model is wide enough (d_model 384: 2.3 MiB MLP matrices, 1.2 MiB per
// rank) for pieces above the 1 MiB direct threshold.
TEST(DirectIo, CheckpointsWrittenWithDirectIoEqualPageCacheOnesAndLoadExactly) {
  std::string root = ckpt_scratch("direct");
  std::map<bool, std::string> dirs;
  FullState trained;
  uint64_t direct_bytes = 0;
  for (const bool direct : {false, true}) {
    auto cfg = base_config(root + (direct ? "/direct" : "/cached"));
    cfg.model.d_model = 384;
    cfg.train.steps = 6;
    cfg.checkpoint.interval = 3;
    cfg.checkpoint.mode = checkpoint::SaveMode::kAsync;
    cfg.checkpoint.direct_io = direct ? checkpoint::DirectIo::kOn : checkpoint::DirectIo::kOff;
    const checkpoint::PosixWriteCounters before = checkpoint::posix_write_counters();
    FullState end = run_and_gather(cfg, kLayouts[1]);
    if (direct) {
      direct_bytes = checkpoint::posix_write_counters().direct_bytes - before.direct_bytes;
    } else {
      EXPECT_EQ(checkpoint::posix_write_counters().direct_bytes, before.direct_bytes);
      trained = std::move(end);
    }
    dirs[direct] = cfg.checkpoint.dir;
  }
  EXPECT_GT(direct_bytes, uint64_t{4} << 20) << "checkpoint.direct_io wrote nothing with O_DIRECT";
  for (int step : {3, 6}) {
    SCOPED_TRACE("step " + std::to_string(step));
    auto cached = read_checkpoint_items(dirs[false] + "/step_" + std::to_string(step));
    auto direct = read_checkpoint_items(dirs[true] + "/step_" + std::to_string(step));
    ASSERT_EQ(direct.size(), cached.size());
    for (const auto& [name, bytes] : cached) EXPECT_EQ(direct.at(name), bytes) << "item " << name;
  }
  auto cfg = base_config(root + "/load");
  cfg.model.d_model = 384;
  expect_same_state(trained, load_and_gather(cfg, kLayouts[2], dirs[true] + "/step_6"),
                    "direct_io fsdp2 -> fsdp3");
  fs::remove_all(root);
}

TEST(AsyncCheckpointing, TrainingAndCheckpointCollectivesRunTogetherForManySteps) {
  std::string root = ckpt_scratch("busy");
  for (const char* mode : {"async", "overlap"}) {
    auto cfg = base_config(root + "/" + mode);
    cfg.train.steps = 40;
    cfg.checkpoint.interval = 1;  // a save in flight during almost every step
    cfg.checkpoint.mode = checkpoint::parse_save_mode(mode);
    cfg.checkpoint.keep_last = 2;
    run_and_gather(cfg, kLayouts[3]);  // 4 ranks
    int committed = 0;
    for (const auto& e : fs::directory_iterator(cfg.checkpoint.dir)) {
      if (fs::exists(e.path() / ".metadata")) ++committed;
    }
    EXPECT_EQ(committed, 2) << mode << ": keep_last 2";
    EXPECT_TRUE(fs::exists(cfg.checkpoint.dir + "/step_40/.metadata")) << mode;
  }
  fs::remove_all(root);
}

// The library's get_state_dict / set_optimizer_state (what the trainer builds
// its checkpoints from), used directly: a model and optimizer trained at FSDP
// world 2 are saved, then loaded into a fresh model and optimizer at world 3;
// their full parameters, moments and step counts equal the saved ones.
TEST(StateDictHelpers, ModelAndOptimizerShardsReshardFromTwoRanksToThree) {
  const std::string dir = ckpt_scratch("state_dict_helpers");
  auto cfg = base_config(dir);
  cfg.train.steps = 3;
  cfg.checkpoint.interval = 0;
  cfg.checkpoint.save_on_signal = false;
  const std::string step_dir = dir + "/by_hand/step_3";
  FullState saved;
  std::mutex mu;
  {
    auto c = cfg;
    c.parallel.shard = 2;
    run_runtimes(2, [&](comm::Runtime& rt) {
      Trainer t(c, rt);
      ASSERT_EQ(t.run(), 0);
      checkpoint::StateDict sd = framework::train::get_state_dict(t.model(), &t.optimizer());
      EXPECT_NE(sd.find_tensor("model.blocks.0.attn.qkv.weight"), nullptr);
      EXPECT_NE(sd.find_tensor("optim.blocks.0.attn.qkv.weight.exp_avg"), nullptr);
      EXPECT_NE(sd.find_bytes("optim.blocks.0.attn.qkv.weight.step"), nullptr);
      checkpoint::SaveOptions so;
      so.step = 3;
      checkpoint::save_state_dict(sd, step_dir, *rt.checkpoint, so);
      FullState full = gather_full_state(t);
      if (rt.env.rank == 0) {
        std::lock_guard<std::mutex> lock(mu);
        saved = std::move(full);
      }
    });
  }
  ASSERT_FALSE(saved.empty());
  EXPECT_EQ(saved.at("optim.blocks.0.attn.qkv.weight.step").item<int64_t>(), 3);
  FullState loaded;
  {
    auto c = cfg;
    c.parallel.shard = 3;
    c.run.seed = 99;  // other initial weights: the load must replace them
    run_runtimes(3, [&](comm::Runtime& rt) {
      Trainer t(c, rt);  // fresh: step 0, zero moments
      checkpoint::StateDict sd = framework::train::get_state_dict(t.model(), &t.optimizer());
      checkpoint::LoadOptions lo;
      checkpoint::load_state_dict(sd, step_dir, lo);
      framework::train::set_optimizer_state(sd, t.model(), t.optimizer());
      FullState full = gather_full_state(t);
      if (rt.env.rank == 0) {
        std::lock_guard<std::mutex> lock(mu);
        loaded = std::move(full);
      }
    });
  }
  expect_same_state(saved, loaded, "state dict helpers, world 2 -> 3");
  fs::remove_all(dir);
}

// Two Trainers, one after the other, on one runtime (train, then resume):
// the second one's mesh groups must not meet the first one's in the store
// (they once did, and its rendezvous failed or hung about half the time).
TEST(TrainerLifetime, ASecondTrainerOnTheSameRuntimeResumesTheFirstOnesCheckpoint) {
  const std::string dir = ckpt_scratch("two_trainers");
  auto cfg = base_config(dir);
  cfg.train.steps = 2;
  cfg.checkpoint.interval = 2;
  cfg.checkpoint.resume = "auto";
  cfg.parallel.shard = 2;
  run_runtimes(2, [&](comm::Runtime& rt) {
    for (int round = 0; round < 4; ++round) {
      Trainer t(cfg, rt);
      EXPECT_EQ(t.step(), round == 0 ? 0 : 2) << "round " << round;
      EXPECT_EQ(t.run(), 0);
    }
  });
  fs::remove_all(dir);
}


// train.optimizer_impl changes how AdamW computes, not what it keeps: a
// checkpoint written under any implementation resumes under any other.
// Under the same implementation the resumed run is bit-identical to the
// uninterrupted one (for_loop is what every earlier checkpoint was written
// with); across implementations the math differs by rounding only.
TEST(OptimizerImpls, ACheckpointWrittenUnderOneImplementationResumesUnderEvery) {
  std::string root = ckpt_scratch("optimizer_impls");
  std::vector<std::string> impls{"for_loop", "foreach"};
  if (framework::optim::adamw_impl_available(framework::optim::AdamWImpl::kFused)) impls.push_back("fused");
  std::map<std::string, std::vector<double>> full_losses;
  std::map<std::string, FullState> full_state;
  std::map<std::string, std::map<std::string, std::vector<uint8_t>>> items;
  for (const std::string& impl : impls) {
    auto cfg = base_config(root + "/full_" + impl);
    cfg.train.optimizer_impl = framework::optim::parse_optimizer_impl(impl);
    full_state[impl] = run_and_gather(cfg, kLayouts[1], &full_losses[impl]);
    ASSERT_EQ(full_losses[impl].size(), 20u);
    auto stopped = base_config(root + "/stopped_" + impl);
    stopped.train.optimizer_impl = framework::optim::parse_optimizer_impl(impl);
    stopped.train.stop_at = 10;
    stopped.checkpoint.interval = 10;
    stopped.checkpoint.mode = checkpoint::SaveMode::kSync;
    run_and_gather(stopped, kLayouts[1]);
    ASSERT_TRUE(fs::exists(stopped.checkpoint.dir + "/step_10/.metadata"));
    items[impl] = read_checkpoint_items(stopped.checkpoint.dir + "/step_10");
  }
  // The same items, shapes and dtypes whoever wrote them (the values differ
  // by rounding across implementations).
  for (const std::string& impl : impls) {
    ASSERT_EQ(items[impl].size(), items["for_loop"].size()) << impl;
    for (const auto& [name, bytes] : items["for_loop"]) {
      auto it = items[impl].find(name);
      ASSERT_NE(it, items[impl].end()) << impl << " lacks " << name;
      EXPECT_EQ(it->second.size(), bytes.size()) << impl << ": " << name;
    }
  }
  for (const std::string& writer : impls) {
    for (const std::string& reader : impls) {
      SCOPED_TRACE("written under " + writer + ", resumed under " + reader);
      auto resumed = base_config(root + "/resumed_" + writer + "_" + reader);
      resumed.train.optimizer_impl = framework::optim::parse_optimizer_impl(reader);
      resumed.checkpoint.resume = root + "/stopped_" + writer + "/checkpoints/step_10";
      std::vector<double> losses;
      int64_t start = -1;
      FullState end = run_and_gather(resumed, kLayouts[1], &losses, &start);
      EXPECT_EQ(start, 10);
      ASSERT_EQ(losses.size(), 10u);
      if (writer == reader) {
        for (size_t i = 0; i < 10; ++i) EXPECT_EQ(losses[i], full_losses[writer][10 + i]) << "step " << 11 + i;
        expect_same_state(end, full_state[writer], writer + " resumed");
      } else {
        for (size_t i = 0; i < 10; ++i) {
          EXPECT_NEAR(losses[i], full_losses[reader][10 + i], 1e-5 * full_losses[reader][10 + i])
              << "step " << 11 + i;
        }
      }
    }
  }
  fs::remove_all(root);
}

namespace {

using framework::train::AuditOutcome;
using framework::train::DataFile;
using framework::train::NextBatchRecord;

NextBatchRecord record_of(uint64_t hash, uint64_t seed, std::vector<DataFile> files) {
  NextBatchRecord r;
  r.batch_hash = hash;
  r.data.seed = seed;
  r.data.global_batch_size = 8;
  r.data.files = std::move(files);
  return r;
}

// A checkpoint's trainer items after a load: the loader's position and,
// unless empty, the next-batch record.
checkpoint::StateDict loaded_items(const framework::data::LoaderState& position, std::vector<uint8_t> next_batch) {
  checkpoint::StateDict sd;
  sd.add_bytes("data.loader", framework::data::encode_loader_state(position));
  sd.add_bytes("data.next_batch", std::move(next_batch));
  return sd;
}

using framework::train::AutoIntervalTracker;
using framework::train::EarlierAttempts;
using framework::train::IntervalChoice;
using framework::train::RestartLedger;
using framework::train::read_earlier_attempts;
using framework::train::restart_ledger;
using framework::train::young_daly_interval;

// A metrics.jsonl record as the trainer writes it, `at` seconds after
// 2026-12-01T00:00:00Z.
std::string record_at(double at, nlohmann::json j) {
  char buf[64];
  const int whole = static_cast<int>(at);
  std::snprintf(buf, sizeof(buf), "2026-12-01T%02d:%02d:%02d.%03dZ", whole / 3600, whole / 60 % 60, whole % 60,
                static_cast<int>(std::lround((at - whole) * 1000)));
  j["time"] = buf;
  return j.dump() + "\n";
}

std::vector<nlohmann::json> metrics_records(const std::string& run_dir, const std::string& event) {
  std::vector<nlohmann::json> out;
  std::ifstream in(run_dir + "/metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_object() && j.value("event", "") == event) out.push_back(j);
  }
  return out;
}

}  // namespace

// Why the next batch differs, named from the recorded data identity.
TEST(ResumeAudit, TheExplanationNamesTheSeedAChangedFileOrTheShardOrder) {
  const DataFile a{"/d/train_000.bin", 100, 1}, b{"/d/train_001.bin", 100, 2};
  const DataFile b_changed{"/d/train_001.bin", 100, 3};
  const DataFile a_swapped{"/d/train_000.bin", 100, 2}, b_swapped{"/d/train_001.bin", 100, 1};
  const auto saved = record_of(0x11, 1234, {a, b});
  EXPECT_EQ(framework::train::explain_batch_difference(saved, record_of(0x22, 99, {a, b})),
            "another seed (saved 1234, now 99) (saved hash 0000000000000011, now 0000000000000022)");
  EXPECT_EQ(framework::train::explain_batch_difference(saved, record_of(0x22, 1234, {a, b_changed})),
            "a data file changed under the same name (/d/train_001.bin: same size, other bytes) "
            "(saved hash 0000000000000011, now 0000000000000022)");
  EXPECT_EQ(framework::train::explain_batch_difference(saved, record_of(0x22, 1234, {a_swapped, b_swapped})),
            "shards in another order (train_000.bin holds what train_001.bin held, train_001.bin holds what "
            "train_000.bin held) (saved hash 0000000000000011, now 0000000000000022)");
  EXPECT_EQ(framework::train::explain_batch_difference(saved, record_of(0x22, 1234, {a, b})),
            "the next batch differs (saved hash 0000000000000011, now 0000000000000022)");
  // The same files elsewhere (the data moved) are no difference of their own.
  const DataFile a_moved{"/e/train_000.bin", 100, 1}, b_moved{"/e/train_001.bin", 100, 2};
  EXPECT_EQ(framework::train::explain_batch_difference(saved, record_of(0x22, 1234, {a_moved, b_moved})),
            "the next batch differs (saved hash 0000000000000011, now 0000000000000022)");
  const auto back = framework::train::decode_next_batch(framework::train::encode_next_batch(saved), "here");
  EXPECT_EQ(back.batch_hash, saved.batch_hash);
  EXPECT_EQ(back.data.seed, saved.data.seed);
  EXPECT_EQ(back.data.files, saved.data.files);
}

// error throws, warn and off go on; a checkpoint without the record (saved
// before it existed) or without a loader position (imported) skips with a note.
TEST(ResumeAudit, ModesAndCheckpointsWithoutTheRecord) {
  using framework::train::audit_resume;
  using Mode = checkpoint::ResumeAudit;
  auto dataset = std::make_shared<framework::data::SyntheticDataset>(framework::data::SyntheticTask::kCopy, 16, 8, 7);
  framework::data::DataLoader loader(dataset, 8, 7, 0, 1);
  framework::data::LoaderState position = loader.state();
  position.next_step = 3;
  loader.load_state(position);
  const framework::train::DataIdentity identity = framework::train::data_identity_of(*dataset, position);
  auto record = record_of(framework::train::global_batch_hash(*dataset, 8, 7, 3), 7, {});
  const auto same = loaded_items(position, framework::train::encode_next_batch(record));
  for (Mode mode : {Mode::kError, Mode::kWarn}) {
    EXPECT_EQ(audit_resume(same, loader, identity, mode, "ck/step_3").outcome, AuditOutcome::kPassed);
  }
  record.batch_hash ^= 1;
  const auto other = loaded_items(position, framework::train::encode_next_batch(record));
  EXPECT_THROW(audit_resume(other, loader, identity, Mode::kError, "ck/step_3"),
               framework::train::ResumeAuditError);
  const auto warned = audit_resume(other, loader, identity, Mode::kWarn, "ck/step_3");
  EXPECT_EQ(warned.outcome, AuditOutcome::kDiffers);
  EXPECT_NE(warned.message.find("the next batch differs"), std::string::npos) << warned.message;
  EXPECT_EQ(audit_resume(other, loader, identity, Mode::kOff, "ck/step_3").outcome, AuditOutcome::kOff);
  const auto old = audit_resume(loaded_items(position, {}), loader, identity, Mode::kError, "ck/step_3");
  EXPECT_EQ(old.outcome, AuditOutcome::kNoRecord);
  EXPECT_EQ(old.message, "resume audit skipped: ck/step_3 was saved before checkpoints recorded their next batch");
  checkpoint::StateDict imported;
  imported.add_bytes("data.loader", {});
  imported.add_bytes("data.next_batch", {});
  EXPECT_EQ(audit_resume(imported, loader, identity, Mode::kError, "ck/step_3").outcome, AuditOutcome::kImported);
}

// Young/Daly: every sqrt(2 x stall x MTBF) seconds, in whole steps (at
// least one); the expected loss per failure is half an interval plus the
// restart.
TEST(AutoCheckpointInterval, YoungDalyGivesTheIntervalInWholeSteps) {
  IntervalChoice c = young_daly_interval(/*save_stall_s=*/2.0, /*step_s=*/0.5, /*mtbf_s=*/3600, /*restart_s=*/10);
  EXPECT_DOUBLE_EQ(c.interval_s, 120.0);
  EXPECT_EQ(c.steps, 240);
  EXPECT_DOUBLE_EQ(c.expected_loss_s, 240 / 2 * 0.5 + 10);
  EXPECT_EQ(young_daly_interval(2.0, 7.0, 3600, 0).steps, 17);   // 120 / 7 = 17.1
  EXPECT_EQ(young_daly_interval(2.0, 48.0, 3600, 0).steps, 3);   // 2.5 rounds to nearest (llround: 3)
  EXPECT_EQ(young_daly_interval(0.0, 0.1, 3600, 0).steps, 1);    // no stall: every step
  EXPECT_EQ(young_daly_interval(2.0, 500.0, 3600, 0).steps, 1);  // steps longer than the interval
  // Four times the MTBF, twice the interval.
  EXPECT_DOUBLE_EQ(young_daly_interval(2.0, 0.5, 4 * 3600, 0).interval_s, 240.0);
}

// Each save's stall and the steps since the one before are smoothed (half
// new, half old); the process's first step counts only when alone.
TEST(AutoCheckpointInterval, TheTrackerSmoothsStallAndStepTime) {
  AutoIntervalTracker t(/*mtbf_s=*/100);
  t.add_step(9.0);  // the first step: warm-up
  EXPECT_DOUBLE_EQ(t.local_step_s(), 9.0);
  t.add_step(0.5);
  EXPECT_DOUBLE_EQ(t.local_step_s(), 0.5);
  IntervalChoice c = t.derive(1.0, t.local_step_s(), 0);
  EXPECT_DOUBLE_EQ(c.save_stall_s, 1.0);
  EXPECT_DOUBLE_EQ(c.step_s, 0.5);
  t.add_step(1.0);
  t.add_step(2.0);
  EXPECT_DOUBLE_EQ(t.local_step_s(), 1.5);
  c = t.derive(3.0, t.local_step_s(), 0);
  EXPECT_DOUBLE_EQ(c.save_stall_s, 2.0);
  EXPECT_DOUBLE_EQ(c.step_s, 1.0);
  EXPECT_DOUBLE_EQ(c.interval_s, 20.0);  // sqrt(2 x 2 x 100)
  EXPECT_EQ(c.steps, 20);
}

// A crashed attempt, then its restart: the time from its last record to
// the new first step is lost, and its steps past the checkpoint are redone.
TEST(GoodputLedger, ARestartCountsTheLostTimeAndTheRedoneSteps) {
  std::string text = record_at(0, {{"event", "start"}, {"step", 0}});
  for (int s = 1; s <= 14; ++s) {
    text += record_at(2.0 * s, {{"step", s}, {"step_time_s", 1.5}, {"loss", 1.0}});
    if (s == 10) text += record_at(20.5, {{"event", "checkpoint"}, {"step", 10}});
  }
  text += "{\"step\": 15, \"lo";  // torn by the crash
  std::istringstream in(text);
  const EarlierAttempts e = read_earlier_attempts(in);
  ASSERT_TRUE(e.any);
  EXPECT_EQ(e.last_step, 14);
  EXPECT_DOUBLE_EQ(e.last_record_unix_s - e.first_start_unix_s, 28.0);
  EXPECT_DOUBLE_EQ(e.mean_step_s, 1.5);
  const RestartLedger r = restart_ledger(e, /*resumed_step=*/10, e.first_start_unix_s + 40);
  EXPECT_EQ(r.restart, 1);
  EXPECT_EQ(r.step, 10);
  EXPECT_DOUBLE_EQ(r.lost_s, 12.0);
  EXPECT_EQ(r.redone_steps, 4);
  EXPECT_DOUBLE_EQ(r.redone_s, 6.0);
  EXPECT_DOUBLE_EQ(r.run_wall_s, 40.0);
  EXPECT_DOUBLE_EQ(r.goodput, (40.0 - 12.0 - 6.0) / 40.0);

  // A second crash: the ledger sums the first restart's cost too. (The
  // restarted attempt ended the torn line before its first record.)
  text += "\n" + record_at(40, {{"event", "start"}, {"step", 10}});
  text += record_at(40, {{"event", "restart"}, {"restart", 1}, {"lost_s", 12.0}, {"redone_s", 6.0}});
  text += record_at(41, {{"step", 11}, {"step_time_s", 1.0}});
  text += record_at(42, {{"step", 12}, {"step_time_s", 3.0}});
  std::istringstream again(text);
  const EarlierAttempts e2 = read_earlier_attempts(again);
  EXPECT_EQ(e2.restarts, 1);
  EXPECT_EQ(e2.last_step, 12);
  EXPECT_DOUBLE_EQ(e2.mean_step_s, 2.0);
  const RestartLedger r2 = restart_ledger(e2, 10, e2.first_start_unix_s + 50);
  EXPECT_EQ(r2.restart, 2);
  EXPECT_DOUBLE_EQ(r2.lost_s, 8.0);
  EXPECT_EQ(r2.redone_steps, 2);
  EXPECT_DOUBLE_EQ(r2.redone_s, 4.0);
  EXPECT_DOUBLE_EQ(r2.goodput, (50.0 - 12.0 - 6.0 - 8.0 - 4.0) / 50.0);
}

// A run that finished is no failure: resuming it later (more steps) starts
// a new ledger, and an empty file has no earlier attempt.
TEST(GoodputLedger, AFinishedRunOrAnEmptyFileHasNoEarlierAttempt) {
  std::istringstream empty("");
  EXPECT_FALSE(read_earlier_attempts(empty).any);
  std::istringstream finished(record_at(0, {{"event", "start"}, {"step", 0}}) +
                              record_at(1, {{"step", 1}, {"step_time_s", 1.0}}) +
                              record_at(2, {{"event", "end"}, {"step", 1}, {"status", "finished"}}));
  EXPECT_FALSE(read_earlier_attempts(finished).any);
  std::istringstream stopped(record_at(0, {{"event", "start"}, {"step", 0}}) +
                             record_at(2, {{"event", "end"}, {"step", 0}, {"status", "stopped"}}));
  const EarlierAttempts e = read_earlier_attempts(stopped);
  EXPECT_TRUE(e.any);
  EXPECT_EQ(e.last_step, 0);
  EXPECT_EQ(framework::train::parse_utc_timestamp("2026-12-01T00:00:01.250Z") -
                framework::train::parse_utc_timestamp("2026-12-01T00:00:00.000Z"),
            1.25);
  EXPECT_LT(framework::train::parse_utc_timestamp("yesterday"), 0);
}

// checkpoint.interval auto at world 2: a first save after two steps, then
// each save derives the next interval from the ranks' mean stall and step
// time; the saves land exactly where the derivations said, on both ranks.
// A tiny MTBF saves every step or few; a huge one (an interval of hours)
// saves only at step 2 and at the last, not at any multiple of 2.
TEST(AutoCheckpointInterval, SavesLandWhereEachDerivationSaidAndTheRecordsAddUp) {
  for (const double mtbf_s : {0.05, 1e7}) {
    const std::string dir = ckpt_scratch("auto_interval");
    auto cfg = base_config(dir);
    cfg.train.steps = 16;
    cfg.parallel.shard = 2;
    cfg.checkpoint.interval = checkpoint::kIntervalAuto;
    cfg.checkpoint.mtbf_s = mtbf_s;
    run_runtimes(2, [&](comm::Runtime& rt) {
      Trainer t(cfg, rt);
      EXPECT_EQ(t.run(), 0);
    });
    const std::vector<nlohmann::json> derived = metrics_records(dir, "checkpoint_interval");
    ASSERT_FALSE(derived.empty()) << "mtbf_s " << mtbf_s;
    std::set<int64_t> want = {2, 16};  // the measuring save, the last step
    int64_t at = 2;
    for (const nlohmann::json& d : derived) {
      EXPECT_EQ(d["step"].get<int64_t>(), at) << d;  // each derivation follows the save it measured
      const double stall = d["save_stall_s"], step = d["step_s"], mtbf = d["mtbf_s"], interval = d["interval_s"];
      const int64_t steps = d["interval_steps"];
      EXPECT_EQ(mtbf, mtbf_s);
      EXPECT_GT(stall, 0);
      EXPECT_GT(step, 0);
      EXPECT_DOUBLE_EQ(interval, std::sqrt(2 * stall * mtbf)) << d;
      EXPECT_EQ(steps, std::max<int64_t>(1, std::llround(interval / step))) << d;
      EXPECT_GE(d["expected_loss_s"].get<double>(), steps / 2.0 * step) << d;
      EXPECT_EQ(d["next_save_step"].get<int64_t>(), at + steps) << d;
      at += steps;
      if (at < 16) want.insert(at);
    }
    EXPECT_GE(at, 16) << "no derivation after the save at step " << at;
    if (mtbf_s > 1) {
      EXPECT_EQ(derived.size(), 1u);
    }
    std::set<int64_t> saved;
    for (const nlohmann::json& c : metrics_records(dir, "checkpoint")) saved.insert(c["step"].get<int64_t>());
    EXPECT_EQ(saved, want) << "mtbf_s " << mtbf_s;
    for (int64_t s : want) EXPECT_TRUE(fs::exists(dir + "/checkpoints/step_" + std::to_string(s))) << s;
    // A fresh run records no restart.
    EXPECT_TRUE(metrics_records(dir, "restart").empty());
    fs::remove_all(dir);
  }
}

// An attempt killed mid-write left a torn last line and no checkpoint: the
// next attempt starts over, ends that line before its own records (every
// later line parses) and records the restart, all 3 logged steps redone.
TEST(GoodputLedger, ARestartAfterATornLineStartsOnANewLineAndRecordsTheRestart) {
  const std::string dir = ckpt_scratch("torn_ledger");
  fs::create_directories(dir);
  {
    std::ofstream out(dir + "/metrics.jsonl");
    out << record_at(0, {{"event", "start"}, {"step", 0}, {"resumed_from", nullptr}});
    for (int s = 1; s <= 3; ++s) out << record_at(s, {{"step", s}, {"step_time_s", 0.5}, {"loss", 1.0}});
    out << "{\"step\": 4, \"lo";
  }
  auto cfg = base_config(dir);
  cfg.train.steps = 2;
  run_runtimes(1, [&](comm::Runtime& rt) {
    Trainer t(cfg, rt);
    EXPECT_EQ(t.run(), 0);
  });
  std::ifstream in(dir + "/metrics.jsonl");
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  ASSERT_GT(lines.size(), 6u);
  EXPECT_EQ(lines[4], "{\"step\": 4, \"lo");
  for (size_t i = 5; i < lines.size(); ++i) EXPECT_TRUE(nlohmann::json::accept(lines[i])) << lines[i];
  const std::vector<nlohmann::json> restarts = metrics_records(dir, "restart");
  ASSERT_EQ(restarts.size(), 1u);
  EXPECT_EQ(restarts[0]["step"].get<int64_t>(), 0);
  EXPECT_EQ(restarts[0]["redone_steps"].get<int64_t>(), 3);
  EXPECT_DOUBLE_EQ(restarts[0]["redone_s"].get<double>(), 1.5);
  fs::remove_all(dir);
}
