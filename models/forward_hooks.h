#pragma once
// Forward hooks for leaf modules, set from outside the model: what LibTorch
// C++ lacks (torch::nn::Module has no register_forward_hook), so that
// parallelism can be applied to a model without changing its code.
// Tensor parallelism (framework/tp) installs one on every projection and
// embedding its plan names; with none installed a call is a plain call.
//
// A module opts in by running its computation through call_with_hook:
//   torch::Tensor MyLinearImpl::forward(const torch::Tensor& x) {
//     return models::call_with_hook(*this, x, [&](const torch::Tensor& in) {
//       return torch::nn::functional::linear(in, weight_);
//     });
//   }
// models::Projection and models::TokenEmbedding do. The hook receives the
// input and the module's own computation, and returns the output: it may
// change the input, the output, or both (an all-reduce after a row-parallel
// projection; masking the token ids of a vocabulary-parallel embedding).
//
// Thread safety: set and clear from one thread while no forward runs;
// call_with_hook from any number of threads.
//
// The unit hook: one process-wide hook around each call of a unit (a block
// that a sharded model gathers as a whole), set from outside the model.
// FSDP (framework/fsdp) sets it when it shards a model: it gathers the
// unit's parameters for the call, frees them after, and gathers them again
// for the unit's backward. A model marks each unit call with run_unit:
//   h = models::run_unit(*block, [&] { return block->forward(h); });
// With no hook set, or for a module that is no unit of a sharded model, it
// is a plain call, so the model's code runs unchanged on one device.
#include <torch/torch.h>

#include <functional>

namespace models {

using ModuleFn = std::function<torch::Tensor(const torch::Tensor& input)>;
using ForwardHook = std::function<torch::Tensor(const torch::Tensor& input, const ModuleFn& inner)>;

// Replaces any hook of `module`. A module held by a shared_ptr (every
// registered submodule is) takes its hook with it when it dies; the hook
// of any other module lasts until it is cleared.
void set_forward_hook(const torch::nn::Module& module, ForwardHook hook);
void clear_forward_hook(const torch::nn::Module& module);
bool has_forward_hook(const torch::nn::Module& module);

// hook(input, fn) when `module` has a hook, else fn(input).
torch::Tensor call_with_hook(const torch::nn::Module& module, const torch::Tensor& input,
                             const ModuleFn& fn);

using UnitFn = std::function<torch::Tensor()>;
// Returns fn() with whatever the unit needs around it. A plain function, so
// setting and calling it need no lock.
using UnitHook = torch::Tensor (*)(const torch::nn::Module& unit, const UnitFn& fn);

// Replaces the unit hook (nullptr: none). Thread-safe.
void set_unit_hook(UnitHook hook);

// hook(unit, fn) when a unit hook is set, else fn(). Thread-safe.
torch::Tensor run_unit(const torch::nn::Module& unit, const UnitFn& fn);

}  // namespace models
