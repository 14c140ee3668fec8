#include "models/hf_adapter.h"

#include <nlohmann/json.hpp>

#include <map>
#include <mutex>
#include <stdexcept>

namespace models {

std::string llama_config_json(const ModelOptions& o, const std::string& torch_dtype) {
  if (o.moe.num_experts > 0) {
    throw std::invalid_argument("model.moe.num_experts is " + std::to_string(o.moe.num_experts) +
                                ": LlamaForCausalLM has no mixture of experts");
  }
  if (o.qk_norm) throw std::invalid_argument("model.qk_norm is true: LlamaForCausalLM has no q/k norm");
  nlohmann::json j;
  j["architectures"] = {"LlamaForCausalLM"};
  j["model_type"] = "llama";
  j["hidden_size"] = o.d_model;
  j["intermediate_size"] = llama_d_ff(o);
  j["num_hidden_layers"] = o.n_layers;
  j["num_attention_heads"] = o.n_heads;
  j["num_key_value_heads"] = o.n_kv_heads > 0 ? o.n_kv_heads : o.n_heads;
  j["head_dim"] = llama_head_dim(o);
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

[[noreturn]] void refuse_json(const std::string& what) { throw std::invalid_argument(what); }

nlohmann::json parse_object(const std::string& text) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    refuse_json(std::string("is not JSON: ") + e.what());
  }
  if (!j.is_object()) refuse_json("is not a JSON object");
  return j;
}

}  // namespace

// Only LlamaForCausalLM's options that map to ours; the others refused.
std::vector<HfConfigValue> read_llama_config_json(const std::string& text) {
  const nlohmann::json j = parse_object(text);
  auto unsupported = [](const std::string& what) { refuse_json(what + "; not supported"); };
  if (j.value("attention_bias", false)) unsupported("attention_bias is true");
  if (j.value("mlp_bias", false)) unsupported("mlp_bias is true");
  if (j.value("hidden_act", std::string("silu")) != "silu")
    unsupported("hidden_act is " + j.value("hidden_act", std::string()));
  auto integer = [&](const nlohmann::json& in, const char* field) -> int64_t {
    if (!in.contains(field) || !in[field].is_number_integer())
      refuse_json(std::string("has no integer \"") + field + "\"");
    return in[field].get<int64_t>();
  };
  auto number = [&](const char* field, double fallback) -> double {
    if (!j.contains(field) || j[field].is_null()) return fallback;
    if (!j[field].is_number()) refuse_json(std::string("\"") + field + "\" is not a number");
    return j[field].get<double>();
  };
  const int64_t hidden = integer(j, "hidden_size");
  const int64_t heads = integer(j, "num_attention_heads");
  // head_dim: model.head_dim when it is not hidden_size / num_attention_heads
  // (Qwen3-MoE's released models), else 0, which means that width.
  int64_t head_dim = 0;
  if (j.contains("head_dim") && !j["head_dim"].is_null()) {
    head_dim = integer(j, "head_dim");
    if (head_dim <= 0) refuse_json("head_dim is " + std::to_string(head_dim) + "; it must be positive");
    if (heads > 0 && hidden % heads == 0 && head_dim == hidden / heads) head_dim = 0;
  }
  const bool has_kv = j.contains("num_key_value_heads") && !j["num_key_value_heads"].is_null();
  std::vector<HfConfigValue> out = {
      {"model.kind", std::string("llama"), "model_type"},
      {"model.d_model", hidden, "hidden_size"},
      {"model.n_heads", heads, "num_attention_heads"},
      {"model.n_kv_heads", has_kv ? integer(j, "num_key_value_heads") : heads, "num_key_value_heads"},
      {"model.head_dim", head_dim, "head_dim"},
      {"model.n_layers", integer(j, "num_hidden_layers"), "num_hidden_layers"},
      {"model.d_ff", integer(j, "intermediate_size"), "intermediate_size"},
      {"model.vocab_size", integer(j, "vocab_size"), "vocab_size"},
      {"model.norm_eps", number("rms_norm_eps", 1e-6), "rms_norm_eps"},
      {"model.rope_theta", number("rope_theta", 10000.0), "rope_theta"},
      {"model.tie_weights", j.value("tie_word_embeddings", false), "tie_word_embeddings"},
      {"model.qk_norm", false, "model_type (no q/k norm)"},
      {"model.moe.num_experts", int64_t{0}, "model_type (dense)"},
  };
  if (!j.contains("rope_scaling") || j["rope_scaling"].is_null()) {
    out.push_back({"model.rope_scaling.factor", 0.0, "rope_scaling (none)"});
    return out;
  }
  const nlohmann::json& r = j["rope_scaling"];
  if (!r.is_object()) refuse_json("rope_scaling is not an object");
  const std::string kind = r.value("rope_type", r.value("type", std::string()));
  if (kind != "llama3") unsupported("rope_scaling of type \"" + kind + "\" (only llama3 is known)");
  auto field = [&](const char* name) {
    if (!r.contains(name) || !r[name].is_number())
      refuse_json(std::string("rope_scaling has no number \"") + name + "\"");
    return r[name].get<double>();
  };
  out.push_back({"model.rope_scaling.factor", field("factor"), "rope_scaling.factor"});
  out.push_back({"model.rope_scaling.low_freq_factor", field("low_freq_factor"),
                 "rope_scaling.low_freq_factor"});
  out.push_back({"model.rope_scaling.high_freq_factor", field("high_freq_factor"),
                 "rope_scaling.high_freq_factor"});
  out.push_back({"model.rope_scaling.original_max_position",
                 integer(r, "original_max_position_embeddings"),
                 "rope_scaling.original_max_position_embeddings"});
  return out;
}

namespace {

struct HfRegistry {
  std::mutex mutex;
  std::map<std::string, HfAdapter> adapters;
  HfRegistry() {
    HfAdapter llama;
    llama.model_type = "llama";
    llama.architecture = "LlamaForCausalLM";
    llama.other_types = {{"qwen3_moe", "Qwen3MoeForCausalLM"}, {"mixtral", "MixtralForCausalLM"}};
    llama.config_json = llama_hf_config_json;
    llama.read_config_json = read_llama_hf_config_json;
    llama.renamed = llama_hf_renamed;
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

namespace {

std::vector<HfConfigValue> read_config_json_unguarded(const std::string& text) {
  const nlohmann::json j = parse_object(text);
  if (j.contains("model_type") && !j["model_type"].is_string()) refuse_json("\"model_type\" is not a string");
  const std::string type = j.value("model_type", std::string());
  std::function<std::vector<HfConfigValue>(const std::string&)> read;
  std::string known;
  {
    HfRegistry& r = hf_registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    for (const auto& [kind, adapter] : r.adapters) {
      if (!adapter.read_config_json) continue;
      std::vector<HfModelType> types = {{adapter.model_type, adapter.architecture}};
      types.insert(types.end(), adapter.other_types.begin(), adapter.other_types.end());
      for (const HfModelType& t : types) {
        if (t.model_type == type) read = adapter.read_config_json;
        known += (known.empty() ? "" : ", ") + t.model_type + " (" + t.architecture + ")";
      }
      known += " as model.kind " + kind;
    }
  }
  if (!read) {
    refuse_json("has model_type \"" + type + "\"; the model types read are " +
           (known.empty() ? std::string("none") : known));
  }
  return read(text);
}

}  // namespace

// A reader's j.value(...) or get<T>() of a field of another JSON type throws
// nlohmann's type_error, which the callers (std::invalid_argument only) do
// not catch: every JSON error becomes the refusal.
std::vector<HfConfigValue> read_hf_config_json(const std::string& text) {
  try {
    return read_config_json_unguarded(text);
  } catch (const nlohmann::json::exception& e) {
    refuse_json(std::string("has a field of the wrong JSON type: ") + e.what());
  }
}

const HfAdapter* find_hf_adapter(const std::string& kind) {
  HfRegistry& r = hf_registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto it = r.adapters.find(kind);
  return it == r.adapters.end() ? nullptr : &it->second;
}

}  // namespace models
