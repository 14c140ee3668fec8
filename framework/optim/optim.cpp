#include "comm/torch_compat.h"
#include "framework/optim/lr_schedule.h"
#include "framework/optim/sharded_adamw.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <utility>

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

const char* adamw_impl_name(AdamWImpl impl) {
  switch (impl) {
    case AdamWImpl::kForLoop: return "for_loop";
    case AdamWImpl::kForeach: return "foreach";
    case AdamWImpl::kFused: return "fused";
  }
  return "?";
}

bool adamw_impl_available(AdamWImpl impl) {
  return impl != AdamWImpl::kFused || comm::compat::kHasFusedAdamW;
}

AdamWImpl resolve_adamw_impl(OptimizerImpl choice, const torch::Device& device) {
  AdamWImpl impl = AdamWImpl::kForLoop;
  switch (choice) {
    case OptimizerImpl::kAuto:
      if (adamw_impl_available(AdamWImpl::kFused)) return AdamWImpl::kFused;
      return device.is_cuda() ? AdamWImpl::kForeach : AdamWImpl::kForLoop;
    case OptimizerImpl::kFused: impl = AdamWImpl::kFused; break;
    case OptimizerImpl::kForeach: impl = AdamWImpl::kForeach; break;
    case OptimizerImpl::kForLoop: impl = AdamWImpl::kForLoop; break;
  }
  if (!adamw_impl_available(impl)) {
    throw std::invalid_argument("train.optimizer_impl: " + std::string(to_string(choice)) +
                                " needs LibTorch 2.4 or later (_fused_adamw_); this build has " +
                                std::to_string(comm::compat::kTorchMajor) + "." +
                                std::to_string(comm::compat::kTorchMinor) +
                                ": use foreach, for_loop or auto");
  }
  return impl;
}

ShardedAdamW::ShardedAdamW(fsdp::FullyShardedModel& model, OptimOptions options,
                           int64_t total_steps, AdamWImpl impl)
    : model_(model),
      options_(options),
      total_steps_(total_steps),
      params_(model.local_params()),
      impl_(impl),
      step_tensors_(params_.size()) {
  if (!adamw_impl_available(impl)) {
    throw std::invalid_argument(std::string("AdamW implementation ") + adamw_impl_name(impl) +
                                " is not in this build of LibTorch");
  }
  torch::optim::AdamWOptions opts(options.lr);
  opts.betas({options.beta1, options.beta2}).eps(options.eps).weight_decay(options.weight_decay);
  adamw_ = std::make_unique<torch::optim::AdamW>(params_, opts);
}

double ShardedAdamW::step(int64_t step) {
  double lr = lr_at(options_, step, total_steps_);
  if (impl_ == AdamWImpl::kForLoop) {
    for (auto& group : adamw_->param_groups()) {
      static_cast<torch::optim::AdamWOptions&>(group.options()).lr(lr);
    }
    adamw_->step();
  } else {
    step_multi_tensor(lr);
  }
  return lr;
}

torch::optim::AdamWParamState& ShardedAdamW::state_for_update(size_t index) {
  if (auto* s = find_state(index)) return *s;
  // As torch::optim::AdamW makes it on a parameter's first update.
  const torch::Tensor& p = params_.at(index);
  auto state = std::make_unique<torch::optim::AdamWParamState>();
  state->step(0);
  state->exp_avg(torch::zeros_like(p, torch::MemoryFormat::Preserve));
  state->exp_avg_sq(torch::zeros_like(p, torch::MemoryFormat::Preserve));
  auto* raw = state.get();
  adamw_->state()[comm::compat::optimizer_state_key(p)] = std::move(state);
  return *raw;
}

// One update of every parameter with a gradient, as torch.optim.AdamW does
// with foreach=True or fused=True: parameters grouped by device and dtype,
// each group updated by multi-tensor kernels.
void ShardedAdamW::step_multi_tensor(double lr) {
  torch::NoGradGuard no_grad;
  struct Group {
    torch::Device device;
    torch::ScalarType dtype;
    std::vector<torch::Tensor> params, grads, exp_avgs, exp_avg_sqs, steps;
    std::vector<int64_t> step_values;
  };
  std::vector<Group> groups;
  for (size_t i = 0; i < params_.size(); ++i) {
    const torch::Tensor& p = params_[i];
    const torch::Tensor& g = p.grad();
    if (!g.defined()) continue;
    torch::optim::AdamWParamState& st = state_for_update(i);
    auto it = std::find_if(groups.begin(), groups.end(), [&](const Group& grp) {
      return grp.device == p.device() && grp.dtype == p.scalar_type();
    });
    if (it == groups.end()) {
      groups.push_back(Group{p.device(), p.scalar_type(), {}, {}, {}, {}, {}, {}});
      it = groups.end() - 1;
    }
    if (impl_ == AdamWImpl::kFused) {
      if (!step_tensors_[i].defined()) {
        step_tensors_[i] = torch::full({}, static_cast<double>(st.step()),
                                       torch::TensorOptions().dtype(torch::kFloat).device(p.device()));
      }
      it->steps.push_back(step_tensors_[i]);
    }
    st.step(st.step() + 1);
    it->params.push_back(p);
    it->grads.push_back(g);
    it->exp_avgs.push_back(st.exp_avg());
    it->exp_avg_sqs.push_back(st.exp_avg_sq());
    it->step_values.push_back(st.step());
  }
  const double beta1 = options_.beta1, beta2 = options_.beta2;
  for (Group& grp : groups) {
    if (impl_ == AdamWImpl::kFused) {
      at::_foreach_add_(grp.steps, 1);
      comm::compat::fused_adamw_(grp.params, grp.grads, grp.exp_avgs, grp.exp_avg_sqs, grp.steps, lr,
                                 beta1, beta2, options_.weight_decay, options_.eps);
      continue;
    }
    // torch.optim.AdamW(foreach=True), capturable=False, step for step.
    if (options_.weight_decay != 0) at::_foreach_mul_(grp.params, 1.0 - lr * options_.weight_decay);
    comm::compat::foreach_moving_average_(grp.exp_avgs, grp.grads, beta1);
    at::_foreach_mul_(grp.exp_avg_sqs, beta2);
    at::_foreach_addcmul_(grp.exp_avg_sqs, grp.grads, grp.grads, 1.0 - beta2);
    std::vector<at::Scalar> step_sizes, bias_correction2_sqrt;
    step_sizes.reserve(grp.step_values.size());
    bias_correction2_sqrt.reserve(grp.step_values.size());
    for (int64_t s : grp.step_values) {
      const double bc1 = 1.0 - std::pow(beta1, static_cast<double>(s));
      const double bc2 = 1.0 - std::pow(beta2, static_cast<double>(s));
      step_sizes.emplace_back((lr / bc1) * -1.0);
      bias_correction2_sqrt.emplace_back(std::pow(bc2, 0.5));
    }
    std::vector<torch::Tensor> denom = at::_foreach_sqrt(grp.exp_avg_sqs);
    at::_foreach_div_(denom, bias_correction2_sqrt);
    at::_foreach_add_(denom, options_.eps);
    at::_foreach_addcdiv_(grp.params, grp.exp_avgs, denom, step_sizes);
  }
}

torch::optim::AdamWParamState* ShardedAdamW::find_state(size_t index) {
  auto& states = adamw_->state();
  auto it = states.find(comm::compat::optimizer_state_key(params_.at(index)));
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
  adamw_->state()[comm::compat::optimizer_state_key(p)] = std::move(state);
  step_tensors_.at(index) = torch::Tensor();
}

}  // namespace framework::optim
