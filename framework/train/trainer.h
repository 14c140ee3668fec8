#pragma once
// The one place where the pieces are wired together: mesh, model, FSDP,
// optimizer, data, metrics and checkpoints.
//
// Call sequence (all ranks): Trainer(config, runtime); run(). Or, to drive
// the loop yourself: Trainer(config, runtime); run_step() (or train_step())
// once per step.
//
// Your own model: Trainer(config, runtime, UserModel{module, units, loss,
// dataset}) trains any torch::nn::Module with the config's train, optim,
// parallel, checkpoint, run and dist sections; its model and data sections
// are not used (model.init_from still is). See examples/fsdp_custom_model.
#include "framework/config/config.h"
#include "checkpoint/storage/storage.h"
#include "comm/local_launcher.h"
#include "comm/runtime.h"
#include "framework/tp/tensor_parallel.h"
#include "models/model_spec.h"

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace framework::fsdp {
class FullyShardedModel;
}
namespace framework::data {
class Dataset;
}
namespace framework::optim {
class ShardedAdamW;
}

namespace framework::train {

// Exit status of a run stopped by SIGTERM/SIGINT after its final save: the
// job was preempted and should be resumed.
inline constexpr int kExitPreempted = comm::kExitResumable;

// One training step. All fields but the timings are the same on every rank.
struct StepRecord {
  int64_t step = 0;         // 1-based
  double loss = 0;          // mean cross-entropy over the global batch's tokens
  double lr = 0;
  double grad_norm = 0;     // global, before clipping; 0 with train.grad_clip off
  double step_time_s = 0;   // this rank: batch, forward, backward, optimizer
  double tokens_per_s = 0;  // global batch tokens / step_time_s
  // Model FLOPs utilisation, percent of the job's peak (MfuBasis,
  // metrics_log.h); 0: not known (no train.peak_tflops on the CPU, a GPU
  // not in the table, a UserModel without flops_per_token).
  double mfu_percent = 0;
  // This rank: time the step waited for FSDP's collectives, the exposed
  // communication (FullyShardedModel::comm_wait_seconds; near 0 on NCCL,
  // where waits are on the stream).
  double comm_wait_s = 0;
  // Pipeline parallelism, this rank: time the step waited for activations
  // and gradients from the other stages (the schedule's bubble as this rank
  // saw it, plus the transfers), and the most micro-batches whose
  // activations one of its stages held at once. 0 without a pipeline.
  double pipeline_wait_s = 0;
  int64_t pipeline_peak_held = 0;
  // Agreed by the step's all-reduce.
  bool stop_requested = false;   // a rank had stop_signal() set
  bool checkpoint_busy = false;  // a rank still had a save in flight
  // Set by run() after the step (train_step() saves nothing).
  bool checkpoint_started = false;    // save() of this step was called
  bool checkpoint_skipped = false;    // due, but a save was in flight (when_busy: skip)
  double checkpoint_blocking_s = 0;   // time this rank's save() call held the loop
  // A mixture of experts (model.moe), over the global batch: the auxiliary
  // load-balancing loss (mean over the MoE layers; computed whether or not
  // model.moe.aux_loss_coef trains on it), and each MoE layer's tokens per
  // expert (top-k choices). Empty without MoE layers.
  double moe_aux_loss = 0;
  std::vector<std::vector<double>> expert_loads;
  // Expert parallelism, this rank: seconds in the MoE layers' all-to-alls
  // (forward and backward; on NCCL the time to enqueue them). 0 without.
  double all_to_all_s = 0;
  // Context parallelism, this rank: seconds in ring attention (forward and
  // backward) and, of them, waiting for key/value and gradient blocks
  // (cp::RingStats; host time). 0 without.
  double context_attention_s = 0;
  double context_wait_s = 0;
};

// A validation pass over the held-out samples (data.eval_fraction).
struct EvalRecord {
  int64_t step = 0;      // after this training step
  double loss = 0;       // mean cross-entropy over every held-out target
  double tokens = 0;     // held-out targets that count
  int64_t samples = 0;   // held-out samples evaluated
  double seconds = 0;    // this rank
};

// This rank's loss on its slice of a batch: summed over its items (tokens,
// samples), and how many items count. The trainer divides by the global
// count, which makes training independent of the world size. (The loss
// type of every model's spec: models/model_spec.h.)
using LossSum = models::LossSum;

// A model that the caller brings instead of the config's model section.
struct UserModel {
  // Built identically on every rank (same seed), on the CPU; the trainer
  // moves it to the run's device and shards it.
  std::shared_ptr<torch::nn::Module> module;
  // Its FSDP units (fsdp::children_of, fsdp::modules_where); their calls in
  // the module's forward go through fsdp::run_unit. Empty: one root unit.
  std::vector<std::string> units;
  // The loss of a local batch (inputs, targets as the loader stacks the
  // dataset's samples, on the run's device). It calls the module's forward;
  // the trainer runs it inside FullyShardedModel::forward. Targets of eval
  // padding are data::kIgnoreIndex and must not count.
  std::function<LossSum(const torch::Tensor& inputs, const torch::Tensor& targets)> loss;
  // Samples (inputs, targets) by global index: data::Dataset.
  std::shared_ptr<data::Dataset> dataset;
  // Shown in the banner, e.g. "llama 4 layers".
  std::string description = "custom";
  // For a module built without parameter storage: fills each full
  // parameter as FullyShardedModel materialises it (fsdp::ParamInit).
  std::function<void(const std::string& name, const torch::Tensor& full)> init;
  // parallel.tensor > 1: which submodules are split and how (tp::Plan, as
  // torchtitan's parallelize_module takes it). The trainer applies it before
  // FSDP; `init` is then still called with whole parameters. The loss sees
  // what the plan leaves: e.g. logits split by vocabulary for a colwise
  // output projection (tp::vocab_parallel_cross_entropy).
  tp::Plan tensor_parallel_plan;
  // parallel.pipeline > 1: a module that is a models::LayeredModelImpl
  // (embed, blocks, head) splits into stages as the built-in kinds do: its
  // blocks (unit_names(), which are then the units) between the stages,
  // and the parameters outside the blocks by this: true for those embed()
  // uses (the first stage holds them), false for the rest (the last stage,
  // with head()). `loss` must run the model through its forward(), which
  // runs only the stage's part (set_stage): on the last stage it gets the
  // previous stage's hidden as `inputs`. Unset: the model is not split
  // (parallel.pipeline > 1 is refused).
  std::function<bool(const std::string& name)> embeds_parameter;
  // Training FLOPs per token, forward and backward, for MFU (a built-in
  // kind's: models::ModelSpec::flops_per_token); 0: MFU not reported.
  double flops_per_token = 0;
};

// What the caller of a Trainer may plug in besides the config.
struct TrainerHooks {
  // Where checkpoints are read and written; null: the POSIX file system.
  std::shared_ptr<checkpoint::Storage> storage;
  // Where the node-local tier (checkpoint.local.dir) is read and written;
  // null: the POSIX file system.
  std::shared_ptr<checkpoint::Storage> local_storage;
  // (Test-only stall and kill points are not here: framework/train/train_seam.h
  // and checkpoint/save_seam.h, not installed.)
};

class Trainer {
 public:
  // REQUIRES: runtime outlives the trainer; every rank constructs it with the
  // same config.
  Trainer(const config::Config& config, comm::Runtime& runtime, TrainerHooks hooks = {});
  // Trains `model` instead of the config's model and data sections.
  // REQUIRES: model.module, model.loss and model.dataset set.
  Trainer(const config::Config& config, comm::Runtime& runtime, UserModel model,
          TrainerHooks hooks = {});
  ~Trainer();

  // Trains from the current step to train.steps (or train.stop_at): a loop
  // over train_step() that logs (rank 0: console and metrics.jsonl), saves
  // checkpoints when due and after a stop signal, stops when any rank got
  // one, and commits the last save before it returns. Returns the process
  // exit status: 0, or kExitPreempted after a stop signal.
  int run();

  // (all ranks) One step of run(): train_step(), then the log line and
  // metrics record (when due), the checkpoint policy (a save when due, or
  // after a stop signal) and the validation pass (when due). Returns the
  // step's record with the checkpoint outcome. run() is a loop over it.
  // REQUIRES: step() < train.steps.
  StepRecord run_step();

  // (all ranks) One training step, step() + 1: forward on the next batch,
  // one all-reduce of the loss, token count and stop/busy flags, backward
  // (FSDP reduce-scatters the gradients), clipping, optimizer step. Appends
  // the record to history() and returns it. Logs and saves nothing, and does
  // not stop on a stop signal: it reports one in stop_requested. A save
  // started by run() may still be in flight; in overlap mode the step waits
  // for its staging before the optimizer step.
  // REQUIRES: step() < train.steps; every rank calls it the same number of
  // times (it is collective).
  StepRecord train_step();

  // (all ranks) The validation loss on min(train.eval_samples, held-out
  // samples) held-out samples, in batches of train.global_batch_size split
  // over the ranks as training batches are: the same at any world size.
  // No gradients; nothing changes. run() calls it every train.eval_every
  // steps and at the last step, and logs it.
  // REQUIRES: data.eval_fraction > 0; collective, like train_step().
  EvalRecord evaluate();

  // The greedy continuation (train.sample_tokens bytes) of
  // train.sample_prompt by the model as it is now; run() calls it every
  // train.sample_every steps and rank 0 prints it. Collective (every rank
  // runs the forwards). REQUIRES: the built-in model, model.vocab_size 256.
  std::string sample();

  // The last step taken: run() and train_step() continue after it (0 for a
  // fresh run).
  int64_t step() const;
  const std::vector<StepRecord>& history() const;
  fsdp::FullyShardedModel& model();
  optim::ShardedAdamW& optimizer();

  // Set from a signal handler: finish the current step, save, and return.
  static std::atomic<int>& stop_signal();

  struct State;

 private:
  std::unique_ptr<State> s_;
};

}  // namespace framework::train
