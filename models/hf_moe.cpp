// The llama's mixture of experts in Hugging Face's formats (models/hf_adapter.h,
// docs/moe.md "Hugging Face in and out"): Qwen3MoeForCausalLM for a model
// with q/k norm, MixtralForCausalLM without; the dispatch between them and
// LlamaForCausalLM. Each format's config.json is LlamaForCausalLM's fields
// (llama_config_json of the model's dense view, read_llama_config_json)
// plus its own.
#include "models/hf_adapter.h"

#include <nlohmann/json.hpp>

#include <sstream>
#include <stdexcept>

namespace models {

namespace {

[[noreturn]] void refuse_moe(const std::string& what) { throw std::invalid_argument(what); }

std::string number_text(double v) {
  std::ostringstream out;
  out << v;
  return out.str();
}

// What neither format can express: a router other than theirs (softmax
// over the experts, the top k weighed by their scores, no bias), or shared
// experts.
void check_expressible(const MoeOptions& m) {
  const std::string both = "Qwen3MoeForCausalLM and MixtralForCausalLM";
  if (m.score_func != MoeScoreFunc::kSoftmax) {
    refuse_moe(std::string("model.moe.score_func is ") + to_string(m.score_func) + ": " + both +
               " route by a softmax over the experts");
  }
  if (m.route_scale != 1.0) {
    refuse_moe("model.moe.route_scale is " + number_text(m.route_scale) + ": " + both +
               " do not scale the routed output");
  }
  if (m.num_shared_experts > 0) {
    refuse_moe("model.moe.num_shared_experts is " + std::to_string(m.num_shared_experts) + ": " + both +
               " have no shared experts");
  }
  if (m.load_balance_rate > 0) {
    refuse_moe("model.moe.load_balance_rate is " + number_text(m.load_balance_rate) + ": " + both +
               " have no balancing bias (e_score_correction_bias)");
  }
}

// LlamaForCausalLM's config.json of the model without its mixture of
// experts and q/k norm (the fields the formats share), as JSON.
nlohmann::json dense_fields(const ModelOptions& o, const std::string& torch_dtype) {
  ModelOptions dense = o;
  dense.moe = MoeOptions{};
  dense.qk_norm = false;
  nlohmann::json j = nlohmann::json::parse(llama_config_json(dense, torch_dtype));
  j.erase("mlp_bias");  // LlamaForCausalLM's alone
  return j;
}

// Hugging Face trains with the aux loss only when output_router_logits is
// set; router_aux_loss_coef is its weight then.
void write_aux_loss(nlohmann::json& j, const MoeOptions& m) {
  j["output_router_logits"] = m.aux_loss_coef > 0;
  j["router_aux_loss_coef"] = m.aux_loss_coef;
}

std::string dump(const nlohmann::json& j) { return j.dump(2) + "\n"; }

// A JSON object's fields, checked as they are read; refusals name the field.
class Fields {
 public:
  explicit Fields(const std::string& text) {
    try {
      j_ = nlohmann::json::parse(text);
    } catch (const nlohmann::json::exception& e) {
      refuse_moe(std::string("is not JSON: ") + e.what());
    }
    if (!j_.is_object()) refuse_moe("is not a JSON object");
  }
  bool has(const char* field) const { return j_.contains(field) && !j_[field].is_null(); }
  int64_t integer(const char* field) const {
    if (!has(field) || !j_[field].is_number_integer()) refuse_moe(std::string("has no integer \"") + field + "\"");
    return j_[field].get<int64_t>();
  }
  int64_t integer(const char* field, int64_t fallback) const { return has(field) ? integer(field) : fallback; }
  double number(const char* field, double fallback) const {
    if (!has(field)) return fallback;
    if (!j_[field].is_number()) refuse_moe(std::string("\"") + field + "\" is not a number");
    return j_[field].get<double>();
  }
  bool boolean(const char* field, bool fallback) const {
    if (!has(field)) return fallback;
    if (!j_[field].is_boolean()) refuse_moe(std::string("\"") + field + "\" is not true or false");
    return j_[field].get<bool>();
  }
  const nlohmann::json& operator[](const char* field) const { return j_[field]; }

 private:
  nlohmann::json j_;
};

// Leaves `key` out of `values`.
void drop(std::vector<HfConfigValue>& values, const std::string& key) {
  for (auto it = values.begin(); it != values.end(); ++it) {
    if (it->key == key) {
      values.erase(it);
      return;
    }
  }
}

// Sets `key` in `values` (replacing the llama reader's value, if any).
void put(std::vector<HfConfigValue>& values, HfConfigValue v) {
  for (HfConfigValue& old : values) {
    if (old.key == v.key) {
      old = std::move(v);
      return;
    }
  }
  values.push_back(std::move(v));
}

// The fields a mixture of experts of either format sets the same way: the
// router's (softmax, no factor, no bias), no shared experts, and the aux
// loss as Hugging Face trains with it.
void put_common_moe(std::vector<HfConfigValue>& out, const Fields& f, const char* experts_field) {
  const int64_t experts = f.integer(experts_field);
  if (experts <= 0) refuse_moe(std::string(experts_field) + " is " + std::to_string(experts) + "; not a mixture of experts");
  put(out, {"model.moe.num_experts", experts, experts_field});
  put(out, {"model.moe.top_k", f.integer("num_experts_per_tok"), "num_experts_per_tok"});
  put(out, {"model.moe.score_func", std::string("softmax"), "model_type (softmax router)"});
  put(out, {"model.moe.route_scale", 1.0, "model_type (no routed scaling)"});
  put(out, {"model.moe.num_shared_experts", int64_t{0}, "model_type (no shared experts)"});
  put(out, {"model.moe.load_balance_rate", 0.0, "model_type (no balancing bias)"});
  const double coef = f.boolean("output_router_logits", false) ? f.number("router_aux_loss_coef", 0.001) : 0.0;
  put(out, {"model.moe.aux_loss_coef", coef, "router_aux_loss_coef (with output_router_logits)"});
}

// mlp_only_layers: the number F of leading dense layers it lists, [0 .. F-1].
int64_t dense_prefix(const Fields& f) {
  if (!f.has("mlp_only_layers")) return 0;
  const nlohmann::json& list = f["mlp_only_layers"];
  if (!list.is_array()) refuse_moe("\"mlp_only_layers\" is not a list");
  for (size_t i = 0; i < list.size(); ++i) {
    if (!list[i].is_number_integer() || list[i].get<int64_t>() != static_cast<int64_t>(i)) {
      refuse_moe("mlp_only_layers is " + list.dump() + "; only the first layers, [0, 1, ..., F-1], may be dense");
    }
  }
  return static_cast<int64_t>(list.size());
}

std::string layer_prefix(int64_t layer) { return "model.layers." + std::to_string(layer) + "."; }

// Our stacked experts of layer `layer` as the tensors of `experts_at`
// ("model.layers.N.mlp.experts."), named by `names` for gate, up, down.
void add_split_experts(std::vector<HfTensorNames>& out, const ModelOptions& o, int64_t layer,
                       const std::string& experts_at, const char* const (&names)[3]) {
  const char* ours[3] = {"gate_proj", "up_proj", "down_proj"};
  for (int p = 0; p < 3; ++p) {
    HfTensorNames t;
    t.name = layer_prefix(layer) + "mlp.experts." + ours[p] + ".weight";
    t.split = true;
    for (int64_t e = 0; e < o.moe.num_experts; ++e) {
      t.hf.push_back(experts_at + std::to_string(e) + "." + names[p] + ".weight");
    }
    out.push_back(std::move(t));
  }
}

}  // namespace

std::string qwen3_moe_config_json(const ModelOptions& o, const std::string& torch_dtype) {
  if (o.moe.num_experts <= 0) refuse_moe("model.moe.num_experts is 0: Qwen3MoeForCausalLM is a mixture of experts");
  if (!o.qk_norm) refuse_moe("model.qk_norm is false: Qwen3MoeForCausalLM has a q/k norm");
  check_expressible(o.moe);
  nlohmann::json j = dense_fields(o, torch_dtype);
  j["architectures"] = {"Qwen3MoeForCausalLM"};
  j["model_type"] = "qwen3_moe";
  j["num_experts"] = o.moe.num_experts;
  j["num_experts_per_tok"] = o.moe.top_k;
  j["moe_intermediate_size"] = moe_expert_d_ff(o);
  j["norm_topk_prob"] = o.moe.route_norm;
  j["decoder_sparse_step"] = 1;
  nlohmann::json dense = nlohmann::json::array();
  for (int64_t i = 0; i < o.moe.first_dense_layers; ++i) dense.push_back(i);
  j["mlp_only_layers"] = dense;
  write_aux_loss(j, o.moe);
  j["use_sliding_window"] = false;
  j["sliding_window"] = nullptr;
  j["max_window_layers"] = o.n_layers;
  return dump(j);
}

std::string mixtral_config_json(const ModelOptions& o, const std::string& torch_dtype) {
  if (o.moe.num_experts <= 0) refuse_moe("model.moe.num_experts is 0: MixtralForCausalLM is a mixture of experts");
  if (o.qk_norm) refuse_moe("model.qk_norm is true: MixtralForCausalLM has no q/k norm");
  check_expressible(o.moe);
  if (!o.moe.route_norm) {
    refuse_moe("model.moe.route_norm is false, which MixtralForCausalLM cannot express: it always renormalises "
           "the top-k weights (Qwen3MoeForCausalLM's norm_topk_prob can be false; it needs model.qk_norm)");
  }
  if (o.moe.first_dense_layers > 0) {
    refuse_moe("model.moe.first_dense_layers is " + std::to_string(o.moe.first_dense_layers) +
           ", which MixtralForCausalLM cannot express: every layer is a mixture of experts "
           "(Qwen3MoeForCausalLM's mlp_only_layers can; it needs model.qk_norm)");
  }
  nlohmann::json j = dense_fields(o, torch_dtype);
  j["architectures"] = {"MixtralForCausalLM"};
  j["model_type"] = "mixtral";
  j["intermediate_size"] = moe_expert_d_ff(o);  // Mixtral's experts' width
  j["num_local_experts"] = o.moe.num_experts;
  j["num_experts_per_tok"] = o.moe.top_k;
  write_aux_loss(j, o.moe);
  j["router_jitter_noise"] = 0.0;
  j["sliding_window"] = nullptr;
  return dump(j);
}

// Qwen3MoeForCausalLM: the llama's fields (head_dim among them, which the
// released models set apart from hidden_size / num_attention_heads), q/k
// norm, and the experts; decoder_sparse_step 1 and a prefix mlp_only_layers
// only.
std::vector<HfConfigValue> read_qwen3_moe_config_json(const std::string& text) {
  const Fields f(text);
  if (f.integer("decoder_sparse_step", 1) != 1) {
    refuse_moe("decoder_sparse_step is " + std::to_string(f.integer("decoder_sparse_step")) +
           "; only 1 (every layer after mlp_only_layers a mixture of experts) is supported");
  }
  if (f.boolean("use_sliding_window", false)) refuse_moe("use_sliding_window is true; not supported");
  std::vector<HfConfigValue> out = read_llama_config_json(text);
  put(out, {"model.qk_norm", true, "model_type (q_norm, k_norm)"});
  // transformers 5 may write the count under Mixtral's name.
  put_common_moe(out, f, !f.has("num_experts") && f.has("num_local_experts") ? "num_local_experts" : "num_experts");
  put(out, {"model.moe.d_ff", f.integer("moe_intermediate_size"), "moe_intermediate_size"});
  put(out, {"model.moe.route_norm", f.boolean("norm_topk_prob", false), "norm_topk_prob"});
  const int64_t dense = dense_prefix(f);
  if (dense >= f.integer("num_hidden_layers")) {
    refuse_moe("mlp_only_layers lists every layer; not a mixture of experts");
  }
  put(out, {"model.moe.first_dense_layers", dense, "mlp_only_layers"});
  return out;
}

// MixtralForCausalLM: the llama's fields, intermediate_size the experts'
// width, the top-k weights always renormalised; no sliding window.
std::vector<HfConfigValue> read_mixtral_config_json(const std::string& text) {
  const Fields f(text);
  if (f.has("sliding_window")) {
    refuse_moe("sliding_window is " + f["sliding_window"].dump() + "; not supported (it must be null)");
  }
  if (f.number("router_jitter_noise", 0.0) != 0.0) {
    refuse_moe("router_jitter_noise is " + f["router_jitter_noise"].dump() + "; not supported (the router adds no noise)");
  }
  std::vector<HfConfigValue> out = read_llama_config_json(text);
  put(out, {"model.qk_norm", false, "model_type (no q/k norm)"});
  put_common_moe(out, f, "num_local_experts");
  // intermediate_size is the experts' width; no layer has the dense MLP
  // that model.d_ff sizes.
  drop(out, "model.d_ff");
  put(out, {"model.moe.d_ff", f.integer("intermediate_size"), "intermediate_size"});
  put(out, {"model.moe.route_norm", true, "model_type (top-k weights renormalised)"});
  put(out, {"model.moe.first_dense_layers", int64_t{0}, "model_type (every layer sparse)"});
  return out;
}

std::string llama_hf_config_json(const ModelOptions& o, const std::string& torch_dtype) {
  if (o.moe.num_experts <= 0) return llama_config_json(o, torch_dtype);
  return o.qk_norm ? qwen3_moe_config_json(o, torch_dtype) : mixtral_config_json(o, torch_dtype);
}

std::vector<HfConfigValue> read_llama_hf_config_json(const std::string& text) {
  const Fields f(text);
  const std::string type = f.has("model_type") && f["model_type"].is_string() ? f["model_type"].get<std::string>()
                                                                              : std::string("llama");
  if (type == "qwen3_moe") return read_qwen3_moe_config_json(text);
  if (type == "mixtral") return read_mixtral_config_json(text);
  return read_llama_config_json(text);
}

std::vector<HfTensorNames> llama_hf_renamed(const ModelOptions& o) {
  std::vector<HfTensorNames> out;
  for (int64_t layer = 0; layer < o.n_layers; ++layer) {
    if (!is_moe_layer(o, layer)) continue;
    if (o.qk_norm) {  // Qwen3-MoE: the router's name is ours
      add_split_experts(out, o, layer, layer_prefix(layer) + "mlp.experts.", {"gate_proj", "up_proj", "down_proj"});
    } else {  // Mixtral: w1 gate, w3 up, w2 down
      out.push_back({layer_prefix(layer) + "mlp.gate.weight", {layer_prefix(layer) + "block_sparse_moe.gate.weight"}, false});
      add_split_experts(out, o, layer, layer_prefix(layer) + "block_sparse_moe.experts.", {"w1", "w3", "w2"});
    }
  }
  return out;
}

}  // namespace models
