#pragma once
// Building blocks shared by the models in this folder.
#include <torch/torch.h>

#include <cstdint>

namespace models {

// Linear(d -> d_ff), GELU, Linear(d_ff -> d). Submodules: fc, proj.
class FeedForwardImpl : public torch::nn::Module {
 public:
  FeedForwardImpl(int64_t d_model, int64_t d_ff);
  torch::Tensor forward(const torch::Tensor& x);

 private:
  torch::nn::Linear fc_{nullptr};
  torch::nn::Linear proj_{nullptr};
};
TORCH_MODULE(FeedForward);

// Multi-head self-attention with a causal mask, written with plain matmul and
// softmax (no fused kernels) so LibTorch 1.13 and 2.x compute the same thing.
// Submodules: qkv (one Linear d -> 3d), proj (d -> d).
class CausalSelfAttentionImpl : public torch::nn::Module {
 public:
  CausalSelfAttentionImpl(int64_t d_model, int64_t n_heads);
  torch::Tensor forward(const torch::Tensor& x);  // [B, T, D] -> [B, T, D]

 private:
  int64_t n_heads_;
  torch::nn::Linear qkv_{nullptr};
  torch::nn::Linear proj_{nullptr};
};
TORCH_MODULE(CausalSelfAttention);

// A residual block of a layered model: [B, T, D] -> [B, T, D].
class ResidualBlockImpl : public torch::nn::Module {
 public:
  virtual torch::Tensor forward(const torch::Tensor& h) = 0;
};

// Pre-LN transformer block: h + attn(ln1(h)), then + mlp(ln2(.)).
// Submodules: ln1, attn, ln2, mlp.
class GptBlockImpl : public ResidualBlockImpl {
 public:
  GptBlockImpl(int64_t d_model, int64_t n_heads, int64_t d_ff);
  torch::Tensor forward(const torch::Tensor& h) override;

 private:
  torch::nn::LayerNorm ln1_{nullptr};
  CausalSelfAttention attn_{nullptr};
  torch::nn::LayerNorm ln2_{nullptr};
  FeedForward mlp_{nullptr};
};

// Per-position residual MLP block: h + mlp(ln1(h)). Submodules: ln1, mlp.
class MlpBlockImpl : public ResidualBlockImpl {
 public:
  MlpBlockImpl(int64_t d_model, int64_t d_ff);
  torch::Tensor forward(const torch::Tensor& h) override;

 private:
  torch::nn::LayerNorm ln1_{nullptr};
  FeedForward mlp_{nullptr};
};

// GPT-2 initialisation: normal(0, 0.02) for every Linear and Embedding weight,
// zero biases; LayerNorms keep (1, 0). Draws from the global torch generator in
// module registration order.
void init_gpt2_style(torch::nn::Module& model);

}  // namespace models
