// Tests that are meant to go wrong: the material for skip_rule.cmake, which
// runs them under ctest with the project's skip rule and checks what ctest
// makes of each. Not registered with the project's ctest itself.
#include "support/skip.h"

#include <gtest/gtest.h>

#include <unistd.h>

#include <sys/stat.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <stdexcept>
#include <string>
#include <thread>

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

int count_environment() {
  int n = 0;
  for (char** e = environ; *e != nullptr; ++e) ++n;
  return n;
}

// For fork_server_check.sh (the fork server, comm/fork_server.h); without
// their variables they pass.
TEST(ForkProbe, ReportsItsProcess) {
  const char* out = std::getenv("SHARDKIT_FORK_PROBE_OUT");
  if (out == nullptr) return;
  char cwd[4096] = "";
  ASSERT_NE(getcwd(cwd, sizeof cwd), nullptr);
  const mode_t mask = umask(0);
  std::string first_line;
  std::getline(std::cin, first_line);
  std::ofstream(out) << "env=" << (std::getenv("SHARDKIT_FORK_PROBE") ? std::getenv("SHARDKIT_FORK_PROBE") : "")
                     << "\ncwd=" << cwd << "\numask=" << std::oct << mask << std::dec << "\nstdin=" << first_line
                     << "\nenvc=" << count_environment() << "\npid=" << getpid() << "\nppid=" << getppid() << "\n";
  std::cout << "probe stdout" << std::endl;
  std::cerr << "probe stderr" << std::endl;
}

TEST(ForkProbe, DiesOfTheSignalItIsAsked) {
  if (const char* sig = std::getenv("SHARDKIT_FORK_PROBE_SIGNAL")) std::raise(std::atoi(sig));
}

TEST(ForkProbe, SleepsUntilKilledWhenAsked) {
  const char* pid_file = std::getenv("SHARDKIT_FORK_PROBE_SLEEP");
  if (pid_file == nullptr) return;
  std::ofstream(std::string(pid_file) + ".tmp") << getpid() << "\n";
  std::rename((std::string(pid_file) + ".tmp").c_str(), pid_file);
  std::this_thread::sleep_for(std::chrono::seconds(120));
}

}  // namespace
