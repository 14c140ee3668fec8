// The storage interface: the POSIX implementation, and fault injection that
// behaves like a full disk or a failing device.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <thread>

#include <unistd.h>

#include "checkpoint/storage/storage.h"
#include "support/faulty_storage.h"

namespace checkpoint {
namespace {

std::string make_temp_dir(const std::string& tag) {
  std::string templ = ::testing::TempDir() + "/" + tag + "_XXXXXX";
  if (::mkdtemp(templ.data()) == nullptr) throw std::runtime_error("mkdtemp failed for " + templ);
  return templ;
}

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const IoError& e) {
    return e.what();
  }
  return "";
}

class StorageTest : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = make_temp_dir("storage"); }
  void TearDown() override { posix_storage()->remove_all(dir_); }

  std::vector<uint8_t> read_all(const std::string& path) {
    return posix_storage()->read_file(path, 1 << 20);
  }

  std::string dir_;
};

TEST_F(StorageTest, PosixStorageWritesReadsListsRenamesAndRemoves) {
  auto fs = posix_storage();
  fs->make_dirs(dir_ + "/a/b");
  fs->make_dirs(dir_ + "/a/b");  // existing is fine
  const std::string path = dir_ + "/a/b/rank_0.data";
  auto file = fs->create_file(path);
  file->append("hello ", 6);
  file->append("world", 5);
  file->write_at(0, "J", 1);
  file->sync();
  file->close();
  file->close();  // idempotent
  EXPECT_EQ(fs->file_size(path), 11u);
  char buf[5];
  fs->read_at(path, 6, buf, 5);
  EXPECT_EQ(std::string(buf, 5), "world");
  EXPECT_EQ(read_all(path), (std::vector<uint8_t>{'J', 'e', 'l', 'l', 'o', ' ', 'w', 'o', 'r', 'l', 'd'}));

  fs->create_file(dir_ + "/a/b/c.data")->close();
  EXPECT_EQ(fs->list_dir(dir_ + "/a/b"), (std::vector<std::string>{"c.data", "rank_0.data"}));
  fs->rename(path, dir_ + "/a/b/renamed");
  fs->sync_dir(dir_ + "/a/b");
  EXPECT_FALSE(fs->exists(path));
  EXPECT_TRUE(fs->exists(dir_ + "/a/b/renamed"));
  fs->remove_all(dir_ + "/a");
  EXPECT_FALSE(fs->exists(dir_ + "/a"));
  fs->remove_all(dir_ + "/a");  // missing is fine
}

TEST_F(StorageTest, ReadingPastTheEndSaysTruncatedAndNamesTheFile) {
  const std::string path = dir_ + "/short.data";
  posix_storage()->write_file_atomic(path, std::vector<uint8_t>(10, 1));
  char buf[8];
  EXPECT_EQ(error_of([&] { posix_storage()->read_at(path, 5, buf, 8); }),
            "truncated: " + path + " has 10 bytes, needed 13");
}

TEST_F(StorageTest, IoErrorsCarryThePathAndStrerror) {
  const std::string path = dir_ + "/missing.data";
  char buf[1];
  try {
    posix_storage()->read_at(path, 0, buf, 1);
    FAIL() << "no error";
  } catch (const IoError& e) {
    EXPECT_EQ(std::string(e.what()), "cannot open " + path + ": " + std::strerror(ENOENT));
    EXPECT_EQ(e.error_number(), ENOENT);
  }
  EXPECT_NE(error_of([&] { posix_storage()->create_file(dir_ + "/no/such/dir/x"); })
                .find("No such file or directory"),
            std::string::npos);
}

TEST_F(StorageTest, WriteFileAtomicReplacesTheFileAndLeavesNoTemporary) {
  const std::string path = dir_ + "/.metadata";
  posix_storage()->write_file_atomic(path, {1, 2, 3});
  posix_storage()->write_file_atomic(path, {4, 5});
  EXPECT_EQ(read_all(path), (std::vector<uint8_t>{4, 5}));
  EXPECT_EQ(posix_storage()->list_dir(dir_), (std::vector<std::string>{".metadata"}));
}

TEST_F(StorageTest, FullDiskStoresWhatFitsThenFailsWithEnospc) {
  faults::FaultPlan plan;
  plan.fail_after_bytes = 100;
  auto fs = faults::fault_injecting_storage(posix_storage(), plan);
  const std::string path = dir_ + "/rank_0.data";
  auto file = fs->create_file(path);
  const std::vector<uint8_t> block(60, 7);
  file->append(block.data(), block.size());
  try {
    file->append(block.data(), block.size());
    FAIL() << "the write crossing the limit succeeded";
  } catch (const IoError& e) {
    EXPECT_EQ(e.error_number(), ENOSPC);
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(std::strerror(ENOSPC)), std::string::npos) << e.what();
  }
  EXPECT_THROW(file->write_at(0, block.data(), 1), IoError);  // the disk stays full
  file->close();
  EXPECT_EQ(posix_storage()->file_size(path), 100u);
}

TEST_F(StorageTest, FullDiskCountsBytesExactlyAcrossThreads) {
  faults::FaultPlan plan;
  plan.fail_after_bytes = 5000;
  auto fs = faults::fault_injecting_storage(posix_storage(), plan);
  auto file = fs->create_file(dir_ + "/rank_0.data");
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      const std::vector<uint8_t> bytes(10, static_cast<uint8_t>(t));
      for (int i = 0; i < 100; ++i) {
        try {
          file->write_at(static_cast<uint64_t>(t * 1000 + i * 10), bytes.data(), bytes.size());
        } catch (const IoError&) {
          ++failures;
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(failures.load(), 800 - 500);  // exactly 500 ten-byte writes fit in 5000 bytes
}

TEST_F(StorageTest, TheNthWriteFailsWithTheChosenErrno) {
  faults::FaultPlan plan;
  plan.fail_on_write_call = 2;
  plan.fail_errno = EIO;
  auto fs = faults::fault_injecting_storage(posix_storage(), plan);
  auto file = fs->create_file(dir_ + "/x");
  file->append("a", 1);
  try {
    file->append("b", 1);
    FAIL() << "no error";
  } catch (const IoError& e) {
    EXPECT_EQ(e.error_number(), EIO);
    EXPECT_NE(std::string(e.what()).find("injected fault"), std::string::npos);
  }
  file->append("c", 1);
}

TEST_F(StorageTest, FailedRenameLeavesNoCommittedFile) {
  faults::FaultPlan plan;
  plan.fail_on_rename_call = 1;
  plan.fail_errno = EIO;
  auto fs = faults::fault_injecting_storage(posix_storage(), plan);
  const std::string path = dir_ + "/.metadata";
  const std::string error = error_of([&] { fs->write_file_atomic(path, {1, 2, 3}); });
  EXPECT_NE(error.find(std::strerror(EIO)), std::string::npos) << error;
  EXPECT_FALSE(posix_storage()->exists(path));
  fs->write_file_atomic(path, {1, 2, 3});  // the second rename goes through
  EXPECT_EQ(read_all(path), (std::vector<uint8_t>{1, 2, 3}));
}

TEST_F(StorageTest, FailedFsyncStopsTheCommitBeforeTheRename) {
  faults::FaultPlan plan;
  plan.fail_on_sync_call = 1;
  plan.fail_errno = EIO;
  auto fs = faults::fault_injecting_storage(posix_storage(), plan);
  const std::string path = dir_ + "/.metadata";
  EXPECT_THROW(fs->write_file_atomic(path, {1}), IoError);
  EXPECT_FALSE(posix_storage()->exists(path));
}

void write_text(Storage& fs, const std::string& path, const std::string& text) {
  auto f = fs.create_file(path);
  f->append(text.data(), text.size());
  f->close();
}

std::string read_text(Storage& fs, const std::string& path, size_t n) {
  std::string s(n, '\0');
  fs.read_at(path, 0, s.data(), n);
  return s;
}

// Descriptors this process holds open on files under `dir` (from /proc): what
// the POSIX storage's read cache keeps, seen from outside.
size_t open_fds_under(const std::string& dir) {
  const std::string root = std::filesystem::canonical(dir).string() + "/";
  size_t n = 0;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) {
    std::error_code ec;
    const std::string target = std::filesystem::read_symlink(entry.path(), ec).string();
    if (!ec && target.compare(0, root.size(), root) == 0) ++n;
  }
  return n;
}

TEST_F(StorageTest, ReadsReuseOpenFilesButSeeFilesReplacedSince) {
  auto fs = posix_storage();
  fs->drop_read_cache();
  const std::string a = dir_ + "/a";
  write_text(*fs, a, "first");
  EXPECT_EQ(read_text(*fs, a, 5), "first");
  EXPECT_EQ(read_text(*fs, a, 5), "first");
  EXPECT_EQ(open_fds_under(dir_), 1u);
  // Replaced through this storage (rename over it), and behind its back
  // (unlinked and recreated, as another process would).
  fs->write_file_atomic(a, {'s', 'e', 'c', 'o', 'n', 'd'});
  EXPECT_EQ(read_text(*fs, a, 6), "second");
  ASSERT_EQ(::unlink(a.c_str()), 0);
  FILE* f = std::fopen(a.c_str(), "wb");
  ASSERT_NE(f, nullptr);
  std::fputs("third", f);
  std::fclose(f);
  EXPECT_EQ(read_text(*fs, a, 5), "third");
  fs->remove_all(dir_ + "/a");
  EXPECT_EQ(open_fds_under(dir_), 0u);
  EXPECT_NE(error_of([&] { read_text(*fs, a, 5); }).find("cannot open " + a), std::string::npos);
}

TEST_F(StorageTest, AtMost64FilesStayOpenAndDroppingClosesThem) {
  auto fs = posix_storage();
  fs->drop_read_cache();
  for (int i = 0; i < 100; ++i) {
    const std::string path = dir_ + "/f" + std::to_string(i);
    write_text(*fs, path, "file" + std::to_string(i % 10));
    EXPECT_EQ(read_text(*fs, path, 5), "file" + std::to_string(i % 10));
  }
  EXPECT_EQ(open_fds_under(dir_), 64u);
  fs->drop_read_cache();
  EXPECT_EQ(open_fds_under(dir_), 0u);
}

TEST_F(StorageTest, ConcurrentReadsOfManyFilesReturnTheirOwnBytes) {
  auto fs = posix_storage();
  constexpr int kFiles = 100;
  for (int i = 0; i < kFiles; ++i) {
    write_text(*fs, dir_ + "/f" + std::to_string(i), "value" + std::to_string(1000 + i));
  }
  std::atomic<int> wrong{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      for (int k = 0; k < 500; ++k) {
        const int i = (k * 7 + t * 13) % kFiles;  // more files than stay open
        if (read_text(*fs, dir_ + "/f" + std::to_string(i), 9) != "value" + std::to_string(1000 + i)) {
          ++wrong;
        }
        if (k % 100 == 0) fs->drop_read_cache();
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(wrong.load(), 0);
  fs->drop_read_cache();
}

TEST(JoinPath, JoinsWithOneSlash) {
  EXPECT_EQ(join_path("/ck/step_1", "rank_0.data"), "/ck/step_1/rank_0.data");
  EXPECT_EQ(join_path("/ck/step_1/", "rank_0.data"), "/ck/step_1/rank_0.data");
  EXPECT_EQ(join_path("", "rank_0.data"), "rank_0.data");
}

}  // namespace
}  // namespace checkpoint
