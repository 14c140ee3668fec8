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
#include "framework/train/state_dict.h"
#include "framework/train/trainer.h"
#include "support/multi_rank.h"
#include "support/trainer_state.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <map>

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
