#pragma once
// A mixture of experts in place of a llama block's SwiGLU MLP (model.moe.*,
// docs/moe.md): token-choice top-k routing, dropless, with the router
// semantics of Mixtral and Qwen3-MoE (softmax) and DeepSeek-V3 (sigmoid,
// shared experts, the auxiliary-loss-free bias).
//
// Parameters (under model.layers.N.mlp.):
//   gate.weight                         [E, d_model]  the router
//   gate.e_score_correction_bias        [E] fp32      a buffer, with load_balance_rate > 0
//   experts.{gate,up}_proj.weight       [E, d_ff, d_model]  the routed experts, stacked
//   experts.down_proj.weight            [E, d_model, d_ff]
//   shared_experts.{gate,up,down}_proj.weight  one SwiGLU of width S x d_ff (S > 0)
// The experts are stacked so that a checkpoint holds each by its global
// index (row e of dim 0) whatever the expert layout; the Hugging Face
// adapter splits them into experts.N.* on export.
//
// A token x of the layer's input (rows of [B*T, d_model]):
//   scores = softmax(x gate^T) or sigmoid(x gate^T), in fp32
//   chosen = topk(scores + bias, k)     the bias only for the choice
//   w      = scores[chosen], / their sum (route_norm), x route_scale
//   out    = sum_j w_j expert_{chosen_j}(x) + shared(x)
// The tokens are grouped by expert (a stable sort of the choices) and each
// expert runs one matmul per projection over its group: no per-token loop,
// no capacity, no dropped token.
#include "models/options.h"

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace models {

class LlamaMlpImpl;

// One stacked weight [E, out, in] (a module of its own so that the
// parameter is named "<projection>.weight").
class ExpertWeightImpl : public torch::nn::Module {
 public:
  ExpertWeightImpl(int64_t experts, int64_t out, int64_t in, bool materialize);
  torch::Tensor weight;
};
TORCH_MODULE(ExpertWeight);

// The routed experts: SwiGLU e of x is down[e] (silu(gate[e] x) * up[e] x).
class GroupedExpertsImpl : public torch::nn::Module {
 public:
  GroupedExpertsImpl(int64_t experts, int64_t d_model, int64_t d_ff, bool materialize);
  // rows [M, d_model], grouped by expert: the first counts[0] rows go to
  // local expert 0, the next counts[1] to expert 1, ... (sum = M). One
  // matmul per projection and expert.
  torch::Tensor forward(const torch::Tensor& rows, const std::vector<int64_t>& counts);
  int64_t num_experts() const { return gate_proj->weight.size(0); }

  ExpertWeight gate_proj{nullptr}, up_proj{nullptr}, down_proj{nullptr};
};
TORCH_MODULE(GroupedExperts);

// The router: gate.weight, and the balancing bias as a buffer.
class MoeRouterImpl : public torch::nn::Module {
 public:
  MoeRouterImpl(int64_t experts, int64_t d_model, bool with_bias, bool materialize);
  torch::Tensor weight;
  torch::Tensor e_score_correction_bias;  // undefined without load_balance_rate
};
TORCH_MODULE(MoeRouter);

// What one step's forwards through a layer routed (training forwards with
// a backward to come, each micro-batch once: not the recomputation of
// activation checkpointing, not a forward under no_grad).
struct MoeLayerStats {
  torch::Tensor loads;    // [E] float64 on the layer's device: top-k choices per expert
  double aux_loss = 0;    // the layer's auxiliary loss, weighted as the step weights it
  double aux_weight = 0;  // the weights summed (1 over a whole global batch)
};

// Expert parallelism's hook (framework/ep): `rows` grouped by global
// expert, `counts` this rank's rows per global expert [num_experts];
// returns the experts' outputs in the same row order, computed by `local`
// (this rank's experts) and the other ranks'.
using ExpertDispatch = std::function<torch::Tensor(const torch::Tensor& rows, const std::vector<int64_t>& counts,
                                                   GroupedExpertsImpl& local)>;

class MoeFeedForwardImpl : public torch::nn::Module {
 public:
  MoeFeedForwardImpl(const ModelOptions& options, bool materialize);
  torch::Tensor forward(const torch::Tensor& x);  // [B, T, d_model]

  // The auxiliary loss's share of a micro-batch of B sequences is
  // B / global_batch_sequences (0: the batch is the whole step), so that
  // over a step's micro-batches and data-parallel ranks it weighs
  // aux_loss_coef x the mean of the micro-batches' losses. The trainer sets it.
  void set_global_batch_sequences(int64_t sequences) { global_batch_ = sequences; }
  // Context parallelism (models::ContextParallel): this rank holds 1 /
  // `degree` of each sequence's tokens; `sum_over_group` sums a tensor over
  // the ranks holding the rest. The auxiliary loss then takes its expert
  // shares f_e over the whole micro-batch (the loads summed over the
  // group) and each rank weighs its tokens' mean probabilities by 1 /
  // degree: the group's terms add up to the unsplit micro-batch's loss and
  // gradient. degree 1 and no function: none.
  void set_context_parallel(int64_t degree, std::function<void(torch::Tensor&)> sum_over_group);
  // This step's statistics so far, and a fresh start.
  MoeLayerStats take_stats();
  // DeepSeek-V3's update from the step's loads (summed over every
  // data-parallel rank): bias += rate x sign(mean(loads) - loads), centred.
  // No effect without load_balance_rate.
  void update_bias(const torch::Tensor& loads);
  int64_t num_experts() const { return options_.num_experts; }
  // Expert parallelism: keep experts [first, first + count) only (the
  // stacked parameters' rows; without storage when they had none) and
  // route through `dispatch`.
  void set_expert_parallel(int64_t first, int64_t count, ExpertDispatch dispatch);
  // The experts the last forward chose, [B*T, k] in topk's order (tests and
  // the PyTorch reference compare them).
  const torch::Tensor& last_choices() const { return last_choices_; }
  const MoeOptions& options() const { return options_; }

 private:
  MoeOptions options_;
  int64_t moe_layer_count_;  // the aux loss is their mean
  int64_t global_batch_ = 0;
  int64_t context_degree_ = 1;
  std::function<void(torch::Tensor&)> sum_over_context_;
  MoeRouter gate_{nullptr};
  GroupedExperts experts_{nullptr};
  ExpertDispatch dispatch_;  // expert parallelism; empty: every expert here
  std::shared_ptr<LlamaMlpImpl> shared_experts_;  // null without shared experts
  torch::Tensor loads_;
  torch::Tensor last_choices_;
  double aux_sum_ = 0, aux_weight_ = 0;
};
TORCH_MODULE(MoeFeedForward);

// Every MoE layer under `root`, in module order.
std::vector<MoeFeedForwardImpl*> moe_layers(torch::nn::Module& root);

// Parameters of a llama with these options: all, and those one token's
// forward multiplies by (the routed experts' k of E, the rest whole).
struct ParameterCounts {
  double total = 0;
  double active = 0;
};
ParameterCounts llama_parameter_counts(const ModelOptions& options);

}  // namespace models
