// Training results do not depend on the world size or the parallel mode:
// FSDP, DDP and HSDP runs match a single-process run step by step.
#include "framework/fsdp/fully_shard.h"
#include "models/layered_model.h"
#include "framework/train/trainer.h"
#include "support/multi_rank.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>

namespace fs = std::filesystem;
using framework::train::Trainer;
using testing_support::run_runtimes;

namespace {

framework::config::Config small_config(const std::string& dir) {
  framework::config::Config c;
  c.run.dir = dir;
  c.run.seed = 7;
  c.train.steps = 20;
  c.train.global_batch_size = 12;  // divisible by 1, 2, 3 and 4
  c.train.log_every = 5;
  c.train.grad_clip = 0.5;         // active: exercises the global-norm path
  c.model.vocab_size = 16;
  c.model.seq_len = 16;
  c.model.d_model = 32;
  c.model.n_heads = 2;
  c.model.n_layers = 3;
  c.optim.warmup_steps = 3;
  c.checkpoint.interval = 0;
  return c;
}

struct RunResult {
  std::vector<double> losses;
  std::vector<double> grad_norms;
  std::vector<torch::Tensor> params;  // full tensors after training
};

std::string temp_run_dir(const std::string& tag) {
  auto dir = fs::temp_directory_path() / ("shardkit_train_" + tag + "_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  return dir.string();
}

RunResult train(int world, int64_t replicate, int64_t shard, const std::string& tag) {
  auto cfg = small_config(temp_run_dir(tag));
  cfg.parallel.replicate = replicate;
  cfg.parallel.shard = shard;
  RunResult result;
  std::mutex mu;
  run_runtimes(world, [&](framework::dist::Runtime& rt) {
    Trainer trainer(cfg, rt);
    EXPECT_EQ(trainer.run(), 0);
    auto& model = trainer.model();
    std::vector<torch::Tensor> full;
    for (size_t i = 0; i < model.local_params().size(); ++i) {
      full.push_back(model.param_dtensor(i).full_tensor());
    }
    if (rt.env.rank == 0) {
      std::lock_guard<std::mutex> lock(mu);
      for (const auto& rec : trainer.history()) {
        result.losses.push_back(rec.loss);
        result.grad_norms.push_back(rec.grad_norm);
      }
      result.params = full;
    }
  });
  fs::remove_all(cfg.run.dir);
  return result;
}

const RunResult& single_process() {
  static RunResult r = train(1, 1, 1, "single");
  return r;
}

void expect_matches_single(const RunResult& got, const std::string& what) {
  const RunResult& ref = single_process();
  ASSERT_EQ(got.losses.size(), ref.losses.size()) << what;
  ASSERT_EQ(got.losses.size(), 20u);
  for (size_t i = 0; i < ref.losses.size(); ++i) {
    EXPECT_NEAR(got.losses[i], ref.losses[i], 1e-5 * std::abs(ref.losses[i]))
        << what << ": loss of step " << i + 1;
    EXPECT_NEAR(got.grad_norms[i], ref.grad_norms[i], 1e-4 * std::abs(ref.grad_norms[i]))
        << what << ": grad norm of step " << i + 1;
  }
  ASSERT_EQ(got.params.size(), ref.params.size());
  for (size_t i = 0; i < ref.params.size(); ++i) {
    // AdamW amplifies float-order noise in near-zero gradients; 1e-4 is still
    // 30x below one lr-sized update (lr 3e-3), so a real mismatch fails.
    EXPECT_TRUE(torch::allclose(got.params[i], ref.params[i], /*rtol=*/1e-4, /*atol=*/1e-4))
        << what << ": parameter " << i << " differs by "
        << (got.params[i] - ref.params[i]).abs().max().item<double>();
  }
}

}  // namespace

TEST(TrainingEquivalence, SingleProcessLossFalls) {
  const RunResult& ref = single_process();
  ASSERT_EQ(ref.losses.size(), 20u);
  EXPECT_LT(ref.losses.back(), ref.losses.front());
}

TEST(TrainingEquivalence, FsdpAtWorldTwoMatchesSingleProcess) {
  expect_matches_single(train(2, 1, -1, "fsdp2"), "FSDP world 2");
}

TEST(TrainingEquivalence, FsdpAtWorldThreeMatchesSingleProcess) {
  expect_matches_single(train(3, 1, -1, "fsdp3"), "FSDP world 3");
}

TEST(TrainingEquivalence, FsdpAtWorldFourMatchesSingleProcess) {
  expect_matches_single(train(4, 1, -1, "fsdp4"), "FSDP world 4");
}

TEST(TrainingEquivalence, DdpAtWorldTwoMatchesSingleProcess) {
  expect_matches_single(train(2, -1, 1, "ddp2"), "DDP world 2");
}

TEST(TrainingEquivalence, Hsdp2x2MatchesSingleProcess) {
  expect_matches_single(train(4, 2, 2, "hsdp"), "HSDP 2x2");
}

// The world-1 run is LibTorch's AdamW on the full, unsharded parameters; the
// FSDP run applies the same AdamW to shards only.
TEST(TrainingEquivalence, ShardedAdamWMatchesAdamWOnFullParameters) {
  RunResult sharded = train(2, 1, 2, "adamw");
  const RunResult& ref = single_process();
  for (size_t i = 0; i < ref.params.size(); ++i) {
    EXPECT_TRUE(torch::allclose(sharded.params[i], ref.params[i], 1e-4, 1e-4)) << "param " << i;
  }
}

TEST(TrainingDeterminism, SameSeedSameWorldTwiceGivesBitIdenticalLosses) {
  RunResult a = train(2, 1, -1, "det_a");
  RunResult b = train(2, 1, -1, "det_b");
  ASSERT_EQ(a.losses.size(), b.losses.size());
  for (size_t i = 0; i < a.losses.size(); ++i) {
    EXPECT_EQ(a.losses[i], b.losses[i]) << "step " << i + 1;
  }
  for (size_t i = 0; i < a.params.size(); ++i) EXPECT_TRUE(torch::equal(a.params[i], b.params[i]));
}

// Every rank of a threads-as-ranks test drew the same tensors: the draws
// were made under seed_global_generator, not interleaved between ranks.
void expect_same_on_every_rank(const std::vector<torch::Tensor>& by_rank, const std::string& what) {
  for (size_t r = 1; r < by_rank.size(); ++r) {
    EXPECT_TRUE(torch::equal(by_rank[r], by_rank[0])) << what << " of rank " << r << " differs from rank 0's";
  }
}

TEST(GradientClipping, ClipsByTheTrueGlobalNormAcrossShards) {
  std::vector<torch::Tensor> first_params(3), batches(3);
  run_runtimes(3, [&](framework::dist::Runtime& rt) {
    auto cfg = small_config(temp_run_dir("clip_" + std::to_string(rt.env.rank)));
    auto mesh = framework::dtensor::DeviceMesh::create(*rt.rendezvous, {1, 3}, {"replicate", "shard"});
    std::shared_ptr<models::LayeredModelImpl> model;
    {
      auto lock = testing_support::seed_global_generator(3);
      model = models::make_model(cfg.model);
    }
    first_params[rt.env.rank] = model->parameters()[0].detach().clone();
    framework::fsdp::FullyShardedModel fsdp(model, mesh, cfg.parallel, framework::fsdp::children_of(*model, "blocks"));
    torch::Tensor tokens;
    {
      auto lock = testing_support::seed_global_generator(11);
      tokens = torch::randint(0, cfg.model.vocab_size, {2, cfg.model.seq_len}, torch::kLong);
    }
    batches[rt.env.rank] = tokens;
    fsdp.forward([&] { return model->forward(tokens); }).pow(2).mean().backward();
    fsdp.finish_backward();
    double sq = 0;
    for (size_t i = 0; i < fsdp.local_params().size(); ++i) {
      auto g = fsdp.like_param(i, fsdp.local_params()[i].grad()).full_tensor();
      sq += g.to(torch::kDouble).pow(2).sum().item<double>();
    }
    double true_norm = std::sqrt(sq);
    double reported = fsdp.clip_grad_norm(true_norm / 4);
    EXPECT_NEAR(reported, true_norm, 1e-6 * true_norm);
    EXPECT_NEAR(fsdp.grad_norm(), true_norm / 4, 1e-4 * true_norm);
  });
  expect_same_on_every_rank(first_params, "the initial first parameter");
  expect_same_on_every_rank(batches, "the batch");
}

TEST(FsdpMemory, PeakParamsAndGradsAreShardsPlusRootPlusOneUnit) {
  std::vector<torch::Tensor> first_params(4), batches(4);
  run_runtimes(4, [&](framework::dist::Runtime& rt) {
    auto cfg = small_config("unused");
    cfg.model.n_layers = 6;
    cfg.model.tie_weights = true;
    auto mesh = framework::dtensor::DeviceMesh::create(*rt.rendezvous, {1, 4}, {"replicate", "shard"});
    std::shared_ptr<models::LayeredModelImpl> model;
    torch::Tensor tokens;
    {
      auto lock = testing_support::seed_global_generator(3);
      model = models::make_model(cfg.model);
      tokens = torch::randint(0, cfg.model.vocab_size, {2, cfg.model.seq_len}, torch::kLong);
    }
    first_params[rt.env.rank] = model->parameters()[0].detach().clone();
    batches[rt.env.rank] = tokens;
    framework::fsdp::FullyShardedModel fsdp(model, mesh, cfg.parallel, framework::fsdp::children_of(*model, "blocks"));
    fsdp.forward([&] { return model->forward(tokens); }).pow(2).mean().backward();
    fsdp.finish_backward();
    const auto& st = fsdp.memory_stats();
    int64_t block_bytes = 0;
    for (const auto& p : model->block(0)->parameters()) block_bytes += p.numel() * 4;
    int64_t root_bytes = st.full_param_bytes - 6 * block_bytes;
    // Root params + grads, plus params + grads of at most two blocks in flight
    // (the one finishing its reduce-scatter and the next one gathered).
    EXPECT_LE(st.peak_gathered_bytes, 2 * root_bytes + 4 * block_bytes);
    // Far below the unsharded params + grads.
    EXPECT_LT(st.peak_gathered_bytes + 2 * st.sharded_param_bytes, 2 * st.full_param_bytes * 3 / 4);
    EXPECT_EQ(st.sharded_param_bytes * 4 >= st.full_param_bytes, true);
  });
  expect_same_on_every_rank(first_params, "the initial first parameter");
  expect_same_on_every_rank(batches, "the batch");
}
