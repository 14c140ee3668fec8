// The storage interface: the POSIX implementation, and fault injection that
// behaves like a full disk or a failing device.
#include "checkpoint/storage/posix_counters.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <thread>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <unistd.h>

#include "checkpoint/storage/direct_io.h"
#include "checkpoint/storage/storage.h"
#include "support/faulty_storage.h"
#include "support/skip.h"

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

// Whether `dir`'s file system takes O_DIRECT writes; else the direct tests
// skip, saying so (tmpfs before Linux 6.6, some FUSE file systems).
bool takes_direct_io(const std::string& dir) {
  const std::string probe = dir + "/.direct_probe";
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_DIRECT | O_CLOEXEC, 0644);
  bool ok = fd >= 0;
  if (ok) {
    void* page = std::aligned_alloc(4096, 4096);
    std::memset(page, 0, 4096);
    ok = ::pwrite(fd, page, 4096, 0) == 4096;
    std::free(page);
    ::close(fd);
  }
  ::unlink(probe.c_str());
  return ok;
}

// The fraction of `path`'s pages in the page cache (mincore).
double resident_fraction(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return -1;
  struct stat st {};
  ::fstat(fd, &st);
  const size_t size = static_cast<size_t>(st.st_size);
  void* map = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
  ::close(fd);
  if (map == MAP_FAILED) return -1;
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  std::vector<unsigned char> vec((size + page - 1) / page);
  const int rc = ::mincore(map, size, vec.data());
  ::munmap(map, size);
  if (rc != 0) return -1;
  size_t resident = 0;
  for (unsigned char v : vec) resident += v & 1;
  return static_cast<double>(resident) / static_cast<double>(vec.size());
}

TEST_F(StorageTest, DirectWritesStoreTheSameBytesAtAnyOffsetLengthAndAlignment) {
  if (!takes_direct_io(dir_)) SHARDKIT_SKIP("the file system of " << dir_ << " refuses O_DIRECT");
  PosixOptions o;
  o.direct_io = DirectIo::kOn;
  o.direct_min_bytes = 8192;  // small pieces take the direct path too
  auto fs = posix_storage(o);
  // Source bytes in a page-aligned buffer, so that both the aligned (no
  // copy) and the unaligned (bounce buffer) paths run.
  constexpr size_t kSize = (size_t{20} << 20) + 12345;
  uint8_t* src = static_cast<uint8_t*>(std::aligned_alloc(4096, kSize + 8192));
  for (size_t i = 0; i < kSize + 8192; ++i) src[i] = static_cast<uint8_t>(i * 131 + (i >> 12));
  // Disjoint pieces covering [0, kSize): page-aligned and not, shorter than
  // a page, several pages, longer than the 8 MiB bounce buffer; the source
  // for file offset x is src + x + shift, so some pieces are aligned like
  // their offsets and some are not.
  struct Piece {
    uint64_t offset;
    size_t n;
    size_t shift;
  };
  const std::vector<uint64_t> cuts = {0, 100, 4096, 4096 + 9000, 65536, 65536 + 3 * 4096, (9u << 20) + 7,
                                      (18u << 20), (18u << 20) + 4095, (18u << 20) + 70000, kSize};
  std::vector<Piece> pieces;
  for (size_t i = 0; i + 1 < cuts.size(); ++i) {
    pieces.push_back({cuts[i], static_cast<size_t>(cuts[i + 1] - cuts[i]), (i % 3 == 0) ? 0 : 4096 - 40 * i});
  }
  const PosixWriteCounters before = posix_write_counters();
  const std::string path = dir_ + "/direct.data";
  {
    auto file = fs->create_file(path);
    std::vector<std::thread> writers;
    for (size_t i = 0; i < pieces.size(); ++i) {
      writers.emplace_back([&, i] {
        const Piece& p = pieces[i];
        file->write_at(p.offset, src + p.shift + p.offset, p.n);
      });
    }
    for (auto& w : writers) w.join();
    file->sync();
    file->close();
  }
  const PosixWriteCounters after = posix_write_counters();
  EXPECT_GT(after.direct_bytes - before.direct_bytes, uint64_t{18} << 20);  // most of it went direct
  ASSERT_EQ(fs->file_size(path), kSize);
  std::vector<uint8_t> back(kSize);
  fs->read_at(path, 0, back.data(), kSize);
  for (const Piece& p : pieces) {
    ASSERT_EQ(std::memcmp(back.data() + p.offset, src + p.shift + p.offset, p.n), 0)
        << "piece at " << p.offset << " (" << p.n << " bytes, shift " << p.shift << ")";
  }
  std::free(src);
}

TEST_F(StorageTest, DirectWritesBypassThePageCacheAndPageCacheWritesDoNot) {
  if (!takes_direct_io(dir_)) SHARDKIT_SKIP("the file system of " << dir_ << " refuses O_DIRECT");
  struct statfs sfs {};
  if (::statfs(dir_.c_str(), &sfs) == 0 && static_cast<unsigned long>(sfs.f_type) == 0x01021994UL) {
    SHARDKIT_SKIP(dir_ << " is a tmpfs, whose files live in the page cache");
  }
  std::vector<uint8_t> data(size_t{32} << 20, 7);
  PosixOptions direct, cached;
  direct.direct_io = DirectIo::kOn;
  cached.direct_io = DirectIo::kOff;
  for (const bool use_direct : {true, false}) {
    const std::string path = dir_ + (use_direct ? "/direct.data" : "/cached.data");
    auto file = posix_storage(use_direct ? direct : cached)->create_file(path);
    for (size_t at = 0; at < data.size(); at += size_t{8} << 20) file->write_at(at, data.data() + at, size_t{8} << 20);
    file->sync();
    file->close();
    const double resident = resident_fraction(path);
    ASSERT_GE(resident, 0) << "mincore on " << path;
    if (use_direct) {
      EXPECT_LT(resident, 0.1) << "direct writes left " << resident << " of the file in the page cache";
    } else {
      EXPECT_GT(resident, 0.9) << "page-cache writes left only " << resident << " of the file cached";
    }
    EXPECT_EQ(posix_storage()->read_file(path, data.size()), data);
  }
}

TEST_F(StorageTest, DirectWritesToAFullDiskFailWithEnospcNamingTheFile) {
  const std::string mnt = dir_ + "/small";
  posix_storage()->make_dirs(mnt);
  if (::mount("tmpfs", mnt.c_str(), "tmpfs", 0, "size=2m") != 0) {
    SHARDKIT_SKIP("cannot mount a tmpfs (" << std::strerror(errno) << ")");
  }
  struct Unmount {
    std::string path;
    ~Unmount() { ::umount2(path.c_str(), MNT_DETACH); }
  } unmount{mnt};
  if (!takes_direct_io(mnt)) SHARDKIT_SKIP("this kernel's tmpfs refuses O_DIRECT");
  PosixOptions o;
  o.direct_io = DirectIo::kOn;
  auto fs = posix_storage(o);
  std::vector<uint8_t> data(size_t{4} << 20, 1);
  const PosixWriteCounters before = posix_write_counters();
  auto file = fs->create_file(mnt + "/full.data");
  const std::string error = error_of([&] { file->write_at(0, data.data(), data.size()); });
  EXPECT_NE(error.find("No space left on device"), std::string::npos) << error;
  EXPECT_NE(error.find(mnt + "/full.data"), std::string::npos) << error;
  EXPECT_GT(posix_write_counters().direct_bytes, before.direct_bytes) << "the direct path was not taken";
}

// checkpoint.direct_io auto (direct_io.h): the choice from a probe's
// timings, the probe itself, its cache, and a probe that fails.

DirectIoProbe timed_probe(bool accepted, double buffered_s, double direct_s) {
  DirectIoProbe p;
  p.accepted = accepted;
  p.buffered_s = buffered_s;
  p.direct_s = direct_s;
  return p;
}

TEST(DirectIoChoice, DirectOnlyWhereAcceptedAndStrictlyFaster) {
  EXPECT_TRUE(prefer_direct(timed_probe(true, 0.20, 0.10)));
  EXPECT_FALSE(prefer_direct(timed_probe(true, 0.10, 0.20)));
  EXPECT_FALSE(prefer_direct(timed_probe(true, 0.10, 0.10))) << "a tie keeps the page cache";
  EXPECT_FALSE(prefer_direct(timed_probe(false, 0.20, 0.10))) << "refused O_DIRECT";
  DirectIoProbe failed = timed_probe(true, 0.20, 0.10);
  failed.failed = true;
  EXPECT_FALSE(prefer_direct(failed));
}

TEST(DirectIoChoice, ParsesAutoTheBooleansAndNamesTheKeyOnBadValues) {
  EXPECT_EQ(parse_direct_io("auto"), DirectIo::kAuto);
  EXPECT_EQ(parse_direct_io("true"), DirectIo::kOn);
  EXPECT_EQ(parse_direct_io("TRUE"), DirectIo::kOn);
  EXPECT_EQ(parse_direct_io("false"), DirectIo::kOff);
  EXPECT_EQ(parse_direct_io("False"), DirectIo::kOff);
  for (DirectIo d : kDirectIos) EXPECT_EQ(parse_direct_io(to_string(d)), d);
  try {
    parse_direct_io("yes");
    FAIL() << "'yes' parsed";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("checkpoint.direct_io 'yes' is not one of auto, true, false"),
              std::string::npos)
        << e.what();
  }
}

TEST_F(StorageTest, DirectIoProbeTimesBothWaysChoosesByThemAndLeavesNoFile) {
  const DirectIoProbe p = probe_direct_io(dir_, uint64_t{1} << 20, 2);
  EXPECT_FALSE(p.failed) << p.detail;
  EXPECT_EQ(p.bytes, uint64_t{1} << 20);
  EXPECT_GT(p.buffered_s, 0);
  EXPECT_EQ(p.accepted, takes_direct_io(dir_)) << p.detail;
  if (p.accepted) {
    EXPECT_GT(p.direct_s, 0);
  }
  EXPECT_EQ(p.use_direct, prefer_direct(p));
  const std::string chosen = p.use_direct ? "O_DIRECT (" : "page cache (";
  EXPECT_EQ(p.detail.rfind(chosen, 0), 0u) << p.detail;
  EXPECT_TRUE(posix_storage()->list_dir(dir_).empty()) << "the probe left its file";
}

TEST_F(StorageTest, DirectIoProbeOfAMissingDirectoryFailsOverToThePageCacheNamingIt) {
  const std::string missing = dir_ + "/no/such/dir";
  const DirectIoProbe p = probe_direct_io(missing, uint64_t{1} << 20);
  EXPECT_TRUE(p.failed);
  EXPECT_FALSE(p.use_direct);
  EXPECT_EQ(p.detail.rfind("page cache (probe failed: cannot create " + missing, 0), 0u) << p.detail;
  // The cached probe of a directory not made yet measures its nearest
  // existing ancestor's file system instead.
  const DirectIoProbe cached = cached_direct_io_probe(missing);
  EXPECT_FALSE(cached.failed) << cached.detail;
}

TEST_F(StorageTest, DirectIoProbeIsCachedPerFileSystem) {
  posix_storage()->make_dirs(dir_ + "/sub");
  const DirectIoProbe a = cached_direct_io_probe(dir_);
  const DirectIoProbe b = cached_direct_io_probe(dir_ + "/sub");
  EXPECT_EQ(a.dir, b.dir);
  EXPECT_EQ(a.buffered_s, b.buffered_s);
  EXPECT_EQ(a.direct_s, b.direct_s);
  EXPECT_EQ(a.detail, b.detail);
}

// Remembered probes (remember_direct_io_probes_in): what a restarted rank
// reads back instead of probing again.
TEST_F(StorageTest, ARememberedProbeReadsBackForItsFileSystemOnlyAndSaysItWasReused) {
  const std::string file = dir_ + "/run/.direct_io_probes";  // its directory is made
  DirectIoProbe p = timed_probe(true, 0.25, 0.125);
  p.bytes = uint64_t{64} << 20;
  p.use_direct = prefer_direct(p);
  ASSERT_TRUE(write_remembered_probe(file, 41, p));
  DirectIoProbe refused = timed_probe(false, 0.5, 0);
  refused.bytes = uint64_t{64} << 20;
  refused.refused_errno = EINVAL;
  ASSERT_TRUE(write_remembered_probe(file, 42, refused));
  const std::optional<DirectIoProbe> a = read_remembered_probe(file, 41);
  ASSERT_TRUE(a.has_value());
  EXPECT_TRUE(a->accepted);
  EXPECT_EQ(a->bytes, p.bytes);
  EXPECT_EQ(a->buffered_s, 0.25);
  EXPECT_EQ(a->direct_s, 0.125);
  EXPECT_TRUE(a->use_direct);
  EXPECT_EQ(a->reused_from, file);
  EXPECT_EQ(a->detail.rfind("O_DIRECT (64 MiB each way: ", 0), 0u) << a->detail;
  EXPECT_NE(a->detail.find("; probe of an earlier process of this run, reused from " + file), std::string::npos)
      << a->detail;
  const std::optional<DirectIoProbe> b = read_remembered_probe(file, 42);
  ASSERT_TRUE(b.has_value());
  EXPECT_FALSE(b->accepted);
  EXPECT_FALSE(b->use_direct);
  EXPECT_EQ(b->detail.rfind("page cache (O_DIRECT refused here: " + std::string(std::strerror(EINVAL)), 0), 0u)
      << b->detail;
  EXPECT_FALSE(read_remembered_probe(file, 43).has_value()) << "another file system";
  // A new probe of a file system replaces its line and keeps the others.
  p.buffered_s = 0.0625;
  p.use_direct = prefer_direct(p);
  ASSERT_TRUE(write_remembered_probe(file, 41, p));
  EXPECT_EQ(read_remembered_probe(file, 41)->buffered_s, 0.0625);
  EXPECT_FALSE(read_remembered_probe(file, 41)->use_direct);
  EXPECT_TRUE(read_remembered_probe(file, 42).has_value());
}

TEST_F(StorageTest, ADamagedOrMissingRememberedProbesFileMeansProbingAgainNeverAnError) {
  const std::string file = dir_ + "/.direct_io_probes";
  EXPECT_FALSE(read_remembered_probe(file, 41).has_value()) << "no file";
  std::string boot;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> boot;
  ASSERT_FALSE(boot.empty());
  const std::string dev = " 41 ";
  for (const std::string& text : {
           std::string("\x01\x02garbage\n"),
           "direct_io_probe/1 " + boot + dev + "1 67108864 0.25\n",                // cut short
           "direct_io_probe/1 " + boot + dev + "1 67108864 0.25 nan 0\n",          // not a time
           "direct_io_probe/1 " + boot + dev + "1 67108864 -1 0.125 0\n",          // negative
           "direct_io_probe/1 " + boot + dev + "2 67108864 0.25 0.125 0\n",        // accepted 2
           "direct_io_probe/1 " + boot + dev + "1 67108864 0.25 0.125 0 extra\n",  // another version's line
           "direct_io_probe/9 " + boot + dev + "1 67108864 0.25 0.125 0\n",
           "direct_io_probe/1 not-this-boot" + dev + "1 67108864 0.25 0.125 0\n",
       }) {
    std::ofstream(file, std::ios::trunc) << text;
    EXPECT_FALSE(read_remembered_probe(file, 41).has_value()) << text;
  }
  // The well-formed line reads back; then a directory where the file should
  // be: nothing to read, nothing written, no throw.
  std::ofstream(file, std::ios::trunc) << "direct_io_probe/1 " + boot + dev + "1 67108864 0.25 0.125 0\n";
  EXPECT_TRUE(read_remembered_probe(file, 41).has_value());
  const std::string not_a_file = dir_ + "/a_directory";
  posix_storage()->make_dirs(not_a_file);
  EXPECT_FALSE(read_remembered_probe(not_a_file, 41).has_value());
  EXPECT_FALSE(write_remembered_probe(not_a_file, 41, timed_probe(true, 0.25, 0.125)));
  DirectIoProbe failed = timed_probe(true, 0.25, 0.125);
  failed.bytes = 1 << 20;
  failed.failed = true;
  EXPECT_FALSE(write_remembered_probe(file, 44, failed)) << "a failed probe is not remembered";
  EXPECT_FALSE(read_remembered_probe(file, 44).has_value());
}

TEST_F(StorageTest, AutoDirectIoWritesTheWayItsProbeChoseAndTheSameBytes) {
  PosixOptions o;  // direct_io auto, the default
  o.direct_min_bytes = 8192;
  const DirectIoProbe probe = cached_direct_io_probe(dir_);
  std::vector<uint8_t> data((size_t{4} << 20) + 100);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<uint8_t>(i * 7 + (i >> 13));
  const PosixWriteCounters before = posix_write_counters();
  const std::string path = dir_ + "/auto.data";
  {
    auto file = posix_storage(o)->create_file(path);
    file->write_at(0, data.data(), data.size());
    file->sync();
    file->close();
  }
  const uint64_t direct = posix_write_counters().direct_bytes - before.direct_bytes;
  if (probe.use_direct) {
    EXPECT_GT(direct, uint64_t{3} << 20) << probe.detail;
  } else {
    EXPECT_EQ(direct, 0u) << probe.detail;
  }
  EXPECT_EQ(posix_storage()->read_file(path, data.size()), data);
}

TEST(DirectIoChoice, AutoTakesTheProbesWayThenTheOtherOnceThenTheFasterLatestFile) {
  DirectIoProbe probe = timed_probe(true, 0.10, 0.20);  // the page cache won the probe
  probe.use_direct = prefer_direct(probe);
  DirectIoLearned l;
  EXPECT_FALSE(choose_direct(probe, l)) << "nothing measured: the probe's way";
  l.buffered_bytes_per_s = 4e8;
  EXPECT_TRUE(choose_direct(probe, l)) << "only the page cache measured: try O_DIRECT";
  l.direct_bytes_per_s = 6e8;
  EXPECT_TRUE(choose_direct(probe, l)) << "O_DIRECT's latest file was faster";
  l.direct_bytes_per_s = 3e8;
  EXPECT_FALSE(choose_direct(probe, l)) << "the page cache's latest file was faster";
  l.direct_bytes_per_s = 4e8;
  EXPECT_FALSE(choose_direct(probe, l)) << "a tie keeps the page cache";
  l = DirectIoLearned{};
  l.direct_bytes_per_s = 6e8;
  EXPECT_FALSE(choose_direct(probe, l)) << "only O_DIRECT measured: try the page cache";
  // O_DIRECT refused, or a failed probe: never, whatever was measured.
  l.buffered_bytes_per_s = 1e8;
  DirectIoProbe refused = timed_probe(false, 0.10, 0);
  EXPECT_FALSE(choose_direct(refused, l));
  DirectIoProbe failed = timed_probe(true, 0.20, 0.10);
  failed.use_direct = true;
  failed.failed = true;
  EXPECT_FALSE(choose_direct(failed, DirectIoLearned{}));
}

// The slower way is measured again after retry_after files; the interval
// doubles (to a cap) while retries find it still slower and starts again
// when one wins, and the way follows the latest files.
TEST(DirectIoChoice, AutoMeasuresTheSlowerWayAgainAfterAnIntervalThatDoublesWhileItStaysSlower) {
  DirectIoProbe probe = timed_probe(true, 0.20, 0.10);  // O_DIRECT won the probe
  probe.use_direct = prefer_direct(probe);
  ASSERT_TRUE(probe.use_direct);
  DirectIoLearned l;
  // Writes one file the way choose_direct says, at these rates.
  const auto file = [&](double direct_rate, double buffered_rate) {
    const bool direct = choose_direct(probe, l);
    learn_auto_write(l, direct, direct ? direct_rate : buffered_rate);
    return direct;
  };
  // Files until one is a retry; their ways, the retry's last.
  const auto until_retry = [&](double direct_rate, double buffered_rate) {
    const uint64_t before = l.retries;
    std::vector<bool> ways;
    while (l.retries == before && ways.size() < 10000) ways.push_back(file(direct_rate, buffered_rate));
    return ways;
  };
  const uint64_t first = DirectIoLearned::kFirstRetryAfter;
  EXPECT_TRUE(file(6e8, 3e8)) << "the probe's way";
  EXPECT_FALSE(file(6e8, 3e8)) << "the other, once";
  // O_DIRECT (faster) until the page cache's latest file is `first` files
  // old, then one page-cache file: still slower, so the interval doubles.
  std::vector<bool> ways = until_retry(6e8, 3e8);
  ASSERT_EQ(ways.size(), first + 1);
  for (size_t i = 0; i + 1 < ways.size(); ++i) EXPECT_TRUE(ways[i]) << "file " << i;
  EXPECT_FALSE(ways.back());
  EXPECT_EQ(l.retry_after, 2 * first);
  ways = until_retry(6e8, 3e8);
  ASSERT_EQ(ways.size(), 2 * first + 1);
  EXPECT_FALSE(ways.back());
  EXPECT_EQ(l.retry_after, 4 * first);
  // The interval stops doubling at its cap.
  while (l.retry_after < DirectIoLearned::kMaxRetryAfter) until_retry(6e8, 3e8);
  EXPECT_EQ(until_retry(6e8, 3e8).size(), DirectIoLearned::kMaxRetryAfter + 1);
  EXPECT_EQ(l.retry_after, DirectIoLearned::kMaxRetryAfter);
  // The disk changed: the next retry finds the page cache faster, the
  // interval starts again, and the files go the page cache's way.
  ways = until_retry(5e8, 9e8);
  EXPECT_EQ(ways.size(), DirectIoLearned::kMaxRetryAfter + 1);
  EXPECT_FALSE(ways.back());
  EXPECT_EQ(l.retry_after, first);
  for (int i = 0; i < 3; ++i) EXPECT_FALSE(file(5e8, 9e8)) << "after the change, file " << i;
  // Files opened during a retry go the same way, but only the first one of
  // them moves the interval (it doubles once, not per file).
  DirectIoLearned m;
  learn_auto_write(m, true, 6e8);
  learn_auto_write(m, false, 3e8);
  for (uint64_t i = 0; i < first; ++i) learn_auto_write(m, true, 6e8);
  ASSERT_FALSE(choose_direct(probe, m));
  for (int i = 0; i < 4; ++i) learn_auto_write(m, false, 3e8);
  EXPECT_EQ(m.retries, 1u);
  EXPECT_EQ(m.retry_after, 2 * first);
  EXPECT_TRUE(choose_direct(probe, m));
}

// auto through the POSIX storage: each file at least learn_min_bytes long
// is timed and recorded the way it was written; the next file goes the way
// choose_direct says from the probe and those records (so from fresh: the
// probe's way, then the other, then the faster). Files written with
// checkpoint.direct_io true or false, and small files, teach it nothing.
TEST_F(StorageTest, AutoDirectIoTimesItsOwnFilesTriesTheOtherWayAndKeepsTheFaster) {
  if (!takes_direct_io(dir_)) SHARDKIT_SKIP("the file system of " << dir_ << " refuses O_DIRECT");
  const DirectIoProbe probe = cached_direct_io_probe(dir_);
  ASSERT_TRUE(probe.accepted) << probe.detail;
  PosixOptions o;  // direct_io auto
  o.direct_min_bytes = 8192;
  o.learn_min_bytes = uint64_t{2} << 20;
  std::vector<uint8_t> data((size_t{3} << 20) + 100);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<uint8_t>(i * 11 + (i >> 12));
  const auto write = [&](const std::shared_ptr<Storage>& storage, const std::string& name, size_t n) {
    const PosixWriteCounters before = posix_write_counters();
    auto file = storage->create_file(dir_ + "/" + name);
    file->write_at(0, data.data(), n);
    file->sync();
    file->close();
    EXPECT_EQ(posix_storage()->read_file(dir_ + "/" + name, n),
              std::vector<uint8_t>(data.begin(), data.begin() + static_cast<std::ptrdiff_t>(n)));
    return posix_write_counters().direct_bytes - before.direct_bytes;
  };
  const DirectIoLearned fresh = learned_direct_io(dir_);
  std::vector<bool> ways;
  for (int i = 0; i < 4; ++i) {
    const DirectIoLearned before = learned_direct_io(dir_);
    const bool expect_direct = choose_direct(probe, before);
    const uint64_t direct = write(posix_storage(o), "auto_" + std::to_string(i), data.size());
    if (expect_direct) {
      EXPECT_GT(direct, uint64_t{2} << 20) << "file " << i << ": " << describe_auto_direct_io(dir_);
    } else {
      EXPECT_EQ(direct, 0u) << "file " << i << ": " << describe_auto_direct_io(dir_);
    }
    const DirectIoLearned after = learned_direct_io(dir_);
    EXPECT_EQ(after.direct_files, before.direct_files + (expect_direct ? 1 : 0)) << "file " << i;
    EXPECT_EQ(after.buffered_files, before.buffered_files + (expect_direct ? 0 : 1)) << "file " << i;
    EXPECT_GT(expect_direct ? after.direct_bytes_per_s : after.buffered_bytes_per_s, 0) << "file " << i;
    ways.push_back(expect_direct);
  }
  const DirectIoLearned both = learned_direct_io(dir_);
  EXPECT_GE(both.direct_files, 1u);
  EXPECT_GE(both.buffered_files, 1u);
  if (fresh.direct_files == 0 && fresh.buffered_files == 0) {
    EXPECT_EQ(ways[0], probe.use_direct) << "the first file goes the probe's way";
    EXPECT_NE(ways[1], ways[0]) << "the second tries the other way";
  }
  const std::string said = describe_auto_direct_io(dir_);
  EXPECT_EQ(said.rfind(choose_direct(probe, both) ? "O_DIRECT (latest checkpoint files: "
                                                  : "page cache (latest checkpoint files: ",
                       0),
            0u)
      << said;
  // Not recorded: a file under learn_min_bytes, and files of true and false.
  write(posix_storage(o), "small", size_t{1} << 20);
  PosixOptions on = o, off = o;
  on.direct_io = DirectIo::kOn;
  off.direct_io = DirectIo::kOff;
  EXPECT_GT(write(posix_storage(on), "forced_direct", data.size()), uint64_t{2} << 20);
  EXPECT_EQ(write(posix_storage(off), "forced_buffered", data.size()), 0u);
  const DirectIoLearned end = learned_direct_io(dir_);
  EXPECT_EQ(end.direct_files, both.direct_files);
  EXPECT_EQ(end.buffered_files, both.buffered_files);
}

// A probe that fails (here: a file system too small for its 64 MiB) must not
// cost the checkpoint: the file is written through the page cache.
TEST_F(StorageTest, AutoDirectIoWhoseProbeFailsWritesThroughThePageCache) {
  const std::string mnt = dir_ + "/small";
  posix_storage()->make_dirs(mnt);
  if (::mount("tmpfs", mnt.c_str(), "tmpfs", 0, "size=16m") != 0) {
    SHARDKIT_SKIP("cannot mount a tmpfs (" << std::strerror(errno) << ")");
  }
  struct Unmount {
    std::string path;
    ~Unmount() { ::umount2(path.c_str(), MNT_DETACH); }
  } unmount{mnt};
  std::vector<uint8_t> data(size_t{6} << 20);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<uint8_t>(i * 13 + 1);
  const PosixWriteCounters before = posix_write_counters();
  {
    auto file = posix_storage()->create_file(mnt + "/rank_0.data");
    file->write_at(0, data.data(), data.size());
    file->sync();
    file->close();
  }
  EXPECT_EQ(posix_write_counters().direct_bytes, before.direct_bytes);
  EXPECT_EQ(posix_storage()->read_file(mnt + "/rank_0.data", data.size()), data);
  const DirectIoProbe p = cached_direct_io_probe(mnt);
  EXPECT_TRUE(p.failed);
  EXPECT_NE(p.detail.find("page cache (probe failed: "), std::string::npos) << p.detail;
  EXPECT_NE(p.detail.find("No space left on device"), std::string::npos) << p.detail;
  EXPECT_EQ(posix_storage()->list_dir(mnt), std::vector<std::string>{"rank_0.data"});
}

TEST(JoinPath, JoinsWithOneSlash) {
  EXPECT_EQ(join_path("/ck/step_1", "rank_0.data"), "/ck/step_1/rank_0.data");
  EXPECT_EQ(join_path("/ck/step_1/", "rank_0.data"), "/ck/step_1/rank_0.data");
  EXPECT_EQ(join_path("", "rank_0.data"), "rank_0.data");
}

}  // namespace
}  // namespace checkpoint
