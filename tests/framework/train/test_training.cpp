// Training results do not depend on the world size or the parallel mode:
// FSDP, DDP and HSDP runs match a single-process run step by step.
#include "framework/fsdp/fully_shard.h"
#include "framework/optim/lr_schedule.h"
#include "framework/optim/sharded_adamw.h"
#include "models/layered_model.h"
#include "models/model_spec.h"
#include "framework/train/metrics_log.h"
#include "framework/train/tensorboard.h"
#include "framework/train/preflight.h"
#include "framework/train/trainer.h"
#include "framework/train/profiler.h"
#include "framework/config/config.h"
#include "support/multi_rank.h"
#include "support/paths.h"
#include "support/python.h"
#include "support/skip.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <sys/wait.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>
#include <sstream>
#include <tuple>

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
  std::vector<double> comm_waits;     // StepRecord::comm_wait_s
  std::vector<torch::Tensor> params;  // full tensors after training
};

std::string temp_run_dir(const std::string& tag) {
  auto dir = fs::temp_directory_path() / ("shardkit_train_" + tag + "_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  return dir.string();
}

RunResult run_config(int world, const framework::config::Config& cfg);

RunResult train(int world, int64_t replicate, int64_t shard, const std::string& tag) {
  auto cfg = small_config(temp_run_dir(tag));
  cfg.parallel.replicate = replicate;
  cfg.parallel.shard = shard;
  return run_config(world, cfg);
}

RunResult run_config(int world, const framework::config::Config& cfg) {
  RunResult result;
  std::mutex mu;
  run_runtimes(world, [&](comm::Runtime& rt) {
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
        result.comm_waits.push_back(rec.comm_wait_s);
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

// parallel.prefetch: the same collectives and the same reduction order with
// and without overlap, so the same bits, in every layout, fp32 and bf16,
// with activation checkpointing and gradient accumulation.
TEST(FsdpPrefetch, LossesAndParametersAreBitIdenticalToPrefetchZeroInEveryLayout) {
  struct Case {
    const char* name;
    int world;
    int64_t replicate, shard, tensor;
    bool llama;
    const char* dtype;
    int64_t micro;
    const char* checkpointing;
  };
  const Case cases[] = {
      {"fsdp fp32", 2, 1, -1, 1, false, "fp32", 0, "none"},
      {"fsdp bf16, accumulation, checkpointing", 2, 1, -1, 1, false, "bf16", 3, "full"},
      {"hsdp 2x2 fp32, accumulation", 4, 2, 2, 1, false, "fp32", 3, "none"},
      {"ddp bf16, accumulation", 2, -1, 1, 1, false, "bf16", 2, "none"},
      {"llama tp2 x fsdp2 fp32", 4, 1, -1, 2, true, "fp32", 0, "none"},
      {"llama tp2 x fsdp2 bf16, checkpointing", 4, 1, -1, 2, true, "bf16", 0, "full"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    RunResult runs[2];
    for (int prefetch : {0, 1}) {
      auto cfg = small_config(temp_run_dir(std::string("prefetch") + std::to_string(prefetch)));
      cfg.train.steps = 6;
      if (c.llama) {
        cfg.model.kind = "llama";
        cfg.model.tie_weights = false;
        cfg.model.n_heads = 4;
        cfg.model.n_kv_heads = 2;
        cfg.model.d_ff = 48;
      }
      cfg.parallel.replicate = c.replicate;
      cfg.parallel.shard = c.shard;
      cfg.parallel.tensor = c.tensor;
      cfg.parallel.prefetch = prefetch;
      cfg.train.mixed_precision.param_dtype =
          framework::fsdp::parse_precision_dtype(c.dtype, "train.mixed_precision.param_dtype");
      cfg.train.micro_batch_size = c.micro;
      cfg.model.activation_checkpointing = models::parse_activation_checkpointing(c.checkpointing);
      runs[prefetch] = run_config(c.world, cfg);
      fs::remove_all(cfg.run.dir);
    }
    ASSERT_EQ(runs[0].losses.size(), 6u);
    ASSERT_EQ(runs[1].losses.size(), 6u);
    for (size_t i = 0; i < runs[0].losses.size(); ++i) {
      // Gloo's waits block the host: every step waited for its collectives.
      EXPECT_GT(runs[0].comm_waits[i], 0.0) << "comm_wait_s of step " << i + 1;
      EXPECT_LT(runs[0].comm_waits[i], 60.0) << "comm_wait_s of step " << i + 1;
      EXPECT_EQ(runs[1].losses[i], runs[0].losses[i]) << "loss of step " << i + 1;
      EXPECT_EQ(runs[1].grad_norms[i], runs[0].grad_norms[i]) << "grad norm of step " << i + 1;
    }
    ASSERT_EQ(runs[1].params.size(), runs[0].params.size());
    for (size_t i = 0; i < runs[0].params.size(); ++i) {
      EXPECT_TRUE(torch::equal(runs[1].params[i], runs[0].params[i])) << "parameter " << i;
    }
  }
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
  run_runtimes(3, [&](comm::Runtime& rt) {
    auto cfg = small_config(temp_run_dir("clip_" + std::to_string(rt.env.rank)));
    auto mesh = framework::dtensor::DeviceMesh::create(*rt.rendezvous, {1, 3}, {"replicate", "shard"});
    std::shared_ptr<models::LayeredModelImpl> model;
    {
      auto lock = testing_support::seed_global_generator(3);
      model = models::make_model(cfg.model);
    }
    first_params[rt.env.rank] = model->parameters()[0].detach().clone();
    framework::fsdp::FullyShardedModel fsdp(model, mesh, framework::parallel::fsdp_options(cfg.parallel), framework::fsdp::children_of(*model, "blocks"));
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
  run_runtimes(4, [&](comm::Runtime& rt) {
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
    framework::fsdp::FullyShardedModel fsdp(model, mesh, framework::parallel::fsdp_options(cfg.parallel), framework::fsdp::children_of(*model, "blocks"));
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

// AdamW's three implementations (train.optimizer_impl) against each other and
// against Python's torch.optim.AdamW: the same parameters, the same gradients
// (drawn here, set on the shards directly), the lr schedule of the trainer,
// 20 steps.
namespace {

using framework::optim::AdamWImpl;

struct AdamWTrace {
  std::vector<torch::Tensor> params, exp_avgs, exp_avg_sqs;
};

struct AdamWCase {
  std::vector<torch::Tensor> initial;               // per parameter
  std::vector<std::vector<torch::Tensor>> grads;    // [step][parameter]
  std::vector<double> lrs;                          // per step
  framework::config::Config cfg;
};

constexpr int kAdamWSteps = 20;

AdamWCase make_adamw_case() {
  AdamWCase c;
  c.cfg = small_config(temp_run_dir("adamw_case"));
  c.cfg.optim.weight_decay = 0.1;
  auto lock = testing_support::seed_global_generator(21);
  auto model = models::make_model(c.cfg.model);
  for (const torch::Tensor& p : model->parameters()) c.initial.push_back(p.detach().clone());
  for (int s = 0; s < kAdamWSteps; ++s) {
    std::vector<torch::Tensor> g;
    // Gradients of varied scale, some entries tiny, as in training.
    for (const torch::Tensor& p : c.initial) g.push_back(torch::randn_like(p) * std::pow(10.0, -(s % 4)));
    c.grads.push_back(std::move(g));
    c.lrs.push_back(framework::optim::lr_at(c.cfg.optim, s + 1, kAdamWSteps));
  }
  return c;
}

// ShardedAdamW(impl) at world 1 from c.initial, kAdamWSteps steps of c.grads.
AdamWTrace run_sharded_adamw(const AdamWCase& c, AdamWImpl impl) {
  AdamWTrace trace;
  run_runtimes(1, [&](comm::Runtime& rt) {
    auto mesh = framework::dtensor::DeviceMesh::create(*rt.rendezvous, {1, 1}, {"replicate", "shard"});
    std::shared_ptr<models::LayeredModelImpl> model;
    {
      auto lock = testing_support::seed_global_generator(21);
      model = models::make_model(c.cfg.model);
    }
    {
      torch::NoGradGuard no_grad;
      auto ps = model->parameters();
      for (size_t i = 0; i < ps.size(); ++i) ps[i].copy_(c.initial[i]);
    }
    framework::fsdp::FullyShardedModel fsdp(model, mesh, framework::parallel::fsdp_options(c.cfg.parallel),
                                            framework::fsdp::children_of(*model, "blocks"));
    framework::optim::ShardedAdamW opt(fsdp, c.cfg.optim, kAdamWSteps, impl);
    std::vector<torch::Tensor> locals = fsdp.local_params();
    ASSERT_EQ(locals.size(), c.initial.size());
    for (int s = 0; s < kAdamWSteps; ++s) {
      for (size_t i = 0; i < locals.size(); ++i) {
        locals[i].mutable_grad() = c.grads[s][i].reshape(locals[i].sizes()).clone();
      }
      EXPECT_DOUBLE_EQ(opt.step(s + 1), c.lrs[s]);
    }
    for (size_t i = 0; i < locals.size(); ++i) {
      const framework::optim::AdamWParamState st = opt.state(i);
      EXPECT_EQ(st.step, kAdamWSteps);
      trace.params.push_back(locals[i].detach().clone().reshape(c.initial[i].sizes()));
      trace.exp_avgs.push_back(st.exp_avg.local().clone().reshape(c.initial[i].sizes()));
      trace.exp_avg_sqs.push_back(st.exp_avg_sq.local().clone().reshape(c.initial[i].sizes()));
    }
  });
  return trace;
}

void expect_traces_within(const AdamWTrace& got, const AdamWTrace& want, double tol, const std::string& what) {
  ASSERT_EQ(got.params.size(), want.params.size()) << what;
  double worst = 0;
  for (size_t i = 0; i < want.params.size(); ++i) {
    for (const auto& [a, b, name] : {std::tuple(got.params[i], want.params[i], "param"),
                                     std::tuple(got.exp_avgs[i], want.exp_avgs[i], "exp_avg"),
                                     std::tuple(got.exp_avg_sqs[i], want.exp_avg_sqs[i], "exp_avg_sq")}) {
      const double diff = (a - b).abs().max().item<double>();
      worst = std::max(worst, diff);
      EXPECT_LE(diff, tol) << what << ": " << name << " of parameter " << i << " differs by " << diff;
    }
  }
  std::cout << "[ adamw    ] " << what << ": largest difference after " << kAdamWSteps << " steps "
            << worst << "\n";
}

std::vector<AdamWImpl> adamw_impls_here() {
  std::vector<AdamWImpl> v{AdamWImpl::kForLoop, AdamWImpl::kForeach};
  if (framework::optim::adamw_impl_available(AdamWImpl::kFused)) v.push_back(AdamWImpl::kFused);
  return v;
}

void write_f32(const fs::path& path, const torch::Tensor& t) {
  torch::Tensor c = t.to(torch::kFloat).contiguous();
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(static_cast<const char*>(c.data_ptr()), static_cast<std::streamsize>(c.numel() * 4));
}

torch::Tensor read_f32(const fs::path& path, at::IntArrayRef shape) {
  std::ifstream f(path, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(f)), {});
  torch::Tensor t = torch::empty(shape, torch::kFloat);
  EXPECT_EQ(bytes.size(), static_cast<size_t>(t.numel() * 4)) << path;
  std::memcpy(t.data_ptr(), bytes.data(), std::min<size_t>(bytes.size(), t.numel() * 4));
  return t;
}

std::string adamw_file_text(const fs::path& path) {
  std::ifstream f(path);
  std::ostringstream text;
  text << f.rdbuf();
  return text.str();
}

}  // namespace

TEST(AdamWImpls, ForeachAndFusedMatchTheForLoopWithinOneMillionth) {
  const AdamWCase c = make_adamw_case();
  const AdamWTrace loop = run_sharded_adamw(c, AdamWImpl::kForLoop);
  // The updates move parameters by ~lr per step: a real fault is far above 1e-6.
  EXPECT_GT((loop.params[0] - c.initial[0]).abs().max().item<double>(), 1e-3);
  for (AdamWImpl impl : adamw_impls_here()) {
    if (impl == AdamWImpl::kForLoop) continue;
    expect_traces_within(run_sharded_adamw(c, impl), loop, 1e-6,
                         std::string(framework::optim::adamw_impl_name(impl)) + " vs for_loop");
  }
  if (!framework::optim::adamw_impl_available(AdamWImpl::kFused)) {
    std::cout << "[ adamw    ] fused not compared: LibTorch " << TORCH_VERSION
              << " has no _fused_adamw_ (2.4 and later have it)\n";
  }
}

TEST(AdamWImpls, EachMatchesPyTorchsAdamWOfTheSameImplementationOverTwentySteps) {
  const std::string python = testing_support::python_with("torch");
  if (python.empty()) {
    SHARDKIT_SKIP("no python3 with torch (tried $SHARDKIT_PYTHON, /usr/bin/python3, python3): "
                  "apt-get install python3-torch to compare against torch.optim.AdamW");
  }
  const AdamWCase c = make_adamw_case();
  const fs::path dir = temp_run_dir("adamw_python");
  fs::create_directories(dir);
  nlohmann::json manifest;
  manifest["shapes"] = nlohmann::json::array();
  for (size_t i = 0; i < c.initial.size(); ++i) {
    manifest["shapes"].push_back(c.initial[i].sizes().vec());
    write_f32(dir / ("param_" + std::to_string(i) + ".bin"), c.initial[i]);
  }
  for (int s = 0; s < kAdamWSteps; ++s) {
    for (size_t i = 0; i < c.initial.size(); ++i) {
      write_f32(dir / ("grad_" + std::to_string(s) + "_" + std::to_string(i) + ".bin"), c.grads[s][i]);
    }
  }
  manifest["steps"] = kAdamWSteps;
  manifest["lrs"] = c.lrs;
  manifest["beta1"] = c.cfg.optim.beta1;
  manifest["beta2"] = c.cfg.optim.beta2;
  manifest["eps"] = c.cfg.optim.eps;
  manifest["weight_decay"] = c.cfg.optim.weight_decay;
  std::vector<std::string> names;
  for (AdamWImpl impl : adamw_impls_here()) names.push_back(framework::optim::adamw_impl_name(impl));
  manifest["impls"] = names;
  std::ofstream(dir / "manifest.json") << manifest.dump();
  const std::string cmd = python + " " + testing_support::source_dir() + "/tests/tools/adamw_reference.py " + dir.string() +
                          " > " + (dir / "python.log").string() + " 2>&1";
  const int status = std::system(cmd.c_str());
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
      << cmd << " failed; its log:\n"
      << adamw_file_text(dir / "python.log");
  const nlohmann::json done = nlohmann::json::parse(std::ifstream(dir / "py_done.json"));
  std::cout << "[ adamw    ] Python torch " << done["torch"].get<std::string>() << "\n";
  for (const auto& [impl, why] : done["skipped"].items()) {
    std::cout << "[ adamw    ] " << impl << " not compared: Python's " << why.get<std::string>() << "\n";
  }
  // Every implementation this LibTorch has is compared with the same
  // implementation in Python when that torch has it (torch of the same
  // version as LibTorch has all of them: both legs install the same).
  ASSERT_FALSE(done["ran"].empty());
  for (AdamWImpl impl : adamw_impls_here()) {
    const std::string name = framework::optim::adamw_impl_name(impl);
    if (std::find(done["ran"].begin(), done["ran"].end(), name) == done["ran"].end()) continue;
    AdamWTrace py;
    for (size_t i = 0; i < c.initial.size(); ++i) {
      const std::string k = std::to_string(i) + ".bin";
      py.params.push_back(read_f32(dir / ("py_" + name + "_param_" + k), c.initial[i].sizes()));
      py.exp_avgs.push_back(read_f32(dir / ("py_" + name + "_exp_avg_" + k), c.initial[i].sizes()));
      py.exp_avg_sqs.push_back(read_f32(dir / ("py_" + name + "_exp_avg_sq_" + k), c.initial[i].sizes()));
    }
    expect_traces_within(run_sharded_adamw(c, impl), py, 1e-6,
                         name + " vs torch.optim.AdamW(" +
                             (name == "fused" ? "fused=True" : name == "foreach" ? "foreach=True" : "foreach=False") + ")");
  }
  fs::remove_all(dir);
}

TEST(AdamWImpls, AnUnknownOrUnavailableImplementationIsAConfigError) {
  const bool fused = framework::optim::adamw_impl_available(AdamWImpl::kFused);
  EXPECT_EQ(framework::optim::resolve_adamw_impl(framework::optim::OptimizerImpl::kAuto, torch::kCPU),
            fused ? AdamWImpl::kFused : AdamWImpl::kForLoop);
  EXPECT_EQ(framework::optim::resolve_adamw_impl(framework::optim::OptimizerImpl::kAuto, torch::Device(torch::kCUDA, 0)),
            fused ? AdamWImpl::kFused : AdamWImpl::kForeach);
  EXPECT_EQ(framework::optim::resolve_adamw_impl(framework::optim::OptimizerImpl::kForLoop, torch::kCPU), AdamWImpl::kForLoop);
  EXPECT_EQ(framework::optim::resolve_adamw_impl(framework::optim::OptimizerImpl::kForeach, torch::kCPU), AdamWImpl::kForeach);
  try {
    framework::optim::parse_optimizer_impl("fast");
    ADD_FAILURE() << "no error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("train.optimizer_impl 'fast' is not one of auto, fused, foreach, for_loop"),
              std::string::npos)
        << e.what();
  }
  if (!framework::optim::adamw_impl_available(AdamWImpl::kFused)) {
    try {
      framework::optim::resolve_adamw_impl(framework::optim::OptimizerImpl::kFused, torch::kCPU);
      ADD_FAILURE() << "no error";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("needs LibTorch 2.4"), std::string::npos) << e.what();
    }
  }
}

// profile.every / profile.active: a Chrome trace per window and rank, holding
// LibTorch's operators and the trainer's own ranges, on both legs (Kineto on
// 2.6, the legacy profiler on 1.13).
TEST(ProfilerTraces, EveryWindowWritesATraceWithTheTrainersRanges) {
  auto cfg = small_config(temp_run_dir("profile"));
  cfg.train.steps = 6;
  cfg.profile.every = 3;
  cfg.profile.active = 2;
  run_runtimes(1, [&](comm::Runtime& rt) {
    Trainer trainer(cfg, rt);
    EXPECT_EQ(trainer.run(), 0);
  });
  const fs::path dir = fs::path(cfg.run.dir) / "profile";
  std::vector<std::string> windows;
  for (const auto& e : fs::directory_iterator(dir)) windows.push_back(e.path().filename().string());
  std::sort(windows.begin(), windows.end());
  EXPECT_EQ(windows, (std::vector<std::string>{"step_3", "step_6"}));
  for (const std::string& w : windows) {
    const fs::path trace = dir / w / "rank0.json";
    ASSERT_TRUE(fs::exists(trace)) << trace;
    nlohmann::json j = nlohmann::json::parse(std::ifstream(trace));  // throws on a malformed trace
    const nlohmann::json& events = j.is_array() ? j : j.at("traceEvents");
    std::set<std::string> names;
    size_t aten = 0;
    for (const auto& e : events) {
      if (!e.contains("name") || !e["name"].is_string()) continue;
      const std::string n = e["name"].get<std::string>();
      names.insert(n);
      if (n.rfind("aten::", 0) == 0) ++aten;
    }
    for (const char* want : {"shardkit::data", "shardkit::forward", "shardkit::step_stats", "shardkit::backward",
                             "shardkit::finish_gradients", "shardkit::optimizer", "shardkit::checkpoint"}) {
      EXPECT_TRUE(names.count(want)) << trace << " lacks " << want;
    }
    // Two steps: each range twice at least.
    size_t optimizer_ranges = 0;
    for (const auto& e : events) {
      if (e.contains("name") && e["name"] == "shardkit::optimizer" && e.value("ph", "") != "E") ++optimizer_ranges;
    }
    EXPECT_GE(optimizer_ranges, 2u) << trace;
    EXPECT_GT(aten, 50u) << trace << ": LibTorch's operators are missing";
  }
  std::ifstream metrics(fs::path(cfg.run.dir) / "metrics.jsonl");
  int profile_events = 0;
  for (std::string line; std::getline(metrics, line);) {
    if (line.find("\"event\":\"profile\"") != std::string::npos) ++profile_events;
  }
  EXPECT_EQ(profile_events, 2);
  std::cout << "[ profile  ] traced with " << framework::train::StepProfiler::backend() << "\n";
  fs::remove_all(cfg.run.dir);
}

// MFU: the kind's FLOPs per token x the job's tokens/s over the world's
// peak, in every StepRecord and metrics.jsonl step record and in the
// progress line, when the peak is known: train.peak_tflops on the CPU, a
// GPU's from the table under auto. Without a peak there is none.
TEST(Mfu, ComesFromTheKindsFlopsAndTheConfiguredPeak) {
  EXPECT_EQ(framework::train::known_peak_tflops("NVIDIA H100 80GB HBM3"), 989.0);
  EXPECT_EQ(framework::train::known_peak_tflops("NVIDIA H100 PCIe"), 756.0);
  EXPECT_EQ(framework::train::known_peak_tflops("NVIDIA H200"), 989.0);
  EXPECT_EQ(framework::train::known_peak_tflops("NVIDIA A100-SXM4-80GB"), 312.0);
  EXPECT_FALSE(framework::train::known_peak_tflops("NVIDIA GeForce GTX 1080").has_value());
  const framework::train::MfuBasis gpu = framework::train::mfu_basis(1e9, 0, "NVIDIA H200", 8);
  EXPECT_EQ(gpu.peak_flops, 989e12);
  EXPECT_NEAR(gpu.percent(989e3 * 8), 100.0, 1e-9);
  EXPECT_NE(framework::train::mfu_basis(1e9, 0, "", 1).missing.find("train.peak_tflops"), std::string::npos);
  EXPECT_EQ(framework::train::mfu_basis(0, 100, "", 1).percent(1e6), 0.0);

  auto cfg = small_config(temp_run_dir("mfu"));
  cfg.model.kind = "llama";
  cfg.model.tie_weights = false;
  cfg.train.steps = 2;
  cfg.train.log_every = 1;
  cfg.train.peak_tflops = 0.001;  // 1 GFLOP/s per device
  const double flops_per_token = models::find_model_spec(cfg.model.kind).flops_per_token(cfg.model);
  ASSERT_GT(flops_per_token, 0);
  std::vector<framework::train::StepRecord> history;
  run_runtimes(2, [&](comm::Runtime& rt) {
    Trainer trainer(cfg, rt);
    EXPECT_EQ(trainer.run(), 0);
    if (rt.env.rank == 0) history = trainer.history();
  });
  ASSERT_EQ(history.size(), 2u);
  for (const auto& rec : history) {
    EXPECT_NEAR(rec.mfu_percent, 100.0 * flops_per_token * rec.tokens_per_s / (2 * 1e9),
                1e-9 * rec.mfu_percent) << rec.step;
    EXPECT_GT(rec.mfu_percent, 0);
  }
  std::ifstream metrics(fs::path(cfg.run.dir) / "metrics.jsonl");
  int with_mfu = 0;
  for (std::string line; std::getline(metrics, line);) {
    const nlohmann::json j = nlohmann::json::parse(line);
    if (!j.contains("step") || j.contains("event")) continue;
    ASSERT_TRUE(j.contains("mfu_percent")) << line;
    const auto& rec = history.at(j["step"].get<size_t>() - 1);
    EXPECT_DOUBLE_EQ(j["mfu_percent"].get<double>(), rec.mfu_percent);
    ++with_mfu;
  }
  EXPECT_EQ(with_mfu, 2);
  fs::remove_all(cfg.run.dir);

  cfg.train.peak_tflops = 0;  // auto, on the CPU: none
  cfg.run.dir = temp_run_dir("mfu_cpu");
  run_runtimes(1, [&](comm::Runtime& rt) {
    Trainer trainer(cfg, rt);
    EXPECT_EQ(trainer.run(), 0);
    for (const auto& rec : trainer.history()) EXPECT_EQ(rec.mfu_percent, 0) << rec.step;
  });
  std::ifstream none(fs::path(cfg.run.dir) / "metrics.jsonl");
  for (std::string line; std::getline(none, line);) EXPECT_EQ(line.find("mfu"), std::string::npos) << line;
  fs::remove_all(cfg.run.dir);
}

// TFRecord framing of the TensorBoard files: CRC-32C's check value, and the
// mask and layout TensorFlow's record writer uses (tools.TensorBoardFiles*
// reads whole files with independent readers).
TEST(TensorBoard, RecordsAreFramedWithMaskedCrc32c) {
  EXPECT_EQ(framework::train::crc32c("123456789", 9), 0xE3069283u);
  EXPECT_EQ(framework::train::crc32c("", 0), 0u);
  const std::string record = framework::train::tf_record("abc");
  ASSERT_EQ(record.size(), 8u + 4 + 3 + 4);
  EXPECT_EQ(record.substr(0, 8), std::string("\x03\0\0\0\0\0\0\0", 8));
  const uint32_t c = framework::train::crc32c("abc", 3);
  const uint32_t masked = ((c >> 15) | (c << 17)) + 0xA282EAD8u;
  uint32_t stored = 0;
  std::memcpy(&stored, record.data() + 15, 4);
  EXPECT_EQ(stored, masked);
  EXPECT_EQ(framework::train::masked_crc32c("abc", 3), masked);
  EXPECT_EQ(record.substr(12, 3), "abc");
}

TEST(ProfilerTraces, ActiveLongerThanEveryIsAConfigError) {
  const fs::path yaml = fs::path(temp_run_dir("profile_cfg")) / "c.yaml";
  fs::create_directories(yaml.parent_path());
  std::ofstream(yaml) << "profile:\n  every: 2\n  active: 3\n";
  try {
    framework::config::load_config(yaml.string(), {});
    ADD_FAILURE() << "no error";
  } catch (const framework::config::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("profile.active"), std::string::npos) << e.what();
  }
  fs::remove_all(yaml.parent_path());
}

// ---------------------------------------------------------------- model specs

namespace {

// A model kind of the test's own, not one of the built-ins: token embedding,
// residual tanh(linear) blocks, a linear head.
class TanhStackImpl : public models::LayeredModelImpl {
 public:
  explicit TanhStackImpl(const models::ModelOptions& o) {
    embed_ = register_module("embed", torch::nn::Embedding(o.vocab_size, o.d_model));
    blocks_ = register_module("blocks", torch::nn::ModuleList());
    for (int64_t i = 0; i < o.n_layers; ++i) blocks_->push_back(torch::nn::Linear(o.d_model, o.d_model));
    head_ = register_module("head", torch::nn::Linear(o.d_model, o.vocab_size));
  }
  torch::Tensor embed(const torch::Tensor& tokens) override { return embed_(tokens); }
  int64_t num_blocks() const override { return static_cast<int64_t>(blocks_->size()); }
  std::shared_ptr<torch::nn::Module> block(int64_t i) override { return blocks_[static_cast<size_t>(i)]; }
  torch::Tensor block_forward(int64_t i, const torch::Tensor& h) override {
    return h + torch::tanh(blocks_[static_cast<size_t>(i)]->as<torch::nn::Linear>()->forward(h));
  }
  torch::Tensor head(const torch::Tensor& h) override { return head_(h); }

 private:
  torch::nn::Embedding embed_{nullptr};
  torch::nn::ModuleList blocks_{nullptr};
  torch::nn::Linear head_{nullptr};
};

void register_tanh_stack() {
  models::ModelSpec spec;
  spec.kind = "tanh_stack";
  spec.description = "a test's own model";
  spec.build = [](const models::ModelOptions& o, bool) {
    return std::static_pointer_cast<models::LayeredModelImpl>(std::make_shared<TanhStackImpl>(o));
  };
  spec.size = [](const models::ModelOptions& o) {
    const double d = static_cast<double>(o.d_model), v = static_cast<double>(o.vocab_size);
    models::ModelSize s;
    s.parameters = v * d + static_cast<double>(o.n_layers) * (d * d + d) + d * v + v;
    s.largest_unit = std::max(d * d + d, 2 * v * d + v);
    s.largest_parameter = v * d;
    return s;
  };
  // Its own rule, beyond every kind's positive sizes.
  spec.validate = [](const models::ModelOptions& o) {
    TORCH_CHECK(o.d_model % 8 == 0, "model.d_model (", o.d_model, ") must be a multiple of 8 for tanh_stack");
  };
  // A Hugging Face counterpart of its own: config.json in and out.
  models::HfAdapter hf;
  hf.model_type = "tanh_stack";
  hf.architecture = "TanhStackForCausalLM";
  hf.config_json = [](const models::ModelOptions& o, const std::string& dtype) {
    return nlohmann::json{{"model_type", "tanh_stack"}, {"hidden", o.d_model}, {"layers", o.n_layers},
                          {"vocab", o.vocab_size}, {"torch_dtype", dtype}}.dump();
  };
  hf.read_config_json = [](const std::string& text) {
    const nlohmann::json j = nlohmann::json::parse(text);
    if (!j.contains("hidden")) throw std::invalid_argument("has no \"hidden\"");
    return std::vector<models::HfConfigValue>{
        {"model.kind", std::string("tanh_stack"), "model_type"},
        {"model.d_model", j["hidden"].get<int64_t>(), "hidden"},
        {"model.n_layers", j["layers"].get<int64_t>(), "layers"},
        {"model.vocab_size", j["vocab"].get<int64_t>(), "vocab"}};
  };
  spec.hf = hf;
  models::register_model_spec(spec);
}

}  // namespace

// Adding a model adds a spec and touches nothing in framework/train or
// checkpoint/: a kind registered here is named by a parsed config, trains
// through the Trainer with its own FSDP units (its blocks), and FSDP at
// world 2 matches world 1 as the built-in kinds do.
TEST(ModelSpecs, AKindRegisteredByTheProgramTrainsFromItsConfigAtAnyWorldSize) {
  const std::string yaml = "model:\n  kind: tanh_stack\n  vocab_size: 16\n  seq_len: 16\n  d_model: 32\n  n_layers: 3\n";
  std::string before;
  try {
    framework::config::parse_config(yaml, "tiny.yaml");
  } catch (const std::exception& e) {
    before = e.what();
  }
  EXPECT_NE(before.find("model.kind"), std::string::npos) << before;
  EXPECT_NE(before.find("one of gpt|mlp|llama"), std::string::npos) << before;

  register_tanh_stack();
  framework::config::Config cfg = framework::config::parse_config(yaml, "tiny.yaml");
  cfg.run.dir = temp_run_dir("tanh_stack_1");
  cfg.run.seed = 7;
  cfg.train.steps = 12;
  cfg.train.global_batch_size = 12;
  cfg.checkpoint.interval = 0;
  const RunResult one = run_config(1, cfg);
  cfg.run.dir = temp_run_dir("tanh_stack_2");
  std::vector<std::string> units;
  run_runtimes(2, [&](comm::Runtime& rt) {
    Trainer trainer(cfg, rt);
    if (rt.env.rank == 0) units = trainer.model().unit_names();
  });
  EXPECT_EQ(units, (std::vector<std::string>{"root", "blocks.0", "blocks.1", "blocks.2"}));
  const RunResult two = run_config(2, cfg);
  ASSERT_EQ(one.losses.size(), 12u);
  ASSERT_EQ(two.losses.size(), 12u);
  EXPECT_LT(one.losses.back(), one.losses.front());
  for (size_t i = 0; i < one.losses.size(); ++i) {
    EXPECT_NEAR(two.losses[i], one.losses[i], 1e-5 * std::abs(one.losses[i])) << "step " << i + 1;
  }

  // No tensor-parallel plan: parallel.tensor 2 is refused, naming the kind.
  cfg.parallel.tensor = 2;
  cfg.run.dir = temp_run_dir("tanh_stack_tp");
  std::string refused;
  run_runtimes(2, [&](comm::Runtime& rt) {
    try {
      Trainer trainer(cfg, rt);
    } catch (const framework::train::PreflightError& e) {
      if (rt.env.rank == 0) refused = e.what();
    }
  });
  EXPECT_NE(refused.find("model.kind is tanh_stack, which has no tensor-parallel plan"), std::string::npos)
      << refused;
  fs::remove_all(cfg.run.dir);
  EXPECT_THROW(models::find_model_spec("no_such_kind"), std::invalid_argument);
}

// A kind's own rules and its config.json reader run where the built-in
// kinds' do, when the config is read: an invalid value is refused naming the
// key and where it came from, and model.init_from naming a directory whose
// config.json has the kind's model_type fills the model section.
TEST(ModelSpecs, AKindsRulesAndConfigJsonReaderRunWhenTheConfigIsRead) {
  register_tanh_stack();
  auto parse_error = [](const std::string& yaml) {
    try {
      framework::config::parse_config(yaml, "tiny.yaml");
    } catch (const framework::config::ConfigError& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  std::string e = parse_error("model:\n  kind: tanh_stack\n  d_model: 30\n");
  EXPECT_NE(e.find("model.d_model (30) must be a multiple of 8 for tanh_stack"), std::string::npos) << e;
  e = parse_error("model:\n  kind: tanh_stack\n  n_layers: 0\n");
  EXPECT_NE(e.find("model.n_layers"), std::string::npos) << e;

  const std::string dir = temp_run_dir("tanh_stack_hf");
  fs::create_directories(dir);
  std::ofstream(dir + "/config.json") << models::find_hf_adapter("tanh_stack")->config_json(
      [] {
        models::ModelOptions o;
        o.kind = "tanh_stack";
        o.d_model = 24;
        o.n_layers = 5;
        o.vocab_size = 40;
        return o;
      }(),
      "float32");
  const framework::config::Config cfg =
      framework::config::parse_config("model:\n  init_from: " + dir + "\n", "tiny.yaml");
  EXPECT_EQ(cfg.model.kind, "tanh_stack");
  EXPECT_EQ(cfg.model.d_model, 24);
  EXPECT_EQ(cfg.model.n_layers, 5);
  EXPECT_EQ(cfg.model.vocab_size, 40);
  e = parse_error("model:\n  d_model: 32\n  init_from: " + dir + "\n");
  EXPECT_NE(e.find("model.d_model (32, tiny.yaml:2) disagrees with hidden 24 in " + dir + "/config.json"),
            std::string::npos) << e;
  std::ofstream(dir + "/config.json") << R"({"model_type": "tanh_stack", "layers": 2})";
  e = parse_error("model:\n  init_from: " + dir + "\n");
  EXPECT_NE(e.find("model.init_from: " + dir + "/config.json: has no \"hidden\""), std::string::npos) << e;
  std::ofstream(dir + "/config.json") << R"({"model_type": "mamba"})";
  e = parse_error("model:\n  init_from: " + dir + "\n");
  EXPECT_NE(e.find("has model_type \"mamba\"; the model types read are "), std::string::npos) << e;
  EXPECT_NE(e.find("llama (LlamaForCausalLM), qwen3_moe (Qwen3MoeForCausalLM), mixtral (MixtralForCausalLM) "
                   "as model.kind llama"),
            std::string::npos) << e;
  EXPECT_NE(e.find("tanh_stack (TanhStackForCausalLM) as model.kind tanh_stack"), std::string::npos) << e;
  fs::remove_all(dir);
}

// The built-in llama's spec: its FLOPs per token are 6 x the parameters of
// the built model that multiply (all but the embedding) plus attention's
// 12 x layers x d_model x seq_len; its Hugging Face adapter writes the
// config.json that PyTorch's LlamaConfig fields name.
TEST(ModelSpecs, LlamaFlopsAndHuggingFaceConfigComeFromTheBuiltModel) {
  models::ModelOptions o;
  o.kind = "llama";
  o.vocab_size = 64;
  o.seq_len = 32;
  o.d_model = 48;
  o.n_layers = 2;
  o.n_heads = 4;
  o.n_kv_heads = 2;
  o.tie_weights = false;
  const std::string kind = "llama";  // a named string: the spec outlives the call
  const models::ModelSpec& spec = models::find_model_spec(kind);
  auto model = models::make_model(o);
  double params = 0;
  for (const auto& p : model->parameters()) params += static_cast<double>(p.numel());
  EXPECT_EQ(spec.size(o).parameters, params);
  const double embedding = 64.0 * 48.0;
  EXPECT_DOUBLE_EQ(spec.flops_per_token(o), 6 * (params - embedding) + 12.0 * 2 * 48 * 32);
  ASSERT_TRUE(spec.hf.has_value());
  const nlohmann::json j = nlohmann::json::parse(spec.hf->config_json(o, "bfloat16"));
  EXPECT_EQ(j["architectures"], nlohmann::json({"LlamaForCausalLM"}));
  EXPECT_EQ(j["hidden_size"], 48);
  EXPECT_EQ(j["num_key_value_heads"], 2);
  EXPECT_EQ(j["intermediate_size"], models::llama_d_ff(o));
  EXPECT_EQ(j["torch_dtype"], "bfloat16");
  // model.head_dim 20 apart from 48 / 4: attention's term is n_heads x head_dim wide.
  o.head_dim = 20;
  auto wide = models::make_model(o);
  double wide_params = 0;
  for (const auto& p : wide->parameters()) wide_params += static_cast<double>(p.numel());
  EXPECT_EQ(spec.size(o).parameters, wide_params);
  EXPECT_DOUBLE_EQ(spec.flops_per_token(o), 6 * (wide_params - embedding) + 12.0 * 2 * (4 * 20) * 32);
  EXPECT_EQ(nlohmann::json::parse(spec.hf->config_json(o, "float32"))["head_dim"], 20);
  EXPECT_FALSE(models::find_model_spec("gpt").hf.has_value());
  EXPECT_TRUE(models::find_model_spec("gpt").tp_plan.empty());
}
