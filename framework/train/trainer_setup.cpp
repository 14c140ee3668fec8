// The Trainer's wiring (trainer_state.h): the layout's meshes, the model from its kind's
// spec, tensor parallelism, FSDP, optimizer, data, the checkpoint manager,
// resume, and the banner. The loop is trainer.cpp.
#include "framework/train/trainer_state.h"

#include "checkpoint/interop/import_dcp.h"
#include "checkpoint/interop/import_weights.h"
#include "checkpoint/timing.h"
#include "comm/device.h"
#include "comm/launch_env.h"
#include "comm/local_launcher.h"
#include "framework/config/run_items.h"
#include "framework/cp/ring_attention.h"
#include "framework/cp/sequence_tensors.h"
#include "framework/dtensor/chunk.h"
#include "framework/train/state_dict.h"
#include "models/layered_model.h"
#include "models/llama.h"
#include "models/model_spec.h"

#include <torch/torch.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <iomanip>
#include <iostream>
#include <mutex>
#include <sstream>

namespace framework::train {

namespace fs = std::filesystem;

namespace {

// For the banner, where rank 0 serves the job's store and where its port
// came from: two jobs on one node collide when they pick the same one.
// Empty when a launcher serves the store or the job has one rank.
std::string rank0_store(const comm::LaunchEnv& env) {
  if (env.store_hosted || env.world_size < 2) return "";
  return ", store " + env.master_addr + ":" + std::to_string(env.master_port) +
         (env.master_port_source.empty() ? ", default port" : ", port from " + env.master_port_source);
}

}  // namespace

// The parallel layout (framework/parallel) for this world, its meshes and
// this rank's place on them.
void Trainer::State::build_mesh() {
  layout = parallel::resolve(cfg.parallel, rt.env.world_size);
  at = layout.coordinates(rt.env.rank);
  // With prefetch, all-gathers and gradient reductions overlap: each on its
  // own channel (process groups of their own) of the data-parallel axes.
  const int channels = cfg.parallel.prefetch > 0 ? 2 : 1;
  meshes = parallel::build_meshes(layout, *rt.rendezvous, channels);
}

// parallel.pipeline > 1: the model's blocks split into stages; this rank
// keeps the parameters of its own (stage s on pipeline rank s mod P): the
// other blocks, and the embedding or the head where this rank holds neither
// end, leave the module before anything is allocated.
void Trainer::State::split_pipeline_stages() {
  if (layout.pipeline == 1) return;
  const std::string key = "parallel.pipeline " + std::to_string(layout.pipeline);
  std::function<bool(const std::string&)> embeds;
  if (builtin_model) {
    models::check_pipeline_support(cfg.model, layout.pipeline);
    embeds = models::find_model_spec(cfg.model.kind).embeds_parameter;
  } else {
    layered = std::dynamic_pointer_cast<models::LayeredModelImpl>(user.module);
    embeds = user.embeds_parameter;
    if (!layered || !embeds) {
      throw std::invalid_argument(key + ": a UserModel splits into stages when its module is a "
                                  "models::LayeredModelImpl and UserModel::embeds_parameter is set");
    }
  }
  check_pipeline_sampling(cfg);
  pipeline.runner = std::make_unique<pp::PipelineRunner>(meshes.pipeline_group(), cfg.parallel.pipeline_schedule,
                                                  cfg.parallel.stages_per_rank, micro_batches);
  name_moe_layers();  // before the other stages' blocks leave the module
  const std::vector<std::string> blocks = layered->unit_names();
  pipeline.spans = pp::split_blocks(blocks, pipeline.runner->stages(), cfg.parallel.pipeline_split_points);
  std::vector<std::string> mine;
  bool first = false, last = false;
  for (int64_t stage : pipeline.runner->local_stages()) {
    first |= pipeline.runner->is_first(stage);
    last |= pipeline.runner->is_last(stage);
    for (int64_t b = pipeline.spans[stage].first; b < pipeline.spans[stage].end; ++b) mine.push_back(blocks[b]);
  }
  const auto in_any = [](const std::vector<std::string>& units, const std::string& name) {
    for (const std::string& u : units) {
      if (name.size() > u.size() && name.compare(0, u.size(), u) == 0 && name[u.size()] == '.') return true;
    }
    return false;
  };
  const auto keep = [&](const std::string& name) {
    if (in_any(blocks, name)) return in_any(mine, name);
    return embeds(name) ? first : last;
  };
  pp::keep_only_parameters(*user.module, keep);
  user.units = mine;
}

// The global batch over the data-parallel ranks, in micro-batches.
void Trainer::State::check_batch_split() {
  try {
    micro_batches = parallel::split_batch(cfg.parallel, layout, cfg.train.global_batch_size,
                                          cfg.train.micro_batch_size);
  } catch (const std::invalid_argument& e) {
    throw PreflightError(e.what());
  }
}

// ", 1234 active per token (top-2 of 8 experts in 3 of 4 blocks)" for a
// built-in mixture of experts, else "".
std::string Trainer::State::moe_description() const {
  if (moe_names.empty() || !builtin_model) return "";
  const models::MoeOptions& m = cfg.model.moe;
  return ", " + std::to_string(static_cast<int64_t>(models::model_size(cfg.model).active_parameters)) +
         " active per token (top-" + std::to_string(m.top_k) + " of " + std::to_string(m.num_experts) +
         " experts in " + std::to_string(moe_names.size()) + " of " + std::to_string(cfg.model.n_layers) + " blocks)";
}

namespace {

std::vector<std::pair<std::string, models::MoeFeedForwardImpl*>> named_moe_layers(torch::nn::Module& root) {
  std::vector<std::pair<std::string, models::MoeFeedForwardImpl*>> out;
  for (const auto& m : root.named_modules("", /*include_self=*/true)) {
    if (auto* moe = dynamic_cast<models::MoeFeedForwardImpl*>(m.value().get())) out.emplace_back(m.key(), moe);
  }
  return out;
}

}  // namespace

// Every MoE layer of the whole model, before a pipeline split: the step's
// statistics have a slot for each on every rank.
void Trainer::State::name_moe_layers() {
  moe_names.clear();
  for (const auto& [name, layer] : named_moe_layers(*user.module)) moe_names.push_back({name, layer->num_experts()});
}

// This rank's MoE layers, told the global batch their auxiliary loss is a
// share of.
void Trainer::State::find_moe_layers() {
  if (layout.pipeline == 1) name_moe_layers();
  moe.clear();
  moe_index.clear();
  for (const auto& [name, layer] : named_moe_layers(*user.module)) {
    size_t i = 0;
    while (i < moe_names.size() && moe_names[i].name != name) ++i;
    TORCH_CHECK(i < moe_names.size(), "find_moe_layers: ", name, " was not in the model before its pipeline split");
    moe.push_back(layer);
    moe_index.push_back(i);
    layer->set_global_batch_sequences(cfg.train.global_batch_size);
  }
}

// This data-parallel rank's loader over the dataset (a context group's
// members read the same samples).
void Trainer::State::make_loader() {
  loader = std::make_unique<data::DataLoader>(user.dataset, cfg.train.global_batch_size,
                                              static_cast<uint64_t>(cfg.run.seed),
                                              static_cast<int>(at.batch), static_cast<int>(layout.batch_parallel()));
}

// The layout as the banner, metrics.jsonl and the checkpoints' metadata
// name it: "pipeline=2 (1f1b, 2 stages, 4 micro-batches) x fsdp replicate=1 shard=2".
std::string Trainer::State::layout_text() const {
  std::ostringstream text;
  if (layout.pipeline > 1) {
    text << "pipeline=" << layout.pipeline << " (" << to_string(cfg.parallel.pipeline_schedule) << ", "
         << pipeline.runner->stages() << " stages, " << micro_batches << " micro-batches) x ";
  }
  text << layout.describe();
  return text.str();
}

// The config's model and data sections as a UserModel, from the model
// kind's spec (models/model_spec.h): every rank builds the same full model
// from the same seed, each block one FSDP unit, with the spec's loss.
void Trainer::State::build_builtin_model() {
  const models::ModelSpec& spec = models::find_model_spec(cfg.model.kind);
  try {
    models::check_tensor_parallel_plan(cfg.model, layout.tensor);
  } catch (const std::invalid_argument& e) {
    throw PreflightError(e.what());
  }
  std::shared_ptr<models::LayeredModelImpl> model;
  {
    // LibTorch's init functions draw from the process-wide generator; ranks
    // that share a process (tests) must not interleave here.
    static std::mutex init_mutex;
    std::lock_guard<std::mutex> lock(init_mutex);
    torch::manual_seed(static_cast<uint64_t>(cfg.run.seed));
    // Built unmaterialised where the kind can be: shard_model fills in one
    // parameter at a time, so no rank ever holds the whole model.
    models::validate_model_options(cfg.model);
    model = spec.build(cfg.model, /*materialize=*/!spec.lazy_init);
  }
  user.module = model;
  layered = model;
  user.units = model->unit_names();
  models::LossContext context;
  context.ignore_index = data::kIgnoreIndex;
  context.fused_kernels = cfg.train.fused_kernels && static_cast<bool>(spec.use_fused_kernels);
  if (context.fused_kernels) spec.use_fused_kernels(*model, true);
  if (spec.lazy_init) {
    user.init = [model](const std::string& name, const torch::Tensor& full) {
      model->init_parameter(name, full);
    };
  }
  if (cfg.parallel.tensor > 1) {
    // The plan splits the output by vocabulary: each rank holds its slice of
    // the logits, and the cross-entropy is vocabulary-parallel.
    comm::Group* group = &meshes.stage->group(2);
    const int64_t offset =
        dtensor::chunk_span(cfg.model.vocab_size, cfg.parallel.tensor, meshes.stage->coordinate(2)).offset;
    user.tensor_parallel_plan = spec.tp_plan;
    context.vocab_parallel_cross_entropy = [group, offset](const torch::Tensor& logits,
                                                           const torch::Tensor& targets) {
      return tp::vocab_parallel_cross_entropy(logits, targets, offset, *group, data::kIgnoreIndex);
    };
  }
  user.loss = [model, loss = spec.loss, context](const torch::Tensor& inputs,
                                                 const torch::Tensor& targets) {
    return loss(*model, inputs, targets, context);
  };
  const detail::Clock::time_point data_started = detail::Clock::now();
  user.dataset = data::make_dataset(cfg.data, cfg.model, static_cast<uint64_t>(cfg.run.seed));
  startup.data_s += std::chrono::duration<double>(detail::Clock::now() - data_started).count();
  user.description = cfg.model.kind;
  if (spec.flops_per_token) user.flops_per_token = spec.flops_per_token(cfg.model);
}

// parallel.tensor > 1: the model's plan splits its weights over the mesh's
// tensor axis before FSDP shards each part over the data-parallel axes.
void Trainer::State::apply_tensor_parallel() {
  if (layout.tensor == 1) return;
  if (user.tensor_parallel_plan.empty()) {
    throw std::invalid_argument("parallel.tensor " + std::to_string(layout.tensor) +
                                ": this model has no tensor-parallel plan (UserModel::tensor_parallel_plan)");
  }
  // A pipeline stage holds only some of the modules the plan names; the
  // built-in llama's plan names modules its options may leave out (q/k
  // norm; a mixture of experts has the dense MLPs' modules in its dense
  // blocks only, its MoE blocks whole on every tensor-parallel rank).
  const bool partial = layout.pipeline > 1 || builtin_model;
  const tp::Plan plan = partial ? tp::restrict_plan(*user.module, user.tensor_parallel_plan)
                                : user.tensor_parallel_plan;
  tp_layout = tp::parallelize_module(*user.module, meshes.stage, 2, plan);
  if (user.init) user.init = tp::sharded_init(tp_layout, user.init);
}

// parallel.expert > 1: each MoE layer keeps its share of the routed experts
// and sends tokens to the others over the expert axis; FSDP shards the
// experts over the rest of the shard axis.
void Trainer::State::apply_expert_parallel() {
  if (layout.expert == 1) return;
  try {
    if (builtin_model) models::check_expert_parallel(cfg.model, layout.expert);
    ep_layout = ep::parallelize_experts(*user.module, meshes.expert);
  } catch (const std::invalid_argument& e) {
    throw PreflightError(e.what());
  }
  if (ep_layout.params.empty()) {
    throw PreflightError("parallel.expert " + std::to_string(layout.expert) + ": the model has no mixture-of-experts layer");
  }
  if (user.init) user.init = ep::expert_init(ep_layout, user.init);
}

// parallel.context > 1: every member of a context group reads the same
// samples and keeps its part of each sequence (split_sequence); the model
// rotates those tokens by their true positions and attends over the whole
// sequence by ring attention over the context group. Parameters are
// unchanged: FSDP shards them over the whole shard axis and its
// reduce-scatter sums the context ranks' gradients with the others'.
void Trainer::State::apply_context_parallel() {
  if (layout.context == 1) return;
  const std::string key = "parallel.context " + std::to_string(layout.context);
  if (!builtin_model) {
    throw PreflightError(key + ": a UserModel is not split along the sequence; use a model.kind that is (llama)");
  }
  try {
    models::check_context_parallel(cfg.model, layout.context);
  } catch (const std::invalid_argument& e) {
    throw PreflightError(e.what());
  }
  const cp::LoadBalance balance = cfg.parallel.context_load_balance;
  const torch::Tensor table = cp::position_table(cfg.model.seq_len, layout.context, balance);
  comm::Group* group = &meshes.context_group();
  context_parallel.positions = table[at.context].clone();
  context_parallel.attention = [table, group, stats = ring_stats](const torch::Tensor& q, const torch::Tensor& k,
                                                                   const torch::Tensor& v) {
    return cp::ring_attention(q, k, v, table, *group, /*causal=*/true, stats.get());
  };
  context_parallel.degree = layout.context;
  context_parallel.sum_over_group = [group](torch::Tensor& t) { group->all_reduce(t); };
  use_context_parallel(true);
}

void Trainer::State::use_context_parallel(bool on) {
  if (layout.context == 1) return;
  models::find_model_spec(cfg.model.kind).set_context_parallel(*layered, on ? context_parallel
                                                                            : models::ContextParallel{});
}

torch::Tensor Trainer::State::split_sequence(const torch::Tensor& batch) const {
  if (layout.context == 1) return batch;
  if (batch.size(1) != cfg.model.seq_len) {
    throw std::invalid_argument("parallel.context " + std::to_string(layout.context) + ": the data's sequences have " +
                                std::to_string(batch.size(1)) + " tokens, not model.seq_len (" +
                                std::to_string(cfg.model.seq_len) + ")");
  }
  return cp::split_sequence(batch, layout.context, at.context, cfg.parallel.context_load_balance, 1);
}

// Each rank keeps its shards of the same full model: results do not depend
// on the world size. REQUIRES: meshes.stage, user.module.
void Trainer::State::shard_model() {
  // The model is initialised on the CPU either way, so a CUDA run starts
  // from the same weights as a CPU run, then moves to the GPU.
  device = rt.device;
  if (device.is_cuda()) {
    // Bit-exact resume needs reproducible kernels (train.deterministic).
    comm::use_deterministic_cuda(cfg.train.deterministic);
    fsdp::move_to_device(*user.module, device);
  }
  fsdp::FsdpOptions parallel = parallel::fsdp_options(cfg.parallel);
  parallel.mixed_precision = cfg.train.mixed_precision;
  if (cfg.model.lora.rank > 0 && cfg.model.lora.base_dtype == "bf16") parallel.frozen_dtype = fsdp::PrecisionDtype::kBf16;
  parallel.tensor_parallel = tp_layout.params;
  if (layout.expert > 1) parallel.expert_parallel = {meshes.expert, ep_layout.params};
  fsdp = std::make_unique<fsdp::FullyShardedModel>(user.module, meshes.stage, parallel, user.units,
                                                   user.init);
  if (layout.pipeline > 1) {
    // Several micro-batches' forwards run before their backwards; the
    // gradient norm spans every stage.
    fsdp->set_hold_root(true);
    fsdp->set_norm_group(&meshes.pipeline_group());
  }
  optim = std::make_unique<optim::ShardedAdamW>(*fsdp, cfg.optim, cfg.train.steps,
                                                optim::resolve_adamw_impl(cfg.train.optimizer_impl, device));
}

// model.init_from into this rank's shards (each rank reads only their bytes).
void Trainer::State::load_initial_weights() {
  checkpoint::StateDict all = get_state_dict(*fsdp, nullptr);
  // LoRA: the base comes from the file; the adapters keep their start (B
  // zero: the base model).
  checkpoint::StateDict sd;
  for (const auto& t : all.tensors()) {
    if (!models::is_lora_parameter(t.name)) sd.add_tensor(t.name, t.local, t.global_shape, t.offsets);
  }
  torch::NoGradGuard no_grad;
  // A pipeline stage holds some of the model: the file's other tensors are
  // the other stages'. What this stage holds must all be there.
  // A Hugging Face directory's names where they are not ours (a mixture of
  // experts: one tensor per expert, each rank reading its experts' bytes).
  const checkpoint::WeightsFile file =
      checkpoint::WeightsFile::open(cfg.model.init_from).renamed(config::hf_renames(cfg.model));
  const checkpoint::ImportStats st = checkpoint::load_weights_into(sd, file, "model.", layout.pipeline > 1);
  if (!st.missing.empty()) {
    throw std::invalid_argument("model.init_from " + cfg.model.init_from + " has no " +
                                checkpoint::join_names(st.missing) + " (pipeline stage " + std::to_string(at.pipeline) + ")");
  }
}

// checkpoint.resume naming a PyTorch DCP directory: every rank reads its
// shards of the model and the AdamW moments and steps (import_dcp.h); the
// training step is train_state.step or the AdamW step; the loader continues
// at that step; the RNG state is not carried (DCP does not save LibTorch's).
checkpoint::DcpLoadStats Trainer::State::load_dcp(const std::string& dir) {
  checkpoint::StateDict sd = get_state_dict(*fsdp, optim.get());
  checkpoint::DcpLoadOptions options;
  options.storage = hooks.storage;
  const checkpoint::DcpLoadStats st = checkpoint::load_dcp_into(sd, dir, options);
  if (!cfg.checkpoint.model_only) {
    set_optimizer_state(sd, *fsdp, *optim);
    step = std::max<int64_t>(0, st.step);
    data::LoaderState position = loader->state();
    position.next_step = step;
    loader->load_state(position);
  }
  return st;
}

// Resumes from a PyTorch DCP directory or this run's newest checkpoint;
// else, with model.init_from, loads the initial weights.
Trainer::State::Resumed Trainer::State::resume_or_initialise() {
  Resumed out;
  const bool lora = cfg.model.lora.rank > 0;
  if (resume.source == ResumeSource::kDcp) {
    const std::string resume = cfg.checkpoint.resume;
    // A PyTorch DCP checkpoint (torchtitan, FSDP2): model and AdamW state,
    // resharded to this world; the data position follows its step.
    const checkpoint::DcpLoadStats st = load_dcp(resume);
    out.from = resume + " (PyTorch DCP)";
    out.stats.step = step;
    if (is_logger && !st.missing.empty()) {
      std::cerr << "shardkit: warning: " << resume << " has no " << checkpoint::join_names(st.missing)
                << "; those start fresh" << std::endl;
    }
  } else {
    checkpoint::StateDict sd = make_state_dict();
    // A GPU run's checkpoints hold rng.cuda; a CPU run takes it (and drops it).
    if (sd.find_bytes(config::kRngCudaItem) == nullptr) sd.add_bytes(config::kRngCudaItem, {});
    for (const char* optional : {config::kLoaderItem, config::kRngItem, config::kNextBatchItem,
                                 config::kLastLossItem, config::kRngCudaItem}) {
      sd.find_bytes(optional)->data.clear();
    }
    if (lora) sd.find_bytes(config::kLoraBaseItem)->data.clear();
    if (std::optional<checkpoint::ResumeResult> r = ckpt->resume(sd)) {
      if (lora && !sd.find_bytes(config::kLoraBaseItem)->data.empty()) {
        // The base the adapters go on (preflight compared its hash with
        // model.init_from's); it now lives at model.init_from.
        const std::vector<uint8_t>& bytes = sd.find_bytes(config::kLoraBaseItem)->data;
        config::LoraBase base = config::decode_lora_base(std::string(bytes.begin(), bytes.end()), r->path);
        if (!cfg.model.init_from.empty()) {
          base.path = std::filesystem::absolute(cfg.model.init_from).lexically_normal().string();
        }
        lora_base = config::encode_lora_base(base);
      }
      // Model shards were loaded in place.
      if (!cfg.checkpoint.model_only) {
        step = set_run_state(sd, *fsdp, *optim, *loader, cfg.checkpoint.allow_config_change, device);
        audit_resumed_batch(sd, r->path);
      }
      out.from = r->path;
      out.stats = r->stats;
      out.skipped = std::move(r->skipped);
      if (ckpt->tiered()) {
        resume.tier = r->tier;
        resume.reason = r->reason;
        resume.notes = r->notes;
      }
    }
  }
  if ((!out.from || lora) && !cfg.model.init_from.empty()) {
    // Full, unsharded weights from elsewhere: each rank reads only the byte
    // ranges of its own shards. Ignored when resuming (the checkpoint wins),
    // except for a LoRA run's base, which its checkpoints do not hold.
    load_initial_weights();
  }
  if (lora && lora_base.empty()) lora_base = config::encode_lora_base(config::lora_base_of(cfg.model.init_from));
  return out;
}

// Before the first update: is the batch the resumed run trains on next the
// one the checkpoint recorded? Every rank decides alike (the hash covers the
// global batch), so on a difference all throw ResumeAuditError together and
// no rank is left waiting in a collective; rank 0 says why.
void Trainer::State::audit_resumed_batch(const checkpoint::StateDict& sd, const std::string& path) {
  const AuditVerdict v = audit_resume(sd, *loader, identity_of_data(), cfg.checkpoint.resume_audit, path,
                                      cfg.checkpoint.allow_config_change);
  if (!is_logger || v.message.empty()) return;
  if (v.outcome == AuditOutcome::kDiffers) {
    std::cerr << "shardkit: warning: " << v.message << std::endl;
  } else {
    std::cout << "shardkit: " << v.message << std::endl;
  }
}

// The checkpoint manager over the checkpoint group, on POSIX (or the
// hooks' storage), with the local tier's placement.
void Trainer::State::make_checkpoint_manager() {
  // What a checkpoint imported from PyTorch DCP (ckpt import-dcp) lacks:
  // set_run_state derives the data position from the step and keeps the RNG.
  // What checkpoints saved before the resume audit lack: the audit is skipped.
  checkpoint::ManagerHooks manager_hooks;
  manager_hooks.optional_items = [](const std::string& name) {
    return name == config::kLoaderItem || name == config::kRngItem || name == config::kConfigItem ||
           name == config::kLoraBaseItem || name == config::kNextBatchItem || name == config::kLastLossItem ||
           name == config::kRngCudaItem;
  };
  checkpoint::CheckpointOptions ckpt_options = cfg.checkpoint;
  ckpt_options.local.dir = config::local_tier_pattern(cfg);
  if (cfg.checkpoint.interval == checkpoint::kIntervalAuto) {
    // The first interval only measures; the constructor counts it from the
    // step resumed, and each save then derives the next (checkpoint_interval.h).
    ckpt_options.interval = kAutoIntervalFirstSave;
    auto_interval.emplace(cfg.checkpoint.mtbf_s);
  }
  checkpoint::PosixOptions posix;
  posix.direct_io = cfg.checkpoint.direct_io;
  ckpt = std::make_unique<checkpoint::CheckpointManager>(
      ckpt_options, (fs::path(cfg.run.dir) / "checkpoints").string(), *rt.checkpoint, layout_text(),
      hooks.storage ? hooks.storage : checkpoint::posix_storage(posix), manager_hooks);
  // The local tier is never behind the test hooks' storage (that one stands
  // for the durable file system), unless they provide one for it.
  ckpt->set_placement({rt.env.node, hooks.local_storage ? hooks.local_storage : checkpoint::posix_storage(posix)});
  // direct_io auto: probe checkpoint.dir's file system now (every rank: the
  // choice is per process), not inside the first save, and say what won.
  if (!hooks.storage && posix.direct_io == checkpoint::DirectIo::kAuto) {
    // Remembered for the run: a restarted rank (train --max-restarts,
    // torchrun, a requeue) reuses the probe rather than writing 64 MiB each
    // way again before its first step.
    checkpoint::remember_direct_io_probes_in((fs::path(cfg.run.dir) / kDirectIoProbesFile).string());
    const checkpoint::DirectIoProbe probe = checkpoint::cached_direct_io_probe(ckpt->dir());
    direct_io.text = probe.detail;
    direct_io.direct = probe.use_direct;
  }
  if (ckpt->stages(device.is_cuda())) {
    // Host (pinned, for GPU state) staging buffers now, not at the first
    // save while the training loop waits.
    ckpt->reserve_staging(make_state_dict());
  }
}

// Rank 0: metrics.jsonl's start record, the resume's warnings, the banner.
void Trainer::State::start_log(const Resumed& resumed) {
  reports.log = std::make_unique<MetricsLog>(cfg, started);
  RunStart start;
  start.step = step;
  start.resumed_from = resumed.from;
  start.resumed = resumed.stats;
  start.resume_tier = resume.tier;
  start.resume_reason = resume.reason;
  start.world = rt.env.world_size;
  start.layout = layout_text();
  start.device = device.str();
  start.params = params.total;
  if (builtin_model) start.memory_estimate_mib = estimate_memory(cfg, rt.env.world_size, rt.env.nodes).total() / 1048576.0;
  reports.log->start(start);
  reports.log->resume_skipped(resumed.skipped);
  print_banner(resumed.from, resumed.stats);
}

void Trainer::State::log_startup_once() {
  static std::atomic<bool> logged{false};
  if (!is_logger || logged.exchange(true)) return;
  StartupPhases& p = startup;
  p.total_s = comm::process_age_s();
  p.load_s = rt.startup.called_at_s;
  p.rendezvous_s = rt.startup.rendezvous_s;
  p.groups_s = rt.startup.groups_s;
  p.restart = rt.env.restart_count;
  p.standby = comm::activated_standby();
  p.forked = comm::forked_rank();
  p.other_s = std::max(0.0, p.total_s - (p.load_s + p.rendezvous_s + p.groups_s + p.model_s + p.data_s +
                                         p.checkpoint_s + p.resume_s));
  reports.log->startup(step, p);
}

void Trainer::State::log_restart_once() {
  if (!is_logger || restart_logged || !reports.log) return;
  restart_logged = true;
  const EarlierAttempts& earlier = reports.log->earlier_attempts();
  if (!earlier.any) return;
  reports.log->restart(restart_ledger(earlier, step, checkpoint::unix_seconds_now()));
}

void Trainer::State::print_banner(const std::optional<std::string>& resume_from,
                                  const checkpoint::LoadStats& resumed) {
  const auto& st = fsdp->memory_stats();
  std::cout << "shardkit: world " << rt.env.world_size << " ("
            << (comm::started_by_local_launcher() ? std::string("train --nproc")
                                                : comm::to_string(rt.env.source))
            << (rt.env.agent_store ? ", the agent's store" : "")
            << rank0_store(rt.env)
            << (rt.env.restart_count > 0 ? ", restart " + std::to_string(rt.env.restart_count) : std::string())
            << "), layout " << layout_text()
            << (layout.context > 1 ? " (" + std::to_string(cfg.model.seq_len / layout.context) +
                                         " tokens per rank of each sequence's " + std::to_string(cfg.model.seq_len) +
                                         ", " + cp::to_string(cfg.parallel.context_load_balance) + ")"
                                   : std::string())
            << ", groups train=" << rt.train->backend_name()
            << " ckpt=" << rt.checkpoint->backend_name() << ", device " << device.str()
            << ", LibTorch " << comm::torch_version() << "\n"
            << "shardkit: model " << user.description << " " << params.total << " params"
            << (params.trainable < params.total ? " (" + std::to_string(params.trainable) + " trainable: " +
                                                      lora_description() + ")"
                                                : std::string())
            << moe_description() << ", "
            << fsdp->unit_names().size() << " units, " << std::fixed << std::setprecision(2)
            << st.sharded_param_bytes / 1048576.0 << std::defaultfloat << " MiB on this rank; data " << user.dataset->describe() << std::endl;
  print_run_lines();
  if (!direct_io.text.empty()) {
    std::cout << "shardkit: checkpoint.direct_io auto: " << direct_io.text << " in " << ckpt->dir() << std::endl;
  }
  if (auto_interval) {
    std::cout << "shardkit: checkpoint.interval auto: every sqrt(2 x save stall x checkpoint.mtbf_s "
              << cfg.checkpoint.mtbf_s << " s) of steps (Young/Daly); the first save, at step "
              << step + kAutoIntervalFirstSave << ", measures the stall, and each save derives the interval again"
              << std::endl;
  }
  if (builtin_model) {
    std::cout << "shardkit: memory estimate per rank "
              << describe(estimate_memory(cfg, rt.env.world_size, rt.env.nodes)) << std::endl;
  }
  if (!resume_from && !cfg.model.init_from.empty()) {
    std::cout << "shardkit: model initialised from " << cfg.model.init_from << std::endl;
  }
  if (resume_from) {
    std::cout << "shardkit: resumed from " << *resume_from << " (step " << resumed.step;
    if (resumed.saved_world_size > 0) {
      std::cout << ", saved by " << resumed.saved_world_size << " ranks, " << resumed.saved_layout;
    }
    std::cout << ")" << (cfg.checkpoint.model_only ? ", model only" : "")
              << "; continuing after step " << step << std::endl;
    if (!resume.tier.empty()) {
      std::cout << "shardkit: resume tier: " << resume.tier << " (" << resume.reason << ")" << std::endl;
      for (const std::string& note : resume.notes) std::cout << "shardkit: resume: " << note << std::endl;
    }
  }
}

// The banner's lines on how the run computes: precision, micro-batches,
// activation checkpointing, the optimizer and kernels, the profiler and
// run.host_malloc.
void Trainer::State::print_run_lines() {
  const auto& mp = cfg.train.mixed_precision;
  if (mp.param_dtype != fsdp::PrecisionDtype::kFp32 || mp.reduce_dtype != fsdp::PrecisionDtype::kFp32 ||
      micro_batches > 1 || cfg.model.activation_checkpointing != models::ActivationCheckpointing::kNone) {
    std::cout << "shardkit: compute " << to_string(mp.param_dtype) << ", gradients reduced in "
              << to_string(mp.reduce_dtype)
              << ", master weights and AdamW fp32; " << micro_batches << " micro-batch"
              << (micro_batches > 1 ? "es" : "") << " per step and rank";
    if (builtin_model) std::cout << "; activation checkpointing " << to_string(cfg.model.activation_checkpointing);
    std::cout << std::endl;
  }
  std::cout << "shardkit: optimizer AdamW " << optim::adamw_impl_name(optim->impl())
            << " (train.optimizer_impl " << to_string(cfg.train.optimizer_impl) << ")";
  if (builtin_model) {
    const models::ModelSpec& spec = models::find_model_spec(cfg.model.kind);
    if (spec.fused_kernels_description) {
      std::cout << "; fused kernels "
                << (cfg.train.fused_kernels ? spec.fused_kernels_description() : std::string("off"));
    }
  }
  std::cout << std::endl;
  if (reports.mfu.missing.empty()) {
    std::cout << "shardkit: MFU against " << reports.mfu.peak_flops / 1e12 << " TFLOP/s per device ("
              << reports.mfu.peak_source << "), " << std::scientific << std::setprecision(3)
              << reports.mfu.flops_per_token << std::defaultfloat << " FLOPs per token" << std::endl;
  } else {
    std::cout << "shardkit: MFU not reported: " << reports.mfu.missing << std::endl;
  }
  if (reports.profiler->enabled()) {
    std::cout << "shardkit: profiler traces of the last " << cfg.profile.active << " of every "
              << cfg.profile.every << " steps (" << StepProfiler::backend() << ") in " << reports.profiler->dir()
              << std::endl;
  }
  if (host_malloc == comm::HostMallocOutcome::kEnvironment) {
    std::cout << "shardkit: run.host_malloc " << to_string(cfg.run.host_malloc)
              << " left to MALLOC_* variables in the environment" << std::endl;
  } else if (host_malloc == comm::HostMallocOutcome::kUnsupported) {
    std::cout << "shardkit: run.host_malloc " << to_string(cfg.run.host_malloc)
              << " not applied: this C library's malloc has no such thresholds" << std::endl;
  }
}

std::string Trainer::State::lora_description() const {
  const models::LoraOptions& l = cfg.model.lora;
  if (!builtin_model || l.rank <= 0) return "frozen parameters";
  std::string targets;
  for (const std::string& t : models::lora_targets(l)) targets += (targets.empty() ? "" : ", ") + t;
  std::ostringstream out;
  out << "LoRA rank " << l.rank << ", alpha " << l.alpha << " on " << targets;
  return out.str();
}

int64_t Trainer::State::param_count(bool trainable_only) const {
  int64_t params = 0;
  for (size_t i = 0; i < fsdp->param_names().size(); ++i) {
    if (trainable_only && !fsdp->param_trainable(i)) continue;
    const dtensor::DTensor p = fsdp->param_dtensor(i);
    int64_t n = 1;
    for (int64_t d : p.global_shape()) n *= d;
    params += n;
  }
  return params;
}

std::atomic<int>& Trainer::stop_signal() {
  static std::atomic<int> signal{0};
  return signal;
}

Trainer::Trainer(const config::Config& config, comm::Runtime& runtime, TrainerHooks hooks)
    : Trainer(config, runtime, UserModel{}, std::move(hooks)) {}

Trainer::Trainer(const config::Config& config, comm::Runtime& runtime, UserModel model,
                 TrainerHooks hooks)
    : s_(std::make_unique<State>(config, runtime)) {
  State& s = *s_;
  // Start-up phases: seconds since the previous lap.
  detail::Clock::time_point lap_at = detail::Clock::now();
  const auto lap = [&lap_at] {
    const detail::Clock::time_point now = detail::Clock::now();
    const double seconds = std::chrono::duration<double>(now - lap_at).count();
    lap_at = now;
    return seconds;
  };
  // Before the model and its buffers are allocated: every later free of a
  // step's host buffers stays in the process (run.host_malloc).
  s.host_malloc = comm::apply_host_malloc(s.cfg.run.host_malloc);
  s.hooks = std::move(hooks);
  s.builtin_model = !model.module;
  if (!s.builtin_model) {
    if (!model.loss || !model.dataset) {
      throw std::invalid_argument("Trainer: a UserModel needs its loss and dataset set");
    }
    s.user = std::move(model);
  }
  s.is_logger = runtime.env.rank == 0;
  s.build_mesh();
  s.check_batch_split();
  if (s.builtin_model) s.build_builtin_model();
  s.split_pipeline_stages();
  s.apply_tensor_parallel();
  s.apply_expert_parallel();
  s.apply_context_parallel();
  s.shard_model();
  s.find_moe_layers();
  s.params.total = s.param_count();
  s.params.trainable = s.param_count(/*trainable_only=*/true);
  if (s.layout.pipeline > 1) {
    // Each stage counts its own parameters; the banner shows the model's.
    torch::Tensor n = torch::tensor({static_cast<double>(s.params.total), static_cast<double>(s.params.trainable)},
                                    torch::kDouble);
    s.meshes.pipeline_group().all_reduce(n);
    s.params.total = static_cast<int64_t>(n[0].item<double>());
    s.params.trainable = static_cast<int64_t>(n[1].item<double>());
  }
  s.startup.model_s = lap() - s.startup.data_s;  // the dataset counts as data
  s.reports.profiler = std::make_unique<StepProfiler>(s.cfg.profile, s.cfg.run.dir, runtime.env.rank,
                                              s.device.is_cuda());
  lap();
  s.make_loader();
  s.startup.data_s += lap();
  s.reports.mfu = mfu_basis(s.user.flops_per_token, s.cfg.train.peak_tflops, comm::cuda_device_name(s.device),
                    runtime.env.world_size);
  s.resume.source = resume_source(s.cfg);
  if (s.resume.source == ResumeSource::kAutoAfterDcp) {
    // The DCP directory was the run's initial load; it has its own now.
    s.cfg.checkpoint.resume = "auto";
  }
  lap();
  s.make_checkpoint_manager();
  s.startup.checkpoint_s = lap();
  const State::Resumed resumed = s.resume_or_initialise();
  s.startup.resume_s = lap();
  if (s.auto_interval) s.ckpt->set_interval(kAutoIntervalFirstSave, s.step);

  if (s.is_logger) s.start_log(resumed);
}

Trainer::~Trainer() = default;

int64_t Trainer::step() const { return s_->step; }
fsdp::FullyShardedModel& Trainer::model() { return *s_->fsdp; }
optim::ShardedAdamW& Trainer::optimizer() { return *s_->optim; }
const std::vector<StepRecord>& Trainer::history() const { return s_->history; }

}  // namespace framework::train
