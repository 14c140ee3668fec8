#pragma once
// The job's rendezvous store, served by one process for the whole job, so that
// ranks only ever connect to it and none has to bind a port (torchrun's agent
// does the same). The launcher hosts one (local_launcher.h); the c10d
// implementation is host_tcp_store (runtime.h). Torch-free.
#include <functional>
#include <memory>
#include <string>

namespace comm {

class StoreServer {
 public:
  virtual ~StoreServer() = default;
  // The TCP port it listens on: the one the kernel chose when asked for 0.
  virtual int port() const = 0;
};

// Starts serving on addr:port (port 0: any free port) with `job_id` recorded
// in the store, so that ranks can tell it from another job's store. Serves
// until the returned object is destroyed; does not wait for any rank. Throws
// when it cannot listen.
using StoreServerFactory = std::function<std::unique_ptr<StoreServer>(
    const std::string& addr, int port, const std::string& job_id)>;

}  // namespace comm
