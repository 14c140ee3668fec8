// One job per run directory, and what the commands say about themselves:
// a second job started in a run.dir that a running job holds exits at once
// with status 2, naming the holder's pid and host, and changes nothing of
// the first job's; the first job is preempted afterwards and the launcher
// says how to resume. --version of train and ckpt.
#include <signal.h>
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
