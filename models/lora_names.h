#pragma once
// How LoRA adapters are named in a model's parameters (the llama's
// Projection registers lora_A and lora_B beside its weight). Torch-free:
// the ckpt tool's exports ask it through the run adapter
// (framework/config/run_items.h), so checkpoint/ names no adapter.
#include <optional>
#include <string>

namespace models {

// An adapter's parameter ("layers.0.attn.q_proj.lora_A.weight"): the
// parameter it changes ("layers.0.attn.q_proj.weight") and whether it is
// the A factor ([rank, in]) or B ([out, rank]).
struct LoraParameter {
  std::string target;
  bool is_a = false;
};

// nullopt for a parameter that is no adapter's.
std::optional<LoraParameter> lora_parameter(const std::string& name);

}  // namespace models
