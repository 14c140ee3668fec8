#pragma once
// Where this process sits in the job: rank, world and rendezvous address, read
// from the torchrun or SLURM environment. Torch-free.
#include <functional>
#include <optional>
#include <string>

namespace comm {

enum class LaunchSource { kSingleProcess, kTorchrun, kSlurm };

struct LaunchEnv {
  LaunchSource source = LaunchSource::kSingleProcess;
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  // Ranks on this rank's node (local_rank < local_world_size), this node's
  // index and the job's node count (node < nodes). Node-local work (node-local
  // checkpoints, the local_rank-th GPU) is keyed by `node`.
  int local_world_size = 1;
  int node = 0;
  int nodes = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  // Where master_port came from, for the banner: "MASTER_PORT",
  // "dist.master_port", "SLURM_JOB_ID=<id>", or empty for the default 29500.
  std::string master_port_source;
  // True when a launcher serves the store at master_addr:master_port for the
  // job's life (kStoreHostedVar=1): every rank then connects as a client.
  // False: rank 0 serves it (torchrun, SLURM, a plain environment).
  bool store_hosted = false;
  // torchrun 2.x's agent serves the store (TORCHELASTIC_USE_AGENT_STORE=True):
  // store_hosted is set too, the agent writes no job id (rank 0 does), and
  // the store outlives a restart of the workers, so every key of this attempt
  // goes under "shardkit/attempt_<restart_count>/" (TORCHELASTIC_RESTART_COUNT).
  bool agent_store = false;
  int restart_count = 0;
  // Names the job in its store; a rank refuses a store that names another job
  // (Rendezvous). Empty: this rank checks nothing.
  std::string job_id;
};

// Set by the local launcher for its ranks.
inline constexpr const char* kStoreHostedVar = "SHARDKIT_STORE_HOSTED";
inline constexpr const char* kJobIdVar = "SHARDKIT_JOB_ID";
inline constexpr const char* kLaunchedVar = "SHARDKIT_LAUNCHED";  // "1"

// True in a rank that the local launcher (train --nproc) started: this
// process's environment has kLaunchedVar.
bool started_by_local_launcher();

// A fresh random job id: 16 hex digits.
std::string new_job_id();

// Seconds since this process started (exec'd): its start time in
// /proc/self/stat against CLOCK_BOOTTIME, so loading the program and its
// libraries counts. The kernel keeps that start time in clock ticks
// (1/100 s on Linux). 0 where it cannot be read. In a standby process that
// the launcher activated (wait_if_standby): seconds since its activation,
// since it became a rank then.
double process_age_s();

// Standby processes (LocalLaunchOptions::standby): the local launcher
// starts a copy of the program per rank ahead of a restart, with
// kStandbyFdVar naming an inherited socket and kStandbyEnvVar holding room
// for the rank's variables, and no rank variables. Such a copy loads its
// libraries, runs their static initialisers, calls wait_if_standby() and
// blocks there until the launcher activates it with the rank's variables
// (RANK, WORLD_SIZE, ..., TORCHELASTIC_RESTART_COUNT: what an exec'd rank
// gets). A restart then costs no program load.
inline constexpr const char* kStandbyFdVar = "SHARDKIT_STANDBY_FD";
inline constexpr const char* kStandbyEnvVar = "SHARDKIT_STANDBY_ENV";
// Bytes of room kStandbyEnvVar holds (spaces) for the rank's variables.
inline constexpr size_t kStandbyEnvRoom = 4096;

// Call first in main, before anything reads the environment. In a process
// without kStandbyFdVar: returns false at once. In a standby: blocks until
// the launcher sends the rank's variables (NAME=VALUE entries, each ended by
// a NUL, then one more NUL), sets them (setenv), writes them over
// kStandbyEnvVar's room so that /proc/<pid>/environ shows them as an exec'd
// rank's does, unsets kStandbyFdVar and returns true. A standby whose
// launcher closes the socket (or dies) without activating it exits 0 there.
// Not thread-safe: call it before any thread starts.
bool wait_if_standby();
// True in a standby that wait_if_standby() activated.
bool activated_standby();

// Reads an environment variable; nullopt when unset. Tests pass a map.
using EnvLookup = std::function<std::optional<std::string>(const std::string&)>;
EnvLookup process_env();

// torchrun: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT (takes
// precedence). SLURM: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID; the master
// address comes from MASTER_ADDR, else `config_master_addr`, else the first
// host of SLURM_JOB_NODELIST / SLURM_NODELIST when it is a plain name. Port:
// MASTER_PORT, else `config_master_port` when > 0, else under SLURM 15000 +
// the last four digits of SLURM_JOB_ID (15000..24999, as PyTorch Lightning's
// SLURMEnvironment: two jobs on one node then serve rank 0's store on
// different ports unless their ids end in the same four digits), else 29500
// (torchrun and a single process do not read SLURM_JOB_ID). With none of
// them set: a single process (node 0 of 1, local_world_size 1). Job:
// store_hosted from SHARDKIT_STORE_HOSTED (0 or 1), or from
// TORCHELASTIC_USE_AGENT_STORE=True (agent_store); restart_count from
// TORCHELASTIC_RESTART_COUNT; job_id from SHARDKIT_JOB_ID, else torchrun's
// TORCHELASTIC_RUN_ID, else empty.
//
// Nodes, torchrun: local_world_size from LOCAL_WORLD_SIZE, node from
// GROUP_RANK, nodes from GROUP_WORLD_SIZE. Without GROUP_WORLD_SIZE, nodes =
// WORLD_SIZE / LOCAL_WORLD_SIZE (an error unless it divides); without
// GROUP_RANK, node = RANK / LOCAL_WORLD_SIZE; without LOCAL_RANK, local_rank
// = RANK % LOCAL_WORLD_SIZE. Without LOCAL_WORLD_SIZE the job is one node:
// local_world_size = WORLD_SIZE, node 0 of 1 (GROUP_* are not read).
// LOCAL_WORLD_SIZE x nodes must equal WORLD_SIZE.
//
// Nodes, SLURM: node from SLURM_NODEID (else SLURM_PROCID / local_world_size),
// nodes from SLURM_NNODES (else 1); local_world_size from
// SLURM_NTASKS_PER_NODE when it is a plain number (a maximum: at most
// SLURM_NTASKS), else SLURM_NTASKS / SLURM_NNODES when that divides, else an
// error naming them (uneven tasks per node, e.g. SLURM_TASKS_PER_NODE=
// "2(x3),1", are not supported). SLURM_NTASKS may be below nodes x
// local_world_size (the last node runs fewer), never above.
//
// Malformed values (non-numbers, signs, zero counts, a SLURM_JOB_ID that is
// not decimal digits when the port is derived from it) and inconsistent ones
// (node >= nodes, local_rank >= local_world_size, more nodes than ranks, a
// world size that does not match the layout) throw std::invalid_argument
// naming the variable and its value.
LaunchEnv detect_launch_env(const EnvLookup& env,
                            const std::string& config_master_addr = "",
                            int config_master_port = 0);

std::string to_string(LaunchSource s);

}  // namespace comm
