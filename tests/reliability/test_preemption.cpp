// Preemption: SIGTERM to the launcher or to one rank mid-run. With
// checkpoint.save_on_signal the ranks agree to stop (the stop flag is
// all-reduced every step), save at the step they stopped, and exit 75; a run
// with resume auto continues there and matches an uninterrupted run bit for
// bit. Without save_on_signal the in-flight save still commits and the exit
// status is still 75.
#include <signal.h>

#include <regex>
#include <thread>

#include "reliability/test_util.h"

namespace reliability {
namespace {

// Starts a run, waits until it logged `after_step`, sends SIGTERM to the
// launcher (rank -1) or to one rank, and waits (bounded).
RunResult run_and_sigterm(const TrainSpec& spec, const fs::path& log, int64_t after_step, int rank) {
  RunResult r;
  Process p(train_argv(spec), spec.env, log.string());
  const double deadline = monotonic_s() + 240;
  while (!p.poll() && monotonic_s() < deadline) {
    auto losses = read_losses(spec.run_dir / "metrics.jsonl");
    if (!losses.empty() && losses.rbegin()->first >= after_step) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  if (rank < 0) {
    p.signal(SIGTERM);
  } else {
    const pid_t pid = wait_for_rank_pid(p.pid(), rank, 10);
    if (pid > 0) ::kill(pid, SIGTERM);
  }
  r.exit_code = p.wait_for(120, &r.timed_out);
  r.output = read_text_file(log.string());
  return r;
}

int64_t stopped_at(const std::string& out) {
  std::smatch m;
  static const std::regex re("stopped by signal at step ([0-9]+)");
  return std::regex_search(out, m, re) ? std::stoll(m[1]) : -1;
}

struct SignalCase {
  const char* name;
  const char* mode;
  int rank;  // -1: the launcher
};

// Names the case in test listings (ctest shows it).
void PrintTo(const SignalCase& c, std::ostream* os) { *os << c.name; }

class Preemption : public ::testing::TestWithParam<SignalCase> {};

TEST_P(Preemption, SavesAtTheStopStepExits75AndResumesBitExact) {
  const SignalCase& c = GetParam();
  std::string error;
  const auto reference = reference_losses(c.mode, cache_dir(), &error);
  ASSERT_FALSE(reference.empty()) << error;
  const fs::path root = fresh_dir(std::string("preempt_") + c.name);
  // Saves every 5 steps, so the stop step is usually not a scheduled one.
  auto spec = small_run(root, {std::string("checkpoint.mode=") + c.mode, "checkpoint.interval=5",
                               "checkpoint.save_on_signal=true", "checkpoint.resume=never"});
  RunResult r = run_and_sigterm(spec, root / "train.log", 3, c.rank);
  ASSERT_FALSE(r.timed_out) << tail(r.output);
  const int64_t stop = stopped_at(r.output);
  if (stop < 0 && r.exit_code == 0) SHARDKIT_SKIP("the run finished before the signal arrived");
  EXPECT_EQ(r.exit_code, 75) << tail(r.output);
  ASSERT_GT(stop, 0) << tail(r.output);
  EXPECT_LT(stop, 40);
  const fs::path at_stop = spec.ckpt_dir / ("step_" + std::to_string(stop));
  ASSERT_TRUE(fs::exists(at_stop / ".metadata")) << "no checkpoint at the stop step " << stop;
  EXPECT_EQ(verify_problems(at_stop), "");
  EXPECT_TRUE(uncommitted_dirs(spec.ckpt_dir).empty());

  auto resume = spec;
  resume.run_dir = root / "resumed";
  resume.sets = {std::string("checkpoint.mode=") + c.mode, "checkpoint.interval=5", "checkpoint.resume=auto"};
  RunResult rr = run_train(resume, root / "resumed.log");
  EXPECT_EQ(rr.exit_code, 0) << tail(rr.output);
  EXPECT_TRUE(contains(rr.output, "resumed from " + at_stop.string() + " ")) << tail(rr.output);
  EXPECT_EQ(compare_losses(read_losses(resume.run_dir / "metrics.jsonl"), reference, stop), "");
}

INSTANTIATE_TEST_SUITE_P(Signals, Preemption,
                         ::testing::Values(SignalCase{"LauncherSync", "sync", -1},
                                           SignalCase{"LauncherAsync", "async", -1},
                                           SignalCase{"LauncherOverlap", "overlap", -1},
                                           SignalCase{"Rank1Async", "async", 1},
                                           SignalCase{"Rank0Sync", "sync", 0}),
                         [](const auto& info) { return std::string(info.param.name); });

TEST(PreemptionWithoutSaveOnSignal, InFlightSaveStillCommitsAndExitIs75) {
  // A save every step in async mode: one is nearly always in flight.
  const fs::path root = fresh_dir("preempt_no_save");
  auto spec = small_run(root, {"checkpoint.mode=async", "checkpoint.interval=1",
                               "checkpoint.save_on_signal=false", "checkpoint.resume=never"});
  RunResult r = run_and_sigterm(spec, root / "train.log", 3, -1);
  ASSERT_FALSE(r.timed_out) << tail(r.output);
  const int64_t stop = stopped_at(r.output);
  if (stop < 0 && r.exit_code == 0) SHARDKIT_SKIP("the run finished before the signal arrived");
  EXPECT_EQ(r.exit_code, 75) << tail(r.output);
  // Every save that started has committed: no step directory without metadata.
  EXPECT_TRUE(uncommitted_dirs(spec.ckpt_dir).empty());
  const auto steps = committed_steps(spec.ckpt_dir);
  ASSERT_FALSE(steps.empty());
  EXPECT_LE(steps.back(), stop);
  for (int64_t s : steps) EXPECT_EQ(verify_problems(spec.ckpt_dir / ("step_" + std::to_string(s))), "");
}

}  // namespace
}  // namespace reliability
