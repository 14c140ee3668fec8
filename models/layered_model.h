#pragma once
// The model interface the FSDP wrapper splits into units: embed -> blocks -> head.
// Implementations are plain single-device LibTorch modules; every parameter belongs
// to a registered submodule, so parallelism can be applied from outside.
#include "models/options.h"

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace models {

// Context parallelism (framework/cp), as a model that supports it is told
// (ModelSpec::set_context_parallel): this rank holds `positions`' tokens of
// every sequence, and attention over the whole sequence is `attention`
// (ring attention over the context group). A default value: none.
struct ContextParallel {
  // [T_local] int64 on the CPU: the global positions of this rank's tokens,
  // in the order it holds them (RoPE rotates by these, not the local index).
  torch::Tensor positions;
  // Causal attention of this rank's queries over the whole sequence: q [B,
  // Hq, T_local, hd], k and v [B, Hkv, T_local, hd] (the key/value heads,
  // before any grouped-query repeat) -> [B, Hq, T_local, hd].
  std::function<torch::Tensor(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v)> attention;
  // The context group's size, and the in-place sum of a tensor over it (no
  // gradient): what a mixture of experts' auxiliary loss needs to count its
  // expert shares over the whole sequence, as without the split.
  int64_t degree = 1;
  std::function<void(torch::Tensor&)> sum_over_group;
};

class LayeredModelImpl : public torch::nn::Module {
 public:
  // tokens: int64 [B, T] with T <= seq_len -> hidden [B, T, D].
  virtual torch::Tensor embed(const torch::Tensor& tokens) = 0;
  virtual int64_t num_blocks() const = 0;
  // The i-th block, a unit for FSDP. REQUIRES: 0 <= i < num_blocks().
  virtual std::shared_ptr<torch::nn::Module> block(int64_t i) = 0;
  // h: [B, T, D] -> [B, T, D]. REQUIRES: 0 <= i < num_blocks().
  virtual torch::Tensor block_forward(int64_t i, const torch::Tensor& h) = 0;
  // hidden [B, T, D] -> logits [B, T, V] (includes the final norm).
  virtual torch::Tensor head(const torch::Tensor& h) = 0;

  // Fills `full`, the parameter `name` of a model built unmaterialised
  // (make_model(options, false)), with its initial values; any order, any
  // thread. Models that cannot be built so throw.
  virtual void init_parameter(const std::string& name, const torch::Tensor& full) const;

  // head(block_forward(n-1, ... block_forward(0, embed(tokens)))), each block
  // called through models::run_unit (the unit hook that FSDP sets: shard it
  // with fsdp::fully_shard(model, mesh, options, unit_names())), and through
  // models::checkpoint_activations where set_activation_checkpointing says.
  torch::Tensor forward(const torch::Tensor& tokens);

  // Pipeline parallelism: what forward() runs on this rank's stage. It
  // starts from embed(tokens) when `embed`, else from the hidden [B, T, D]
  // it is given (the previous stage's output); runs blocks [first, end)
  // (end -1: to the last); and ends with head() when `head`, else returns
  // the hidden. The default is the whole model. The trainer sets it before
  // each stage's forward (a rank may hold several stages).
  struct Stage {
    int64_t first = 0;
    int64_t end = -1;
    bool embed = true;
    bool head = true;
  };
  void set_stage(Stage stage) { stage_ = stage; }
  const Stage& stage() const { return stage_; }

  // The FSDP units: one per block ("blocks.N", the children of the
  // ModuleList "blocks"; llama: "model.layers.N").
  virtual std::vector<std::string> unit_names() const;

  // selective: blocks 0, every, 2 * every, ...
  void set_activation_checkpointing(ActivationCheckpointing mode, int64_t every);
  bool block_checkpointed(int64_t i) const;

 private:
  ActivationCheckpointing checkpointing_ = ActivationCheckpointing::kNone;
  Stage stage_;
  int64_t checkpoint_every_ = 1;
};

// Validates `options` (errors name the offending field, e.g. "model.n_heads") and
// builds the model of options.kind with its activation checkpointing set.
// gpt, mlp: initialised GPT-2 style from the global torch generator, so the
// result is deterministic given torch::manual_seed beforehand. llama: its
// per-parameter generators are seeded by one draw from the global generator
// (so also deterministic given torch::manual_seed); with materialize false
// its parameters are left without storage for init_parameter to fill
// (FullyShardedModel does, one at a time). gpt and mlp always materialise.
std::shared_ptr<LayeredModelImpl> make_model(const ModelOptions& options, bool materialize = true);

// What make_model(options) would hold, computed from the options alone
// (nothing allocated; doubles, so absurd sizes do not overflow).
struct ModelSize {
  double parameters = 0;       // all of them
  // Those one token's forward multiplies by (a mixture of experts: k of
  // its routed experts); the kind's size sets it, else all of them.
  double active_parameters = 0;
  double largest_unit = 0;     // one block, or the rest (embeddings, final norm, head)
  // A mixture of experts: the largest block and the parameters outside
  // the blocks (largest_unit is the larger), and one MoE block's routed
  // experts, which expert parallelism splits. 0 where the kind does not say.
  double largest_block = 0;
  double outside_blocks = 0;
  double routed_experts_per_block = 0;
  double largest_parameter = 0;  // elements
  double activation_floats_per_sample = 0;  // kept for backward, roughly
  double block_activation_floats_per_sample = 0;  // of those, one block's
};
ModelSize model_size(const ModelOptions& options);

// Throws c10::Error naming the first invalid field of `options`.
void validate_model_options(const ModelOptions& options);

}  // namespace models
