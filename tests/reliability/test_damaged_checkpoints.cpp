// Hostile and damaged checkpoints: single-byte flips at random offsets of
// every file of a real checkpoint (uncompressed and zstd), truncations of
// every file, and loads of damaged checkpoints through build/train. Every
// flip inside stored data or the metadata is detected (or, inside a zstd
// frame, provably harmless: verify re-checked the decoded bytes), nothing
// crashes, and errors name the file. Fixed seeds, printed; scripts/fault-soak
// --corrupt N runs thousands.
#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <fstream>
#include <random>

#include "checkpoint/format/metadata.h"
#include "reliability/test_util.h"
#include "support/paths.h"

namespace reliability {
namespace {

constexpr uint64_t kSeed = 20260101;
constexpr int64_t kFlips = 300;

// step_4 of a 4-step sync run. Made once per build of train (with these
// settings) by the first of the suite's test processes, under a lock
// (ctest runs each test in its own process, two at a time), and copied into
// this process's own directory: the tests damage their copy.
fs::path make_checkpoint(const std::string& name, std::vector<std::string> extra) {
  std::vector<std::string> sets{"train.steps=4", "checkpoint.interval=4", "checkpoint.mode=sync"};
  sets.insert(sets.end(), extra.begin(), extra.end());
  const fs::path shared = fs::path(testing_support::binary_dir()) / "reliability-work" / "shared" / ("damaged_" + name);
  fs::create_directories(shared.parent_path());
  std::string key = train_binary_key();
  for (const auto& s : small_model_sets()) key += "," + s;
  for (const auto& s : sets) key += "," + s;
  const int lock = ::open((shared.string() + ".lock").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  EXPECT_GE(lock, 0) << shared << ".lock: " << std::strerror(errno);
  if (lock >= 0) ::flock(lock, LOCK_EX);
  const fs::path step = shared / "ckpt" / "step_4";
  if (read_text_file((shared / "key").string()) != key || !fs::exists(step / ".metadata")) {
    fs::remove_all(shared);
    fs::create_directories(shared);
    auto spec = small_run(shared, sets);
    RunResult r = run_train(spec, shared / "train.log");
    EXPECT_EQ(r.exit_code, 0) << tail(r.output);
    if (r.exit_code == 0) std::ofstream(shared / "key") << key;
  }
  const fs::path root = fresh_dir("damaged_" + name);
  fs::copy(step, root / "step_4", fs::copy_options::recursive);
  if (lock >= 0) ::close(lock);  // releases the lock
  return root / "step_4";
}

class DamagedCheckpoints : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    plain_ = new fs::path(make_checkpoint("plain", {}));
    // Small blocks: several zstd frames per chunk.
    zstd_ = new fs::path(make_checkpoint(
        "zstd", {"checkpoint.compression.codec=zstd", "checkpoint.compression.block_size=4096"}));
  }
  static void TearDownTestSuite() {
    delete plain_;
    delete zstd_;
  }
  static fs::path* plain_;
  static fs::path* zstd_;
};
fs::path* DamagedCheckpoints::plain_ = nullptr;
fs::path* DamagedCheckpoints::zstd_ = nullptr;

void report(const char* what, uint64_t seed, const FlipStats& s) {
  std::cout << what << " (seed " << seed << "): " << s.flips << " flips, " << s.in_stored_bytes
            << " in stored bytes/metadata, " << s.detected << " detected, " << s.benign
            << " benign (zstd frame decodes identically), " << s.unreferenced << " in unreferenced bytes ("
            << s.unreferenced_detected << " detected)\n";
  for (const auto& m : s.messages_sample) std::cout << "  e.g. " << m.substr(0, 300) << "\n";
  for (const auto& m : s.misses) std::cout << "  MISS " << m.substr(0, 400) << "\n";
}

TEST_F(DamagedCheckpoints, EveryFlipInAnUncompressedCheckpointIsDetected) {
  ASSERT_EQ(verify_problems(*plain_), "");
  const FlipStats s = corruption_sweep(*plain_, kFlips, kSeed);
  report("uncompressed", kSeed, s);
  EXPECT_TRUE(s.misses.empty());
  EXPECT_EQ(s.detected, s.in_stored_bytes);
  EXPECT_EQ(s.benign, 0);
  EXPECT_EQ(verify_problems(*plain_), "") << "the sweep restores every byte";
}

TEST_F(DamagedCheckpoints, EveryFlipInACompressedCheckpointIsDetectedOrHarmless) {
  ASSERT_EQ(verify_problems(*zstd_), "");
  const FlipStats s = corruption_sweep(*zstd_, kFlips, kSeed + 1);
  report("zstd", kSeed + 1, s);
  EXPECT_TRUE(s.misses.empty());
  EXPECT_EQ(s.detected + s.benign, s.in_stored_bytes);
  EXPECT_EQ(verify_problems(*zstd_), "");
}

// Truncating any file at any point is reported, naming that file.
TEST_F(DamagedCheckpoints, TruncationAtManyPointsIsDetectedNamingTheFile) {
  std::mt19937_64 rng(kSeed + 2);
  int cases = 0;
  for (const fs::path* dir : {plain_, zstd_}) {
    for (const auto& e : fs::directory_iterator(*dir)) {
      const fs::path file = e.path();
      const std::string name = file.filename().string();
      const std::string original = read_text_file(file.string());
      const uint64_t n = original.size();
      std::vector<uint64_t> points{0, 1, n / 3, n / 2, n - 1};
      for (int i = 0; i < 5; ++i) points.push_back(rng() % n);
      for (uint64_t at : points) {
        ASSERT_EQ(::truncate(file.c_str(), static_cast<off_t>(at)), 0);
        const std::string problems = verify_problems(*dir);
        EXPECT_NE(problems, "") << name << " truncated to " << at;
        EXPECT_TRUE(contains(problems, name)) << name << " truncated to " << at << ": " << problems;
        std::ofstream(file, std::ios::binary | std::ios::trunc) << original;
        ++cases;
      }
    }
    ASSERT_EQ(verify_problems(*dir), "");
  }
  std::cout << cases << " truncations checked" << std::endl;
}

// A copy of `src` with one damage applied, loaded through build/train.
void expect_load_fails(const fs::path& src, const std::string& case_name, const std::string& file,
                       bool truncate_instead) {
  const fs::path root = fresh_dir("damaged_load_" + case_name);
  const fs::path copy = root / "step_4";
  fs::copy(src, copy, fs::copy_options::recursive);
  const fs::path target = copy / file;
  const std::string bytes = read_text_file(target.string());
  std::string damaged = bytes;
  if (truncate_instead) {
    damaged.resize(bytes.size() / 2);
  } else {
    damaged[bytes.size() / 2] = static_cast<char>(damaged[bytes.size() / 2] ^ 0x5a);
  }
  std::ofstream(target, std::ios::binary | std::ios::trunc) << damaged;
  auto spec = small_run(root, {"checkpoint.mode=sync", "checkpoint.resume=" + copy.string()});
  RunResult r = run_train(spec, root / "train.log");
  EXPECT_NE(r.exit_code, 0) << tail(r.output);
  EXPECT_FALSE(r.timed_out);
  EXPECT_TRUE(contains(r.output, file)) << "the error names " << file << ": " << tail(r.output);
  EXPECT_FALSE(contains(r.output, "resumed from")) << tail(r.output);
}

TEST_F(DamagedCheckpoints, LoadingAFlippedDataFileFails) {
  expect_load_fails(*plain_, "flip_rank1", "rank_1.data", false);
}
TEST_F(DamagedCheckpoints, LoadingAFlippedCompressedDataFileFails) {
  expect_load_fails(*zstd_, "flip_zstd_rank0", "rank_0.data", false);
}
TEST_F(DamagedCheckpoints, LoadingAFlippedMetadataFails) {
  expect_load_fails(*plain_, "flip_meta", ".metadata", false);
}
TEST_F(DamagedCheckpoints, LoadingATruncatedDataFileFails) {
  expect_load_fails(*plain_, "trunc_rank0", "rank_0.data", true);
}

}  // namespace
}  // namespace reliability
