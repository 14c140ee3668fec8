#include "models/options.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <mutex>

namespace models {

int64_t llama_d_ff(const ModelOptions& o) {
  if (o.d_ff > 0) return o.d_ff;
  const int64_t hidden = 8 * o.d_model / 3;
  return (hidden + 255) / 256 * 256;
}

int64_t llama_head_dim(const ModelOptions& o) {
  return o.head_dim > 0 ? o.head_dim : o.d_model / o.n_heads;
}

int64_t llama_attention_width(const ModelOptions& o) { return o.n_heads * llama_head_dim(o); }

int64_t moe_expert_d_ff(const ModelOptions& o) { return o.moe.d_ff > 0 ? o.moe.d_ff : llama_d_ff(o); }

namespace {

[[noreturn]] void refuse(const std::string& message) { throw std::invalid_argument(message); }

std::string text(int64_t value) { return std::to_string(value); }
std::string text(double value) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", value);
  return buf;
}

// Every kind's sizes.
void check_sizes(const ModelOptions& o, const KeyNamer& name) {
  const std::pair<const char*, int64_t> positive[] = {{"model.vocab_size", o.vocab_size},
                                                       {"model.seq_len", o.seq_len},
                                                       {"model.d_model", o.d_model},
                                                       {"model.n_layers", o.n_layers}};
  for (const auto& [key, value] : positive)
    if (value <= 0) refuse(name(key, text(value)) + " must be positive");
  if (o.d_ff < 0)
    refuse(name("model.d_ff", text(o.d_ff)) + " must be >= 0 (0: the kind's default)");
}

// gpt and llama: d_model split into whole heads (`head_dim` 0), or heads
// of their own width (llama's model.head_dim).
void check_heads(const ModelOptions& o, const KeyNamer& name, int64_t head_dim = 0) {
  if (o.n_heads <= 0) refuse(name("model.n_heads", text(o.n_heads)) + " must be positive");
  if (head_dim == 0 && o.d_model % o.n_heads != 0)
    refuse(name("model.d_model", text(o.d_model)) + " must be divisible by " +
           name("model.n_heads", text(o.n_heads)) + " for model.kind " + o.kind +
           (o.kind == "llama" ? " (or set model.head_dim)" : ""));
}

void check_gpt(const ModelOptions& o, int64_t, const KeyNamer& name) { check_heads(o, name); }

void check_lora(const ModelOptions& o, const KeyNamer& name) {
  const LoraOptions& l = o.lora;
  // rank's range (>= 0, 0: off) is the config schema's; a rank below 1 is
  // off. Which kinds take adapters is check_lora_support's (model_spec.h).
  if (l.rank <= 0) return;
  if (l.alpha <= 0) refuse(name("model.lora.alpha", text(l.alpha)) + " must be positive");
  if (l.dropout < 0 || l.dropout >= 1) refuse(name("model.lora.dropout", text(l.dropout)) + " must be in [0, 1)");
  try {
    if (lora_targets(l).empty()) throw std::invalid_argument("names no projection");
  } catch (const std::invalid_argument& e) {
    refuse(name("model.lora.targets", "\"" + l.targets + "\"") + ": " + e.what());
  }
}

void check_moe(const ModelOptions& o, const KeyNamer& name) {
  const MoeOptions& m = o.moe;
  if (m.num_experts < 0) refuse(name("model.moe.num_experts", text(m.num_experts)) + " must be >= 0 (0: dense)");
  if (m.num_experts == 0) return;
  const std::string experts = name("model.moe.num_experts", text(m.num_experts));
  if (m.top_k < 1 || m.top_k > m.num_experts)
    refuse(name("model.moe.top_k", text(m.top_k)) + " must be in [1, " + experts + "]");
  if (m.d_ff < 0) refuse(name("model.moe.d_ff", text(m.d_ff)) + " must be >= 0 (0: model.d_ff)");
  if (m.route_scale <= 0) refuse(name("model.moe.route_scale", text(m.route_scale)) + " must be positive");
  if (m.num_shared_experts < 0)
    refuse(name("model.moe.num_shared_experts", text(m.num_shared_experts)) + " must be >= 0");
  if (m.first_dense_layers < 0 || m.first_dense_layers >= o.n_layers)
    refuse(name("model.moe.first_dense_layers", text(m.first_dense_layers)) + " must be in [0, " +
           name("model.n_layers", text(o.n_layers)) + "): at least one block is a mixture of experts");
  if (m.aux_loss_coef < 0) refuse(name("model.moe.aux_loss_coef", text(m.aux_loss_coef)) + " must be >= 0");
  if (m.load_balance_rate < 0)
    refuse(name("model.moe.load_balance_rate", text(m.load_balance_rate)) + " must be >= 0");
}

void check_llama(const ModelOptions& o, int64_t tensor, const KeyNamer& name) {
  if (o.head_dim < 0)
    refuse(name("model.head_dim", text(o.head_dim)) + " must be >= 0 (0: model.d_model / model.n_heads)");
  check_heads(o, name, o.head_dim);
  check_moe(o, name);
  const std::string heads = name("model.n_heads", text(o.n_heads));
  const std::string kv_heads = name("model.n_kv_heads", text(o.n_kv_heads));
  if (o.n_kv_heads < 0) refuse(kv_heads + " must be >= 0 (0: model.n_heads)");
  const int64_t kv = o.n_kv_heads > 0 ? o.n_kv_heads : o.n_heads;
  if (o.n_heads % kv != 0)
    refuse(heads + " must be divisible by " + kv_heads +
           " (each key/value head serves a whole group of query heads)");
  if (o.head_dim > 0 && o.head_dim % 2 != 0)
    refuse(name("model.head_dim", text(o.head_dim)) +
           " must be even for llama (rotary embeddings rotate pairs of dimensions)");
  if (o.head_dim == 0 && (o.d_model / o.n_heads) % 2 != 0)
    refuse(name("model.d_model", text(o.d_model)) + " / " + heads +
           " must be even for llama (rotary embeddings rotate pairs of dimensions)");
  if (o.rope_theta <= 0) refuse(name("model.rope_theta", text(o.rope_theta)) + " must be positive");
  if (o.norm_eps <= 0) refuse(name("model.norm_eps", text(o.norm_eps)) + " must be positive");
  const RopeScalingOptions& r = o.rope_scaling;
  if (r.factor > 0 && r.high_freq_factor <= r.low_freq_factor)
    refuse(name("model.rope_scaling.high_freq_factor", text(r.high_freq_factor)) + " must exceed " +
           name("model.rope_scaling.low_freq_factor", text(r.low_freq_factor)));
  if (tensor <= 1) return;
  const std::string ranks = name("parallel.tensor", text(tensor));
  if (o.n_heads % tensor != 0 || kv % tensor != 0)
    refuse(ranks + " must divide " + heads + " and " + kv_heads +
           " (n_heads when 0): each tensor-parallel rank computes whole query and key/value heads");
}

struct KindList {
  std::mutex mutex;
  std::vector<std::string> kinds{"gpt", "mlp", "llama"};
  std::map<std::string, ModelCheck> checks{{"gpt", check_gpt}, {"llama", check_llama}};
  std::map<std::string, bool> ties_weights{{"llama", false}};  // absent: true
};

KindList& kind_list() {
  static KindList list;
  return list;
}

}  // namespace

void check_model_options(const ModelOptions& o, int64_t tensor, const KeyNamer& namer) {
  const KeyNamer name = namer ? namer : [](const std::string& key, const std::string& value) {
    return key + " (" + value + ")";
  };
  ModelCheck check;
  {
    KindList& l = kind_list();
    std::lock_guard<std::mutex> lock(l.mutex);
    if (std::find(l.kinds.begin(), l.kinds.end(), o.kind) == l.kinds.end()) return;
    auto it = l.checks.find(o.kind);
    if (it != l.checks.end()) check = it->second;
  }
  check_sizes(o, name);
  check_lora(o, name);
  if (check) check(o, tensor, name);
}

std::vector<std::string> lora_target_choices() {
  return {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"};
}

std::vector<std::string> lora_targets(const LoraOptions& options) {
  const std::vector<std::string> choices = lora_target_choices();
  std::vector<std::string> out;
  std::string item;
  std::string text = options.targets + ",";
  for (char c : text) {
    if (c != ',') {
      if (c != ' ' && c != '\t') item += c;
      continue;
    }
    if (item.empty()) continue;
    if (std::find(choices.begin(), choices.end(), item) == choices.end()) {
      std::string all;
      for (const std::string& x : choices) all += (all.empty() ? "" : ", ") + x;
      throw std::invalid_argument("'" + item + "' is not one of " + all);
    }
    if (std::find(out.begin(), out.end(), item) == out.end()) out.push_back(item);
    item.clear();
  }
  return out;
}

double lora_parameter_count(const ModelOptions& o) {
  if (o.lora.rank <= 0 || o.kind != "llama") return 0;
  const double d = static_cast<double>(o.d_model);
  const double hd = static_cast<double>(llama_head_dim(o));
  const double q = static_cast<double>(llama_attention_width(o));
  const double kv = static_cast<double>(o.n_kv_heads > 0 ? o.n_kv_heads : o.n_heads) * hd;
  const double ff = static_cast<double>(llama_d_ff(o));
  double per_layer = 0;
  for (const std::string& t : lora_targets(o.lora)) {
    double in = d, out = d;
    if (t == "q_proj") out = q;
    if (t == "o_proj") in = q;
    if (t == "k_proj" || t == "v_proj") out = kv;
    if (t == "gate_proj" || t == "up_proj") out = ff;
    if (t == "down_proj") in = ff;
    per_layer += static_cast<double>(o.lora.rank) * (in + out);
  }
  return per_layer * static_cast<double>(o.n_layers);
}

std::vector<std::string> model_kinds() {
  KindList& l = kind_list();
  std::lock_guard<std::mutex> lock(l.mutex);
  return l.kinds;
}

void register_model_kind(const std::string& kind, ModelCheck check, std::optional<bool> ties_weights) {
  KindList& l = kind_list();
  std::lock_guard<std::mutex> lock(l.mutex);
  if (std::find(l.kinds.begin(), l.kinds.end(), kind) == l.kinds.end()) l.kinds.push_back(kind);
  if (check) l.checks[kind] = std::move(check);
  if (ties_weights) l.ties_weights[kind] = *ties_weights;
}

bool ties_weights_by_default(const std::string& kind) {
  KindList& l = kind_list();
  std::lock_guard<std::mutex> lock(l.mutex);
  auto it = l.ties_weights.find(kind);
  return it == l.ties_weights.end() || it->second;
}

}  // namespace models
