// run.host_malloc: glibc's thresholds, observed through malloc's own
// statistics and the process's page faults. Each test is its own process
// (gtest_discover_tests), so one test's mallopt does not reach another.
#include "comm/host_malloc.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <stdexcept>
#include <string>

#include <sys/resource.h>
#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace comm {
namespace {

// Writes every page through a volatile pointer: a memset before free is a
// dead store the compiler may drop.
void touch(char* p, std::size_t n, char value) {
  volatile char* v = p;
  for (std::size_t i = 0; i < n; i += 4096) v[i] = value;
}

long minor_faults() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_minflt;
}

TEST(HostMalloc, AnUnknownModeIsAnErrorNamingTheKey) {
  try {
    parse_host_malloc("hold");
    FAIL() << "no error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("run.host_malloc"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("hold"), std::string::npos) << e.what();
  }
}

#if defined(__GLIBC__)
constexpr std::size_t kBlock = std::size_t{16} << 20;  // above glibc's 128 KiB default

TEST(HostMalloc, KeepServesLargeBlocksFromTheHeapAndReusesThemWithoutFaults) {
  ASSERT_EQ(apply_host_malloc(HostMalloc::kKeep), HostMallocOutcome::kKept);
  const std::size_t mmapped_before = mallinfo2().hblkhd;
  auto* a = static_cast<char*>(std::malloc(kBlock));
  ASSERT_NE(a, nullptr);
  // Below the 32 MiB threshold: from the heap, not a mapping of its own.
  EXPECT_EQ(mallinfo2().hblkhd, mmapped_before);
  touch(a, kBlock, 1);
  std::free(a);
  // Freed, it stays in the process (the trim threshold is 1 GiB)...
  EXPECT_GE(mallinfo2().fordblks, kBlock);
  // ...so the next step's block of the same size is there, faulted in already
  // (4096 faults for 16 MiB of 4 KiB pages otherwise, at least 8 with huge pages).
  const long before = minor_faults();
  auto* b = static_cast<char*>(std::malloc(kBlock));
  ASSERT_NE(b, nullptr);
  touch(b, kBlock, 2);
  const long faults = minor_faults() - before;
  std::free(b);
  EXPECT_LT(faults, 8) << "a freed 16 MiB block was given back and faulted in again";
}

TEST(HostMalloc, DefaultLeavesGlibcsThresholds) {
  ASSERT_EQ(apply_host_malloc(HostMalloc::kDefault), HostMallocOutcome::kDefault);
  // glibc's own threshold (128 KiB at start) maps a 16 MiB block by itself.
  const std::size_t mmapped_before = mallinfo2().hblkhd;
  void* a = std::malloc(kBlock);
  ASSERT_NE(a, nullptr);
  EXPECT_GE(mallinfo2().hblkhd, mmapped_before + kBlock);
  std::free(a);
}

TEST(HostMalloc, MallocVariablesInTheEnvironmentWinOverKeep) {
  for (const char* name : {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_"}) {
    SCOPED_TRACE(name);
    ASSERT_EQ(setenv(name, "65536", 1), 0);
    EXPECT_EQ(apply_host_malloc(HostMalloc::kKeep), HostMallocOutcome::kEnvironment);
    ASSERT_EQ(unsetenv(name), 0);
  }
  // Nothing was set: a 16 MiB block is still mapped on its own.
  const std::size_t mmapped_before = mallinfo2().hblkhd;
  void* a = std::malloc(kBlock);
  ASSERT_NE(a, nullptr);
  EXPECT_GE(mallinfo2().hblkhd, mmapped_before + kBlock);
  std::free(a);
}
#endif

}  // namespace
}  // namespace comm
