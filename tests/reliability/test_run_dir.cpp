// One job per run directory, and what the commands say about themselves:
// a second job started in a run.dir that a running job holds exits at once
// with status 2, naming the holder's pid and host, and changes nothing of
// the first job's; the first job is preempted afterwards and the launcher
// says how to resume. --version of train and ckpt.
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <unistd.h>

#include <thread>

#include "reliability/test_util.h"

namespace reliability {
namespace {

std::string host_name() {
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  return host;
}

TEST(RunDir, ASecondJobInTheSameRunDirExits2NamingTheHolderAndTouchesNothing) {
  const fs::path root = fresh_dir("run_dir_race");
  auto first = small_run(root, {"train.steps=100000", "checkpoint.interval=5"});
  const fs::path first_log = root / "first.log";
  Process job(train_argv(first), first.env, first_log.string());
  // Wait until the first job trains (it holds the lock before any rank starts).
  const double deadline = monotonic_s() + 120;
  while (!job.poll() && monotonic_s() < deadline &&
         read_losses(first.run_dir / "metrics.jsonl").size() < 3) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_FALSE(job.poll().has_value()) << tail(read_text_file(first_log.string()));
  const auto metrics_before = read_text_file((first.run_dir / "config.yaml").string());

  auto second = small_run(root, {"train.steps=10", "run.seed=99"});
  for (int nproc : {2, 0}) {  // through the local launcher, and as a single process
    second.nproc = nproc;
    const double started = monotonic_s();
    RunResult r = run_train(second, root / ("second_" + std::to_string(nproc) + ".log"), 60);
    EXPECT_EQ(r.exit_code, 2) << tail(r.output);
    EXPECT_LT(monotonic_s() - started, 30.0);
    const std::string want = "run.dir " + first.run_dir.string() + " is in use by another job (pid " +
                             std::to_string(job.pid()) + " on " + host_name() + ")";
    EXPECT_TRUE(contains(r.output, want)) << r.output;
    EXPECT_FALSE(contains(r.output, "frame #")) << r.output;
  }
  EXPECT_EQ(read_text_file((first.run_dir / "config.yaml").string()), metrics_before);

  // The first job is unharmed: preempted now, it saves and exits 75, and the
  // launcher says how to go on rather than reporting a failure.
  job.signal(SIGTERM);
  bool timed_out = false;
  EXPECT_EQ(job.wait_for(120, &timed_out), 75);
  EXPECT_FALSE(timed_out);
  const std::string out = read_text_file(first_log.string());
  EXPECT_TRUE(contains(out, "stopped after its final save (status 75); run the same command to resume"))
      << tail(out);
  EXPECT_FALSE(contains(out, "exited with status 75")) << tail(out);
  // Its lock died with it: the same run dir takes a new job at once.
  // (It resumes the first job's final checkpoint: the same run.)
  auto again = small_run(root, {"train.steps=1", "checkpoint.interval=0"});
  RunResult r = run_train(again, root / "again.log", 120);
  EXPECT_EQ(r.exit_code, 0) << tail(r.output);
}

// Each node's local tier directory (checkpoint.local.dir) is locked like
// run.dir: a second job with its own run.dir and checkpoint.dir but the same
// local directories is refused with exit 2 naming the directory, whether
// started by the local launcher (which locks every simulated node's) or as a
// single process (node 0's first rank locks it), and nothing of the first
// job's local tier changes.
TEST(RunDir, ASecondJobSharingANodeLocalTierDirectoryExits2NamingIt) {
  const fs::path root = fresh_dir("run_dir_local_tier");
  const std::string local = (root / "local" / "node{node}").string();
  auto first = small_run(root / "a", {"train.steps=100000", "checkpoint.interval=5",
                                      "checkpoint.local.dir=\"" + local + "\""});
  first.nodes = 2;
  const fs::path first_log = root / "first.log";
  Process job(train_argv(first), first.env, first_log.string());
  // Until both nodes' local tiers are in use (node 1's holds a step directory).
  const auto node1_used = [&] {
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator(root / "local" / "node1", ec)) {
      if (entry.path().filename().string().rfind("step_", 0) == 0) return true;
    }
    return false;
  };
  const double deadline = monotonic_s() + 120;
  while (!job.poll() && monotonic_s() < deadline &&
         (read_losses(first.run_dir / "metrics.jsonl").size() < 6 || !node1_used())) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_FALSE(job.poll().has_value()) << tail(read_text_file(first_log.string()));
  ASSERT_TRUE(node1_used()) << tail(read_text_file(first_log.string()));

  auto second = small_run(root / "b", {"train.steps=10", "checkpoint.local.dir=\"" + local + "\""});
  for (int nproc : {2, 0}) {
    second.nproc = nproc;
    second.nodes = nproc == 2 ? 2 : 1;
    RunResult r = run_train(second, root / ("second_" + std::to_string(nproc) + ".log"), 60);
    EXPECT_EQ(r.exit_code, 2) << tail(r.output);
    // Node 0's directory is the first each refused job tries.
    const std::string want = "checkpoint.local.dir " + (root / "local" / "node0").string() +
                             " is in use by another job (pid " + std::to_string(job.pid()) + " on " + host_name() + ")";
    EXPECT_TRUE(contains(r.output, want)) << r.output;
    EXPECT_FALSE(contains(r.output, "frame #")) << r.output;
    EXPECT_FALSE(fs::exists(second.run_dir / "metrics.jsonl"));
  }
  job.signal(SIGTERM);
  bool timed_out = false;
  EXPECT_EQ(job.wait_for(120, &timed_out), 75);
  EXPECT_FALSE(timed_out);
  // Free again once the first job ended: the same job resumes there.
  auto again = small_run(root / "a", {"train.steps=1", "checkpoint.interval=0",
                                      "checkpoint.local.dir=\"" + local + "\""});
  again.nodes = 2;
  RunResult r = run_train(again, root / "again.log", 120);
  EXPECT_EQ(r.exit_code, 0) << tail(r.output);
}

// The ranks hold the run-dir lock with the launcher. A launcher killed with
// SIGKILL releases nothing itself; its ranks get SIGHUP (PDEATHSIG) and end
// in their own time, and until the last has, the directory stays locked, so
// a new job cannot start over them. Rank 1 stalls (train_faults) so that the
// ranks outlive the launcher for as long as the test needs.
TEST(RunDir, ALauncherKilledWithSigkillLeavesTheRunDirLockedUntilItsRanksExit) {
  const fs::path root = fresh_dir("run_dir_launcher_kill");
  auto first = small_run(root, {"train.steps=100000", "checkpoint.interval=50000", "dist.timeout_s=120"},
                         {{"SHARDKIT_STALL_AT", "train:20:1"}});
  const fs::path first_log = root / "first.log";
  Process job(train_argv(first), first.env, first_log.string());
  const double deadline = monotonic_s() + 120;
  while (!job.poll() && monotonic_s() < deadline &&
         !contains(read_text_file(first_log.string()), "stops responding")) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_FALSE(job.poll().has_value()) << tail(read_text_file(first_log.string()));
  const std::vector<pid_t> ranks = {wait_for_rank_pid(job.pid(), 0, 10), wait_for_rank_pid(job.pid(), 1, 10)};
  ASSERT_GT(ranks[0], 0);
  ASSERT_GT(ranks[1], 0);
  job.signal(SIGKILL);
  bool timed_out = false;
  EXPECT_EQ(job.wait_for(30, &timed_out), 128 + SIGKILL);
  std::this_thread::sleep_for(std::chrono::milliseconds(500));  // the ranks hear of it (SIGHUP)
  ASSERT_TRUE(process_alive(ranks[0]) && process_alive(ranks[1]))
      << "the ranks did not outlive the launcher: rank 0 " << (process_alive(ranks[0]) ? "alive" : "gone")
      << ", rank 1 " << (process_alive(ranks[1]) ? "alive" : "gone") << "\n"
      << tail(read_text_file(first_log.string()));

  // The launcher is gone, its ranks are not: the lock holds.
  const std::string lock = (first.run_dir / ".lock").string();
  const int fd = ::open(lock.c_str(), O_RDWR | O_CLOEXEC);
  ASSERT_GE(fd, 0) << lock;
  EXPECT_NE(::flock(fd, LOCK_EX | LOCK_NB), 0) << "the lock died with the launcher while its ranks run";
  EXPECT_EQ(errno, EWOULDBLOCK);
  auto second = small_run(root, {"train.steps=10", "run.seed=99"});
  RunResult r = run_train(second, root / "second.log", 60);
  EXPECT_EQ(r.exit_code, 2) << tail(r.output);
  EXPECT_TRUE(contains(r.output, "run.dir " + first.run_dir.string() + " is in use by another job")) << r.output;

  // The lock goes with the last rank.
  for (pid_t p : ranks) ::kill(p, SIGKILL);
  wait_gone_or_kill(ranks, 30);
  // A process is a zombie once its main thread has exited; its files close
  // with its last thread, a moment later.
  int got = -1;
  for (const double until = monotonic_s() + 10; got != 0 && monotonic_s() < until;) {
    got = ::flock(fd, LOCK_EX | LOCK_NB);
    if (got != 0) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_EQ(got, 0) << "the lock outlived every rank by 10 s";
  ::close(fd);
}

// Without a stall the orphaned ranks do what a first SIGTERM asks: finish
// the step, save and exit, their output to the dead launcher dropped (no
// SIGPIPE); the lock goes with the last of them.
TEST(RunDir, RanksOfALauncherKilledWithSigkillSaveAndExit) {
  const fs::path root = fresh_dir("run_dir_launcher_kill_save");
  auto first = small_run(root, {"train.steps=100000", "checkpoint.interval=50000"});
  const fs::path first_log = root / "first.log";
  Process job(train_argv(first), first.env, first_log.string());
  const double deadline = monotonic_s() + 120;
  while (!job.poll() && monotonic_s() < deadline && read_losses(first.run_dir / "metrics.jsonl").size() < 5) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_FALSE(job.poll().has_value()) << tail(read_text_file(first_log.string()));
  const std::vector<pid_t> ranks = {wait_for_rank_pid(job.pid(), 0, 10), wait_for_rank_pid(job.pid(), 1, 10)};
  ASSERT_GT(ranks[0], 0);
  ASSERT_GT(ranks[1], 0);
  job.signal(SIGKILL);
  bool timed_out = false;
  EXPECT_EQ(job.wait_for(30, &timed_out), 128 + SIGKILL);
  EXPECT_EQ(wait_gone_or_kill(ranks, 120), 0) << "ranks of a dead launcher did not stop by themselves";
  const auto saved = committed_checkpoints(first.ckpt_dir);
  ASSERT_EQ(saved.size(), 1u) << "no final save (checkpoint.interval is 50000)";
  EXPECT_EQ(verify_problems(saved.front().path), "");
  const std::string lock = (first.run_dir / ".lock").string();
  const int fd = ::open(lock.c_str(), O_RDWR | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  int got = -1;  // the files of an exited process close with its last thread
  for (const double until = monotonic_s() + 10; got != 0 && monotonic_s() < until;) {
    got = ::flock(fd, LOCK_EX | LOCK_NB);
    if (got != 0) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_EQ(got, 0);
  ::close(fd);
}

TEST(RunDir, TrainAndCkptPrintTheirVersion) {
  for (const auto& [tool, path] : {std::pair{std::string("train"), train_binary()},
                                    std::pair{std::string("ckpt"), ckpt_binary()}}) {
    const fs::path out = fresh_dir("version_" + tool) / "out.txt";
    RunResult r = run_process({path, "--version"}, {}, 60, out.string());
    EXPECT_EQ(r.exit_code, 0) << r.output;
    EXPECT_EQ(r.output.rfind(tool + " (shardkit) 0.", 0), 0u) << r.output;
  }
}

}  // namespace
}  // namespace reliability
