// save_state_dict / load_state_dict over real Gloo groups: failures are
// agreed by every rank, nothing half-committed, damaged checkpoints are
// refused with a message naming the checkpoint, the item and the file.
#include "checkpoint/format/checksum.h"
#include "checkpoint/load.h"
#include "checkpoint/format/metadata.h"
#include "checkpoint/save.h"
#include "checkpoint/async/manager.h"
#include "checkpoint/codec/chunk_reader.h"
#include "checkpoint/layout/checkpoint_dir.h"
#include "checkpoint/storage/memory.h"
#include "checkpoint/storage/storage.h"
#include "support/faulty_storage.h"
#include "support/multi_rank.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <fstream>
#include <mutex>

namespace fs = std::filesystem;
using namespace checkpoint;
using testing_support::RankContext;
using testing_support::run_ranks;

namespace {

std::string scratch(const std::string& tag) {
  auto dir = fs::temp_directory_path() / ("shardkit_sl_" + tag + "_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir.string();
}

torch::Tensor global_weight() { return torch::arange(6 * 5, torch::kFloat32).reshape({6, 5}) / 7; }
torch::Tensor global_bias() { return torch::arange(4, torch::kBFloat16); }

// Rank r of `world` holds rows of the weight torch.chunk-style and the whole
// (replicated) bias, plus a replicated bytes item.
StateDict rank_state(int rank, int world) {
  StateDict sd;
  int64_t chunk = (6 + world - 1) / world;
  int64_t lo = std::min<int64_t>(rank * chunk, 6), hi = std::min<int64_t>(lo + chunk, 6);
  sd.add_tensor("w", global_weight().narrow(0, lo, hi - lo).clone(), {6, 5}, {lo, 0});
  sd.add_tensor("b", global_bias().clone());
  sd.add_bytes("step", {7, 0, 0, 0});
  return sd;
}

void save_world(const std::string& dir, int world, std::shared_ptr<Storage> rank1_storage = nullptr,
                std::shared_ptr<Storage> storage = nullptr) {
  run_ranks(world, [&](RankContext& ctx) {
    auto g = ctx.make_group("ckpt");
    SaveOptions so;
    so.step = 7;
    so.layout = "test";
    so.compression.block_size = 16;  // several blocks per chunk
    so.storage = storage;
    if (ctx.rank == 1 && rank1_storage) so.storage = rank1_storage;
    save_state_dict(rank_state(ctx.rank, world), dir, *g, so);
  });
}

StateDict empty_like_state(int rank, int world) {
  StateDict sd = rank_state(rank, world);
  for (auto& t : sd.tensors()) t.local.zero_();
  sd.bytes()[0].data.clear();
  return sd;
}

std::string load_error(const std::string& dir, StateDict sd, LoadOptions lo = {}) {
  try {
    load_state_dict(sd, dir, lo);
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

void flip_byte(const std::string& path, uint64_t offset) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(static_cast<std::streamoff>(offset));
  char c;
  f.get(c);
  f.seekp(static_cast<std::streamoff>(offset));
  f.put(static_cast<char>(c ^ 0x5a));
}

}  // namespace

TEST(SaveLoad, RoundTripsAcrossWorldSizes) {
  std::string root = scratch("roundtrip");
  save_world(root + "/w2", 2);
  for (int world : {1, 3, 4}) {
    for (int r = 0; r < world; ++r) {
      StateDict sd = empty_like_state(r, world);
      load_state_dict(sd, root + "/w2", {});
      StateDict want = rank_state(r, world);
      EXPECT_TRUE(torch::equal(sd.tensors()[0].local, want.tensors()[0].local)) << world << "/" << r;
      EXPECT_TRUE(torch::equal(sd.tensors()[1].local, want.tensors()[1].local));
      EXPECT_EQ(sd.bytes()[0].data, want.bytes()[0].data);
    }
  }
  // Replicated data was written once: the bias has exactly one chunk.
  auto meta = read_committed_metadata(*posix_storage(), root + "/w2");
  EXPECT_EQ(meta.find("b")->chunks.size(), 1u);
  EXPECT_EQ(meta.find("w")->chunks.size(), 2u);
  fs::remove_all(root);
}

// The same protocol on the in-memory Storage: nothing touches the disk, and
// a world-2 checkpoint reshards to worlds 1, 3 and 4.
TEST(SaveLoad, RoundTripsAcrossWorldSizesOnTheMemoryStorage) {
  auto memory = memory_storage();
  const std::string dir = "/memory/w2/step_7";
  save_world(dir, 2, nullptr, memory);
  EXPECT_FALSE(fs::exists("/memory"));
  EXPECT_TRUE(memory->exists(join_path(dir, kMetadataFileName)));
  for (int world : {1, 3, 4}) {
    for (int r = 0; r < world; ++r) {
      StateDict sd = empty_like_state(r, world);
      LoadOptions lo;
      lo.storage = memory;
      load_state_dict(sd, dir, lo);
      StateDict want = rank_state(r, world);
      EXPECT_TRUE(torch::equal(sd.tensors()[0].local, want.tensors()[0].local)) << world << "/" << r;
      EXPECT_TRUE(torch::equal(sd.tensors()[1].local, want.tensors()[1].local));
      EXPECT_EQ(sd.bytes()[0].data, want.bytes()[0].data);
    }
  }
  EXPECT_TRUE(verify_checkpoint(*memory, dir).ok());
}

// The manager's discovery, retention and resume on the in-memory Storage:
// four saves with keep_last 2 leave steps 3 and 4, resume picks step 4, and
// it loads exactly.
TEST(SaveLoad, ManagerRetentionAndResumeRunOnTheMemoryStorage) {
  auto memory = memory_storage();
  CheckpointOptions options;
  options.dir = "/memory/ckpt";
  options.interval = 1;
  options.keep_last = 2;
  options.mode = checkpoint::SaveMode::kAsync;
  run_ranks(2, [&](RankContext& ctx) {
    auto g = ctx.make_group("ckpt");
    CheckpointManager manager(options, "", *g, "test", memory);
    for (int64_t step = 1; step <= 4; ++step) {
      StateDict sd = rank_state(ctx.rank, 2);
      sd.tensors()[0].local.add_(static_cast<float>(step));
      manager.save(step, std::move(sd));
    }
    manager.finish();
  });
  std::vector<int64_t> steps;
  for (const CheckpointEntry& e : list_checkpoints(*memory, "/memory/ckpt")) steps.push_back(e.step);
  EXPECT_EQ(steps, (std::vector<int64_t>{3, 4}));
  EXPECT_FALSE(fs::exists("/memory"));
  run_ranks(2, [&](RankContext& ctx) {
    auto g = ctx.make_group("ckpt");
    CheckpointOptions resume = options;
    resume.resume = "auto";
    CheckpointManager manager(resume, "", *g, "test", memory);
    StateDict sd = empty_like_state(ctx.rank, 2);
    const std::optional<ResumeResult> resumed = manager.resume(sd);
    ASSERT_TRUE(resumed.has_value());
    EXPECT_EQ(resumed->path, "/memory/ckpt/step_4");
    StateDict want = rank_state(ctx.rank, 2);
    want.tensors()[0].local.add_(4.0f);
    EXPECT_TRUE(torch::equal(sd.tensors()[0].local, want.tensors()[0].local)) << ctx.rank;
  });
}

// A storage whose remove_all of an existing path waits until the test
// releases it (or 20 s), or fails: retention made observable.
class GatedRemovals : public StorageWrapper {
 public:
  using StorageWrapper::StorageWrapper;
  void remove_all(const std::string& path) override {
    if (!exists(path)) return StorageWrapper::remove_all(path);  // nothing to delete
    if (fail) throw IoError::from_errno("cannot remove", path, EACCES);
    std::unique_lock<std::mutex> lock(mu);
    ++waiting;
    cv.notify_all();
    if (!cv.wait_for(lock, std::chrono::seconds(20), [&] { return released; })) timed_out = true;
    lock.unlock();
    StorageWrapper::remove_all(path);
  }
  void release() {
    std::lock_guard<std::mutex> lock(mu);
    released = true;
    cv.notify_all();
  }
  std::mutex mu;
  std::condition_variable cv;
  int waiting = 0;
  bool released = false;
  bool timed_out = false;
  bool fail = false;
};

TEST(SaveLoad, SyncSaveReturnsAtTheCommitWhileRetentionDeletesInTheBackground) {
  auto gated = std::make_shared<GatedRemovals>(memory_storage());
  CheckpointOptions options;
  options.dir = "/memory/ckpt";
  options.interval = 1;
  options.keep_last = 1;
  options.mode = checkpoint::SaveMode::kSync;
  auto steps_in = [&] {
    std::vector<int64_t> steps;
    for (const CheckpointEntry& e : list_checkpoints(*gated, "/memory/ckpt")) steps.push_back(e.step);
    return steps;
  };
  run_ranks(2, [&](RankContext& ctx) {
    auto g = ctx.make_group("ckpt");
    CheckpointManager manager(options, "", *g, "test", gated);
    manager.save(1, rank_state(ctx.rank, 2));
    manager.save(2, rank_state(ctx.rank, 2));  // retention of step 1 starts, and blocks
    g->barrier();
    if (ctx.rank == 0) {
      // save() returned with step 2 committed while the deletion of step 1
      // (renamed .deleting.step_1 first) is held in remove_all.
      {
        std::unique_lock<std::mutex> lock(gated->mu);
        EXPECT_TRUE(gated->cv.wait_for(lock, std::chrono::seconds(20), [&] { return gated->waiting > 0; }))
            << "retention never started";
        EXPECT_FALSE(gated->timed_out) << "save() waited for retention";
      }
      EXPECT_EQ(steps_in(), (std::vector<int64_t>{2}));
      EXPECT_TRUE(gated->exists("/memory/ckpt/step_2/.metadata"));
      EXPECT_TRUE(gated->exists("/memory/ckpt/.deleting.step_1")) << "deleted before release";
      gated->release();
    }
    manager.finish();  // waits for the deletion
    g->barrier();
    if (ctx.rank == 0) {
      EXPECT_EQ(steps_in(), (std::vector<int64_t>{2}));
      EXPECT_FALSE(gated->exists("/memory/ckpt/.deleting.step_1"));
    }
  });
  EXPECT_EQ(gated->waiting, 1);
}

// Retention that fails after a commit is not a failed save, in any mode: no
// save() or finish() throws on any rank (in async and overlap mode rank 0's
// next save used to throw "checkpoint of step N failed" alone, leaving the
// other rank in the save's collectives), every save's event is ok, and rank
// 0, which runs retention, reports each failure apart with its step.
TEST(SaveLoad, AFailedRetentionLeavesTheSaveCommittedAndIsReportedApartInEveryMode) {
  for (const std::string mode : {"sync", "async", "overlap"}) {
    SCOPED_TRACE("mode " + mode);
    auto gated = std::make_shared<GatedRemovals>(memory_storage());
    gated->fail = true;
    CheckpointOptions options;
    options.dir = "/memory/ckpt_" + mode;
    options.interval = 1;
    options.keep_last = 1;
    options.mode = parse_save_mode(mode);
    std::vector<std::string> errors(2);
    std::vector<std::vector<CheckpointEvent>> events(2);
    std::vector<std::vector<RetentionFailure>> failures(2);
    run_ranks(2, [&](RankContext& ctx) {
      auto g = ctx.make_group("ckpt");
      CheckpointManager manager(options, "", *g, "test", gated);
      try {
        for (int64_t step = 1; step <= 3; ++step) {
          manager.save(step, rank_state(ctx.rank, 2));
          manager.wait_staged();
        }
        manager.finish();
      } catch (const std::exception& e) {
        errors[ctx.rank] = e.what();
      }
      events[ctx.rank] = manager.take_events();
      failures[ctx.rank] = manager.take_retention_failures();
    });
    for (int r = 0; r < 2; ++r) {
      EXPECT_EQ(errors[r], "") << "rank " << r;
      ASSERT_EQ(events[r].size(), 3u) << "rank " << r;
      for (const CheckpointEvent& ev : events[r]) EXPECT_TRUE(ev.ok) << "step " << ev.step << ": " << ev.error;
    }
    EXPECT_TRUE(gated->exists(options.dir + "/step_3/.metadata"));
    // Retention after steps 2 and 3 failed, on rank 0 only.
    ASSERT_EQ(failures[0].size(), 2u);
    for (size_t i = 0; i < 2; ++i) {
      EXPECT_EQ(failures[0][i].step, static_cast<int64_t>(i + 2));
      EXPECT_EQ(failures[0][i].tier, "durable");
      EXPECT_NE(failures[0][i].error.find("Permission denied"), std::string::npos) << failures[0][i].error;
    }
    EXPECT_TRUE(failures[1].empty());
  }
}

TEST(SaveLoad, ARankThatFailsMakesEveryRankFailAndNothingIsCommitted) {
  std::string root = scratch("rankfail");
  save_world(root + "/good", 2);
  faults::FaultPlan plan;
  plan.fail_after_bytes = 0;
  auto failing = faults::fault_injecting_storage(posix_storage(), plan);
  std::vector<std::string> messages(2);
  run_ranks(2, [&](RankContext& ctx) {
    auto g = ctx.make_group("ckpt");
    SaveOptions so;
    so.step = 8;
    if (ctx.rank == 1) so.storage = failing;
    try {
      save_state_dict(rank_state(ctx.rank, 2), root + "/bad", *g, so);
    } catch (const CheckpointError& e) {
      messages[ctx.rank] = e.what();
    }
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(messages[r].find("rank 1"), std::string::npos) << messages[r];
    EXPECT_NE(messages[r].find("No space left on device"), std::string::npos) << messages[r];
    EXPECT_NE(messages[r].find("nothing was committed"), std::string::npos) << messages[r];
  }
  EXPECT_FALSE(fs::exists(root + "/bad/.metadata"));
  EXPECT_EQ(load_error(root + "/bad", empty_like_state(0, 1)).find("not a committed checkpoint"), 0u);
  // The previous checkpoint still loads.
  StateDict sd = empty_like_state(0, 1);
  load_state_dict(sd, root + "/good", {});
  EXPECT_TRUE(torch::equal(sd.tensors()[0].local, global_weight()));
  fs::remove_all(root);
}

// Plan caching: a second save of the same structure reuses the plan (one
// all-reduce) and writes byte-identical data files and the same metadata but
// for its creation time; a change on one rank, or a rank without the cached
// plan, makes every rank plan in full, and the result is still right.
TEST(SaveLoad, PlanCacheGivesIdenticalCheckpointsAndFallsBackOnAnyChange) {
  std::string root = scratch("plancache");
  const int world = 3;
  std::vector<std::vector<bool>> cached(world);
  run_ranks(world, [&](RankContext& ctx) {
    auto g = ctx.make_group("ckpt");
    auto cache = std::make_shared<SavePlanCache>();
    auto save = [&](const std::string& name, const StateDict& sd) {
      SaveOptions so;
      so.step = 7;
      so.layout = "test";
      so.compression.block_size = 16;
      so.plan_cache = cache;
      cached[ctx.rank].push_back(save_state_dict(sd, root + "/" + name, *g, so).plan_cached);
    };
    save("a", rank_state(ctx.rank, world));
    save("b", rank_state(ctx.rank, world));
    // Rank 2 alone holds one more item.
    StateDict changed = rank_state(ctx.rank, world);
    if (ctx.rank == 2) changed.add_bytes("rank2_extra", {1, 2, 3});
    save("c", changed);
    save("d", changed);
    // Rank 1 alone lost its cache.
    if (ctx.rank == 1) *cache = SavePlanCache{};
    save("e", changed);
    save("f", changed);
    EXPECT_EQ(cache->hits, ctx.rank == 1 ? 1 : 3);  // rank 1's count restarted with its cache
  });
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(cached[r], (std::vector<bool>{false, true, false, true, false, true})) << "rank " << r;
  }
  auto bytes_of = [](const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  for (auto [full, reused] : {std::pair{"a", "b"}, std::pair{"c", "d"}, std::pair{"e", "f"}}) {
    for (int r = 0; r < world; ++r) {
      const std::string file = "/rank_" + std::to_string(r) + ".data";
      EXPECT_EQ(bytes_of(root + "/" + full + file), bytes_of(root + "/" + reused + file)) << reused << file;
    }
    CheckpointMeta a = read_committed_metadata(*posix_storage(), root + "/" + full);
    CheckpointMeta b = read_committed_metadata(*posix_storage(), root + "/" + reused);
    b.created_unix_s = a.created_unix_s;
    EXPECT_EQ(a, b) << reused;
  }
  // The new item is in the checkpoints planned after it appeared.
  CheckpointMeta d = read_committed_metadata(*posix_storage(), root + "/d");
  const ItemMeta* extra = d.find("rank2_extra");
  ASSERT_NE(extra, nullptr);
  ASSERT_EQ(extra->chunks.size(), 1u);
  EXPECT_EQ(extra->chunks[0].writer_rank, 2);
  StateDict sd = empty_like_state(0, 1);
  LoadOptions lo;
  lo.allow_partial = true;
  load_state_dict(sd, root + "/f", lo);
  EXPECT_TRUE(torch::equal(sd.tensors()[0].local, global_weight()));
  fs::remove_all(root);
}

// Version-1 checkpoints (written before the indexed metadata) still load,
// resharded, read whole; a version-2 load reads only part of the metadata.
TEST(SaveLoad, VersionOneCheckpointsStillLoadAndVersionTwoIsReadInPart) {
  std::string root = scratch("v1");
  save_world(root + "/v2", 3);
  save_world(root + "/v1", 3);
  const std::string path = root + "/v1/.metadata";
  const std::vector<uint8_t> v1 = encode_metadata(read_committed_metadata(*posix_storage(), root + "/v1"), 1);
  std::ofstream(path, std::ios::binary | std::ios::trunc)
      .write(reinterpret_cast<const char*>(v1.data()), static_cast<std::streamsize>(v1.size()));
  EXPECT_EQ(read_committed_metadata(*posix_storage(), root + "/v1").format_version, 1u);
  EXPECT_EQ(read_committed_metadata(*posix_storage(), root + "/v2").format_version, 2u);
  for (const char* version : {"v1", "v2"}) {
    for (int world : {1, 2}) {
      for (int rank = 0; rank < world; ++rank) {
        StateDict sd = empty_like_state(rank, world);
        const LoadStats stats = load_state_dict(sd, root + "/" + version, {});
        EXPECT_TRUE(torch::equal(sd.tensors()[0].local, rank_state(rank, world).tensors()[0].local))
            << version << " world " << world << " rank " << rank;
        EXPECT_EQ(sd.bytes()[0].data, rank_state(rank, world).bytes()[0].data);
        const uint64_t file = fs::file_size(root + "/" + version + "/.metadata");
        if (std::string(version) == "v1") {
          EXPECT_EQ(stats.metadata_bytes_read, file);
        } else {
          EXPECT_GT(stats.metadata_bytes_read, 0u);
          EXPECT_LE(stats.metadata_bytes_read, file);
        }
      }
    }
  }
  fs::remove_all(root);
}

TEST(SaveLoad, AFlippedDataByteIsDetectedNamingItemAndFile) {
  std::string root = scratch("flip");
  save_world(root + "/c", 2);
  auto meta = read_committed_metadata(*posix_storage(), root + "/c");
  const ChunkMeta& chunk = meta.find("w")->chunks[1];
  flip_byte(root + "/c/" + chunk.file, chunk.offset + 3);
  std::string err = load_error(root + "/c", empty_like_state(0, 1));
  EXPECT_NE(err.find("checksum mismatch"), std::string::npos) << err;
  EXPECT_NE(err.find("'w'"), std::string::npos) << err;
  EXPECT_NE(err.find(chunk.file), std::string::npos) << err;
  EXPECT_NE(err.find(root + "/c"), std::string::npos) << err;
  fs::remove_all(root);
}

TEST(SaveLoad, TruncatedOrMissingDataFilesAreNamed) {
  std::string root = scratch("trunc");
  save_world(root + "/c", 2);
  fs::resize_file(root + "/c/rank_1.data", fs::file_size(root + "/c/rank_1.data") / 2);
  std::string err = load_error(root + "/c", empty_like_state(0, 1));
  EXPECT_NE(err.find("rank_1.data"), std::string::npos) << err;
  EXPECT_NE(err.find("truncated"), std::string::npos) << err;
  fs::remove(root + "/c/rank_1.data");
  err = load_error(root + "/c", empty_like_state(0, 1));
  EXPECT_NE(err.find("rank_1.data"), std::string::npos) << err;
  fs::remove_all(root);
}

TEST(SaveLoad, UncommittedCheckpointIsNeverLoaded) {
  std::string root = scratch("uncommitted");
  save_world(root + "/c", 2);
  fs::rename(root + "/c/.metadata", root + "/c/.metadata.tmp");
  std::string err = load_error(root + "/c", empty_like_state(0, 1));
  EXPECT_NE(err.find("not a committed checkpoint"), std::string::npos) << err;
  fs::remove_all(root);
}

TEST(SaveLoad, DtypeAndShapeMismatchesNameTheItem) {
  std::string root = scratch("mismatch");
  save_world(root + "/c", 1);
  StateDict wrong_dtype;
  wrong_dtype.add_tensor("w", torch::zeros({6, 5}, torch::kFloat64));
  wrong_dtype.add_tensor("b", torch::zeros({4}, torch::kBFloat16));
  wrong_dtype.add_bytes("step", {});
  std::string err = load_error(root + "/c", std::move(wrong_dtype));
  EXPECT_NE(err.find("dtype mismatch for item 'w'"), std::string::npos) << err;
  EXPECT_NE(err.find("float32"), std::string::npos) << err;
  StateDict wrong_shape;
  wrong_shape.add_tensor("w", torch::zeros({5, 6}));
  wrong_shape.add_tensor("b", torch::zeros({4}, torch::kBFloat16));
  wrong_shape.add_bytes("step", {});
  err = load_error(root + "/c", std::move(wrong_shape));
  EXPECT_NE(err.find("shape mismatch for item 'w'"), std::string::npos) << err;
  EXPECT_NE(err.find("[6, 5]"), std::string::npos) << err;
  fs::remove_all(root);
}

TEST(SaveLoad, StrictLoadingListsMissingAndUnexpectedKeys) {
  std::string root = scratch("strict");
  save_world(root + "/c", 1);
  StateDict sd;
  sd.add_tensor("w", torch::zeros({6, 5}));
  sd.add_tensor("extra", torch::zeros({2}));
  std::string err = load_error(root + "/c", sd);
  EXPECT_NE(err.find("missing keys: extra"), std::string::npos) << err;
  EXPECT_NE(err.find("unexpected keys: b, step"), std::string::npos) << err;
  LoadOptions partial;
  partial.allow_partial = true;
  auto stats = load_state_dict(sd, root + "/c", partial);
  EXPECT_EQ(stats.missing, std::vector<std::string>{"extra"});
  EXPECT_TRUE(torch::equal(sd.tensors()[0].local, global_weight()));
  // A filter (model-only loading) ignores everything else.
  StateDict only_w;
  only_w.add_tensor("w", torch::zeros({6, 5}));
  LoadOptions filtered;
  filtered.filter = [](const std::string& n) { return n == "w"; };
  load_state_dict(only_w, root + "/c", filtered);
  EXPECT_TRUE(torch::equal(only_w.tensors()[0].local, global_weight()));
  fs::remove_all(root);
}

TEST(SaveLoad, MetadataPathThatEscapesTheDirectoryIsRefused) {
  std::string root = scratch("escape");
  save_world(root + "/c", 1);
  // Rewrite the data file name inside the committed metadata (as version 1,
  // whose only checksum is the trailer), fixing up the trailing checksum so
  // only the path check can catch it. (Version 2's record checksums: the
  // partial reader's own tests in test_metadata.cpp.)
  std::string path = root + "/c/.metadata";
  std::vector<uint8_t> v1 = encode_metadata(read_committed_metadata(*posix_storage(), root + "/c"), 1);
  std::string bytes(v1.begin(), v1.end());
  size_t at = bytes.find("rank_0.data");
  ASSERT_NE(at, std::string::npos);
  bytes.replace(at, 11, "../../x.dat");
  uint64_t sum = xxh3_64(bytes.data(), bytes.size() - 8);
  for (int i = 0; i < 8; ++i) bytes[bytes.size() - 8 + i] = static_cast<char>(sum >> (8 * i));
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
  std::string err = load_error(root + "/c", empty_like_state(0, 1));
  EXPECT_NE(err.find("../../x.dat"), std::string::npos) << err;
  EXPECT_NE(err.find(path), std::string::npos) << err;
  fs::remove_all(root);
}

TEST(SaveLoad, CompressedCheckpointReshardsLikeAnUncompressedOne) {
  std::string root = scratch("zstd");
  run_ranks(2, [&](RankContext& ctx) {
    auto g = ctx.make_group("ckpt");
    SaveOptions so;
    so.compression.codec = checkpoint::Codec::kZstd;
    so.compression.block_size = 24;
    save_state_dict(rank_state(ctx.rank, 2), root + "/z", *g, so);
  });
  auto meta = read_committed_metadata(*posix_storage(), root + "/z");
  EXPECT_EQ(meta.find("w")->chunks[0].transforms,
            (std::vector<std::string>{"signrot/1", "bytegroup/1", "zstdplanes/1"}));
  for (int r = 0; r < 3; ++r) {
    StateDict sd = empty_like_state(r, 3);
    load_state_dict(sd, root + "/z", {});
    EXPECT_TRUE(torch::equal(sd.tensors()[0].local, rank_state(r, 3).tensors()[0].local));
  }
  fs::remove_all(root);
}
