#include "models/layers.h"

#include <cmath>
#include <limits>

namespace models {

FeedForwardImpl::FeedForwardImpl(int64_t d_model, int64_t d_ff)
    : fc_(register_module("fc", torch::nn::Linear(d_model, d_ff))),
      proj_(register_module("proj", torch::nn::Linear(d_ff, d_model))) {}

torch::Tensor FeedForwardImpl::forward(const torch::Tensor& x) {
  return proj_->forward(torch::gelu(fc_->forward(x)));
}

CausalSelfAttentionImpl::CausalSelfAttentionImpl(int64_t d_model, int64_t n_heads)
    : n_heads_(n_heads),
      qkv_(register_module("qkv", torch::nn::Linear(d_model, 3 * d_model))),
      proj_(register_module("proj", torch::nn::Linear(d_model, d_model))) {}

torch::Tensor CausalSelfAttentionImpl::forward(const torch::Tensor& x) {
  const int64_t batch = x.size(0);
  const int64_t len = x.size(1);
  const int64_t d_model = x.size(2);
  const int64_t d_head = d_model / n_heads_;
  // [B, T, 3D] -> three [B, H, T, Dh].
  auto heads = qkv_->forward(x).view({batch, len, 3, n_heads_, d_head}).permute({2, 0, 3, 1, 4});
  auto q = heads[0];
  auto k = heads[1];
  auto v = heads[2];
  auto scores = torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(d_head));
  // Mask is rebuilt per call (tiny) rather than kept as a buffer, so it never
  // shows up in the state dict or in sharding.
  auto future = torch::ones({len, len}, x.options().dtype(torch::kBool)).triu(1);
  scores = scores.masked_fill(future, -std::numeric_limits<float>::infinity());
  auto out = torch::matmul(torch::softmax(scores, -1), v);  // [B, H, T, Dh]
  out = out.transpose(1, 2).contiguous().view({batch, len, d_model});
  return proj_->forward(out);
}

namespace {
torch::nn::LayerNorm make_layer_norm(int64_t d_model) {
  return torch::nn::LayerNorm(torch::nn::LayerNormOptions({d_model}));
}
}  // namespace

GptBlockImpl::GptBlockImpl(int64_t d_model, int64_t n_heads, int64_t d_ff)
    : ln1_(register_module("ln1", make_layer_norm(d_model))),
      attn_(register_module("attn", CausalSelfAttention(d_model, n_heads))),
      ln2_(register_module("ln2", make_layer_norm(d_model))),
      mlp_(register_module("mlp", FeedForward(d_model, d_ff))) {}

torch::Tensor GptBlockImpl::forward(const torch::Tensor& h) {
  auto x = h + attn_->forward(ln1_->forward(h));
  return x + mlp_->forward(ln2_->forward(x));
}

MlpBlockImpl::MlpBlockImpl(int64_t d_model, int64_t d_ff)
    : ln1_(register_module("ln1", make_layer_norm(d_model))),
      mlp_(register_module("mlp", FeedForward(d_model, d_ff))) {}

torch::Tensor MlpBlockImpl::forward(const torch::Tensor& h) {
  return h + mlp_->forward(ln1_->forward(h));
}

void init_gpt2_style(torch::nn::Module& model) {
  torch::NoGradGuard no_grad;
  for (auto& module : model.modules(/*include_self=*/true)) {
    if (auto* linear = module->as<torch::nn::Linear>()) {
      linear->weight.normal_(0.0, 0.02);
      if (linear->bias.defined()) linear->bias.zero_();
    } else if (auto* embedding = module->as<torch::nn::Embedding>()) {
      embedding->weight.normal_(0.0, 0.02);
    }
  }
}

}  // namespace models
