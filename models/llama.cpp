#include "models/llama.h"

#include "comm/torch_compat.h"
#include "models/forward_hooks.h"
#include "models/lora_names.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>

namespace models {

torch::Tensor make_param(std::vector<int64_t> sizes, bool materialize) {
  torch::Tensor t = torch::empty(sizes);
  if (!materialize) {
    c10::StorageImpl* impl = t.storage().unsafeGetStorageImpl();
    impl->set_data_ptr_noswap(at::DataPtr(nullptr, t.device()));
    impl->set_nbytes(0);
  }
  return t;
}

namespace {

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

}  // namespace

bool is_lora_parameter(const std::string& name) { return lora_parameter(name).has_value(); }

RMSNormImpl::RMSNormImpl(int64_t dim, double eps, bool materialize)
    : eps_(eps), weight_(register_parameter("weight", make_param({dim}, materialize))) {}

torch::Tensor RMSNormImpl::forward(const torch::Tensor& x) {
  if (fused_ && comm::compat::kHasRmsNorm) {
    return comm::compat::rms_norm(x, weight_, eps_);
  }
  torch::Tensor xf = x.to(torch::kFloat);
  xf = xf * torch::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps_);
  return weight_ * xf.to(x.scalar_type());
}

void use_fused_kernels(torch::nn::Module& root, bool fused) {
  for (const std::shared_ptr<torch::nn::Module>& m : root.modules(/*include_self=*/true)) {
    if (auto* norm = dynamic_cast<RMSNormImpl*>(m.get())) norm->set_fused(fused);
  }
}

std::string llama_fused_ops_description() {
  return std::string(comm::compat::kHasRmsNorm ? "rms_norm (LibTorch's op)"
                                                          : "rms_norm composed (LibTorch < 2.4)") +
         ", cross-entropy in row chunks";
}

namespace {

// Rows per chunk: about 64 MiB of fp32 logits at a time.
int64_t cross_entropy_chunk_rows(int64_t vocab) {
  return std::max<int64_t>(1, (int64_t{64} << 20) / (4 * std::max<int64_t>(vocab, 1)));
}

class FusedCrossEntropySum : public torch::autograd::Function<FusedCrossEntropySum> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& logits,
                               const torch::Tensor& targets, int64_t ignore_index, int64_t rows) {
    const int64_t n = logits.size(0);
    ctx->saved_data["rows"] = rows;
    torch::Tensor valid = targets != ignore_index;
    torch::Tensor safe = targets.masked_fill(valid.logical_not(), 0).unsqueeze(1);
    torch::Tensor lse = torch::empty({n}, logits.options().dtype(torch::kFloat));
    torch::Tensor total = torch::zeros({}, logits.options().dtype(torch::kFloat));
    for (int64_t r = 0; r < n; r += rows) {
      const int64_t len = std::min(rows, n - r);
      torch::Tensor lf = logits.narrow(0, r, len).to(torch::kFloat);
      torch::Tensor chunk_lse = torch::logsumexp(lf, 1);
      lse.narrow(0, r, len).copy_(chunk_lse);
      torch::Tensor picked = lf.gather(1, safe.narrow(0, r, len)).squeeze(1);
      total.add_(((chunk_lse - picked) * valid.narrow(0, r, len)).sum());
    }
    ctx->save_for_backward({logits, lse, safe, valid});
    return total;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const torch::Tensor& logits = saved[0];
    const torch::Tensor& lse = saved[1];
    const torch::Tensor& safe = saved[2];
    const torch::Tensor& valid = saved[3];
    const torch::Tensor scale = grad_outputs[0].to(torch::kFloat);
    const int64_t n = logits.size(0);
    const int64_t rows = ctx->saved_data["rows"].toInt();
    torch::Tensor grad = torch::empty_like(logits);
    for (int64_t r = 0; r < n; r += rows) {
      const int64_t len = std::min(rows, n - r);
      // d/dlogits of (lse - logit[target]) = softmax - one-hot, per valid row.
      torch::Tensor g = (logits.narrow(0, r, len).to(torch::kFloat) - lse.narrow(0, r, len).unsqueeze(1)).exp_();
      g.scatter_add_(1, safe.narrow(0, r, len),
                     torch::full({len, 1}, -1.0, g.options()));
      g.mul_((valid.narrow(0, r, len).to(torch::kFloat) * scale).unsqueeze(1));
      grad.narrow(0, r, len).copy_(g);
    }
    return {grad, torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor fused_cross_entropy_sum(const torch::Tensor& logits, const torch::Tensor& targets,
                                      int64_t ignore_index, int64_t chunk_rows) {
  TORCH_CHECK(logits.dim() == 2 && targets.dim() == 1 && targets.size(0) == logits.size(0),
              "fused_cross_entropy_sum: logits [N, V] and targets [N], got ", logits.sizes(), " and ",
              targets.sizes());
  TORCH_CHECK(chunk_rows >= 0, "fused_cross_entropy_sum: chunk_rows must be >= 0, got ", chunk_rows);
  return FusedCrossEntropySum::apply(logits, targets, ignore_index,
                                     chunk_rows > 0 ? chunk_rows : cross_entropy_chunk_rows(logits.size(1)));
}

TokenEmbeddingImpl::TokenEmbeddingImpl(int64_t vocab, int64_t dim, bool materialize)
    : weight_(register_parameter("weight", make_param({vocab, dim}, materialize))) {}

torch::Tensor TokenEmbeddingImpl::forward(const torch::Tensor& tokens) {
  return call_with_hook(*this, tokens, [this](const torch::Tensor& ids) {
    return torch::embedding(weight_, ids);
  });
}

torch::Tensor TiedOutputImpl::forward(const torch::Tensor& x) {
  return call_with_hook(*this, x, [this](const torch::Tensor& in) {
    return torch::nn::functional::linear(in, embedding_->weight());
  });
}

ProjectionImpl::ProjectionImpl(int64_t in, int64_t out, bool materialize)
    : weight_(register_parameter("weight", make_param({out, in}, materialize))) {}

void ProjectionImpl::add_lora(int64_t rank, double scale, double dropout, bool materialize) {
  TORCH_CHECK(!lora_A_, "Projection: LoRA added twice");
  const int64_t out = weight_.size(0), in = weight_.size(1);
  lora_A_ = register_module("lora_A", std::make_shared<ProjectionImpl>(in, rank, materialize));
  lora_B_ = register_module("lora_B", std::make_shared<ProjectionImpl>(rank, out, materialize));
  lora_scale_ = scale;
  lora_dropout_ = dropout;
}

torch::Tensor ProjectionImpl::forward(const torch::Tensor& x) {
  torch::Tensor y = call_with_hook(*this, x, [this](const torch::Tensor& in) {
    return torch::nn::functional::linear(in, weight_);
  });
  if (!lora_A_) return y;
  const torch::Tensor in = lora_dropout_ > 0 && is_training() ? torch::dropout(x, lora_dropout_, true) : x;
  return y + lora_B_->forward(lora_A_->forward(in)) * lora_scale_;
}

torch::Tensor rope_inverse_frequencies(const ModelOptions& o) {
  const int64_t head_dim = llama_head_dim(o);
  torch::Tensor exponents = torch::arange(0, head_dim, 2, torch::kFloat) / static_cast<double>(head_dim);
  torch::Tensor inv_freq = 1.0 / torch::pow(torch::full({}, o.rope_theta, torch::kFloat), exponents);
  const RopeScalingOptions& s = o.rope_scaling;
  if (s.factor <= 0) return inv_freq;
  // Llama 3.1: long wavelengths divided by factor, short ones kept, a smooth
  // blend between (Hugging Face's _compute_llama3_parameters).
  const double old_len = static_cast<double>(s.original_max_position);
  const double low_freq_wavelen = old_len / s.low_freq_factor;
  const double high_freq_wavelen = old_len / s.high_freq_factor;
  torch::Tensor wavelen = 2 * M_PI / inv_freq;
  torch::Tensor scaled = torch::where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq);
  torch::Tensor smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
  torch::Tensor blended = (1 - smooth) * scaled / s.factor + smooth * scaled;
  torch::Tensor medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen);
  return torch::where(medium, blended, scaled);
}

torch::Tensor apply_rotary(const torch::Tensor& x, const RotaryTables& rope) {
  const int64_t half = x.size(-1) / 2;
  torch::Tensor rotated = torch::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
  return x * rope.cos + rotated * rope.sin;
}

LlamaAttentionImpl::LlamaAttentionImpl(const ModelOptions& o, bool materialize)
    : n_heads_(o.n_heads),
      n_kv_heads_(o.n_kv_heads > 0 ? o.n_kv_heads : o.n_heads),
      head_dim_(llama_head_dim(o)) {
  q_proj_ = register_module("q_proj", Projection(o.d_model, n_heads_ * head_dim_, materialize));
  k_proj_ = register_module("k_proj", Projection(o.d_model, n_kv_heads_ * head_dim_, materialize));
  v_proj_ = register_module("v_proj", Projection(o.d_model, n_kv_heads_ * head_dim_, materialize));
  o_proj_ = register_module("o_proj", Projection(n_heads_ * head_dim_, o.d_model, materialize));
  if (o.qk_norm) {
    q_norm_ = register_module("q_norm", RMSNorm(head_dim_, o.norm_eps, materialize));
    k_norm_ = register_module("k_norm", RMSNorm(head_dim_, o.norm_eps, materialize));
  }
}

torch::Tensor LlamaAttentionImpl::rotate_q(const torch::Tensor& q, const RotaryTables& rope) {
  return apply_rotary(q_norm_ ? q_norm_->forward(q) : q, rope);
}

torch::Tensor LlamaAttentionImpl::rotate_k(const torch::Tensor& k, const RotaryTables& rope) {
  return apply_rotary(k_norm_ ? k_norm_->forward(k) : k, rope);
}

torch::Tensor LlamaAttentionImpl::forward(const torch::Tensor& x, const RotaryTables& rope,
                                          const ContextParallel* context) {
  const int64_t batch = x.size(0), len = x.size(1);
  // Head counts come from the projections' outputs: under tensor
  // parallelism each rank computes n_heads / tensor query heads and
  // n_kv_heads / tensor key/value heads (column-parallel q, k, v).
  auto heads = [&](const torch::Tensor& t) {
    return t.view({batch, len, -1, head_dim_}).transpose(1, 2);  // [B, n, T, hd]
  };
  torch::Tensor q = rotate_q(heads(q_proj_->forward(x)), rope);
  torch::Tensor k = rotate_k(heads(k_proj_->forward(x)), rope);
  torch::Tensor v = heads(v_proj_->forward(x));
  const int64_t local_heads = q.size(1), local_kv = k.size(1);
  if (context != nullptr) {
    // The whole sequence's attention over the context group; it expands
    // the key/value heads where it uses them.
    torch::Tensor out = context->attention(q, k, v);  // [B, H, T, hd]
    return o_proj_->forward(out.transpose(1, 2).reshape({batch, len, local_heads * head_dim_}));
  }
  if (local_kv != local_heads) {
    // Query head h reads key/value head h / group (Hugging Face's repeat_kv).
    const int64_t group = local_heads / local_kv;
    auto repeat = [&](const torch::Tensor& t) {
      return t.unsqueeze(2).expand({batch, local_kv, group, len, head_dim_})
          .reshape({batch, local_heads, len, head_dim_});
    };
    k = repeat(k);
    v = repeat(v);
  }
  torch::Tensor out = comm::compat::causal_attention(q, k, v);  // [B, H, T, hd]
  return o_proj_->forward(out.transpose(1, 2).reshape({batch, len, local_heads * head_dim_}));
}

torch::Tensor LlamaAttentionImpl::forward_cached(const torch::Tensor& x, const RotaryTables& rope,
                                                 torch::Tensor& k_cache, torch::Tensor& v_cache) {
  const int64_t batch = x.size(0), len = x.size(1);
  auto heads = [&](const torch::Tensor& t, int64_t n) {
    return t.view({batch, len, n, head_dim_}).transpose(1, 2);  // [B, n, T, hd]
  };
  torch::Tensor q = rotate_q(heads(q_proj_->forward(x), n_heads_), rope);
  torch::Tensor k = rotate_k(heads(k_proj_->forward(x), n_kv_heads_), rope);
  torch::Tensor v = heads(v_proj_->forward(x), n_kv_heads_);
  const int64_t past = k_cache.defined() ? k_cache.size(2) : 0;
  k_cache = past > 0 ? torch::cat({k_cache, k}, 2) : k;
  v_cache = past > 0 ? torch::cat({v_cache, v}, 2) : v;
  const int64_t total = past + len;
  // Query head h reads key/value head h / group, as in forward.
  const int64_t group = n_heads_ / n_kv_heads_;
  torch::Tensor keys = k_cache.unsqueeze(2).expand({batch, n_kv_heads_, group, total, head_dim_})
                           .reshape({batch, n_heads_, total, head_dim_});
  torch::Tensor values = v_cache.unsqueeze(2).expand({batch, n_kv_heads_, group, total, head_dim_})
                             .reshape({batch, n_heads_, total, head_dim_});
  torch::Tensor scores = torch::matmul(q.to(torch::kFloat), keys.to(torch::kFloat).transpose(-2, -1)) /
                         std::sqrt(static_cast<double>(head_dim_));
  if (len > 1) {  // new position i (absolute past + i) sees keys 0 .. past + i
    torch::Tensor allowed = torch::arange(total).unsqueeze(0) <= (torch::arange(len) + past).unsqueeze(1);
    scores = scores.masked_fill(allowed.logical_not().to(scores.device()), -std::numeric_limits<float>::infinity());
  }
  torch::Tensor out = torch::matmul(torch::softmax(scores, -1), values.to(torch::kFloat)).to(x.scalar_type());
  return o_proj_->forward(out.transpose(1, 2).reshape({batch, len, n_heads_ * head_dim_}));
}

LlamaMlpImpl::LlamaMlpImpl(int64_t d_model, int64_t d_ff, bool materialize)
    : gate_proj_(register_module("gate_proj", Projection(d_model, d_ff, materialize))),
      up_proj_(register_module("up_proj", Projection(d_model, d_ff, materialize))),
      down_proj_(register_module("down_proj", Projection(d_ff, d_model, materialize))) {}

torch::Tensor LlamaMlpImpl::forward(const torch::Tensor& x) {
  return down_proj_->forward(torch::silu(gate_proj_->forward(x)) * up_proj_->forward(x));
}

LlamaBlockImpl::LlamaBlockImpl(const ModelOptions& o, int64_t layer, int64_t d_ff, bool materialize)
    : input_layernorm_(register_module("input_layernorm", RMSNorm(o.d_model, o.norm_eps, materialize))),
      self_attn_(register_module("self_attn", LlamaAttention(o, materialize))),
      post_attention_layernorm_(
          register_module("post_attention_layernorm", RMSNorm(o.d_model, o.norm_eps, materialize))) {
  if (is_moe_layer(o, layer)) {
    moe_ = register_module("mlp", MoeFeedForward(o, materialize));
  } else {
    mlp_ = register_module("mlp", LlamaMlp(o.d_model, d_ff, materialize));
  }
}

torch::Tensor LlamaBlockImpl::forward(const torch::Tensor& x, const RotaryTables& rope,
                                      const ContextParallel* context) {
  torch::Tensor h = x + self_attn_->forward(input_layernorm_->forward(x), rope, context);
  return h + mlp(post_attention_layernorm_->forward(h));
}

torch::Tensor LlamaBlockImpl::forward_cached(const torch::Tensor& x, const RotaryTables& rope,
                                             torch::Tensor& k, torch::Tensor& v) {
  torch::Tensor h = x + self_attn_->forward_cached(input_layernorm_->forward(x), rope, k, v);
  return h + mlp(post_attention_layernorm_->forward(h));
}

LlamaBodyImpl::LlamaBodyImpl(const ModelOptions& o, int64_t d_ff, bool materialize) {
  // Registration order is parameter order: embed_tokens, layers, norm.
  embed_tokens = register_module("embed_tokens", TokenEmbedding(o.vocab_size, o.d_model, materialize));
  auto layers = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < o.n_layers; ++i) {
    blocks.push_back(LlamaBlock(o, i, d_ff, materialize));
    layers->push_back(blocks.back());
  }
  norm = register_module("norm", RMSNorm(o.d_model, o.norm_eps, materialize));
}

LlamaModelImpl::LlamaModelImpl(const ModelOptions& options, uint64_t seed, bool materialize)
    : options_(options), seed_(seed) {
  const int64_t d_ff = llama_d_ff(options);
  body_ = register_module("model", LlamaBody(options, d_ff, materialize));
  if (!options.tie_weights) {
    lm_head_ = register_module("lm_head", Projection(options.d_model, options.vocab_size, materialize));
  } else {
    tied_head_ = register_module("lm_head", TiedOutput(body_->embed_tokens.ptr()));
  }
  if (options.lora.rank > 0) {
    // Adapters on the targeted projections of every block; everything else
    // frozen.
    const std::vector<std::string> targets = lora_targets(options.lora);
    const double scale = options.lora.alpha / static_cast<double>(options.lora.rank);
    for (const auto& item : named_modules("", /*include_self=*/false)) {
      auto* proj = dynamic_cast<ProjectionImpl*>(item.value().get());
      const std::string& name = item.key();
      const size_t dot = name.rfind('.');
      if (proj == nullptr || name.rfind("model.layers.", 0) != 0 || dot == std::string::npos) continue;
      if (std::find(targets.begin(), targets.end(), name.substr(dot + 1)) == targets.end()) continue;
      proj->add_lora(options.lora.rank, scale, options.lora.dropout, materialize);
    }
  }
  // The base parameters first, so that each draws the values it draws
  // without LoRA (step 0 is the base model), then the adapters.
  int64_t index = 0;
  for (bool adapters : {false, true}) {
    for (const auto& item : named_parameters()) {
      if (is_lora_parameter(item.key()) != adapters) continue;
      param_index_.emplace(item.key(), index++);
      if (options.lora.rank > 0 && !adapters) item.value().requires_grad_(false);
    }
  }
  inv_freq_ = rope_inverse_frequencies(options);
  if (materialize) {
    torch::NoGradGuard no_grad;
    for (const auto& item : named_parameters()) init_parameter(item.key(), item.value());
  }
}

void LlamaModelImpl::init_parameter(const std::string& name, const torch::Tensor& full) const {
  auto it = param_index_.find(name);
  if (it == param_index_.end()) {
    throw std::invalid_argument("llama: no parameter named '" + name + "'");
  }
  torch::NoGradGuard no_grad;
  if (ends_with(name, "norm.weight")) {  // input_layernorm, post_attention_layernorm, norm
    full.fill_(1.0);
    return;
  }
  if (ends_with(name, "lora_B.weight")) {  // the base model at step 0
    full.zero_();
    return;
  }
  double std = 0.02;
  if (ends_with(name, "o_proj.weight") || ends_with(name, "down_proj.weight")) {  // experts' too
    std /= std::sqrt(2.0 * static_cast<double>(options_.n_layers));
  }
  // splitmix64 of (seed, index): one independent stream per parameter.
  uint64_t z = seed_ + 0x9E3779B97F4A7C15ULL * static_cast<uint64_t>(it->second + 1);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  z ^= z >> 31;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(z);
  // lora_A: PEFT's kaiming_uniform(a = sqrt(5)), U(-1/sqrt(in), 1/sqrt(in)).
  const bool lora_a = ends_with(name, "lora_A.weight");
  const double bound = lora_a ? 1.0 / std::sqrt(static_cast<double>(full.size(1))) : 0.0;
  auto draw = [&](torch::Tensor t) { return lora_a ? t.uniform_(-bound, bound, gen) : t.normal_(0.0, std, gen); };
  if (full.device().is_cpu()) {
    draw(full);
  } else {
    // The same values on any device: drawn on the CPU.
    full.copy_(draw(torch::empty(full.sizes(), full.options().device(torch::kCPU))));
  }
}

torch::Tensor LlamaModelImpl::embed(const torch::Tensor& tokens) {
  TORCH_CHECK(tokens.dim() == 2, "embed: tokens must be [batch, seq], got ", tokens.sizes());
  TORCH_CHECK(tokens.size(1) <= options_.seq_len, "embed: sequence length ", tokens.size(1),
              " exceeds model.seq_len ", options_.seq_len);
  return body_->embed_tokens->forward(tokens);
}

std::vector<std::string> LlamaModelImpl::unit_names() const {
  std::vector<std::string> out;
  for (int64_t i = 0; i < num_blocks(); ++i) out.push_back("model.layers." + std::to_string(i));
  return out;
}

int64_t LlamaModelImpl::num_blocks() const { return static_cast<int64_t>(body_->blocks.size()); }

std::shared_ptr<torch::nn::Module> LlamaModelImpl::block(int64_t i) {
  TORCH_CHECK(i >= 0 && i < num_blocks(), "block index ", i, " out of range [0, ", num_blocks(), ")");
  return body_->blocks[i].ptr();
}

void LlamaModelImpl::set_context_parallel(ContextParallel context) {
  TORCH_CHECK(!context.positions.defined() || (context.positions.dim() == 1 && context.attention),
              "set_context_parallel: positions [T_local] and an attention function, got positions ",
              context.positions.sizes());
  for (MoeFeedForwardImpl* moe : moe_layers(*this)) {
    // A mixture of experts counts its auxiliary loss's expert shares over
    // the whole sequence.
    if (context.positions.defined()) {
      moe->set_context_parallel(context.degree, context.sum_over_group);
    } else {
      moe->set_context_parallel(1, nullptr);
    }
  }
  context_ = std::move(context);
  rope_ = {};  // the positions changed
}

const RotaryTables& LlamaModelImpl::rotary(int64_t len, const torch::Tensor& like) {
  const bool split = context_.positions.defined();
  TORCH_CHECK(!split || context_.positions.size(0) == len, "llama: context parallelism holds ",
              context_.positions.size(0), " tokens of each sequence, the input has ", len);
  if (!rope_.cos.defined() || rope_.cos.size(0) != len || rope_.cos.device() != like.device() ||
      rope_.cos.scalar_type() != like.scalar_type()) {
    // Angles in fp32 on the CPU (the same on every device), then cast; a
    // context-parallel rank's tokens at their true positions.
    torch::Tensor positions = split ? context_.positions.to(torch::kFloat) : torch::arange(len, torch::kFloat);
    torch::Tensor freqs = torch::outer(positions, inv_freq_);
    torch::Tensor angles = torch::cat({freqs, freqs}, -1);  // [T, hd]
    auto opts = like.options().requires_grad(false);
    rope_.cos = angles.cos().to(opts);
    rope_.sin = angles.sin().to(opts);
  }
  return rope_;
}

torch::Tensor LlamaModelImpl::block_forward(int64_t i, const torch::Tensor& h) {
  TORCH_CHECK(i >= 0 && i < num_blocks(), "block index ", i, " out of range [0, ", num_blocks(), ")");
  return body_->blocks[i]->forward(h, rotary(h.size(1), h), context_.positions.defined() ? &context_ : nullptr);
}

torch::Tensor LlamaModelImpl::forward_cached(const torch::Tensor& tokens, KvCache& cache) {
  TORCH_CHECK(tokens.dim() == 2, "forward_cached: tokens must be [batch, seq], got ", tokens.sizes());
  const int64_t len = tokens.size(1);
  torch::Tensor h = body_->embed_tokens->forward(tokens);
  // Angles of positions [cache.length, cache.length + len), as rotary() makes them.
  torch::Tensor positions = torch::arange(cache.length, cache.length + len, torch::kFloat);
  torch::Tensor freqs = torch::outer(positions, inv_freq_);
  torch::Tensor angles = torch::cat({freqs, freqs}, -1);
  auto opts = h.options().requires_grad(false);
  const RotaryTables rope{angles.cos().to(opts), angles.sin().to(opts)};
  cache.k.resize(static_cast<size_t>(num_blocks()));
  cache.v.resize(static_cast<size_t>(num_blocks()));
  for (int64_t i = 0; i < num_blocks(); ++i) {
    h = body_->blocks[i]->forward_cached(h, rope, cache.k[i], cache.v[i]);
  }
  cache.length += len;
  return head(h);
}

torch::Tensor LlamaModelImpl::head(const torch::Tensor& h) {
  torch::Tensor x = body_->norm->forward(h);
  if (lm_head_) return lm_head_->forward(x);
  return tied_head_->forward(x);
}

}  // namespace models
