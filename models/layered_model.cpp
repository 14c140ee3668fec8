#include "models/layered_model.h"

#include "models/activation_checkpoint.h"
#include "models/forward_hooks.h"
#include "models/layers.h"
#include "models/llama.h"
#include "models/stacked_model.h"

#include <ATen/CPUGeneratorImpl.h>

#include <mutex>
#include <stdexcept>

#include <algorithm>
#include <vector>

namespace models {

torch::Tensor LayeredModelImpl::forward(const torch::Tensor& tokens) {
  auto h = embed(tokens);
  // Each block is an FSDP unit when the model is sharded (a plain call when not).
  for (int64_t i = 0; i < num_blocks(); ++i) {
    h = run_unit(*block(i), [&] {
      if (!block_checkpointed(i)) return block_forward(i, h);
      return checkpoint_activations(
          [this, i](const torch::Tensor& x) { return block_forward(i, x); }, h);
    });
  }
  return head(h);
}

void LayeredModelImpl::init_parameter(const std::string& name, const torch::Tensor&) const {
  throw std::logic_error("this model is always built materialised; it cannot initialise " + name);
}

std::vector<std::string> LayeredModelImpl::unit_names() const {
  std::vector<std::string> out;  // the children of the ModuleList "blocks"
  for (int64_t i = 0; i < num_blocks(); ++i) out.push_back("blocks." + std::to_string(i));
  return out;
}

void LayeredModelImpl::set_activation_checkpointing(ActivationCheckpointing mode, int64_t every) {
  TORCH_CHECK(every >= 1, "model.activation_checkpointing_every must be >= 1, got ", every);
  checkpointing_ = mode;
  checkpoint_every_ = every;
}

bool LayeredModelImpl::block_checkpointed(int64_t i) const {
  switch (checkpointing_) {
    case ActivationCheckpointing::kNone: return false;
    case ActivationCheckpointing::kFull: return true;
    case ActivationCheckpointing::kSelective: return i % checkpoint_every_ == 0;
  }
  return false;
}

void validate_model_options(const ModelOptions& o) {
  TORCH_CHECK(o.kind == "gpt" || o.kind == "mlp" || o.kind == "llama",
              "model.kind must be gpt, mlp or llama, got '", o.kind, "'");
  TORCH_CHECK(o.vocab_size > 0, "model.vocab_size must be positive, got ", o.vocab_size);
  TORCH_CHECK(o.seq_len > 0, "model.seq_len must be positive, got ", o.seq_len);
  TORCH_CHECK(o.d_model > 0, "model.d_model must be positive, got ", o.d_model);
  TORCH_CHECK(o.n_layers > 0, "model.n_layers must be positive, got ", o.n_layers);
  TORCH_CHECK(o.d_ff >= 0, "model.d_ff must be >= 0 (0 means 4 * d_model), got ", o.d_ff);
  if (o.kind == "gpt" || o.kind == "llama") {
    TORCH_CHECK(o.n_heads > 0, "model.n_heads must be positive, got ", o.n_heads);
    TORCH_CHECK(o.d_model % o.n_heads == 0, "model.d_model (", o.d_model,
                ") must be divisible by model.n_heads (", o.n_heads, ")");
  }
  if (o.kind == "llama") {
    const int64_t kv = o.n_kv_heads > 0 ? o.n_kv_heads : o.n_heads;
    TORCH_CHECK(o.n_kv_heads >= 0, "model.n_kv_heads must be >= 0, got ", o.n_kv_heads);
    TORCH_CHECK(o.n_heads % kv == 0, "model.n_heads (", o.n_heads,
                ") must be divisible by model.n_kv_heads (", kv, ")");
    TORCH_CHECK((o.d_model / o.n_heads) % 2 == 0, "model.d_model / model.n_heads (",
                o.d_model / o.n_heads, ") must be even for rotary embeddings");
    TORCH_CHECK(o.rope_theta > 0, "model.rope_theta must be positive, got ", o.rope_theta);
    TORCH_CHECK(o.norm_eps > 0, "model.norm_eps must be positive, got ", o.norm_eps);
  }
}

std::shared_ptr<LayeredModelImpl> make_model(const ModelOptions& options, bool materialize) {
  validate_model_options(options);
  if (options.kind == "llama") {
    uint64_t seed = 0;
    {
      auto gen = at::detail::getDefaultCPUGenerator();
      std::lock_guard<std::mutex> lock(gen.mutex());
      seed = gen.get<at::CPUGeneratorImpl>()->random64();
    }
    auto model = std::make_shared<LlamaModelImpl>(options, seed, materialize);
    model->set_activation_checkpointing(options.activation_checkpointing,
                                        options.activation_checkpointing_every);
    return model;
  }
  const int64_t d_ff = options.d_ff > 0 ? options.d_ff : 4 * options.d_model;
  std::vector<std::shared_ptr<ResidualBlockImpl>> blocks;
  for (int64_t i = 0; i < options.n_layers; ++i) {
    if (options.kind == "gpt") {
      blocks.push_back(std::make_shared<GptBlockImpl>(options.d_model, options.n_heads, d_ff));
    } else {
      blocks.push_back(std::make_shared<MlpBlockImpl>(options.d_model, d_ff));
    }
  }
  auto model = std::make_shared<StackedModelImpl>(options, std::move(blocks));
  init_gpt2_style(*model);
  model->set_activation_checkpointing(options.activation_checkpointing,
                                      options.activation_checkpointing_every);
  return model;
}

ModelSize model_size(const ModelOptions& o) {
  const double d = static_cast<double>(o.d_model);
  const double f = o.d_ff > 0 ? static_cast<double>(o.d_ff) : 4 * d;
  const double v = static_cast<double>(o.vocab_size);
  const double s = static_cast<double>(o.seq_len);
  const double layer_norm = 2 * d;
  const double feed_forward = (d * f + f) + (f * d + d);
  double block = 0;
  double block_acts = 0;  // per token
  if (o.kind == "llama") {
    const double hd = d / static_cast<double>(o.n_heads);
    const double kv = static_cast<double>(o.n_kv_heads > 0 ? o.n_kv_heads : o.n_heads) * hd;
    const double ff = static_cast<double>(llama_d_ff(o));
    block = 2 * d + (d * d + 2 * d * kv + d * d) + 3 * d * ff;
    // norms, q k v (rotated and repeated), scores and softmax (per head,
    // per key; the matmul path), attention out, projections, the SwiGLU's
    // gate, up, activation and product, residuals
    block_acts = 12 * d + 4 * ff + 2 * static_cast<double>(o.n_heads) * s;
    const double rest = v * d + d + (o.tie_weights ? 0 : d * v);
    ModelSize size;
    size.parameters = rest + static_cast<double>(o.n_layers) * block;
    size.largest_unit = std::max(rest, block);
    size.largest_parameter = std::max(v * d, d * ff);
    size.activation_floats_per_sample =
        s * (static_cast<double>(o.n_layers) * block_acts + 2 * v + 3 * d);
    size.block_activation_floats_per_sample = s * block_acts;
    return size;
  }
  if (o.kind == "gpt") {
    const double attention = (d * 3 * d + 3 * d) + (d * d + d);
    block = 2 * layer_norm + attention + feed_forward;
    // norms, qkv, scores and softmax (per head, per key), attention out,
    // projections, the feed-forward's hidden and activation, residuals
    block_acts = 10 * d + 2 * f + 2 * static_cast<double>(o.n_heads) * s;
  } else {
    block = layer_norm + feed_forward;
    block_acts = 4 * d + 2 * f;
  }
  const double rest = v * d + s * d + layer_norm + (o.tie_weights ? 0 : d * v);
  ModelSize size;
  size.parameters = rest + static_cast<double>(o.n_layers) * block;
  size.largest_unit = std::max(rest, block);
  size.largest_parameter = std::max(v * d, d * f);
  size.block_activation_floats_per_sample = s * block_acts;
  // logits and their log-softmax, embeddings and final norm, per token
  size.activation_floats_per_sample =
      s * (static_cast<double>(o.n_layers) * block_acts + 2 * v + 3 * d);
  return size;
}

}  // namespace models
