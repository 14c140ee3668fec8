#pragma once
// SHARDKIT_SKIP(reason): the one way a test skips on purpose.
//
//   if (clang.empty()) SHARDKIT_SKIP("clang++ not found (Debian: clang)");
//   SHARDKIT_SKIP("cannot mount a tmpfs (" << std::strerror(errno) << ")");
//
// Use it in a test body or in SetUp(), not in SetUpTestSuite (GoogleTest 1.12
// runs the suite's tests anyway). It records the reason as the test property
// kSkipReasonProperty and then skips like GTEST_SKIP. test_main.cpp turns that
// into the line ctest counts as a skip; any skip without a reason (a bare
// GTEST_SKIP, or the tests of a suite whose SetUpTestSuite failed) makes the
// test binary exit 1 instead, so ctest reports a failure.
#include <gtest/gtest.h>

#include <sstream>

namespace testing_support {

// Where SHARDKIT_SKIP leaves its reason (also visible in --gtest_output=xml).
inline constexpr const char* kSkipReasonProperty = "shardkit_skip_reason";

}  // namespace testing_support

#define SHARDKIT_SKIP(reason)                                                       \
  do {                                                                              \
    std::ostringstream shardkit_skip_reason_;                                       \
    shardkit_skip_reason_ << reason;                                                \
    ::testing::Test::RecordProperty(::testing_support::kSkipReasonProperty,         \
                                    shardkit_skip_reason_.str());                   \
    GTEST_SKIP() << shardkit_skip_reason_.str();                                    \
  } while (false)
