// main() of every test binary (linked instead of GTest::gtest_main).
//
// Why not gtest_main: GoogleTest marks the tests of a suite whose
// SetUpTestSuite threw as skipped and prints "[  SKIPPED ]" for them; the rule
// gtest_discover_tests gives ctest (that text in the output means skipped)
// wins over the exit status, so broken suites looked green. ctest cannot be
// told to drop that rule (set_tests_properties appends regular expressions),
// so here:
//  - gtest's printer is wrapped so that no line says "[  SKIPPED ]" (skips
//    read "[   SKIP   ]"): the old rule never matches;
//  - a skip is deliberate only when SHARDKIT_SKIP (skip.h) gave its reason,
//    and then, when nothing failed, this main prints "<marker> Suite.Test:
//    reason" last, which is what tests/CMakeLists.txt tells ctest to count as
//    a skip;
//  - any other skip makes the exit status 1, with a line naming it.
#include "comm/exit_now.h"
#include "comm/fork_server.h"
#include "support/skip.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#ifndef SHARDKIT_SKIP_MARKER
#error "SHARDKIT_SKIP_MARKER must be defined (tests/CMakeLists.txt)"
#endif

namespace {

using ::testing::TestInfo;
using ::testing::TestSuite;
using ::testing::UnitTest;

// The reason SHARDKIT_SKIP recorded for a test, or "" when it has none.
std::string skip_reason(const ::testing::TestResult& result) {
  for (int i = 0; i < result.test_property_count(); ++i) {
    const ::testing::TestProperty& p = result.GetTestProperty(i);
    if (std::string(p.key()) == testing_support::kSkipReasonProperty) return p.value();
  }
  return "";
}

std::string full_name(const TestInfo& info) {
  return std::string(info.test_suite_name()) + "." + info.name();
}

// One line per reason: the marker must start the line ctest matches.
std::string one_line(std::string text) {
  for (char& c : text) {
    if (c == '\n' || c == '\r') c = ' ';
  }
  return text;
}

std::string count_of(int n, const char* what) {
  return std::to_string(n) + " " + what + (n == 1 ? "" : "s");
}

// gtest's default printer, but skipped tests are printed as "[   SKIP   ]"
// (the per-test line and the summary); everything else is forwarded.
class SkipAwarePrinter : public ::testing::TestEventListener {
 public:
  explicit SkipAwarePrinter(TestEventListener* inner) : inner_(inner) {}

  void OnTestProgramStart(const UnitTest& u) override { inner_->OnTestProgramStart(u); }
  void OnTestIterationStart(const UnitTest& u, int i) override {
    inner_->OnTestIterationStart(u, i);
  }
  void OnEnvironmentsSetUpStart(const UnitTest& u) override { inner_->OnEnvironmentsSetUpStart(u); }
  void OnEnvironmentsSetUpEnd(const UnitTest& u) override { inner_->OnEnvironmentsSetUpEnd(u); }
  void OnTestSuiteStart(const TestSuite& s) override { inner_->OnTestSuiteStart(s); }
#ifndef GTEST_REMOVE_LEGACY_TEST_CASEAPI_
  void OnTestCaseStart(const ::testing::TestCase& s) override { inner_->OnTestCaseStart(s); }
  void OnTestCaseEnd(const ::testing::TestCase& s) override { inner_->OnTestCaseEnd(s); }
#endif
  void OnTestStart(const TestInfo& info) override { inner_->OnTestStart(info); }
  void OnTestPartResult(const ::testing::TestPartResult& r) override { inner_->OnTestPartResult(r); }
  void OnTestEnd(const TestInfo& info) override {
    if (!info.result()->Skipped()) return inner_->OnTestEnd(info);
    std::printf("[   SKIP   ] %s (%lld ms)\n", full_name(info).c_str(),
                static_cast<long long>(info.result()->elapsed_time()));
    std::fflush(stdout);
  }
  void OnTestSuiteEnd(const TestSuite& s) override { inner_->OnTestSuiteEnd(s); }
  void OnEnvironmentsTearDownStart(const UnitTest& u) override {
    inner_->OnEnvironmentsTearDownStart(u);
  }
  void OnEnvironmentsTearDownEnd(const UnitTest& u) override { inner_->OnEnvironmentsTearDownEnd(u); }
  void OnTestIterationEnd(const UnitTest& u, int i) override {
    if (u.skipped_test_count() == 0) return inner_->OnTestIterationEnd(u, i);
    print_summary(u);
  }
  void OnTestProgramEnd(const UnitTest& u) override { inner_->OnTestProgramEnd(u); }

 private:
  // What gtest's summary says, minus its "[  SKIPPED ]" lines.
  static void print_summary(const UnitTest& u) {
    std::printf("[==========] %s from %s ran. (%lld ms total)\n",
                count_of(u.test_to_run_count(), "test").c_str(),
                count_of(u.test_suite_to_run_count(), "test suite").c_str(),
                static_cast<long long>(u.elapsed_time()));
    std::printf("[  PASSED  ] %s.\n", count_of(u.successful_test_count(), "test").c_str());
    std::printf("[   SKIP   ] %s, listed below:\n", count_of(u.skipped_test_count(), "test").c_str());
    print_tests(u, "[   SKIP   ]", [](const ::testing::TestResult& r) { return r.Skipped(); });
    if (u.failed_test_count() > 0) {
      std::printf("[  FAILED  ] %s, listed below:\n", count_of(u.failed_test_count(), "test").c_str());
      print_tests(u, "[  FAILED  ]", [](const ::testing::TestResult& r) { return r.Failed(); });
    }
    for (int i = 0; i < u.total_test_suite_count(); ++i) {
      const TestSuite& s = *u.GetTestSuite(i);
      if (s.should_run() && s.ad_hoc_test_result().Failed()) {
        std::printf("[  FAILED  ] %s: SetUpTestSuite or TearDownTestSuite\n", s.name());
      }
    }
    std::fflush(stdout);
  }

  template <typename Pick>
  static void print_tests(const UnitTest& u, const char* tag, Pick pick) {
    for (int i = 0; i < u.total_test_suite_count(); ++i) {
      const TestSuite& s = *u.GetTestSuite(i);
      for (int j = 0; j < s.total_test_count(); ++j) {
        const TestInfo& info = *s.GetTestInfo(j);
        if (info.should_run() && pick(*info.result())) {
          std::printf("%s %s\n", tag, full_name(info).c_str());
        }
      }
    }
  }

  std::unique_ptr<TestEventListener> inner_;
};

// Sorts the skips into deliberate and unexplained, and has the last word on
// the exit status.
class SkipVerdict : public ::testing::EmptyTestEventListener {
 public:
  void OnTestEnd(const TestInfo& info) override {
    if (!info.result()->Skipped()) return;
    const std::string reason = skip_reason(*info.result());
    if (reason.empty()) {
      unexplained_.push_back(full_name(info));
    } else {
      deliberate_.push_back(full_name(info) + ": " + one_line(reason));
    }
  }

  // The exit status: RUN_ALL_TESTS's, or 1 when a skip had no reason.
  int finish(int status) const {
    for (const std::string& name : unexplained_) {
      std::printf("[  FAILED  ] %s was skipped without a reason: its suite's SetUpTestSuite "
                  "failed (see above), or it called GTEST_SKIP instead of SHARDKIT_SKIP "
                  "(tests/support/skip.h)\n",
                  name.c_str());
    }
    if (!unexplained_.empty()) status = 1;
    // Only a passing run may look skipped: ctest's skip rule wins over the
    // exit status.
    if (status == 0) {
      for (const std::string& line : deliberate_) {
        std::printf("%s %s\n", SHARDKIT_SKIP_MARKER, line.c_str());
      }
    }
    std::fflush(stdout);
    return status;
  }

 private:
  std::vector<std::string> deliberate_;
  std::vector<std::string> unexplained_;
};

}  // namespace

int main(int argc, char** argv) {
  // Under ctest: the server's forks of this process return here as the tests
  // (comm/fork_server.h).
  comm::serve_forks_if_asked(argc, argv);
  ::testing::InitGoogleTest(&argc, argv);
  ::testing::TestEventListeners& listeners = ::testing::UnitTest::GetInstance()->listeners();
  // Null under --gtest_brief or when output goes elsewhere; then there is
  // nothing to wrap.
  if (::testing::TestEventListener* printer = listeners.default_result_printer()) {
    listeners.Append(new SkipAwarePrinter(listeners.Release(printer)));
  }
  auto* verdict = new SkipVerdict;  // the listener list owns it
  listeners.Append(verdict);
  const int status = verdict->finish(RUN_ALL_TESTS());
  // No static destructors (comm/exit_now.h): nothing a test checks runs in
  // them (gtest has printed and written its results).
  comm::exit_now(status);
}
