// The llama under the trainer: world-size and parallel-mode equivalence,
// bf16 mixed precision, gradient accumulation, activation checkpointing,
// bit-exact and resharded resume, and a model that is never whole on a rank.
// (Against PyTorch itself: tests/models/test_llama_parity.py.)
#include "comm/device.h"
#include "comm/torch_compat.h"
#include "framework/dtensor/device_mesh.h"
#include "models/activation_checkpoint.h"
#include "framework/fsdp/fully_shard.h"
#include "checkpoint/interop/export.h"
#include "checkpoint/interop/import_weights.h"
#include "checkpoint/interop/weights_file.h"
#include "framework/config/run_items.h"
#include "framework/train/preflight.h"
#include "framework/train/state_dict.h"
#include "framework/parallel/layout.h"
#include "framework/train/trainer.h"
#include "models/model_spec.h"
#include "models/generate.h"
#include "models/layered_model.h"
#include "models/llama.h"
#include "support/counting_allocator.h"
#include "support/multi_rank.h"
#include "support/skip.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>

#include <unistd.h>

namespace fs = std::filesystem;
using framework::train::Trainer;
using testing_support::run_runtimes;

namespace {

framework::config::Config llama_config(const std::string& dir) {
  framework::config::Config c;
  c.run.dir = dir;
  c.run.seed = 11;
  c.train.steps = 12;
  c.train.global_batch_size = 12;  // divisible by 1, 2, 3 and 4 ranks, and micro 1, 2, 3, 6
  c.train.log_every = 100;
  c.train.grad_clip = 0.5;
  c.model.kind = "llama";
  c.model.tie_weights = false;
  c.model.vocab_size = 16;
  c.model.seq_len = 16;
  c.model.d_model = 32;
  c.model.n_heads = 4;
  c.model.n_kv_heads = 2;
  c.model.n_layers = 3;
  c.model.d_ff = 48;
  c.optim.warmup_steps = 3;
  c.checkpoint.interval = 0;
  c.checkpoint.mode = checkpoint::SaveMode::kSync;
  return c;
}

std::string llama_scratch(const std::string& tag) {
  auto dir = fs::temp_directory_path() / ("shardkit_llama_" + tag + "_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  return dir.string();
}

struct LlamaRun {
  std::vector<double> losses;
  std::vector<double> grad_norms;
  std::vector<double> aux_losses;  // a mixture of experts' auxiliary loss per step
  std::vector<torch::Tensor> params;  // full tensors after training
  int64_t first_step = 0;
};

LlamaRun train(framework::config::Config cfg, int world, int64_t replicate = 1, int64_t shard = -1) {
  cfg.parallel.replicate = replicate;
  cfg.parallel.shard = shard;
  LlamaRun result;
  std::mutex mu;
  run_runtimes(world, [&](comm::Runtime& rt) {
    Trainer trainer(cfg, rt);
    const int64_t first = trainer.step();
    EXPECT_EQ(trainer.run(), 0);
    auto& model = trainer.model();
    std::vector<torch::Tensor> full;
    for (size_t i = 0; i < model.local_params().size(); ++i) {
      EXPECT_EQ(model.local_params()[i].scalar_type(), torch::kFloat) << model.param_names()[i];
      full.push_back(model.param_dtensor(i).full_tensor());
    }
    if (rt.env.rank == 0) {
      std::lock_guard<std::mutex> lock(mu);
      for (const auto& rec : trainer.history()) {
        result.losses.push_back(rec.loss);
        result.grad_norms.push_back(rec.grad_norm);
        result.aux_losses.push_back(rec.moe_aux_loss);
      }
      result.params = full;
      result.first_step = first;
    }
  });
  return result;
}

void expect_close(const LlamaRun& got, const LlamaRun& ref, double rel, const std::string& what) {
  ASSERT_EQ(got.losses.size(), ref.losses.size()) << what;
  for (size_t i = 0; i < ref.losses.size(); ++i) {
    EXPECT_NEAR(got.losses[i], ref.losses[i], rel * std::abs(ref.losses[i])) << what << ": loss of step " << i + 1;
    EXPECT_NEAR(got.grad_norms[i], ref.grad_norms[i], 10 * rel * std::abs(ref.grad_norms[i]))
        << what << ": grad norm of step " << i + 1;
  }
  ASSERT_EQ(got.params.size(), ref.params.size()) << what;
  for (size_t i = 0; i < ref.params.size(); ++i) {
    EXPECT_TRUE(torch::allclose(got.params[i], ref.params[i], 1e-4, 1e-4))
        << what << ": parameter " << i << " differs by " << (got.params[i] - ref.params[i]).abs().max().item<double>();
  }
}

void expect_identical(const LlamaRun& got, const LlamaRun& ref, const std::string& what) {
  ASSERT_EQ(got.losses.size(), ref.losses.size()) << what;
  for (size_t i = 0; i < ref.losses.size(); ++i) {
    EXPECT_EQ(got.losses[i], ref.losses[i]) << what << ": loss of step " << i + 1;
    EXPECT_EQ(got.grad_norms[i], ref.grad_norms[i]) << what << ": grad norm of step " << i + 1;
  }
  ASSERT_EQ(got.params.size(), ref.params.size()) << what;
  for (size_t i = 0; i < ref.params.size(); ++i) {
    EXPECT_TRUE(torch::equal(got.params[i], ref.params[i])) << what << ": parameter " << i;
  }
}

const LlamaRun& single_fp32() {
  static LlamaRun r = train(llama_config(llama_scratch("single")), 1);
  return r;
}

}  // namespace

TEST(LlamaModel, HasHuggingFaceParameterNamesAndOneUnitPerBlock) {
  auto cfg = llama_config("unused");
  auto model = models::make_model(cfg.model);
  std::vector<std::string> names;
  for (const auto& p : model->named_parameters()) names.push_back(p.key());
  const std::vector<std::string> first = {
      "model.embed_tokens.weight",
      "model.layers.0.input_layernorm.weight",
      "model.layers.0.self_attn.q_proj.weight",
      "model.layers.0.self_attn.k_proj.weight",
      "model.layers.0.self_attn.v_proj.weight",
      "model.layers.0.self_attn.o_proj.weight",
      "model.layers.0.post_attention_layernorm.weight",
      "model.layers.0.mlp.gate_proj.weight",
      "model.layers.0.mlp.up_proj.weight",
      "model.layers.0.mlp.down_proj.weight"};
  ASSERT_GE(names.size(), first.size());
  EXPECT_EQ(std::vector<std::string>(names.begin(), names.begin() + first.size()), first);
  EXPECT_EQ(names[names.size() - 2], "model.norm.weight");
  EXPECT_EQ(names.back(), "lm_head.weight");
  EXPECT_EQ(model->named_parameters()["model.layers.0.self_attn.k_proj.weight"].sizes(),
            torch::IntArrayRef({16, 32}));  // 2 kv heads of 8
  EXPECT_EQ(model->unit_names(),
            (std::vector<std::string>{"model.layers.0", "model.layers.1", "model.layers.2"}));
  int64_t n = 0;
  for (const auto& p : model->parameters()) n += p.numel();
  EXPECT_EQ(static_cast<double>(n), models::model_size(cfg.model).parameters);
}

TEST(LlamaModel, UnmaterialisedInitialisationEqualsEagerInAnyOrder) {
  auto cfg = llama_config("unused");
  torch::manual_seed(3);
  auto eager = models::make_model(cfg.model, true);
  torch::manual_seed(3);
  auto lazy = models::make_model(cfg.model, false);
  auto params = lazy->named_parameters();
  for (size_t i = params.size(); i-- > 0;) {  // reverse order
    const torch::Tensor& p = params[i].value();
    EXPECT_EQ(p.storage().nbytes(), 0u) << params[i].key();
    torch::Tensor full = torch::empty(p.sizes());
    lazy->init_parameter(params[i].key(), full);
    EXPECT_TRUE(torch::equal(full, eager->named_parameters()[params[i].key()])) << params[i].key();
  }
}

TEST(LlamaAttention, FusedAndMatmulPathsAgree) {
  torch::manual_seed(5);
  auto q = torch::randn({2, 4, 16, 8});
  auto k = torch::randn({2, 4, 16, 8});
  auto v = torch::randn({2, 4, 16, 8});
  auto fused = comm::compat::causal_attention(q, k, v);
  auto plain = comm::compat::causal_attention_matmul(q, k, v);
  std::cout << "attention path on this LibTorch: "
            << (comm::compat::kFusedAttention ? "scaled_dot_product_attention" : "matmul")
            << ", max difference to matmul " << (fused - plain).abs().max().item<double>() << std::endl;
  EXPECT_TRUE(torch::allclose(fused, plain, 1e-5, 1e-5));
  // bf16: the same within bf16 rounding.
  auto fused16 = comm::compat::causal_attention(q.to(torch::kBFloat16), k.to(torch::kBFloat16),
                                                           v.to(torch::kBFloat16));
  EXPECT_TRUE(torch::allclose(fused16.to(torch::kFloat), plain, 3e-2, 3e-2));
  // Causal: the first position attends to itself only.
  EXPECT_TRUE(torch::allclose(plain.select(2, 0), v.select(2, 0), 1e-6, 1e-6));
}

TEST(LlamaEquivalence, SingleProcessLossFalls) {
  const LlamaRun& ref = single_fp32();
  ASSERT_EQ(ref.losses.size(), 12u);
  EXPECT_LT(ref.losses.back(), ref.losses.front() - 0.05);
}

TEST(LlamaEquivalence, FsdpTwoAndThreeDdpTwoAndHsdpMatchOneProcess) {
  auto cfg = llama_config(llama_scratch("eq"));
  expect_close(train(cfg, 2), single_fp32(), 1e-5, "FSDP 2");
  expect_close(train(cfg, 3), single_fp32(), 1e-5, "FSDP 3");
  expect_close(train(cfg, 2, 2, 1), single_fp32(), 1e-5, "DDP 2");
  expect_close(train(cfg, 4, 2, 2), single_fp32(), 1e-5, "HSDP 2x2");
  fs::remove_all(cfg.run.dir);
}

TEST(LlamaMixedPrecision, Bf16ComputesInBf16KeepsFp32MastersAndTracksFp32) {
  auto cfg = llama_config(llama_scratch("bf16"));
  cfg.train.mixed_precision.param_dtype = framework::fsdp::PrecisionDtype::kBf16;
  const LlamaRun one = train(cfg, 1);
  const LlamaRun two = train(cfg, 2);
  const LlamaRun& fp32 = single_fp32();
  ASSERT_EQ(one.losses.size(), fp32.losses.size());
  bool differs = false;
  for (size_t i = 0; i < fp32.losses.size(); ++i) {
    differs |= one.losses[i] != fp32.losses[i];
    // bf16 keeps 8 bits of mantissa: within 2% of the fp32 run over 12 steps.
    EXPECT_NEAR(one.losses[i], fp32.losses[i], 2e-2 * fp32.losses[i]) << "step " << i + 1;
    EXPECT_NEAR(two.losses[i], one.losses[i], 1e-2 * one.losses[i]) << "FSDP 2, step " << i + 1;
  }
  EXPECT_TRUE(differs) << "bf16 losses equal fp32 bit for bit: the policy did nothing";
  // reduce_dtype bf16 runs too, and stays close.
  cfg.train.mixed_precision.reduce_dtype = framework::fsdp::PrecisionDtype::kBf16;
  const LlamaRun reduced = train(cfg, 2);
  for (size_t i = 0; i < fp32.losses.size(); ++i) {
    EXPECT_NEAR(reduced.losses[i], fp32.losses[i], 2e-2 * fp32.losses[i]) << "step " << i + 1;
  }
  fs::remove_all(cfg.run.dir);
}

TEST(LlamaMixedPrecision, GatheredParametersAreBf16AndShardsFp32) {
  auto cfg = llama_config("unused");
  std::vector<torch::Tensor> batches(2), embeddings(2);
  run_runtimes(2, [&](comm::Runtime& rt) {
    // The ranks share LibTorch's generator: the model's seed and the batch
    // are drawn under the lock (testing_support::seed_global_generator).
    std::shared_ptr<models::LayeredModelImpl> model;
    torch::Tensor tokens;
    {
      auto lock = testing_support::seed_global_generator(1);
      model = models::make_model(cfg.model, false);
      tokens = torch::randint(16, {2, 16}, torch::kLong);
    }
    batches[rt.env.rank] = tokens;
    auto mesh = framework::dtensor::DeviceMesh::create(*rt.rendezvous, {1, 2}, {"replicate", "shard"});
    framework::fsdp::FsdpOptions options;
    options.mixed_precision.param_dtype = framework::fsdp::PrecisionDtype::kBf16;
    framework::fsdp::FullyShardedModel fsdp(
        model, mesh, options, model->unit_names(),
        [model](const std::string& n, const torch::Tensor& t) { model->init_parameter(n, t); });
    for (const auto& p : fsdp.local_params()) EXPECT_EQ(p.scalar_type(), torch::kFloat);
    for (const auto& p : model->parameters()) EXPECT_EQ(p.scalar_type(), torch::kBFloat16);
    // Gathers move bf16: the full parameters take 2 bytes an element.
    int64_t elements = 0;
    for (const auto& p : model->parameters()) elements += p.numel();
    EXPECT_EQ(fsdp.memory_stats().full_param_bytes, 2 * elements);
    embeddings[rt.env.rank] = fsdp.param_dtensor(0).full_tensor();
    torch::Tensor logits = fsdp.forward([&] { return model->forward(tokens); });
    EXPECT_EQ(logits.scalar_type(), torch::kBFloat16);
    logits.to(torch::kFloat).sum().backward();
    fsdp.finish_backward();
    for (const auto& p : fsdp.local_params()) {
      ASSERT_TRUE(p.grad().defined());
      EXPECT_EQ(p.grad().scalar_type(), torch::kFloat);
    }
  });
  // Each rank initialised its shards from the same seed: the gathered
  // embedding is the one a world-1 build from seed 1 has, and the ranks drew
  // the same batch.
  torch::manual_seed(1);
  auto eager = models::make_model(cfg.model, true);
  const torch::Tensor want = eager->named_parameters()[0].value().to(torch::kBFloat16);
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(torch::equal(embeddings[r].to(torch::kBFloat16), want)) << "rank " << r;
    EXPECT_TRUE(torch::equal(batches[r], batches[0])) << "rank " << r;
  }
}

TEST(LlamaAccumulation, MicroBatchesMatchOneForwardUnderFsdpAndDdp) {
  auto cfg = llama_config(llama_scratch("accum"));
  for (int64_t micro : {1, 2, 3}) {
    cfg.train.micro_batch_size = micro;
    expect_close(train(cfg, 2), single_fp32(), 1e-5, "FSDP 2, micro " + std::to_string(micro));
  }
  cfg.train.micro_batch_size = 2;
  expect_close(train(cfg, 2, 2, 1), single_fp32(), 1e-5, "DDP 2, micro 2");
  expect_close(train(cfg, 1), single_fp32(), 1e-5, "world 1, micro 2");
  cfg.train.micro_batch_size = 1;
  expect_close(train(cfg, 4, 2, 2), single_fp32(), 1e-5, "HSDP 2x2, micro 1");
  fs::remove_all(cfg.run.dir);
}

TEST(LlamaAccumulation, AnIndivisibleMicroBatchIsRefusedNamingTheValues) {
  auto cfg = llama_config(llama_scratch("indivisible"));
  cfg.train.micro_batch_size = 4;  // 12 / (4 x 2) is not whole
  try {
    run_runtimes(2, [&](comm::Runtime& rt) { Trainer trainer(cfg, rt); });
    FAIL() << "expected an error";
  } catch (const std::exception& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("train.global_batch_size (12)"), std::string::npos) << what;
    EXPECT_NE(what.find("train.micro_batch_size (4)"), std::string::npos) << what;
    EXPECT_NE(what.find("data-parallel ranks (2)"), std::string::npos) << what;
  }
  fs::remove_all(cfg.run.dir);
}

TEST(LlamaActivationCheckpointing, FullAndSelectiveAreBitIdenticalToNone) {
  auto cfg = llama_config(llama_scratch("ac"));
  const LlamaRun none2 = train(cfg, 2);
  cfg.model.activation_checkpointing = models::ActivationCheckpointing::kFull;
  expect_identical(train(cfg, 1), single_fp32(), "full, world 1");
  expect_identical(train(cfg, 2), none2, "full, FSDP 2");
  cfg.model.activation_checkpointing = models::ActivationCheckpointing::kSelective;
  cfg.model.activation_checkpointing_every = 2;
  expect_identical(train(cfg, 2), none2, "selective every 2, FSDP 2");
  // With accumulation and bf16 too: identical to the same run without it.
  cfg.train.micro_batch_size = 3;
  cfg.train.mixed_precision.param_dtype = framework::fsdp::PrecisionDtype::kBf16;
  cfg.model.activation_checkpointing = models::ActivationCheckpointing::kNone;
  const LlamaRun plain = train(cfg, 2);
  cfg.model.activation_checkpointing = models::ActivationCheckpointing::kFull;
  expect_identical(train(cfg, 2), plain, "full, FSDP 2, bf16, micro 3");
  fs::remove_all(cfg.run.dir);
}

// What the forward keeps for backward, counted by the CPU allocator: with
// every block checkpointed, only the blocks' inputs (and the head) remain.
TEST(LlamaActivationCheckpointing, TheForwardKeepsOnlyTheBlockInputs) {
  auto cfg = llama_config("unused");
  cfg.model.seq_len = 64;
  cfg.model.n_layers = 4;
  static auto* counter = new testing_support::CountingCpuAllocator();
  std::map<std::string, int64_t> kept;
  for (const char* mode : {"none", "full"}) {
    cfg.model.activation_checkpointing = models::parse_activation_checkpointing(mode);
    torch::manual_seed(4);
    auto model = models::make_model(cfg.model);
    torch::Tensor tokens = torch::randint(16, {4, 64}, torch::kLong);
    const int64_t before = counter->live_bytes();
    torch::Tensor logits = model->forward(tokens);
    kept[mode] = counter->live_bytes() - before;
    logits.sum().backward();
  }
  const int64_t logits_bytes = 4 * 64 * 16 * 4;
  std::cout << "kept by the forward: none " << kept["none"] << " bytes, full " << kept["full"] << std::endl;
  // 4 block inputs [4, 64, 32] fp32 plus the head's final norm and logits.
  EXPECT_LT(kept["full"], 4 * (4 * 64 * 32 * 4) + 6 * logits_bytes + 4 * 64 * 32 * 4 * 3);
  EXPECT_LT(kept["full"] * 4, kept["none"]);
}

TEST(LlamaActivationCheckpointing, RecomputeReplaysTheRngAndGivesTheSameGradients) {
  // A block whose forward draws random numbers: the recompute must see the
  // same ones, or the gradient would not match the forward.
  torch::manual_seed(9);
  auto w = torch::randn({8, 8}).requires_grad_(true);
  auto fn = [&](const torch::Tensor& x) {
    return torch::tanh(torch::matmul(x, w)) * torch::rand({4, 8});
  };
  auto x = torch::randn({4, 8}).requires_grad_(true);
  torch::manual_seed(21);
  auto plain = fn(x);
  plain.pow(2).sum().backward();
  auto gw = w.grad().clone(), gx = x.grad().clone();
  w.mutable_grad().reset();
  x.mutable_grad().reset();
  torch::manual_seed(21);
  auto ckpt = models::checkpoint_activations(fn, x);
  torch::rand({3});  // the caller's generator moves on before backward
  ckpt.pow(2).sum().backward();
  EXPECT_TRUE(torch::equal(ckpt, plain));
  EXPECT_TRUE(torch::equal(w.grad(), gw));
  EXPECT_TRUE(torch::equal(x.grad(), gx));
}

TEST(LlamaResume, BitExactInFp32AndBf16AndAcrossPolicies) {
  for (const char* dtype : {"fp32", "bf16"}) {
    SCOPED_TRACE(dtype);
    auto cfg = llama_config(llama_scratch(std::string("resume_") + dtype));
    cfg.train.mixed_precision.param_dtype =
        framework::fsdp::parse_precision_dtype(dtype, "train.mixed_precision.param_dtype");
    cfg.train.micro_batch_size = 2;
    cfg.model.activation_checkpointing = models::ActivationCheckpointing::kSelective;
    const LlamaRun full = train(cfg, 2);
    auto stopped = cfg;
    stopped.run.dir = cfg.run.dir + "_stopped";
    stopped.train.stop_at = 6;
    stopped.checkpoint.interval = 3;
    train(stopped, 2);
    stopped.train.stop_at = 0;
    const LlamaRun resumed = train(stopped, 2);
    EXPECT_EQ(resumed.first_step, 6);
    ASSERT_EQ(resumed.losses.size(), 6u);
    for (size_t i = 0; i < 6; ++i) {
      EXPECT_EQ(resumed.losses[i], full.losses[6 + i]) << "step " << 7 + i;
    }
    for (size_t i = 0; i < full.params.size(); ++i) {
      EXPECT_TRUE(torch::equal(resumed.params[i], full.params[i])) << "parameter " << i;
    }
    // Resharded: FSDP 2 -> FSDP 3 and DDP 2 continue within rounding.
    for (auto [world, replicate, shard] : {std::tuple{3, 1L, -1L}, std::tuple{2, 2L, 1L}}) {
      auto other = cfg;
      other.run.dir = cfg.run.dir + "_reshard" + std::to_string(world) + std::to_string(replicate);
      other.checkpoint.resume = stopped.run.dir + "/checkpoints/step_6";
      const LlamaRun r = train(other, world, replicate, shard);
      ASSERT_EQ(r.losses.size(), 6u);
      const double tol = std::string(dtype) == "fp32" ? 1e-5 : 1e-2;
      for (size_t i = 0; i < 6; ++i) {
        EXPECT_NEAR(r.losses[i], full.losses[6 + i], tol * full.losses[6 + i])
            << "world " << world << " replicate " << replicate << ", step " << 7 + i;
      }
      fs::remove_all(other.run.dir);
    }
    // The other policy resumes the same checkpoint (it holds fp32 masters).
    auto switched = cfg;
    switched.run.dir = cfg.run.dir + "_switched";
    switched.train.mixed_precision.param_dtype = std::string(dtype) == "fp32"
                                                      ? framework::fsdp::PrecisionDtype::kBf16
                                                      : framework::fsdp::PrecisionDtype::kFp32;
    switched.checkpoint.resume = stopped.run.dir + "/checkpoints/step_6";
    const LlamaRun s = train(switched, 2);
    EXPECT_EQ(s.first_step, 6);
    ASSERT_EQ(s.losses.size(), 6u);
    for (size_t i = 0; i < 6; ++i) EXPECT_NEAR(s.losses[i], full.losses[6 + i], 3e-2 * full.losses[6 + i]);
    for (const auto& d : {cfg.run.dir, stopped.run.dir, switched.run.dir}) fs::remove_all(d);
  }
}

// Parameters are created as their shards: while the model is built and
// sharded, the CPU allocator never holds more than the ranks' shards plus
// one full parameter per rank (+10%), far below one whole model per rank.
TEST(LlamaNeverWhole, PeakMemoryWhileBuildingIsShardsPlusOneParameter) {
  auto cfg = llama_config("unused");
  cfg.model.vocab_size = 4096;
  cfg.model.d_model = 256;
  cfg.model.n_heads = 8;
  cfg.model.n_kv_heads = 4;
  cfg.model.n_layers = 4;
  cfg.model.d_ff = 768;
  cfg.model.seq_len = 64;
  const int world = 4;
  const auto size = models::model_size(cfg.model);
  const double whole = size.parameters * 4;
  const double largest = size.largest_parameter * 4;
  static auto* counter = new testing_support::CountingCpuAllocator();  // for the process
  std::atomic<int64_t> shards{0};
  std::atomic<int64_t> peak_built{0};
  std::vector<torch::Tensor> values(world);
  run_runtimes(world, [&](comm::Runtime& rt) {
    auto mesh = framework::dtensor::DeviceMesh::create(*rt.rendezvous, {1, world}, {"replicate", "shard"});
    mesh->group(1).barrier();
    if (rt.env.rank == 0) counter->reset_peak();
    mesh->group(1).barrier();
    const int64_t before = counter->live_bytes();
    std::shared_ptr<models::LayeredModelImpl> model;
    {
      static std::mutex seed_mutex;
      std::lock_guard<std::mutex> lock(seed_mutex);
      torch::manual_seed(2);
      model = models::make_model(cfg.model, false);
    }
    framework::fsdp::FullyShardedModel fsdp(
        model, mesh, {}, model->unit_names(),
        [model](const std::string& n, const torch::Tensor& t) { model->init_parameter(n, t); });
    shards += fsdp.memory_stats().sharded_param_bytes;
    mesh->group(1).barrier();
    if (rt.env.rank == 0) peak_built = counter->peak_bytes() - before;
    mesh->group(1).barrier();
    values[rt.env.rank] = fsdp.param_dtensor(0).full_tensor();  // the embedding, gathered
  });
  const double peak = static_cast<double>(peak_built.load());
  std::cout << "whole model " << whole / 1048576 << " MiB, largest parameter " << largest / 1048576
            << " MiB, " << world << " ranks' shards " << shards.load() / 1048576.0
            << " MiB; peak while building " << peak / 1048576 << " MiB" << std::endl;
  EXPECT_LE(peak, (static_cast<double>(shards.load()) + world * largest) * 1.1);
  EXPECT_LT(peak, 0.6 * world * whole);
  // The values do not depend on the world size: equal to a world-1 build.
  torch::manual_seed(2);
  auto eager = models::make_model(cfg.model, true);
  for (int r = 0; r < world; ++r) EXPECT_TRUE(torch::equal(values[r], eager->named_parameters()[0].value()));
}

// Gradient accumulation under HSDP and DDP: with sync off for all but the
// last micro-batch (what the Trainer does), the replicate axis carries one
// all-reduce per bucket per step instead of one per micro-batch. HSDP still
// reduce-scatters every micro-batch, and its gradients equal those of
// syncing every micro-batch; DDP refuses a second synced backward in a step.
TEST(LlamaAccumulation, HsdpAndDdpAllReduceOncePerStepAndMatchSyncingEveryMicroBatch) {
  auto cfg = llama_config("unused");
  for (auto [replicate, shard] : {std::pair<int64_t, int64_t>{2, 2}, std::pair<int64_t, int64_t>{4, 1}}) {
    SCOPED_TRACE("mesh " + std::to_string(replicate) + "x" + std::to_string(shard));
    run_runtimes(4, [&, replicate = replicate, shard = shard](comm::Runtime& rt) {
      auto mesh = framework::dtensor::DeviceMesh::create(*rt.rendezvous, {replicate, shard},
                                                         {"replicate", "shard"});
      // The ranks are threads of this process and share LibTorch's global
      // generator: seeding and drawing must not interleave between them, or
      // a rank's two runs start from different models.
      static std::mutex seed_mutex;
      std::vector<torch::Tensor> micro;
      {
        std::lock_guard<std::mutex> lock(seed_mutex);
        torch::manual_seed(5 + rt.env.rank);  // each rank its own micro-batches
        for (int m = 0; m < 3; ++m) micro.push_back(torch::randint(16, {2, 17}, torch::kLong));
      }
      // Gradient collectives issued, counted from the schedule log (one entry
      // per unit and issue).
      struct Counts {
        int64_t reduce_scatters = 0;
        int64_t all_reduces = 0;
      };
      auto run = [&](bool sync_every, Counts& counts) {
        std::shared_ptr<models::LayeredModelImpl> model;
        {
          std::lock_guard<std::mutex> lock(seed_mutex);
          torch::manual_seed(1);
          model = models::make_model(cfg.model, false);
        }
        framework::fsdp::FullyShardedModel fsdp(
            model, mesh, framework::fsdp::FsdpOptions{}, model->unit_names(),
            [model](const std::string& n, const torch::Tensor& t) { model->init_parameter(n, t); });
        fsdp.set_schedule_logging(true);
        for (int m = 0; m < 3; ++m) {
          fsdp.set_requires_gradient_sync(sync_every || m == 2);
          torch::Tensor in = micro[m].narrow(1, 0, 16), target = micro[m].narrow(1, 1, 16);
          torch::Tensor logits = fsdp.forward([&] { return model->forward(in); });
          torch::nn::functional::cross_entropy(logits.reshape({-1, 16}), target.reshape({-1})).backward();
          fsdp.finish_backward();
        }
        for (const std::string& event : fsdp.schedule()) {
          counts.reduce_scatters += event.rfind("reduce.issue ", 0) == 0;
          counts.all_reduces += event.rfind("allreduce.issue ", 0) == 0;
        }
        std::vector<torch::Tensor> grads;
        for (const auto& p : fsdp.local_params()) grads.push_back(p.grad().clone());
        return grads;
      };
      Counts last_only, every;
      const auto g_last = run(false, last_only);
      ASSERT_GT(last_only.all_reduces, 0);
      if (shard == 1) {
        // DDP: a parameter is its own shard, so syncing a backward before the
        // last would have the next one add to the synced sum: refused.
        try {
          run(true, every);
          ADD_FAILURE() << "DDP synced twice in one step without an error";
        } catch (const std::exception& e) {
          EXPECT_NE(std::string(e.what()).find("set_requires_gradient_sync(false)"), std::string::npos)
              << e.what();
        }
        EXPECT_EQ(last_only.reduce_scatters, 0);
        return;
      }
      const auto g_every = run(true, every);
      EXPECT_EQ(every.all_reduces, 3 * last_only.all_reduces);
      EXPECT_EQ(last_only.reduce_scatters, every.reduce_scatters);
      EXPECT_GT(last_only.reduce_scatters, 0);
      EXPECT_EQ(last_only.reduce_scatters % 3, 0);  // every micro-batch
      EXPECT_EQ(last_only.reduce_scatters / 3, last_only.all_reduces);
      ASSERT_EQ(g_last.size(), g_every.size());
      for (size_t i = 0; i < g_last.size(); ++i) {
        EXPECT_TRUE(torch::allclose(g_last[i], g_every[i], 1e-5, 1e-7))
            << "parameter " << i << ": max diff " << (g_last[i] - g_every[i]).abs().max().item<double>();
      }
    });
  }
}

// model.init_from a Hugging Face directory (bf16 safetensors): each rank
// reads only its shards' bytes; the memory the load adds beyond the shards
// is one conversion buffer, the rank's part of one tensor in bf16. Ranks
// load one after another so that the process-wide allocator counts one.
TEST(LlamaFromHuggingFace, EachRankHoldsItsShardsPlusOneConversionBuffer) {
  auto cfg = llama_config("unused");
  cfg.model.vocab_size = 512;
  cfg.model.d_model = 128;
  cfg.model.n_layers = 2;
  cfg.model.d_ff = 352;
  const std::string dir = llama_scratch("hf_dir");
  fs::create_directories(dir);
  torch::manual_seed(8);
  auto eager = models::make_model(cfg.model, true);
  std::vector<torch::Tensor> bf16;
  std::map<std::string, torch::Tensor> by_name;
  std::vector<checkpoint::SafetensorsTensor> tensors;
  for (const auto& p : eager->named_parameters()) {
    bf16.push_back(p.value().detach().to(torch::kBFloat16).contiguous());
    by_name[p.key()] = bf16.back();
    tensors.push_back({p.key(), checkpoint::DType::kBFloat16, p.value().sizes().vec(),
                       static_cast<const uint8_t*>(bf16.back().data_ptr())});
  }
  checkpoint::write_safetensors(dir + "/model.safetensors", tensors);
  const int world = 2;
  static auto* counter = new testing_support::CountingCpuAllocator();
  std::vector<int64_t> added(world, 0), largest_buffer(world, 0);
  std::vector<std::map<std::string, torch::Tensor>> full(world);
  run_runtimes(world, [&](comm::Runtime& rt) {
    auto mesh = framework::dtensor::DeviceMesh::create(*rt.rendezvous, {1, world}, {"replicate", "shard"});
    std::shared_ptr<models::LayeredModelImpl> model;
    {
      static std::mutex seed_mutex;
      std::lock_guard<std::mutex> lock(seed_mutex);
      model = models::make_model(cfg.model, false);
    }
    framework::fsdp::FullyShardedModel fsdp(
        model, mesh, {}, model->unit_names(),
        [model](const std::string& n, const torch::Tensor& t) { model->init_parameter(n, t); });
    checkpoint::StateDict sd = framework::train::get_state_dict(fsdp, nullptr);
    for (const auto& p : fsdp.local_params()) {
      largest_buffer[rt.env.rank] = std::max<int64_t>(largest_buffer[rt.env.rank], p.numel() * 2);
    }
    for (int turn = 0; turn < world; ++turn) {
      mesh->group(1).barrier();
      if (turn != rt.env.rank) continue;
      const int64_t before = counter->live_bytes();
      counter->reset_peak();
      torch::NoGradGuard no_grad;
      const auto stats = checkpoint::load_weights_into(sd, dir, "model.", false);
      added[rt.env.rank] = counter->peak_bytes() - before;
      EXPECT_EQ(stats.converted.size(), tensors.size());
    }
    mesh->group(1).barrier();
    for (size_t i = 0; i < fsdp.local_params().size(); ++i) {
      full[rt.env.rank][fsdp.param_names()[i]] = fsdp.param_dtensor(i).full_tensor();
    }
  });
  for (int r = 0; r < world; ++r) {
    std::cout << "rank " << r << ": the load added at most " << added[r] << " bytes; its largest bf16 shard is "
              << largest_buffer[r] << " bytes" << std::endl;
    EXPECT_LE(added[r], largest_buffer[r] + 4096) << "rank " << r;
    ASSERT_EQ(full[r].size(), by_name.size());
    for (const auto& [name, want] : by_name) {
      ASSERT_EQ(full[r].count(name), 1u) << name;
      EXPECT_TRUE(torch::equal(full[r][name], want.to(torch::kFloat))) << name;
    }
  }
  fs::remove_all(dir);
}

// Every parameter of a Trainer of `cfg` at `world` ranks, whole, by name:
// after `cfg.train.steps` steps when `steps`, else as it starts
// (model.init_from loaded).
std::map<std::string, torch::Tensor> trainer_params(const framework::config::Config& cfg, int world, bool steps) {
  std::map<std::string, torch::Tensor> out;
  std::mutex mu;
  run_runtimes(world, [&](comm::Runtime& rt) {
    Trainer trainer(cfg, rt);
    if (steps) {
      EXPECT_EQ(trainer.run(), 0);
    }
    auto& model = trainer.model();
    std::map<std::string, torch::Tensor> full;
    for (size_t i = 0; i < model.local_params().size(); ++i) full[model.param_names()[i]] = model.param_dtensor(i).full_tensor();
    if (rt.env.rank == 0) {
      std::lock_guard<std::mutex> lock(mu);
      out = std::move(full);
    }
  });
  return out;
}

// A llama mixture of experts through Hugging Face and back (docs/moe.md,
// "Hugging Face in and out"): a run's checkpoint exported with ckpt
// export's run adapter is a Qwen3MoeForCausalLM (q/k norm) or
// MixtralForCausalLM directory, one tensor per expert under Hugging Face's
// names; model.init_from that directory at 2 ranks (each reading its own
// experts' bytes) starts from the run's parameters bit for bit. LoRA on the
// attention of the Qwen3-MoE base trains, and --merge-lora writes the base
// with the adapters merged, its experts untouched.
TEST(LlamaMoeHuggingFace, ExportSplitsTheExpertsAndInitFromStacksThemBackBitForBit) {
  for (const bool qwen3 : {true, false}) {
    const std::string tag = qwen3 ? "qwen3_moe" : "mixtral";
    auto cfg = llama_config(llama_scratch("moe_hf_" + tag));
    cfg.train.steps = 2;
    cfg.checkpoint.interval = 2;
    cfg.model.qk_norm = qwen3;
    cfg.model.moe.num_experts = 4;
    cfg.model.moe.top_k = 2;
    cfg.model.moe.d_ff = 24;
    cfg.model.moe.route_norm = !qwen3;  // Qwen3-MoE's norm_topk_prob may be false; Mixtral's never
    cfg.model.moe.first_dense_layers = qwen3 ? 1 : 0;
    cfg.model.moe.aux_loss_coef = 0.01;
    // Qwen3-30B-A3B's kind of attention: heads of 16 where 32 / 4 would be 8.
    cfg.model.head_dim = qwen3 ? 16 : 0;
    const std::map<std::string, torch::Tensor> trained = trainer_params(cfg, 2, true);
    const std::string step_dir = cfg.run.dir + "/checkpoints/step_2", hf = cfg.run.dir + "_hf";
    checkpoint::ExportOptions to_hf;
    to_hf.format = checkpoint::ExportFormat::kHf;
    to_hf.run = framework::config::make_run_adapter();
    checkpoint::export_checkpoint(step_dir, hf, to_hf);

    const checkpoint::WeightsFile file = checkpoint::WeightsFile::open(hf);
    std::ifstream config_file(hf + "/config.json");
    const nlohmann::json config = nlohmann::json::parse(config_file);
    EXPECT_EQ(config["model_type"], qwen3 ? "qwen3_moe" : "mixtral") << tag;
    const int64_t d = cfg.model.d_model, inner = 24;
    const int64_t head_dim = qwen3 ? 16 : 8;
    EXPECT_EQ(config["head_dim"], head_dim) << tag;
    EXPECT_EQ(file.find("model.layers.0.self_attn.q_proj.weight")->shape, (std::vector<int64_t>{4 * head_dim, d})) << tag;
    EXPECT_EQ(file.find("model.layers.0.self_attn.k_proj.weight")->shape, (std::vector<int64_t>{2 * head_dim, d})) << tag;
    EXPECT_EQ(file.find("model.layers.0.self_attn.o_proj.weight")->shape, (std::vector<int64_t>{d, 4 * head_dim})) << tag;
    size_t experts_tensors = 0;
    for (int64_t layer = 0; layer < cfg.model.n_layers; ++layer) {
      const std::string at = "model.layers." + std::to_string(layer) + ".";
      if (layer < cfg.model.moe.first_dense_layers) {
        EXPECT_NE(file.find(at + "mlp.gate_proj.weight"), nullptr) << tag << " dense layer " << layer;
        continue;
      }
      const std::string moe = at + (qwen3 ? "mlp." : "block_sparse_moe.");
      EXPECT_EQ(file.find(at + "mlp.experts.gate_proj.weight"), nullptr) << tag;
      ASSERT_NE(file.find(moe + "gate.weight"), nullptr) << tag << " " << moe;
      EXPECT_EQ(file.find(moe + "gate.weight")->shape, (std::vector<int64_t>{4, d}));
      for (int e = 0; e < 4; ++e) {
        const std::string expert = moe + "experts." + std::to_string(e) + ".";
        const std::vector<std::pair<std::string, std::vector<int64_t>>> shapes =
            qwen3 ? std::vector<std::pair<std::string, std::vector<int64_t>>>{{"gate_proj", {inner, d}},
                                                                            {"up_proj", {inner, d}},
                                                                            {"down_proj", {d, inner}}}
                  : std::vector<std::pair<std::string, std::vector<int64_t>>>{
                        {"w1", {inner, d}}, {"w3", {inner, d}}, {"w2", {d, inner}}};
        for (const auto& [name, shape] : shapes) {
          const checkpoint::WeightsTensorInfo* t = file.find(expert + name + ".weight");
          ASSERT_NE(t, nullptr) << expert + name;
          EXPECT_EQ(t->shape, shape) << expert + name;
          ++experts_tensors;
        }
      }
      EXPECT_EQ(file.find(at + "self_attn.q_norm.weight") != nullptr, qwen3) << tag;
    }
    EXPECT_EQ(experts_tensors, static_cast<size_t>(3 * 4 * (cfg.model.n_layers - cfg.model.moe.first_dense_layers)));

    auto from_hf = cfg;
    from_hf.run.dir = cfg.run.dir + "_from_hf";
    from_hf.checkpoint.interval = 0;
    from_hf.model.init_from = hf;
    const std::map<std::string, torch::Tensor> loaded = trainer_params(from_hf, 2, false);
    ASSERT_EQ(loaded.size(), trained.size()) << tag;
    for (const auto& [name, want] : trained) {
      ASSERT_EQ(loaded.count(name), 1u) << tag << " " << name;
      EXPECT_TRUE(torch::equal(loaded.at(name), want)) << tag << ": " << name << " differs after the round trip";
    }

    if (qwen3) {
      auto lora = from_hf;
      lora.run.dir = cfg.run.dir + "_lora";
      lora.checkpoint.interval = 2;
      lora.model.lora.rank = 4;
      lora.model.lora.targets = "q_proj,v_proj";
      const std::map<std::string, torch::Tensor> tuned = trainer_params(lora, 2, true);
      for (const auto& [name, want] : trained) {
        EXPECT_TRUE(torch::equal(tuned.at(name), want)) << "LoRA changed the frozen " << name;
      }
      EXPECT_GT(tuned.at("model.layers.1.self_attn.q_proj.lora_B.weight").abs().max().item<double>(), 0);
      checkpoint::ExportOptions merged = to_hf;
      merged.merge_lora = true;
      checkpoint::export_checkpoint(lora.run.dir + "/checkpoints/step_2", lora.run.dir + "_merged", merged);
      const checkpoint::WeightsFile m = checkpoint::WeightsFile::open(lora.run.dir + "_merged");
      EXPECT_EQ(m.tensors().size(), file.tensors().size());
      auto read = [](const checkpoint::WeightsFile& f, const std::string& name) {
        const checkpoint::WeightsTensorInfo* t = f.find(name);
        EXPECT_NE(t, nullptr) << name;
        torch::Tensor out = torch::empty(t->shape, torch::kFloat);
        f.read_box(name, checkpoint::full_box(t->shape), static_cast<uint8_t*>(out.data_ptr()));
        return out;
      };
      const std::string expert = "model.layers.2.mlp.experts.3.down_proj.weight", q = "model.layers.2.self_attn.q_proj.weight";
      EXPECT_TRUE(torch::equal(read(m, expert), read(file, expert)));
      EXPECT_FALSE(torch::equal(read(m, q), read(file, q)));
      fs::remove_all(lora.run.dir);
      fs::remove_all(lora.run.dir + "_merged");
    }
    fs::remove_all(cfg.run.dir);
    fs::remove_all(hf);
    fs::remove_all(from_hf.run.dir);
  }
}

// Generation: the KV cache gives the logits of a forward over the whole
// sequence (prompt at once, then one token at a time), and greedy tokens
// equal those of re-running the sequence; sampling is a function of its seed.
// LoRA (model.lora.*): a projection with adapters is x W^T + (alpha / rank)
// x A^T B^T, values and gradients, against the formula in torch ops.
TEST(LlamaLora, AProjectionIsTheBaseProjectionPlusTheScaledLowRankProduct) {
  torch::manual_seed(3);
  models::Projection p(8, 6, true);
  p->add_lora(2, 16.0 / 2, 0.0, true);
  std::map<std::string, torch::Tensor> w;
  for (const auto& item : p->named_parameters()) w[item.key()] = item.value();
  ASSERT_EQ(w.size(), 3u);
  ASSERT_EQ(w.at("lora_A.weight").sizes(), (std::vector<int64_t>{2, 8}));
  ASSERT_EQ(w.at("lora_B.weight").sizes(), (std::vector<int64_t>{6, 2}));
  {
    torch::NoGradGuard no_grad;
    for (auto& [name, t] : w) t.normal_();  // B too: its start (zero) would hide the product
  }
  torch::Tensor x = torch::randn({3, 5, 8});
  torch::Tensor y = p->forward(x);
  std::map<std::string, torch::Tensor> ref;
  for (auto& [name, t] : w) ref[name] = t.detach().clone().requires_grad_(true);
  torch::Tensor want = x.matmul(ref["weight"].t()) + 8.0 * x.matmul(ref["lora_A.weight"].t()).matmul(ref["lora_B.weight"].t());
  EXPECT_TRUE(torch::allclose(y, want, 1e-6, 1e-6));
  torch::Tensor g = torch::randn_like(y);
  y.backward(g);
  want.backward(g);
  for (auto& [name, t] : w) {
    EXPECT_TRUE(torch::allclose(t.grad(), ref[name].grad(), 1e-5, 1e-6)) << name;
  }
}

// A LoRA llama is its base model at step 0 (B zero, the base drawn as
// without LoRA); training changes only the adapters, which alone have
// AdamW state; FSDP 2, TP 2 and TP 2 x FSDP 2 equal one process.
TEST(LlamaLora, StepZeroIsTheBaseAndOnlyTheAdaptersTrainUnderFsdpAndTp) {
  auto cfg = llama_config(llama_scratch("lora"));
  cfg.model.n_heads = 4;
  cfg.model.n_kv_heads = 2;
  cfg.model.lora.rank = 4;
  cfg.model.lora.alpha = 8;
  cfg.model.lora.targets = "q_proj,v_proj,o_proj,gate_proj,down_proj";  // colwise and rowwise
  // The blocks' inputs need no gradient (the embedding is frozen): the
  // recompute must still give the adapters theirs.
  cfg.model.activation_checkpointing = models::ActivationCheckpointing::kFull;
  auto base_options = cfg.model;
  base_options.lora.rank = 0;
  torch::manual_seed(static_cast<uint64_t>(cfg.run.seed));
  auto lora_model = models::make_model(cfg.model);
  torch::manual_seed(static_cast<uint64_t>(cfg.run.seed));
  auto base_model = models::make_model(base_options);
  torch::Tensor tokens = torch::randint(0, cfg.model.vocab_size, {2, cfg.model.seq_len});
  EXPECT_TRUE(torch::equal(lora_model->forward(tokens), base_model->forward(tokens)));
  std::vector<std::string> names;
  std::vector<torch::Tensor> initial;
  int64_t adapters = 0;
  for (const auto& item : lora_model->named_parameters()) {
    names.push_back(item.key());
    initial.push_back(item.value().detach().clone());
    EXPECT_EQ(item.value().requires_grad(), models::is_lora_parameter(item.key())) << item.key();
    adapters += models::is_lora_parameter(item.key()) ? 1 : 0;
  }
  EXPECT_EQ(adapters, 2 * 5 * cfg.model.n_layers);

  const LlamaRun one = train(cfg, 1);
  ASSERT_EQ(one.params.size(), names.size());
  for (size_t i = 0; i < names.size(); ++i) {
    if (models::is_lora_parameter(names[i])) {
      if (names[i].find("lora_B") != std::string::npos) {
        EXPECT_GT(one.params[i].abs().max().item<double>(), 0) << names[i];
      }
    } else {
      EXPECT_TRUE(torch::equal(one.params[i], initial[i])) << "the frozen " << names[i] << " changed";
    }
  }
  EXPECT_LT(one.losses.back(), one.losses.front());
  expect_close(train(cfg, 2), one, 1e-5, "LoRA, FSDP 2");
  auto tp = cfg;
  tp.parallel.tensor = 2;
  expect_close(train(tp, 2, 1, 1), one, 1e-5, "LoRA, TP 2");
  expect_close(train(tp, 4, 1, 2), one, 1e-5, "LoRA, TP 2 x FSDP 2");
  // AdamW state: the adapters' only.
  run_runtimes(1, [&](comm::Runtime& rt) {
    auto c = cfg;
    c.train.steps = 1;
    c.run.dir = cfg.run.dir + "_state";
    Trainer trainer(c, rt);
    trainer.run();
    checkpoint::StateDict sd = framework::train::get_state_dict(trainer.model(), &trainer.optimizer());
    int64_t moments = 0;
    for (const auto& t : sd.tensors()) {
      if (t.name.rfind("optim.", 0) != 0) continue;
      ++moments;
      EXPECT_TRUE(models::is_lora_parameter(t.name)) << t.name;
    }
    EXPECT_EQ(moments, 2 * adapters);
    fs::remove_all(c.run.dir);
  });
  fs::remove_all(cfg.run.dir);
}

TEST(LlamaGeneration, KvCacheGivesTheLogitsOfAFullForwardAndTheSameTokens) {
  auto cfg = llama_config("unused");
  cfg.model.rope_scaling.factor = 8;  // Llama 3.1's scaled frequencies too
  cfg.model.rope_scaling.original_max_position = 8;
  torch::manual_seed(3);
  auto model = models::make_model(cfg.model, true);
  auto* llama = dynamic_cast<models::LlamaModelImpl*>(model.get());
  ASSERT_NE(llama, nullptr);
  torch::NoGradGuard no_grad;
  torch::Tensor tokens = torch::randint(16, {2, 16}, torch::kLong);
  torch::Tensor full = model->forward(tokens);
  models::KvCache cache;
  torch::Tensor first = llama->forward_cached(tokens.narrow(1, 0, 5), cache);
  EXPECT_TRUE(torch::allclose(first, full.narrow(1, 0, 5), 1e-5, 1e-5))
      << (first - full.narrow(1, 0, 5)).abs().max().item<double>();
  for (int64_t t = 5; t < 16; ++t) {
    torch::Tensor step = llama->forward_cached(tokens.narrow(1, t, 1), cache);
    EXPECT_TRUE(torch::allclose(step, full.narrow(1, t, 1), 1e-5, 1e-5))
        << "position " << t << ": " << (step - full.narrow(1, t, 1)).abs().max().item<double>();
  }
  EXPECT_EQ(cache.length, 16);
  ASSERT_EQ(cache.k.at(0).size(3), 8);  // d_model 32 / 4 heads
  {
    // model.head_dim 12 apart from 32 / 4: the cache holds heads of 12.
    auto wide_cfg = cfg.model;
    wide_cfg.head_dim = 12;
    wide_cfg.qk_norm = true;
    auto wide = models::make_model(wide_cfg, true);
    auto* wide_llama = dynamic_cast<models::LlamaModelImpl*>(wide.get());
    torch::Tensor wide_full = wide->forward(tokens);
    models::KvCache wide_cache;
    torch::Tensor head = wide_llama->forward_cached(tokens.narrow(1, 0, 9), wide_cache);
    torch::Tensor tail = wide_llama->forward_cached(tokens.narrow(1, 9, 7), wide_cache);
    EXPECT_TRUE(torch::allclose(torch::cat({head, tail}, 1), wide_full, 1e-5, 1e-5));
    EXPECT_EQ(wide_cache.k.at(0).sizes(), (std::vector<int64_t>{2, 2, 16, 12}));
  }
  const std::vector<int64_t> prompt = {3, 1, 4, 1};
  models::SamplingOptions greedy;
  const auto cached = models::generate(*model, cfg.model.seq_len, prompt, 12, greedy);
  const auto rerun = models::generate(*model, cfg.model.seq_len, prompt, 12, greedy, {}, /*use_cache=*/false);
  EXPECT_EQ(cached, rerun);
  models::SamplingOptions top1;
  top1.temperature = 1.0;
  top1.top_k = 1;
  EXPECT_EQ(models::generate(*model, cfg.model.seq_len, prompt, 12, top1), cached);
  models::SamplingOptions sampled;
  sampled.temperature = 1.5;
  sampled.top_p = 0.95;
  sampled.seed = 7;
  const auto a = models::generate(*model, cfg.model.seq_len, prompt, 12, sampled);
  EXPECT_EQ(models::generate(*model, cfg.model.seq_len, prompt, 12, sampled), a);
  sampled.seed = 8;
  EXPECT_NE(models::generate(*model, cfg.model.seq_len, prompt, 12, sampled), a);
}

// train.fused_kernels: the fused ops against the composed LibTorch ops they
// replace, forward and backward, on the CPU (both legs) and on a GPU
// (CudaFusedOps, run by scripts/gpu-all). fp32 within 1e-5; bf16 within
// 1/64 relative plus 1/64 absolute (a few bf16 steps: a fused RMSNorm kernel
// rounds once where the composed ops round twice).
void expect_fused_ops_match(const torch::Device& device, torch::ScalarType dtype) {
  const bool bf16 = dtype == torch::kBFloat16;
  const double tol = bf16 ? 1.0 / 64 : 1e-5;
  torch::manual_seed(5);
  auto opts = torch::TensorOptions().dtype(dtype).device(device);
  // RMSNorm.
  models::RMSNorm plain(256, 1e-5, true), fused(256, 1e-5, true);
  {
    torch::NoGradGuard no_grad;
    torch::Tensor w = torch::rand({256}) + 0.5;
    plain->named_parameters()["weight"].copy_(w);
    fused->named_parameters()["weight"].copy_(w);
  }
  plain->to(device, dtype);
  fused->to(device, dtype);
  fused->set_fused(true);
  torch::Tensor x = (torch::randn({4, 33, 256}) * 3).to(opts);
  torch::Tensor xa = x.clone().requires_grad_(true), xb = x.clone().requires_grad_(true);
  torch::Tensor ya = plain->forward(xa), yb = fused->forward(xb);
  torch::Tensor up = torch::randn_like(ya);
  (ya.to(torch::kFloat) * up.to(torch::kFloat)).sum().backward();
  (yb.to(torch::kFloat) * up.to(torch::kFloat)).sum().backward();
  auto close = [&](const torch::Tensor& a, const torch::Tensor& b, const std::string& what, double t) {
    ASSERT_EQ(a.scalar_type(), b.scalar_type()) << what;
    const double diff = (a.to(torch::kDouble) - b.to(torch::kDouble)).abs().max().item<double>();
    const double scale = b.to(torch::kDouble).abs().max().item<double>();
    EXPECT_LE(diff, t * (1 + scale)) << what << " on " << device << " in " << dtype << ": differs by " << diff
                                     << " (largest value " << scale << ")";
  };
  close(yb, ya, "rms_norm forward", tol);
  close(xb.grad(), xa.grad(), "rms_norm input gradient", tol);
  close(fused->named_parameters()["weight"].grad(), plain->named_parameters()["weight"].grad(),
        "rms_norm weight gradient", bf16 ? 4 * tol : tol);  // a sum over 132 rows
  // Cross-entropy over the vocabulary, in chunks (3 of 100 rows, the last
  // one short), some targets ignored; then once more in the trainer's
  // chunking (64 MiB of fp32 rows: 512 of a 32K vocabulary) below.
  const int64_t vocab = 4096, rows = 250;
  torch::Tensor logits = (torch::randn({rows, vocab}) * 4).to(opts);
  torch::Tensor targets = torch::randint(vocab, {rows}, torch::TensorOptions(torch::kLong));
  targets.index_put_({torch::arange(0, rows, 7)}, -100);
  targets = targets.to(device);
  torch::Tensor la = logits.clone().requires_grad_(true), lb = logits.clone().requires_grad_(true);
  torch::Tensor ref = torch::nn::functional::cross_entropy(
      la.to(torch::kFloat), targets,
      torch::nn::functional::CrossEntropyFuncOptions().ignore_index(-100).reduction(torch::kSum));
  torch::Tensor got = models::fused_cross_entropy_sum(lb, targets, -100, /*chunk_rows=*/100);
  EXPECT_EQ(got.scalar_type(), torch::kFloat);
  const double r = ref.item<double>();
  EXPECT_NEAR(got.item<double>(), r, 1e-5 * std::abs(r)) << "cross-entropy sum on " << device << " in " << dtype;
  (ref / 977.0).backward();
  (got / 977.0).backward();
  close(lb.grad(), la.grad(), "cross-entropy logits gradient", bf16 ? tol : 1e-5);
  // Nothing differs where both are exact: ignored rows get zero gradient.
  EXPECT_EQ(lb.grad().index({torch::arange(0, rows, 7).to(device)}).abs().max().item<double>(), 0.0);
  // The default chunking: one full chunk of a 32K vocabulary and a short one.
  torch::Tensor big = (torch::randn({600, 32768}) * 4).to(opts);
  torch::Tensor big_targets = torch::randint(32768, {600}, torch::TensorOptions(torch::kLong)).to(device);
  const double big_ref = torch::nn::functional::cross_entropy(
                             big.to(torch::kFloat), big_targets,
                             torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum))
                             .item<double>();
  EXPECT_NEAR(models::fused_cross_entropy_sum(big, big_targets, -100).item<double>(), big_ref,
              1e-5 * std::abs(big_ref));
}

TEST(FusedOps, RmsNormAndChunkedCrossEntropyMatchTheComposedOpsOnTheCpu) {
  expect_fused_ops_match(torch::kCPU, torch::kFloat);
  expect_fused_ops_match(torch::kCPU, torch::kBFloat16);
  std::cout << "[ fused    ] rms_norm: "
            << (comm::compat::kHasRmsNorm ? "LibTorch's op" : "composed (LibTorch < 2.4 has no rms_norm op)")
            << "\n";
}

TEST(CudaFusedOps, RmsNormAndChunkedCrossEntropyMatchTheComposedOpsOnTheGpu) {
  if (!comm::cuda_available()) {
    SHARDKIT_SKIP("no CUDA device (CPU-only LibTorch build, or no GPU visible)");
  }
  expect_fused_ops_match(torch::Device(torch::kCUDA, 0), torch::kFloat);
  expect_fused_ops_match(torch::Device(torch::kCUDA, 0), torch::kBFloat16);
}

namespace {

// A mixture of experts (docs/moe.md) on the llama_config sizes: 4 experts
// of width 16, top-2, a dense first block and a shared expert, the aux
// loss and the bias balancing, so that every part of a step crosses ranks.
framework::config::Config moe_config(const std::string& dir) {
  auto c = llama_config(dir);
  c.train.steps = 20;
  c.model.moe.num_experts = 4;
  c.model.moe.top_k = 2;
  c.model.moe.d_ff = 16;
  c.model.moe.route_norm = true;
  c.model.moe.num_shared_experts = 1;
  c.model.moe.first_dense_layers = 1;
  c.model.moe.aux_loss_coef = 0.01;
  c.model.moe.load_balance_rate = 0.01;
  c.model.qk_norm = true;
  // The auxiliary loss is each micro-batch's: micro-batches of 3 sequences
  // make it the same objective at world 1, 2 and 4 (global batch 12).
  c.train.micro_batch_size = 3;
  return c;
}

LlamaRun train_ep(framework::config::Config cfg, int world, int64_t expert, int64_t replicate = 1) {
  cfg.parallel.expert = expert;
  return train(std::move(cfg), world, replicate, -1);
}

}  // namespace

// Expert parallelism against one process over 20 steps, fp32: the experts
// split over 2 and 4 ranks (each rank all of its experts), split over 2
// and sharded over the 2 left (EP 2 x FSDP 2), and under HSDP; plain FSDP
// of the same MoE, and tensor parallelism of its dense parts, alone, under
// FSDP and beside expert parallelism (EP 2 x TP 2). Losses within 1e-5, grad norms 1e-4, parameters
// 1e-4 (expect_close).
TEST(MoeExpertParallel, Ep2Ep4Ep2xFsdp2AndHsdpMatchOneProcessOverTwentySteps) {
  auto cfg = moe_config(llama_scratch("moe_eq"));
  const LlamaRun ref = train(cfg, 1);
  ASSERT_EQ(ref.losses.size(), 20u);
  EXPECT_LT(ref.losses.back(), ref.losses.front() - 0.05);
  expect_close(train(cfg, 2), ref, 1e-5, "FSDP 2, experts sharded as parameters");
  expect_close(train_ep(cfg, 2, 2), ref, 1e-5, "EP 2");
  expect_close(train_ep(cfg, 4, 4), ref, 1e-5, "EP 4");
  expect_close(train_ep(cfg, 4, 2), ref, 1e-5, "EP 2 x FSDP 2");
  expect_close(train_ep(cfg, 4, 2, 2), ref, 1e-5, "HSDP 2 x EP 2");
  // Tensor parallelism of the attention and the dense block, the MoE
  // blocks whole on both tensor-parallel ranks, alone, under FSDP 2 and
  // beside expert parallelism (EP 2 x TP 2: each tensor rank's experts
  // split over the 2 ranks of its shard axis). The q/k norms' gradients
  // are summed over the tensor axis (each rank normalises its own heads).
  auto tp = cfg;
  tp.parallel.tensor = 2;
  expect_close(train(tp, 2), ref, 1e-5, "TP 2");
  expect_close(train(tp, 4), ref, 1e-5, "FSDP 2 x TP 2");
  expect_close(train_ep(tp, 4, 2), ref, 1e-5, "EP 2 x TP 2");
  fs::remove_all(cfg.run.dir);
}

// A checkpoint of an expert-parallel run holds each expert under its
// global index: EP 2 x FSDP 2 resumes bit-exactly in its own layout, and
// within rounding as EP 4, at world 1 and as EP 2; a layout whose expert
// degree does not divide the experts is refused naming both keys.
TEST(MoeExpertParallel, CheckpointsLoadUnderEveryExpertLayout) {
  auto cfg = moe_config(llama_scratch("moe_ckpt"));
  const LlamaRun full = train_ep(cfg, 4, 2);
  auto stopped = cfg;
  stopped.run.dir = cfg.run.dir + "_stopped";
  stopped.train.stop_at = 10;
  stopped.checkpoint.interval = 5;
  train_ep(stopped, 4, 2);
  stopped.train.stop_at = 0;
  const LlamaRun resumed = train_ep(stopped, 4, 2);
  EXPECT_EQ(resumed.first_step, 10);
  ASSERT_EQ(resumed.losses.size(), 10u);
  for (size_t i = 0; i < 10; ++i) EXPECT_EQ(resumed.losses[i], full.losses[10 + i]) << "step " << 11 + i;
  for (auto [world, expert] : {std::pair{4, 4L}, std::pair{1, 1L}, std::pair{2, 2L}}) {
    auto other = cfg;
    other.run.dir = cfg.run.dir + "_as" + std::to_string(world) + "x" + std::to_string(expert);
    other.checkpoint.resume = stopped.run.dir + "/checkpoints/step_10";
    const LlamaRun r = train_ep(other, world, expert);
    ASSERT_EQ(r.losses.size(), 10u) << "world " << world;
    for (size_t i = 0; i < 10; ++i) {
      EXPECT_NEAR(r.losses[i], full.losses[10 + i], 1e-5 * full.losses[10 + i])
          << "world " << world << " expert " << expert << ", step " << 11 + i;
    }
    fs::remove_all(other.run.dir);
  }
  auto bad = cfg;
  bad.parallel.expert = 3;
  bad.parallel.shard = -1;
  try {
    framework::parallel::resolve(bad.parallel, 3);
    models::check_expert_parallel(bad.model, 3);
    ADD_FAILURE() << "parallel.expert 3 of 4 experts was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("parallel.expert (3) must divide model.moe.num_experts (4)"),
              std::string::npos) << e.what();
  }
  for (const auto& d : {cfg.run.dir, stopped.run.dir}) fs::remove_all(d);
}

namespace {

// Context parallelism (#72) on the llama_config sizes over 20 steps: each
// sequence (16 tokens) split over the context group.
framework::config::Config context_config(const std::string& dir) {
  auto c = llama_config(dir);
  c.train.steps = 20;
  return c;
}

LlamaRun train_cp(framework::config::Config cfg, int world, int64_t context,
                  framework::cp::LoadBalance balance = framework::cp::LoadBalance::kHeadTail) {
  cfg.parallel.context = context;
  cfg.parallel.context_load_balance = balance;
  return train(std::move(cfg), world, 1, -1);
}

// Losses within 1e-5 (relative) and every final parameter within 1e-5.
void expect_within_1e5(const LlamaRun& got, const LlamaRun& ref, const std::string& what) {
  ASSERT_EQ(got.losses.size(), ref.losses.size()) << what;
  for (size_t i = 0; i < ref.losses.size(); ++i) {
    EXPECT_NEAR(got.losses[i], ref.losses[i], 1e-5 * std::abs(ref.losses[i])) << what << ": loss of step " << i + 1;
  }
  ASSERT_EQ(got.params.size(), ref.params.size()) << what;
  for (size_t i = 0; i < ref.params.size(); ++i) {
    EXPECT_TRUE(torch::allclose(got.params[i], ref.params[i], 1e-5, 1e-5))
        << what << ": parameter " << i << " differs by " << (got.params[i] - ref.params[i]).abs().max().item<double>();
  }
}

}  // namespace

// Context parallelism against one process, fp32, 20 steps: CP 2 (world 2)
// and CP 2 x FSDP 2 (world 4: shard 4, context 2, two context groups
// reading different samples), with the head-tail split and without load
// balancing; RoPE at the tokens' true positions, ring attention over the
// group, the loss and token count summed over every rank once. Then CP 2 x
// TP 2 (world 4: each tensor rank's 2 query and 1 key/value heads over its
// own context ring, the ring's ranks 2 apart), and HSDP with the shard axis
// all context (world 4: replicate 2, shard 2, context 2; gradients
// all-reduced over the replicas).
TEST(LlamaContextParallel, Cp2Cp2xFsdp2Cp2xTp2AndHsdpMatchOneProcessOverTwentySteps) {
  auto cfg = context_config(llama_scratch("cp_eq"));
  const LlamaRun ref = train(cfg, 1);
  ASSERT_EQ(ref.losses.size(), 20u);
  EXPECT_LT(ref.losses.back(), ref.losses.front() - 0.05);
  expect_within_1e5(train_cp(cfg, 2, 2), ref, "CP 2, head-tail");
  expect_within_1e5(train_cp(cfg, 4, 2), ref, "CP 2 x FSDP 2, head-tail");
  expect_within_1e5(train_cp(cfg, 2, 2, framework::cp::LoadBalance::kNone), ref, "CP 2, no load balance");
  expect_within_1e5(train_cp(cfg, 4, 2, framework::cp::LoadBalance::kNone), ref, "CP 2 x FSDP 2, no load balance");
  auto tp = cfg;
  tp.parallel.tensor = 2;
  expect_within_1e5(train_cp(tp, 4, 2), ref, "CP 2 x TP 2, head-tail");
  auto hsdp = cfg;
  hsdp.parallel.context = 2;
  expect_within_1e5(train(hsdp, 4, /*replicate=*/2), ref, "HSDP: replicate 2 x (shard 2 = context 2)");
  fs::remove_all(cfg.run.dir);
}

// A mixture of experts under context parallelism against one process, fp32,
// 20 steps (moe_config: top-2 of 4 experts, a shared expert, the auxiliary
// loss per micro-batch of 3 sequences and the bias balancing): CP 2 (world
// 2) and CP 2 x EP 2 (world 4: shard 4 = context 2 x batch 2 = expert 2 x
// expert shard 2, each rank's tokens of its half-sequences sent to their
// experts). The auxiliary loss's expert shares are the whole micro-batch's
// (the loads summed over the context group), so the logged auxiliary loss,
// the losses and every parameter (the router's included) match.
TEST(MoeContextParallel, Cp2AndCp2xEp2MatchOneProcessOverTwentySteps) {
  auto cfg = moe_config(llama_scratch("moe_cp"));
  const LlamaRun ref = train(cfg, 1);
  ASSERT_EQ(ref.losses.size(), 20u);
  auto expect_aux = [&](const LlamaRun& got, const std::string& what) {
    ASSERT_EQ(got.aux_losses.size(), ref.aux_losses.size()) << what;
    for (size_t i = 0; i < ref.aux_losses.size(); ++i) {
      EXPECT_GT(ref.aux_losses[i], 0) << "step " << i + 1;
      EXPECT_NEAR(got.aux_losses[i], ref.aux_losses[i], 1e-6 * ref.aux_losses[i])
          << what << ": auxiliary loss of step " << i + 1;
    }
  };
  const LlamaRun cp2 = train_cp(cfg, 2, 2);
  expect_close(cp2, ref, 1e-5, "MoE CP 2");
  expect_aux(cp2, "MoE CP 2");
  auto ep = cfg;
  ep.parallel.expert = 2;
  const LlamaRun cp2ep2 = train_cp(ep, 4, 2);
  expect_close(cp2ep2, ref, 1e-5, "MoE CP 2 x EP 2");
  expect_aux(cp2ep2, "MoE CP 2 x EP 2");
  fs::remove_all(cfg.run.dir);
}

// Activation checkpointing recomputes each block's ring attention (its own
// autograd function, the ring run again in the recompute): bit-identical
// to CP 2 without it, and so within 1e-5 of one process.
TEST(LlamaContextParallel, ActivationCheckpointingRecomputesTheRingAttentionBitIdentically) {
  auto cfg = context_config(llama_scratch("cp_ac"));
  const LlamaRun plain = train_cp(cfg, 2, 2);
  auto ac = cfg;
  ac.model.activation_checkpointing = models::ActivationCheckpointing::kFull;
  const LlamaRun recomputed = train_cp(ac, 2, 2);
  expect_identical(recomputed, plain, "CP 2 with full activation checkpointing");
  fs::remove_all(cfg.run.dir);
}

// A checkpoint does not depend on the context degree (the parameters are
// sharded over the whole shard axis as without it): a CP 2 checkpoint
// resumes bit-exactly at CP 2, and within 1e-5 at world 1 and at CP 4
// (world 4: 8 chunks of 2 tokens).
TEST(LlamaContextParallel, ACp2CheckpointResumesAtWorldOneAndAtCp4) {
  auto cfg = context_config(llama_scratch("cp_ckpt"));
  const LlamaRun full = train_cp(cfg, 2, 2);
  auto stopped = cfg;
  stopped.run.dir = cfg.run.dir + "_stopped";
  stopped.train.stop_at = 10;
  stopped.checkpoint.interval = 5;
  train_cp(stopped, 2, 2);
  stopped.train.stop_at = 0;
  const LlamaRun resumed = train_cp(stopped, 2, 2);
  EXPECT_EQ(resumed.first_step, 10);
  ASSERT_EQ(resumed.losses.size(), 10u);
  for (size_t i = 0; i < 10; ++i) EXPECT_EQ(resumed.losses[i], full.losses[10 + i]) << "step " << 11 + i;
  for (auto [world, context] : {std::pair{1, 1L}, std::pair{4, 4L}}) {
    auto other = cfg;
    other.run.dir = cfg.run.dir + "_as" + std::to_string(world) + "x" + std::to_string(context);
    other.checkpoint.resume = stopped.run.dir + "/checkpoints/step_10";
    const LlamaRun r = train_cp(other, world, context);
    EXPECT_EQ(r.first_step, 10);
    ASSERT_EQ(r.losses.size(), 10u) << "world " << world;
    for (size_t i = 0; i < 10; ++i) {
      EXPECT_NEAR(r.losses[i], full.losses[10 + i], 1e-5 * full.losses[10 + i])
          << "world " << world << " context " << context << ", step " << 11 + i;
    }
    ASSERT_EQ(r.params.size(), full.params.size());
    for (size_t i = 0; i < full.params.size(); ++i) {
      EXPECT_TRUE(torch::allclose(r.params[i], full.params[i], 1e-5, 1e-5))
          << "world " << world << " context " << context << ": parameter " << i;
    }
    fs::remove_all(other.run.dir);
  }
  for (const auto& d : {cfg.run.dir, stopped.run.dir}) fs::remove_all(d);
}

// The dry run's estimate of a rank's activations under context
// parallelism (train --dry-run): every activation kept is per token, so
// with the ranks over the batch unchanged, C ranks per sequence keep 1 / C
// each; a C whose chunks model.seq_len does not split into is marked.
TEST(LlamaContextParallel, TheDryRunEstimatesActivationsPerRankForC1248) {
  auto cfg = context_config(llama_scratch("cp_dry"));
  cfg.model.seq_len = 24;  // head-tail: 2, 4, 8 chunks split it, 16 do not
  cfg.train.micro_batch_size = 3;
  cfg.model.activation_checkpointing = models::ActivationCheckpointing::kSelective;
  cfg.model.activation_checkpointing_every = 2;
  const auto rows = framework::train::activations_by_context(cfg, 2);
  ASSERT_EQ(rows.size(), 4u);
  const double one = rows[0].bytes;
  EXPECT_EQ(rows[0].context, 1);
  EXPECT_GT(one, 0);
  EXPECT_EQ(framework::train::estimate_memory(cfg, 2).activations, one);  // C = 1 is the configured run
  for (size_t i = 1; i < 3; ++i) {
    EXPECT_TRUE(rows[i].splits) << rows[i].context;
    EXPECT_DOUBLE_EQ(rows[i].bytes, one / static_cast<double>(rows[i].context)) << rows[i].context;
  }
  EXPECT_EQ(rows[3].context, 8);
  EXPECT_FALSE(rows[3].splits);
  // The configured CP 2 at world 4 (the same 2 ranks over the batch) is
  // the table's C = 2, and its table the same as world 2's.
  auto cp2 = cfg;
  cp2.parallel.context = 2;
  EXPECT_DOUBLE_EQ(framework::train::estimate_memory(cp2, 4).activations, one / 2);
  const auto again = framework::train::activations_by_context(cp2, 4);
  for (size_t i = 0; i < 3; ++i) EXPECT_DOUBLE_EQ(again[i].bytes, rows[i].bytes) << rows[i].context;
}
