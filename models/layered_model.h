#pragma once
// The model interface the FSDP wrapper splits into units: embed -> blocks -> head.
// Implementations are plain single-device LibTorch modules; every parameter belongs
// to a registered submodule, so parallelism can be applied from outside.
#include "models/options.h"

#include <torch/torch.h>

#include <cstdint>
#include <memory>

namespace models {

class LayeredModelImpl : public torch::nn::Module {
 public:
  // tokens: int64 [B, T] with T <= seq_len -> hidden [B, T, D].
  virtual torch::Tensor embed(const torch::Tensor& tokens) = 0;
  virtual int64_t num_blocks() const = 0;
  // The i-th block, a unit for FSDP. REQUIRES: 0 <= i < num_blocks().
  virtual std::shared_ptr<torch::nn::Module> block(int64_t i) = 0;
  // h: [B, T, D] -> [B, T, D]. REQUIRES: 0 <= i < num_blocks().
  virtual torch::Tensor block_forward(int64_t i, const torch::Tensor& h) = 0;
  // hidden [B, T, D] -> logits [B, T, V] (includes the final norm).
  virtual torch::Tensor head(const torch::Tensor& h) = 0;

  // head(block_forward(n-1, ... block_forward(0, embed(tokens)))), each block
  // called through framework::fsdp::run_unit: shard it with
  // fully_shard(model, mesh, options, children_of(*model, "blocks")).
  torch::Tensor forward(const torch::Tensor& tokens);
};

// Validates `options` (errors name the offending field, e.g. "model.n_heads") and
// builds the model of options.kind, initialised GPT-2 style from the global torch
// generator: the result is deterministic given torch::manual_seed beforehand.
std::shared_ptr<LayeredModelImpl> make_model(const ModelOptions& options);

// What make_model(options) would hold, computed from the options alone
// (nothing allocated; doubles, so absurd sizes do not overflow).
struct ModelSize {
  double parameters = 0;       // all of them
  double largest_unit = 0;     // one block, or the rest (embeddings, final norm, head)
  double activation_floats_per_sample = 0;  // kept for backward, roughly, fp32
};
ModelSize model_size(const ModelOptions& options);

// Throws c10::Error naming the first invalid field of `options`.
void validate_model_options(const ModelOptions& options);

}  // namespace models
