#include "comm/launch_env.h"

#include <gtest/gtest.h>

#include <map>
#include <stdexcept>
#include <string>

namespace comm {
namespace {

EnvLookup env_of(std::map<std::string, std::string> vars) {
  return [vars = std::move(vars)](const std::string& name)
             -> std::optional<std::string> {
    auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  };
}

// The message of the std::invalid_argument that `detect` throws.
template <typename F>
std::string invalid_argument_message(F detect) {
  try {
    detect();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected std::invalid_argument";
  return "";
}

TEST(LaunchEnv, TorchrunVariablesGiveRankWorldAndMaster) {
  LaunchEnv env = detect_launch_env(env_of({{"RANK", "3"},
                                            {"WORLD_SIZE", "8"},
                                            {"LOCAL_RANK", "1"},
                                            {"MASTER_ADDR", "10.0.0.7"},
                                            {"MASTER_PORT", "29611"}}));
  EXPECT_EQ(env.source, LaunchSource::kTorchrun);
  EXPECT_EQ(env.rank, 3);
  EXPECT_EQ(env.world_size, 8);
  EXPECT_EQ(env.local_rank, 1);
  EXPECT_EQ(env.master_addr, "10.0.0.7");
  EXPECT_EQ(env.master_port, 29611);
}

TEST(LaunchEnv, TorchrunWinsOverSlurmWhenBothAreSet) {
  LaunchEnv env = detect_launch_env(env_of({{"RANK", "1"},
                                            {"WORLD_SIZE", "2"},
                                            {"SLURM_PROCID", "0"},
                                            {"SLURM_NTASKS", "1"}}));
  EXPECT_EQ(env.source, LaunchSource::kTorchrun);
  EXPECT_EQ(env.rank, 1);
}

TEST(LaunchEnv, SlurmVariablesWithMasterAddrFromEnvironment) {
  LaunchEnv env = detect_launch_env(
      env_of({{"SLURM_PROCID", "5"},
              {"SLURM_NTASKS", "16"},
              {"SLURM_LOCALID", "1"},
              {"SLURM_JOB_NODELIST", "gpu[01-04]"},
              {"MASTER_ADDR", "gpu01"}}),
      "from-config", 0);
  EXPECT_EQ(env.source, LaunchSource::kSlurm);
  EXPECT_EQ(env.rank, 5);
  EXPECT_EQ(env.world_size, 16);
  EXPECT_EQ(env.local_rank, 1);
  EXPECT_EQ(env.master_addr, "gpu01");
  EXPECT_EQ(env.master_port, 29500);
}

TEST(LaunchEnv, SlurmUsesConfigAddressAndPortWhenEnvironmentHasNone) {
  LaunchEnv env = detect_launch_env(
      env_of({{"SLURM_PROCID", "0"},
              {"SLURM_NTASKS", "4"},
              {"SLURM_LOCALID", "0"},
              {"SLURM_JOB_NODELIST", "gpu[01-02]"}}),
      "head.cluster", 31000);
  EXPECT_EQ(env.master_addr, "head.cluster");
  EXPECT_EQ(env.master_port, 31000);
}

// One SLURM task of a 2-task job `job_id` on node n1, with no port set.
std::map<std::string, std::string> slurm_job(const std::string& job_id) {
  return {{"SLURM_PROCID", "0"},
          {"SLURM_NTASKS", "2"},
          {"SLURM_LOCALID", "0"},
          {"SLURM_JOB_NODELIST", "n1"},
          {"SLURM_JOB_ID", job_id}};
}

TEST(LaunchEnv, SlurmJobsWithoutAPortGetOneFromTheirJobId) {
  LaunchEnv env = detect_launch_env(env_of(slurm_job("1234567")));
  EXPECT_EQ(env.master_port, 19567);
  EXPECT_EQ(env.master_port_source, "SLURM_JOB_ID=1234567");
  // Two jobs sharing a node: consecutive ids, different ports.
  EXPECT_EQ(detect_launch_env(env_of(slurm_job("1234568"))).master_port, 19568);
  EXPECT_EQ(detect_launch_env(env_of(slurm_job("42"))).master_port, 15042);
  EXPECT_EQ(detect_launch_env(env_of(slurm_job("10000"))).master_port, 15000);
  // Ids beyond an int still give a port: only the last four digits count.
  EXPECT_EQ(detect_launch_env(env_of(slurm_job("4294967295"))).master_port, 22295);
}

TEST(LaunchEnv, MasterPortWinsOverThePortFromTheSlurmJobId) {
  std::map<std::string, std::string> vars = slurm_job("1234567");
  vars["MASTER_PORT"] = "29611";
  LaunchEnv env = detect_launch_env(env_of(vars), "", 31000);
  EXPECT_EQ(env.master_port, 29611);
  EXPECT_EQ(env.master_port_source, "MASTER_PORT");
}

TEST(LaunchEnv, ConfigPortWinsOverThePortFromTheSlurmJobId) {
  LaunchEnv env = detect_launch_env(env_of(slurm_job("1234567")), "", 31000);
  EXPECT_EQ(env.master_port, 31000);
  EXPECT_EQ(env.master_port_source, "dist.master_port");
}

TEST(LaunchEnv, TorchrunUnderSlurmIgnoresTheSlurmJobId) {
  LaunchEnv env = detect_launch_env(env_of({{"RANK", "0"},
                                            {"WORLD_SIZE", "2"},
                                            {"SLURM_PROCID", "0"},
                                            {"SLURM_NTASKS", "1"},
                                            {"SLURM_JOB_ID", "1234567"}}));
  EXPECT_EQ(env.source, LaunchSource::kTorchrun);
  EXPECT_EQ(env.master_port, 29500);
  EXPECT_EQ(env.master_port_source, "");
}

TEST(LaunchEnv, MalformedSlurmJobIdIsAnErrorNamingIt) {
  for (const char* bad : {"12a4", "", "-5", " 123", "1234_5"}) {
    std::string message = invalid_argument_message(
        [&] { detect_launch_env(env_of(slurm_job(bad))); });
    EXPECT_NE(message.find("SLURM_JOB_ID=\"" + std::string(bad) + "\""),
              std::string::npos)
        << message;
    EXPECT_NE(message.find("MASTER_PORT"), std::string::npos) << message;
  }
  // Not read when a port is set: nothing to derive.
  std::map<std::string, std::string> vars = slurm_job("12a4");
  vars["MASTER_PORT"] = "29611";
  EXPECT_EQ(detect_launch_env(env_of(vars)).master_port, 29611);
}

TEST(LaunchEnv, SlurmTakesFirstHostOfPlainNodelist) {
  LaunchEnv env = detect_launch_env(env_of({{"SLURM_PROCID", "1"},
                                            {"SLURM_NTASKS", "2"},
                                            {"SLURM_LOCALID", "0"},
                                            {"SLURM_JOB_NODELIST",
                                             "nodeA,nodeB"}}));
  EXPECT_EQ(env.master_addr, "nodeA");
}

TEST(LaunchEnv, SlurmFallsBackToSlurmNodelist) {
  LaunchEnv env = detect_launch_env(env_of({{"SLURM_PROCID", "0"},
                                            {"SLURM_NTASKS", "1"},
                                            {"SLURM_NODELIST", "solo"}}));
  EXPECT_EQ(env.master_addr, "solo");
}

TEST(LaunchEnv, BracketedNodelistWithoutAddressIsAnErrorThatSaysWhatToSet) {
  std::string message = invalid_argument_message([] {
    detect_launch_env(env_of({{"SLURM_PROCID", "0"},
                              {"SLURM_NTASKS", "8"},
                              {"SLURM_JOB_NODELIST", "node[01-04]"}}));
  });
  EXPECT_NE(message.find("SLURM_JOB_NODELIST"), std::string::npos) << message;
  EXPECT_NE(message.find("node[01-04]"), std::string::npos) << message;
  EXPECT_NE(message.find("MASTER_ADDR"), std::string::npos) << message;
  EXPECT_NE(message.find("dist.master_addr"), std::string::npos) << message;
}

TEST(LaunchEnv, NothingSetMeansSingleProcess) {
  LaunchEnv env = detect_launch_env(env_of({}));
  EXPECT_EQ(env.source, LaunchSource::kSingleProcess);
  EXPECT_EQ(env.rank, 0);
  EXPECT_EQ(env.world_size, 1);
  EXPECT_EQ(env.local_rank, 0);
  EXPECT_EQ(env.master_addr, "127.0.0.1");
  EXPECT_EQ(env.master_port, 29500);
  EXPECT_EQ(env.local_world_size, 1);
  EXPECT_EQ(env.node, 0);
  EXPECT_EQ(env.nodes, 1);
}

// What torchrun gives rank `rank` of 2 nodes x 2 ranks.
std::map<std::string, std::string> torchrun_two_by_two(int rank) {
  return {{"RANK", std::to_string(rank)},
          {"WORLD_SIZE", "4"},
          {"LOCAL_RANK", std::to_string(rank % 2)},
          {"LOCAL_WORLD_SIZE", "2"},
          {"GROUP_RANK", std::to_string(rank / 2)},
          {"GROUP_WORLD_SIZE", "2"}};
}

TEST(LaunchEnv, TorchrunTwoNodesOfTwoPutEachRankOnItsNode) {
  for (int rank = 0; rank < 4; ++rank) {
    LaunchEnv env = detect_launch_env(env_of(torchrun_two_by_two(rank)));
    EXPECT_EQ(env.rank, rank);
    EXPECT_EQ(env.world_size, 4);
    EXPECT_EQ(env.local_rank, rank % 2);
    EXPECT_EQ(env.local_world_size, 2);
    EXPECT_EQ(env.node, rank / 2);
    EXPECT_EQ(env.nodes, 2);
  }
}

TEST(LaunchEnv, TorchrunWithoutGroupVariablesDerivesNodesFromLocalWorldSize) {
  std::map<std::string, std::string> vars = torchrun_two_by_two(3);
  vars.erase("GROUP_RANK");
  vars.erase("GROUP_WORLD_SIZE");
  vars.erase("LOCAL_RANK");
  LaunchEnv env = detect_launch_env(env_of(vars));
  EXPECT_EQ(env.node, 1);
  EXPECT_EQ(env.nodes, 2);
  EXPECT_EQ(env.local_rank, 1);
  EXPECT_EQ(env.local_world_size, 2);
}

TEST(LaunchEnv, TorchrunWithoutLocalWorldSizeIsOneNodeOfAllRanks) {
  LaunchEnv env = detect_launch_env(env_of({{"RANK", "3"}, {"WORLD_SIZE", "4"}}));
  EXPECT_EQ(env.local_rank, 3);
  EXPECT_EQ(env.local_world_size, 4);
  EXPECT_EQ(env.node, 0);
  EXPECT_EQ(env.nodes, 1);
}

TEST(LaunchEnv, TorchrunWorldSizeThatIsNotAMultipleOfLocalWorldSizeIsAnError) {
  std::string message = invalid_argument_message([] {
    detect_launch_env(env_of({{"RANK", "0"}, {"WORLD_SIZE", "6"}, {"LOCAL_WORLD_SIZE", "4"}}));
  });
  EXPECT_NE(message.find("WORLD_SIZE=\"6\""), std::string::npos) << message;
  EXPECT_NE(message.find("LOCAL_WORLD_SIZE=4"), std::string::npos) << message;
}

TEST(LaunchEnv, InconsistentTorchrunNodeVariablesAreErrorsNamingTheVariable) {
  struct Case {
    const char* var;
    const char* value;
    const char* named;  // in the message
  };
  for (const Case& c : {Case{"GROUP_RANK", "2", "GROUP_RANK=\"2\""},
                        Case{"LOCAL_RANK", "2", "LOCAL_RANK=\"2\""},
                        Case{"GROUP_WORLD_SIZE", "3", "GROUP_WORLD_SIZE=3"},
                        Case{"LOCAL_WORLD_SIZE", "3", "LOCAL_WORLD_SIZE=3"},
                        Case{"LOCAL_WORLD_SIZE", "0", "LOCAL_WORLD_SIZE=\"0\""},
                        Case{"GROUP_WORLD_SIZE", "0", "GROUP_WORLD_SIZE=\"0\""}}) {
    std::map<std::string, std::string> vars = torchrun_two_by_two(1);
    vars[c.var] = c.value;
    std::string message = invalid_argument_message([&] { detect_launch_env(env_of(vars)); });
    EXPECT_NE(message.find(c.named), std::string::npos) << c.var << "=" << c.value << ": " << message;
  }
}

TEST(LaunchEnv, MalformedNodeVariablesAreErrorsNamingTheVariableAndValue) {
  for (const char* var : {"LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "LOCAL_RANK"}) {
    for (const char* bad : {"", "-1", "x", "1.5", "2 "}) {
      std::map<std::string, std::string> vars = torchrun_two_by_two(1);
      vars[var] = bad;
      std::string message = invalid_argument_message([&] { detect_launch_env(env_of(vars)); });
      EXPECT_NE(message.find(std::string(var) + "=\"" + bad + "\""), std::string::npos)
          << message;
    }
  }
  for (const char* var : {"SLURM_NODEID", "SLURM_NNODES"}) {
    std::string message = invalid_argument_message([&] {
      detect_launch_env(env_of({{"SLURM_PROCID", "0"},
                                {"SLURM_NTASKS", "4"},
                                {"SLURM_NODELIST", "solo"},
                                {var, "-1"}}));
    });
    EXPECT_NE(message.find(std::string(var) + "=\"-1\""), std::string::npos) << message;
  }
}

// What srun gives task `rank` of 2 nodes x 4 tasks.
std::map<std::string, std::string> slurm_two_by_four(int rank) {
  return {{"SLURM_PROCID", std::to_string(rank)},
          {"SLURM_NTASKS", "8"},
          {"SLURM_LOCALID", std::to_string(rank % 4)},
          {"SLURM_NODEID", std::to_string(rank / 4)},
          {"SLURM_NNODES", "2"},
          {"SLURM_NTASKS_PER_NODE", "4"},
          {"SLURM_JOB_NODELIST", "gpu01,gpu02"}};
}

TEST(LaunchEnv, SlurmNodeVariablesPutEachTaskOnItsNode) {
  for (int rank = 0; rank < 8; ++rank) {
    LaunchEnv env = detect_launch_env(env_of(slurm_two_by_four(rank)));
    EXPECT_EQ(env.source, LaunchSource::kSlurm);
    EXPECT_EQ(env.local_rank, rank % 4);
    EXPECT_EQ(env.local_world_size, 4);
    EXPECT_EQ(env.node, rank / 4);
    EXPECT_EQ(env.nodes, 2);
  }
}

TEST(LaunchEnv, SlurmTasksPerNodeThatIsNoPlainNumberComesFromTheDivision) {
  std::map<std::string, std::string> vars = slurm_two_by_four(5);
  vars["SLURM_NTASKS_PER_NODE"] = "4(x2)";
  LaunchEnv env = detect_launch_env(env_of(vars));
  EXPECT_EQ(env.local_world_size, 4);
  EXPECT_EQ(env.node, 1);
  vars.erase("SLURM_NTASKS_PER_NODE");
  vars.erase("SLURM_NODEID");
  env = detect_launch_env(env_of(vars));
  EXPECT_EQ(env.local_world_size, 4);
  EXPECT_EQ(env.node, 1);
}

TEST(LaunchEnv, SlurmUnevenTasksPerNodeIsAnErrorNamingTheVariables) {
  std::map<std::string, std::string> vars = slurm_two_by_four(0);
  vars["SLURM_NTASKS"] = "7";
  vars["SLURM_NTASKS_PER_NODE"] = "4,3";
  std::string message = invalid_argument_message([&] { detect_launch_env(env_of(vars)); });
  EXPECT_NE(message.find("SLURM_NTASKS=\"7\""), std::string::npos) << message;
  EXPECT_NE(message.find("SLURM_NNODES=2"), std::string::npos) << message;
  EXPECT_NE(message.find("SLURM_NTASKS_PER_NODE=\"4,3\""), std::string::npos) << message;
}

TEST(LaunchEnv, InconsistentSlurmNodeVariablesAreErrorsNamingTheVariable) {
  std::map<std::string, std::string> vars = slurm_two_by_four(5);
  vars["SLURM_NODEID"] = "2";
  std::string message = invalid_argument_message([&] { detect_launch_env(env_of(vars)); });
  EXPECT_NE(message.find("SLURM_NODEID=\"2\""), std::string::npos) << message;
  EXPECT_NE(message.find("SLURM_NNODES=2"), std::string::npos) << message;

  vars = slurm_two_by_four(5);
  vars["SLURM_LOCALID"] = "4";
  message = invalid_argument_message([&] { detect_launch_env(env_of(vars)); });
  EXPECT_NE(message.find("SLURM_LOCALID=\"4\""), std::string::npos) << message;

  vars = slurm_two_by_four(5);
  vars["SLURM_NTASKS_PER_NODE"] = "3";  // 2 x 3 slots for 8 tasks
  message = invalid_argument_message([&] { detect_launch_env(env_of(vars)); });
  EXPECT_NE(message.find("SLURM_NTASKS=\"8\""), std::string::npos) << message;
}

TEST(LaunchEnv, MalformedRankIsAnErrorNamingRankAndItsValue) {
  for (const char* bad : {"", "1x", "-1", " 1", "+1", "99999999999"}) {
    std::string message = invalid_argument_message([&] {
      detect_launch_env(env_of({{"RANK", bad}, {"WORLD_SIZE", "4"}}));
    });
    EXPECT_NE(message.find("RANK=\"" + std::string(bad) + "\""),
              std::string::npos)
        << message;
  }
}

TEST(LaunchEnv, RankNotBelowWorldSizeIsAnError) {
  std::string message = invalid_argument_message([] {
    detect_launch_env(env_of({{"RANK", "4"}, {"WORLD_SIZE", "4"}}));
  });
  EXPECT_NE(message.find("RANK=\"4\""), std::string::npos) << message;
  EXPECT_NE(message.find("WORLD_SIZE=4"), std::string::npos) << message;
}

TEST(LaunchEnv, ZeroWorldSizeIsAnError) {
  std::string message = invalid_argument_message([] {
    detect_launch_env(env_of({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "0"}}));
  });
  EXPECT_NE(message.find("SLURM_NTASKS"), std::string::npos) << message;
}

TEST(LaunchEnv, RankWithoutWorldSizeIsAnErrorNamingWorldSize) {
  std::string message = invalid_argument_message(
      [] { detect_launch_env(env_of({{"RANK", "0"}})); });
  EXPECT_NE(message.find("WORLD_SIZE"), std::string::npos) << message;
}

TEST(LaunchEnv, PortOutOfRangeIsAnErrorNamingMasterPort) {
  std::string message = invalid_argument_message([] {
    detect_launch_env(env_of({{"RANK", "0"},
                              {"WORLD_SIZE", "1"},
                              {"MASTER_PORT", "70000"}}));
  });
  EXPECT_NE(message.find("MASTER_PORT=\"70000\""), std::string::npos)
      << message;
}

TEST(LaunchEnv, LocalLauncherVariablesSayTheStoreIsHostedAndNameTheJob) {
  LaunchEnv env = detect_launch_env(env_of({{"RANK", "1"},
                                            {"WORLD_SIZE", "2"},
                                            {"SHARDKIT_STORE_HOSTED", "1"},
                                            {"SHARDKIT_JOB_ID", "0123456789abcdef"},
                                            {"TORCHELASTIC_RUN_ID", "ignored"}}));
  EXPECT_TRUE(env.store_hosted);
  EXPECT_EQ(env.job_id, "0123456789abcdef");
}

TEST(LaunchEnv, TorchrunRunIdNamesTheJobAndRankZeroServesTheStore) {
  LaunchEnv env = detect_launch_env(
      env_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"TORCHELASTIC_RUN_ID", "run-7"}}));
  EXPECT_FALSE(env.store_hosted);
  EXPECT_EQ(env.job_id, "run-7");
}

TEST(LaunchEnv, TorchrunsAgentStoreIsUsedByEveryRankAndTheRestartIsRead) {
  LaunchEnv env = detect_launch_env(env_of({{"RANK", "0"},
                                            {"WORLD_SIZE", "2"},
                                            {"TORCHELASTIC_RUN_ID", "run-7"},
                                            {"TORCHELASTIC_USE_AGENT_STORE", "True"},
                                            {"TORCHELASTIC_RESTART_COUNT", "2"}}));
  EXPECT_TRUE(env.store_hosted);
  EXPECT_TRUE(env.agent_store);
  EXPECT_EQ(env.restart_count, 2);
  // torchrun 1.x and TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 say False: rank 0 serves.
  LaunchEnv own = detect_launch_env(env_of({{"RANK", "0"},
                                            {"WORLD_SIZE", "2"},
                                            {"TORCHELASTIC_USE_AGENT_STORE", "False"},
                                            {"TORCHELASTIC_RESTART_COUNT", "0"}}));
  EXPECT_FALSE(own.store_hosted);
  EXPECT_FALSE(own.agent_store);
  EXPECT_EQ(own.restart_count, 0);
  EXPECT_THROW(detect_launch_env(env_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"TORCHELASTIC_RESTART_COUNT", "x"}})),
               std::invalid_argument);
}

TEST(LaunchEnv, WithoutAJobIdNoneIsChecked) {
  LaunchEnv env = detect_launch_env(env_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}}));
  EXPECT_FALSE(env.store_hosted);
  EXPECT_EQ(env.job_id, "");
}

TEST(LaunchEnv, StoreHostedOtherThanZeroOrOneIsAnError) {
  std::string message = invalid_argument_message([] {
    detect_launch_env(env_of({{"SHARDKIT_STORE_HOSTED", "yes"}}));
  });
  EXPECT_NE(message.find("SHARDKIT_STORE_HOSTED=\"yes\""), std::string::npos) << message;
}

TEST(LaunchEnv, NewJobIdsAreSixteenHexDigitsAndDiffer) {
  const std::string a = new_job_id();
  const std::string b = new_job_id();
  EXPECT_EQ(a.size(), 16u);
  EXPECT_EQ(a.find_first_not_of("0123456789abcdef"), std::string::npos) << a;
  EXPECT_NE(a, b);
}

TEST(LaunchEnv, SourceNamesAreShortWords) {
  EXPECT_EQ(to_string(LaunchSource::kSingleProcess), "single");
  EXPECT_EQ(to_string(LaunchSource::kTorchrun), "torchrun");
  EXPECT_EQ(to_string(LaunchSource::kSlurm), "slurm");
}

TEST(LaunchEnv, ProcessEnvReadsTheRealEnvironment) {
  ::setenv("SHARDKIT_TEST_LAUNCH_ENV", "42", 1);
  EnvLookup env = process_env();
  EXPECT_EQ(env("SHARDKIT_TEST_LAUNCH_ENV"), std::optional<std::string>("42"));
  ::unsetenv("SHARDKIT_TEST_LAUNCH_ENV");
  EXPECT_EQ(env("SHARDKIT_TEST_LAUNCH_ENV"), std::nullopt);
}

}  // namespace
}  // namespace comm
