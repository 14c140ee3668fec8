#include "framework/dist/runtime.h"

#include "framework/dist/device.h"
#include "framework/dist/torch_compat.h"

#include <algorithm>
#include <cstdlib>

#include <sstream>

namespace framework::dist {

Rendezvous::Rendezvous(const std::string& addr, int port, int rank, int world_size,
                       std::chrono::milliseconds timeout)
    : store_(std::make_unique<Store>()), addr_(addr), rank_(rank), world_size_(world_size),
      timeout_(timeout) {
  try {
    store_->store = compat::make_tcp_store(addr, port, rank == 0, world_size, timeout);
  } catch (const std::exception& e) {
    std::ostringstream msg;
    msg << "dist: rendezvous at " << addr << ":" << port << " failed for rank " << rank << " of "
        << world_size << " (timeout " << timeout.count() / 1000.0 << " s): " << e.what();
    throw DistError(msg.str());
  }
}

Rendezvous::~Rendezvous() = default;

std::shared_ptr<Group> Rendezvous::new_group(const std::string& name, const std::vector<int>& ranks,
                                             const std::string& backend) {
  int my_index = -1;
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (ranks[i] == rank_) my_index = static_cast<int>(i);
  }
  TORCH_CHECK(my_index >= 0, "new_group('", name, "'): rank ", rank_, " is not a member");
  auto impl = std::make_unique<Group::Backend>();
  impl->kind = backend;
  auto store = compat::make_prefix_store(name + "/", store_->store);
  try {
    if (backend == "gloo") {
      impl->pg = compat::make_gloo_backend(store, my_index, static_cast<int>(ranks.size()),
                                           timeout_, addr_);
#ifdef SHARDKIT_CUDA
    } else if (backend == "nccl") {
      impl->pg = compat::make_nccl_backend(store, my_index, static_cast<int>(ranks.size()),
                                           timeout_);
#endif
    } else {
      throw std::invalid_argument("unsupported backend '" + backend + "'");
    }
  } catch (const std::exception& e) {
    std::ostringstream msg;
    msg << "dist: creating group '" << name << "' (" << backend << ", " << ranks.size()
        << " ranks) failed on rank " << rank_ << ": " << e.what();
    throw DistError(msg.str());
  }
  return std::make_shared<Group>(name, my_index, ranks, std::move(impl), timeout_);
}

std::string resolve_backend(const DistOptions& options, const std::string& device) {
  const std::string& b = options.backend;
  if (b == "gloo") return "gloo";
  if (b == "nccl" || (b == "auto" && device == "cuda")) {
    if (!built_with_cuda()) {
      if (b == "auto") return "gloo";
      throw std::invalid_argument(
          "dist.backend: nccl requested, but this build has no CUDA/NCCL (LibTorch " +
          torch_version() + " without CUDA); use gloo");
    }
    return "nccl";
  }
  return "gloo";
}

std::unique_ptr<Runtime> init_runtime(const LaunchEnv& env, const DistOptions& options,
                                      const std::string& device) {
  auto rt = std::make_unique<Runtime>();
  rt->env = env;
  rt->device = select_device(device, env.local_rank);
  std::string train_backend = resolve_backend(options, device);
  if (train_backend == "nccl" && env.world_size > 1) {
    // Ranks on this node: torchrun and our launcher say so; SLURM's tasks
    // per node; else assume a single node.
    int local_world = env.world_size;
    if (const char* lws = std::getenv("LOCAL_WORLD_SIZE")) {
      local_world = std::max(1, std::atoi(lws));
    } else if (const char* tpn = std::getenv("SLURM_NTASKS_PER_NODE")) {
      local_world = std::max(1, std::atoi(tpn));
    }
    if (local_world > cuda_device_count()) {
      if (options.backend == "nccl") {
        throw std::invalid_argument(
            "dist.backend: nccl needs one GPU per rank, but " + std::to_string(local_world) +
            " local ranks share " + std::to_string(cuda_device_count()) +
            " GPU(s); use gloo or auto (Gloo stages CUDA tensors through the host)");
      }
      train_backend = "gloo";
    }
  }
  auto timeout = std::chrono::milliseconds(static_cast<int64_t>(options.timeout_s * 1000.0));
  rt->rendezvous = std::make_unique<Rendezvous>(env.master_addr, env.master_port, env.rank,
                                                env.world_size, timeout);
  std::vector<int> all(env.world_size);
  for (int r = 0; r < env.world_size; ++r) all[r] = r;
  // Same order on every rank: construction blocks until all members join.
  rt->train = rt->rendezvous->new_group("train", all, train_backend);
  rt->checkpoint = rt->rendezvous->new_group("ckpt", all, "gloo");
  return rt;
}

std::string torch_version() {
  return std::to_string(compat::kTorchMajor) + "." + std::to_string(compat::kTorchMinor);
}

bool built_with_cuda() {
#ifdef SHARDKIT_CUDA
  return true;
#else
  return false;
#endif
}

}  // namespace framework::dist
