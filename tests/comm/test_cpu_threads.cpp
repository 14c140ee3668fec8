// A rank's CPU thread pools (LibTorch's and, on OpenBLAS, the BLAS's) are
// sized to its share of the machine's cores. Each TEST runs in its own process
// (gtest_discover_tests), so changing the process-wide pools here is safe.
#include "comm/cpu_threads.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <iostream>
#include <map>
#include <optional>
#include <string>
#include <thread>

namespace comm {
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

void expect_share_of(int local_ranks, const LaunchEnv& env) {
  int cores = static_cast<int>(std::thread::hardware_concurrency());
  int expected = cpu_threads_per_rank(cores, local_ranks);
  EXPECT_EQ(share_cpu_threads_among_local_ranks(env), expected);
  EXPECT_EQ(torch::get_num_threads(), expected);
  if (openblas_threads() > 0) {
    EXPECT_EQ(openblas_threads(), expected);
  }
}

TEST(CpuThreads, LocalWorldSizeGivesEachRankItsShare) {
  expect_share_of(2, detect_launch_env(env_of({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "1"},
                                              {"LOCAL_WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"},
                                              {"MASTER_PORT", "29500"}})));
}

// Plain `srun -n2` sets no SLURM_NTASKS_PER_NODE: the node's share comes
// from its tasks over its nodes, as the launch environment reads them.
TEST(CpuThreads, SlurmTasksOnOneNodeShareItsCores) {
  expect_share_of(2, detect_launch_env(env_of({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"},
                                              {"SLURM_LOCALID", "0"}, {"SLURM_NNODES", "1"},
                                              {"SLURM_NODEID", "0"}, {"SLURM_JOB_NODELIST", "vm"}})));
}

TEST(CpuThreads, ARankAloneOnItsNodeLeavesThePoolsAlone) {
  int before = torch::get_num_threads();
  int blas_before = openblas_threads();
  EXPECT_EQ(share_cpu_threads_among_local_ranks(detect_launch_env(env_of({}))), 0);
  EXPECT_EQ(torch::get_num_threads(), before);
  EXPECT_EQ(openblas_threads(), blas_before);
}

}  // namespace
}  // namespace comm
