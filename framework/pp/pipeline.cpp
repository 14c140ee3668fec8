#include "framework/pp/pipeline.h"

#include <ATen/record_function.h>

#include <chrono>
#include <map>
#include <stdexcept>
#include <utility>

namespace framework::pp {

namespace {

void keep_only(torch::nn::Module& module, const std::function<bool(const std::string&)>& keep,
               const std::string& prefix) {
  for (const auto& p : module.named_parameters(/*recurse=*/false)) {
    if (!keep(prefix + p.key())) {
      throw std::invalid_argument("pipeline: parameter " + prefix + p.key() +
                                  " belongs to another stage but cannot be taken out of its module");
    }
  }
  std::vector<std::string> drop;
  for (const auto& child : module.named_children()) {
    bool any = false, all = true;
    for (const auto& p : child.value()->named_parameters(/*recurse=*/true)) {
      const bool k = keep(prefix + child.key() + "." + p.key());
      any |= k;
      all &= k;
    }
    if (!any) {
      drop.push_back(child.key());
    } else if (!all) {
      keep_only(*child.value(), keep, prefix + child.key() + ".");
    }
  }
  for (const std::string& name : drop) module.unregister_module(name);
}

}  // namespace

void keep_only_parameters(torch::nn::Module& module, const std::function<bool(const std::string&)>& keep) {
  keep_only(module, keep, "");
}

PipelineRunner::PipelineRunner(comm::Group& group, Schedule schedule, int64_t stages_per_rank,
                               int64_t micro_batches)
    : group_(group),
      ranks_(group.size()),
      rank_(group.rank()),
      stages_per_rank_(stages_per_rank),
      micro_(micro_batches) {
  actions_ = schedule_actions(schedule, ranks_, rank_, stages_per_rank, micro_batches);
}

std::vector<int64_t> PipelineRunner::local_stages() const {
  std::vector<int64_t> out;
  for (int64_t c = 0; c < stages_per_rank_; ++c) out.push_back(c * ranks_ + rank_);
  return out;
}

int PipelineRunner::tag(bool gradient, int64_t stage, int64_t micro) const {
  // Unique per message of a step: activations into `stage`, or gradients
  // out of it.
  return static_cast<int>(((gradient ? 1 : 0) * stages() + stage) * micro_ + micro);
}

torch::Tensor PipelineRunner::receive(bool gradient, int64_t stage, int64_t micro, int from,
                                      const std::vector<int64_t>& shape, torch::TensorOptions options) {
  RECORD_USER_SCOPE("shardkit::pp_recv");
  torch::Tensor t = torch::empty(shape, options.requires_grad(false));
  const auto t0 = std::chrono::steady_clock::now();
  group_.recv_async(t, from, tag(gradient, stage, micro)).wait();
  wait_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return t;
}

void PipelineRunner::run_step(const std::vector<torch::Tensor>& first_inputs, const std::vector<int64_t>& shape,
                              torch::TensorOptions options, const StageCallbacks& cb) {
  if (static_cast<int64_t>(first_inputs.size()) != micro_) {
    throw std::invalid_argument("PipelineRunner: " + std::to_string(first_inputs.size()) + " micro-batches, expected " +
                                std::to_string(micro_));
  }
  // (stage, micro) -> the forward's input (for its gradient) and output.
  std::map<std::pair<int64_t, int64_t>, std::pair<torch::Tensor, torch::Tensor>> held;
  std::map<int64_t, int64_t> live;
  peak_held_ = 0;
  int64_t backwards_left = 0;
  for (const Action& a : actions_) backwards_left += a.kind == Action::Kind::kBackward ? 1 : 0;
  try {
    for (const Action& a : actions_) {
      const std::pair<int64_t, int64_t> key{a.stage, a.micro};
      if (a.kind == Action::Kind::kForward) {
        torch::Tensor input;
        if (is_first(a.stage)) {
          input = first_inputs[a.micro];
        } else {
          input = receive(false, a.stage, a.micro, member_of(a.stage - 1), shape, options);
          input.requires_grad_(true);
        }
        torch::Tensor out;
        {
          // One range per action, for a profile's schedule timeline (profile.every).
          RECORD_USER_SCOPE("shardkit::pp_forward stage " + std::to_string(a.stage) + " micro " +
                            std::to_string(a.micro));
          out = cb.forward(a.stage, a.micro, input);
        }
        if (!is_last(a.stage)) {
          sends_.push_back(group_.send_async(out.detach(), member_of(a.stage + 1), tag(false, a.stage + 1, a.micro)));
        }
        held[key] = {input, out};
        peak_held_ = std::max(peak_held_, ++live[a.stage]);
        continue;
      }
      auto it = held.find(key);
      if (it == held.end()) {
        throw std::logic_error("pipeline: backward of stage " + std::to_string(a.stage) + ", micro-batch " +
                               std::to_string(a.micro) + " before its forward");
      }
      auto [input, out] = std::move(it->second);
      held.erase(it);
      --live[a.stage];
      --backwards_left;
      if (cb.before_backward) cb.before_backward(backwards_left == 0);
      {
        torch::Tensor grad;
        if (!is_last(a.stage)) grad = receive(true, a.stage + 1, a.micro, member_of(a.stage + 1), shape, options);
        RECORD_USER_SCOPE("shardkit::pp_backward stage " + std::to_string(a.stage) + " micro " +
                          std::to_string(a.micro));
        if (is_last(a.stage)) {
          out.backward();
        } else {
          torch::autograd::backward({out}, {grad});
        }
      }
      out = torch::Tensor();
      if (!is_first(a.stage)) {
        torch::Tensor g = input.grad();
        if (!g.defined()) g = torch::zeros(shape, options);
        sends_.push_back(group_.send_async(g, member_of(a.stage - 1), tag(true, a.stage, a.micro)));
      }
      if (backwards_left > 0 && cb.after_backward) cb.after_backward();
    }
    for (comm::Work& w : sends_) w.wait();
    sends_.clear();
  } catch (...) {
    sends_.clear();  // waited for (and their errors dropped) by the Works' destructors
    throw;
  }
}

void PipelineRunner::run_forward(const std::vector<torch::Tensor>& first_inputs, const std::vector<int64_t>& shape,
                                 torch::TensorOptions options, const StageCallbacks& cb) {
  try {
    for (int64_t m = 0; m < static_cast<int64_t>(first_inputs.size()); ++m) {
      for (int64_t stage : local_stages()) {
        torch::Tensor input = is_first(stage) ? first_inputs[m]
                                              : receive(false, stage, m % micro_, member_of(stage - 1), shape, options);
        torch::Tensor out = cb.forward(stage, m, input);
        if (!is_last(stage)) {
          sends_.push_back(group_.send_async(out.detach(), member_of(stage + 1), tag(false, stage + 1, m % micro_)));
        }
      }
      // Tags repeat every micro_ batches: the sends of this round are done
      // before the next round reuses them.
      if ((m + 1) % micro_ == 0) {
        for (comm::Work& w : sends_) w.wait();
        sends_.clear();
      }
    }
    for (comm::Work& w : sends_) w.wait();
    sends_.clear();
  } catch (...) {
    sends_.clear();
    throw;
  }
}

}  // namespace framework::pp
