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

namespace {

[[noreturn]] void refuse(const std::string& message) { throw std::invalid_argument(message); }

std::string text(int64_t value) { return std::to_string(value); }
std::string text(double value) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", value);
  return buf;
}
std::string text(bool value) { return value ? "true" : "false"; }

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

// gpt and llama: d_model split into whole heads.
void check_heads(const ModelOptions& o, const KeyNamer& name) {
  if (o.n_heads <= 0) refuse(name("model.n_heads", text(o.n_heads)) + " must be positive");
  if (o.d_model % o.n_heads != 0)
    refuse(name("model.d_model", text(o.d_model)) + " must be divisible by " +
           name("model.n_heads", text(o.n_heads)) + " for model.kind " + o.kind);
}

void check_gpt(const ModelOptions& o, int64_t, const KeyNamer& name) { check_heads(o, name); }

void check_llama(const ModelOptions& o, int64_t tensor, const KeyNamer& name) {
  check_heads(o, name);
  const std::string heads = name("model.n_heads", text(o.n_heads));
  const std::string kv_heads = name("model.n_kv_heads", text(o.n_kv_heads));
  if (o.n_kv_heads < 0) refuse(kv_heads + " must be >= 0 (0: model.n_heads)");
  const int64_t kv = o.n_kv_heads > 0 ? o.n_kv_heads : o.n_heads;
  if (o.n_heads % kv != 0)
    refuse(heads + " must be divisible by " + kv_heads +
           " (each key/value head serves a whole group of query heads)");
  if ((o.d_model / o.n_heads) % 2 != 0)
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
  if (o.tie_weights)
    refuse(ranks + " above 1 does not support " + name("model.tie_weights", text(o.tie_weights)) +
           " yet (the embedding and the output projection are split separately)");
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
  if (check) check(o, tensor, name);
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
