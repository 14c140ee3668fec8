#include "dist/torch_compat.h"
#include "framework/optim/lr_schedule.h"
#include "framework/optim/sharded_adamw.h"

#include <cmath>

namespace framework::optim {

double lr_at(const OptimOptions& o, int64_t step, int64_t total_steps) {
  if (o.warmup_steps > 0 && step <= o.warmup_steps) {
    return o.lr * static_cast<double>(step) / static_cast<double>(o.warmup_steps);
  }
  int64_t decay_steps = total_steps - o.warmup_steps;
  if (decay_steps <= 0) return o.lr;
  double progress = static_cast<double>(step - o.warmup_steps) / static_cast<double>(decay_steps);
  progress = std::min(1.0, std::max(0.0, progress));
  return o.min_lr + 0.5 * (o.lr - o.min_lr) * (1.0 + std::cos(M_PI * progress));
}

ShardedAdamW::ShardedAdamW(fsdp::FullyShardedModel& model, OptimOptions options,
                           int64_t total_steps)
    : model_(model), options_(options), total_steps_(total_steps), params_(model.local_params()) {
  torch::optim::AdamWOptions opts(options.lr);
  opts.betas({options.beta1, options.beta2}).eps(options.eps).weight_decay(options.weight_decay);
  adamw_ = std::make_unique<torch::optim::AdamW>(params_, opts);
}

double ShardedAdamW::step(int64_t step) {
  double lr = lr_at(options_, step, total_steps_);
  for (auto& group : adamw_->param_groups()) {
    static_cast<torch::optim::AdamWOptions&>(group.options()).lr(lr);
  }
  adamw_->step();
  return lr;
}

torch::optim::AdamWParamState* ShardedAdamW::find_state(size_t index) {
  auto& states = adamw_->state();
  auto it = states.find(dist::compat::optimizer_state_key(params_.at(index)));
  if (it == states.end()) return nullptr;
  return static_cast<torch::optim::AdamWParamState*>(it->second.get());
}

AdamWParamState ShardedAdamW::state(size_t index) {
  const torch::Tensor& p = params_.at(index);
  if (auto* s = find_state(index)) {
    return {s->step(), model_.like_param(index, s->exp_avg()),
            model_.like_param(index, s->exp_avg_sq())};
  }
  return {0, model_.like_param(index, torch::zeros_like(p, torch::MemoryFormat::Contiguous)),
          model_.like_param(index, torch::zeros_like(p, torch::MemoryFormat::Contiguous))};
}

void ShardedAdamW::set_state(size_t index, int64_t step, const torch::Tensor& exp_avg,
                             const torch::Tensor& exp_avg_sq) {
  const torch::Tensor& p = params_.at(index);
  TORCH_CHECK(exp_avg.sizes() == p.sizes() && exp_avg_sq.sizes() == p.sizes(),
              "optimizer state for ", model_.param_names().at(index), " has shape ",
              exp_avg.sizes(), ", the local shard has ", p.sizes());
  auto state = std::make_unique<torch::optim::AdamWParamState>();
  state->step(step);
  state->exp_avg(exp_avg.detach().clone().to(p.dtype()));
  state->exp_avg_sq(exp_avg_sq.detach().clone().to(p.dtype()));
  adamw_->state()[dist::compat::optimizer_state_key(p)] = std::move(state);
}

}  // namespace framework::optim
