#include "comm/runtime.h"

#include "comm/device.h"
#include "comm/torch_compat.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <memory>
#include <sstream>
#include <string>

namespace comm {

namespace {

// Where a store names its job (see Rendezvous in runtime.h).
constexpr const char* kJobIdKey = "shardkit/job_id";
// How long a hosted store server's own client waits on it: it only writes the
// job id, into a store in this very process.
constexpr std::chrono::seconds kStoreServerTimeout{60};

std::string endpoint(const std::string& addr, int port) {
  return addr + ":" + std::to_string(port);
}

class TcpStoreServer final : public StoreServer {
 public:
  TcpStoreServer(compat::StorePtr store, int port) : store_(std::move(store)), port_(port) {}
  int port() const override { return port_; }

 private:
  compat::StorePtr store_;  // serves while it lives
  int port_;
};

// Returns once all `size` callers of the same round have arrived (rounds
// count up, so a key can be reused). Waits up to the store's timeout.
void wait_for_all(const compat::StorePtr& store, const std::string& key, int64_t size) {
  const int64_t arrived = compat::store_add(store, key, 1);
  const std::string done = key + "/" + std::to_string((arrived - 1) / size);
  if (arrived % size == 0) {
    compat::store_set(store, done, "1");
  } else {
    compat::store_wait(store, done);
  }
}

}  // namespace

std::unique_ptr<StoreServer> host_tcp_store(const std::string& addr, int port,
                                            const std::string& job_id) {
  TORCH_CHECK(!job_id.empty(), "host_tcp_store: job_id must not be empty");
  try {
    compat::StorePtr store = compat::make_tcp_store_server(addr, port, kStoreServerTimeout);
    // Written before any rank can start, so that ranks need not wait for it.
    compat::store_set(store, kJobIdKey, job_id);
    return std::make_unique<TcpStoreServer>(store, compat::tcp_store_port(store));
  } catch (const std::exception& e) {
    throw DistError("dist: cannot serve the rendezvous store on " + endpoint(addr, port) + ": " +
                    error_message(e));
  }
}

Rendezvous::Rendezvous(const LaunchEnv& env, std::chrono::milliseconds timeout)
    : store_(std::make_unique<Store>()), addr_(env.master_addr), port_(env.master_port),
      rank_(env.rank), world_size_(env.world_size), timeout_(timeout) {
  const bool serves = !env.store_hosted && rank_ == 0;
  // Concurrent single-process runs must not fight over one MASTER_PORT.
  if (serves && world_size_ == 1) port_ = 0;
  // train --nproc's launcher wrote the job id at the top of its store,
  // before any attempt started.
  const bool launcher_store = env.store_hosted && !env.agent_store;
  try {
    store_->store = compat::make_tcp_store(addr_, port_, serves, world_size_, timeout);
    port_ = compat::tcp_store_port(store_->store);
  } catch (const std::exception& e) {
    throw DistError(rendezvous_failed(e));
  }
  if (launcher_store && !env.job_id.empty()) check_job_id(env.job_id, true);
  try {
    // A hosted store (torchrun's agent, train --nproc's launcher) outlives a
    // restart of the workers: each attempt's keys apart from the last one's.
    if (env.store_hosted) {
      store_->store = compat::make_prefix_store("shardkit/attempt_" + std::to_string(env.restart_count) + "/",
                                                store_->store);
    }
  } catch (const std::exception& e) {
    throw DistError(rendezvous_failed(e));
  }
  // The agent's store has no job id of ours: its rank 0 writes one, as a
  // rank-0-served store's does.
  if (serves || (env.agent_store && rank_ == 0)) {
    compat::store_set(store_->store, kJobIdKey, env.job_id.empty() ? new_job_id() : env.job_id);
  } else if (!env.job_id.empty() && !launcher_store) {
    check_job_id(env.job_id, false);
  }
}

std::string Rendezvous::rendezvous_failed(const std::exception& e) const {
  std::ostringstream msg;
  msg << "dist: rendezvous at " << endpoint(addr_, port_) << " failed for rank " << rank_ << " of " << world_size_
      << " (timeout " << timeout_.count() / 1000.0 << " s): " << error_message(e);
  return msg.str();
}

void Rendezvous::check_job_id(const std::string& expected, bool store_hosted) {
  std::string found = "none";
  try {
    // A hosted store has its id before any rank starts; rank 0 writes its
    // own once every rank has connected.
    if (!store_hosted || compat::store_has(store_->store, kJobIdKey)) {
      found = compat::store_get(store_->store, kJobIdKey);
    }
  } catch (const std::exception& e) {
    std::ostringstream msg;
    msg << "dist: rendezvous at " << endpoint(addr_, port_) << ": rank " << rank_
        << " could not read the job id (timeout " << timeout_.count() / 1000.0
        << " s; is rank 0 up, and is this store one of ours?): " << error_message(e);
    throw DistError(msg.str());
  }
  if (found != expected) {
    throw DistError("dist: rendezvous at " + endpoint(addr_, port_) +
                    " belongs to another job (id " + found + ", expected " + expected +
                    "): rank " + std::to_string(rank_) + " refuses it");
  }
}

Rendezvous::~Rendezvous() = default;

std::shared_ptr<Group> Rendezvous::new_group(const std::string& name, const std::vector<int>& ranks,
                                             Backend backend) {
  int my_index = -1;
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (ranks[i] == rank_) my_index = static_cast<int>(i);
  }
  TORCH_CHECK(my_index >= 0, "new_group('", name, "'): rank ", rank_, " is not a member");
  auto impl = std::make_unique<Group::Backend>();
  impl->kind = to_string(backend);
  const int generation = groups_made_[name]++;
  auto store = compat::make_prefix_store(name + "/" + std::to_string(generation) + "/", store_->store);
  try {
    if (backend == Backend::kGloo) {
      impl->pg = compat::make_gloo_backend(store, my_index, static_cast<int>(ranks.size()),
                                           timeout_, addr_);
#ifdef SHARDKIT_CUDA
    } else if (backend == Backend::kNccl) {
      impl->pg = compat::make_nccl_backend(store, my_index, static_cast<int>(ranks.size()),
                                           timeout_);
#endif
    } else {
      throw std::invalid_argument("unsupported backend '" + std::string(to_string(backend)) + "'");
    }
    // As PyTorch's new_group does (_store_based_barrier): Gloo's connect ends
    // without a handshake, so a member that returned and dropped the group at
    // once could cut a slower member's connect short ("Connection closed by
    // peer", pair.cc). No member returns before every member has connected.
    wait_for_all(store, "created", static_cast<int64_t>(ranks.size()));
  } catch (const std::exception& e) {
    std::ostringstream msg;
    msg << "dist: creating group '" << name << "' (" << to_string(backend) << ", " << ranks.size()
        << " ranks) failed on rank " << rank_ << ": " << error_message(e);
    throw DistError(msg.str());
  }
  return std::make_shared<Group>(name, my_index, ranks, std::move(impl), timeout_);
}

Backend resolve_backend(const DistOptions& options, DeviceKind device) {
  const Backend b = options.backend;
  if (b == Backend::kGloo) return Backend::kGloo;
  if (b == Backend::kNccl || (b == Backend::kAuto && device == DeviceKind::kCuda)) {
    if (!built_with_cuda()) {
      if (b == Backend::kAuto) return Backend::kGloo;
      throw std::invalid_argument(
          "dist.backend: nccl requested, but this build has no CUDA/NCCL (LibTorch " +
          torch_version() + " without CUDA); use gloo");
    }
    return Backend::kNccl;
  }
  return Backend::kGloo;
}

std::unique_ptr<Runtime> init_runtime(const LaunchEnv& env, const DistOptions& options,
                                      DeviceKind device) {
  auto rt = std::make_unique<Runtime>();
  rt->startup.called_at_s = process_age_s();
  rt->env = env;
  rt->device = select_device(device, env.local_rank);
  Backend train_backend = resolve_backend(options, device);
  if (train_backend == Backend::kNccl && env.world_size > 1) {
    const int local_world = env.local_world_size;  // ranks on this node (launch_env.h)
    if (local_world > cuda_device_count()) {
      if (options.backend == Backend::kNccl) {
        throw std::invalid_argument(
            "dist.backend: nccl needs one GPU per rank, but " + std::to_string(local_world) +
            " local ranks share " + std::to_string(cuda_device_count()) +
            " GPU(s); use gloo or auto (Gloo stages CUDA tensors through the host)");
      }
      train_backend = Backend::kGloo;
    }
  }
  auto timeout = std::chrono::milliseconds(static_cast<int64_t>(options.timeout_s * 1000.0));
  using Clock = std::chrono::steady_clock;
  const auto seconds_since = [](Clock::time_point t) {
    return std::chrono::duration<double>(Clock::now() - t).count();
  };
  const Clock::time_point t0 = Clock::now();
  rt->rendezvous = std::make_unique<Rendezvous>(env, timeout);
  rt->startup.rendezvous_s = seconds_since(t0);
  const Clock::time_point t1 = Clock::now();
  std::vector<int> all(env.world_size);
  for (int r = 0; r < env.world_size; ++r) all[r] = r;
  // Same order on every rank: construction blocks until all members join.
  rt->train = rt->rendezvous->new_group("train", all, train_backend);
  rt->checkpoint = rt->rendezvous->new_group("ckpt", all, Backend::kGloo);
  rt->startup.groups_s = seconds_since(t1);
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

}  // namespace comm
