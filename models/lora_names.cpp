// LoRA adapters' parameter names (lora_names.h).
#include "models/lora_names.h"

namespace models {

std::optional<LoraParameter> lora_parameter(const std::string& name) {
  for (const char* factor : {".lora_A.", ".lora_B."}) {
    const size_t at = name.find(factor);
    if (at == std::string::npos) continue;
    LoraParameter p;
    p.is_a = factor[6] == 'A';
    p.target = name.substr(0, at) + name.substr(at + 7);  // ".lora_A.weight" -> ".weight"
    return p;
  }
  return std::nullopt;
}

}  // namespace models
