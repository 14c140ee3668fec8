#pragma once
// Activation checkpointing for LibTorch C++ (what torch.utils.checkpoint is
// in Python; LibTorch's C++ API has none, pytorch#52744).
//
//   out = checkpoint_activations(fn, x);
//
// runs fn(x) without recording its graph: of everything fn computes, only x
// is kept for backward. When the gradient of `out` arrives, fn(x) runs again
// with grad mode on and the CPU RNG state of the first run, and its backward
// runs from there: the gradients of fn's parameters accumulate as they would
// have, and x's gradient flows on. The cost is one more forward of fn; the
// saving is every activation inside it.
//
// A model applies it to its own blocks (LayeredModel's
// set_activation_checkpointing); it needs nothing but LibTorch, so it lives
// with the models. Inside a unit of a sharded model, wrap the checkpoint in
// the unit's run_unit (models/forward_hooks.h): FSDP gathers the unit's
// parameters for its backward (the output hook) before the recompute runs,
// as for any unit. The one line per block:
//
//   h = models::run_unit(*block, [&] {
//     return models::checkpoint_activations([&](const torch::Tensor& x) { return block->forward(x); }, h);
//   });
//
// REQUIRES: fn is a pure function of x, its parameters and the RNG state
// (it reads no other tensor that changes between forward and backward); fn
// returns one tensor. Under torch::NoGradGuard it is a plain call.
// Bit-exact: on the CPU, gradients with and without it are identical.
// The CUDA RNG state is not replayed (no model here draws random numbers
// in its forward); the CPU generator's is.
#include <torch/torch.h>

#include <functional>

namespace models {

using BlockFn = std::function<torch::Tensor(const torch::Tensor&)>;

torch::Tensor checkpoint_activations(BlockFn fn, const torch::Tensor& input);

// True on this thread while a checkpointed call's forward runs again for
// its backward: what a module counts once per forward (a mixture of
// experts' loads) it skips then.
bool recomputing_activations();
// True on this thread while a checkpointed call runs its first forward
// (without grad mode, its backward to come): with grad mode on and
// !recomputing_activations(), what counts as a training forward.
bool checkpointed_first_pass();

}  // namespace models
