#pragma once
// Runs a function as `world` ranks, one thread each, over a real TCPStore and
// real Gloo groups on 127.0.0.1. The test thread serves the store, as `train
// --nproc` does, so that tests running in parallel never race for a port. The
// first exception thrown by any rank is rethrown (with its rank) after all
// threads end.
#include "comm/launch_env.h"
#include "comm/runtime.h"

#include <torch/torch.h>

#include <chrono>
#include <exception>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace testing_support {

struct RankContext {
  int rank;
  int world;
  comm::Rendezvous& rendezvous;
  // All ranks, named "train" (a fresh group per call to make_group).
  std::shared_ptr<comm::Group> make_group(const std::string& name) {
    std::vector<int> all(world);
    for (int r = 0; r < world; ++r) all[r] = r;
    return rendezvous.new_group(name, all);
  }
};

// What rank `rank` of a job of `world` ranks on `server` knows: the launch
// environment `train --nproc` gives a rank.
inline comm::LaunchEnv hosted_rank_env(const comm::StoreServer& server,
                                                  const std::string& job_id, int rank,
                                                  int world) {
  comm::LaunchEnv env;
  env.source = comm::LaunchSource::kTorchrun;
  env.rank = rank;
  env.world_size = world;
  env.local_rank = rank;
  env.local_world_size = world;
  env.master_addr = "127.0.0.1";
  env.master_port = server.port();
  env.store_hosted = true;
  env.job_id = job_id;
  return env;
}

// The ranks of run_ranks and run_runtimes are threads of one process and
// share LibTorch's process-wide generator. Seed it, and make the draws that
// must follow the seed, under the returned lock, as the Trainer builds its
// model (Trainer::State::build_builtin_model): otherwise one rank's draws
// interleave with another's, and the ranks start from different models or
// batches. Never hold the lock across a collective (the other ranks would
// wait for it).
inline std::unique_lock<std::mutex> seed_global_generator(uint64_t seed) {
  static std::mutex mu;
  std::unique_lock<std::mutex> lock(mu);
  torch::manual_seed(seed);
  return lock;
}

inline void run_ranks(int world, const std::function<void(RankContext&)>& fn,
                      double timeout_s = 30.0) {
  const std::string job_id = comm::new_job_id();
  auto server = comm::host_tcp_store("127.0.0.1", 0, job_id);
  std::vector<std::thread> threads;
  std::mutex mu;
  std::exception_ptr first;
  int first_rank = -1;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        comm::Rendezvous rv(
            hosted_rank_env(*server, job_id, r, world),
            std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000)));
        RankContext ctx{r, world, rv};
        fn(ctx);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu);
        if (!first) {
          first = std::current_exception();
          first_rank = r;
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  if (first) {
    try {
      std::rethrow_exception(first);
    } catch (const std::exception& e) {
      throw std::runtime_error("rank " + std::to_string(first_rank) + ": " + e.what());
    }
  }
}

}  // namespace testing_support

namespace testing_support {

// Like run_ranks, but each rank gets a full comm::Runtime (store,
// "train" and "ckpt" groups) from init_runtime, as `train` builds it.
// `device` is train.device; every rank of a CUDA run shares
// GPU 0 (LOCAL_RANK % device count), over a Gloo training group beyond world 1.
inline void run_runtimes(int world, const std::function<void(comm::Runtime&)>& fn,
                         double timeout_s = 60.0,
                         comm::DeviceKind device = comm::DeviceKind::kCpu) {
  const std::string job_id = comm::new_job_id();
  auto server = comm::host_tcp_store("127.0.0.1", 0, job_id);
  std::vector<std::thread> threads;
  std::mutex mu;
  std::exception_ptr first;
  int first_rank = -1;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        comm::LaunchEnv env = hosted_rank_env(*server, job_id, r, world);
        comm::DistOptions options;
        options.timeout_s = timeout_s;
        auto rt = comm::init_runtime(env, options, device);
        fn(*rt);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu);
        if (!first) {
          first = std::current_exception();
          first_rank = r;
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  if (first) {
    try {
      std::rethrow_exception(first);
    } catch (const std::exception& e) {
      throw std::runtime_error("rank " + std::to_string(first_rank) + ": " + e.what());
    }
  }
}

}  // namespace testing_support
