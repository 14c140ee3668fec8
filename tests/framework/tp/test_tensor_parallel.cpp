// Tensor parallelism (framework/tp) under the trainer: the llama at TP 2,
// TP 2 x FSDP 2 and TP 4 equals one process; checkpoints saved under one
// (dp, tp) layout resume under every other; the vocabulary-parallel
// cross-entropy equals torch's; plans that cannot work are refused by name.
#include "framework/data/dataset.h"
#include "framework/dtensor/device_mesh.h"
#include "framework/fsdp/fully_shard.h"
#include "framework/tp/tensor_parallel.h"
#include "framework/train/trainer.h"
#include "models/layered_model.h"
#include "models/llama.h"
#include "support/multi_rank.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <map>
#include <mutex>

#include <unistd.h>

namespace fs = std::filesystem;
using framework::train::Trainer;
using testing_support::run_runtimes;

namespace {

// GQA (8 query heads, 4 key/value heads: TP 4 keeps 2 and 1 per rank), a
// vocabulary that 4 does not divide evenly by the chunk rule (66 -> 17, 17,
// 17, 15), gradient clipping on.
framework::config::Config tp_config(const std::string& dir) {
  framework::config::Config c;
  c.run.dir = dir;
  c.run.seed = 5;
  c.train.steps = 20;
  c.train.global_batch_size = 8;
  c.train.log_every = 100;
  c.train.grad_clip = 0.5;
  c.model.kind = "llama";
  c.model.tie_weights = false;
  c.model.vocab_size = 66;
  c.model.seq_len = 12;
  c.model.d_model = 64;
  c.model.n_heads = 8;
  c.model.n_kv_heads = 4;
  c.model.n_layers = 2;
  c.model.d_ff = 96;
  c.optim.warmup_steps = 3;
  c.checkpoint.interval = 0;
  c.checkpoint.mode = checkpoint::SaveMode::kSync;
  return c;
}

std::string scratch(const std::string& tag) {
  auto dir = fs::temp_directory_path() / ("shardkit_tp_" + tag + "_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  return dir.string();
}

struct Layout {
  const char* name;
  int world;
  int64_t replicate, shard, tensor;
};
const Layout kSingle{"single", 1, 1, 1, 1};
const Layout kTp2{"tp2", 2, 1, 1, 2};
const Layout kTp2Fsdp2{"tp2xfsdp2", 4, 1, 2, 2};
const Layout kTp4{"tp4", 4, 1, 1, 4};
const Layout kFsdp4{"fsdp4", 4, 1, 4, 1};
const Layout kTp2Ddp2{"tp2xddp2", 4, 2, 1, 2};

struct RunResult {
  std::vector<double> losses;
  std::vector<double> grad_norms;
  std::vector<std::string> names;
  std::vector<torch::Tensor> params;  // whole tensors after training
  std::vector<std::string> placements;
};

RunResult train(framework::config::Config cfg, const Layout& l) {
  cfg.parallel.replicate = l.replicate;
  cfg.parallel.shard = l.shard;
  cfg.parallel.tensor = l.tensor;
  RunResult result;
  std::mutex mu;
  run_runtimes(l.world, [&](comm::Runtime& rt) {
    Trainer trainer(cfg, rt);
    EXPECT_EQ(trainer.run(), 0);
    auto& model = trainer.model();
    std::vector<torch::Tensor> full;
    std::vector<std::string> placements;
    for (size_t i = 0; i < model.local_params().size(); ++i) {
      const framework::dtensor::DTensor p = model.param_dtensor(i);
      full.push_back(p.full_tensor());
      placements.push_back(framework::dtensor::to_string(p.placements()));
    }
    if (rt.env.rank == 0) {
      std::lock_guard<std::mutex> lock(mu);
      for (const auto& rec : trainer.history()) {
        result.losses.push_back(rec.loss);
        result.grad_norms.push_back(rec.grad_norm);
      }
      result.names = model.param_names();
      result.params = full;
      result.placements = placements;
    }
  });
  return result;
}

const RunResult& reference() {
  static RunResult r = [] {
    const std::string dir = scratch("reference");
    RunResult out = train(tp_config(dir), kSingle);
    fs::remove_all(dir);
    return out;
  }();
  return r;
}

void expect_close(const RunResult& got, const RunResult& ref, size_t first_step, const std::string& what) {
  ASSERT_EQ(got.losses.size() + first_step, ref.losses.size()) << what;
  for (size_t i = 0; i < got.losses.size(); ++i) {
    const double want = ref.losses[i + first_step];
    EXPECT_NEAR(got.losses[i], want, 1e-5 * std::abs(want)) << what << ": loss of step " << i + first_step + 1;
    const double norm = ref.grad_norms[i + first_step];
    EXPECT_NEAR(got.grad_norms[i], norm, 1e-4 * std::abs(norm))
        << what << ": grad norm of step " << i + first_step + 1;
  }
  ASSERT_EQ(got.params.size(), ref.params.size()) << what;
  for (size_t i = 0; i < ref.params.size(); ++i) {
    ASSERT_EQ(got.params[i].sizes(), ref.params[i].sizes()) << what << ": " << got.names[i];
    EXPECT_TRUE(torch::allclose(got.params[i], ref.params[i], 1e-4, 1e-4))
        << what << ": parameter " << got.names[i] << " differs by "
        << (got.params[i] - ref.params[i]).abs().max().item<double>();
  }
}

std::string placement_of(const RunResult& r, const std::string& name) {
  for (size_t i = 0; i < r.names.size(); ++i) {
    if (r.names[i] == name) return r.placements[i];
  }
  return "(no parameter " + name + ")";
}

}  // namespace

TEST(TensorParallel, ReferenceLossFalls) {
  const RunResult& ref = reference();
  ASSERT_EQ(ref.losses.size(), 20u);
  EXPECT_LT(ref.losses.back(), ref.losses.front());
}

TEST(TensorParallel, Tp2MatchesOneProcess) {
  const std::string dir = scratch("tp2");
  RunResult r = train(tp_config(dir), kTp2);
  expect_close(r, reference(), 0, "TP 2");
  // On the {replicate, tensor, shard} view: TP's split, FSDP's (none here).
  EXPECT_EQ(placement_of(r, "model.layers.0.self_attn.q_proj.weight"), "[Replicate(), Shard(0), Replicate()]");
  EXPECT_EQ(placement_of(r, "model.layers.0.mlp.down_proj.weight"), "[Replicate(), Shard(1), Replicate()]");
  EXPECT_EQ(placement_of(r, "model.embed_tokens.weight"), "[Replicate(), Shard(0), Replicate()]");
  EXPECT_EQ(placement_of(r, "model.norm.weight"), "[Replicate(), Replicate(), Replicate()]");
  fs::remove_all(dir);
}

TEST(TensorParallel, Tp2TimesFsdp2MatchesOneProcess) {
  const std::string dir = scratch("tp2xfsdp2");
  RunResult r = train(tp_config(dir), kTp2Fsdp2);
  expect_close(r, reference(), 0, "TP 2 x FSDP 2");
  EXPECT_EQ(placement_of(r, "model.layers.1.self_attn.o_proj.weight"), "[Replicate(), Shard(1), Shard(0)]");
  EXPECT_EQ(placement_of(r, "lm_head.weight"), "[Replicate(), Shard(0), Shard(0)]");
  EXPECT_EQ(placement_of(r, "model.layers.1.input_layernorm.weight"), "[Replicate(), Replicate(), Shard(0)]");
  fs::remove_all(dir);
}

TEST(TensorParallel, Tp4MatchesOneProcess) {
  const std::string dir = scratch("tp4");
  expect_close(train(tp_config(dir), kTp4), reference(), 0, "TP 4");
  fs::remove_all(dir);
}

TEST(TensorParallel, Tp2TimesDdp2WithAccumulationMatchesOneProcess) {
  const std::string dir = scratch("tp2xddp2");
  framework::config::Config cfg = tp_config(dir);
  cfg.train.micro_batch_size = 2;  // two micro-batches per step and data-parallel rank
  expect_close(train(cfg, kTp2Ddp2), reference(), 0, "TP 2 x DDP 2, micro-batches of 2");
  fs::remove_all(dir);
}

// Saved at step 15 under one layout, resumed under each (16 pairs at 4
// ranks and 1), continuing within 1e-5 of the uninterrupted run; in its own
// layout, TP 2 x FSDP 2 resumes bit for bit.
TEST(TensorParallel, CheckpointsResumeAcrossEveryLayout) {
  const std::vector<Layout> layouts = {kTp2Fsdp2, kFsdp4, kTp4, kSingle};
  for (const Layout& saved : layouts) {
    const std::string dir = scratch(std::string("save_") + saved.name);
    framework::config::Config cfg = tp_config(dir);
    cfg.checkpoint.interval = 15;
    cfg.checkpoint.keep_last = 1;
    cfg.train.stop_at = 15;
    RunResult first = train(cfg, saved);
    ASSERT_EQ(first.losses.size(), 15u) << saved.name;
    for (const Layout& resumed : layouts) {
      const std::string what = std::string("saved ") + saved.name + ", resumed " + resumed.name;
      const std::string rdir = scratch(std::string("resume_") + saved.name + "_" + resumed.name);
      fs::copy(dir, rdir, fs::copy_options::recursive);
      framework::config::Config rc = tp_config(rdir);
      rc.checkpoint.interval = 0;
      RunResult second = train(rc, resumed);
      expect_close(second, reference(), 15, what);
      if (std::string(saved.name) == kTp2Fsdp2.name && std::string(resumed.name) == kTp2Fsdp2.name) {
        const std::string udir = scratch("whole_tp2xfsdp2");
        RunResult whole = train(tp_config(udir), saved);
        for (size_t i = 0; i < second.losses.size(); ++i) {
          EXPECT_EQ(second.losses[i], whole.losses[15 + i]) << what << ": step " << 16 + i;
        }
        for (size_t i = 0; i < whole.params.size(); ++i) {
          EXPECT_TRUE(torch::equal(second.params[i], whole.params[i])) << what << ": " << whole.names[i];
        }
        fs::remove_all(udir);
      }
      fs::remove_all(rdir);
    }
    fs::remove_all(dir);
  }
}

// model.tie_weights under TP (Llama 3.2 1B and 3B tie them): the one table
// is split by vocabulary rows, which is both the embedding's rowwise split
// and the output's colwise one; the same equivalence as the untied model,
// and a TP 2 x FSDP 2 checkpoint resumes in one process and at TP 4.
TEST(TensorParallel, TiedEmbeddingsMatchOneProcessAndResumeAcrossLayouts) {
  framework::config::Config cfg = tp_config(scratch("tied_single"));
  cfg.model.tie_weights = true;
  const RunResult ref = train(cfg, kSingle);
  ASSERT_EQ(ref.losses.size(), 20u);
  EXPECT_EQ(placement_of(ref, "lm_head.weight"), "(no parameter lm_head.weight)");
  for (const Layout& l : {kTp2, kTp2Fsdp2, kTp4}) {
    framework::config::Config c = cfg;
    c.run.dir = scratch(std::string("tied_") + l.name);
    const RunResult r = train(c, l);
    expect_close(r, ref, 0, std::string("tied, ") + l.name);
    if (l.world == 2) {
      EXPECT_EQ(placement_of(r, "model.embed_tokens.weight"), "[Replicate(), Shard(0), Replicate()]");
    }
    fs::remove_all(c.run.dir);
  }
  framework::config::Config saved = cfg;
  saved.run.dir = scratch("tied_saved");
  saved.checkpoint.interval = 10;
  saved.train.stop_at = 10;
  train(saved, kTp2Fsdp2);
  for (const Layout& l : {kSingle, kTp4}) {
    framework::config::Config rc = cfg;
    rc.run.dir = scratch(std::string("tied_resumed_") + l.name);
    rc.checkpoint.resume = saved.run.dir + "/checkpoints/step_10";
    expect_close(train(rc, l), ref, 10, std::string("tied, TP 2 x FSDP 2 resumed at ") + l.name);
    fs::remove_all(rc.run.dir);
  }
  fs::remove_all(saved.run.dir);
  fs::remove_all(cfg.run.dir);
}

// A UserModel brings its own plan: here only the MLP is split (attention
// stays whole on every TP rank) and the output projection's logits are
// gathered, so the loss is the plain cross-entropy. TP 2 equals one process.
TEST(TensorParallel, AUserModelsOwnPlanMatchesOneProcess) {
  auto run = [](const Layout& l) {
    framework::config::Config cfg = tp_config(scratch(std::string("user_") + l.name));
    cfg.train.steps = 12;
    cfg.parallel.replicate = l.replicate;
    cfg.parallel.shard = l.shard;
    cfg.parallel.tensor = l.tensor;
    RunResult result;
    std::mutex mu;
    run_runtimes(l.world, [&](comm::Runtime& rt) {
      framework::train::UserModel user;
      std::shared_ptr<models::LayeredModelImpl> model;
      {
        std::lock_guard<std::mutex> lock(mu);
        torch::manual_seed(21);
        model = models::make_model(cfg.model);
      }
      user.module = model;
      user.units = model->unit_names();
      user.loss = [model](const torch::Tensor& inputs, const torch::Tensor& targets) {
        torch::Tensor logits = model->forward(inputs);
        torch::Tensor sum = torch::nn::functional::cross_entropy(
            logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}),
            torch::nn::functional::CrossEntropyFuncOptions().ignore_index(framework::data::kIgnoreIndex).reduction(torch::kSum));
        return framework::train::LossSum{sum, (targets != framework::data::kIgnoreIndex).sum()};
      };
      user.dataset = framework::data::make_dataset(cfg.data, cfg.model, 5);
      user.tensor_parallel_plan = {
          {"model.layers.*.mlp.gate_proj", framework::tp::Style::kColwise},
          {"model.layers.*.mlp.up_proj", framework::tp::Style::kColwise},
          {"model.layers.*.mlp.down_proj", framework::tp::Style::kRowwise},
          {"lm_head", framework::tp::Style::kColwise, /*gather_output=*/true},
      };
      Trainer trainer(cfg, rt, user);
      EXPECT_EQ(trainer.run(), 0);
      std::vector<torch::Tensor> full;
      for (size_t i = 0; i < trainer.model().local_params().size(); ++i) {
        full.push_back(trainer.model().param_dtensor(i).full_tensor());
      }
      if (rt.env.rank == 0) {
        std::lock_guard<std::mutex> lock(mu);
        for (const auto& rec : trainer.history()) {
          result.losses.push_back(rec.loss);
          result.grad_norms.push_back(rec.grad_norm);
        }
        result.names = trainer.model().param_names();
        result.params = full;
      }
    });
    fs::remove_all(cfg.run.dir);
    return result;
  };
  const RunResult whole = run(kSingle);
  ASSERT_EQ(whole.losses.size(), 12u);
  expect_close(run(kTp2), whole, 0, "a user's plan at TP 2");
}

TEST(TensorParallel, VocabParallelCrossEntropyMatchesTorch) {
  torch::manual_seed(3);
  const int64_t vocab = 11, tokens = 9;  // over 3 ranks: 4, 4, 3
  torch::Tensor logits = torch::randn({tokens, vocab}, torch::kDouble);
  torch::Tensor targets = torch::randint(0, vocab, {tokens}, torch::kLong);
  targets[2] = -100;  // ignored
  torch::Tensor weights = torch::rand({tokens}, torch::kDouble);  // a non-uniform upstream gradient
  torch::Tensor ref_logits = logits.clone().set_requires_grad(true);
  torch::Tensor ref = torch::nn::functional::cross_entropy(
      ref_logits, targets,
      torch::nn::functional::CrossEntropyFuncOptions().ignore_index(-100).reduction(torch::kNone));
  (ref * weights).sum().backward();
  run_runtimes(3, [&](comm::Runtime& rt) {
    auto mesh = framework::dtensor::DeviceMesh::create(*rt.rendezvous, {3}, {"tensor"}, "ce");
    const framework::dtensor::Span span = framework::dtensor::chunk_span(vocab, 3, mesh->coordinate(0));
    torch::Tensor mine = logits.narrow(1, span.offset, span.size).clone().set_requires_grad(true);
    torch::Tensor loss = framework::tp::vocab_parallel_cross_entropy(mine, targets, span.offset,
                                                                     mesh->group(0), -100);
    EXPECT_TRUE(torch::allclose(loss, ref.detach(), 1e-12, 1e-12)) << loss << ref;
    (loss * weights).sum().backward();
    EXPECT_TRUE(torch::allclose(mine.grad(), ref_logits.grad().narrow(1, span.offset, span.size),
                                1e-12, 1e-12));
  });
}

// A user's own module gets TP from a plan: a two-layer MLP of
// models::Projection, colwise then rowwise, equals the whole module.
TEST(TensorParallel, PlanOnYourOwnModuleMatchesTheWholeModule) {
  struct Mlp : torch::nn::Module {
    models::Projection up{nullptr}, down{nullptr};
    Mlp() {
      up = register_module("up", models::Projection(6, 10, true));
      down = register_module("down", models::Projection(10, 6, true));
    }
    torch::Tensor forward(const torch::Tensor& x) { return down->forward(torch::relu(up->forward(x))); }
  };
  torch::manual_seed(9);
  auto whole = std::make_shared<Mlp>();
  for (auto& p : whole->parameters()) torch::nn::init::normal_(p);
  torch::Tensor x = torch::randn({5, 6}, torch::kFloat);
  torch::Tensor want = whole->forward(x);
  want.sum().backward();
  run_runtimes(2, [&](comm::Runtime& rt) {
    auto mesh = framework::dtensor::DeviceMesh::create(*rt.rendezvous, {2}, {"tensor"}, "mlp");
    auto mine = std::make_shared<Mlp>();
    {
      torch::NoGradGuard no_grad;
      mine->up->weight().copy_(whole->up->weight());
      mine->down->weight().copy_(whole->down->weight());
    }
    framework::tp::TensorParallelLayout layout = framework::tp::parallelize_module(
        *mine, mesh, 0, {{"up", framework::tp::Style::kColwise}, {"down", framework::tp::Style::kRowwise}});
    EXPECT_EQ(layout.params.at("up.weight").dim, 0);
    EXPECT_EQ(layout.params.at("down.weight").dim, 1);
    EXPECT_EQ(mine->up->weight().sizes(), (std::vector<int64_t>{5, 6}));
    torch::Tensor x_mine = x.clone().set_requires_grad(true);
    torch::Tensor got = mine->forward(x_mine);
    EXPECT_TRUE(torch::allclose(got, want, 1e-5, 1e-6));
    got.sum().backward();
    EXPECT_TRUE(torch::allclose(mine->up->weight().grad(),
                                framework::tp::local_part(layout, "up.weight", whole->up->weight().grad()),
                                1e-5, 1e-6));
    EXPECT_TRUE(torch::allclose(mine->down->weight().grad(),
                                framework::tp::local_part(layout, "down.weight", whole->down->weight().grad()),
                                1e-5, 1e-6));
    framework::tp::clear_hooks(*mine);
  });
}

TEST(TensorParallel, PlansThatCannotWorkAreRefusedByName) {
  run_runtimes(2, [&](comm::Runtime& rt) {
    auto mesh = framework::dtensor::DeviceMesh::create(*rt.rendezvous, {2}, {"tensor"}, "bad");
    auto expect_error = [&](torch::nn::Module& m, framework::tp::Plan plan, const std::string& needle) {
      try {
        framework::tp::parallelize_module(m, mesh, 0, plan);
        ADD_FAILURE() << "no error; wanted one with '" << needle << "'";
      } catch (const std::invalid_argument& e) {
        EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
      }
    };
    torch::nn::Sequential seq(torch::nn::Linear(4, 4));
    expect_error(*seq, {{"0", framework::tp::Style::kColwise}}, "torch::nn::Linear");
    expect_error(*seq, {{"layers.*.mlp", framework::tp::Style::kColwise}}, "'layers.*.mlp' (colwise) matches no submodule");
    struct Biased : torch::nn::Module {
      Biased() {
        register_parameter("weight", torch::ones({4, 4}));
        register_parameter("bias", torch::ones({4}));
      }
    };
    auto holder = std::make_shared<torch::nn::Module>();
    holder->register_module("proj", std::make_shared<Biased>());
    expect_error(*holder, {{"proj", framework::tp::Style::kRowwise}}, "has a bias");
    expect_error(*holder, {{"proj", framework::tp::Style::kColwise}, {"*", framework::tp::Style::kReplicate}},
                 "also named by entry 'proj'");
  });
}
