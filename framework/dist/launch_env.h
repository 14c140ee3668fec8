#pragma once
// Where this process sits in the job: rank, world and rendezvous address, read
// from the torchrun or SLURM environment. Torch-free.
#include <functional>
#include <optional>
#include <string>

namespace framework::dist {

enum class LaunchSource { kSingleProcess, kTorchrun, kSlurm };

struct LaunchEnv {
  LaunchSource source = LaunchSource::kSingleProcess;
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  // True when a launcher serves the store at master_addr:master_port for the
  // job's life (kStoreHostedVar=1): every rank then connects as a client.
  // False: rank 0 serves it (torchrun, SLURM, a plain environment).
  bool store_hosted = false;
  // Names the job in its store; a rank refuses a store that names another job
  // (Rendezvous). Empty: this rank checks nothing.
  std::string job_id;
};

// Set by the local launcher for its ranks.
inline constexpr const char* kStoreHostedVar = "SHARDKIT_STORE_HOSTED";
inline constexpr const char* kJobIdVar = "SHARDKIT_JOB_ID";

// A fresh random job id: 16 hex digits.
std::string new_job_id();

// Reads an environment variable; nullopt when unset. Tests pass a map.
using EnvLookup = std::function<std::optional<std::string>(const std::string&)>;
EnvLookup process_env();

// torchrun: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT (takes
// precedence). SLURM: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID; the master
// address comes from MASTER_ADDR, else `config_master_addr`, else the first
// host of SLURM_JOB_NODELIST / SLURM_NODELIST when it is a plain name. Port:
// MASTER_PORT, else `config_master_port` when > 0, else 29500. With none of
// them set: a single process. Job: store_hosted from SHARDKIT_STORE_HOSTED
// (0 or 1); job_id from SHARDKIT_JOB_ID, else torchrun's TORCHELASTIC_RUN_ID,
// else empty. Malformed values throw std::invalid_argument naming the
// variable and its value.
LaunchEnv detect_launch_env(const EnvLookup& env,
                            const std::string& config_master_addr = "",
                            int config_master_port = 0);

std::string to_string(LaunchSource s);

}  // namespace framework::dist
