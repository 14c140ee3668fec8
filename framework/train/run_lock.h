#pragma once
// One job per run directory. The job takes an exclusive flock(2) on
// <run.dir>/.lock before it writes anything there. The kernel releases the
// lock when the holder exits, however it exits (kill -9 included), so a crash
// never leaves a stale lock. The file itself holds "<pid> <host>" of the
// holder, for the message a second job prints.
//
// A checkpoint.dir set outside run.dir is locked the same way, by the same
// holder, with its own .lock file. So is each node's local tier directory
// (checkpoint.local.dir, "{node}" replaced), by whoever starts that node's
// ranks: two jobs sharing one would list, resume from and delete each
// other's local checkpoints.
//
// Who holds it: the local launcher (`train --nproc N`) for the whole job, or
// rank 0 when ranks come from torchrun or SLURM (the local tier directory:
// each node's local rank 0). Ranks the local launcher started do not take it
// again.
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace framework::train {

// Another job holds the run directory's lock.
class RunDirBusy : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class RunDirLock {
 public:
  // Creates `run_dir` (and parents) if needed and takes its lock without
  // waiting. Throws RunDirBusy "run.dir <dir> is in use by another job (pid
  // <P> on <host>); ..." when another process holds it, and
  // std::runtime_error naming the path when the directory or the lock file
  // cannot be made.
  // `key` names the directory in messages ("run.dir", "checkpoint.dir").
  static std::unique_ptr<RunDirLock> acquire(const std::string& run_dir,
                                             const std::string& key = "run.dir");
  ~RunDirLock();
  RunDirLock(const RunDirLock&) = delete;
  RunDirLock& operator=(const RunDirLock&) = delete;

  // For a job that ended before it started (a config error found by a
  // rank): removes the lock file and the directories that acquire() made,
  // if nothing else was put there, so that the job leaves nothing behind.
  void remove_if_unused();

  // Lets child processes inherit the lock (clears FD_CLOEXEC). A flock lasts
  // until the last descriptor of its open file closes, so the ranks that a
  // launcher starts hold it with the launcher: a launcher killed with SIGKILL
  // leaves the directory locked until its last rank has exited.
  void share_with_children();

 private:
  RunDirLock(int fd, std::string path, std::vector<std::string> made_dirs, bool made_file)
      : fd_(fd), path_(std::move(path)), made_dirs_(std::move(made_dirs)), made_file_(made_file) {}
  int fd_;
  std::string path_;                    // <run.dir>/.lock
  std::vector<std::string> made_dirs_;  // created by acquire(), deepest first
  bool made_file_;
};

// The job's locks: run.dir's, and checkpoint.dir's too when it is set and
// lies outside run.dir (two jobs with different run.dirs must not share
// one checkpoint.dir either). Throws as acquire() does; on a throw, the locks
// taken so far are released.
std::vector<std::unique_ptr<RunDirLock>> lock_job_dirs(const std::string& run_dir,
                                                        const std::string& checkpoint_dir);

// The local tier directories of `nodes` (checkpoint.local.dir `pattern`,
// "{node}" replaced by each). Throws as acquire() does, naming the key
// "checkpoint.local.dir" and the node's directory; on a throw, the locks
// taken so far are released. An empty pattern locks nothing.
std::vector<std::unique_ptr<RunDirLock>> lock_local_tier_dirs(const std::string& pattern,
                                                               const std::vector<int>& nodes);

}  // namespace framework::train
