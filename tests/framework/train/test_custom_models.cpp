// The two example models (examples/fsdp_custom_model: a LLaMA-style decoder
// with tied embeddings; examples/ddp_cnn: a CNN with a frozen BatchNorm
// stem), defined in the examples and trained through Trainer(UserModel):
// FSDP at worlds 2 and 3, DDP at 2 and HSDP 2x2 give the per-step losses of
// world 1; resume at the same world is bit-exact; a checkpoint reshards
// from world 2 to 3.
#include "examples/ddp_cnn/setup.h"
#include "examples/fsdp_custom_model/setup.h"
#include "framework/fsdp/fully_shard.h"
#include "framework/train/trainer.h"
#include "support/multi_rank.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <algorithm>
#include <functional>
#include <map>
#include <mutex>
#include <string>

namespace fs = std::filesystem;
using framework::train::Trainer;
using framework::train::UserModel;
using testing_support::run_runtimes;

namespace {

enum class Example { kLlama, kCnn };

std::string name_of(Example e) { return e == Example::kLlama ? "llama" : "cnn"; }

UserModel make_model(Example e, int64_t seed) {
  // Ranks are threads here: the global generator must not interleave.
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  return e == Example::kLlama ? llama::make_user_model(seed) : cnn::make_user_model(seed);
}

framework::config::Config config_for(Example e, const std::string& dir, int64_t steps) {
  framework::config::Config c;
  c.run.dir = dir;
  c.run.seed = 11;
  c.train.steps = steps;
  c.train.global_batch_size = 12;  // divisible by 1, 2, 3 and 4
  c.train.log_every = 100;
  c.train.grad_clip = 1.0;
  c.optim.lr = e == Example::kLlama ? 3e-3 : 1e-2;
  c.optim.warmup_steps = 2;
  c.checkpoint.interval = 0;
  return c;
}

std::string temp_dir(const std::string& tag) {
  auto dir = fs::temp_directory_path() /
             ("shardkit_custom_" + tag + "_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  return dir.string();
}

struct ExampleLayout {
  int world;
  int64_t replicate;
  int64_t shard;
};

// Trains `steps` steps (checkpointing every `interval`, 0: never) in `dir`
// and returns rank 0's losses of the steps this run took.
std::vector<double> train(Example e, const ExampleLayout& l, const std::string& dir, int64_t steps,
                          int64_t interval = 0, int64_t stop_at = 0) {
  auto cfg = config_for(e, dir, steps);
  cfg.parallel.replicate = l.replicate;
  cfg.parallel.shard = l.shard;
  cfg.checkpoint.interval = interval;
  cfg.train.stop_at = stop_at;
  std::vector<double> losses;
  std::mutex mu;
  run_runtimes(l.world, [&](comm::Runtime& rt) {
    Trainer trainer(cfg, rt, make_model(e, cfg.run.seed));
    EXPECT_EQ(trainer.run(), 0);
    if (rt.env.rank == 0) {
      std::lock_guard<std::mutex> lock(mu);
      for (const auto& rec : trainer.history()) losses.push_back(rec.loss);
    }
  });
  return losses;
}

constexpr int64_t kExampleSteps = 8;

const std::vector<double>& reference(Example e) {
  static std::map<Example, std::vector<double>> cache;
  auto it = cache.find(e);
  if (it == cache.end()) {
    const std::string dir = temp_dir(name_of(e) + "_ref");
    it = cache.emplace(e, train(e, {1, 1, 1}, dir, kExampleSteps)).first;
    fs::remove_all(dir);
  }
  return it->second;
}

void expect_matches_world_one(Example e, const ExampleLayout& l, const std::string& what) {
  const std::string dir = temp_dir(name_of(e) + "_" + what);
  const std::vector<double> got = train(e, l, dir, kExampleSteps);
  fs::remove_all(dir);
  const std::vector<double>& ref = reference(e);
  ASSERT_EQ(ref.size(), static_cast<size_t>(kExampleSteps));
  ASSERT_EQ(got.size(), ref.size()) << what;
  for (size_t i = 0; i < ref.size(); ++i) {
    EXPECT_NEAR(got[i], ref[i], 1e-5 * std::abs(ref[i])) << name_of(e) << " " << what
                                                          << ": loss of step " << i + 1;
  }
  EXPECT_LT(ref.back(), ref.front()) << name_of(e) << ": the loss does not fall";
}

class CustomModel : public ::testing::TestWithParam<Example> {};

TEST_P(CustomModel, FsdpAtWorldTwoMatchesWorldOne) {
  expect_matches_world_one(GetParam(), {2, 1, -1}, "fsdp2");
}
TEST_P(CustomModel, FsdpAtWorldThreeMatchesWorldOne) {
  expect_matches_world_one(GetParam(), {3, 1, -1}, "fsdp3");
}
TEST_P(CustomModel, DdpAtWorldTwoMatchesWorldOne) {
  expect_matches_world_one(GetParam(), {2, -1, 1}, "ddp2");
}
TEST_P(CustomModel, Hsdp2x2MatchesWorldOne) {
  expect_matches_world_one(GetParam(), {4, 2, 2}, "hsdp2x2");
}

// Stopped at step 4 and resumed (a fresh model from another seed would be
// overwritten anyway), the run takes exactly the losses of an uninterrupted
// one.
TEST_P(CustomModel, ResumeAtTheSameWorldIsBitExact) {
  const Example e = GetParam();
  const ExampleLayout fsdp2{2, 1, -1};
  const std::string straight_dir = temp_dir(name_of(e) + "_straight");
  const std::vector<double> straight = train(e, fsdp2, straight_dir, kExampleSteps, 4);
  const std::string dir = temp_dir(name_of(e) + "_resumed");
  std::vector<double> resumed = train(e, fsdp2, dir, kExampleSteps, 4, /*stop_at=*/4);
  ASSERT_EQ(resumed.size(), 4u);
  ASSERT_TRUE(fs::exists(fs::path(dir) / "checkpoints" / "step_4" / ".metadata"));
  const std::vector<double> rest = train(e, fsdp2, dir, kExampleSteps, 4);
  ASSERT_EQ(rest.size(), 4u) << "the second run did not resume at step 4";
  resumed.insert(resumed.end(), rest.begin(), rest.end());
  ASSERT_EQ(straight.size(), resumed.size());
  for (size_t i = 0; i < straight.size(); ++i) {
    EXPECT_EQ(straight[i], resumed[i]) << name_of(e) << ": loss of step " << i + 1;
  }
  fs::remove_all(straight_dir);
  fs::remove_all(dir);
}

// Saved by FSDP at world 2, resumed by FSDP at world 3: the remaining steps
// are those of world 1.
TEST_P(CustomModel, CheckpointReshardsFromWorldTwoToThree) {
  const Example e = GetParam();
  const std::string dir = temp_dir(name_of(e) + "_reshard");
  train(e, {2, 1, -1}, dir, kExampleSteps, 4, /*stop_at=*/4);
  const std::vector<double> rest = train(e, {3, 1, -1}, dir, kExampleSteps, 4);
  fs::remove_all(dir);
  const std::vector<double>& ref = reference(e);
  ASSERT_EQ(rest.size(), 4u) << "world 3 did not resume at step 4";
  for (size_t i = 0; i < rest.size(); ++i) {
    EXPECT_NEAR(rest[i], ref[4 + i], 1e-5 * std::abs(ref[4 + i]))
        << name_of(e) << ": loss of step " << 5 + i;
  }
}

INSTANTIATE_TEST_SUITE_P(Examples, CustomModel, ::testing::Values(Example::kLlama, Example::kCnn),
                         [](const ::testing::TestParamInfo<Example>& info) {
                           return info.param == Example::kLlama ? "Llama" : "Cnn";
                         });

// The example model's parameter names follow the module's own, tied
// weights once, and the CNN's BatchNorm statistics are checkpoint items.
TEST(CustomModelState, NamesFollowTheModuleAndTiedWeightsAppearOnce) {
  run_runtimes(2, [&](comm::Runtime& rt) {
    auto cfg = config_for(Example::kLlama, temp_dir("names_" + std::to_string(rt.env.rank)), 1);
    Trainer trainer(cfg, rt, make_model(Example::kLlama, 3));
    const std::vector<std::string> names = trainer.model().param_names();
    EXPECT_EQ(names.front(), "tok_embeddings.weight");
    EXPECT_EQ(std::count(names.begin(), names.end(), "output.weight"), 0)
        << "the tied output weight is the embedding's";
    EXPECT_EQ(std::count(names.begin(), names.end(), "layers.1.feed_forward.w3.weight"), 1);
    EXPECT_EQ(trainer.model().unit_names(),
              (std::vector<std::string>{"root", "layers.0", "layers.1"}));
  });
}

}  // namespace
