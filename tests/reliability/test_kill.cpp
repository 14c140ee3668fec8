// kill -9 during training and saving: a rank, the launcher, or everything, in
// each checkpoint mode. Afterwards every committed checkpoint verifies, the
// newest one from before the kill is still there, a run with resume auto
// continues from the newest committed checkpoint, finishes, and its losses
// equal an uninterrupted run's bit for bit. scripts/fault-soak runs many more.
#include <gtest/gtest.h>

#include <tuple>

#include "reliability/harness.h"
#include "support/paths.h"

namespace reliability {
namespace {

fs::path work_dir() { return fs::path(testing_support::binary_dir()) / "reliability-work"; }

struct CiTrial {
  const char* mode;
  const char* kill_point;
  const char* victim;
  double delay;  // random: seconds after the first step; else the save number (step 2k)
};

// Every mode with every victim; kill points rotate through all three.
const CiTrial kCiTrials[] = {
    {"sync", "during_save", "rank1", 3},     {"async", "during_save", "rank0", 4},
    {"overlap", "during_save", "rank1", 5},  {"sync", "after_commit", "all", 2},
    {"async", "random", "all", 0.4},         {"overlap", "after_commit", "rank0", 6},
    {"sync", "random", "launcher", 0.3},     {"async", "after_commit", "launcher", 3},
    {"overlap", "random", "all", 0.6},       {"sync", "during_save", "rank0", 7},
    {"async", "during_save", "rank1", 8},    {"overlap", "during_save", "launcher", 4},
};

class KillTrialTest : public ::testing::TestWithParam<int> {};

TEST_P(KillTrialTest, NewestCommittedCheckpointSurvivesAndResumesBitExact) {
  const CiTrial& c = kCiTrials[GetParam()];
  std::string error;
  const auto reference = reference_losses(c.mode, work_dir() / "cache", &error);
  ASSERT_FALSE(reference.empty()) << error;
  KillTrial t;
  t.index = GetParam();
  t.mode = c.mode;
  t.kill_point = c.kill_point;
  t.victim = c.victim;
  t.delay_s = c.delay;
  t.root = work_dir() / ("kill_" + std::to_string(GetParam()));
  const KillOutcome o = run_kill_trial(t, reference);
  std::cout << "trial " << t.index << " mode " << t.mode << " kill " << t.kill_point << "("
            << t.delay_s << ") victim " << t.victim << ": " << o.state_at_kill << " -> " << o.summary
            << "\n  " << o.detail << std::endl;
  EXPECT_TRUE(o.ok) << o.summary << "\n" << o.detail << "\nlogs in " << t.root;
  if (o.ok) fs::remove_all(t.root);
}

INSTANTIATE_TEST_SUITE_P(Ci, KillTrialTest,
                         ::testing::Range(0, static_cast<int>(std::size(kCiTrials))));

TEST(KillHarness, LossesDoNotDependOnCheckpointMode) {
  std::string error;
  const auto sync = reference_losses("sync", work_dir() / "cache", &error);
  ASSERT_FALSE(sync.empty()) << error;
  for (const char* mode : {"async", "overlap"}) {
    const auto other = reference_losses(mode, work_dir() / "cache", &error);
    ASSERT_FALSE(other.empty()) << error;
    EXPECT_EQ(compare_losses(other, sync, 0), "") << mode;
  }
}

}  // namespace
}  // namespace reliability
