// A full disk while saving. Injected (SHARDKIT_FAULT_INJECT, always runs) and
// real (a 2 MiB tmpfs, when this process may mount one). The save fails with
// "No space left on device" naming the step, nothing new is committed, the
// previous checkpoint still verifies; on_error fail stops the run (non-zero),
// on_error warn finishes it with a warning, and saves commit again once
// there is space.
#include <sys/mount.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <thread>

#include "reliability/test_util.h"

namespace reliability {
namespace {

uint64_t file_size_or_zero(const fs::path& p) {
  std::error_code ec;
  const auto n = fs::file_size(p, ec);
  return ec ? 0 : n;
}

// Bytes each rank writes for one save of the small model (rank 0 also writes
// the metadata), from a fault-free run.
std::pair<uint64_t, uint64_t> bytes_per_save_by_rank() {
  const fs::path root = fresh_dir("disk_measure");
  auto spec = small_run(root, {"train.steps=4", "checkpoint.interval=4", "checkpoint.mode=sync"});
  RunResult r = run_train(spec, root / "train.log");
  EXPECT_EQ(r.exit_code, 0) << tail(r.output);
  const fs::path step = spec.ckpt_dir / "step_4";
  uint64_t r0 = file_size_or_zero(step / ".metadata"), r1 = 0;
  for (const auto& e : fs::directory_iterator(step)) {
    const std::string n = e.path().filename().string();
    if (n.rfind("rank_0", 0) == 0) r0 += e.file_size();
    if (n.rfind("rank_1", 0) == 0) r1 += e.file_size();
  }
  return {r0, r1};
}

class InjectedFullDisk : public ::testing::TestWithParam<const char*> {
 protected:
  static void SetUpTestSuite() { sizes_ = bytes_per_save_by_rank(); }
  // A limit that lets each rank's first save through and stops its second.
  static std::string plan() {
    const uint64_t hi = std::max(sizes_.first, sizes_.second);
    const uint64_t lo = std::min(sizes_.first, sizes_.second);
    return "fail_after_bytes=" + std::to_string(hi + lo / 2) + ",errno=ENOSPC";
  }
  static std::pair<uint64_t, uint64_t> sizes_;
};
std::pair<uint64_t, uint64_t> InjectedFullDisk::sizes_;

TEST_P(InjectedFullDisk, OnErrorFailStopsWithNonZeroExitNamingTheStep) {
  const uint64_t hi = std::max(sizes_.first, sizes_.second), lo = std::min(sizes_.first, sizes_.second);
  ASSERT_GT(lo, 0u);
  ASSERT_LT(hi + lo / 2, 2 * lo) << "ranks write too unevenly for one byte limit";
  const fs::path root = fresh_dir(std::string("disk_fail_") + GetParam());
  auto spec = small_run(root,
                        {"train.steps=12", "checkpoint.interval=4", "checkpoint.keep_last=0",
                         std::string("checkpoint.mode=") + GetParam(), "checkpoint.on_error=fail"},
                        {{"SHARDKIT_FAULT_INJECT", plan()}});
  RunResult r = run_train(spec, root / "train.log");
  EXPECT_NE(r.exit_code, 0) << tail(r.output);
  EXPECT_FALSE(r.timed_out);
  EXPECT_TRUE(contains(r.output, "No space left on device")) << tail(r.output);
  EXPECT_TRUE(contains(r.output, "step 8")) << tail(r.output);
  EXPECT_EQ(committed_steps(spec.ckpt_dir), std::vector<int64_t>{4});
  EXPECT_EQ(verify_problems(spec.ckpt_dir / "step_4"), "");
}

// Training goes on to the end, but the run's last save failed: it exits 1
// saying how many saves failed and which was last.
TEST_P(InjectedFullDisk, OnErrorWarnFinishesWithAWarningAndKeepsThePreviousCheckpoint) {
  const fs::path root = fresh_dir(std::string("disk_warn_") + GetParam());
  auto spec = small_run(root,
                        {"train.steps=12", "checkpoint.interval=4", "checkpoint.keep_last=0",
                         std::string("checkpoint.mode=") + GetParam(), "checkpoint.on_error=warn"},
                        {{"SHARDKIT_FAULT_INJECT", plan()}});
  RunResult r = run_train(spec, root / "train.log");
  EXPECT_EQ(r.exit_code, 1) << tail(r.output);
  EXPECT_TRUE(contains(r.output, "warning")) << tail(r.output);
  EXPECT_TRUE(contains(r.output, "No space left on device")) << tail(r.output);
  EXPECT_TRUE(contains(r.output, "step 8")) << tail(r.output);
  EXPECT_TRUE(contains(r.output, "2 checkpoint save(s) failed (checkpoint.on_error: warn), the "
                                 "last one too: step 12"))
      << tail(r.output);
  // The disk stays full: nothing after step 4 commits.
  EXPECT_EQ(committed_steps(spec.ckpt_dir), std::vector<int64_t>{4});
  EXPECT_EQ(verify_problems(spec.ckpt_dir / "step_4"), "");
  EXPECT_EQ(read_losses(spec.run_dir / "metrics.jsonl").rbegin()->first, 12);
}

TEST_P(InjectedFullDisk, OnErrorWarnCommitsLaterSavesAfterATransientFailure) {
  // Only the second commit rename fails (ENOSPC: the directory needed a block).
  const fs::path root = fresh_dir(std::string("disk_transient_") + GetParam());
  auto spec = small_run(root,
                        {"train.steps=12", "checkpoint.interval=4", "checkpoint.keep_last=0",
                         std::string("checkpoint.mode=") + GetParam(), "checkpoint.on_error=warn"},
                        {{"SHARDKIT_FAULT_INJECT", "fail_on_rename_call=2,errno=ENOSPC"}});
  RunResult r = run_train(spec, root / "train.log");
  EXPECT_EQ(r.exit_code, 0) << tail(r.output);
  EXPECT_TRUE(contains(r.output, "warning")) << tail(r.output);
  EXPECT_TRUE(contains(r.output, "No space left on device")) << tail(r.output);
  EXPECT_EQ(committed_steps(spec.ckpt_dir), (std::vector<int64_t>{4, 12}));
  EXPECT_FALSE(fs::exists(spec.ckpt_dir / "step_8" / ".metadata"));
  for (int64_t s : {4, 12}) {
    EXPECT_EQ(verify_problems(spec.ckpt_dir / ("step_" + std::to_string(s))), "") << s;
  }
}

INSTANTIATE_TEST_SUITE_P(Modes, InjectedFullDisk, ::testing::Values("sync", "async"));

// A real 2 MiB tmpfs as checkpoint.dir, mostly filled by a filler file.
class TmpfsFullDisk : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fresh_dir(std::string("disk_tmpfs_") +
                      ::testing::UnitTest::GetInstance()->current_test_info()->name());
    mnt_ = root_ / "ckpt";
    fs::create_directories(mnt_);
    if (::mount("tmpfs", mnt_.c_str(), "tmpfs", 0, "size=2m") != 0) {
      SHARDKIT_SKIP("cannot mount a tmpfs (" << std::strerror(errno)
                                             << "); the injected full-disk tests cover this");
    }
    mounted_ = true;
  }
  void TearDown() override {
    if (mounted_) ::umount2(mnt_.c_str(), MNT_DETACH);
  }
  // Leaves about `free_bytes` free on the tmpfs.
  void fill_leaving(uint64_t free_bytes) {
    const uint64_t size = 2 * 1024 * 1024 - free_bytes;
    std::ofstream f(mnt_ / "filler", std::ios::binary);
    std::string block(4096, 'x');
    for (uint64_t n = 0; n < size; n += block.size()) f.write(block.data(), block.size());
  }
  fs::path root_, mnt_;
  bool mounted_ = false;
};

TEST_F(TmpfsFullDisk, OnErrorFailReportsTheRealErrnoAndKeepsThePreviousCheckpoint) {
  fill_leaving(300 * 1024);  // one checkpoint (~0.2 MiB) fits, two do not
  auto spec = small_run(root_, {"train.steps=12", "checkpoint.interval=4", "checkpoint.keep_last=0",
                                "checkpoint.mode=sync", "checkpoint.on_error=fail",
                                // no direct_io probe: its own "No space left" must not stand in for the save's
                                "checkpoint.direct_io=false"});
  RunResult r = run_train(spec, root_ / "train.log");
  EXPECT_NE(r.exit_code, 0) << tail(r.output);
  EXPECT_TRUE(contains(r.output, "No space left on device")) << tail(r.output);
  EXPECT_TRUE(contains(r.output, "step 8")) << tail(r.output);
  EXPECT_EQ(committed_steps(mnt_), std::vector<int64_t>{4});
  EXPECT_EQ(verify_problems(mnt_ / "step_4"), "");
}

TEST_F(TmpfsFullDisk, OnErrorWarnCommitsAgainOnceSpaceIsFreed) {
  fill_leaving(300 * 1024);
  auto spec = small_run(root_, {"train.steps=40", "checkpoint.interval=4", "checkpoint.keep_last=2",
                                "checkpoint.mode=async", "checkpoint.on_error=warn",
                                // no direct_io probe: its "No space left" would free the space before a save fails
                                "checkpoint.direct_io=false"});
  const fs::path log = root_ / "train.log";
  Process p(train_argv(spec), {}, log.string());
  // Free the space as soon as the first failure is reported.
  bool freed = false;
  const double deadline = monotonic_s() + 300;
  while (!p.poll() && monotonic_s() < deadline) {
    if (!freed && contains(read_text_file(log.string()), "No space left on device")) {
      fs::remove(mnt_ / "filler");
      freed = true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  const int status = p.wait_for(30);
  const std::string out = read_text_file(log.string());
  EXPECT_TRUE(freed) << "no save failed: " << tail(out);
  EXPECT_EQ(status, 0) << tail(out);
  EXPECT_TRUE(contains(out, "warning")) << tail(out);
  const auto steps = committed_steps(mnt_);
  ASSERT_FALSE(steps.empty());
  EXPECT_EQ(steps.back(), 40) << tail(out);
  for (int64_t s : steps) EXPECT_EQ(verify_problems(mnt_ / ("step_" + std::to_string(s))), "") << s;
}

}  // namespace
}  // namespace reliability
