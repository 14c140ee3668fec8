#pragma once
// Trainer::State: what a Trainer holds, shared by the files that implement
// it. Internal (not installed):
//   trainer.cpp        the loop: train_step, run_step, run, evaluate, sample
//   trainer_setup.cpp  the wiring: meshes, model (from the kind's spec), FSDP,
//                      optimizer, data, the checkpoint manager, resume, banner
//   metrics_log.h      rank 0's console lines and metrics.jsonl
//   state_dict.h       the state-dict items a checkpoint holds
// The checkpoint policy (when a save is due, when_busy, on_error) is the
// manager's (CheckpointManager::save_if_due).
#include "framework/train/trainer.h"

#include "checkpoint/async/manager.h"
#include "checkpoint/interop/import_dcp.h"
#include "comm/host_malloc.h"
#include "framework/data/dataset.h"
#include "framework/data/loader.h"
#include "framework/dtensor/device_mesh.h"
#include "framework/fsdp/fully_shard.h"
#include "framework/optim/sharded_adamw.h"
#include "framework/parallel/mesh.h"
#include "framework/pp/pipeline.h"
#include "framework/tokenizer/tokenizer.h"
#include "framework/tp/tensor_parallel.h"
#include "framework/cp/ring_attention.h"
#include "framework/ep/expert_parallel.h"
#include "framework/train/checkpoint_interval.h"
#include "framework/train/metrics_log.h"
#include "framework/train/preflight.h"
#include "framework/train/profiler.h"
#include "framework/train/resume_audit.h"
#include "models/moe.h"

#include <torch/torch.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace framework::train {

namespace detail {

using Clock = std::chrono::steady_clock;

// This rank's cross-entropy summed over its tokens, and how many of its
// targets count (not ignore_index); both still on the training device.
struct LocalLoss {
  torch::Tensor sum;
  torch::Tensor tokens;
};

// A step's batch on the training device, in its micro-batches (one
// without train.micro_batch_size).
struct MicroBatches {
  std::vector<torch::Tensor> inputs;
  std::vector<torch::Tensor> targets;
};

// What run() needs to decide when to log and to estimate the time left.
struct RunSpan {
  int64_t first_step;  // the first step this run() takes
  int64_t last_step;   // train.steps, or train.stop_at when it comes first
  Clock::time_point start;
};

// The step's one all-reduce, a sum over ranks. Packed into a double tensor
// in the order of the fields by pack_step_stats.
struct StepStats {
  double loss_sum = 0;        // cross-entropy summed over the global batch
  double tokens = 0;          // targets that count, global batch
  double stop_requested = 0;  // ranks that got a stop signal
  double ckpt_busy = 0;       // ranks with a save still in flight
};
constexpr int64_t kStepStatsSlots = 4;
static_assert(sizeof(StepStats) == kStepStatsSlots * sizeof(double), "one slot per field");

// What the resume chose (resume_or_initialise), for the banner and the
// start event.
struct ResumeChoice {
  ResumeSource source = ResumeSource::kConfig;
  std::string tier;  // tiers: local | durable, and why
  std::string reason;
  std::vector<std::string> notes;
};

// checkpoint.direct_io auto: what the probe of checkpoint.dir chose and why
// (direct_io.h), for the banner (empty text for true and false), and
// whether auto's latest line (the banner, or a save's) named O_DIRECT: a
// save that changes the way (auto learns from its own files) prints a line.
struct DirectIoChoice {
  std::string text;
  bool direct = false;
};

// The saves of this run that finished: how many failed (on_error: warn
// keeps going) and the last one.
struct SaveOutcomes {
  int64_t failed = 0;
  std::optional<checkpoint::CheckpointEvent> last;
};

// Every stage's parameters, unsharded (the banner), and of those what
// trains (LoRA: the adapters).
struct ParamCounts {
  int64_t total = 0;
  int64_t trainable = 0;
};

// Pipeline parallelism (layout.pipeline > 1): every stage's blocks and the
// schedule's runner.
struct PipelineStages {
  std::vector<pp::StageSpan> spans;
  std::unique_ptr<pp::PipelineRunner> runner;
};

// What a run reports as it goes: rank 0's log lines and metrics.jsonl,
// every rank's checkpoint timeline, the profiler (profile.every) and the
// MFU basis of the step lines.
struct Reports {
  std::unique_ptr<MetricsLog> log;            // rank 0 only
  std::unique_ptr<RankEventLog> rank_events;  // every rank, from its first save
  std::unique_ptr<StepProfiler> profiler;
  MfuBasis mfu;
};

}  // namespace detail

// In run.dir: the direct_io probes of the run's processes, which a restarted
// rank reuses (checkpoint/storage/direct_io.h, remember_direct_io_probes_in).
inline constexpr const char* kDirectIoProbesFile = ".direct_io_probes";

struct Trainer::State {
  config::Config cfg;
  comm::Runtime& rt;
  TrainerHooks hooks;
  bool is_logger = false;     // rank 0: the console and metrics.jsonl
  bool builtin_model = true;  // model and data from the config's sections (the kind's spec)
  comm::HostMallocOutcome host_malloc = comm::HostMallocOutcome::kDefault;
  detail::Clock::time_point started = detail::Clock::now();  // this process's run: wall_s

  // The parallel layout (framework/parallel): every axis's degree, this
  // rank's place on them and the meshes (meshes.stage: {replicate, shard[,
  // tensor]}, what FSDP and TP work on; meshes.world: with the pipeline
  // axis first). The ranks of a TP group train on the same batch and hold
  // the same loss: only the first (at.tensor 0) counts it in the sums.
  // Pipeline parallelism (layout.pipeline > 1): this rank's stages of the
  // model's blocks and the schedule's runner. The last stage computes the
  // loss: only its ranks count it in the step's sums.
  torch::Device device{torch::kCPU};  // where the model, optimizer and batches live
  parallel::Layout layout;
  parallel::Layout::Coordinates at;
  parallel::Meshes meshes;
  detail::PipelineStages pipeline;
  std::shared_ptr<models::LayeredModelImpl> layered;  // the built-in model (stages run through it)
  detail::ParamCounts params;
  std::string lora_base;  // LoRA: the lora.base item its checkpoints carry (config/run_items.h)
  // The data's files, seed and batch size, as every checkpoint records them
  // for the resume audit (resume_audit.h): read at the first need, once.
  std::optional<DataIdentity> data_identity;

  // The model and what trains it.
  UserModel user;  // the model, units, loss and data (built-in: from the kind's spec)
  tp::TensorParallelLayout tp_layout;
  ep::ExpertParallelLayout ep_layout;
  // parallel.context > 1: this rank's positions and the ring attention, as
  // set on the model (the sample's generation turns them off and on).
  models::ContextParallel context_parallel;
  // Its ring attention's seconds, summed over the run (per step: StepRecord).
  std::shared_ptr<cp::RingStats> ring_stats = std::make_shared<cp::RingStats>();
  std::unique_ptr<fsdp::FullyShardedModel> fsdp;
  std::unique_ptr<optim::ShardedAdamW> optim;
  std::unique_ptr<data::DataLoader> loader;
  std::unique_ptr<tokenizer::Tokenizer> tokenizer;  // data.tokenizer, loaded at the first sample
  int64_t micro_batches = 1;  // per step and rank (train.micro_batch_size)
  // The model's mixture-of-experts layers (model.moe): every stage's, by
  // name and expert count in module order (recorded before a pipeline
  // split drops the other stages' blocks), and this rank's, each with its
  // index in that list. Their step's statistics, summed over the ranks
  // (each layer counted on one tensor rank of its stage): [aux loss x its
  // weight, the weight, then every layer's loads in that order].
  struct MoeLayerName {
    std::string name;
    int64_t experts = 0;
  };
  std::vector<MoeLayerName> moe_names;
  std::vector<models::MoeFeedForwardImpl*> moe;
  std::vector<size_t> moe_index;
  torch::Tensor moe_step_stats;

  // Progress.
  int64_t step = 0;
  std::vector<StepRecord> history;
  std::optional<detail::RunSpan> span;  // of the run() (or run_step() calls) in progress
  detail::Reports reports;

  // Checkpoints.
  std::unique_ptr<checkpoint::CheckpointManager> ckpt;
  detail::ResumeChoice resume;
  detail::DirectIoChoice direct_io;
  detail::SaveOutcomes saves;
  // checkpoint.interval auto: the measurements each save derives the
  // interval from (checkpoint_interval.h); empty otherwise.
  std::optional<AutoIntervalTracker> auto_interval;
  bool restart_logged = false;  // log_restart_once

  // This process's start-up (the constructor fills in its phases, run()
  // the rest and logs it once per process on rank 0).
  StartupPhases startup;

  State(const config::Config& c, comm::Runtime& r) : cfg(c), rt(r) {}
  ~State() {
    // The hooks tensor parallelism set on the module hold the mesh's groups.
    if (layout.tensor > 1 && user.module) tp::clear_hooks(*user.module);
  }

  // Setup (trainer_setup.cpp), in the constructor's order.
  void build_mesh();
  void check_batch_split();
  void build_builtin_model();
  void split_pipeline_stages();
  void apply_tensor_parallel();
  void apply_expert_parallel();
  void apply_context_parallel();
  // parallel.context > 1: the model's context parallelism on or off.
  void use_context_parallel(bool on);
  // parallel.context > 1: this rank's part of each sequence of a [B, S]
  // batch (inputs or targets); else the batch.
  torch::Tensor split_sequence(const torch::Tensor& batch) const;
  void shard_model();
  void make_loader();
  void name_moe_layers();
  void find_moe_layers();
  std::string moe_description() const;
  std::string layout_text() const;  // "fsdp replicate=1 shard=2", as the banner says it
  void make_checkpoint_manager();
  // What the constructor resumed from (from: nothing, a fresh start).
  struct Resumed {
    std::optional<std::string> from;
    checkpoint::LoadStats stats;
    std::vector<checkpoint::SkippedCheckpoint> skipped;
  };
  Resumed resume_or_initialise();
  checkpoint::DcpLoadStats load_dcp(const std::string& dir);
  void audit_resumed_batch(const checkpoint::StateDict& sd, const std::string& path);
  void load_initial_weights();
  void start_log(const Resumed& resumed);
  // Rank 0, at the first run() of this process: the start-up line and record.
  void log_startup_once();
  // Rank 0, as this Trainer's first step begins: the goodput ledger's
  // "restart" record when an earlier attempt in run.dir did not finish.
  void log_restart_once();
  void print_banner(const std::optional<std::string>& resume_from, const checkpoint::LoadStats& resumed);
  void print_run_lines();
  int64_t param_count(bool trainable_only = false) const;  // elements of all parameters, unsharded
  std::string lora_description() const;  // "LoRA rank 8, alpha 16 on q_proj, v_proj" or "frozen base"

  // The loop (trainer.cpp).
  checkpoint::StateDict make_state_dict();
  const DataIdentity& identity_of_data();
  int64_t last_step() const;
  detail::StepStats compute_gradients(int64_t to_step);
  // This step's MoE statistics (moe_step_stats) into `rec`, and the
  // auxiliary-loss-free bias update of every layer from its global loads.
  void finish_moe_step(StepRecord& rec);
  void run_micro_batches(const detail::MicroBatches& batches, double global_tokens, torch::Tensor& loss_sum);
  void run_pipeline_schedule(const detail::MicroBatches& batches, double global_tokens, torch::Tensor& loss_sum);
  models::LayeredModelImpl::Stage stage_of(int64_t stage) const;
  torch::TensorOptions activation_options() const;
  bool counts_loss() const { return at.tensor == 0 && at.pipeline == layout.pipeline - 1; }
  double finish_gradients();
  double apply_optimizer_step(int64_t to_step);
  void log_step(const StepRecord& rec, const detail::RunSpan& span);
  void log_checkpoint_events();
  void after_step_profile();
  std::vector<double> gather_per_rank(double mine);
  void checkpoint_if_due(StepRecord& rec, int64_t last);
  // checkpoint.interval auto, after a save at rec.step (all ranks): the
  // ranks' mean stall and step time, the new interval on the manager.
  void rederive_checkpoint_interval(const StepRecord& rec);
  void finish_checkpoints();
};

}  // namespace framework::train
