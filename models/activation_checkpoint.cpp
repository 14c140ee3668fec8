#include "models/activation_checkpoint.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>

#include <mutex>
#include <stdexcept>

namespace models {
namespace {

thread_local bool recomputing = false;
thread_local bool first_pass = false;

struct RecomputeScope {
  bool before = recomputing;
  RecomputeScope() { recomputing = true; }
  ~RecomputeScope() { recomputing = before; }
};

torch::Tensor cpu_rng_state() {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

void set_cpu_rng_state(const torch::Tensor& state) {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

// The backward of one checkpointed call: recompute, then backward through
// the recomputed graph (a reentrant backward, as torch.utils.checkpoint's
// use_reentrant=True does).
class CheckpointBackward : public torch::autograd::Node {
 public:
  CheckpointBackward(BlockFn fn, torch::Tensor input, torch::Tensor rng_state)
      : fn_(std::move(fn)), input_(std::move(input)), rng_state_(std::move(rng_state)) {}

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    TORCH_CHECK(input_.defined(), "checkpoint_activations: backward ran twice through a "
                                  "checkpointed call (retain_graph is not supported)");
    torch::Tensor x = input_.detach().set_requires_grad(input_requires_grad_);
    torch::Tensor out;
    {
      // Replay the forward's random numbers, then give the caller its own
      // generator state back.
      const torch::Tensor now = cpu_rng_state();
      set_cpu_rng_state(rng_state_);
      torch::AutoGradMode enable(true);
      RecomputeScope recompute;
      try {
        out = fn_(x);
      } catch (...) {
        set_cpu_rng_state(now);
        throw;
      }
      set_cpu_rng_state(now);
    }
    input_ = torch::Tensor();  // freed as soon as it is no longer needed
    if (grads.at(0).defined() && out.requires_grad()) {
      torch::autograd::backward({out}, {grads[0]});
    }
    return {input_requires_grad_ ? x.grad() : torch::Tensor()};
  }

  std::string name() const override { return "CheckpointActivationsBackward"; }

  bool input_requires_grad_ = false;

 private:
  BlockFn fn_;
  torch::Tensor input_;
  torch::Tensor rng_state_;
};

}  // namespace

bool recomputing_activations() { return recomputing; }
bool checkpointed_first_pass() { return first_pass; }

torch::Tensor checkpoint_activations(BlockFn fn, const torch::Tensor& input) {
  if (!torch::GradMode::is_enabled()) return fn(input);
  torch::Tensor rng = cpu_rng_state();
  torch::Tensor out;
  {
    torch::NoGradGuard no_grad;
    const bool before = first_pass;
    first_pass = true;
    try {
      out = fn(input.detach());
    } catch (...) {
      first_pass = before;
      throw;
    }
    first_pass = before;
  }
  auto node = std::shared_ptr<CheckpointBackward>(
      new CheckpointBackward(std::move(fn), input.detach(), std::move(rng)),
      torch::autograd::deleteNode);
  node->input_requires_grad_ = input.requires_grad();
  // The input's gradient edge (if it has one); the node runs either way, so
  // the parameters inside fn get their gradients even when x needs none.
  node->set_next_edges(torch::autograd::collect_next_edges(input));
  // A fresh tensor, so the view and version bookkeeping of fn's result does
  // not follow it into the graph.
  out = out.detach();
  torch::autograd::create_gradient_edge(out, node);
  return out;
}

}  // namespace models
