#pragma once
// Causal self-attention, the one kernel whose choice depends on what the
// LibTorch at hand offers. The models include nothing of dist/ (where
// torch_compat.h branches on the LibTorch version), so this asks LibTorch
// itself: a feature test for the operator, not a version test.
#include <torch/torch.h>

#include <cmath>
#include <limits>

#if __has_include(<ATen/ops/scaled_dot_product_attention.h>)
#define SHARDKIT_HAS_SDPA 1  // LibTorch 2.x
#else
#define SHARDKIT_HAS_SDPA 0  // LibTorch 1.13
#endif

namespace models {

// Causal self-attention of q [B, H, T, Dh] over k, v [B, H, T, Dh] (key and
// value heads already repeated to H). The plain path: scores by matmul,
// softmax in fp32 (as autocast keeps it), cast back to the inputs' dtype.
inline at::Tensor causal_attention_matmul(const at::Tensor& q, const at::Tensor& k,
                                          const at::Tensor& v) {
  const int64_t len = q.size(-2);
  at::Tensor scores = at::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(q.size(-1)));
  // Rebuilt per call (tiny) rather than kept as a buffer, so it never shows
  // up in a state dict or in sharding.
  at::Tensor future = at::ones({len, len}, q.options().dtype(at::kBool)).triu(1);
  scores = scores.masked_fill(future, -std::numeric_limits<double>::infinity());
  return at::matmul(at::softmax(scores.to(at::kFloat), -1).to(q.scalar_type()), v);
}

// The fused kernel where LibTorch has one (2.x: scaled_dot_product_attention,
// causal, flash or memory-efficient where the device supports them), else
// causal_attention_matmul. Both compute the same function, within rounding.
inline constexpr bool kFusedAttention = SHARDKIT_HAS_SDPA;
inline at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
#if SHARDKIT_HAS_SDPA
  return at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, /*dropout_p=*/0.0,
                                          /*is_causal=*/true);
#else
  return causal_attention_matmul(q, k, v);
#endif
}

}  // namespace models
