// The mixture-of-experts block (models/moe.h) on its own: the grouped
// experts against a token-by-token loop, the routing rules, the auxiliary
// loss's gradient through activation checkpointing, the bias update, the
// sizes. The model against an independent PyTorch one is
// models.LlamaMatchesPyTorch's MoE cases (test_llama_parity.py).
#include "models/activation_checkpoint.h"
#include "models/llama.h"
#include "models/model_spec.h"
#include "models/moe.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>

namespace models {
namespace {

ModelOptions moe_options() {
  ModelOptions o;
  o.kind = "llama";
  o.vocab_size = 29;
  o.seq_len = 8;
  o.d_model = 16;
  o.n_layers = 3;
  o.n_heads = 4;
  o.n_kv_heads = 2;
  o.d_ff = 24;
  o.tie_weights = false;
  o.moe.num_experts = 6;
  o.moe.top_k = 2;
  o.moe.d_ff = 12;
  return o;
}

std::shared_ptr<LayeredModelImpl> moe_model(const ModelOptions& o, uint64_t seed = 3) {
  torch::manual_seed(seed);
  return make_model(o);
}

// The MoE layer's output for rows x, computed token by token and expert by
// expert from its parameters, in double.
torch::Tensor loop_reference(MoeFeedForwardImpl& layer, const torch::Tensor& x) {
  auto params = layer.named_parameters();
  auto buffers = layer.named_buffers();
  const MoeOptions& m = layer.options();
  const torch::Tensor gate = params["gate.weight"].to(torch::kDouble);
  const torch::Tensor g = params["experts.gate_proj.weight"].to(torch::kDouble);
  const torch::Tensor u = params["experts.up_proj.weight"].to(torch::kDouble);
  const torch::Tensor d = params["experts.down_proj.weight"].to(torch::kDouble);
  const torch::Tensor* bias = buffers.find("gate.e_score_correction_bias");
  const torch::Tensor rows = x.reshape({-1, x.size(-1)}).to(torch::kDouble);
  torch::Tensor out = torch::zeros_like(rows);
  for (int64_t t = 0; t < rows.size(0); ++t) {
    const torch::Tensor logits = torch::mv(gate, rows[t]);
    const torch::Tensor scores = m.score_func == MoeScoreFunc::kSoftmax ? torch::softmax(logits, 0) : torch::sigmoid(logits);
    const torch::Tensor pick = bias ? scores + bias->to(torch::kDouble) : scores;
    const torch::Tensor chosen = std::get<1>(torch::topk(pick, m.top_k));
    torch::Tensor w = scores.index_select(0, chosen);
    if (m.route_norm) w = w / w.sum();
    w = w * m.route_scale;
    for (int64_t j = 0; j < m.top_k; ++j) {
      const int64_t e = chosen[j].item<int64_t>();
      const torch::Tensor h = torch::silu(torch::mv(g[e], rows[t])) * torch::mv(u[e], rows[t]);
      out[t] += w[j] * torch::mv(d[e], h);
    }
  }
  return out.view(x.sizes());
}

MoeFeedForwardImpl& first_moe(LayeredModelImpl& model) {
  auto layers = moe_layers(model);
  EXPECT_FALSE(layers.empty());
  return *layers.front();
}

TEST(MixtureOfExperts, GroupedExpertsEqualATokenByTokenLoopForEachRouting) {
  for (auto score : {MoeScoreFunc::kSoftmax, MoeScoreFunc::kSigmoid}) {
    for (bool norm : {false, true}) {
      ModelOptions o = moe_options();
      o.moe.score_func = score;
      o.moe.route_norm = norm;
      o.moe.route_scale = norm ? 1.0 : 2.5;
      o.moe.load_balance_rate = score == MoeScoreFunc::kSigmoid ? 0.01 : 0.0;
      auto model = moe_model(o);
      MoeFeedForwardImpl& layer = first_moe(*model);
      if (o.moe.load_balance_rate > 0) {
        // A bias that changes the choice: expert 0 always among the top k.
        layer.named_buffers()["gate.e_score_correction_bias"].fill_(0).index_put_({0}, 10.0);
      }
      torch::NoGradGuard no_grad;
      torch::Tensor x = torch::randn({3, 5, o.d_model});
      torch::Tensor ours = layer.forward(x);
      torch::Tensor loop = loop_reference(layer, x);
      EXPECT_LT((ours.to(torch::kDouble) - loop).abs().max().item<double>(), 1e-5)
          << to_string(score) << " route_norm " << norm;
      if (o.moe.load_balance_rate > 0) {
        EXPECT_TRUE((layer.last_choices() == 0).any(1).all().item<bool>()) << "the bias must steer the choice";
      }
    }
  }
}

// Experts that receive no row still give every weight a (zero) gradient
// and pass one back to their (empty) input: under expert parallelism that
// input came by all-to-all, whose backward every rank of the expert group
// must run, also one whose experts got no token (the bench's EP 4 run
// where the router had collapsed onto other ranks' experts hung Gloo).
TEST(MixtureOfExperts, ExpertsWithoutRowsStillReachTheirWeightsAndTheirInput) {
  torch::manual_seed(5);
  GroupedExperts experts(2, 16, 12, /*materialize=*/true);
  torch::Tensor rows = torch::randn({0, 16}, torch::requires_grad());
  torch::Tensor out = experts->forward(rows, {0, 0});
  EXPECT_EQ(out.sizes(), (std::vector<int64_t>{0, 16}));
  std::vector<torch::Tensor> inputs = {rows, experts->gate_proj->weight, experts->up_proj->weight,
                                       experts->down_proj->weight};
  // Throws ("not used in the graph") for an input the result does not reach.
  const auto grads = torch::autograd::grad({out.sum()}, inputs);
  ASSERT_EQ(grads.size(), inputs.size());
  for (size_t i = 0; i < grads.size(); ++i) {
    ASSERT_TRUE(grads[i].defined()) << i;
    EXPECT_EQ(grads[i].sizes(), inputs[i].sizes()) << i;
    EXPECT_EQ(grads[i].abs().sum().item<double>(), 0.0) << i;
  }
}

TEST(MixtureOfExperts, FirstDenseLayersSharedExpertsAndQkNormHaveTheirParameters) {
  ModelOptions o = moe_options();
  o.moe.first_dense_layers = 1;
  o.moe.num_shared_experts = 2;
  o.moe.load_balance_rate = 0.001;
  o.qk_norm = true;
  auto model = moe_model(o);
  auto params = model->named_parameters();
  EXPECT_TRUE(params.contains("model.layers.0.mlp.gate_proj.weight"));
  EXPECT_FALSE(params.contains("model.layers.0.mlp.gate.weight"));
  EXPECT_EQ(params["model.layers.1.mlp.gate.weight"].sizes(), (std::vector<int64_t>{6, 16}));
  EXPECT_EQ(params["model.layers.1.mlp.experts.gate_proj.weight"].sizes(), (std::vector<int64_t>{6, 12, 16}));
  EXPECT_EQ(params["model.layers.2.mlp.experts.down_proj.weight"].sizes(), (std::vector<int64_t>{6, 16, 12}));
  EXPECT_EQ(params["model.layers.1.mlp.shared_experts.up_proj.weight"].sizes(), (std::vector<int64_t>{24, 16}));
  EXPECT_EQ(params["model.layers.0.self_attn.q_norm.weight"].sizes(), (std::vector<int64_t>{4}));
  EXPECT_TRUE(model->named_buffers().contains("model.layers.2.mlp.gate.e_score_correction_bias"));
  // The size the memory estimate and the banner use is the model's.
  int64_t count = 0;
  for (const auto& p : model->parameters()) count += p.numel();
  const ModelSize size = model_size(o);
  EXPECT_EQ(static_cast<int64_t>(size.parameters), count);
  // Active: the router, 2 of 6 experts and the shared ones per MoE block.
  const double expert = 3.0 * 16 * 12;
  EXPECT_EQ(size.parameters - size.active_parameters, 2 * (6 - 2) * expert);
}

// model.head_dim apart from d_model / n_heads (Qwen3-MoE's released models):
// q/k/v/o and the q/k norms take its width, and the size the memory
// estimate, the banner and MFU use counts them so.
TEST(MixtureOfExperts, AHeadDimOfItsOwnSizesTheAttentionAndItsCount) {
  ModelOptions o = moe_options();
  o.qk_norm = true;
  o.head_dim = 6;  // d_model 16 / 4 heads would be 4
  auto model = moe_model(o);
  auto params = model->named_parameters();
  EXPECT_EQ(params["model.layers.0.self_attn.q_proj.weight"].sizes(), (std::vector<int64_t>{24, 16}));
  EXPECT_EQ(params["model.layers.0.self_attn.k_proj.weight"].sizes(), (std::vector<int64_t>{12, 16}));
  EXPECT_EQ(params["model.layers.0.self_attn.v_proj.weight"].sizes(), (std::vector<int64_t>{12, 16}));
  EXPECT_EQ(params["model.layers.0.self_attn.o_proj.weight"].sizes(), (std::vector<int64_t>{16, 24}));
  EXPECT_EQ(params["model.layers.0.self_attn.q_norm.weight"].sizes(), (std::vector<int64_t>{6}));
  int64_t count = 0;
  for (const auto& p : model->parameters()) count += p.numel();
  EXPECT_EQ(static_cast<int64_t>(model_size(o).parameters), count);
  torch::Tensor tokens = torch::randint(o.vocab_size, {2, o.seq_len}, torch::kLong);
  EXPECT_EQ(model->forward(tokens).sizes(), (std::vector<int64_t>{2, o.seq_len, o.vocab_size}));

  // Qwen3-30B-A3B (config.json): 30.5B parameters, 3.3B active, as released.
  ModelOptions q;
  q.kind = "llama";
  q.vocab_size = 151936;
  q.seq_len = 4096;
  q.d_model = 2048;
  q.n_layers = 48;
  q.n_heads = 32;
  q.n_kv_heads = 4;
  q.head_dim = 128;
  q.d_ff = 6144;
  q.tie_weights = false;
  q.qk_norm = true;
  q.moe.num_experts = 128;
  q.moe.top_k = 8;
  q.moe.d_ff = 768;
  const ModelSize qwen = model_size(q);
  EXPECT_NEAR(qwen.parameters / 1e9, 30.53, 0.01);
  EXPECT_NEAR(qwen.active_parameters / 1e9, 3.35, 0.01);
}

TEST(MixtureOfExperts, AuxiliaryLossReachesTheRouterAlsoThroughActivationCheckpointing) {
  ModelOptions o = moe_options();
  o.moe.aux_loss_coef = 0.5;
  torch::Tensor tokens = torch::randint(o.vocab_size, {2, o.seq_len}, torch::kLong);
  auto grads = [&](ActivationCheckpointing ac, double coef) {
    ModelOptions p = o;
    p.moe.aux_loss_coef = coef;
    auto model = moe_model(p);
    model->set_activation_checkpointing(ac, 1);
    model->forward(tokens).sum().backward();
    return model->named_parameters()["model.layers.1.mlp.gate.weight"].grad().clone();
  };
  const torch::Tensor plain = grads(ActivationCheckpointing::kNone, 0.5);
  const torch::Tensor recomputed = grads(ActivationCheckpointing::kFull, 0.5);
  const torch::Tensor without = grads(ActivationCheckpointing::kNone, 0.0);
  EXPECT_TRUE(torch::equal(plain, recomputed));
  EXPECT_GT((plain - without).abs().max().item<double>(), 1e-4) << "the aux loss must change the router's gradient";
}

TEST(MixtureOfExperts, StatsCountEachTrainingForwardOnceAndTheBiasMovesTowardsTheMeanLoad) {
  ModelOptions o = moe_options();
  o.moe.load_balance_rate = 0.1;
  auto model = moe_model(o);
  model->set_activation_checkpointing(ActivationCheckpointing::kFull, 1);
  torch::Tensor tokens = torch::randint(o.vocab_size, {2, o.seq_len}, torch::kLong);
  model->forward(tokens).sum().backward();  // the backward recomputes: not counted again
  MoeFeedForwardImpl& layer = first_moe(*model);
  MoeLayerStats st = layer.take_stats();
  EXPECT_EQ(st.loads.sum().item<double>(), 2.0 * o.seq_len * o.moe.top_k);
  {
    torch::NoGradGuard no_grad;
    model->eval();
    model->forward(tokens);  // evaluation: not counted
    model->train();
    model->forward(tokens);  // no backward to come (a probe): not counted
  }
  EXPECT_EQ(layer.take_stats().loads.sum().item<double>(), 0.0);
  torch::Tensor loads = torch::tensor({10.0, 0.0, 2.0, 2.0, 2.0, 8.0}, torch::kDouble);
  layer.update_bias(loads);
  torch::Tensor bias = layer.named_buffers()["gate.e_score_correction_bias"];
  // sign(mean 4 - load) = -1, 1, 1, 1, 1, -1, centred: mean 1/3.
  torch::Tensor expected = 0.1 * torch::tensor({-1.0, 1.0, 1.0, 1.0, 1.0, -1.0}) - 0.1 / 3;
  EXPECT_LT((bias - expected).abs().max().item<double>(), 1e-6) << bias;
}

TEST(MixtureOfExperts, BadKeysAreRefusedNamingThem) {
  auto refusal = [](const ModelOptions& o) -> std::string {
    try {
      check_model_options(o);
      check_lora_support(o);
    } catch (const std::invalid_argument& e) {
      return e.what();
    }
    return "";
  };
  ModelOptions o = moe_options();
  o.moe.top_k = 7;
  EXPECT_NE(refusal(o).find("model.moe.top_k (7) must be in [1, model.moe.num_experts (6)]"), std::string::npos)
      << refusal(o);
  o = moe_options();
  o.moe.first_dense_layers = 3;
  EXPECT_NE(refusal(o).find("model.moe.first_dense_layers (3)"), std::string::npos) << refusal(o);
  o = moe_options();
  o.lora.rank = 4;
  o.lora.targets = "q_proj,gate_proj";
  EXPECT_NE(refusal(o).find("model.lora.targets names gate_proj with model.moe.num_experts 6"), std::string::npos)
      << refusal(o);
  // Tensor and pipeline parallelism of a mixture of experts (with q/k
  // norm) are accepted (test_llama.cpp and test_pipeline.cpp train them).
  o = moe_options();
  o.qk_norm = true;
  EXPECT_NO_THROW(check_tensor_parallel_plan(o, 2));
  EXPECT_NO_THROW(check_pipeline_support(o, 2));
}

}  // namespace
}  // namespace models
