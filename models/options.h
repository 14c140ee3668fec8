#pragma once
// Model sizes (config section `model`).
#include <cstdint>
#include <string>

namespace models {

struct ModelOptions {
  std::string kind = "gpt";  // gpt | mlp
  int64_t vocab_size = 32;
  int64_t seq_len = 32;      // context length
  int64_t d_model = 64;
  int64_t n_layers = 2;
  int64_t n_heads = 4;
  int64_t d_ff = 0;          // 0: 4 * d_model
  bool tie_weights = true;
  // A safetensors or torch.save file of full (unsharded) weights to start from;
  // empty: random init. Ignored when resuming from a checkpoint.
  std::string init_from;
};

}  // namespace models
