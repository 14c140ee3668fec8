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

}  // namespace models
