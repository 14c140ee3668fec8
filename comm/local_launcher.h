#pragma once
// The built-in local launcher behind `train --nproc N` (like `torchrun
// --standalone`): runs N copies of a program on this machine as ranks
// 0..N-1. Torch-free.
#include "comm/store_server.h"

#include <optional>
#include <string>
#include <vector>

namespace comm {

// A rank's exit status that means "stopped by a signal after its final
// save; run the same command to resume" (framework/train: kExitPreempted).
// The launcher says so instead of reporting a failure.
inline constexpr int kExitResumable = 75;
// A rank's exit status that means "usage or configuration error" (train's
// status 2): the same command would fail the same way, so it is never
// restarted (max_restarts).
inline constexpr int kExitUsage = 2;

struct LocalLaunchOptions {
  int nproc = 1;  // ranks in all, over all nodes
  // Simulated nodes, all on this machine: rank r is local rank r % (nproc /
  // nodes) of node r / (nproc / nodes). nproc must be a multiple of nodes
  // (else run_local_launcher throws std::invalid_argument, starting nothing).
  int nodes = 1;
  // Program and arguments each rank runs (argv[0] is resolved via execvp).
  std::vector<std::string> argv;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;           // 0: the store server takes any free port
  // REQUIRED: serves the job's rendezvous store (host_tcp_store in runtime.h
  // for ranks that use comm). Called once, before any rank starts;
  // the server lives until every rank has exited, so no rank binds a port and
  // no other job can take the port between choosing and binding it.
  StoreServerFactory store_server;
  double stop_grace_s = 10.0;    // SIGTERM, then SIGKILL after this long
  bool prefix_output = true;     // "[rank K] " before each forwarded line
  // Restarts of the whole group after a rank fails (torchrun's
  // --max_restarts): 0, the default, never restarts.
  int max_restarts = 0;
  // With max_restarts > 0: keep a standby process per rank, loaded and
  // waiting (comm::wait_if_standby, launch_env.h), so that a restart
  // activates them instead of starting the program again. The program must
  // call comm::wait_if_standby() first in main. The standbys of an attempt
  // start standby_delay_s after its ranks (so they do not slow its start);
  // a restart before then, or of a rank whose standby died, starts the rank
  // afresh. Standbys left at the end are killed.
  bool standby = false;
  double standby_delay_s = 3.0;
};

// Makes a new job id (new_job_id), starts the store server on
// master_addr:master_port with it, then starts every rank with RANK,
// WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK (its node),
// GROUP_WORLD_SIZE (nodes), MASTER_ADDR, MASTER_PORT (the server's port),
// SHARDKIT_STORE_HOSTED=1, SHARDKIT_JOB_ID and SHARDKIT_LAUNCHED=1 set, forwards their stdout and stderr line by line with
// a rank prefix, and waits. A server that cannot start throws before any rank
// starts. Ranks inherit fds 0..2 and what the caller left inheritable when it
// called; nothing the launcher or its store server opened.
//
// Returns 0 when every rank exited 0. When a rank exits non-zero or dies by a
// signal, the others get SIGTERM (then SIGKILL after stop_grace_s), a line on
// stderr names the first failing rank and its exit status or signal
// ("launcher: rank 1 exited with status 3" / "... killed by signal 9
// (SIGKILL)"), and the return value is that status (128+signal for a signal).
// SIGINT and SIGTERM sent to the launcher are forwarded to every rank; the
// launcher then waits for them and returns as above.
//
// Restarts (max_restarts > 0), as torchrun's elastic agent: once every rank
// of the failed group has exited, all nproc ranks start again, up to
// max_restarts times, with the same environment (same job id, same store
// server: it serves the whole job, so each attempt's keys must not collide)
// plus TORCHELASTIC_RESTART_COUNT = the attempt (0 for the first; set on
// every attempt, also without restarts). The failing rank's line then ends
// "; restarting the group (restart i of K)". Not restarted, whatever
// max_restarts says: a group whose first failure is kExitResumable or
// kExitUsage, and one stopped by SIGINT/SIGTERM sent to the launcher (a
// restart already announced is then cancelled, saying so). Once the
// restarts are spent, the last attempt's failing status is returned.
// With `standby`, each restart activates the standbys instead (same
// environment, same prefixes; a standby's process started earlier, so a
// rank's start-up from its activation skips the program's load).
// REQUIRES: called from the main thread; installs SIGINT/SIGTERM handlers for
// its duration.
int run_local_launcher(const LocalLaunchOptions& options);

// What each launched rank runs: this executable (/proc/self/exe) with the
// given arguments minus the launcher's flags, so that no rank launches again:
// "--nproc N", "--nodes N", "--nproc-per-node N", "--max-restarts K" and
// their "--flag=N" forms.
std::vector<std::string> argv_without_nproc(int argc, char** argv);

// Rank templates: copies of this process forked before it does anything
// else, which the next run_local_launcher() of this process makes its
// first attempt's ranks instead of starting the program again. A rank that
// starts from one skips the program's load (LibTorch's about 0.6 s of CPU
// and 0.7 s of wall time) and runs exactly as an exec'd rank would: the
// launcher's child, in its own process group, with the rank's environment
// (all of it, nothing of the template's), arguments, stdin, output pipes
// and inherited fds sent over a socket at its activation.
//
// Call first in main, before any other thread starts (OpenBLAS's pool,
// which stops itself across fork, aside), with the number of ranks the
// process will launch of itself. In the parent (the launcher to be) it
// returns nullopt at once. In a template it returns only once the launcher
// activates it: the rank's argv, with which the program runs as that rank
// (its environment is already the rank's). A template the launcher does not
// need, or whose launcher dies, exits 0 without output.
//
// Off (nullopt, nothing forked) with SHARDKIT_FORK_RANKS=0 in the
// environment, for count <= 0, and beyond kMaxRankTemplates ranks (the rest
// start as before). Restarts and standbys start as before. A forked rank's
// /proc/<pid>/environ shows its rank variables (RANK, ..., the job's) first,
// then as many of the others as fit in the block the launcher was started
// with; its /proc/<pid>/cmdline is the launcher's.
inline constexpr int kMaxRankTemplates = 64;
std::optional<std::vector<std::string>> fork_rank_templates(int count);

// In a rank forked from a template: true; process_age_s() then counts from
// its activation.
bool forked_rank();

namespace detail {
// For the template's activation (local_launcher.cpp); defined with
// process_age_s() in launch_env.cpp.
void mark_forked_rank_activated();
}  // namespace detail

}  // namespace comm
