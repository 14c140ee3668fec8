// Runs that must not mix: through build/train as a process. A resume whose
// checkpoint was saved with other model, data, seed or batch values fails
// naming the keys (unless checkpoint.allow_config_change), `resume: never`
// refuses a checkpoint.dir holding an earlier run's checkpoints, and neither
// deletes or renames anything. Plus what metrics.jsonl records about a run:
// start, resume, eval, end.
#include <sys/mount.h>

#include <csignal>
#include <thread>

#include <cerrno>
#include <cstring>
#include <fstream>

#include <nlohmann/json.hpp>

#include "reliability/test_util.h"

namespace reliability {
namespace {

std::vector<nlohmann::json> read_records(const fs::path& metrics_jsonl) {
  std::vector<nlohmann::json> out;
  std::ifstream in(metrics_jsonl);
  std::string line;
  while (std::getline(in, line)) {
    if (!line.empty()) out.push_back(nlohmann::json::parse(line));
  }
  return out;
}

std::vector<nlohmann::json> events(const std::vector<nlohmann::json>& records, const std::string& kind) {
  std::vector<nlohmann::json> out;
  for (const auto& r : records) {
    if (r.value("event", std::string()) == kind) out.push_back(r);
  }
  return out;
}

// Every file under `dir` with its size: what "nothing changed" compares.
// The run lock (.lock) is left out: any run that takes the lock writes its
// own pid there, whose length varies.
std::map<std::string, uintmax_t> tree(const fs::path& dir) {
  std::map<std::string, uintmax_t> out;
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    const std::string name = fs::relative(e.path(), dir).string();
    if (name == ".lock") continue;
    out[name] = e.is_regular_file() ? e.file_size() : 0;
  }
  return out;
}

// A finished 4-step run saving steps 2 and 4 (sync), in `root`.
TrainSpec finished_run(const fs::path& root) {
  auto spec = small_run(root, {"train.steps=4", "checkpoint.interval=2", "checkpoint.keep_last=0",
                               "checkpoint.mode=sync"});
  RunResult r = run_train(spec, root / "first.log");
  EXPECT_EQ(r.exit_code, 0) << tail(r.output);
  EXPECT_EQ(committed_steps(spec.ckpt_dir), (std::vector<int64_t>{2, 4}));
  return spec;
}

TEST(RunSafety, ResumingWithAnotherSeedAndBatchFailsNamingTheKeysAndChangesNothing) {
  const fs::path root = fresh_dir("run_safety_changed");
  const TrainSpec first = finished_run(root);
  const auto before = tree(first.ckpt_dir);
  auto again = first;
  again.sets = {"train.steps=8", "run.seed=99", "train.global_batch_size=4"};
  RunResult r = run_train(again, root / "again.log");
  EXPECT_EQ(r.exit_code, 2) << tail(r.output);
  const std::string step4 = (first.ckpt_dir / "step_4").string();
  EXPECT_TRUE(contains(r.output, "checkpoint.resume: " + step4 +
                                     " was saved by a run with other settings: run.seed (1234 -> "
                                     "99), train.global_batch_size (8 -> 4)"))
      << tail(r.output);
  EXPECT_TRUE(contains(r.output, "checkpoint.allow_config_change")) << tail(r.output);
  EXPECT_FALSE(contains(r.output, "frame #")) << tail(r.output);
  EXPECT_FALSE(contains(r.output, "[rank ")) << "no rank started: " << tail(r.output);
  EXPECT_EQ(tree(first.ckpt_dir), before);
}

TEST(RunSafety, AllowConfigChangeResumesAnywayAndSaysWhatChanged) {
  const fs::path root = fresh_dir("run_safety_allowed");
  const TrainSpec first = finished_run(root);
  auto again = first;
  again.sets = {"train.steps=6", "run.seed=99", "train.global_batch_size=4",
                "checkpoint.allow_config_change=true", "checkpoint.interval=0"};
  RunResult r = run_train(again, root / "again.log");
  EXPECT_EQ(r.exit_code, 0) << tail(r.output);
  EXPECT_TRUE(contains(r.output, "warning: resuming " + (first.ckpt_dir / "step_4").string() +
                                     " although it was saved with other settings: run.seed"))
      << tail(r.output);
  EXPECT_TRUE(contains(r.output, "warning: checkpoint.resume_audit: resuming " + (first.ckpt_dir / "step_4").string() +
                                     ", step 5 would train on another batch than the saved run would have: "
                                     "another seed (saved 1234, now 99); another train.global_batch_size "
                                     "(saved 8, now 4)"))
      << tail(r.output);
  // Allowed on purpose: a warning, not a refusal (checkpoint.resume_audit error).
  EXPECT_TRUE(contains(r.output, "(checkpoint.allow_config_change: resuming anyway)"))
      << tail(r.output);
  EXPECT_TRUE(contains(r.output, "continuing after step 4")) << tail(r.output);
  EXPECT_FALSE(contains(r.output, "frame #")) << tail(r.output);
}

TEST(RunSafety, AChangedModelWithAllowConfigChangeFailsToLoadAndSetsNothingAside) {
  const fs::path root = fresh_dir("run_safety_model");
  const TrainSpec first = finished_run(root);
  const auto before = tree(first.ckpt_dir);
  auto again = first;
  again.sets = {"train.steps=6", "model.n_layers=2"};
  RunResult r = run_train(again, root / "refused.log");
  EXPECT_EQ(r.exit_code, 2) << tail(r.output);
  EXPECT_TRUE(contains(r.output, "model.n_layers (1 -> 2)")) << tail(r.output);
  // Forced: the load itself fails (not damage), once per rank, without a
  // stack trace; nothing is set aside.
  again.sets.push_back("checkpoint.allow_config_change=true");
  r = run_train(again, root / "forced.log");
  EXPECT_EQ(r.exit_code, 1) << tail(r.output);
  EXPECT_TRUE(contains(r.output, "loading checkpoint")) << tail(r.output);
  EXPECT_FALSE(contains(r.output, "skipped")) << tail(r.output);
  EXPECT_FALSE(contains(r.output, "frame #")) << tail(r.output);
  EXPECT_EQ(tree(first.ckpt_dir), before);
}

TEST(RunSafety, ResumeNeverRefusesADirectoryHoldingAnEarlierRunsCheckpoints) {
  const fs::path root = fresh_dir("run_safety_never");
  const TrainSpec first = finished_run(root);
  const auto before = tree(first.ckpt_dir);
  auto fresh = first;
  fresh.sets = {"train.steps=6", "checkpoint.resume=never", "checkpoint.keep_last=1"};
  RunResult r = run_train(fresh, root / "fresh.log");
  EXPECT_EQ(r.exit_code, 2) << tail(r.output);
  EXPECT_TRUE(contains(r.output, "checkpoint.resume: never, but checkpoint.dir '" +
                                     first.ckpt_dir.string() +
                                     "' already holds committed checkpoints of an earlier run "
                                     "(step_2, step_4)"))
      << tail(r.output);
  EXPECT_EQ(tree(first.ckpt_dir), before);  // nothing pruned or overwritten
}

// The validation loss is computed on held-out samples split over the ranks
// like a training batch: one rank and two agree, and the records say so.
TEST(RunSafety, ValidationLossIsTheSameAtAnyWorldSizeAndMetricsRecordTheRun) {
  std::map<int, std::vector<nlohmann::json>> evals;
  for (int nproc : {1, 2}) {
    const fs::path root = fresh_dir("run_safety_eval_" + std::to_string(nproc));
    auto spec = small_run(root, {"train.steps=6", "train.eval_every=3", "data.eval_fraction=0.1",
                                 "train.eval_samples=20", "checkpoint.interval=0"});
    spec.nproc = nproc;
    RunResult r = run_train(spec, root / "train.log");
    ASSERT_EQ(r.exit_code, 0) << tail(r.output);
    EXPECT_TRUE(contains(r.output, "eval step 3 | val_loss ")) << tail(r.output);
    const auto records = read_records(spec.run_dir / "metrics.jsonl");
    evals[nproc] = events(records, "eval");
    const auto starts = events(records, "start");
    ASSERT_EQ(starts.size(), 1u);
    EXPECT_EQ(starts[0]["world"], std::max(1, nproc));
    EXPECT_TRUE(starts[0]["resumed_from"].is_null());
    EXPECT_EQ(starts[0]["step"], 0);
    ASSERT_EQ(events(records, "end").size(), 1u);
    EXPECT_EQ(events(records, "end")[0]["status"], "finished");
    int steps = 0;
    for (const auto& rec : records) {
      if (rec.contains("event")) continue;
      ++steps;
      EXPECT_TRUE(rec["time"].is_string()) << rec.dump();
      EXPECT_GT(rec["wall_s"].get<double>(), 0.0) << rec.dump();
      ASSERT_EQ(rec["peak_rss_mib"].size(), static_cast<size_t>(std::max(1, nproc))) << rec.dump();
      for (const auto& mib : rec["peak_rss_mib"]) EXPECT_GT(mib.get<double>(), 10.0) << rec.dump();
      EXPECT_GT(rec["grad_norm"].get<double>(), 0.0) << rec.dump();
    }
    EXPECT_EQ(steps, 6);
  }
  ASSERT_EQ(evals[1].size(), 2u);
  ASSERT_EQ(evals[2].size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(evals[1][i]["step"], evals[2][i]["step"]);
    EXPECT_EQ(evals[1][i]["samples"], 20);
    EXPECT_EQ(evals[1][i]["val_tokens"], evals[2][i]["val_tokens"]);
    EXPECT_NEAR(evals[1][i]["val_loss"].get<double>(), evals[2][i]["val_loss"].get<double>(), 1e-4);
  }
  // Training moved the held-out loss.
  EXPECT_NE(evals[1][0]["val_loss"], evals[1][1]["val_loss"]);
}

TEST(RunSafety, AResumeIsRecordedWithItsStepWorldAndLayout) {
  const fs::path root = fresh_dir("run_safety_resume_record");
  const TrainSpec first = finished_run(root);
  auto again = first;
  again.nproc = 1;
  again.sets = {"train.steps=6", "checkpoint.interval=0"};
  RunResult r = run_train(again, root / "again.log");
  ASSERT_EQ(r.exit_code, 0) << tail(r.output);
  // A change resume allows is still named, once.
  const std::string note = "train: warning: resuming " + (first.ckpt_dir / "step_4").string() +
                           " with changed settings: train.steps (4 -> 6)";
  EXPECT_TRUE(contains(r.output, note)) << tail(r.output);
  EXPECT_EQ(r.output.find(note), r.output.rfind(note)) << tail(r.output);
  const auto starts = events(read_records(first.run_dir / "metrics.jsonl"), "start");
  ASSERT_EQ(starts.size(), 2u);
  EXPECT_TRUE(starts[0]["resumed_from"].is_null());
  EXPECT_EQ(starts[1]["resumed_from"], (first.ckpt_dir / "step_4").string());
  EXPECT_EQ(starts[1]["resumed_step"], 4);
  EXPECT_EQ(starts[1]["step"], 4);
  EXPECT_EQ(starts[1]["saved_world"], 2);
  EXPECT_EQ(starts[1]["world"], 1);
  EXPECT_EQ(starts[1]["saved_layout"], "fsdp replicate=1 shard=2");
}

// A read-only file system (a tmpfs mounted read-only: refused even to root)
// as run.dir's parent, then as checkpoint.dir: exit 2 before any rank
// starts, naming the key and the reason, creating nothing.
TEST(RunSafety, AReadOnlyRunDirOrCheckpointDirExits2BeforeAnyRankStarts) {
  const fs::path root = fresh_dir("run_safety_read_only");
  const fs::path ro = root / "ro";
  fs::create_directories(ro);
  if (::mount("tmpfs", ro.c_str(), "tmpfs", MS_RDONLY, "size=1m") != 0) {
    SHARDKIT_SKIP("cannot mount a read-only tmpfs (" << std::strerror(errno)
                                                    << "); RunDirUnderAFile covers the message");
  }
  auto run_in_ro = small_run(root, {"train.steps=2"});
  run_in_ro.run_dir = ro / "run";
  RunResult a = run_train(run_in_ro, root / "a.log");
  auto ckpt_in_ro = small_run(root, {"train.steps=2"});
  ckpt_in_ro.ckpt_dir = ro;
  RunResult b = run_train(ckpt_in_ro, root / "b.log");
  ::umount2(ro.c_str(), MNT_DETACH);

  EXPECT_EQ(a.exit_code, 2) << tail(a.output);
  EXPECT_TRUE(contains(a.output, "train: run.dir: cannot create '" + (ro / "run").string() +
                                     "': '" + ro.string() +
                                     "' is not writable: Read-only file system"))
      << tail(a.output);
  EXPECT_EQ(b.exit_code, 2) << tail(b.output);
  EXPECT_TRUE(contains(b.output, "train: checkpoint.dir: '" + ro.string() +
                                     "' is not writable: Read-only file system"))
      << tail(b.output);
  for (const RunResult* r : {&a, &b}) {
    EXPECT_FALSE(contains(r->output, "[rank ")) << tail(r->output);
    EXPECT_FALSE(contains(r->output, "frame #")) << tail(r->output);
  }
  EXPECT_FALSE(fs::exists(root / "run"));  // b's run.dir: checked before it was made
}

// Two jobs with different run.dirs but one checkpoint.dir: the second is
// refused while the first runs.
TEST(RunSafety, ASharedCheckpointDirIsLockedToo) {
  const fs::path root = fresh_dir("run_safety_shared_ckpt");
  auto first = small_run(root, {"train.steps=100000", "checkpoint.interval=0"});
  Process job(train_argv(first), {}, (root / "first.log").string());
  const double deadline = monotonic_s() + 120;
  while (monotonic_s() < deadline && !job.poll() &&
         read_losses(first.run_dir / "metrics.jsonl").empty()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_FALSE(job.poll().has_value()) << tail(read_text_file((root / "first.log").string()));
  auto second = small_run(root, {"train.steps=2"});
  second.run_dir = root / "other_run";
  RunResult r = run_train(second, root / "second.log", 60);
  job.signal(SIGTERM);
  EXPECT_EQ(job.wait_for(120), 75);
  EXPECT_EQ(r.exit_code, 2) << tail(r.output);
  EXPECT_TRUE(contains(r.output, "checkpoint.dir " + first.ckpt_dir.string() +
                                     " is in use by another job (pid " + std::to_string(job.pid())))
      << tail(r.output);
  EXPECT_FALSE(fs::exists(root / "other_run")) << "the refused job left its run.dir behind";
}

}  // namespace
}  // namespace reliability
