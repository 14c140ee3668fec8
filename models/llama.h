#pragma once
// Llama 3 (what torchtitan, Megatron-LM and llm.c train): token embedding;
// n_layers blocks of RMSNorm, grouped-query attention with rotary
// embeddings, RMSNorm, SwiGLU MLP; a final RMSNorm and the output
// projection. No biases.
//
// Parameter names are Hugging Face's LlamaForCausalLM names, so an import
// or export of Hugging Face weights is a plain copy:
//   model.embed_tokens.weight                       [vocab, d_model]
//   model.layers.N.input_layernorm.weight           [d_model]
//   model.layers.N.self_attn.{q,k,v,o}_proj.weight  [heads*hd, d] / [kv*hd, d] / [d, heads*hd]
//   model.layers.N.post_attention_layernorm.weight  [d_model]
//   model.layers.N.mlp.{gate,up,down}_proj.weight   [d_ff, d] / [d, d_ff]
//   model.norm.weight                               [d_model]
//   lm_head.weight                                  [vocab, d_model] (absent when tied)
// hd is model.head_dim, or d_model / n_heads when 0 (llama_head_dim): heads
// * hd need not be d_model (Qwen3-MoE's released models).
// Rotary layout: Hugging Face's rotate-half (the first and second halves of
// each head's dimensions form the rotated pairs), not Meta's interleaved
// pairs; Meta's original checkpoints need HF's q/k permutation on import.
//
// Initialisation (torchtitan-like, GPT-2 scale): every projection and the
// embedding normal(0, 0.02), o_proj and down_proj normal(0, 0.02 /
// sqrt(2 * n_layers)), norms 1. Each parameter draws from a generator of
// its own, seeded from the model's seed and the parameter's index, so its
// values do not depend on when, where or on which thread it is made: the
// model can be built unallocated and each rank fills in one parameter at
// a time while sharding it (FullyShardedModel's ParamInit).
#include "models/layered_model.h"
#include "models/moe.h"

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

namespace models {

// A parameter of `sizes`: allocated (its values set by init_parameter
// later), or, unmaterialised, a tensor of that shape whose storage holds no
// bytes. The allocation is never touched before it is freed.
torch::Tensor make_param(std::vector<int64_t> sizes, bool materialize);

// x / rms(x) * weight, the statistics in fp32 (as autocast keeps them),
// the result in x's dtype.
class RMSNormImpl : public torch::nn::Module {
 public:
  RMSNormImpl(int64_t dim, double eps, bool materialize);
  torch::Tensor forward(const torch::Tensor& x);
  // true: LibTorch's one rms_norm op where the version has it (2.4+; a fused
  // CUDA kernel in recent versions), else the composed ops.
  void set_fused(bool fused) { fused_ = fused; }

 private:
  double eps_;
  bool fused_ = false;
  torch::Tensor weight_;
};
TORCH_MODULE(RMSNorm);

// train.fused_kernels: every RMSNorm under `root` uses the fused op (or not).
void use_fused_kernels(torch::nn::Module& root, bool fused);
// What use_fused_kernels(root, true) and fused_cross_entropy_sum run in this
// build, for the banner.
std::string llama_fused_ops_description();

// sum over rows r with targets[r] != ignore_index of
// -log_softmax(logits[r])[targets[r]], in fp32, for logits [N, V] of any
// float dtype: computed in chunks of rows, each converted to fp32 on its own,
// so the whole batch's fp32 logits (and their log-softmax) never exist. Saves
// the logits as given and the per-row log-sum-exp [N] for backward, which
// makes the gradient (softmax - one-hot) chunk by chunk, in fp32, rounded
// once to the logits' dtype. Same value as cross_entropy(logits.float(),
// reduction sum) within fp32 rounding.
// chunk_rows: rows per chunk; 0: about 64 MiB of fp32 logits per chunk.
torch::Tensor fused_cross_entropy_sum(const torch::Tensor& logits, const torch::Tensor& targets,
                                      int64_t ignore_index, int64_t chunk_rows = 0);

// A LoRA adapter's parameter name ("...q_proj.lora_A.weight", "...lora_B...").
bool is_lora_parameter(const std::string& name);

// A bias-free projection x @ weight^T; weight [out, in]. Submodule-free
// unless LoRA adds its adapters.
class ProjectionImpl : public torch::nn::Module {
 public:
  ProjectionImpl(int64_t in, int64_t out, bool materialize);
  // LoRA (models/options.h: LoraOptions): registers the submodules lora_A
  // ([rank, in]) and lora_B ([out, rank]), Projections whose forwards run
  // through their own hooks (tensor parallelism splits B like a colwise
  // parent's weight and A like a rowwise one's). forward() then adds
  // scale x lora_B(lora_A(dropout(x))) to the hooked x @ weight^T: the
  // adapters' path stays outside this module's own hook.
  void add_lora(int64_t rank, double scale, double dropout, bool materialize);
  bool has_lora() const { return lora_A_ != nullptr; }
  torch::Tensor forward(const torch::Tensor& x);
  const torch::Tensor& weight() const { return weight_; }

 private:
  torch::Tensor weight_;
  std::shared_ptr<ProjectionImpl> lora_A_, lora_B_;
  double lora_scale_ = 0;
  double lora_dropout_ = 0;
};
TORCH_MODULE(Projection);

// Token ids [B, T] -> rows of weight [vocab, d_model].
class TokenEmbeddingImpl : public torch::nn::Module {
 public:
  TokenEmbeddingImpl(int64_t vocab, int64_t dim, bool materialize);
  torch::Tensor forward(const torch::Tensor& tokens);
  const torch::Tensor& weight() const { return weight_; }

 private:
  torch::Tensor weight_;
};
TORCH_MODULE(TokenEmbedding);

// The output projection of a model whose embedding and output share one
// weight (model.tie_weights): x @ embedding.weight^T, with no parameter of
// its own. A module of its own (the llama registers it as "lm_head") so that
// tensor parallelism can hook it as a colwise projection of the embedding's
// vocabulary-split weight (framework/tp).
class TiedOutputImpl : public torch::nn::Module {
 public:
  explicit TiedOutputImpl(std::shared_ptr<TokenEmbeddingImpl> embedding) : embedding_(std::move(embedding)) {}
  torch::Tensor forward(const torch::Tensor& x);
  const torch::Tensor& weight() const { return embedding_->weight(); }

 private:
  std::shared_ptr<TokenEmbeddingImpl> embedding_;
};
TORCH_MODULE(TiedOutput);

// cos and sin of the rotary angles, [T, head_dim] each, in the compute dtype.
struct RotaryTables {
  torch::Tensor cos;
  torch::Tensor sin;
};

// The rotary inverse frequencies [head_dim / 2] (fp32), with Llama 3.1's
// scaling when options.rope_scaling.factor > 0 (Hugging Face's
// _compute_llama3_parameters).
torch::Tensor rope_inverse_frequencies(const ModelOptions& options);

// Applies the rotation to x [B, H, T, hd] (rotate-half layout).
torch::Tensor apply_rotary(const torch::Tensor& x, const RotaryTables& rope);

// Keys and values of the positions seen so far, per layer, for generation:
// each [B, n_kv_heads, length, head_dim] after rotation.
struct KvCache {
  std::vector<torch::Tensor> k, v;
  int64_t length = 0;  // positions cached
};

class LlamaAttentionImpl : public torch::nn::Module {
 public:
  LlamaAttentionImpl(const ModelOptions& options, bool materialize);
  // `context`: context parallelism's attention (ContextParallel::attention),
  // given the rotated queries and the key/value heads; null: this device's
  // causal attention over x's tokens.
  torch::Tensor forward(const torch::Tensor& x, const RotaryTables& rope,
                        const ContextParallel* context = nullptr);
  // x holds positions [cache_len, cache_len + T) (rope for those); k and v
  // are the layer's cache, extended in place. Each new position attends to
  // every cached one and to the new ones up to itself.
  torch::Tensor forward_cached(const torch::Tensor& x, const RotaryTables& rope, torch::Tensor& k,
                               torch::Tensor& v);

 private:
  // q and k [B, n, T, hd] -> their heads' RMSNorm (model.qk_norm), then rotary.
  torch::Tensor rotate_q(const torch::Tensor& q, const RotaryTables& rope);
  torch::Tensor rotate_k(const torch::Tensor& k, const RotaryTables& rope);

  int64_t n_heads_, n_kv_heads_, head_dim_;
  Projection q_proj_{nullptr}, k_proj_{nullptr}, v_proj_{nullptr}, o_proj_{nullptr};
  RMSNorm q_norm_{nullptr}, k_norm_{nullptr};  // model.qk_norm
};
TORCH_MODULE(LlamaAttention);

class LlamaMlpImpl : public torch::nn::Module {
 public:
  LlamaMlpImpl(int64_t d_model, int64_t d_ff, bool materialize);
  torch::Tensor forward(const torch::Tensor& x);  // down(silu(gate(x)) * up(x))

 private:
  Projection gate_proj_{nullptr}, up_proj_{nullptr}, down_proj_{nullptr};
};
TORCH_MODULE(LlamaMlp);

// Block `layer`: its "mlp" is the dense SwiGLU, or a mixture of experts
// where is_moe_layer(options, layer).
class LlamaBlockImpl : public torch::nn::Module {
 public:
  LlamaBlockImpl(const ModelOptions& options, int64_t layer, int64_t d_ff, bool materialize);
  torch::Tensor forward(const torch::Tensor& h, const RotaryTables& rope, const ContextParallel* context = nullptr);
  torch::Tensor forward_cached(const torch::Tensor& h, const RotaryTables& rope, torch::Tensor& k,
                               torch::Tensor& v);

 private:
  RMSNorm input_layernorm_{nullptr};
  LlamaAttention self_attn_{nullptr};
  RMSNorm post_attention_layernorm_{nullptr};
  torch::Tensor mlp(const torch::Tensor& x) { return moe_ ? moe_->forward(x) : mlp_->forward(x); }
  LlamaMlp mlp_{nullptr};
  MoeFeedForward moe_{nullptr};
};
TORCH_MODULE(LlamaBlock);

// The parameters under "model.": embed_tokens, layers, norm.
class LlamaBodyImpl : public torch::nn::Module {
 public:
  LlamaBodyImpl(const ModelOptions& options, int64_t d_ff, bool materialize);
  TokenEmbedding embed_tokens{nullptr};
  std::vector<LlamaBlock> blocks;  // registered as "layers"
  RMSNorm norm{nullptr};
};
TORCH_MODULE(LlamaBody);

class LlamaModelImpl : public LayeredModelImpl {
 public:
  // materialize false: every parameter has its shape and no storage until
  // init_parameter fills it. REQUIRES: options validated, kind llama.
  LlamaModelImpl(const ModelOptions& options, uint64_t seed, bool materialize);

  torch::Tensor embed(const torch::Tensor& tokens) override;
  int64_t num_blocks() const override;
  std::shared_ptr<torch::nn::Module> block(int64_t i) override;
  torch::Tensor block_forward(int64_t i, const torch::Tensor& h) override;
  torch::Tensor head(const torch::Tensor& h) override;
  void init_parameter(const std::string& name, const torch::Tensor& full) const override;
  std::vector<std::string> unit_names() const override;  // model.layers.N

  // Logits [B, T, vocab] of tokens [B, T] at positions [cache.length,
  // cache.length + T), attending to the cache, which grows by T. The same
  // logits as forward() on the whole sequence, up to rounding. Not for
  // training (no FSDP units, no activation checkpointing); positions may
  // run past model.seq_len.
  torch::Tensor forward_cached(const torch::Tensor& tokens, KvCache& cache);

  // Context parallelism (framework/cp): from now on every forward takes
  // this rank's tokens of each sequence (T_local = positions' length),
  // rotates them by their true positions and attends through
  // context.attention (the keys and values before the grouped-query
  // repeat, so only the key/value heads travel). Activation checkpointing
  // recomputes the attention with the block. A default ContextParallel
  // turns it off (generation runs on whole sequences).
  void set_context_parallel(ContextParallel context);

 private:
  const RotaryTables& rotary(int64_t len, const torch::Tensor& like);

  ModelOptions options_;
  uint64_t seed_;
  LlamaBody body_{nullptr};
  Projection lm_head_{nullptr};  // null when tied
  TiedOutput tied_head_{nullptr};  // when tied, registered as "lm_head" (no parameter)
  std::unordered_map<std::string, int64_t> param_index_;
  torch::Tensor inv_freq_;       // fp32, CPU
  RotaryTables rope_;            // cached for the last length, device and dtype
  ContextParallel context_;      // positions undefined: none
};

}  // namespace models
