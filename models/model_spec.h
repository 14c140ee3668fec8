#pragma once
// A model kind's spec: everything that is specific to one kind of model, in
// one place, registered by name (model.kind). The trainer, the checkpoint
// exports and the tools drive specs and name no model (torchtitan's
// TrainSpec). Adding a model adds a spec: register_model_spec, then
// model.kind names it; nothing in framework/train or checkpoint/ changes.
//
// A spec holds:
//   - build: the model, unmaterialised where the kind can be (parameters
//     without storage that `init_parameter` fills one at a time, so no rank
//     holds the whole model);
//   - its FSDP units and activation checkpointing (the LayeredModelImpl it
//     builds: unit_names(), set_activation_checkpointing);
//   - its tensor-parallel plan (empty: the kind cannot be split);
//   - its loss;
//   - its size and FLOPs per token (for the memory estimate and MFU);
//   - its Hugging Face adapter (config.json out, parameter names, tied
//     weights), where it has a Hugging Face counterpart;
//   - embeds_parameter: pipeline parallelism's split of the parameters
//     outside the blocks between the first stage and the last;
//   - set_context_parallel: context parallelism's RoPE positions and ring
//     attention set on the built model (llama).
//
// Example (a kind of your own; tests/models/test_models.cpp has one):
//   models::ModelSpec spec = models::find_model_spec("gpt");  // start from one
//   spec.kind = "tiny";
//   spec.build = [](const ModelOptions& o, bool) { return make_tiny(o); };
//   models::register_model_spec(spec);
//   // model.kind: tiny now trains with framework::train::Trainer.
//
// Thread safety: register before any thread looks a spec up; lookups may
// then run concurrently.
#include "models/hf_adapter.h"
#include "models/layered_model.h"
#include "models/options.h"
#include "models/tp_plan.h"

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace models {

// A loss over a local batch: summed over the items that count (tokens,
// samples) and how many count. The trainer divides by the global count.
struct LossSum {
  torch::Tensor sum;    // 0-d, differentiable
  torch::Tensor count;  // 0-d, any dtype
};

// What the trainer tells a spec's loss about the run.
struct LossContext {
  int64_t ignore_index = -100;  // targets that do not count (eval padding)
  bool fused_kernels = false;   // train.fused_kernels, for kinds that have them
  // Set under tensor parallelism when the plan splits the output by
  // vocabulary: the per-token cross-entropy of the local logits [N, V_local]
  // against targets [N] -> [N] (framework/tp's vocab_parallel_cross_entropy).
  std::function<torch::Tensor(const torch::Tensor& logits, const torch::Tensor& targets)>
      vocab_parallel_cross_entropy;
};

using LossFn = std::function<LossSum(LayeredModelImpl& model, const torch::Tensor& inputs,
                                     const torch::Tensor& targets, const LossContext& context)>;

// The token cross-entropy of the model's logits, in fp32 whatever the compute
// dtype (fused: one chunk of rows at a time; vocabulary-parallel when the
// context says so). The loss of every built-in kind.
LossSum token_cross_entropy(LayeredModelImpl& model, const torch::Tensor& inputs,
                            const torch::Tensor& targets, const LossContext& context);

// Pipeline parallelism's hook: true for the parameters outside the blocks
// that embed() uses, which live on the first stage; the others outside the
// blocks live on the last (head()). The blocks split between the stages
// (framework/pp/schedule.h: split_blocks), and each stage's forward is
// LayeredModelImpl::forward with set_stage.
using EmbedsParameterFn = std::function<bool(const std::string& name)>;

struct ModelSpec {
  std::string kind;         // model.kind
  std::string description;  // for --help and docs: "Llama 3: RMSNorm, RoPE, ..."
  // Rules of this kind's options beyond every kind's positive sizes
  // (models/options.h: check_model_options); the config runs them at load
  // and make_model before building. Throws c10::Error (TORCH_CHECK) or
  // std::invalid_argument naming the first invalid model.* key. Empty: none
  // (the built-in kinds' rules live in models/options.cpp, torch-free).
  std::function<void(const ModelOptions& options)> validate;
  // The model, initialised deterministically from the global torch
  // generator (given torch::manual_seed beforehand), its activation
  // checkpointing set from the options. materialize false: parameters
  // without storage where the kind supports it (see lazy_init).
  std::function<std::shared_ptr<LayeredModelImpl>(const ModelOptions& options, bool materialize)>
      build;
  // True: build(options, false) leaves parameters without storage and the
  // model's init_parameter fills them (FullyShardedModel calls it).
  bool lazy_init = false;
  std::function<ModelSize(const ModelOptions& options)> size;
  // Training FLOPs per token, forward and backward: 6 x the parameters
  // that multiply (embedding lookups excluded) + 12 x layers x d_model x
  // seq_len for attention (PaLM's estimate, torchtitan's
  // get_num_flop_per_token).
  std::function<double(const ModelOptions& options)> flops_per_token;
  TpPlan tp_plan;  // empty: parallel.tensor > 1 is refused
  LossFn loss = token_cross_entropy;
  // The fused kernels this kind uses under train.fused_kernels (set on the
  // built model), and their description for the banner. Unset: none.
  std::function<void(LayeredModelImpl& model, bool on)> use_fused_kernels;
  std::function<std::string()> fused_kernels_description;
  // model.tie_weights when the config does not set it (llama: false).
  bool ties_weights_by_default = true;
  std::optional<HfAdapter> hf;  // nullopt: no Hugging Face counterpart
  // Empty: the kind is not split into pipeline stages (parallel.pipeline
  // > 1 is refused, naming model.kind). gpt, llama and mlp have it.
  EmbedsParameterFn embeds_parameter;
  // Context parallelism (parallel.context > 1, framework/cp): sets this
  // rank's positions and the ring attention on a model this spec built
  // (layered_model.h: ContextParallel; a default value turns it off).
  // Empty: the kind is not split along the sequence (refused, naming
  // model.kind). llama has it.
  std::function<void(LayeredModelImpl& model, const ContextParallel& context)> set_context_parallel;
};

// Adds `spec` (or replaces the one of its kind), and its Hugging Face
// adapter (register_hf_adapter) when it has one. REQUIRES: spec.kind,
// spec.build, spec.size and spec.loss set.
void register_model_spec(ModelSpec spec);

// The spec of `kind`. Throws std::invalid_argument "model.kind 'x' is not a
// registered model (gpt, llama, mlp)" when there is none.
const ModelSpec& find_model_spec(const std::string& kind);
bool has_model_spec(const std::string& kind);

// parallel.tensor `tensor` above 1 needs the kind's tensor-parallel plan
// (ModelSpec::tp_plan; of the built-in kinds, llama's). A mixture of
// experts' MoE blocks stay whole on every tensor-parallel rank (the plan
// splits the attention and the dense blocks' MLPs). Throws
// std::invalid_argument naming both keys; the kind's head rules under TP
// are check_model_options'.
void check_tensor_parallel_plan(const ModelOptions& options, int64_t tensor);

// parallel.expert `expert` above 1 needs a mixture of experts whose
// experts it divides. Throws std::invalid_argument naming the keys.
void check_expert_parallel(const ModelOptions& options, int64_t expert);

// parallel.context `context` above 1 needs a kind that splits along the
// sequence (ModelSpec::set_context_parallel: llama, dense or a mixture of
// experts). Throws std::invalid_argument naming the keys.
void check_context_parallel(const ModelOptions& options, int64_t context);

// parallel.pipeline `pipeline` above 1 needs the kind's pipeline split
// (ModelSpec::embeds_parameter).
// Throws std::invalid_argument naming the keys.
void check_pipeline_support(const ModelOptions& options, int64_t pipeline);

// model.lora.rank above 0 needs a kind with LoRA adapters (llama). Throws
// std::invalid_argument naming both keys. make_model and preflight call it.
void check_lora_support(const ModelOptions& options);

// Every registered kind, sorted: the built-in gpt, llama and mlp, and yours.
std::vector<std::string> registered_model_kinds();

// The built-in llama's plan (torchtitan's): embed_tokens rowwise (by
// vocabulary), q/k/v and gate/up colwise, o and down rowwise, lm_head
// colwise with its output split by vocabulary, norms replicated.
TpPlan llama_tp_plan();

}  // namespace models
