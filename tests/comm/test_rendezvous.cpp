// Rendezvous over real c10d TCPStores on loopback: who serves the store, and
// how a rank refuses a store that belongs to another job.
#include "comm/launch_env.h"
#include "comm/local_launcher.h"
#include "comm/process_group.h"
#include "comm/runtime.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <future>
#include <set>
#include <string>
#include <thread>
#include <vector>

namespace comm {
namespace {

constexpr std::chrono::milliseconds kTimeout{10000};

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

LaunchEnv rank_env(int port, int rank, int world, bool hosted, const std::string& job_id) {
  LaunchEnv env;
  env.source = LaunchSource::kTorchrun;
  env.rank = rank;
  env.world_size = world;
  env.local_rank = rank;
  env.master_addr = "127.0.0.1";
  env.master_port = port;
  env.store_hosted = hosted;
  env.job_id = job_id;
  return env;
}

// The DistError message of Rendezvous(env), or "" when it connected.
std::string rendezvous_error(const LaunchEnv& env) {
  try {
    Rendezvous rv(env, kTimeout);
    return "";
  } catch (const DistError& e) {
    return e.what();
  }
}

// Sums rank+1 over a Gloo group of all ranks.
double sum_over_group(Rendezvous& rv) {
  std::vector<int> all(rv.world_size());
  for (int r = 0; r < rv.world_size(); ++r) all[r] = r;
  auto group = rv.new_group("train", all);
  at::Tensor t = at::full({1}, static_cast<double>(rv.rank() + 1), at::kDouble);
  group->all_reduce(t, ReduceOp::kSum);
  return t.item<double>();
}

TEST(HostedStore, RanksThatAllConnectAsClientsFormAGroup) {
  const std::string job_id = new_job_id();
  auto server = host_tcp_store("127.0.0.1", 0, job_id);  // returns without waiting
  ASSERT_GT(server->port(), 0);
  const int world = 3;
  std::vector<double> sums(world, 0);
  std::vector<std::thread> ranks;
  for (int r = 0; r < world; ++r) {
    ranks.emplace_back([&, r] {
      Rendezvous rv(rank_env(server->port(), r, world, /*hosted=*/true, job_id), kTimeout);
      sums[r] = sum_over_group(rv);
    });
  }
  for (auto& t : ranks) t.join();
  EXPECT_EQ(sums, std::vector<double>(world, 6.0));
}

TEST(HostedStore, ATakenPortIsAnErrorNamingIt) {
  auto first = host_tcp_store("127.0.0.1", 0, "job-a");
  const std::string where = "127.0.0.1:" + std::to_string(first->port());
  try {
    host_tcp_store("127.0.0.1", first->port(), "job-b");
    FAIL() << "a second server bound " << where;
  } catch (const DistError& e) {
    EXPECT_TRUE(contains(e.what(), "cannot serve the rendezvous store on " + where)) << e.what();
  }
}

// c10d (1.13) opens the store's sockets without close-on-exec; the launcher
// forks its ranks while serving, and they must not inherit them (a rank, or
// anything it starts, would keep the port open after the launcher died).
TEST(HostedStore, ItsSocketsDoNotLeakIntoTheLaunchersRanks) {
  auto inheritable = [] {
    std::set<int> fds;
    for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) {
      const int fd = std::stoi(entry.path().filename().string());
      const int flags = fcntl(fd, F_GETFD);
      if (flags >= 0 && (flags & FD_CLOEXEC) == 0) fds.insert(fd);
    }
    return fds;
  };
  std::string dir = (std::filesystem::temp_directory_path() / "shardkit-fds-XXXXXX").string();
  ASSERT_NE(mkdtemp(dir.data()), nullptr);
  LocalLaunchOptions options;
  options.nproc = 2;
  // The inner shell lists its own fds: the outer one keeps a copy of the
  // redirected stdout open (dash, at fd 10 or above).
  options.argv = {"/bin/sh", "-c", "sh -c 'ls /proc/$$/fd' > \"$1/fds.$RANK\"", "sh", dir};
  options.store_server = host_tcp_store;
  ASSERT_EQ(run_local_launcher(options), 0);
  std::set<int> expected = inheritable();  // what the test's caller passes down
  expected.insert({0, 1, 2});
  for (int k = 0; k < 2; ++k) {
    std::ifstream in(dir + "/fds." + std::to_string(k));
    std::set<int> seen;
    for (int fd; in >> fd;) seen.insert(fd);
    EXPECT_EQ(seen, expected) << "rank " << k;
  }
  std::filesystem::remove_all(dir);
}

TEST(JobId, RankRefusesTheHostedStoreOfAnotherJob) {
  auto server = host_tcp_store("127.0.0.1", 0, "job-a");
  const auto start = std::chrono::steady_clock::now();
  const std::string error =
      rendezvous_error(rank_env(server->port(), 1, 2, /*hosted=*/true, "job-b"));
  EXPECT_TRUE(contains(error, "rendezvous at 127.0.0.1:" + std::to_string(server->port()) +
                                  " belongs to another job (id job-a, expected job-b)"))
      << error;
  // A hosted store has its id already: no waiting for the timeout.
  EXPECT_LT(std::chrono::steady_clock::now() - start, kTimeout / 2);
}

// The failure this check exists for: a rank whose rank 0 lost the port to
// another job reaches that job's store instead (and used to die in Gloo with
// "address.cc:45 sizeof(impl_) == bytes.size()").
TEST(JobId, RankRefusesAnotherJobsStoreFoundAtItsMasterPort) {
  auto other_job = host_tcp_store("127.0.0.1", 0, "job-a");
  const std::string error =
      rendezvous_error(rank_env(other_job->port(), 1, 2, /*hosted=*/false, "job-b"));
  EXPECT_TRUE(contains(error, "belongs to another job (id job-a, expected job-b)")) << error;
}

TEST(JobId, RankWithoutAJobIdChecksNothing) {
  auto server = host_tcp_store("127.0.0.1", 0, "job-a");
  EXPECT_EQ(rendezvous_error(rank_env(server->port(), 0, 1, /*hosted=*/true, "")), "");
}

// A port nobody listened on a moment ago. Only tests that need rank 0 to
// serve a multi-rank store use it (as under torchrun, the port is given).
int unused_port() {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
  socklen_t len = sizeof addr;
  bind(fd, reinterpret_cast<sockaddr*>(&addr), len);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  close(fd);
  return ntohs(addr.sin_port);
}

// Runs rank 0 and rank 1 of a rank-0-served job as threads; returns their
// DistError messages ("" for success). With equal ids they sum over a group.
std::vector<std::string> rank_zero_job(const std::string& job0, const std::string& job1) {
  const int port = unused_port();
  std::vector<std::string> errors(2);
  // Rank 0 serves until rank 1 is done with the store.
  std::promise<void> rank1_done;
  std::shared_future<void> rank1_finished = rank1_done.get_future().share();
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.emplace_back([&, r] {
      try {
        Rendezvous rv(rank_env(port, r, 2, /*hosted=*/false, r == 0 ? job0 : job1), kTimeout);
        if (job0 == job1 && sum_over_group(rv) != 3.0) errors[r] = "wrong sum";
        if (r == 0) rank1_finished.wait_for(kTimeout);
      } catch (const DistError& e) {
        errors[r] = e.what();
      }
      if (r == 1) rank1_done.set_value();
    });
  }
  for (auto& t : ranks) t.join();
  return errors;
}

TEST(RankZeroServes, WhenNoLauncherDoesAndRecordsItsJobId) {
  EXPECT_EQ(rank_zero_job("job-z", "job-z"), (std::vector<std::string>{"", ""}));
  const std::vector<std::string> errors = rank_zero_job("job-z", "job-y");
  EXPECT_EQ(errors[0], "");
  EXPECT_TRUE(contains(errors[1], "belongs to another job (id job-z, expected job-y)"))
      << errors[1];
}

TEST(RankZeroServes, OnAnyFreePortWhenItIsTheOnlyRank) {
  // MASTER_PORT (29500 unless set) is taken; a one-rank job does not need it.
  auto taken = host_tcp_store("127.0.0.1", 0, "job-a");
  Rendezvous rv(rank_env(taken->port(), 0, 1, /*hosted=*/false, "job-b"), kTimeout);
  EXPECT_NE(rv.port(), taken->port());
  EXPECT_EQ(sum_over_group(rv), 1.0);
}

}  // namespace
}  // namespace comm
