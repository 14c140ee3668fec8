#include "models/stacked_model.h"

#include <utility>

namespace models {

StackedModelImpl::StackedModelImpl(const ModelOptions& options,
                                   std::vector<std::shared_ptr<ResidualBlockImpl>> blocks)
    : options_(options), blocks_(std::move(blocks)) {
  // Registration order fixes parameter order: embeddings, blocks, final norm, head.
  tok_emb_ = register_module("tok_emb", torch::nn::Embedding(options.vocab_size, options.d_model));
  pos_emb_ = register_module("pos_emb", torch::nn::Embedding(options.seq_len, options.d_model));
  blocks_module_list_ = register_module("blocks", torch::nn::ModuleList());
  for (const auto& b : blocks_) blocks_module_list_->push_back(b);
  ln_f_ = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({options.d_model})));
  if (!options.tie_weights) {
    lm_head_ = register_module(
        "lm_head", torch::nn::Linear(torch::nn::LinearOptions(options.d_model, options.vocab_size).bias(false)));
  }
}

torch::Tensor StackedModelImpl::embed(const torch::Tensor& tokens) {
  TORCH_CHECK(tokens.dim() == 2, "embed: tokens must be [batch, seq], got ", tokens.sizes());
  const int64_t len = tokens.size(1);
  TORCH_CHECK(len <= options_.seq_len, "embed: sequence length ", len, " exceeds model.seq_len ",
              options_.seq_len);
  auto positions = torch::arange(len, tokens.options().dtype(torch::kLong));
  return tok_emb_->forward(tokens) + pos_emb_->forward(positions);
}

int64_t StackedModelImpl::num_blocks() const { return static_cast<int64_t>(blocks_.size()); }

std::shared_ptr<torch::nn::Module> StackedModelImpl::block(int64_t i) {
  TORCH_CHECK(i >= 0 && i < num_blocks(), "block index ", i, " out of range [0, ", num_blocks(), ")");
  return blocks_[i];
}

torch::Tensor StackedModelImpl::block_forward(int64_t i, const torch::Tensor& h) {
  TORCH_CHECK(i >= 0 && i < num_blocks(), "block index ", i, " out of range [0, ", num_blocks(), ")");
  return blocks_[i]->forward(h);
}

torch::Tensor StackedModelImpl::head(const torch::Tensor& h) {
  auto x = ln_f_->forward(h);
  if (lm_head_) return lm_head_->forward(x);
  return torch::nn::functional::linear(x, tok_emb_->weight);
}

}  // namespace models
