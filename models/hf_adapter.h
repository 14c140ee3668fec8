#pragma once
// A model kind's Hugging Face counterpart: config.json in and out,
// parameter names, tied weights. Torch-free (library models_options), so that the ckpt tool
// exports to Hugging Face without LibTorch. A kind's spec
// (models/model_spec.h) holds its adapter; register_model_spec registers it
// here too. The built-in llama's is registered from the start.
//
// Thread safety: register before any thread looks an adapter up.
#include "models/options.h"

#include <functional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

namespace models {

// One model.* key a Hugging Face config.json sets, and the field it came
// from (the config reports a clash with both).
struct HfConfigValue {
  std::string key;  // "model.d_model"
  std::variant<int64_t, double, bool, std::string> value;
  std::string field;  // "hidden_size"
};

struct HfAdapter {
  std::string model_type;    // config.json's "model_type", e.g. "llama"
  std::string architecture;  // config.json's "architectures", e.g. "LlamaForCausalLM"
  // config.json (text) of the model of these options, its weights stored as
  // `torch_dtype` ("float32", "bfloat16", "float16").
  std::function<std::string(const ModelOptions& options, const std::string& torch_dtype)>
      config_json;
  // config.json (text, a JSON object of this model_type) in: the model.*
  // values it sets, model.kind among them. Throws std::invalid_argument
  // saying which field is missing or not supported; the caller names the
  // file. Empty: this kind's config.json is not read.
  std::function<std::vector<HfConfigValue>(const std::string& config_json)> read_config_json;
  // Our parameter name -> Hugging Face's. Empty: the same names.
  std::function<std::string(const std::string& name)> hf_name;
  // (parameter, the one it is tied to) when options.tie_weights: the first
  // is not a parameter of its own (the llama's lm_head.weight).
  std::vector<std::pair<std::string, std::string>> tied_weights;
};

// Adds (or replaces) the adapter of model.kind `kind`.
void register_hf_adapter(const std::string& kind, HfAdapter adapter);

// The adapter of `kind`; nullptr when the kind has no Hugging Face
// counterpart (gpt, mlp) or is unknown here.
const HfAdapter* find_hf_adapter(const std::string& kind);

// config.json (text) in, through the adapter whose model_type it names.
// Throws std::invalid_argument: not a JSON object, a model_type no adapter
// reads (naming those that do), or the adapter's refusal.
std::vector<HfConfigValue> read_hf_config_json(const std::string& config_json);

// The built-in llama's LlamaForCausalLM config.json, out and in.
std::string llama_config_json(const ModelOptions& options, const std::string& torch_dtype);
std::vector<HfConfigValue> read_llama_config_json(const std::string& config_json);

}  // namespace models
