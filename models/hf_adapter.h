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

// A config.json "model_type" and its "architectures" entry.
struct HfModelType {
  std::string model_type;    // "qwen3_moe"
  std::string architecture;  // "Qwen3MoeForCausalLM"
};

// One of our parameters that Hugging Face names or lays out otherwise: its
// tensor `hf.front()` under another name, or (split) the tensors `hf`, one
// per row of our dim 0, that dim dropped -- a mixture of experts' stacked
// experts [E, out, in], which Hugging Face saves as E tensors [out, in].
struct HfTensorNames {
  std::string name;             // ours: "model.layers.1.mlp.experts.gate_proj.weight"
  std::vector<std::string> hf;  // "model.layers.1.mlp.experts.0.gate_proj.weight", ...
  bool split = false;
};

struct HfAdapter {
  std::string model_type;    // config.json's "model_type", e.g. "llama"
  std::string architecture;  // config.json's "architectures", e.g. "LlamaForCausalLM"
  // The other model types config_json writes (as the options ask) and
  // read_config_json reads: the llama's mixtures of experts, qwen3_moe and
  // mixtral.
  std::vector<HfModelType> other_types;
  // config.json (text) of the model of these options, its weights stored as
  // `torch_dtype` ("float32", "bfloat16", "float16"). Throws
  // std::invalid_argument naming the model.* key of an option Hugging Face's
  // counterpart cannot express.
  std::function<std::string(const ModelOptions& options, const std::string& torch_dtype)>
      config_json;
  // config.json (text, a JSON object of one of its model types) in: the
  // model.* values it sets, model.kind among them. Throws
  // std::invalid_argument saying which field is missing or not supported;
  // the caller names the file. Empty: this kind's config.json is not read.
  std::function<std::vector<HfConfigValue>(const std::string& config_json)> read_config_json;
  // The parameters of a model of these options that Hugging Face names or
  // lays out otherwise (config_json's format for them); the rest keep their
  // names. Empty: every name is Hugging Face's.
  std::function<std::vector<HfTensorNames>(const ModelOptions& options)> renamed;
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

// The built-in llama's config.json, out and in (its adapter's config_json
// and read_config_json): LlamaForCausalLM's for a dense model; for a
// mixture of experts (model.moe.num_experts > 0) Qwen3MoeForCausalLM's with
// model.qk_norm, else MixtralForCausalLM's (docs/moe.md, "Hugging Face in
// and out"). In: by its model_type.
std::string llama_hf_config_json(const ModelOptions& options, const std::string& torch_dtype);
std::vector<HfConfigValue> read_llama_hf_config_json(const std::string& config_json);
// Each format alone. Out throws std::invalid_argument naming the model.*
// key of an option the format cannot express (the first found), in
// std::invalid_argument naming the config.json field it cannot take.
std::string llama_config_json(const ModelOptions& options, const std::string& torch_dtype);
std::vector<HfConfigValue> read_llama_config_json(const std::string& config_json);
std::string qwen3_moe_config_json(const ModelOptions& options, const std::string& torch_dtype);
std::vector<HfConfigValue> read_qwen3_moe_config_json(const std::string& config_json);
std::string mixtral_config_json(const ModelOptions& options, const std::string& torch_dtype);
std::vector<HfConfigValue> read_mixtral_config_json(const std::string& config_json);
// The llama's parameters Hugging Face names otherwise (its adapter's
// renamed): none for a dense model; for a mixture of experts each MoE
// block's stacked experts, split into experts.K.{gate,up,down}_proj
// (Qwen3-MoE) or block_sparse_moe.experts.K.{w1,w3,w2} (Mixtral, whose
// router is block_sparse_moe.gate).
std::vector<HfTensorNames> llama_hf_renamed(const ModelOptions& options);

}  // namespace models
