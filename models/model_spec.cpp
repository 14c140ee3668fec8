#include "models/model_spec.h"

#include "models/layers.h"
#include "models/llama.h"
#include "models/stacked_model.h"

#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <stdexcept>

namespace models {

LossSum token_cross_entropy(LayeredModelImpl& model, const torch::Tensor& inputs,
                            const torch::Tensor& targets, const LossContext& context) {
  const torch::Tensor counted = (targets != context.ignore_index).sum();
  if (context.vocab_parallel_cross_entropy) {
    torch::Tensor logits = model.forward(inputs).to(torch::kFloat);
    torch::Tensor per_token = context.vocab_parallel_cross_entropy(
        logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}));
    return {per_token.sum(), counted};
  }
  if (context.fused_kernels) {
    // fp32 one chunk of rows at a time (train.fused_kernels).
    torch::Tensor logits = model.forward(inputs);
    return {fused_cross_entropy_sum(logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}),
                                    context.ignore_index),
            counted};
  }
  // The loss and its softmax in fp32, whatever the compute dtype.
  torch::Tensor logits = model.forward(inputs).to(torch::kFloat);
  torch::Tensor sum = torch::nn::functional::cross_entropy(
      logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}),
      torch::nn::functional::CrossEntropyFuncOptions()
          .ignore_index(context.ignore_index)
          .reduction(torch::kSum));
  return {sum, counted};
}

TpPlan llama_tp_plan() {
  return {
      {"model.embed_tokens", TpStyle::kRowwise},
      {"model.layers.*.self_attn.q_proj", TpStyle::kColwise},
      {"model.layers.*.self_attn.k_proj", TpStyle::kColwise},
      {"model.layers.*.self_attn.v_proj", TpStyle::kColwise},
      {"model.layers.*.self_attn.o_proj", TpStyle::kRowwise},
      {"model.layers.*.mlp.gate_proj", TpStyle::kColwise},
      {"model.layers.*.mlp.up_proj", TpStyle::kColwise},
      {"model.layers.*.mlp.down_proj", TpStyle::kRowwise},
      {"lm_head", TpStyle::kColwise},
      // model.qk_norm: each rank normalises its own heads.
      {"model.layers.*.self_attn.q_norm", TpStyle::kSumGrads},
      {"model.layers.*.self_attn.k_norm", TpStyle::kSumGrads},
  };
}

namespace {

// ---------------------------------------------------------------- every kind

// 6 x the parameters that multiply + 12 x layers x attention width x
// seq_len (attention's scores and weighted sum, forward and backward; the
// width is n_heads x head_dim, PaLM's H x Q): PaLM's estimate, as torchtitan
// counts it. `lookup`: embedding parameters that are looked up, not
// multiplied (a tied output projection multiplies them). `attention_width`
// 0: no attention.
double palm_flops_per_token(const ModelOptions& o, double parameters, double lookup,
                            double attention_width) {
  const double matmul = parameters - lookup;
  const double attn = 12.0 * static_cast<double>(o.n_layers) * attention_width * static_cast<double>(o.seq_len);
  return 6.0 * matmul + attn;
}

// ---------------------------------------------------------------- gpt, mlp

std::shared_ptr<LayeredModelImpl> build_stacked(const ModelOptions& options, bool gpt) {
  const int64_t d_ff = options.d_ff > 0 ? options.d_ff : 4 * options.d_model;
  std::vector<std::shared_ptr<ResidualBlockImpl>> blocks;
  for (int64_t i = 0; i < options.n_layers; ++i) {
    if (gpt) {
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

ModelSize stacked_size(const ModelOptions& o, bool gpt) {
  const double d = static_cast<double>(o.d_model);
  const double f = o.d_ff > 0 ? static_cast<double>(o.d_ff) : 4 * d;
  const double v = static_cast<double>(o.vocab_size);
  const double s = static_cast<double>(o.seq_len);
  const double layer_norm = 2 * d;
  const double feed_forward = (d * f + f) + (f * d + d);
  double block = 0;
  double block_acts = 0;  // per token
  if (gpt) {
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

ModelSpec stacked_spec(bool gpt) {
  ModelSpec spec;
  spec.kind = gpt ? "gpt" : "mlp";
  spec.description = gpt ? "GPT-2 style: learned positions, LayerNorm, multi-head attention, GELU MLP"
                         : "residual MLP blocks (no attention), learned positions";
  spec.build = [gpt](const ModelOptions& o, bool) { return build_stacked(o, gpt); };
  spec.size = [gpt](const ModelOptions& o) { return stacked_size(o, gpt); };
  spec.flops_per_token = [gpt](const ModelOptions& o) {
    const double d = static_cast<double>(o.d_model);
    // Token and position embeddings are looked up; a tied output projection
    // multiplies the token embedding.
    const double lookup = static_cast<double>(o.seq_len) * d +
                          (o.tie_weights ? 0.0 : static_cast<double>(o.vocab_size) * d);
    return palm_flops_per_token(o, stacked_size(o, gpt).parameters, lookup, gpt ? d : 0.0);
  };
  spec.embeds_parameter = [](const std::string& name) {
    return name.rfind("tok_emb.", 0) == 0 || name.rfind("pos_emb.", 0) == 0;
  };
  return spec;
}

// ---------------------------------------------------------------- llama

std::shared_ptr<LayeredModelImpl> build_llama(const ModelOptions& options, bool materialize) {
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

ModelSize llama_size(const ModelOptions& o) {
  const double d = static_cast<double>(o.d_model);
  const double v = static_cast<double>(o.vocab_size);
  const double s = static_cast<double>(o.seq_len);
  const double hd = static_cast<double>(llama_head_dim(o));
  const double q = static_cast<double>(llama_attention_width(o));  // n_heads * head_dim
  const double kv = static_cast<double>(o.n_kv_heads > 0 ? o.n_kv_heads : o.n_heads) * hd;
  const double ff = static_cast<double>(llama_d_ff(o));
  const double attention = 2 * d + (d * q + 2 * d * kv + q * d) + (o.qk_norm ? 2 * hd : 0);
  double block = attention + 3 * d * ff;
  // norms, q k v (rotated and repeated), scores and softmax (per head, per
  // key; the matmul path), attention out, projections, the SwiGLU's gate,
  // up, activation and product, residuals: the q/k/v and attention-out
  // ones are q wide (n_heads * head_dim), the rest d_model
  const double attention_acts = 6 * d + 6 * q + 2 * static_cast<double>(o.n_heads) * s;
  double block_acts = attention_acts + 4 * ff;
  double largest_parameter = std::max(d * ff, d * q);
  if (o.moe.num_experts > 0) {
    // A mixture of experts: the router, every expert, the shared ones; each
    // token's rows are copied k times into the experts (input, SwiGLU
    // parts, output), plus the router's scores.
    const double E = static_cast<double>(o.moe.num_experts), k = static_cast<double>(o.moe.top_k);
    const double fe = static_cast<double>(moe_expert_d_ff(o));
    const double shared = static_cast<double>(o.moe.num_shared_experts) * fe;
    block = std::max(block, attention + E * d + E * 3 * d * fe + 3 * d * shared);
    block_acts = std::max(block_acts, attention_acts + k * (2 * d + 4 * fe) + 4 * shared + 3 * E);
    largest_parameter = std::max(largest_parameter, E * d * fe);
  }
  const double rest = v * d + d + (o.tie_weights ? 0 : d * v);
  const ParameterCounts counts = llama_parameter_counts(o);
  ModelSize size;
  size.parameters = counts.total;
  size.active_parameters = counts.active;
  size.largest_unit = std::max(rest, block);
  size.largest_block = block;
  size.outside_blocks = rest;
  if (o.moe.num_experts > 0) {
    size.routed_experts_per_block = static_cast<double>(o.moe.num_experts) * 3 * d * static_cast<double>(moe_expert_d_ff(o));
  }
  size.largest_parameter = std::max(v * d, largest_parameter);
  size.activation_floats_per_sample = s * (static_cast<double>(o.n_layers) * block_acts + 2 * v + 3 * d);
  size.block_activation_floats_per_sample = s * block_acts;
  return size;
}

ModelSpec llama_spec() {
  ModelSpec spec;
  spec.kind = "llama";
  spec.description = "Llama 3: RMSNorm, RoPE, grouped-query attention, SwiGLU; Hugging Face names";
  spec.build = build_llama;
  spec.lazy_init = true;
  spec.ties_weights_by_default = false;
  spec.size = llama_size;
  spec.flops_per_token = [](const ModelOptions& o) {
    const double embedding = static_cast<double>(o.vocab_size) * static_cast<double>(o.d_model);
    // A mixture of experts multiplies by its active parameters only.
    return palm_flops_per_token(o, llama_size(o).active_parameters, o.tie_weights ? 0.0 : embedding,
                                static_cast<double>(llama_attention_width(o)));
  };
  spec.tp_plan = llama_tp_plan();
  spec.embeds_parameter = [](const std::string& name) { return name.rfind("model.embed_tokens.", 0) == 0; };
  spec.use_fused_kernels = [](LayeredModelImpl& model, bool on) { models::use_fused_kernels(model, on); };
  spec.fused_kernels_description = llama_fused_ops_description;
  spec.set_context_parallel = [](LayeredModelImpl& model, const ContextParallel& context) {
    dynamic_cast<LlamaModelImpl&>(model).set_context_parallel(context);
  };
  if (const HfAdapter* hf = find_hf_adapter("llama")) spec.hf = *hf;
  return spec;
}

// ---------------------------------------------------------------- registry

struct SpecRegistry {
  std::mutex mutex;
  std::map<std::string, ModelSpec> specs;
  SpecRegistry() {
    for (ModelSpec spec : {stacked_spec(true), stacked_spec(false), llama_spec()}) {
      specs.emplace(spec.kind, std::move(spec));
    }
  }
};

SpecRegistry& spec_registry() {
  static SpecRegistry r;  // built on first use: no static-initialisation order
  return r;
}

}  // namespace

void register_model_spec(ModelSpec spec) {
  if (spec.kind.empty() || !spec.build || !spec.size || !spec.loss) {
    throw std::invalid_argument("register_model_spec: a spec needs its kind, build, size and loss (kind '" +
                                spec.kind + "')");
  }
  ModelCheck check;
  if (spec.validate) {
    // The config runs it at load, torch-free (models/options.h): its
    // c10::Error becomes the std::invalid_argument the config reports.
    check = [validate = spec.validate](const ModelOptions& o, int64_t, const KeyNamer&) {
      try {
        validate(o);
      } catch (const c10::Error& e) {
        throw std::invalid_argument(e.what_without_backtrace());
      }
    };
  }
  register_model_kind(spec.kind, std::move(check), spec.ties_weights_by_default);
  if (spec.hf) register_hf_adapter(spec.kind, *spec.hf);
  SpecRegistry& r = spec_registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.specs[spec.kind] = std::move(spec);
}

bool has_model_spec(const std::string& kind) {
  SpecRegistry& r = spec_registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  return r.specs.count(kind) != 0;
}

const ModelSpec& find_model_spec(const std::string& kind) {
  SpecRegistry& r = spec_registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto it = r.specs.find(kind);
  if (it != r.specs.end()) return it->second;
  std::string known;
  for (const auto& [name, spec] : r.specs) known += (known.empty() ? "" : ", ") + name;
  throw std::invalid_argument("model.kind '" + kind + "' is not a registered model (" + known + ")");
}

void check_tensor_parallel_plan(const ModelOptions& o, int64_t tensor) {
  if (tensor <= 1 || !find_model_spec(o.kind).tp_plan.empty()) return;
  throw std::invalid_argument("parallel.tensor " + std::to_string(tensor) + " needs model.kind llama (model.kind is " +
                              o.kind + ", which has no tensor-parallel plan)");
}

void check_expert_parallel(const ModelOptions& o, int64_t expert) {
  if (expert <= 1) return;
  if (o.moe.num_experts <= 0) {
    throw std::invalid_argument("parallel.expert " + std::to_string(expert) +
                                " needs a mixture of experts (model.moe.num_experts > 0)");
  }
  if (o.moe.num_experts % expert != 0) {
    throw std::invalid_argument("parallel.expert (" + std::to_string(expert) + ") must divide model.moe.num_experts (" +
                                std::to_string(o.moe.num_experts) +
                                "): each expert-parallel rank holds the same number of experts");
  }
}

void check_context_parallel(const ModelOptions& o, int64_t context) {
  if (context <= 1) return;
  const std::string key = "parallel.context " + std::to_string(context);
  if (!find_model_spec(o.kind).set_context_parallel) {
    throw std::invalid_argument(key + " needs model.kind llama (model.kind is " + o.kind +
                                ", which does not split along the sequence)");
  }
}

void check_pipeline_support(const ModelOptions& o, int64_t pipeline) {
  if (pipeline <= 1) return;
  if (!find_model_spec(o.kind).embeds_parameter) {
    throw std::invalid_argument("parallel.pipeline " + std::to_string(pipeline) + ": model.kind " + o.kind +
                                " has no pipeline split");
  }
}

void check_lora_support(const ModelOptions& o) {
  if (o.lora.rank > 0 && o.moe.num_experts > 0) {
    for (const std::string& t : lora_targets(o.lora)) {
      if (t == "q_proj" || t == "k_proj" || t == "v_proj" || t == "o_proj") continue;
      throw std::invalid_argument("model.lora.targets names " + t + " with model.moe.num_experts " +
                                  std::to_string(o.moe.num_experts) +
                                  ": adapters on a mixture of experts' MLPs are not supported; target the "
                                  "attention projections (q_proj, k_proj, v_proj, o_proj)");
    }
  }
  if (o.lora.rank <= 0 || o.kind == "llama") return;
  throw std::invalid_argument("model.lora.rank " + std::to_string(o.lora.rank) + " needs model.kind llama, not " +
                              o.kind);
}

std::vector<std::string> registered_model_kinds() {
  SpecRegistry& r = spec_registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  std::vector<std::string> out;
  for (const auto& [name, spec] : r.specs) out.push_back(name);
  return out;
}

// ---------------------------------------------------------------- layered_model.h

void validate_model_options(const ModelOptions& o) {
  try {
    find_model_spec(o.kind);  // throws for a kind with no spec
    check_model_options(o);   // the kind's rules, spec.validate among them
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK(false, e.what());
  }
}

std::shared_ptr<LayeredModelImpl> make_model(const ModelOptions& options, bool materialize) {
  validate_model_options(options);
  check_lora_support(options);
  return find_model_spec(options.kind).build(options, materialize);
}

ModelSize model_size(const ModelOptions& o) { return find_model_spec(o.kind).size(o); }

}  // namespace models
