#pragma once
// The distributed runtime of one process: where it sits in the job, the
// rendezvous store, and its process groups.
//
// Call sequence (all ranks, same order): init_runtime; then new_group for any
// sub-groups (mesh axes) in the same order on every rank.
#include "comm/launch_env.h"
#include "comm/options.h"
#include "comm/process_group.h"
#include "comm/store_server.h"

#include <map>
#include <memory>
#include <string>
#include <vector>

namespace comm {

// This rank's connection to the job's c10d TCPStore at
// env.master_addr:env.master_port.
//
// Who serves the store: with env.store_hosted, a launcher does (host_tcp_store)
// and every rank connects as a client. Otherwise rank 0 serves it and waits
// until all env.world_size ranks have connected; a job of one rank serves on
// any free port instead of master_port, since nobody else looks for it.
//
// Which job it belongs to: the store holds the job's id. The server writes it
// (host_tcp_store; rank 0 writes env.job_id, or a new_job_id() when that is
// empty), and every other rank with a non-empty env.job_id reads it (rank 0's
// after waiting for it) and throws DistError "rendezvous at ADDR:PORT belongs
// to another job (id X, expected Y)" when they differ, before any group can
// pick up another job's peers. A rank with an empty job_id checks nothing.
class Rendezvous {
 public:
  struct Store;  // opaque c10d store
  // Blocks until the store is reachable and its job id checked, or `timeout`
  // passes (DistError); rank 0 serving the store also waits for all ranks.
  Rendezvous(const LaunchEnv& env, std::chrono::milliseconds timeout);
  ~Rendezvous();

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  // The store's port: master_port, except for a one-rank job's own store.
  int port() const { return port_; }

  // A new Gloo (or NCCL) group over `ranks` (global ranks, ascending), with its
  // own store prefix "<name>/<k>/", k counting this rendezvous's groups of that
  // name (a second Trainer on one runtime makes its mesh groups again; they
  // must not meet the first ones' addresses in the store). Only members call
  // it; blocks until all members join. REQUIRES: every member creates its
  // groups in the same order.
  // REQUIRES: backend is kGloo or kNccl (resolve_backend).
  std::shared_ptr<Group> new_group(const std::string& name, const std::vector<int>& ranks,
                                   Backend backend = Backend::kGloo);

 private:
  // Throws DistError unless the store's job id is `expected`.
  void check_job_id(const std::string& expected, bool store_hosted);
  // "dist: rendezvous at <addr:port> failed for rank ..." with e's message.
  std::string rendezvous_failed(const std::exception& e) const;

  std::unique_ptr<Store> store_;
  std::map<std::string, int> groups_made_;  // by name: new_group's <k>
  std::string addr_;
  int port_ = 0;
  int rank_;
  int world_size_;
  std::chrono::milliseconds timeout_;
};

struct Runtime {
  LaunchEnv env;
  at::Device device{at::kCPU};        // train.device; CUDA: LOCAL_RANK % device count
  std::unique_ptr<Rendezvous> rendezvous;
  std::shared_ptr<Group> train;       // training collectives (Gloo or NCCL)
  std::shared_ptr<Group> checkpoint;  // checkpoint collectives, always Gloo
  // Where init_runtime's time went, for the trainer's start-up record:
  // this process's age (process_age_s, launch_env.h) when it was called, and
  // the seconds of the rendezvous and of building the two groups.
  struct StartupTimes {
    double called_at_s = 0;
    double rendezvous_s = 0;
    double groups_s = 0;
  };
  StartupTimes startup;
};

// Resolves dist.backend (auto -> nccl for cuda when built with it, else
// gloo): kGloo or kNccl; throws std::invalid_argument for nccl in a build
// without CUDA.
Backend resolve_backend(const DistOptions& options, DeviceKind device);

// (all ranks) Selects the device (`device`, see
// select_device), then the rendezvous plus the "train" and "ckpt" groups
// over all ranks. Blocks until every rank arrived (DistError after
// options.timeout_s). With dist.backend auto on CUDA, the training group is
// NCCL when every local rank has a GPU of its own, else Gloo (several ranks
// on one GPU; NCCL refuses that), which stages CUDA tensors through the host.
std::unique_ptr<Runtime> init_runtime(const LaunchEnv& env, const DistOptions& options,
                                      DeviceKind device);

// Serves a c10d TCPStore on addr:port (0: any free port) for ranks that all
// connect as clients (LaunchEnv::store_hosted), with `job_id` recorded for
// them to check; until the returned object is destroyed. Returns at once: it
// waits for no rank. Throws DistError naming addr:port when it cannot listen.
// Fits LocalLaunchOptions::store_server. REQUIRES: job_id is not empty.
std::unique_ptr<StoreServer> host_tcp_store(const std::string& addr, int port,
                                            const std::string& job_id);

// The LibTorch this binary was built against, e.g. "1.13".
std::string torch_version();
bool built_with_cuda();

}  // namespace comm
