#pragma once
// The built-in local launcher behind `train --nproc N` (like `torchrun
// --standalone`): runs N copies of a program on this machine as ranks
// 0..N-1. Torch-free.
#include <string>
#include <vector>

namespace framework::dist {

struct LocalLaunchOptions {
  int nproc = 1;
  // Program and arguments each rank runs (argv[0] is resolved via execvp).
  std::vector<std::string> argv;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;           // 0: pick a free port on master_addr
  double stop_grace_s = 10.0;    // SIGTERM, then SIGKILL after this long
  bool prefix_output = true;     // "[rank K] " before each forwarded line
};

// Starts every rank with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
// MASTER_ADDR and MASTER_PORT set (and SHARDKIT_LAUNCHED=1), forwards their
// stdout and stderr line by line with a rank prefix, and waits.
//
// Returns 0 when every rank exited 0. When a rank exits non-zero or dies by a
// signal, the others get SIGTERM (then SIGKILL after stop_grace_s), a line on
// stderr names the first failing rank and its exit status or signal
// ("launcher: rank 1 exited with status 3" / "... killed by signal 9
// (SIGKILL)"), and the return value is that status (128+signal for a signal).
// SIGINT and SIGTERM sent to the launcher are forwarded to every rank; the
// launcher then waits for them and returns as above.
// REQUIRES: called from the main thread; installs SIGINT/SIGTERM handlers for
// its duration.
int run_local_launcher(const LocalLaunchOptions& options);

// What each launched rank runs: this executable (/proc/self/exe) with the
// given arguments minus "--nproc N" / "--nproc=N".
std::vector<std::string> argv_without_nproc(int argc, char** argv);

// A TCP port that was free on `addr` a moment ago.
int pick_free_port(const std::string& addr);

}  // namespace framework::dist
