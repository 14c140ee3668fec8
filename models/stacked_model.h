#pragma once
// The skeleton both models share:
//   tok_emb + pos_emb -> blocks.0 .. blocks.{n-1} -> ln_f -> lm_head
// where lm_head is absent when tie_weights is set (the head then multiplies by
// tok_emb.weight). What differs between GPT and MLP is only the block type.
#include "models/layered_model.h"
#include "models/layers.h"

#include <memory>
#include <vector>

namespace models {

class StackedModelImpl : public LayeredModelImpl {
 public:
  // REQUIRES: options validated; blocks non-empty, each mapping [B,T,d_model] to itself.
  StackedModelImpl(const ModelOptions& options,
                   std::vector<std::shared_ptr<ResidualBlockImpl>> blocks);

  torch::Tensor embed(const torch::Tensor& tokens) override;
  int64_t num_blocks() const override;
  std::shared_ptr<torch::nn::Module> block(int64_t i) override;
  torch::Tensor block_forward(int64_t i, const torch::Tensor& h) override;
  torch::Tensor head(const torch::Tensor& h) override;

 private:
  ModelOptions options_;
  torch::nn::Embedding tok_emb_{nullptr};
  torch::nn::Embedding pos_emb_{nullptr};
  torch::nn::ModuleList blocks_module_list_{nullptr};
  std::vector<std::shared_ptr<ResidualBlockImpl>> blocks_;
  torch::nn::LayerNorm ln_f_{nullptr};
  torch::nn::Linear lm_head_{nullptr};  // null when tied
};

}  // namespace models
