#include "models/layered_model.h"

#include "framework/fsdp/fully_shard.h"
#include "models/layers.h"
#include "models/stacked_model.h"

#include <algorithm>
#include <vector>

namespace models {

torch::Tensor LayeredModelImpl::forward(const torch::Tensor& tokens) {
  auto h = embed(tokens);
  // Each block is an FSDP unit when the model is sharded (a plain call when not).
  for (int64_t i = 0; i < num_blocks(); ++i) {
    h = framework::fsdp::run_unit(*block(i), [&] { return block_forward(i, h); });
  }
  return head(h);
}

void validate_model_options(const ModelOptions& o) {
  TORCH_CHECK(o.kind == "gpt" || o.kind == "mlp", "model.kind must be gpt or mlp, got '", o.kind, "'");
  TORCH_CHECK(o.vocab_size > 0, "model.vocab_size must be positive, got ", o.vocab_size);
  TORCH_CHECK(o.seq_len > 0, "model.seq_len must be positive, got ", o.seq_len);
  TORCH_CHECK(o.d_model > 0, "model.d_model must be positive, got ", o.d_model);
  TORCH_CHECK(o.n_layers > 0, "model.n_layers must be positive, got ", o.n_layers);
  TORCH_CHECK(o.d_ff >= 0, "model.d_ff must be >= 0 (0 means 4 * d_model), got ", o.d_ff);
  if (o.kind == "gpt") {
    TORCH_CHECK(o.n_heads > 0, "model.n_heads must be positive, got ", o.n_heads);
    TORCH_CHECK(o.d_model % o.n_heads == 0, "model.d_model (", o.d_model,
                ") must be divisible by model.n_heads (", o.n_heads, ")");
  }
}

std::shared_ptr<LayeredModelImpl> make_model(const ModelOptions& options) {
  validate_model_options(options);
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
  // logits and their log-softmax, embeddings and final norm, per token
  size.activation_floats_per_sample =
      s * (static_cast<double>(o.n_layers) * block_acts + 2 * v + 3 * d);
  return size;
}

}  // namespace models
