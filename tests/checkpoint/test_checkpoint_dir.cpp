// The checkpoint.dir layout: canonical step names, discovery that trusts no
// name, retention that never deletes the newest or an in-progress checkpoint,
// and resume resolution.
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "checkpoint/layout/checkpoint_dir.h"
#include "checkpoint/storage/memory.h"
#include "checkpoint/format/metadata.h"

namespace checkpoint {
namespace {

namespace fs = std::filesystem;

class TempDir {
 public:
  TempDir() {
    std::string pattern = (fs::temp_directory_path() / "shardkit-ckptdir-XXXXXX").string();
    if (mkdtemp(pattern.data()) == nullptr) {
      throw std::runtime_error(std::string("mkdtemp: ") + std::strerror(errno));
    }
    path_ = pattern;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  const fs::path& path() const { return path_; }
  std::string str() const { return path_.string(); }

 private:
  fs::path path_;
};

void write_file(const fs::path& path, size_t bytes) {
  std::ofstream out(path, std::ios::binary);
  out << std::string(bytes, 'x');
}

// A step directory with one data file of `bytes`, committed or not.
fs::path make_step(const fs::path& root, int64_t step, bool committed, size_t bytes = 100) {
  const fs::path dir = root / step_dir_name(step);
  fs::create_directories(dir);
  write_file(dir / "rank_0.data", bytes);
  if (committed) write_file(dir / kMetadataFileName, 32);
  return dir;
}

std::vector<int64_t> steps_of(const std::vector<CheckpointEntry>& entries) {
  std::vector<int64_t> steps;
  for (const CheckpointEntry& e : entries) steps.push_back(e.step);
  return steps;
}

CheckpointEntry entry(int64_t step, bool committed) {
  CheckpointEntry e;
  e.step = step;
  e.path = "/ckpt/" + step_dir_name(step);
  e.committed = committed;
  return e;
}

TEST(StepDirName, FormatsAndParsesCanonicalNames) {
  EXPECT_EQ(step_dir_name(0), "step_0");
  EXPECT_EQ(step_dir_name(120), "step_120");
  EXPECT_EQ(parse_step_dir_name("step_0"), 0);
  EXPECT_EQ(parse_step_dir_name("step_120"), 120);
  EXPECT_EQ(parse_step_dir_name("step_9223372036854775807"), INT64_MAX);
  EXPECT_THROW(step_dir_name(-1), std::invalid_argument);
}

TEST(StepDirName, HostileNamesAreNotSteps) {
  for (const char* name :
       {"step_", "step_x", "step_-1", "step_+1", "step_01", "step_00", "step_1a", "step_1 ",
        " step_1", "Step_1", "step1", "step_1.tmp", "step_9223372036854775808",
        "step_99999999999999999999999", ""}) {
    EXPECT_FALSE(parse_step_dir_name(name).has_value()) << "'" << name << "'";
  }
  EXPECT_FALSE(parse_step_dir_name(std::string("step_1\0", 7)).has_value());
}

TEST(ListCheckpoints, MissingDirectoryIsEmpty) {
  TempDir tmp;
  EXPECT_TRUE(list_checkpoints(*posix_storage(), (tmp.path() / "nope").string()).empty());
  EXPECT_FALSE(latest_committed(*posix_storage(), (tmp.path() / "nope").string()).has_value());
}

TEST(ListCheckpoints, AFileInPlaceOfTheDirectoryIsAnErrorNamingIt) {
  TempDir tmp;
  write_file(tmp.path() / "file", 1);
  try {
    list_checkpoints(*posix_storage(), (tmp.path() / "file").string());
    FAIL() << "expected an error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find((tmp.path() / "file").string()), std::string::npos) << e.what();
  }
}

TEST(ListCheckpoints, FindsCommittedAndIncompleteStepsAndIgnoresJunk) {
  TempDir tmp;
  TempDir outside;
  make_step(tmp.path(), 10, true, 100);
  make_step(tmp.path(), 2, true, 50);
  make_step(tmp.path(), 30, false, 7);
  // Junk that must never count as a checkpoint.
  fs::create_directories(tmp.path() / "step_x");
  fs::create_directories(tmp.path() / "step_-1");
  fs::rename(make_step(tmp.path(), 5, true), tmp.path() / "step_05");
  fs::create_directories(tmp.path() / "step_99999999999999999999");
  write_file(tmp.path() / "step_6", 10);                       // a file, not a directory
  make_step(outside.path(), 7, true);                           // a committed checkpoint elsewhere
  fs::create_directory_symlink(outside.path() / "step_7", tmp.path() / "step_7");
  fs::create_directories(tmp.path() / "other");
  write_file(tmp.path() / "README", 3);

  const std::vector<CheckpointEntry> entries = list_checkpoints(*posix_storage(), tmp.str());
  ASSERT_EQ(steps_of(entries), (std::vector<int64_t>{2, 10, 30}));
  EXPECT_TRUE(entries[0].committed);
  EXPECT_TRUE(entries[1].committed);
  EXPECT_FALSE(entries[2].committed);
  EXPECT_EQ(entries[0].bytes, 50u + 32u);
  EXPECT_EQ(entries[1].bytes, 100u + 32u);
  EXPECT_EQ(entries[2].bytes, 7u);
  EXPECT_EQ(entries[1].path, (tmp.path() / "step_10").string());
  EXPECT_GT(entries[1].mtime_unix_s, 1600000000);

  const std::optional<CheckpointEntry> latest = latest_committed(*posix_storage(), tmp.str());
  ASSERT_TRUE(latest.has_value());
  EXPECT_EQ(latest->step, 10);  // step_30 is incomplete
}

TEST(ListCheckpoints, ASymlinkedMetadataDoesNotCommit) {
  TempDir tmp;
  const fs::path dir = make_step(tmp.path(), 3, false);
  write_file(tmp.path() / "elsewhere", 32);
  fs::create_symlink(tmp.path() / "elsewhere", dir / kMetadataFileName);
  const std::vector<CheckpointEntry> entries = list_checkpoints(*posix_storage(), tmp.str());
  ASSERT_EQ(entries.size(), 1u);
  EXPECT_FALSE(entries[0].committed);
}

TEST(SetAsideDirName, ParsesWhatResumeSetsAsideAndNothingElse) {
  EXPECT_EQ(parse_set_aside_dir_name("step_6.damaged"), 6);
  EXPECT_EQ(parse_set_aside_dir_name("step_6.damaged.1"), 6);
  EXPECT_EQ(parse_set_aside_dir_name("step_0.damaged.12"), 0);
  EXPECT_EQ(parse_set_aside_dir_name(step_dir_name(40) + kSetAsideSuffix), 40);
  for (const char* name : {"step_6", "step_6.damaged.", "step_6.damaged.0", "step_6.damaged.01",
                           "step_6.damaged.x", "step_6.damagedx", "step_06.damaged", "step_.damaged",
                           "step_x.damaged", ".damaged", "step_6.damaged.1.2", "step_6.tmp", ""}) {
    EXPECT_FALSE(parse_set_aside_dir_name(name).has_value()) << "'" << name << "'";
  }
}

// A .metadata that read_committed_metadata accepts.
void write_valid_metadata(Storage& storage, const std::string& dir, int64_t step) {
  CheckpointMeta meta;
  meta.step = step;
  meta.world_size = 1;
  storage.write_file_atomic(join_path(dir, kMetadataFileName), encode_metadata(meta));
}

TEST(CheckpointStatus, CommittedOnlyWhenTheMetadataReadsBack) {
  auto storage = memory_storage();
  const std::string root = "/runs/ckpt";
  for (int64_t step : {1, 2, 3, 4}) {
    storage->make_dirs(join_path(root, step_dir_name(step)));
    storage->write_file_atomic(join_path(root, step_dir_name(step) + "/rank_0.data"), {1, 2, 3});
  }
  write_valid_metadata(*storage, join_path(root, "step_1"), 1);
  write_valid_metadata(*storage, join_path(root, "step_2"), 2);
  std::vector<uint8_t> bytes = storage->read_file(join_path(root, "step_2/.metadata"), 1 << 20);
  bytes.resize(bytes.size() - 1);  // truncated
  storage->write_file_atomic(join_path(root, "step_2/.metadata"), bytes);
  write_valid_metadata(*storage, join_path(root, "step_3"), 3);
  bytes = storage->read_file(join_path(root, "step_3/.metadata"), 1 << 20);
  bytes.back() ^= 0x01;  // one bit flipped
  storage->write_file_atomic(join_path(root, "step_3/.metadata"), bytes);
  // step_4: no .metadata. Set aside by resume, twice, plus names it never makes.
  for (const char* name : {"step_3.damaged.1", "step_3.damaged", "step_3.damaged.0", "step_03.damaged"}) {
    storage->make_dirs(join_path(root, name));
  }
  storage->write_file_atomic(join_path(root, "step_9.damaged"), {1});  // a file, not a directory

  const std::vector<CheckpointStatusEntry> statuses = list_checkpoints_with_status(*storage, root);
  std::vector<std::pair<std::string, std::string>> seen;
  for (const CheckpointStatusEntry& s : statuses) {
    seen.emplace_back(s.entry.path.substr(root.size() + 1), checkpoint_status_name(s.status));
  }
  EXPECT_EQ(seen, (std::vector<std::pair<std::string, std::string>>{{"step_1", "committed"},
                                                                    {"step_2", "damaged"},
                                                                    {"step_3", "damaged"},
                                                                    {"step_3.damaged", "set-aside"},
                                                                    {"step_3.damaged.1", "set-aside"},
                                                                    {"step_4", "uncommitted"}}));
  ASSERT_EQ(statuses.size(), 6u);
  EXPECT_EQ(statuses[0].error, "");
  EXPECT_NE(statuses[1].error.find(join_path(root, "step_2/.metadata")), std::string::npos) << statuses[1].error;
  EXPECT_NE(statuses[2].error.find(join_path(root, "step_3/.metadata")), std::string::npos) << statuses[2].error;
  EXPECT_EQ(statuses[3].entry.step, 3);
  EXPECT_EQ(statuses[5].error, "");
  EXPECT_EQ(statuses[0].entry.bytes, 3u + storage->stat(join_path(root, "step_1/.metadata")).size);

  // Discovery, retention and resume still go by the commit marker: the
  // damaged step_3 is the latest committed, so resume tries it (and, with
  // checkpoint.resume_fallback, sets it aside) instead of silently skipping
  // it; set-aside directories are never checkpoints.
  EXPECT_EQ(latest_committed(*storage, root)->step, 3);
  EXPECT_EQ(steps_of(list_checkpoints(*storage, root)), (std::vector<int64_t>{1, 2, 3, 4}));
}

TEST(CheckpointStatus, AnEntryWhoseMetadataVanishedIsUncommittedNotDamaged) {
  auto storage = memory_storage();
  storage->make_dirs("/c/step_5");
  write_valid_metadata(*storage, "/c/step_5", 5);
  const std::vector<CheckpointEntry> entries = list_checkpoints(*storage, "/c");
  ASSERT_EQ(entries.size(), 1u);
  storage->remove_all("/c/step_5/.metadata");  // e.g. retention got there first
  const CheckpointStatusEntry s = checkpoint_status(*storage, entries[0]);
  EXPECT_EQ(s.status, CheckpointStatus::kUncommitted);
  EXPECT_EQ(s.error, "");
}

TEST(RetentionVictims, KeepLastTable) {
  const std::vector<CheckpointEntry> entries = {entry(40, true), entry(10, true), entry(30, true),
                                                entry(20, true)};
  EXPECT_TRUE(retention_victims(entries, 0).empty());
  EXPECT_EQ(steps_of(retention_victims(entries, 1)), (std::vector<int64_t>{10, 20, 30}));
  EXPECT_EQ(steps_of(retention_victims(entries, 2)), (std::vector<int64_t>{10, 20}));
  EXPECT_EQ(steps_of(retention_victims(entries, 3)), (std::vector<int64_t>{10}));
  EXPECT_TRUE(retention_victims(entries, 4).empty());
  EXPECT_TRUE(retention_victims(entries, 100).empty());
  EXPECT_TRUE(retention_victims({}, 1).empty());
  EXPECT_THROW(retention_victims(entries, -1), std::invalid_argument);
}

TEST(RetentionVictims, AnUncommittedNewestIsNeitherCountedNorDeleted) {
  // step 50 may still be being written: the newest committed (40) must stay.
  const std::vector<CheckpointEntry> entries = {entry(10, true), entry(20, false), entry(30, true),
                                                entry(40, true), entry(50, false)};
  EXPECT_EQ(steps_of(retention_victims(entries, 1)), (std::vector<int64_t>{10, 30}));
  EXPECT_EQ(steps_of(retention_victims(entries, 2)), (std::vector<int64_t>{10}));
  EXPECT_TRUE(retention_victims(entries, 3).empty());
}

TEST(RetentionVictims, TheProtectedStepIsNeverAVictim) {
  const std::vector<CheckpointEntry> entries = {entry(10, true), entry(20, true), entry(30, true)};
  EXPECT_EQ(steps_of(retention_victims(entries, 1, 20)), (std::vector<int64_t>{10}));
  EXPECT_EQ(steps_of(retention_victims(entries, 1, 30)), (std::vector<int64_t>{10, 20}));
  EXPECT_EQ(steps_of(retention_victims(entries, 1, 99)), (std::vector<int64_t>{10, 20}));
  EXPECT_TRUE(retention_victims(entries, 2, 10).empty());
}

TEST(ApplyRetention, DeletesExactlyTheVictims) {
  TempDir tmp;
  for (int64_t step : {10, 20, 30, 40}) make_step(tmp.path(), step, true);
  make_step(tmp.path(), 50, false);
  fs::create_directories(tmp.path() / "step_x");
  apply_retention(*posix_storage(), tmp.str(), 2, std::nullopt);
  EXPECT_EQ(steps_of(list_checkpoints(*posix_storage(), tmp.str())), (std::vector<int64_t>{30, 40, 50}));
  EXPECT_TRUE(fs::exists(tmp.path() / "step_x"));
  // Nothing is left behind besides what was there.
  size_t n = 0;
  for (const auto& e : fs::directory_iterator(tmp.path())) {
    (void)e;
    ++n;
  }
  EXPECT_EQ(n, 4u);
}

TEST(ApplyRetention, KeepAllAndProtectDeleteNothingExtra) {
  TempDir tmp;
  for (int64_t step : {1, 2, 3}) make_step(tmp.path(), step, true);
  apply_retention(*posix_storage(), tmp.str(), 0, std::nullopt);
  EXPECT_EQ(steps_of(list_checkpoints(*posix_storage(), tmp.str())), (std::vector<int64_t>{1, 2, 3}));
  apply_retention(*posix_storage(), tmp.str(), 1, 2);
  EXPECT_EQ(steps_of(list_checkpoints(*posix_storage(), tmp.str())), (std::vector<int64_t>{2, 3}));
}

TEST(ApplyRetention, SweepsLeftoversOfAnInterruptedDeletion) {
  TempDir tmp;
  make_step(tmp.path(), 1, true);
  fs::rename(make_step(tmp.path(), 0, true), tmp.path() / ".deleting.step_0");
  fs::create_directories(tmp.path() / ".deleting.notours");
  apply_retention(*posix_storage(), tmp.str(), 1, std::nullopt);
  EXPECT_FALSE(fs::exists(tmp.path() / ".deleting.step_0"));
  EXPECT_TRUE(fs::exists(tmp.path() / ".deleting.notours"));
  EXPECT_EQ(steps_of(list_checkpoints(*posix_storage(), tmp.str())), (std::vector<int64_t>{1}));
}

TEST(ApplyRetention, AMissingDirectoryIsNothingToDo) {
  TempDir tmp;
  EXPECT_NO_THROW(apply_retention(*posix_storage(), (tmp.path() / "nope").string(), 1, std::nullopt));
}

TEST(ResolveResume, AutoPicksTheLatestCommitted) {
  TempDir tmp;
  EXPECT_FALSE(resolve_resume(*posix_storage(), "auto", tmp.str()).has_value());
  EXPECT_FALSE(resolve_resume(*posix_storage(), "auto", (tmp.path() / "missing").string()).has_value());
  make_step(tmp.path(), 4, true);
  make_step(tmp.path(), 8, true);
  make_step(tmp.path(), 12, false);
  EXPECT_EQ(resolve_resume(*posix_storage(), "auto", tmp.str()), (tmp.path() / "step_8").string());
  EXPECT_FALSE(resolve_resume(*posix_storage(), "never", tmp.str()).has_value());
}

TEST(ResolveResume, AnExplicitPathMustBeACommittedCheckpoint) {
  TempDir tmp;
  const std::string committed = make_step(tmp.path(), 4, true).string();
  const std::string incomplete = make_step(tmp.path(), 8, false).string();
  const std::string missing = (tmp.path() / "step_99").string();
  EXPECT_EQ(resolve_resume(*posix_storage(), committed, "/unused"), committed);

  auto expect_error = [](const std::string& path, const std::string& why) {
    try {
      resolve_resume(*posix_storage(), path, "/unused");
      FAIL() << "expected an error for " << path;
    } catch (const std::runtime_error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find(path), std::string::npos) << msg;
      EXPECT_NE(msg.find(why), std::string::npos) << msg;
    }
  };
  expect_error(missing, "no such");
  expect_error(incomplete, "not a committed checkpoint");
  expect_error(incomplete + "/rank_0.data", "not a directory");
}

// Discovery, retention and resume on the in-memory Storage: the same rules as
// on POSIX, with no file system involved.
void make_memory_step(Storage& storage, const std::string& root, int64_t step, bool committed) {
  const std::string dir = join_path(root, step_dir_name(step));
  storage.make_dirs(dir);
  storage.write_file_atomic(join_path(dir, "rank_0.data"), std::vector<uint8_t>(10, 1));
  if (committed) storage.write_file_atomic(join_path(dir, kMetadataFileName), {1});
}

TEST(MemoryStorage, DiscoveryRetentionAndResumeFollowTheSameRules) {
  auto storage = memory_storage();
  const std::string root = "/runs/ckpt";
  EXPECT_TRUE(list_checkpoints(*storage, root).empty());
  EXPECT_FALSE(resolve_resume(*storage, "auto", root).has_value());
  for (int64_t step : {10, 20, 30, 40}) make_memory_step(*storage, root, step, true);
  make_memory_step(*storage, root, 50, false);
  storage->make_dirs(join_path(root, "step_x"));
  storage->write_file_atomic(join_path(root, "step_60"), {1});  // a file, not a checkpoint
  const std::vector<CheckpointEntry> entries = list_checkpoints(*storage, root);
  EXPECT_EQ(steps_of(entries), (std::vector<int64_t>{10, 20, 30, 40, 50}));
  EXPECT_EQ(entries[0].bytes, 11u);
  EXPECT_FALSE(entries[4].committed);
  EXPECT_EQ(latest_committed(*storage, root)->step, 40);
  EXPECT_EQ(resolve_resume(*storage, "auto", root), join_path(root, "step_40"));

  apply_retention(*storage, root, 2, std::nullopt);
  EXPECT_EQ(steps_of(list_checkpoints(*storage, root)), (std::vector<int64_t>{30, 40, 50}));
  EXPECT_EQ(storage->list_dir(root),
            (std::vector<std::string>{"step_30", "step_40", "step_50", "step_60", "step_x"}));
  try {
    resolve_resume(*storage, join_path(root, "step_50"), root);
    FAIL() << "an uncommitted checkpoint was accepted";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("not a committed checkpoint"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace checkpoint
