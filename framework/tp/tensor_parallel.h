#pragma once
// Tensor parallelism (Megatron-LM's, as torchtitan plans it) applied from
// outside the model: a plan names submodules and their style, and
// parallelize_module keeps only this rank's part of their weights and
// installs the communication around their forward (models/forward_hooks.h,
// LibTorch C++'s missing forward hooks).
//
//   colwise   weight [out, in] split by output rows (Shard(0)); bias too.
//             The input is whole on every TP rank; its gradient is
//             all-reduced over the TP group in backward. The output is this
//             rank's slice of the last dim (gather_output: all-gathered).
//   rowwise   a projection: weight split by input columns (Shard(1)); the
//             input is this rank's slice of the last dim (what a colwise
//             projection produced); the partial outputs are all-reduced in
//             forward. No bias (it would be added once per rank).
//             An embedding (models::TokenEmbedding): the table split by
//             vocabulary rows (Shard(0)); each rank looks up the ids in its
//             range, zeros the others, and the rows are all-reduced.
//   replicate parameters whole on every TP rank, nothing communicated
//             (norms). Every parameter the plan does not name is replicated.
//   sum_grads whole on every TP rank, but each rank's gradient covers only
//             its heads (a per-head norm: model.qk_norm): FSDP sums the
//             gradients over the TP group before it reduces them.
//
// Over a colwise projection followed by a rowwise one (attention's q/k/v
// then o; the MLP's gate/up then down) a block needs two all-reduces in
// forward and two in backward. The activations between are split: each
// rank computes its heads (n_heads / tensor query and n_kv_heads / tensor
// key/value heads) and its share of the MLP's hidden units.
//
// The modules a plan names must run their forward through
// models::call_with_hook (models::Projection and models::TokenEmbedding
// do; torch::nn::Linear cannot be hooked and is refused).
//
// Thread safety: parallelize_module from the thread that owns the mesh,
// before any forward; the forwards then communicate over the mesh's tensor
// group, with the rules of every comm::Group (all its members call them in
// the same order).
#include "framework/dtensor/device_mesh.h"
#include "framework/fsdp/options.h"
#include "models/tp_plan.h"

#include <torch/torch.h>

#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace framework::tp {

// The plan's types are the model's (models/tp_plan.h): a model's spec
// declares its plan without depending on this library.
using Style = models::TpStyle;

// "colwise" | "rowwise" | "replicate" | "sum_grads"; throws std::invalid_argument naming
// `what` otherwise.
Style parse_style(const std::string& name, const std::string& what);
std::string to_string(Style style);

using PlanEntry = models::TpPlanEntry;
using Plan = models::TpPlan;

// What parallelize_module did: every parameter of the module by name, with
// how it is split (fsdp::FsdpOptions::tensor_parallel takes it).
struct TensorParallelLayout {
  std::unordered_map<std::string, fsdp::TensorParallelParam> params;
  int64_t size = 1;  // TP degree
  int64_t rank = 0;  // this rank's coordinate on the tensor axis
};

// Applies `plan` over the mesh's axis `axis` (its "tensor" axis). Keeps
// this rank's part of every split parameter in place (the module's
// parameters change shape; ones without storage, from a model built
// unmaterialised, stay without storage at their new shape) and installs
// the hooks. Throws std::invalid_argument naming the plan entry or the
// module when a pattern matches nothing, a module has no `weight`, is a
// torch::nn::Linear/Embedding, has a bias under rowwise, or two entries
// name one module. REQUIRES: every rank of the tensor group passes the
// same module and plan.
TensorParallelLayout parallelize_module(torch::nn::Module& module,
                                        std::shared_ptr<dtensor::DeviceMesh> mesh, int axis,
                                        const Plan& plan);

// The entries of `plan` that name at least one submodule of `module` (a
// pipeline stage holds only some of the modules a model's plan names).
Plan restrict_plan(const torch::nn::Module& module, const Plan& plan);

// Removes the hooks parallelize_module installed on `module`'s submodules.
void clear_hooks(const torch::nn::Module& module);

// An initialiser for a model whose split parameters have no storage: it
// builds the whole parameter, has `full_init` fill it and keeps this rank's
// part (what fsdp's ParamInit of a TP-split model needs).
using FullInit = std::function<void(const std::string& name, const torch::Tensor& full)>;
FullInit sharded_init(const TensorParallelLayout& layout, FullInit full_init);

// This rank's part of `full`, a whole parameter named `name` (a copy).
torch::Tensor local_part(const TensorParallelLayout& layout, const std::string& name,
                         const torch::Tensor& full);

// The per-token cross-entropy of logits split by vocabulary over `group`
// (what a colwise output projection produces), without gathering them:
// logits [N, V_local] of the vocabulary rows [vocab_offset, vocab_offset +
// V_local); targets [N] (ignore_index: loss 0, no gradient). Returns [N],
// the same on every rank of the group. Computed in the logits' dtype; pass
// fp32. Three all-reduces of N values each (max, sum of exps, target
// logit) in forward, none in backward.
torch::Tensor vocab_parallel_cross_entropy(const torch::Tensor& logits, const torch::Tensor& targets,
                                           int64_t vocab_offset, comm::Group& group,
                                           int64_t ignore_index);

// The whole of `local`'s last dim, split over `group` by the chunk rule into
// `full` columns (e.g. the logits of a colwise output projection, for
// sampling). Differentiable: the gradient of each rank's slice goes back.
torch::Tensor gather_last_dim(const torch::Tensor& local, comm::Group& group, int64_t full);

// The built-in llama's plan (torchtitan's): embed_tokens rowwise (by
// vocabulary), q/k/v and gate/up colwise, o and down rowwise, lm_head
// colwise with its output split by vocabulary (vocab_parallel_cross_entropy),
// norms replicated.
Plan llama_plan();

}  // namespace framework::tp
