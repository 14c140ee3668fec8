#pragma once
// Tensor parallelism as a model declares it: which submodules are split and
// how (torchtitan's parallelize_module plan; Hugging Face's
// base_model_tp_plan). Plain data: framework/tp applies a plan
// (tp::parallelize_module) and names these types tp::Style, tp::PlanEntry
// and tp::Plan. A model's spec (models/model_spec.h) holds its plan.
#include <string>
#include <vector>

namespace models {

// kSumGrads: whole on every rank like kReplicate, but each rank's gradient
// covers only its own part of the work (a per-head norm, model.qk_norm, over
// this rank's heads): FSDP sums the gradients over the tensor group, as
// Megatron-LM does for its q/k layernorms.
enum class TpStyle { kColwise, kRowwise, kReplicate, kSumGrads };

struct TpPlanEntry {
  // A submodule's name in named_modules(); "*" stands for one whole name
  // component: "model.layers.*.self_attn.q_proj".
  std::string pattern;
  TpStyle style = TpStyle::kReplicate;
  bool gather_output = false;  // colwise only: all-gather the output's last dim
};
using TpPlan = std::vector<TpPlanEntry>;

}  // namespace models
