#pragma once
// Child processes for the reliability harness: start a program with its
// output in a file, wait with a deadline, find the ranks a launcher started,
// kill them. Torch-free; Linux (/proc).
//
// Every wait is bounded: a child that outlives its deadline is killed with
// SIGKILL together with its own children, and the result says it timed out.
// Children get PR_SET_PDEATHSIG(SIGKILL), so a crashed test never leaves a
// launcher running (the launcher's ranks then get their own SIGTERM).
#include <sys/types.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace reliability {

using EnvVars = std::vector<std::pair<std::string, std::string>>;

// Shell-style exit status: the exit code, or 128 + signal number.
int decode_wait_status(int status);

class Process {
 public:
  // Starts argv[0] (a path) with the current environment plus `env`, stdin
  // from /dev/null, stdout and stderr appended to `output_path`.
  // Throws std::runtime_error when fork fails.
  Process(const std::vector<std::string>& argv, const EnvVars& env, const std::string& output_path);
  // Kills (SIGKILL) and reaps the child and its children if still running.
  ~Process();
  Process(const Process&) = delete;
  Process& operator=(const Process&) = delete;

  pid_t pid() const { return pid_; }
  // The exit status once the child has exited (reaps it), else nullopt.
  std::optional<int> poll();
  // Waits up to `timeout_s`; on timeout kills the child and its children with
  // SIGKILL, reaps it, sets *timed_out and returns its status.
  int wait_for(double timeout_s, bool* timed_out = nullptr);
  // SIGKILL to the child's children, then the child. No-op once reaped.
  void kill_tree();
  // Sends `sig` to the child only.
  void signal(int sig);
  double seconds_since_start() const;

 private:
  pid_t pid_ = -1;
  std::optional<int> status_;
  double start_s_ = 0;
};

// Seconds on a monotonic clock.
double monotonic_s();

// Processes whose parent is `parent` (scans /proc).
std::vector<pid_t> child_pids(pid_t parent);
// The value of RANK in the environment of `pid`, or -1.
int rank_of(pid_t pid);
// The child of `launcher` whose RANK is `rank`, waiting up to `timeout_s` for
// it to appear; -1 if none did.
pid_t wait_for_rank_pid(pid_t launcher, int rank, double timeout_s);
// True while `pid` exists and is not a zombie.
bool process_alive(pid_t pid);
// Waits up to `timeout_s` for every pid in `pids` to be gone (not ours to
// reap: orphans); SIGKILLs the survivors. Returns the number killed.
int wait_gone_or_kill(const std::vector<pid_t>& pids, double timeout_s);

struct RunResult {
  int exit_code = -1;
  bool timed_out = false;
  double seconds = 0;
  std::string output;  // stdout and stderr together
};

// Runs argv to completion (at most timeout_s) and collects its output.
RunResult run_process(const std::vector<std::string>& argv, const EnvVars& env, double timeout_s,
                      const std::string& output_path);

std::string read_text_file(const std::string& path);
bool contains(const std::string& haystack, const std::string& needle);

}  // namespace reliability
