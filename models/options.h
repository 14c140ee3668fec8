#pragma once
// Model sizes (config section `model`).
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "comm/enum_text.h"

namespace models {

// model.activation_checkpointing: keep only each checkpointed block's input
// for backward and run its forward again there. none | full (every block) |
// selective (every N-th block, N = activation_checkpointing_every).
enum class ActivationCheckpointing { kNone, kFull, kSelective };

inline constexpr comm::EnumName<ActivationCheckpointing> kActivationCheckpointings[] = {
    {ActivationCheckpointing::kNone, "none"}, {ActivationCheckpointing::kFull, "full"},
    {ActivationCheckpointing::kSelective, "selective"}};
inline const char* to_string(ActivationCheckpointing mode) {
  return comm::enum_text(mode, kActivationCheckpointings);
}
// Throws std::invalid_argument naming the key and the allowed values.
inline ActivationCheckpointing parse_activation_checkpointing(const std::string& mode) {
  return comm::parse_enum("model.activation_checkpointing", mode, kActivationCheckpointings);
}

// Llama 3.1's frequency scaling of the rotary embedding (Hugging Face's
// rope_scaling {"rope_type": "llama3", ...}). factor 0: off.
struct RopeScalingOptions {
  double factor = 0;
  double low_freq_factor = 1;
  double high_freq_factor = 4;
  int64_t original_max_position = 8192;
};

// LoRA (model.lora.*, llama): each projection named in `targets` gets
// trainable low-rank adapters A [rank, in] and B [out, rank] beside its
// frozen weight W: y = x W^T + (alpha / rank) dropout(x) A^T B^T, PEFT's
// scale. B starts at zero, so step 0 is the base model; every parameter but
// the adapters is frozen (no gradient, no optimizer state). rank 0: off.
struct LoraOptions {
  int64_t rank = 0;
  double alpha = 16;
  double dropout = 0;
  // Comma-separated projection names: q_proj, k_proj, v_proj, o_proj,
  // gate_proj, up_proj, down_proj (PEFT's target_modules for a llama).
  std::string targets = "q_proj,v_proj";
  // The frozen base's shards: "fp32", or "bf16" (half the bytes; the
  // adapters keep fp32 masters and AdamW state either way).
  std::string base_dtype = "fp32";
};

// The llama projections LoRA may target, and the targets of `options`
// (throws std::invalid_argument naming model.lora.targets for another).
std::vector<std::string> lora_target_choices();
std::vector<std::string> lora_targets(const LoraOptions& options);

// model.moe.score_func: how the router turns its logits into scores.
// softmax over the experts (Mixtral, Qwen3-MoE) | sigmoid of each
// (DeepSeek-V3).
enum class MoeScoreFunc { kSoftmax, kSigmoid };

inline constexpr comm::EnumName<MoeScoreFunc> kMoeScoreFuncs[] = {{MoeScoreFunc::kSoftmax, "softmax"},
                                                                  {MoeScoreFunc::kSigmoid, "sigmoid"}};
inline const char* to_string(MoeScoreFunc f) { return comm::enum_text(f, kMoeScoreFuncs); }
inline MoeScoreFunc parse_moe_score_func(const std::string& text) {
  return comm::parse_enum("model.moe.score_func", text, kMoeScoreFuncs);
}

// A mixture of experts in place of the SwiGLU MLP (model.moe.*, llama;
// docs/moe.md). Names and meanings follow torchtitan's MoEArgs and the
// Hugging Face configs (in brackets). num_experts 0: a dense model.
struct MoeOptions {
  int64_t num_experts = 0;         // routed experts [num_experts, n_routed_experts]
  int64_t top_k = 2;               // experts per token [num_experts_per_tok]
  int64_t d_ff = 0;                // each expert's width; 0: the model's d_ff [moe_intermediate_size]
  MoeScoreFunc score_func = MoeScoreFunc::kSoftmax;
  bool route_norm = false;         // renormalise the top-k weights to sum 1 [norm_topk_prob]
  double route_scale = 1.0;        // the routed output's factor [routed_scaling_factor]
  int64_t num_shared_experts = 0;  // one SwiGLU of width this x d_ff that every token takes [n_shared_experts]
  int64_t first_dense_layers = 0;  // leading blocks with the dense MLP [first_k_dense_replace]
  double aux_loss_coef = 0;        // the load-balancing loss's weight [router_aux_loss_coef]
  // DeepSeek-V3's auxiliary-loss-free balancing: a per-expert bias added to
  // the scores for the choice only, moved by this much after every step
  // towards the mean load (torchtitan's load_balance_coeff); 0: off.
  double load_balance_rate = 0;
};

struct ModelOptions {
  std::string kind = "gpt";  // gpt | mlp | llama
  int64_t vocab_size = 32;
  int64_t seq_len = 32;      // context length
  int64_t d_model = 64;
  int64_t n_layers = 2;
  int64_t n_heads = 4;
  // llama: key/value heads of grouped-query attention; 0: n_heads. Must
  // divide n_heads.
  int64_t n_kv_heads = 0;
  // llama: each attention head's width; 0: d_model / n_heads. Qwen3-MoE's
  // released models set it otherwise (Qwen3-30B-A3B: d_model 2048, 32
  // heads of 128), so q/k/v/o are not square in d_model.
  int64_t head_dim = 0;
  // 0: 4 * d_model (gpt, mlp); llama: 8/3 * d_model rounded up to a
  // multiple of 256, as Llama's multiple_of.
  int64_t d_ff = 0;
  // Unless the config sets it: ties_weights_by_default(kind).
  bool tie_weights = true;
  // llama: rotary embedding base, RMSNorm epsilon, Llama 3.1 scaling.
  double rope_theta = 10000.0;
  double norm_eps = 1e-5;
  RopeScalingOptions rope_scaling;
  ActivationCheckpointing activation_checkpointing = ActivationCheckpointing::kNone;
  int64_t activation_checkpointing_every = 2;
  // A safetensors or torch.save file of full (unsharded) weights to start from;
  // empty: random init. Ignored when resuming from a checkpoint.
  std::string init_from;
  LoraOptions lora;
  // llama: an RMSNorm over each head's dimensions of q and of k, before the
  // rotary embedding (Qwen3's q_norm, k_norm).
  bool qk_norm = false;
  MoeOptions moe;
};

// Whether block `layer` of a model of these options is a mixture of experts.
inline bool is_moe_layer(const ModelOptions& options, int64_t layer) {
  return options.moe.num_experts > 0 && layer >= options.moe.first_dense_layers;
}

// Each expert's width (model.moe.d_ff, or the model's d_ff).
int64_t moe_expert_d_ff(const ModelOptions& options);

// The adapters' parameter count of a llama with these options (0 with LoRA
// off): what trains, for the memory estimate.
double lora_parameter_count(const ModelOptions& options);

// The d_ff a llama of these options uses (model.d_ff, or its default).
int64_t llama_d_ff(const ModelOptions& options);

// Each attention head's width a llama of these options uses
// (model.head_dim, or d_model / n_heads), and the width of its queries and
// attention output (n_heads * head_dim: q_proj's rows, o_proj's columns).
int64_t llama_head_dim(const ModelOptions& options);
int64_t llama_attention_width(const ModelOptions& options);

// Names a key in a model error: `key` and `value` give "model.n_heads (4)"
// by default; the config's namer adds where the value came from
// ("model.n_heads (4, configs/x.yaml:7)").
using KeyNamer = std::function<std::string(const std::string& key, const std::string& value)>;

// A kind's rules for its options. `tensor`: parallel.tensor, the ranks its
// layers are split over (1: none). Throws std::invalid_argument naming the
// first invalid key through `name`.
using ModelCheck =
    std::function<void(const ModelOptions& options, int64_t tensor, const KeyNamer& name)>;

// The rules of options.kind, in one place for the config (at load, naming
// where each value came from) and for make_model: every kind's sizes are
// positive; gpt and llama split d_model into whole heads (llama: unless
// model.head_dim sets their width); llama's key/value
// heads divide its query heads, its head dimension is even (rotary pairs),
// its rope_scaling frequencies are ordered, and with tensor > 1 every rank
// holds whole heads of an untied model. Then the check the kind was
// registered with. Throws std::invalid_argument; nothing for a kind that is
// not registered (the config's model.kind check names those).
void check_model_options(const ModelOptions& options, int64_t tensor = 1,
                         const KeyNamer& name = {});

// The kinds model.kind may name, in the order registered: the built-in gpt,
// mlp and llama, then each kind register_model_spec (models/model_spec.h)
// added. The config checks model.kind against it.
std::vector<std::string> model_kinds();
// Adds `kind` to model_kinds() (no effect when there) with the rules
// check_model_options runs for it after the sizes' (an empty `check` keeps
// the kind's rules: a built-in kind's stay), and whether its embedding and
// output projection are tied when the config does not say (nullopt: keep
// the kind's; true for a new one). register_model_spec calls it; register
// before parsing a config that names the kind.
void register_model_kind(const std::string& kind, ModelCheck check = {},
                         std::optional<bool> ties_weights = std::nullopt);
// model.tie_weights when the config does not set it: true but for llama
// (Llama 3 8B and up untie them) and kinds registered so.
bool ties_weights_by_default(const std::string& kind);

}  // namespace models
