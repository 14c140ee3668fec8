// A rank's CPU thread pools (LibTorch's and, on OpenBLAS, the BLAS's) are
// sized to its share of the machine's cores. Each TEST runs in its own process
// (gtest_discover_tests), so changing the process-wide pools here is safe.
#include "framework/dist/cpu_threads.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <iostream>
#include <map>
#include <optional>
#include <string>
#include <thread>

namespace framework::dist {
namespace {

EnvLookup env_of(const std::map<std::string, std::string>& vars) {
  return [vars](const std::string& name) -> std::optional<std::string> {
    auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  };
}

TEST(CpuThreads, CoresAreSharedEvenlyAmongLocalRanksAndNeverZero) {
  EXPECT_EQ(cpu_threads_per_rank(2, 1), 2);
  EXPECT_EQ(cpu_threads_per_rank(2, 2), 1);
  EXPECT_EQ(cpu_threads_per_rank(16, 3), 5);
  EXPECT_EQ(cpu_threads_per_rank(2, 4), 1);   // more ranks than cores
  EXPECT_EQ(cpu_threads_per_rank(2, 0), 2);   // malformed LOCAL_WORLD_SIZE: one rank
  EXPECT_EQ(cpu_threads_per_rank(0, 1), 1);   // hardware_concurrency() unknown
}

TEST(CpuThreads, SettingThreadsSizesTorchAndOpenBlasWhenPresent) {
  bool on_openblas = openblas_threads() > 0;
  EXPECT_EQ(set_cpu_threads(1), on_openblas);
  EXPECT_EQ(torch::get_num_threads(), 1);
  EXPECT_EQ(openblas_threads(), on_openblas ? 1 : 0);
  std::cout << (on_openblas ? "BLAS: OpenBLAS" : "BLAS: not OpenBLAS (pool not sized)") << std::endl;
}

TEST(CpuThreads, LocalWorldSizeGivesEachRankItsShare) {
  int cores = static_cast<int>(std::thread::hardware_concurrency());
  int expected = cpu_threads_per_rank(cores, 2);
  EXPECT_EQ(share_cpu_threads_among_local_ranks(env_of({{"LOCAL_WORLD_SIZE", "2"}})), expected);
  EXPECT_EQ(torch::get_num_threads(), expected);
  if (openblas_threads() > 0) {
    EXPECT_EQ(openblas_threads(), expected);
  }
}

TEST(CpuThreads, WithoutLocalWorldSizeThePoolsAreLeftAlone) {
  int before = torch::get_num_threads();
  int blas_before = openblas_threads();
  EXPECT_EQ(share_cpu_threads_among_local_ranks(env_of({})), 0);
  EXPECT_EQ(torch::get_num_threads(), before);
  EXPECT_EQ(openblas_threads(), blas_before);
}

}  // namespace
}  // namespace framework::dist
