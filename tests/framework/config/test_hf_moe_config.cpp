// A llama mixture of experts in Hugging Face's config.json, out and in
// (models/hf_moe.cpp): Qwen3MoeForCausalLM (q/k norm) and MixtralForCausalLM;
// an MoE that neither format expresses and the config.json fields we do not
// take are refused in one line naming the key or field; the run adapter's
// renames split each MoE layer's stacked experts. Torch-free. (The weights
// themselves: LlamaMoeHuggingFace in tests/framework/train/test_llama.cpp,
// TrainCli.MoeHuggingFace* and models.LlamaMatchesPyTorch's hf check.)
#include "framework/config/config.h"
#include "framework/config/run_items.h"
#include "models/hf_adapter.h"
#include "support/paths.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

namespace framework::config {
namespace {

namespace fs = std::filesystem;

// 3 layers, 4 experts of width 24, the first layer dense (d_ff 48), q/k norm.
models::ModelOptions qwen3_moe_like() {
  models::ModelOptions o;
  o.kind = "llama";
  o.vocab_size = 64;
  o.seq_len = 16;
  o.d_model = 32;
  o.n_layers = 3;
  o.n_heads = 4;
  o.n_kv_heads = 2;
  o.d_ff = 48;
  o.tie_weights = false;
  o.norm_eps = 1e-6;
  o.rope_theta = 1e6;
  o.qk_norm = true;
  o.moe.num_experts = 4;
  o.moe.top_k = 2;
  o.moe.d_ff = 24;
  o.moe.route_norm = false;
  o.moe.first_dense_layers = 1;
  o.moe.aux_loss_coef = 0.01;
  return o;
}

models::ModelOptions mixtral_like() {
  models::ModelOptions o = qwen3_moe_like();
  o.qk_norm = false;
  o.moe.route_norm = true;
  o.moe.first_dense_layers = 0;
  o.moe.aux_loss_coef = 0;
  return o;
}

std::string config_json(const models::ModelOptions& o) {
  return models::find_hf_adapter("llama")->config_json(o, "bfloat16");
}

// The message of the std::invalid_argument `f` throws ("" when none).
template <typename F>
std::string refusal(F f) {
  try {
    f();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

fs::path scratch(const std::string& tag) {
  const fs::path dir = fs::path(testing_support::binary_dir()) / "test_config_tmp" / tag;
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

// ConfigError's message for model.init_from a directory holding `json`.
std::string init_from_error(const fs::path& dir, const std::string& json) {
  std::ofstream(dir / "config.json") << json;
  try {
    parse_config("model:\n  kind: llama\n  init_from: " + dir.string() + "\n", "test.yaml");
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

void expect_same_moe(const models::ModelOptions& got, const models::ModelOptions& want, const std::string& what) {
  EXPECT_EQ(got.kind, "llama") << what;
  EXPECT_EQ(got.d_model, want.d_model) << what;
  EXPECT_EQ(got.n_layers, want.n_layers) << what;
  EXPECT_EQ(got.n_heads, want.n_heads) << what;
  EXPECT_EQ(got.n_kv_heads, want.n_kv_heads) << what;
  EXPECT_EQ(got.head_dim, want.head_dim) << what;
  EXPECT_EQ(got.vocab_size, want.vocab_size) << what;
  EXPECT_EQ(got.norm_eps, want.norm_eps) << what;
  EXPECT_EQ(got.rope_theta, want.rope_theta) << what;
  EXPECT_EQ(got.tie_weights, want.tie_weights) << what;
  EXPECT_EQ(got.qk_norm, want.qk_norm) << what;
  EXPECT_EQ(got.moe.num_experts, want.moe.num_experts) << what;
  EXPECT_EQ(got.moe.top_k, want.moe.top_k) << what;
  EXPECT_EQ(models::moe_expert_d_ff(got), models::moe_expert_d_ff(want)) << what;
  EXPECT_EQ(got.moe.score_func, models::MoeScoreFunc::kSoftmax) << what;
  EXPECT_EQ(got.moe.route_norm, want.moe.route_norm) << what;
  EXPECT_EQ(got.moe.route_scale, 1.0) << what;
  EXPECT_EQ(got.moe.num_shared_experts, 0) << what;
  EXPECT_EQ(got.moe.first_dense_layers, want.moe.first_dense_layers) << what;
  EXPECT_EQ(got.moe.aux_loss_coef, want.moe.aux_loss_coef) << what;
  EXPECT_EQ(got.moe.load_balance_rate, 0.0) << what;
}

TEST(HfMoeConfig, Qwen3MoeConfigJsonHasItsFieldsAndReadsBackAsTheSameModel) {
  const models::ModelOptions o = qwen3_moe_like();
  const std::string text = config_json(o);
  const nlohmann::json j = nlohmann::json::parse(text);
  EXPECT_EQ(j["architectures"], nlohmann::json({"Qwen3MoeForCausalLM"}));
  EXPECT_EQ(j["model_type"], "qwen3_moe");
  EXPECT_EQ(j["hidden_size"], 32);
  EXPECT_EQ(j["intermediate_size"], 48);  // the dense layer's MLP
  EXPECT_EQ(j["moe_intermediate_size"], 24);
  EXPECT_EQ(j["num_experts"], 4);
  EXPECT_EQ(j["num_experts_per_tok"], 2);
  EXPECT_EQ(j["norm_topk_prob"], false);
  EXPECT_EQ(j["decoder_sparse_step"], 1);
  EXPECT_EQ(j["mlp_only_layers"], nlohmann::json({0}));
  EXPECT_EQ(j["head_dim"], 8);
  EXPECT_EQ(j["num_hidden_layers"], 3);
  EXPECT_EQ(j["num_key_value_heads"], 2);
  EXPECT_EQ(j["router_aux_loss_coef"], 0.01);
  EXPECT_EQ(j["output_router_logits"], true);
  EXPECT_EQ(j["use_sliding_window"], false);
  EXPECT_EQ(j["rms_norm_eps"], 1e-6);
  EXPECT_EQ(j["rope_theta"], 1e6);
  EXPECT_EQ(j["tie_word_embeddings"], false);
  EXPECT_EQ(j["torch_dtype"], "bfloat16");
  EXPECT_FALSE(j.contains("mlp_bias"));
  expect_same_moe(hf_model_options(text, "qwen3"), o, "qwen3_moe");
}

TEST(HfMoeConfig, MixtralConfigJsonHasItsFieldsAndReadsBackAsTheSameModel) {
  const models::ModelOptions o = mixtral_like();
  const std::string text = config_json(o);
  const nlohmann::json j = nlohmann::json::parse(text);
  EXPECT_EQ(j["architectures"], nlohmann::json({"MixtralForCausalLM"}));
  EXPECT_EQ(j["model_type"], "mixtral");
  EXPECT_EQ(j["intermediate_size"], 24);  // the experts' width
  EXPECT_EQ(j["num_local_experts"], 4);
  EXPECT_EQ(j["num_experts_per_tok"], 2);
  EXPECT_TRUE(j["sliding_window"].is_null());
  EXPECT_EQ(j["router_aux_loss_coef"], 0.0);
  EXPECT_EQ(j["output_router_logits"], false);
  EXPECT_FALSE(j.contains("num_experts"));
  EXPECT_FALSE(j.contains("mlp_only_layers"));
  expect_same_moe(hf_model_options(text, "mixtral"), o, "mixtral");
}

// Qwen3-30B-A3B's attention: 32 heads of 128 over hidden_size 2048, not
// 2048 / 32. config.json's head_dim becomes model.head_dim and goes back out;
// one that is hidden_size / num_attention_heads is the default, 0.
TEST(HfMoeConfig, AHeadDimApartFromHiddenOverHeadsImportsAndExportsBack) {
  nlohmann::json j = nlohmann::json::parse(config_json(qwen3_moe_like()));
  j["head_dim"] = 16;  // hidden_size 32, 4 heads: 8 by division
  models::ModelOptions o = hf_model_options(j.dump(), "qwen3 head_dim 16");
  EXPECT_EQ(o.head_dim, 16);
  EXPECT_EQ(models::llama_head_dim(o), 16);
  EXPECT_EQ(models::llama_attention_width(o), 64);
  EXPECT_EQ(nlohmann::json::parse(config_json(o))["head_dim"], 16);
  models::ModelOptions want = qwen3_moe_like();
  want.head_dim = 16;
  expect_same_moe(hf_model_options(config_json(o), "back"), want, "qwen3 head_dim 16 back");

  // hidden_size not divisible by num_attention_heads: only head_dim gives the width.
  j["hidden_size"] = 30;
  EXPECT_EQ(hf_model_options(j.dump(), "hidden 30").head_dim, 16);
  j["hidden_size"] = 32;
  j["head_dim"] = 8;
  EXPECT_EQ(hf_model_options(j.dump(), "head_dim 8").head_dim, 0);
  j.erase("head_dim");
  EXPECT_EQ(hf_model_options(j.dump(), "no head_dim").head_dim, 0);

  // The dense llama's LlamaForCausalLM takes it the same way.
  models::ModelOptions dense = qwen3_moe_like();
  dense.moe.num_experts = 0;
  dense.qk_norm = false;
  dense.head_dim = 12;
  const std::string dense_json = config_json(dense);
  EXPECT_EQ(nlohmann::json::parse(dense_json)["head_dim"], 12);
  EXPECT_EQ(hf_model_options(dense_json, "llama head_dim 12").head_dim, 12);
}

// Hugging Face trains with router_aux_loss_coef only when
// output_router_logits is set (Qwen3-30B-A3B ships 0.001 and false).
TEST(HfMoeConfig, TheAuxLossCoefficientCountsOnlyWithOutputRouterLogits) {
  nlohmann::json j = nlohmann::json::parse(config_json(qwen3_moe_like()));
  j["router_aux_loss_coef"] = 0.001;
  j["output_router_logits"] = false;
  EXPECT_EQ(hf_model_options(j.dump(), "off").moe.aux_loss_coef, 0.0);
  j["output_router_logits"] = true;
  EXPECT_EQ(hf_model_options(j.dump(), "on").moe.aux_loss_coef, 0.001);
  j.erase("router_aux_loss_coef");  // Hugging Face's default
  EXPECT_EQ(hf_model_options(j.dump(), "default").moe.aux_loss_coef, 0.001);
}

TEST(HfMoeConfig, AnMoeNeitherFormatExpressesIsRefusedInOneLineNamingItsKey) {
  struct Case {
    std::string key;
    std::function<void(models::ModelOptions&)> set;
    bool qk_norm;
  };
  const std::vector<Case> cases = {
      {"model.moe.score_func", [](models::ModelOptions& o) { o.moe.score_func = models::MoeScoreFunc::kSigmoid; }, true},
      {"model.moe.route_scale", [](models::ModelOptions& o) { o.moe.route_scale = 2.5; }, false},
      {"model.moe.num_shared_experts", [](models::ModelOptions& o) { o.moe.num_shared_experts = 1; }, true},
      {"model.moe.load_balance_rate", [](models::ModelOptions& o) { o.moe.load_balance_rate = 1e-3; }, false},
      // Mixtral's alone (without q/k norm): Qwen3-MoE expresses both
      {"model.moe.route_norm", [](models::ModelOptions& o) { o.moe.route_norm = false; }, false},
      {"model.moe.first_dense_layers", [](models::ModelOptions& o) { o.moe.first_dense_layers = 1; }, false},
  };
  for (const Case& c : cases) {
    models::ModelOptions o = c.qk_norm ? qwen3_moe_like() : mixtral_like();
    c.set(o);
    const std::string e = refusal([&] { config_json(o); });
    EXPECT_EQ(e.rfind(c.key + " is ", 0), 0u) << c.key << ": " << e;
    EXPECT_EQ(e.find('\n'), std::string::npos) << e;
  }
  models::ModelOptions dense = mixtral_like();
  dense.moe.num_experts = 0;
  dense.qk_norm = true;
  EXPECT_EQ(refusal([&] { config_json(dense); }).rfind("model.qk_norm is true", 0), 0u);
}

TEST(HfMoeConfig, UnsupportedConfigJsonFieldsAreRefusedInOneLineNamingThem) {
  const fs::path dir = scratch("hf_moe_refusals");
  const nlohmann::json qwen = nlohmann::json::parse(config_json(qwen3_moe_like()));
  const nlohmann::json mixtral = nlohmann::json::parse(config_json(mixtral_like()));
  struct Case {
    nlohmann::json base;
    std::string field;
    nlohmann::json value;
  };
  const std::vector<Case> cases = {
      {qwen, "decoder_sparse_step", 2},
      {qwen, "mlp_only_layers", nlohmann::json({1})},
      {qwen, "mlp_only_layers", nlohmann::json({0, 2})},
      {qwen, "head_dim", 0},
      {qwen, "head_dim", "wide"},
      {qwen, "use_sliding_window", true},
      {qwen, "attention_bias", true},
      {mixtral, "sliding_window", 4096},
      {mixtral, "router_jitter_noise", 0.01},
      {mixtral, "hidden_act", "gelu"},
  };
  for (const Case& c : cases) {
    nlohmann::json j = c.base;
    j[c.field] = c.value;
    const std::string e = init_from_error(dir, j.dump());
    const std::string what = c.field + " = " + c.value.dump();
    EXPECT_EQ(e.rfind("model.init_from: " + (dir / "config.json").string() + ": ", 0), 0u) << what << ": " << e;
    EXPECT_NE(e.find(c.field), std::string::npos) << what << ": " << e;
    EXPECT_EQ(e.find('\n'), std::string::npos) << e;
  }
  // A key the config sets to another value than config.json: both named.
  std::ofstream(dir / "config.json") << qwen.dump();
  try {
    parse_config("model:\n  kind: llama\n  moe:\n    num_experts: 8\n  init_from: " + dir.string() + "\n", "x.yaml");
    FAIL() << "expected a disagreement";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("model.moe.num_experts (8, x.yaml:4) disagrees with num_experts 4 in " +
                                         (dir / "config.json").string()),
              std::string::npos)
        << e.what();
  }
  fs::remove_all(dir);
}

// The names an HF export writes and an import reads: each MoE layer's three
// stacked expert tensors split into one per expert; Mixtral's router and
// experts under block_sparse_moe, w1/w3/w2 for gate/up/down.
TEST(RunAdapter, HfRenamesSplitEachMoeLayersExpertsIntoHuggingFacesNames) {
  const std::shared_ptr<const checkpoint::RunAdapter> run = make_run_adapter();
  const std::vector<checkpoint::RenamedTensor> qwen = run->hf_renames(config_json(qwen3_moe_like()), "q");
  ASSERT_EQ(qwen.size(), 6u);  // layers 1 and 2 (0 is dense) x gate, up, down
  EXPECT_EQ(qwen[0].name, "model.layers.1.mlp.experts.gate_proj.weight");
  EXPECT_TRUE(qwen[0].split);
  EXPECT_EQ(qwen[0].parts, (std::vector<std::string>{
                               "model.layers.1.mlp.experts.0.gate_proj.weight", "model.layers.1.mlp.experts.1.gate_proj.weight",
                               "model.layers.1.mlp.experts.2.gate_proj.weight", "model.layers.1.mlp.experts.3.gate_proj.weight"}));
  EXPECT_EQ(qwen[5].name, "model.layers.2.mlp.experts.down_proj.weight");
  EXPECT_EQ(qwen[5].parts.back(), "model.layers.2.mlp.experts.3.down_proj.weight");

  const std::vector<checkpoint::RenamedTensor> mixtral = run->hf_renames(config_json(mixtral_like()), "x");
  ASSERT_EQ(mixtral.size(), 12u);  // 3 layers x router, gate, up, down
  EXPECT_EQ(mixtral[0].name, "model.layers.0.mlp.gate.weight");
  EXPECT_FALSE(mixtral[0].split);
  EXPECT_EQ(mixtral[0].parts, std::vector<std::string>{"model.layers.0.block_sparse_moe.gate.weight"});
  const std::vector<std::pair<std::string, std::string>> projections = {
      {"gate_proj", "w1"}, {"up_proj", "w3"}, {"down_proj", "w2"}};
  for (size_t p = 0; p < 3; ++p) {
    EXPECT_EQ(mixtral[1 + p].name, "model.layers.0.mlp.experts." + projections[p].first + ".weight");
    EXPECT_EQ(mixtral[1 + p].parts.at(2), "model.layers.0.block_sparse_moe.experts.2." + projections[p].second + ".weight");
  }

  models::ModelOptions dense = mixtral_like();
  dense.moe.num_experts = 0;
  EXPECT_TRUE(run->hf_renames(config_json(dense), "dense").empty());
  // A config.json no adapter reads (ckpt import-hf of another model) keeps its names.
  EXPECT_TRUE(run->hf_renames(R"({"model_type": "gpt2"})", "gpt2").empty());
}

}  // namespace
}  // namespace framework::config
