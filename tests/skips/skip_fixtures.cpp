// Tests that are meant to go wrong: the material for skip_rule.cmake, which
// runs them under ctest with the project's skip rule and checks what ctest
// makes of each. Not registered with the project's ctest itself.
#include "support/skip.h"

#include <gtest/gtest.h>

#include <stdexcept>

namespace {

// The InteropTest / DamagedCheckpoints failure that once looked green.
class SuiteWhoseSetUpThrows : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { throw std::runtime_error("fixture data could not be made"); }
};

TEST_F(SuiteWhoseSetUpThrows, AnyTest) { SUCCEED(); }

TEST(Skips, BareGtestSkip) { GTEST_SKIP() << "a reason gtest prints, but not one we accept"; }

TEST(Skips, WithReason) { SHARDKIT_SKIP("no widget on this machine (install widget-dev)"); }

TEST(Skips, WithEmptyReason) { SHARDKIT_SKIP(""); }

TEST(Skips, WithReasonAfterAFailure) {
  ADD_FAILURE() << "a real failure";
  SHARDKIT_SKIP("skipping after a failure must not hide it");
}

class SkipsInSetUp : public ::testing::Test {
 protected:
  void SetUp() override { SHARDKIT_SKIP("cannot mount a tmpfs (" << 1 << ": Operation not permitted)"); }
};

TEST_F(SkipsInSetUp, WithReason) { ADD_FAILURE() << "not reached"; }

TEST(Passes, Plainly) { SUCCEED(); }

}  // namespace
