// Pipeline parallelism: the schedules as action lists (each forward and
// backward once, no deadlock, 1F1B's bound on the activations held), the
// split of the blocks into stages, and the llama trained under each
// schedule, and under PP x FSDP, PP x TP and PP x FSDP x TP, against one
// process; resume in the same layout (bit-exact) and across layouts.
#include "framework/pp/pipeline.h"
#include "framework/pp/schedule.h"
#include "framework/train/preflight.h"
#include "framework/train/trainer.h"
#include "framework/data/dataset.h"
#include "framework/fsdp/fully_shard.h"
#include "models/layered_model.h"
#include "models/model_spec.h"
#include "support/multi_rank.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <map>
#include <mutex>
#include <set>
#include <tuple>

#include <unistd.h>

namespace fs = std::filesystem;
using framework::pp::Action;
using framework::pp::Schedule;
using framework::train::Trainer;

namespace pp_test {

// Runs every rank's action list as the runner would (sends never block; a
// forward waits for the previous stage's forward of its micro-batch, a
// backward for the next stage's backward): true when all finish.
bool pp_simulate(Schedule schedule, int64_t ranks, int64_t per_rank, int64_t micro, std::string* why) {
  std::vector<std::vector<Action>> lists;
  for (int64_t r = 0; r < ranks; ++r) {
    lists.push_back(framework::pp::schedule_actions(schedule, ranks, r, per_rank, micro));
  }
  const int64_t stages = ranks * per_rank;
  std::set<std::tuple<int, int64_t, int64_t>> done;
  std::vector<size_t> next(ranks, 0);
  bool progress = true;
  while (progress) {
    progress = false;
    for (int64_t r = 0; r < ranks; ++r) {
      while (next[r] < lists[r].size()) {
        const Action& a = lists[r][next[r]];
        if (a.stage % ranks != r) {
          *why = "rank " + std::to_string(r) + " runs stage " + std::to_string(a.stage);
          return false;
        }
        const bool fwd = a.kind == Action::Kind::kForward;
        bool ready = fwd ? (a.stage == 0 || done.count({0, a.stage - 1, a.micro}))
                         : done.count({0, a.stage, a.micro}) &&
                               (a.stage == stages - 1 || done.count({1, a.stage + 1, a.micro}));
        if (!ready) break;
        if (!done.insert({fwd ? 0 : 1, a.stage, a.micro}).second) {
          *why = "action run twice";
          return false;
        }
        ++next[r];
        progress = true;
      }
    }
  }
  for (int64_t r = 0; r < ranks; ++r) {
    if (next[r] != lists[r].size()) {
      *why = "deadlock: rank " + std::to_string(r) + " stuck at action " + std::to_string(next[r]);
      return false;
    }
  }
  if (static_cast<int64_t>(done.size()) != 2 * stages * micro) {
    *why = std::to_string(done.size()) + " actions, expected " + std::to_string(2 * stages * micro);
    return false;
  }
  return true;
}

framework::config::Config pp_config(const std::string& tag) {
  framework::config::Config c;
  auto dir = fs::temp_directory_path() / ("shardkit_pp_" + tag + "_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  c.run.dir = dir.string();
  c.run.seed = 5;
  c.train.steps = 20;
  c.train.global_batch_size = 8;
  c.train.micro_batch_size = 2;
  c.train.log_every = 100;
  c.train.grad_clip = 0.5;
  c.model.kind = "llama";
  c.model.tie_weights = false;
  c.model.vocab_size = 16;
  c.model.seq_len = 8;
  c.model.d_model = 16;
  c.model.n_heads = 4;
  c.model.n_kv_heads = 2;
  c.model.n_layers = 4;
  c.model.d_ff = 24;
  c.optim.warmup_steps = 3;
  c.data.eval_fraction = 0.1;
  c.train.eval_samples = 8;
  c.checkpoint.interval = 0;
  c.checkpoint.mode = checkpoint::SaveMode::kSync;
  return c;
}

struct PpRun {
  std::vector<double> losses;
  std::vector<double> grad_norms;
  std::map<std::string, torch::Tensor> params;  // full tensors after training, every stage's
  int64_t first_step = 0;
  int64_t peak_held = 0;  // the most any rank's pipeline held in a step
  double eval_loss = 0;   // Trainer::evaluate() after training (data.eval_fraction set)
};

// The config's llama as a UserModel (a models::LayeredModelImpl), split by
// UserModel::embeds_parameter when `embeds`.
framework::train::UserModel user_llama(const framework::config::Config& cfg, bool embeds) {
  static std::mutex init;  // the global generator: ranks are threads here
  std::lock_guard<std::mutex> lock(init);
  torch::manual_seed(static_cast<uint64_t>(cfg.run.seed));
  std::shared_ptr<models::LayeredModelImpl> model = models::make_model(cfg.model);
  framework::train::UserModel u;
  u.module = model;
  u.units = model->unit_names();
  u.loss = [model](const torch::Tensor& inputs, const torch::Tensor& targets) {
    models::LossContext context;
    context.ignore_index = framework::data::kIgnoreIndex;
    return models::token_cross_entropy(*model, inputs, targets, context);
  };
  u.dataset = framework::data::make_dataset(cfg.data, cfg.model, static_cast<uint64_t>(cfg.run.seed));
  if (embeds) u.embeds_parameter = [](const std::string& name) { return name.rfind("model.embed_tokens.", 0) == 0; };
  return u;
}

PpRun pp_train(framework::config::Config cfg, int world, bool user = false) {
  PpRun result;
  std::mutex mu;
  testing_support::run_runtimes(world, [&](comm::Runtime& rt) {
    Trainer trainer = user ? Trainer(cfg, rt, user_llama(cfg, true)) : Trainer(cfg, rt);
    const int64_t first = trainer.step();
    EXPECT_EQ(trainer.run(), 0);
    const double eval_loss = cfg.data.eval_fraction > 0 ? trainer.evaluate().loss : 0.0;
    auto& model = trainer.model();
    std::map<std::string, torch::Tensor> full;
    for (size_t i = 0; i < model.param_names().size(); ++i) {
      full[model.param_names()[i]] = model.param_dtensor(i).full_tensor();
    }
    std::lock_guard<std::mutex> lock(mu);
    for (auto& [name, t] : full) result.params[name] = t;
    for (const auto& rec : trainer.history()) result.peak_held = std::max(result.peak_held, rec.pipeline_peak_held);
    if (rt.env.rank == 0) {
      result.eval_loss = eval_loss;
      for (const auto& rec : trainer.history()) {
        result.losses.push_back(rec.loss);
        result.grad_norms.push_back(rec.grad_norm);
      }
      result.first_step = first;
    }
  });
  return result;
}

void pp_expect_close(const PpRun& got, const PpRun& ref, double tol, const std::string& what) {
  ASSERT_EQ(got.losses.size(), ref.losses.size()) << what;
  for (size_t i = 0; i < ref.losses.size(); ++i) {
    EXPECT_NEAR(got.losses[i], ref.losses[i], tol * std::abs(ref.losses[i])) << what << ": loss of step " << i + 1;
    EXPECT_NEAR(got.grad_norms[i], ref.grad_norms[i], 10 * tol * std::abs(ref.grad_norms[i]))
        << what << ": grad norm of step " << i + 1;
  }
  EXPECT_NEAR(got.eval_loss, ref.eval_loss, tol * std::abs(ref.eval_loss)) << what << ": validation loss";
  ASSERT_EQ(got.params.size(), ref.params.size()) << what;
  for (const auto& [name, t] : ref.params) {
    auto it = got.params.find(name);
    ASSERT_NE(it, got.params.end()) << what << ": no parameter " << name;
    EXPECT_TRUE(torch::allclose(it->second, t, 1e-4, 1e-5))
        << what << ": " << name << " differs by " << (it->second - t).abs().max().item<double>();
  }
}

// pp_config's llama as a mixture of experts: top-2 of 4 experts, a dense
// first block, a shared expert, q/k norm, the aux loss and the bias balancing.
framework::config::Config pp_moe_config(const std::string& tag) {
  auto c = pp_config(tag);
  c.model.moe.num_experts = 4;
  c.model.moe.top_k = 2;
  c.model.moe.d_ff = 8;
  c.model.moe.route_norm = true;
  c.model.moe.num_shared_experts = 1;
  c.model.moe.first_dense_layers = 1;
  c.model.moe.aux_loss_coef = 0.01;
  c.model.moe.load_balance_rate = 0.01;
  c.model.qk_norm = true;
  return c;
}

const PpRun& pp_single() {
  static PpRun r = pp_train(pp_config("single"), 1);
  return r;
}

}  // namespace pp_test

using pp_test::PpRun;
using pp_test::pp_config;
using pp_test::pp_expect_close;
using pp_test::pp_simulate;
using pp_test::pp_single;
using pp_test::pp_train;

TEST(PipelineSchedule, EveryScheduleRunsEachActionOnceWithoutDeadlock) {
  std::string why;
  for (int64_t p : {2, 3, 4}) {
    for (int64_t m : {1, 2, 3, 4, 5, 8}) {
      EXPECT_TRUE(pp_simulate(Schedule::kGpipe, p, 1, m, &why)) << "gpipe P " << p << " M " << m << ": " << why;
      if (m >= p) {
        EXPECT_TRUE(pp_simulate(Schedule::k1F1B, p, 1, m, &why)) << "1f1b P " << p << " M " << m << ": " << why;
      }
      for (int64_t v : {2, 3}) {
        if (m % p != 0) continue;
        EXPECT_TRUE(pp_simulate(Schedule::kInterleaved1F1B, p, v, m, &why))
            << "interleaved P " << p << " V " << v << " M " << m << ": " << why;
      }
    }
  }
}

TEST(PipelineSchedule, OneFOneBHoldsAtMostPMicroBatchesPerStageAndGpipeAll) {
  for (int64_t p : {2, 4}) {
    for (int64_t m : {4, 8, 16}) {
      for (int64_t r = 0; r < p; ++r) {
        const auto one = framework::pp::schedule_actions(Schedule::k1F1B, p, r, 1, m);
        EXPECT_EQ(framework::pp::peak_in_flight(one), p - r) << "P " << p << " M " << m << " rank " << r;
        const auto all = framework::pp::schedule_actions(Schedule::kGpipe, p, r, 1, m);
        EXPECT_EQ(framework::pp::peak_in_flight(all), m);
      }
    }
  }
}

TEST(PipelineSchedule, BadSchedulesAndSplitsNameTheKey) {
  auto message = [](auto&& fn) {
    try {
      fn();
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message([] { framework::pp::check_schedule(Schedule::k1F1B, 4, 1, 2); }).find("train.micro_batch_size"),
            std::string::npos);
  EXPECT_NE(message([] { framework::pp::check_schedule(Schedule::kInterleaved1F1B, 2, 1, 4); })
                .find("parallel.stages_per_rank"),
            std::string::npos);
  EXPECT_NE(message([] { framework::pp::check_schedule(Schedule::kInterleaved1F1B, 2, 2, 3); })
                .find("multiple of parallel.pipeline"),
            std::string::npos);
  EXPECT_NE(message([] { framework::pp::check_schedule(Schedule::kGpipe, 2, 2, 4); }).find("stages_per_rank must be 1"),
            std::string::npos);
  const std::vector<std::string> blocks = {"model.layers.0", "model.layers.1", "model.layers.2", "model.layers.3",
                                           "model.layers.4"};
  auto even = framework::pp::split_blocks(blocks, 2, "");
  ASSERT_EQ(even.size(), 2u);
  EXPECT_EQ(even[0].first, 0);
  EXPECT_EQ(even[0].end, 3);
  EXPECT_EQ(even[1].end, 5);
  auto at = framework::pp::split_blocks(blocks, 3, "model.layers.1, model.layers.4");
  ASSERT_EQ(at.size(), 3u);
  EXPECT_EQ(at[1].first, 1);
  EXPECT_EQ(at[1].end, 4);
  EXPECT_EQ(at[2].first, 4);
  const std::string unknown = message([&] { framework::pp::split_blocks(blocks, 2, "model.layers.9"); });
  EXPECT_NE(unknown.find("parallel.pipeline_split_points: 'model.layers.9' names no block"), std::string::npos)
      << unknown;
  EXPECT_NE(message([&] { framework::pp::split_blocks(blocks, 3, "model.layers.2"); }).find("3 stages need 2"),
            std::string::npos);
  EXPECT_NE(message([&] { framework::pp::split_blocks(blocks, 8, ""); }).find("model.n_layers"), std::string::npos);
}

TEST(PipelineTraining, EverySchedulesAtPipelineTwoMatchesOneProcess) {
  const PpRun& ref = pp_single();
  ASSERT_EQ(ref.losses.size(), 20u);
  for (Schedule schedule : framework::pp::kSchedules) {
    auto cfg = pp_config(std::string("sched_") + framework::pp::to_string(schedule));
    cfg.parallel.pipeline = 2;
    cfg.parallel.pipeline_schedule = schedule;
    if (schedule == Schedule::kInterleaved1F1B) cfg.parallel.stages_per_rank = 2;
    const PpRun got = pp_train(cfg, 2);
    pp_expect_close(got, ref, 1e-5, framework::pp::to_string(schedule));
    // 4 micro-batches a step: gpipe holds them all, 1f1b at most P = 2 per stage.
    EXPECT_EQ(got.peak_held, schedule == Schedule::kGpipe ? 4 : schedule == Schedule::k1F1B ? 2 : 4)
        << framework::pp::to_string(schedule);
    fs::remove_all(cfg.run.dir);
  }
}

TEST(PipelineTraining, Bf16MatchesOneProcessOnTheSameMicroBatches) {
  auto one = pp_config("bf16_one");
  one.train.mixed_precision.param_dtype = framework::fsdp::PrecisionDtype::kBf16;
  auto pp = one;
  pp.run.dir = one.run.dir + "_pp";
  pp.parallel.pipeline = 2;
  const PpRun ref = pp_train(one, 1);
  // The stages run the same ops on the same micro-batches and reduce each
  // backward pass's gradients into the fp32 shards as accumulation does.
  pp_expect_close(pp_train(pp, 2), ref, 1e-6, "bf16 PP 2");
  fs::remove_all(one.run.dir);
  fs::remove_all(pp.run.dir);
}

TEST(PipelineTraining, AUserModelSplitsThroughEmbedsParameter) {
  auto cfg = pp_config("user_one");
  const PpRun ref = pp_train(cfg, 1, /*user=*/true);
  auto pp = cfg;
  pp.run.dir = cfg.run.dir + "_pp";
  pp.parallel.pipeline = 2;
  pp_expect_close(pp_train(pp, 2, /*user=*/true), ref, 1e-5, "UserModel PP 2");
  std::string refused;
  std::mutex mu;
  testing_support::run_runtimes(2, [&](comm::Runtime& rt) {
    try {
      Trainer trainer(pp, rt, pp_test::user_llama(pp, false));
    } catch (const std::invalid_argument& e) {
      std::lock_guard<std::mutex> lock(mu);
      refused = e.what();
    }
  });
  EXPECT_NE(refused.find("UserModel::embeds_parameter"), std::string::npos) << refused;
  fs::remove_all(cfg.run.dir);
  fs::remove_all(pp.run.dir);
}

TEST(PipelineTraining, WithFsdpAndTensorParallelMatchesOneProcess) {
  const PpRun& ref = pp_single();
  struct Case {
    const char* what;
    int world;
    int64_t shard, tensor;
    Schedule schedule;
  };
  for (const Case& c : {Case{"PP 2 x FSDP 2", 4, 2, 1, Schedule::k1F1B},
                        Case{"PP 2 x DDP 2", 4, 1, 1, Schedule::kGpipe},
                        Case{"PP 2 x HSDP 2x2", 8, 2, 1, Schedule::kInterleaved1F1B},
                        Case{"PP 2 x TP 2", 4, 1, 2, Schedule::kGpipe},
                        Case{"PP 2 x FSDP 2 x TP 2", 8, 2, 2, Schedule::k1F1B}}) {
    auto cfg = pp_config(std::string("mix") + std::to_string(c.world) + std::to_string(c.tensor));
    cfg.parallel.pipeline = 2;
    cfg.parallel.shard = c.shard;
    cfg.parallel.tensor = c.tensor;
    cfg.parallel.pipeline_schedule = c.schedule;
    if (c.schedule == Schedule::kInterleaved1F1B) cfg.parallel.stages_per_rank = 2;
    // Replicas beside the shards: DDP (shard 1) and HSDP (shard 2 of 4 data-parallel ranks).
    const int64_t dp = c.world / 2 / c.tensor;
    cfg.parallel.replicate = dp / c.shard;
    if (dp == 4) cfg.train.micro_batch_size = 1;  // 2 rows per rank: 2 micro-batches
    pp_expect_close(pp_train(cfg, c.world), ref, 1e-5, c.what);
    fs::remove_all(cfg.run.dir);
  }
}

// A mixture of experts (docs/moe.md) split into pipeline stages, against
// one process over 20 fp32 steps: PP 2 (1F1B, and interleaved with a
// stage that holds only the dense first block), PP 2 x EP 2 (each stage's
// experts split over its 2 ranks, tokens through the all-to-all between
// the pipeline's sends) and PP 2 x EP 2 x TP 2. The MoE has a dense first
// block, a shared expert, q/k norm, the aux loss (per micro-batch of 2
// sequences in every layout: the same objective) and the bias balancing,
// whose loads every stage reports for its own blocks. Then a PP 2 x EP 2
// checkpoint resumes at world 1 within rounding.
TEST(PipelineTraining, AMixtureOfExpertsUnderPp2AndPp2xEp2MatchesOneProcess) {
  const auto moe = pp_test::pp_moe_config;
  const auto one = moe("moe_one");
  const PpRun whole = pp_train(one, 1);
  ASSERT_EQ(whole.losses.size(), 20u);
  struct Case {
    const char* what;
    int world;
    int64_t expert, tensor, per_rank;
  };
  for (const Case& c : {Case{"MoE PP 2", 2, 1, 1, 1}, Case{"MoE PP 2 interleaved", 2, 1, 1, 2},
                        Case{"MoE PP 2 x EP 2", 4, 2, 1, 1}, Case{"MoE PP 2 x EP 2 x TP 2", 8, 2, 2, 1}}) {
    auto cfg = moe(std::string("moe_pp") + std::to_string(c.world) + std::to_string(c.per_rank));
    cfg.parallel.pipeline = 2;
    cfg.parallel.expert = c.expert;
    cfg.parallel.tensor = c.tensor;
    cfg.parallel.stages_per_rank = c.per_rank;
    if (c.per_rank > 1) cfg.parallel.pipeline_schedule = Schedule::kInterleaved1F1B;
    pp_expect_close(pp_train(cfg, c.world), whole, 1e-5, c.what);
    if (c.expert > 1 && c.tensor == 1) {
      // Its checkpoint at step 10 resumes at world 1.
      auto saved = cfg;
      saved.run.dir += "_saved";
      saved.train.stop_at = 10;
      saved.checkpoint.interval = 10;
      pp_train(saved, c.world);
      auto back = moe("moe_back");
      back.checkpoint.resume = saved.run.dir + "/checkpoints/step_10";
      const PpRun r = pp_train(back, 1);
      ASSERT_EQ(r.losses.size(), 10u);
      for (size_t i = 0; i < 10; ++i) {
        EXPECT_NEAR(r.losses[i], whole.losses[10 + i], 1e-5 * whole.losses[10 + i]) << "PP 2 x EP 2 -> 1, step " << 11 + i;
      }
      for (const auto& d : {saved.run.dir, back.run.dir}) fs::remove_all(d);
    }
    fs::remove_all(cfg.run.dir);
  }
  fs::remove_all(one.run.dir);
}

// Context parallelism inside each pipeline stage (#72) against one process
// over 20 fp32 steps: PP 2 x CP 2 (world 4: each stage's two ranks hold
// the head-tail halves of every sequence, attend over a ring of the two,
// and pass [micro, 4, d_model] to the other stage's rank of the same
// context place), 1F1B and interleaved, the dense llama and its mixture of
// experts (the auxiliary loss's expert shares summed over the context
// group); the validation loss after training goes through the stages too.
TEST(PipelineTraining, Pp2xCp2MatchesOneProcessDenseAndMixtureOfExperts) {
  const PpRun& dense = pp_single();
  for (Schedule schedule : {Schedule::k1F1B, Schedule::kInterleaved1F1B}) {
    auto cfg = pp_config(std::string("cp_") + framework::pp::to_string(schedule));
    cfg.parallel.pipeline = 2;
    cfg.parallel.context = 2;
    cfg.parallel.pipeline_schedule = schedule;
    if (schedule == Schedule::kInterleaved1F1B) cfg.parallel.stages_per_rank = 2;
    pp_expect_close(pp_train(cfg, 4), dense, 1e-5, std::string("PP 2 x CP 2, ") + framework::pp::to_string(schedule));
    fs::remove_all(cfg.run.dir);
  }
  const auto one = pp_test::pp_moe_config("cp_moe_one");
  const PpRun whole = pp_train(one, 1);
  auto cfg = pp_test::pp_moe_config("cp_moe");
  cfg.parallel.pipeline = 2;
  cfg.parallel.context = 2;
  pp_expect_close(pp_train(cfg, 4), whole, 1e-5, "MoE PP 2 x CP 2");
  for (const auto& d : {one.run.dir, cfg.run.dir}) fs::remove_all(d);
}

TEST(PipelineTraining, ResumesBitExactInItsLayoutAndWithinRoundingAcrossLayouts) {
  auto cfg = pp_config("resume");
  cfg.parallel.pipeline = 2;
  cfg.parallel.shard = 1;
  cfg.model.activation_checkpointing = models::ActivationCheckpointing::kFull;
  const PpRun full = pp_train(cfg, 2);
  auto stopped = cfg;
  stopped.run.dir = cfg.run.dir + "_stopped";
  stopped.train.stop_at = 10;
  stopped.checkpoint.interval = 5;
  stopped.checkpoint.mode = checkpoint::SaveMode::kAsync;  // saved while the next steps run
  pp_train(stopped, 2);
  stopped.train.stop_at = 0;
  const PpRun resumed = pp_train(stopped, 2);
  EXPECT_EQ(resumed.first_step, 10);
  ASSERT_EQ(resumed.losses.size(), 10u);
  for (size_t i = 0; i < 10; ++i) EXPECT_EQ(resumed.losses[i], full.losses[10 + i]) << "step " << 11 + i;
  for (const auto& [name, t] : full.params) EXPECT_TRUE(torch::equal(resumed.params.at(name), t)) << name;
  // Overlap saves: each staged during the next step's micro-batches.
  auto overlap = cfg;
  overlap.run.dir = cfg.run.dir + "_overlap";
  overlap.train.stop_at = 15;
  overlap.checkpoint.interval = 5;
  overlap.checkpoint.mode = checkpoint::SaveMode::kOverlap;
  pp_train(overlap, 2);
  overlap.train.stop_at = 0;
  const PpRun after_overlap = pp_train(overlap, 2);
  EXPECT_EQ(after_overlap.first_step, 15);
  ASSERT_EQ(after_overlap.losses.size(), 5u);
  for (size_t i = 0; i < 5; ++i) EXPECT_EQ(after_overlap.losses[i], full.losses[15 + i]) << "overlap, step " << 16 + i;
  fs::remove_all(overlap.run.dir);
  // PP 2 -> one process, FSDP 2 and PP 2 x FSDP 2 (interleaved needs 4
  // blocks: 2 stages per rank); and one process's checkpoint -> PP 2.
  struct Other {
    int world;
    int64_t pipeline, shard, per_rank;
  };
  for (const Other& o : {Other{1, 1, -1, 1}, Other{2, 1, -1, 1}, Other{4, 2, 2, 2}}) {
    auto other = pp_config("reshard");
    other.model.activation_checkpointing = cfg.model.activation_checkpointing;
    other.parallel.pipeline = o.pipeline;
    other.parallel.shard = o.shard;
    other.parallel.stages_per_rank = o.per_rank;
    if (o.per_rank > 1) other.parallel.pipeline_schedule = Schedule::kInterleaved1F1B;
    other.checkpoint.resume = stopped.run.dir + "/checkpoints/step_10";
    const PpRun r = pp_train(other, o.world);
    EXPECT_EQ(r.first_step, 10);
    ASSERT_EQ(r.losses.size(), 10u);
    for (size_t i = 0; i < 10; ++i) {
      EXPECT_NEAR(r.losses[i], full.losses[10 + i], 1e-5 * full.losses[10 + i])
          << "world " << o.world << " pipeline " << o.pipeline << ", step " << 11 + i;
    }
    fs::remove_all(other.run.dir);
  }
  auto one = pp_config("from_one");
  one.train.stop_at = 10;
  one.checkpoint.interval = 10;
  pp_train(one, 1);
  auto onto = pp_config("onto_pp");
  onto.parallel.pipeline = 2;
  onto.checkpoint.resume = one.run.dir + "/checkpoints/step_10";
  const PpRun r = pp_train(onto, 2);
  ASSERT_EQ(r.losses.size(), 10u);
  for (size_t i = 0; i < 10; ++i) EXPECT_NEAR(r.losses[i], pp_single().losses[10 + i], 1e-5 * pp_single().losses[10 + i]);
  for (const auto& d : {cfg.run.dir, stopped.run.dir, one.run.dir, onto.run.dir}) fs::remove_all(d);
}

TEST(PipelineTraining, TooFewMicroBatchesOrAnUnknownSplitPointIsRefusedNamingTheKey) {
  auto message = [](framework::config::Config cfg, int world) {
    std::string out;
    std::mutex mu;
    testing_support::run_runtimes(world, [&](comm::Runtime& rt) {
      try {
        Trainer trainer(cfg, rt);
      } catch (const std::exception& e) {
        std::lock_guard<std::mutex> lock(mu);
        out = e.what();
      }
    });
    return out;
  };
  auto cfg = pp_config("bad");
  cfg.parallel.pipeline = 2;
  cfg.train.micro_batch_size = 8;  // one micro-batch: 1f1b needs 2
  EXPECT_NE(message(cfg, 2).find("train.micro_batch_size"), std::string::npos);
  cfg.train.micro_batch_size = 2;
  cfg.parallel.pipeline_split_points = "model.layers.7";
  const std::string split = message(cfg, 2);
  EXPECT_NE(split.find("parallel.pipeline_split_points: 'model.layers.7' names no block"), std::string::npos) << split;
  // The same rules before any rank starts (train's preflight and dry run).
  auto refused = [](const framework::config::Config& c, int world) {
    try {
      framework::train::check_parallel(c, world);
    } catch (const framework::train::PreflightError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(refused(cfg, 2).find("parallel.pipeline_split_points: 'model.layers.7' names no block"),
            std::string::npos);
  cfg.parallel.pipeline_split_points = "";
  EXPECT_EQ(refused(cfg, 2), "no error");
  cfg.train.micro_batch_size = 8;
  EXPECT_NE(refused(cfg, 2).find("train.micro_batch_size"), std::string::npos);
  cfg.train.micro_batch_size = 2;
  cfg.train.sample_every = 5;
  EXPECT_EQ(refused(cfg, 2), "train.sample_every 5 generates on one whole model; set it 0 with parallel.pipeline 2");
  EXPECT_NE(message(cfg, 2).find("train.sample_every 5 generates on one whole model"), std::string::npos);
  fs::remove_all(cfg.run.dir);
}
