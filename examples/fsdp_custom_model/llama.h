#pragma once
// A small LLaMA-style decoder, written as any LibTorch user would write it:
// RMSNorm, rotary position embeddings, SwiGLU MLP, pre-norm residual layers,
// tied or untied embeddings. Its only line for FSDP is in LlamaImpl::forward:
// each layer is called through framework::fsdp::run_unit, which gathers the
// layer's parameters when the model is sharded and is a plain call when not.
//
// Shard it with: fully_shard(model, mesh, options, fsdp::children_of(*model, "layers")).
#include "framework/fsdp/fully_shard.h"

#include <torch/torch.h>

#include <cmath>
#include <cstdint>
#include <limits>

namespace llama {

struct LlamaOptions {
  int64_t vocab_size = 64;
  int64_t seq_len = 16;
  int64_t dim = 32;
  int64_t n_layers = 2;
  int64_t n_heads = 4;
  int64_t hidden_dim = 64;  // SwiGLU inner width
  bool tie_embeddings = true;
  double norm_eps = 1e-5;
  double rope_theta = 10000.0;
};

// x / rms(x) * weight, over the last dimension.
class RMSNormImpl : public torch::nn::Module {
 public:
  RMSNormImpl(int64_t dim, double eps) : eps_(eps) {
    weight = register_parameter("weight", torch::ones({dim}));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return x * torch::rsqrt(x.pow(2).mean(-1, /*keepdim=*/true) + eps_) * weight;
  }
  torch::Tensor weight;

 private:
  double eps_;
};
TORCH_MODULE(RMSNorm);

// Rotates (x[..., :d/2], x[..., d/2:]) pairs by position-dependent angles.
// x: [B, H, T, Dh].
inline torch::Tensor apply_rotary(const torch::Tensor& x, double theta) {
  const int64_t t = x.size(2), dh = x.size(3), half = dh / 2;
  auto opts = x.options();
  torch::Tensor inv_freq =
      torch::pow(theta, -torch::arange(0, half, opts) * (2.0 / static_cast<double>(dh)));
  torch::Tensor angles = torch::outer(torch::arange(0, t, opts), inv_freq);  // [T, half]
  torch::Tensor cos = angles.cos(), sin = angles.sin();
  torch::Tensor x1 = x.narrow(-1, 0, half), x2 = x.narrow(-1, half, half);
  return torch::cat({x1 * cos - x2 * sin, x1 * sin + x2 * cos}, -1);
}

class AttentionImpl : public torch::nn::Module {
 public:
  explicit AttentionImpl(const LlamaOptions& o) : n_heads_(o.n_heads), theta_(o.rope_theta) {
    auto lin = [&](int64_t in, int64_t out) {
      return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(false));
    };
    wq = register_module("wq", lin(o.dim, o.dim));
    wk = register_module("wk", lin(o.dim, o.dim));
    wv = register_module("wv", lin(o.dim, o.dim));
    wo = register_module("wo", lin(o.dim, o.dim));
  }
  torch::Tensor forward(const torch::Tensor& x) {  // [B, T, D]
    const int64_t b = x.size(0), t = x.size(1), d = x.size(2), dh = d / n_heads_;
    auto heads = [&](const torch::Tensor& y) { return y.view({b, t, n_heads_, dh}).transpose(1, 2); };
    torch::Tensor q = apply_rotary(heads(wq(x)), theta_);
    torch::Tensor k = apply_rotary(heads(wk(x)), theta_);
    torch::Tensor v = heads(wv(x));
    torch::Tensor scores = torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(dh));
    torch::Tensor mask = torch::ones({t, t}, x.options().dtype(torch::kBool)).triu(1);
    scores = scores.masked_fill(mask, -std::numeric_limits<float>::infinity());
    torch::Tensor out = torch::matmul(torch::softmax(scores, -1), v);
    return wo(out.transpose(1, 2).reshape({b, t, d}));
  }
  torch::nn::Linear wq{nullptr}, wk{nullptr}, wv{nullptr}, wo{nullptr};

 private:
  int64_t n_heads_;
  double theta_;
};
TORCH_MODULE(Attention);

// w2(silu(w1 x) * w3 x)
class FeedForwardImpl : public torch::nn::Module {
 public:
  explicit FeedForwardImpl(const LlamaOptions& o) {
    auto lin = [&](int64_t in, int64_t out) {
      return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(false));
    };
    w1 = register_module("w1", lin(o.dim, o.hidden_dim));
    w2 = register_module("w2", lin(o.hidden_dim, o.dim));
    w3 = register_module("w3", lin(o.dim, o.hidden_dim));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return w2(torch::silu(w1(x)) * w3(x));
  }
  torch::nn::Linear w1{nullptr}, w2{nullptr}, w3{nullptr};
};
TORCH_MODULE(FeedForward);

class DecoderLayerImpl : public torch::nn::Module {
 public:
  explicit DecoderLayerImpl(const LlamaOptions& o) {
    attention_norm = register_module("attention_norm", RMSNorm(o.dim, o.norm_eps));
    attention = register_module("attention", Attention(o));
    ffn_norm = register_module("ffn_norm", RMSNorm(o.dim, o.norm_eps));
    feed_forward = register_module("feed_forward", FeedForward(o));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    torch::Tensor h = x + attention(attention_norm(x));
    return h + feed_forward(ffn_norm(h));
  }
  RMSNorm attention_norm{nullptr}, ffn_norm{nullptr};
  Attention attention{nullptr};
  FeedForward feed_forward{nullptr};
};
TORCH_MODULE(DecoderLayer);

// The output projection. Tied, it registers the token embedding's weight
// tensor as its own (the same tensor under two names, as in PyTorch).
class OutputImpl : public torch::nn::Module {
 public:
  explicit OutputImpl(torch::Tensor w) { weight = register_parameter("weight", std::move(w)); }
  torch::Tensor forward(const torch::Tensor& h) { return torch::matmul(h, weight.t()); }
  torch::Tensor weight;
};
TORCH_MODULE(Output);

class LlamaImpl : public torch::nn::Module {
 public:
  explicit LlamaImpl(const LlamaOptions& o) {
    tok_embeddings = register_module("tok_embeddings", torch::nn::Embedding(o.vocab_size, o.dim));
    layers = register_module("layers", torch::nn::ModuleList());
    for (int64_t i = 0; i < o.n_layers; ++i) layers->push_back(DecoderLayer(o));
    norm = register_module("norm", RMSNorm(o.dim, o.norm_eps));
    torch::Tensor out_weight = o.tie_embeddings ? tok_embeddings->weight
                                                : torch::empty({o.vocab_size, o.dim});
    output = register_module("output", Output(out_weight));
    // Small normal init, drawn from the global generator in registration
    // order: the same weights on every rank after the same torch::manual_seed.
    torch::NoGradGuard no_grad;
    for (auto& p : named_parameters()) {
      if (p.key().find("norm") == std::string::npos) p.value().normal_(0.0, 0.02);
    }
  }

  // tokens int64 [B, T] -> logits [B, T, vocab]
  torch::Tensor forward(const torch::Tensor& tokens) {
    torch::Tensor h = tok_embeddings(tokens);
    for (const auto& layer : *layers) {
      // The one FSDP line: this layer is a unit when the model is sharded.
      h = framework::fsdp::run_unit(*layer, [&] { return layer->as<DecoderLayer>()->forward(h); });
    }
    return output(norm(h));
  }

  torch::nn::Embedding tok_embeddings{nullptr};
  torch::nn::ModuleList layers{nullptr};
  RMSNorm norm{nullptr};
  Output output{nullptr};
};
TORCH_MODULE(Llama);

}  // namespace llama
