#pragma once
// Options of the distributed runtime (config section `dist`), and the enums of
// the keys whose values the runtime acts on (train.device, run.host_malloc).
// Each is parsed once, by its parse_<name> (std::invalid_argument naming the
// key and the allowed values), and written back with to_string.
#include <string>

#include "comm/enum_text.h"

namespace comm {

// dist.backend. auto: nccl when train.device is cuda and the build has NCCL,
// else gloo.
enum class Backend { kAuto, kGloo, kNccl };
inline constexpr EnumName<Backend> kBackends[] = {
    {Backend::kAuto, "auto"}, {Backend::kGloo, "gloo"}, {Backend::kNccl, "nccl"}};
inline const char* to_string(Backend backend) { return enum_text(backend, kBackends); }
inline Backend parse_backend(const std::string& backend) {
  return parse_enum("dist.backend", backend, kBackends);
}

// train.device.
enum class DeviceKind { kCpu, kCuda };
inline constexpr EnumName<DeviceKind> kDeviceKinds[] = {{DeviceKind::kCpu, "cpu"}, {DeviceKind::kCuda, "cuda"}};
inline const char* to_string(DeviceKind device) { return enum_text(device, kDeviceKinds); }
inline DeviceKind parse_device_kind(const std::string& device) {
  return parse_enum("train.device", device, kDeviceKinds);
}

// run.host_malloc (host_malloc.h): keep freed host memory for reuse, or
// glibc's defaults.
enum class HostMalloc { kKeep, kDefault };
inline constexpr EnumName<HostMalloc> kHostMallocs[] = {{HostMalloc::kKeep, "keep"},
                                                        {HostMalloc::kDefault, "default"}};
inline const char* to_string(HostMalloc host_malloc) { return enum_text(host_malloc, kHostMallocs); }
inline HostMalloc parse_host_malloc(const std::string& host_malloc) {
  return parse_enum("run.host_malloc", host_malloc, kHostMallocs);
}

struct DistOptions {
  Backend backend = Backend::kAuto;
  // Every collective on every group fails after this many seconds instead of
  // hanging on a dead or stuck peer.
  double timeout_s = 120.0;
  // train --nproc: once a rank fails (or the launcher gets SIGINT/SIGTERM),
  // the other ranks get SIGTERM, then SIGKILL after this many seconds (a
  // rank stuck in a collective cannot act on SIGTERM).
  double stop_grace_s = 10.0;
  // train --nproc --max-restarts: keep a loaded standby process per rank,
  // which a restart activates instead of starting the program again (no
  // load of LibTorch on the restart's path); they start standby_delay_s
  // after each attempt's ranks.
  bool standby = true;
  double standby_delay_s = 3.0;
  // Rendezvous address for SLURM launches (torchrun sets MASTER_ADDR itself).
  // Empty: MASTER_ADDR from the environment, else 127.0.0.1.
  std::string master_addr = "";
  // 0: MASTER_PORT from the environment, else under SLURM 15000 + the last
  // four digits of SLURM_JOB_ID (a port per job), else 29500.
  int master_port = 0;
};

}  // namespace comm
