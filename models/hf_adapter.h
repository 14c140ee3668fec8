#pragma once
// A model kind's Hugging Face counterpart: config.json out, parameter names,
// tied weights. Torch-free (library models_options), so that the ckpt tool
// exports to Hugging Face without LibTorch. A kind's spec
// (models/model_spec.h) holds its adapter; register_model_spec registers it
// here too. The built-in llama's is registered from the start.
//
// Thread safety: register before any thread looks an adapter up.
#include "models/options.h"

#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace models {

struct HfAdapter {
  std::string model_type;    // config.json's "model_type", e.g. "llama"
  std::string architecture;  // config.json's "architectures", e.g. "LlamaForCausalLM"
  // config.json (text) of the model of these options, its weights stored as
  // `torch_dtype` ("float32", "bfloat16", "float16").
  std::function<std::string(const ModelOptions& options, const std::string& torch_dtype)>
      config_json;
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

// The built-in llama's LlamaForCausalLM config.json.
std::string llama_config_json(const ModelOptions& options, const std::string& torch_dtype);

}  // namespace models
