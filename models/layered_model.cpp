#include "models/layered_model.h"

#include "models/activation_checkpoint.h"
#include "models/forward_hooks.h"
#include "models/layers.h"
#include <stdexcept>

#include <algorithm>
#include <vector>

namespace models {

torch::Tensor LayeredModelImpl::forward(const torch::Tensor& tokens) {
  auto h = stage_.embed ? embed(tokens) : tokens;
  const int64_t end = stage_.end < 0 ? num_blocks() : std::min(stage_.end, num_blocks());
  // Each block is an FSDP unit when the model is sharded (a plain call when not).
  for (int64_t i = stage_.first; i < end; ++i) {
    h = run_unit(*block(i), [&] {
      if (!block_checkpointed(i)) return block_forward(i, h);
      return checkpoint_activations(
          [this, i](const torch::Tensor& x) { return block_forward(i, x); }, h);
    });
  }
  return stage_.head ? head(h) : h;
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

}  // namespace models
