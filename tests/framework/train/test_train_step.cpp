// The trainer is a loop over its step function: calling train_step() N times
// trains exactly as run() does for N steps, and each step's record says what
// happened in it (including, under run(), what was saved).
#include "framework/fsdp/fully_shard.h"
#include "framework/train/trainer.h"
#include "support/multi_rank.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <csignal>
#include <filesystem>
#include <functional>
#include <mutex>

namespace fs = std::filesystem;
using framework::train::StepRecord;
using framework::train::Trainer;
using testing_support::run_runtimes;

namespace {

constexpr int kWorld = 2;
constexpr int64_t kStepTestSteps = 6;

std::string step_run_dir(const std::string& tag) {
  auto dir = fs::temp_directory_path() / ("shardkit_step_" + tag + "_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  return dir.string();
}

framework::config::Config step_config(const std::string& dir) {
  framework::config::Config c;
  c.run.dir = dir;
  c.run.seed = 9;
  c.train.steps = kStepTestSteps;
  c.train.global_batch_size = 8;
  c.train.log_every = 100;
  c.train.grad_clip = 0.5;
  c.model.vocab_size = 16;
  c.model.seq_len = 16;
  c.model.d_model = 24;
  c.model.n_heads = 2;
  c.model.n_layers = 2;
  c.optim.warmup_steps = 2;
  c.checkpoint.interval = 0;
  c.checkpoint.resume = "never";
  return c;
}

struct Trained {
  std::vector<StepRecord> records;  // rank 0's
  std::vector<torch::Tensor> params;  // full tensors after training
};

// Trains `cfg` on kWorld ranks with `drive` (run() or train_step() calls);
// returns rank 0's records and the final parameters.
Trained train(const framework::config::Config& cfg,
              const std::function<std::vector<StepRecord>(Trainer&)>& drive) {
  Trained out;
  std::mutex mu;
  run_runtimes(kWorld, [&](comm::Runtime& rt) {
    Trainer trainer(cfg, rt);
    std::vector<StepRecord> records = drive(trainer);
    auto& model = trainer.model();
    std::vector<torch::Tensor> full;
    for (size_t i = 0; i < model.local_params().size(); ++i) {
      full.push_back(model.param_dtensor(i).full_tensor());
    }
    if (rt.env.rank == 0) {
      std::lock_guard<std::mutex> lock(mu);
      out.records = records;
      out.params = full;
    }
  });
  fs::remove_all(cfg.run.dir);
  return out;
}

std::vector<StepRecord> with_run(Trainer& t, int expected_status = 0) {
  EXPECT_EQ(t.run(), expected_status);
  return t.history();
}

std::vector<StepRecord> with_train_step(Trainer& t) {
  std::vector<StepRecord> records;
  for (int64_t i = 0; i < kStepTestSteps; ++i) records.push_back(t.train_step());
  EXPECT_EQ(t.step(), kStepTestSteps);
  EXPECT_EQ(t.history().size(), records.size());
  return records;
}

const Trained& by_run() {
  static Trained r = train(step_config(step_run_dir("run")), [](Trainer& t) { return with_run(t); });
  return r;
}

const Trained& by_train_step() {
  static Trained r = train(step_config(step_run_dir("train_step")), with_train_step);
  return r;
}

// Sets the trainer's stop signal as SIGTERM would, for one scope. Ranks run
// as threads of this process, so every rank sees it.
struct StopSignalRaised {
  StopSignalRaised() { Trainer::stop_signal().store(SIGTERM); }
  ~StopSignalRaised() { Trainer::stop_signal().store(0); }
};

}  // namespace

TEST(TrainStep, CalledNTimesGivesTheLossesOfRunForNSteps) {
  const Trained& ref = by_run();
  const Trained& got = by_train_step();
  ASSERT_EQ(ref.records.size(), static_cast<size_t>(kStepTestSteps));
  ASSERT_EQ(got.records.size(), static_cast<size_t>(kStepTestSteps));
  for (size_t i = 0; i < ref.records.size(); ++i) {
    EXPECT_EQ(got.records[i].loss, ref.records[i].loss) << "step " << i + 1;
    EXPECT_EQ(got.records[i].lr, ref.records[i].lr) << "step " << i + 1;
    EXPECT_EQ(got.records[i].grad_norm, ref.records[i].grad_norm) << "step " << i + 1;
  }
  ASSERT_EQ(got.params.size(), ref.params.size());
  for (size_t i = 0; i < ref.params.size(); ++i) {
    EXPECT_TRUE(torch::equal(got.params[i], ref.params[i])) << "parameter " << i;
  }
}

TEST(TrainStep, RecordsNumberTheStepsAndCarryTheirMetrics) {
  const auto& records = by_train_step().records;
  ASSERT_EQ(records.size(), static_cast<size_t>(kStepTestSteps));
  for (size_t i = 0; i < records.size(); ++i) {
    const StepRecord& r = records[i];
    EXPECT_EQ(r.step, static_cast<int64_t>(i) + 1);
    EXPECT_TRUE(std::isfinite(r.loss)) << "step " << r.step;
    EXPECT_GT(r.loss, 0) << "step " << r.step;
    EXPECT_GT(r.lr, 0) << "step " << r.step;
    EXPECT_GT(r.grad_norm, 0) << "step " << r.step;
    EXPECT_GT(r.tokens_per_s, 0) << "step " << r.step;
    EXPECT_FALSE(r.stop_requested) << "step " << r.step;
    EXPECT_FALSE(r.checkpoint_started) << "train_step() saves nothing";
  }
}

TEST(TrainStep, PastTrainStepsIsRefused) {
  auto cfg = step_config(step_run_dir("past_end"));
  cfg.train.steps = 1;
  run_runtimes(1, [&](comm::Runtime& rt) {
    Trainer trainer(cfg, rt);
    trainer.train_step();
    EXPECT_THROW(trainer.train_step(), c10::Error);
    EXPECT_EQ(trainer.step(), 1);
  });
  fs::remove_all(cfg.run.dir);
}

TEST(TrainStep, ReportsAStopSignalAndKeepsTraining) {
  StopSignalRaised raised;
  auto records = train(step_config(step_run_dir("stop_step")), with_train_step).records;
  ASSERT_EQ(records.size(), static_cast<size_t>(kStepTestSteps));
  for (const auto& r : records) EXPECT_TRUE(r.stop_requested) << "step " << r.step;
}

TEST(TrainerRun, RecordsWhichStepsItSaved) {
  auto cfg = step_config(step_run_dir("saves"));
  cfg.checkpoint.interval = 2;
  cfg.train.steps = 5;
  auto records = train(cfg, [](Trainer& t) { return with_run(t); }).records;
  ASSERT_EQ(records.size(), 5u);
  for (const auto& r : records) {
    // Every interval, and at the last step.
    EXPECT_EQ(r.checkpoint_started, r.step % 2 == 0 || r.step == 5) << "step " << r.step;
    EXPECT_FALSE(r.checkpoint_skipped) << "step " << r.step;
  }
}

TEST(TrainerRun, StopsAfterTheFirstStepOnAStopSignalAndSavesIt) {
  StopSignalRaised raised;
  auto cfg = step_config(step_run_dir("stop_run"));
  cfg.checkpoint.interval = 100;
  auto records = train(cfg, [](Trainer& t) {
    return with_run(t, framework::train::kExitPreempted);
  }).records;
  ASSERT_EQ(records.size(), 1u);
  EXPECT_TRUE(records[0].stop_requested);
  EXPECT_TRUE(records[0].checkpoint_started);
}
