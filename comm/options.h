#pragma once
// Options of the distributed runtime (config section `dist`).
#include <string>

namespace comm {

struct DistOptions {
  // auto: nccl when train.device is cuda and the build has NCCL, else gloo.
  std::string backend = "auto";  // auto | gloo | nccl
  // Every collective on every group fails after this many seconds instead of
  // hanging on a dead or stuck peer.
  double timeout_s = 120.0;
  // Rendezvous address for SLURM launches (torchrun sets MASTER_ADDR itself).
  // Empty: MASTER_ADDR from the environment, else 127.0.0.1.
  std::string master_addr = "";
  // 0: MASTER_PORT from the environment, else under SLURM 15000 + the last
  // four digits of SLURM_JOB_ID (a port per job), else 29500.
  int master_port = 0;
};

}  // namespace comm
