#include "models/hf_adapter.h"

#include <nlohmann/json.hpp>

#include <map>
#include <mutex>

namespace models {

std::string llama_config_json(const ModelOptions& o, const std::string& torch_dtype) {
  nlohmann::json j;
  j["architectures"] = {"LlamaForCausalLM"};
  j["model_type"] = "llama";
  j["hidden_size"] = o.d_model;
  j["intermediate_size"] = llama_d_ff(o);
  j["num_hidden_layers"] = o.n_layers;
  j["num_attention_heads"] = o.n_heads;
  j["num_key_value_heads"] = o.n_kv_heads > 0 ? o.n_kv_heads : o.n_heads;
  j["head_dim"] = o.d_model / o.n_heads;
  j["vocab_size"] = o.vocab_size;
  j["max_position_embeddings"] = o.seq_len;
  j["rms_norm_eps"] = o.norm_eps;
  j["rope_theta"] = o.rope_theta;
  j["tie_word_embeddings"] = o.tie_weights;
  j["hidden_act"] = "silu";
  j["attention_bias"] = false;
  j["mlp_bias"] = false;
  j["attention_dropout"] = 0.0;
  j["initializer_range"] = 0.02;
  if (o.rope_scaling.factor > 0) {
    j["rope_scaling"] = {{"rope_type", "llama3"},
                         {"factor", o.rope_scaling.factor},
                         {"low_freq_factor", o.rope_scaling.low_freq_factor},
                         {"high_freq_factor", o.rope_scaling.high_freq_factor},
                         {"original_max_position_embeddings", o.rope_scaling.original_max_position}};
  } else {
    j["rope_scaling"] = nullptr;
  }
  j["torch_dtype"] = torch_dtype;
  return j.dump(2) + "\n";
}

namespace {

struct HfRegistry {
  std::mutex mutex;
  std::map<std::string, HfAdapter> adapters;
  HfRegistry() {
    HfAdapter llama;
    llama.model_type = "llama";
    llama.architecture = "LlamaForCausalLM";
    llama.config_json = llama_config_json;
    llama.tied_weights = {{"lm_head.weight", "model.embed_tokens.weight"}};
    adapters.emplace("llama", std::move(llama));
  }
};

HfRegistry& hf_registry() {
  static HfRegistry r;
  return r;
}

}  // namespace

void register_hf_adapter(const std::string& kind, HfAdapter adapter) {
  HfRegistry& r = hf_registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.adapters[kind] = std::move(adapter);
}

const HfAdapter* find_hf_adapter(const std::string& kind) {
  HfRegistry& r = hf_registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto it = r.adapters.find(kind);
  return it == r.adapters.end() ? nullptr : &it->second;
}

}  // namespace models
