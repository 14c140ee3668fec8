#pragma once
// Runs a pipeline schedule (schedule.h) on this rank: each action's forward
// or backward through the caller's stage callbacks, with the activations and
// their gradients sent point to point over the pipeline axis's group
// (comm::Group::send_async / recv_async: Gloo on the CPU, NCCL on CUDA).
//
// Sends are issued and not waited for until the step's end, so a rank never
// blocks on a peer that is itself waiting to receive from it; a receive is
// waited for right before the action that needs it (the time blocked is the
// pipeline's bubble as this rank sees it: wait_seconds()). Each message
// carries a tag of its own (kind, stage, micro-batch), so Gloo matches it
// whatever order the ranks post them in.
//
// Thread safety: one training thread drives it.
#include "comm/process_group.h"
#include "framework/pp/schedule.h"

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace framework::pp {

struct StageCallbacks {
  // Stage `stage` on micro-batch `micro`. `input`: the micro-batch's inputs
  // on the first stage, else the activations received from the stage
  // before (a leaf that requires grad). Returns the activations to send to
  // the next stage, or on the last stage the 0-d value to run backward on.
  std::function<torch::Tensor(int64_t stage, int64_t micro, const torch::Tensor& input)> forward;
  // Before each backward pass; `last`: the step's last on this rank.
  std::function<void(bool last)> before_backward;
  // After each backward pass but the step's last on this rank.
  std::function<void()> after_backward;
};

// Unregisters every submodule of `module` none of whose parameters
// (full dotted names) `keep` holds true for, so that the module is one
// stage's: its named_parameters() are the stage's, under their global
// names. Throws std::invalid_argument naming a parameter that `keep` drops
// but a module holds directly beside kept ones (it cannot be removed).
void keep_only_parameters(torch::nn::Module& module, const std::function<bool(const std::string&)>& keep);

class PipelineRunner {
 public:
  // `group`: the pipeline axis (member p is pipeline rank p). Stage s runs
  // on member s mod P. REQUIRES: check_schedule(schedule, P,
  // stages_per_rank, micro_batches) passed (parallel::split_batch runs it
  // for the Trainer); group outlives the runner.
  PipelineRunner(comm::Group& group, Schedule schedule, int64_t stages_per_rank, int64_t micro_batches);

  int64_t ranks() const { return ranks_; }
  int64_t rank() const { return rank_; }
  int64_t stages() const { return ranks_ * stages_per_rank_; }
  int64_t micro_batches() const { return micro_; }
  // This rank's stages, in model order.
  std::vector<int64_t> local_stages() const;
  bool is_first(int64_t stage) const { return stage == 0; }
  bool is_last(int64_t stage) const { return stage == stages() - 1; }
  const std::vector<Action>& actions() const { return actions_; }

  // One training step: this rank's actions in order. first_inputs[m] is
  // micro-batch m's input to stage 0 (used on the rank that holds it).
  // Activations and their gradients between stages have `shape` and
  // `options` (the compute dtype, the training device).
  void run_step(const std::vector<torch::Tensor>& first_inputs, const std::vector<int64_t>& shape,
                torch::TensorOptions options, const StageCallbacks& callbacks);
  // Forwards only (evaluation, under torch::NoGradGuard), micro-batch by
  // micro-batch through every stage; the last stage's callback keeps what
  // it needs.
  void run_forward(const std::vector<torch::Tensor>& first_inputs, const std::vector<int64_t>& shape,
                   torch::TensorOptions options, const StageCallbacks& callbacks);

  // Of the last run_step: the most micro-batches whose activations one of
  // this rank's stages held at once (forward done, backward not yet).
  int64_t peak_held() const { return peak_held_; }
  // Seconds this rank waited for activations and gradients since it was
  // built (the bubble, as this rank saw it, plus the transfers).
  double wait_seconds() const { return wait_s_; }

 private:
  int tag(bool gradient, int64_t stage, int64_t micro) const;
  int member_of(int64_t stage) const { return static_cast<int>(stage % ranks_); }
  torch::Tensor receive(bool gradient, int64_t stage, int64_t micro, int from,
                        const std::vector<int64_t>& shape, torch::TensorOptions options);

  comm::Group& group_;
  int64_t ranks_, rank_, stages_per_rank_, micro_;
  std::vector<Action> actions_;
  std::vector<comm::Work> sends_;
  int64_t peak_held_ = 0;
  double wait_s_ = 0;
};

}  // namespace framework::pp
