#pragma once
// The distributed runtime of one process: where it sits in the job, the
// rendezvous store, and its process groups.
//
// Call sequence (all ranks, same order): init_runtime; then new_group for any
// sub-groups (mesh axes) in the same order on every rank.
#include "framework/dist/launch_env.h"
#include "framework/dist/options.h"
#include "framework/dist/process_group.h"

#include <memory>
#include <string>
#include <vector>

namespace framework::dist {

class Rendezvous {
 public:
  struct Store;  // opaque c10d store
  // Rank 0 hosts the TCPStore at addr:port; every rank connects. Blocks until
  // all `world_size` ranks arrive or `timeout` passes (DistError).
  Rendezvous(const std::string& addr, int port, int rank, int world_size,
             std::chrono::milliseconds timeout);
  ~Rendezvous();

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }

  // A new Gloo (or NCCL) group over `ranks` (global ranks, ascending), with its
  // own store prefix "<name>/". Only members call it; blocks until all members
  // join. REQUIRES: every member creates its groups in the same order.
  std::shared_ptr<Group> new_group(const std::string& name, const std::vector<int>& ranks,
                                   const std::string& backend = "gloo");

 private:
  std::unique_ptr<Store> store_;
  std::string addr_;
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
};

// Resolves dist.backend ("auto" -> nccl for cuda when built with it, else
// gloo); throws std::invalid_argument for nccl in a build without CUDA.
std::string resolve_backend(const DistOptions& options, const std::string& device);

// (all ranks) Selects the device (`device`: "cpu" | "cuda", see
// select_device), then the rendezvous plus the "train" and "ckpt" groups
// over all ranks. Blocks until every rank arrived (DistError after
// options.timeout_s). With dist.backend auto on CUDA, the training group is
// NCCL when every local rank has a GPU of its own, else Gloo (several ranks
// on one GPU; NCCL refuses that), which stages CUDA tensors through the host.
std::unique_ptr<Runtime> init_runtime(const LaunchEnv& env, const DistOptions& options,
                                      const std::string& device);

// The LibTorch this binary was built against, e.g. "1.13".
std::string torch_version();
bool built_with_cuda();

}  // namespace framework::dist
