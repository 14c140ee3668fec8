#include "models/options.h"

#include <algorithm>
#include <mutex>

namespace models {

int64_t llama_d_ff(const ModelOptions& o) {
  if (o.d_ff > 0) return o.d_ff;
  const int64_t hidden = 8 * o.d_model / 3;
  return (hidden + 255) / 256 * 256;
}

namespace {

struct KindList {
  std::mutex mutex;
  std::vector<std::string> kinds{"gpt", "mlp", "llama"};
};

KindList& kind_list() {
  static KindList list;
  return list;
}

}  // namespace

std::vector<std::string> model_kinds() {
  KindList& l = kind_list();
  std::lock_guard<std::mutex> lock(l.mutex);
  return l.kinds;
}

void register_model_kind(const std::string& kind) {
  KindList& l = kind_list();
  std::lock_guard<std::mutex> lock(l.mutex);
  if (std::find(l.kinds.begin(), l.kinds.end(), kind) == l.kinds.end()) l.kinds.push_back(kind);
}

}  // namespace models
