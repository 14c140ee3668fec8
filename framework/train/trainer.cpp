#include "framework/train/trainer.h"
#include "framework/train/profiler.h"

#include <ATen/record_function.h>
#include "framework/train/preflight.h"
#include "framework/train/state_dict.h"
#include "framework/train/train_seam.h"

#include "checkpoint/interop/import_dcp.h"
#include "checkpoint/interop/import_weights.h"
#include "checkpoint/async/manager.h"
#include "checkpoint/format/byte_order.h"
#include "checkpoint/timing.h"
#include "framework/data/dataset.h"
#include "dist/device.h"
#include "dist/host_malloc.h"
#include "dist/launch_env.h"
#include "framework/data/sampler.h"
#include "framework/data/loader.h"
#include "framework/dtensor/chunk.h"
#include "framework/dtensor/device_mesh.h"
#include "framework/fsdp/fully_shard.h"
#include "framework/optim/sharded_adamw.h"
#include "framework/tp/tensor_parallel.h"
#include "framework/tokenizer/tokenizer.h"
#include "models/generate.h"
#include "models/layered_model.h"
#include "models/llama.h"

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <ctime>
#include <cstdlib>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <mutex>
#include <optional>
#include <cstring>
#include <sstream>

namespace framework::train {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using checkpoint::seconds_since;

namespace test_seam {

namespace {
std::function<void(int64_t step, int rank)> before_step_callback;  // tests only
}  // namespace

void set_before_step(std::function<void(int64_t step, int rank)> callback) {
  before_step_callback = std::move(callback);
}

void before_step(int64_t step, int rank) {
  if (before_step_callback) before_step_callback(step, rank);
}

}  // namespace test_seam

namespace {

// This rank's cross-entropy summed over its tokens, and how many of its
// targets count (not ignore_index); both still on the training device.
struct LocalLoss {
  torch::Tensor sum;
  torch::Tensor tokens;
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

}  // namespace

struct Trainer::State {
  config::Config cfg;
  dist::Runtime& rt;
  torch::Device device{torch::kCPU};  // where the model, optimizer and batches live
  std::vector<int64_t> mesh_shape;
  std::shared_ptr<dtensor::DeviceMesh> mesh;
  // Tensor parallelism (parallel.tensor > 1): the mesh's innermost axis.
  // The ranks of a TP group train on the same batch and hold the same loss:
  // only the first (tp_rank 0) counts it in the step's sums.
  int64_t tp_size = 1, tp_rank = 0;
  int64_t dp_size = 1, dp_rank = 0;  // data-parallel: replicate x shard
  tp::TensorParallelLayout tp_layout;
  UserModel user;          // the model, units, loss and data (built-in: from the config)
  bool builtin_model = true;  // model and data from the config's sections
  std::unique_ptr<fsdp::FullyShardedModel> fsdp;
  std::unique_ptr<optim::ShardedAdamW> optim;
  std::unique_ptr<StepProfiler> profiler;  // profile.every
  std::shared_ptr<data::Dataset> dataset;
  std::unique_ptr<tokenizer::Tokenizer> tokenizer;  // data.tokenizer, loaded at the first sample
  std::unique_ptr<data::DataLoader> loader;
  int64_t step = 0;
  std::vector<StepRecord> history;
  std::ofstream metrics;
  bool is_logger = false;
  std::unique_ptr<checkpoint::CheckpointManager> ckpt;
  TrainerHooks hooks;
  Clock::time_point started = Clock::now();  // this process's run: wall_s in metrics.jsonl
  std::string layout;                        // "fsdp replicate=1 shard=2"
  int64_t saves_failed = 0;                  // this run, kept going by on_error: warn
  std::optional<checkpoint::CheckpointEvent> last_save;
  std::optional<RunSpan> span;  // of the run() (or run_step() calls) in progress
  ResumeSource resume_source = ResumeSource::kConfig;
  std::string resume_tier;  // tiers: local | durable, and why
  std::string resume_reason;
  std::vector<std::string> resume_notes;

  void build_mesh();
  void check_batch_split();
  void build_builtin_model();
  void apply_tensor_parallel();
  void shard_model();
  void load_initial_weights();
  void make_loader_and_layout();
  // What the constructor resumed from (from: nothing, a fresh start).
  struct Resumed {
    std::optional<std::string> from;
    checkpoint::LoadStats stats;
    std::vector<checkpoint::SkippedCheckpoint> skipped;
  };
  Resumed resume_or_initialise();
  void open_metrics();
  void log_skipped_checkpoints(const std::vector<checkpoint::SkippedCheckpoint>& skipped);
  void print_banner(const std::optional<std::string>& resume_from,
                    const checkpoint::LoadStats& resumed);
  checkpoint::StateDict make_state_dict();
  void apply_loaded(checkpoint::StateDict& sd, bool model_only);
  checkpoint::DcpLoadStats load_dcp(const std::string& dir);
  void save_checkpoint(int64_t step, bool final = false);
  void log_checkpoint_events();

  int64_t last_step() const;
  int64_t param_count() const;  // elements of all parameters, unsharded
  LocalLoss forward_next_batch();
  StepStats accumulate_gradients(int64_t to_step);
  int64_t micro_batches = 1;  // per step and rank (train.micro_batch_size)
  double finish_gradients();
  double apply_optimizer_step(int64_t to_step);
  void log_step(const StepRecord& rec, const RunSpan& span);
  void log_eval(const EvalRecord& rec);
  void write_start_record(const std::optional<std::string>& resume_from,
                          const checkpoint::LoadStats& resumed);
  void write_end_record(bool stopped_by_signal);
  std::vector<double> peak_rss_mib_of_ranks();
  std::vector<double> peak_gpu_mib_of_ranks();
  std::vector<double> gather_per_rank(double mine);
  void checkpoint_if_due(StepRecord& rec, int64_t last);
  void finish_checkpoints();

  State(const config::Config& c, dist::Runtime& r) : cfg(c), rt(r) {}
  dist::HostMallocOutcome host_malloc = dist::HostMallocOutcome::kDefault;
  ~State() {
    // The hooks tensor parallelism set on the module hold the mesh's groups.
    if (tp_size > 1 && user.module) tp::clear_hooks(*user.module);
  }
};

namespace {

std::string format_duration(double seconds) {
  auto s = static_cast<int64_t>(seconds + 0.5);
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%02lld:%02lld:%02lld", static_cast<long long>(s / 3600),
                static_cast<long long>(s / 60 % 60), static_cast<long long>(s % 60));
  return buf;
}

// "2026-11-23T01:02:03.456Z"
std::string utc_timestamp() {
  const auto now = std::chrono::system_clock::now();
  const std::time_t t = std::chrono::system_clock::to_time_t(now);
  const auto ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch()).count() % 1000;
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[40];
  std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%S", &tm);
  char out[48];
  std::snprintf(out, sizeof(out), "%s.%03dZ", buf, static_cast<int>(ms));
  return out;
}

// For the banner, where rank 0 serves the job's store and where its port
// came from: two jobs on one node collide when they pick the same one.
// Empty when a launcher serves the store or the job has one rank.
std::string rank0_store(const dist::LaunchEnv& env) {
  if (env.store_hosted || env.world_size < 2) return "";
  return ", store " + env.master_addr + ":" + std::to_string(env.master_port) +
         (env.master_port_source.empty() ? ", default port" : ", port from " + env.master_port_source);
}

// This process's peak resident set (VmHWM), MiB; 0 where unknown.
double peak_rss_mib() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmHWM:", 0) == 0) return std::strtod(line.c_str() + 6, nullptr) / 1024.0;
  }
  return 0;
}


// On `device`: the loss and token count are not read back before the reduce.
// `counts` 0: this rank's loss and tokens duplicate another's (a tensor-
// parallel rank other than the first of its group).
torch::Tensor pack_step_stats(const LocalLoss& local, bool stop_requested, bool ckpt_busy,
                              torch::Device device, bool counts = true) {
  torch::Tensor flags = torch::tensor(
      {static_cast<double>(stop_requested), static_cast<double>(ckpt_busy)}, torch::kDouble);
  const double weight = counts ? 1.0 : 0.0;
  return torch::cat({local.sum.detach().to(torch::kDouble).reshape({1}) * weight,
                     local.tokens.to(torch::kDouble).reshape({1}) * weight, flags.to(device)});
}

StepStats unpack_step_stats(const torch::Tensor& reduced) {
  torch::Tensor host = reduced.to(torch::kCPU);
  TORCH_INTERNAL_ASSERT(host.numel() == kStepStatsSlots, "step stats: ", host.numel(), " values");
  auto v = host.accessor<double, 1>();
  return {v[0], v[1], v[2], v[3]};
}

}  // namespace

// Everything a resumed run needs, as named items. Tensors are this rank's
// shards (no copies); the optimizer moments have their parameter's layout.
// The LR schedule is a pure function of train.step, so it needs no item.
checkpoint::StateDict Trainer::State::make_state_dict() {
  checkpoint::StateDict sd = get_state_dict(*fsdp, optim.get());
  sd.add_bytes("train.step", int64_bytes(step));
  sd.add_bytes("data.loader", data::encode_loader_state(loader->state()));
  {
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    torch::Tensor rng = gen.get_state();
    const uint8_t* p = rng.data_ptr<uint8_t>();
    sd.add_bytes("rng.cpu", std::vector<uint8_t>(p, p + rng.numel()));
  }
  std::string yaml = config::to_yaml(cfg);
  sd.add_bytes("config", std::vector<uint8_t>(yaml.begin(), yaml.end()));
  return sd;
}

void Trainer::State::apply_loaded(checkpoint::StateDict& sd, bool model_only) {
  // Model shards were loaded in place.
  if (model_only) return;
  set_optimizer_state(sd, *fsdp, *optim);
  step = bytes_int64(sd.find_bytes("train.step")->data, "train.step");
  const std::vector<uint8_t>& saved_position = sd.find_bytes("data.loader")->data;
  if (saved_position.empty()) {
    // An imported checkpoint (ckpt import-dcp): the data continue at its
    // step, and the RNG keeps this run's state.
    data::LoaderState position = loader->state();
    position.next_step = step;
    loader->load_state(position);
    return;
  }
  data::LoaderState loader_state = data::decode_loader_state(saved_position);
  if (cfg.checkpoint.allow_config_change) {
    // The user resumed across a run.seed or batch change: keep the position.
    const data::LoaderState now = loader->state();
    loader_state.seed = now.seed;
    loader_state.global_batch_size = now.global_batch_size;
  }
  loader->load_state(loader_state);
  const auto& rng = sd.find_bytes("rng.cpu")->data;
  torch::Tensor t = torch::empty({static_cast<int64_t>(rng.size())}, torch::kUInt8);
  std::memcpy(t.data_ptr(), rng.data(), rng.size());
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(t);
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

void Trainer::State::save_checkpoint(int64_t at_step, bool final) {
  try {
    ckpt->save(at_step, make_state_dict(), final);
  } catch (const checkpoint::CheckpointError& e) {
    // The previous (background) save failed, or this sync save did.
    if (cfg.checkpoint.on_error != checkpoint::OnError::kWarn) throw;
    if (is_logger) std::cerr << "shardkit: warning: " << e.what() << std::endl;
    if (ckpt->busy() || cfg.checkpoint.mode == checkpoint::SaveMode::kSync) return;
    ckpt->save(at_step, make_state_dict(), final);
  }
}

void Trainer::State::log_checkpoint_events() {
  for (const auto& ev : ckpt->take_events()) {
    saves_failed += ev.ok ? 0 : 1;
    last_save = ev;
    if (!is_logger) continue;
    std::ostringstream line;
    line << std::fixed << std::setprecision(3) << "checkpoint step " << ev.step << " (" << ev.mode
         << ") " << (ev.ok ? "committed " : "FAILED ") << ev.path << " | blocking " << ev.blocking_s
         << " s | stage " << ev.stage_s << " s | write " << ev.write_s << " s | commit "
         << ev.commit_s << " s | " << std::setprecision(1) << ev.bytes / 1048576.0 << " MiB -> "
         << ev.stored_bytes / 1048576.0 << " MiB";
    if (!ev.staging.empty()) line << " | staging " << ev.staging;
    if (ckpt->tiered()) {
      line << " | tier " << ev.tier << " | local commit " << std::setprecision(3) << ev.local_commit_s
           << " s | partner " << ev.partner;
      if (ev.flushed) line << " | durable +" << ev.exposure_s << " s";
    }
    std::cout << line.str() << std::endl;
    if (ckpt->tiered() && ev.partner.rfind("failed", 0) == 0) {
      std::cerr << "shardkit: warning: checkpoint step " << ev.step
                << " has no partner copies (L1 only): " << ev.partner << std::endl;
    }
    nlohmann::json j = {{"event", "checkpoint"}, {"step", ev.step},         {"mode", ev.mode},
                        {"blocking_s", ev.blocking_s}, {"stage_s", ev.stage_s},
                        {"write_s", ev.write_s},   {"commit_s", ev.commit_s}, {"bytes", ev.bytes},
                        {"stored_bytes", ev.stored_bytes}, {"ok", ev.ok},   {"path", ev.path},
                        {"plan_s", ev.plan_s}, {"plan_cached", ev.plan_cached}};
    if (!ev.staging.empty()) j["staging"] = ev.staging;
    if (ckpt->tiered()) {
      j["tier"] = ev.tier;
      j["local_path"] = ev.local_path;
      j["local_commit_s"] = ev.local_commit_s;
      j["partner"] = ev.partner;
      j["flushed"] = ev.flushed;
      j["flush_s"] = ev.flush_s;
      j["exposure_s"] = ev.exposure_s;
    }
    if (!ev.ok) j["error"] = ev.error;
    metrics << j.dump() << "\n";
    metrics.flush();
  }
  // Not a failed save: that checkpoint committed, only older ones were not
  // all deleted. Retention runs on rank 0 (durable) and node leaders (local).
  for (const auto& f : ckpt->take_retention_failures()) {
    std::cerr << "shardkit: warning: checkpoint step " << f.step << " committed, but retention ("
              << f.tier << " tier, keep_last) failed on rank " << rt.env.rank << ": " << f.error << std::endl;
    if (!is_logger) continue;
    metrics << nlohmann::json({{"event", "retention"}, {"step", f.step}, {"tier", f.tier}, {"ok", false},
                               {"error", f.error}})
                   .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace)
            << "\n";
    metrics.flush();
  }
}

// The config's model and data sections as a UserModel: every rank builds
// the same full model from the same seed, each block one FSDP unit, with
// the token cross-entropy as its loss.
void Trainer::State::build_builtin_model() {
  check_tensor_parallel_model(cfg);
  std::shared_ptr<models::LayeredModelImpl> model;
  {
    // LibTorch's init functions draw from the process-wide generator; ranks
    // that share a process (tests) must not interleave here.
    static std::mutex init_mutex;
    std::lock_guard<std::mutex> lock(init_mutex);
    torch::manual_seed(static_cast<uint64_t>(cfg.run.seed));
    // A llama is built unmaterialised: shard_model fills in one parameter
    // at a time, so no rank ever holds the whole model.
    model = models::make_model(cfg.model, /*materialize=*/cfg.model.kind != "llama");
  }
  user.module = model;
  user.units = model->unit_names();
  const bool fused = cfg.train.fused_kernels && cfg.model.kind == "llama";
  if (fused) models::use_fused_kernels(*model, true);
  if (cfg.model.kind == "llama") {
    user.init = [model](const std::string& name, const torch::Tensor& full) {
      model->init_parameter(name, full);
    };
  }
  if (cfg.parallel.tensor > 1) {
    // The output projection is colwise: each rank holds its slice of the
    // vocabulary's logits, and the cross-entropy is vocabulary-parallel.
    dist::Group* group = &mesh->group(2);
    const int64_t offset =
        dtensor::chunk_span(cfg.model.vocab_size, cfg.parallel.tensor, mesh->coordinate(2)).offset;
    user.tensor_parallel_plan = tp::llama_plan();
    user.loss = [model, group, offset](const torch::Tensor& inputs, const torch::Tensor& targets) {
      torch::Tensor logits = model->forward(inputs).to(torch::kFloat);
      torch::Tensor per_token = tp::vocab_parallel_cross_entropy(
          logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}), offset, *group,
          data::kIgnoreIndex);
      return LossSum{per_token.sum(), (targets != data::kIgnoreIndex).sum()};
    };
  } else {
    user.loss = [model, fused](const torch::Tensor& inputs, const torch::Tensor& targets) {
      if (fused) {
        // fp32 one chunk of rows at a time (train.fused_kernels).
        torch::Tensor logits = model->forward(inputs);
        torch::Tensor sum = models::fused_cross_entropy_sum(
            logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}), data::kIgnoreIndex);
        return LossSum{sum, (targets != data::kIgnoreIndex).sum()};
      }
      // The loss and its softmax in fp32, whatever the compute dtype.
      torch::Tensor logits = model->forward(inputs).to(torch::kFloat);
      const int64_t vocab = logits.size(-1);
      torch::Tensor sum = torch::nn::functional::cross_entropy(
          logits.reshape({-1, vocab}), targets.reshape({-1}),
          torch::nn::functional::CrossEntropyFuncOptions()
              .ignore_index(data::kIgnoreIndex)
              .reduction(torch::kSum));
      return LossSum{sum, (targets != data::kIgnoreIndex).sum()};
    };
  }
  user.dataset = data::make_dataset(cfg.data, cfg.model, static_cast<uint64_t>(cfg.run.seed));
  user.description = cfg.model.kind;
}

// parallel.tensor > 1: the model's plan splits its weights over the mesh's
// tensor axis before FSDP shards each part over the data-parallel axes.
void Trainer::State::apply_tensor_parallel() {
  if (tp_size == 1) return;
  if (user.tensor_parallel_plan.empty()) {
    throw std::invalid_argument("parallel.tensor " + std::to_string(tp_size) +
                                ": this model has no tensor-parallel plan (UserModel::tensor_parallel_plan)");
  }
  tp_layout = tp::parallelize_module(*user.module, mesh, 2, user.tensor_parallel_plan);
  if (user.init) user.init = tp::sharded_init(tp_layout, user.init);
}

// Each rank keeps its shards of the same full model: results do not depend
// on the world size. REQUIRES: mesh, user.module.
void Trainer::State::shard_model() {
  // The model is initialised on the CPU either way, so a CUDA run starts
  // from the same weights as a CPU run, then moves to the GPU.
  device = rt.device;
  if (device.is_cuda()) {
    // Bit-exact resume needs reproducible kernels (train.deterministic).
    dist::use_deterministic_cuda(cfg.train.deterministic);
    fsdp::move_to_device(*user.module, device);
  }
  fsdp::ParallelOptions parallel = cfg.parallel;
  parallel.mixed_precision = cfg.train.mixed_precision;
  parallel.tensor_parallel = tp_layout.params;
  fsdp = std::make_unique<fsdp::FullyShardedModel>(user.module, mesh, parallel, user.units,
                                                   user.init);
  optim = std::make_unique<optim::ShardedAdamW>(*fsdp, cfg.optim, cfg.train.steps,
                                                optim::resolve_adamw_impl(cfg.train.optimizer_impl, device));
}

// model.init_from into this rank's shards (each rank reads only their bytes).
void Trainer::State::load_initial_weights() {
  checkpoint::StateDict sd = get_state_dict(*fsdp, nullptr);
  torch::NoGradGuard no_grad;
  checkpoint::load_weights_into(sd, cfg.model.init_from, "model.", false);
}

// Rank 0: run.dir with the effective config, and metrics.jsonl to append to.
void Trainer::State::open_metrics() {
  fs::create_directories(cfg.run.dir);
  config::write_effective_config(cfg, cfg.run.dir);
  fs::path metrics_path = fs::path(cfg.run.dir) / "metrics.jsonl";
  metrics.open(metrics_path, std::ios::app);
  if (!metrics) {
    throw std::runtime_error("cannot open " + metrics_path.string() + " for appending");
  }
}

// Rank 0: what runs where, and where the weights came from.
// Loudly, on stderr and in metrics.jsonl: each damaged checkpoint resume
// set aside, and why.
void Trainer::State::log_skipped_checkpoints(
    const std::vector<checkpoint::SkippedCheckpoint>& skipped) {
  for (const checkpoint::SkippedCheckpoint& c : skipped) {
    std::cerr << "shardkit: WARNING: checkpoint " << c.path << " failed to load and was skipped"
              << (c.moved_to.empty() ? "" : " (moved to " + c.moved_to + ")") << ": " << c.error
              << std::endl;
    nlohmann::json j = {{"event", "resume_skipped"}, {"path", c.path}, {"moved_to", c.moved_to},
                        {"error", c.error}};
    metrics << j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
  }
  metrics.flush();
}

void Trainer::State::print_banner(const std::optional<std::string>& resume_from,
                                  const checkpoint::LoadStats& resumed) {
  const auto& st = fsdp->memory_stats();
  std::cout << "shardkit: world " << rt.env.world_size << " ("
            << (dist::started_by_local_launcher() ? std::string("train --nproc")
                                                : dist::to_string(rt.env.source))
            << (rt.env.agent_store ? ", the agent's store" : "")
            << rank0_store(rt.env)
            << (rt.env.restart_count > 0 ? ", restart " + std::to_string(rt.env.restart_count) : std::string())
            << "), layout " << layout << ", groups train=" << rt.train->backend_name()
            << " ckpt=" << rt.checkpoint->backend_name() << ", device " << device.str()
            << ", LibTorch " << dist::torch_version() << "\n"
            << "shardkit: model " << user.description << " " << param_count() << " params, "
            << fsdp->unit_names().size() << " units, " << std::fixed << std::setprecision(2)
            << st.sharded_param_bytes / 1048576.0 << std::defaultfloat << " MiB on this rank; data " << dataset->describe() << std::endl;
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
  if (builtin_model && cfg.model.kind == "llama") {
    std::cout << "; fused kernels "
              << (cfg.train.fused_kernels ? models::llama_fused_ops_description() : std::string("off"));
  }
  std::cout << std::endl;
  if (profiler->enabled()) {
    std::cout << "shardkit: profiler traces of the last " << cfg.profile.active << " of every "
              << cfg.profile.every << " steps (" << StepProfiler::backend() << ") in " << profiler->dir()
              << std::endl;
  }
  if (host_malloc == dist::HostMallocOutcome::kEnvironment) {
    std::cout << "shardkit: run.host_malloc " << to_string(cfg.run.host_malloc)
              << " left to MALLOC_* variables in the environment" << std::endl;
  } else if (host_malloc == dist::HostMallocOutcome::kUnsupported) {
    std::cout << "shardkit: run.host_malloc " << to_string(cfg.run.host_malloc)
              << " not applied: this C library's malloc has no such thresholds" << std::endl;
  }
  if (builtin_model) {
    std::cout << "shardkit: memory estimate per rank "
              << describe(estimate_memory(cfg, rt.env.world_size)) << std::endl;
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
    if (!resume_tier.empty()) {
      std::cout << "shardkit: resume tier: " << resume_tier << " (" << resume_reason << ")" << std::endl;
      for (const std::string& note : resume_notes) std::cout << "shardkit: resume: " << note << std::endl;
    }
  }
}

std::atomic<int>& Trainer::stop_signal() {
  static std::atomic<int> signal{0};
  return signal;
}

// The device mesh ({replicate, shard}, or {replicate, shard, tensor} with
// parallel.tensor > 1) and this rank's place in it.
void Trainer::State::build_mesh() {
  const int world = rt.env.world_size;
  const int rank = rt.env.rank;
  mesh_shape = fsdp::mesh_shape_for(cfg.parallel, world);
  // With prefetch, all-gathers and gradient reductions overlap: each on its
  // own channel (process groups of their own) of the data-parallel axes.
  const int channels = cfg.parallel.prefetch > 0 ? 2 : 1;
  if (mesh_shape.size() == 3) {
    mesh = dtensor::DeviceMesh::create(*rt.rendezvous, mesh_shape, {"replicate", "shard", "tensor"},
                                       "mesh", channels);
    tp_size = mesh_shape[2];
    tp_rank = mesh->coordinate(2);
  } else {
    mesh = dtensor::DeviceMesh::create(*rt.rendezvous, mesh_shape, {"replicate", "shard"}, "mesh",
                                       channels);
  }
  // The tensor axis is innermost: rank = data-parallel rank x tensor + tp_rank.
  dp_size = world / tp_size;
  dp_rank = rank / tp_size;
}

// The global batch over the data-parallel ranks, in micro-batches.
void Trainer::State::check_batch_split() {
  check_batch(cfg, static_cast<int>(dp_size));
  const int64_t micro = cfg.train.micro_batch_size;
  if (micro > 0) micro_batches = cfg.train.global_batch_size / dp_size / micro;
}

// This data-parallel rank's loader over the dataset, and the layout's name.
void Trainer::State::make_loader_and_layout() {
  dataset = user.dataset;
  loader = std::make_unique<data::DataLoader>(dataset, cfg.train.global_batch_size,
                                              static_cast<uint64_t>(cfg.run.seed),
                                              static_cast<int>(dp_rank), static_cast<int>(dp_size));
  std::ostringstream text;
  text << fsdp::layout_name(mesh_shape) << " replicate=" << mesh_shape[0]
       << " shard=" << mesh_shape[1];
  if (tp_size > 1) text << " tensor=" << tp_size;
  layout = text.str();
}

// Resumes from a PyTorch DCP directory or this run's newest checkpoint;
// else, with model.init_from, loads the initial weights.
Trainer::State::Resumed Trainer::State::resume_or_initialise() {
  Resumed out;
  if (resume_source == ResumeSource::kDcp) {
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
    for (const char* optional : {"data.loader", "rng.cpu"}) sd.find_bytes(optional)->data.clear();
    if (std::optional<checkpoint::ResumeResult> r = ckpt->resume(sd)) {
      apply_loaded(sd, cfg.checkpoint.model_only);
      out.from = r->path;
      out.stats = r->stats;
      out.skipped = std::move(r->skipped);
      if (ckpt->tiered()) {
        resume_tier = r->tier;
        resume_reason = r->reason;
        resume_notes = r->notes;
      }
    }
  }
  if (!out.from && !cfg.model.init_from.empty()) {
    // Full, unsharded weights from elsewhere: each rank reads only the byte
    // ranges of its own shards. Ignored when resuming (the checkpoint wins).
    load_initial_weights();
  }
  return out;
}

Trainer::Trainer(const config::Config& config, dist::Runtime& runtime, TrainerHooks hooks)
    : Trainer(config, runtime, UserModel{}, std::move(hooks)) {}

Trainer::Trainer(const config::Config& config, dist::Runtime& runtime, UserModel model,
                 TrainerHooks hooks)
    : s_(std::make_unique<State>(config, runtime)) {
  State& s = *s_;
  // Before the model and its buffers are allocated: every later free of a
  // step's host buffers stays in the process (run.host_malloc).
  s.host_malloc = dist::apply_host_malloc(s.cfg.run.host_malloc);
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
  s.apply_tensor_parallel();
  s.shard_model();
  s.profiler = std::make_unique<StepProfiler>(s.cfg.profile, s.cfg.run.dir, runtime.env.rank,
                                              s.device.is_cuda());
  s.make_loader_and_layout();
  s.resume_source = resume_source(s.cfg);
  if (s.resume_source == ResumeSource::kAutoAfterDcp) {
    // The DCP directory was the run's initial load; it has its own now.
    s.cfg.checkpoint.resume = "auto";
  }
  // What a checkpoint imported from PyTorch DCP (ckpt import-dcp) lacks:
  // apply_loaded derives the data position from train.step and keeps the RNG.
  checkpoint::ManagerHooks manager_hooks;
  manager_hooks.optional_items = [](const std::string& name) {
    return name == "data.loader" || name == "rng.cpu" || name == "config";
  };
  checkpoint::CheckpointOptions ckpt_options = s.cfg.checkpoint;
  ckpt_options.local.dir = config::local_tier_pattern(s.cfg);
  checkpoint::PosixOptions posix;
  posix.direct_io = s.cfg.checkpoint.direct_io;
  s.ckpt = std::make_unique<checkpoint::CheckpointManager>(
      ckpt_options, (fs::path(s.cfg.run.dir) / "checkpoints").string(), *runtime.checkpoint,
      s.layout, s.hooks.storage ? s.hooks.storage : checkpoint::posix_storage(posix),
      manager_hooks);
  // The local tier is never behind the test hooks' storage (that one stands
  // for the durable file system), unless they provide one for it.
  s.ckpt->set_placement({runtime.env.node, s.hooks.local_storage ? s.hooks.local_storage
                                                                 : checkpoint::posix_storage(posix)});
  if (s.ckpt->enabled() && (s.cfg.checkpoint.mode != checkpoint::SaveMode::kSync || s.device.is_cuda())) {
    // Host (pinned, for GPU state) staging buffers now, not at the first
    // save while the training loop waits.
    s.ckpt->reserve_staging(s.make_state_dict());
  }
  const State::Resumed resumed = s.resume_or_initialise();

  if (s.is_logger) {
    s.open_metrics();
    s.write_start_record(resumed.from, resumed.stats);
    s.log_skipped_checkpoints(resumed.skipped);
    s.print_banner(resumed.from, resumed.stats);
  }
}

Trainer::~Trainer() = default;

int64_t Trainer::step() const { return s_->step; }
fsdp::FullyShardedModel& Trainer::model() { return *s_->fsdp; }
optim::ShardedAdamW& Trainer::optimizer() { return *s_->optim; }
const std::vector<StepRecord>& Trainer::history() const { return s_->history; }

int64_t Trainer::State::param_count() const {
  int64_t params = 0;
  for (size_t i = 0; i < fsdp->param_names().size(); ++i) {
    const dtensor::DTensor p = fsdp->param_dtensor(i);
    int64_t n = 1;
    for (int64_t d : p.global_shape()) n *= d;
    params += n;
  }
  return params;
}

int64_t Trainer::State::last_step() const {
  const auto& tc = cfg.train;
  return tc.stop_at > 0 ? std::min(tc.stop_at, tc.steps) : tc.steps;
}

LocalLoss Trainer::State::forward_next_batch() {
  auto [host_inputs, host_targets] = [&] {
    RECORD_USER_SCOPE("shardkit::data");
    return loader->next();
  }();
  torch::Tensor inputs = host_inputs.to(device);
  torch::Tensor targets = host_targets.to(device);
  const LossSum loss = fsdp->forward([&] { return user.loss(inputs, targets); });
  return {loss.sum, loss.count};
}

// After backward: FSDP's last reduce-scatters, then clipping by the global
// norm. Returns the norm before clipping (0 with train.grad_clip off).
double Trainer::State::finish_gradients() {
  fsdp->finish_backward();
  return cfg.train.grad_clip > 0 ? fsdp->clip_grad_norm(cfg.train.grad_clip) : 0.0;
}

// Returns the learning rate of `to_step`.
double Trainer::State::apply_optimizer_step(int64_t to_step) {
  // Overlap mode: the previous save may still be copying parameters and
  // optimizer state; they change only here.
  ckpt->wait_staged();
  double lr = optim->step(to_step);
  fsdp->zero_grad();
  step = to_step;
  return lr;
}

// Gradient accumulation (train.micro_batch_size): the step's global token
// count first, in the step's all-reduce with the stop and busy flags (each
// micro-batch's loss is normalised by it, so the gradient does not depend
// on the micro-batch size); then each micro-batch's forward and backward
// (FSDP reduce-scatters each; DDP all-reduces only the last); then the
// loss sum for the log, in a second small all-reduce.
StepStats Trainer::State::accumulate_gradients(int64_t to_step) {
  auto [host_inputs, host_targets] = loader->next();
  const int64_t rows = host_inputs.size(0);
  const int64_t micro = cfg.train.micro_batch_size;
  LocalLoss counted{torch::zeros({}, torch::TensorOptions(torch::kDouble).device(device)),
                    (host_targets != data::kIgnoreIndex).sum().to(device)};
  torch::Tensor stats =
      pack_step_stats(counted, stop_signal().load() != 0, ckpt->busy(), device, tp_rank == 0);
  test_seam::before_step(to_step, rt.env.rank);
  rt.train->all_reduce(stats);
  StepStats global = unpack_step_stats(stats);
  const double global_tokens = std::max(1.0, global.tokens);
  torch::Tensor loss_sum = torch::zeros({1}, torch::TensorOptions(torch::kDouble).device(device));
  for (int64_t first = 0; first < rows; first += micro) {
    fsdp->set_requires_gradient_sync(first + micro >= rows);
    torch::Tensor inputs = host_inputs.narrow(0, first, micro).to(device);
    torch::Tensor targets = host_targets.narrow(0, first, micro).to(device);
    const LossSum loss = fsdp->forward([&] { return user.loss(inputs, targets); });
    (loss.sum / global_tokens).backward();
    fsdp->finish_backward();
    loss_sum += loss.sum.detach().to(torch::kDouble);
  }
  if (tp_rank != 0) loss_sum.zero_();  // the first rank of the TP group counts it
  rt.train->all_reduce(loss_sum);
  global.loss_sum = loss_sum.to(torch::kCPU).item<double>();
  return global;
}

StepRecord Trainer::train_step() {
  State& s = *s_;
  TORCH_CHECK(s.step < s.cfg.train.steps, "train_step: already at train.steps (",
              s.cfg.train.steps, ")");
  const int64_t step = s.step + 1;
  auto t0 = Clock::now();
  const double waited_before = s.fsdp->comm_wait_seconds();
  StepStats global;
  if (s.micro_batches > 1) {
    global = s.accumulate_gradients(step);
  } else {
    // The step's phases are named for a profiler (llama_ref --profile-trace):
    // forward, the step's stats (all-reduce and host read), backward, the
    // gradients' last reductions and clipping, the optimizer.
    LocalLoss local;
    {
      RECORD_USER_SCOPE("shardkit::forward");
      local = s.forward_next_batch();
    }
    // One small all-reduce per step, on the training device: global loss
    // sum, global token count, and whether any rank was asked to stop or is
    // still saving. Its result is the one host read of the step.
    {
      RECORD_USER_SCOPE("shardkit::step_stats");
      torch::Tensor stats =
          pack_step_stats(local, stop_signal().load() != 0, s.ckpt->busy(), s.device, s.tp_rank == 0);
      test_seam::before_step(step, s.rt.env.rank);
      s.rt.train->all_reduce(stats);
      global = unpack_step_stats(stats);
    }
    // Normalising by the global token count and summing gradients across
    // ranks gives the gradient of the global mean at any world size.
    RECORD_USER_SCOPE("shardkit::backward");
    (local.sum / std::max(1.0, global.tokens)).backward();
  }
  const double global_tokens = std::max(1.0, global.tokens);
  StepRecord rec;
  {
    RECORD_USER_SCOPE("shardkit::finish_gradients");
    rec.grad_norm = s.finish_gradients();
  }
  {
    RECORD_USER_SCOPE("shardkit::optimizer");
    rec.lr = s.apply_optimizer_step(step);
  }
  rec.step = step;
  rec.loss = global.loss_sum / global_tokens;
  rec.stop_requested = global.stop_requested > 0;
  rec.checkpoint_busy = global.ckpt_busy > 0;
  rec.step_time_s = seconds_since(t0);
  rec.comm_wait_s = s.fsdp->comm_wait_seconds() - waited_before;
  const int64_t tokens_per_step = s.cfg.train.global_batch_size * s.dataset->seq_len();
  rec.tokens_per_s = static_cast<double>(tokens_per_step) / std::max(rec.step_time_s, 1e-9);
  s.history.push_back(rec);
  return rec;
}

// Every train.log_every steps and at the run's first and last step: the
// ranks' peak RSS (one small all-reduce, every rank), then on rank 0 the
// console line and the metrics.jsonl record.
void Trainer::State::log_step(const StepRecord& rec, const RunSpan& span) {
  const int64_t at = rec.step;
  bool log_now = at % cfg.train.log_every == 0 || at == span.last_step || at == span.first_step;
  if (!log_now) return;
  const std::vector<double> rss = peak_rss_mib_of_ranks();
  const std::vector<double> gpu =
      device.is_cuda() ? peak_gpu_mib_of_ranks() : std::vector<double>{};
  if (!is_logger) return;
  double per_step = seconds_since(span.start) / static_cast<double>(at - span.first_step + 1);
  std::ostringstream line;
  line << "step " << at << "/" << cfg.train.steps << " | loss " << std::fixed
       << std::setprecision(4) << rec.loss << " | lr " << std::scientific << std::setprecision(2)
       << rec.lr << std::fixed << " | grad_norm " << std::setprecision(3) << rec.grad_norm << " | "
       << std::setprecision(0) << rec.tokens_per_s << " tok/s | " << std::setprecision(3)
       << rec.step_time_s << " s/step | rss " << std::setprecision(0)
       << *std::max_element(rss.begin(), rss.end()) << " MiB | elapsed "
       << format_duration(seconds_since(started)) << " | ETA "
       << format_duration(per_step * static_cast<double>(span.last_step - at));
  std::cout << line.str() << std::endl;
  nlohmann::json j = {{"step", at},
                      {"loss", rec.loss},
                      {"lr", rec.lr},
                      {"tokens_per_s", rec.tokens_per_s},
                      {"step_time_s", rec.step_time_s},
                      {"comm_wait_s", rec.comm_wait_s},
                      {"grad_norm", rec.grad_norm},
                      {"time", utc_timestamp()},
                      {"wall_s", seconds_since(started)},
                      {"peak_rss_mib", rss}};
  if (device.is_cuda()) j["peak_gpu_mib"] = gpu;
  metrics << j.dump() << "\n";
  metrics.flush();
}

std::vector<double> Trainer::State::peak_rss_mib_of_ranks() {
  return gather_per_rank(peak_rss_mib());
}

std::vector<double> Trainer::State::peak_gpu_mib_of_ranks() {
  return gather_per_rank(dist::peak_device_memory_bytes(device) / 1048576.0);
}

// One value per rank, indexed by rank (a small all-reduce, every rank).
std::vector<double> Trainer::State::gather_per_rank(double mine) {
  const int world = rt.env.world_size;
  torch::Tensor rss = torch::zeros({world}, torch::kDouble);
  rss[rt.env.rank] = mine;
  rss = rss.to(device);
  rt.train->all_reduce(rss);
  rss = rss.to(torch::kCPU);
  return std::vector<double>(rss.data_ptr<double>(), rss.data_ptr<double>() + world);
}

void Trainer::State::log_eval(const EvalRecord& rec) {
  if (!is_logger) return;
  std::ostringstream line;
  line << "eval step " << rec.step << " | val_loss " << std::fixed << std::setprecision(4)
       << rec.loss << " | " << rec.samples << " held-out samples | " << std::setprecision(3)
       << rec.seconds << " s";
  std::cout << line.str() << std::endl;
  nlohmann::json j = {{"event", "eval"},         {"step", rec.step},
                      {"val_loss", rec.loss},    {"val_tokens", rec.tokens},
                      {"samples", rec.samples},  {"eval_s", rec.seconds},
                      {"time", utc_timestamp()}, {"wall_s", seconds_since(started)}};
  metrics << j.dump() << "\n";
  metrics.flush();
}

// Rank 0: where this run segment starts, so that a reader of metrics.jsonl
// tells a fresh run from a resume and knows the world and layout of each.
void Trainer::State::write_start_record(const std::optional<std::string>& resume_from,
                                        const checkpoint::LoadStats& resumed) {
  nlohmann::json j = {{"event", "start"},
                      {"time", utc_timestamp()},
                      {"step", step},
                      {"resumed_from", resume_from ? nlohmann::json(*resume_from) : nlohmann::json()},
                      {"world", rt.env.world_size},
                      {"layout", layout},
                      {"device", device.str()},
                      {"params", param_count()},
                      {"memory_estimate_mib",
                       builtin_model ? nlohmann::json(estimate_memory(cfg, rt.env.world_size).total() / 1048576.0)
                                     : nlohmann::json()},
                      {"libtorch", dist::torch_version()}};
  if (resume_from) {
    j["resumed_step"] = resumed.step;
    j["saved_world"] = resumed.saved_world_size;
    j["saved_layout"] = resumed.saved_layout;
    if (!resume_tier.empty()) {
      j["resumed_tier"] = resume_tier;
      j["resume_reason"] = resume_reason;
    }
  }
  metrics << j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
  metrics.flush();
}

void Trainer::State::write_end_record(bool stopped_by_signal) {
  nlohmann::json j = {{"event", "end"},
                      {"time", utc_timestamp()},
                      {"step", step},
                      {"status", stopped_by_signal ? "stopped" : "finished"},
                      {"wall_s", seconds_since(started)}};
  metrics << j.dump() << "\n";
  metrics.flush();
}

std::string Trainer::sample() {
  State& s = *s_;
  auto* model = dynamic_cast<models::LayeredModelImpl*>(s.user.module.get());
  if (model == nullptr) throw std::runtime_error("train.sample_every: only the built-in models can sample");
  const std::string& spec = s.cfg.data.tokenizer;
  const bool bytes = spec.empty() || spec == "bytes";
  if (!bytes && !s.tokenizer) s.tokenizer = tokenizer::load_tokenizer(spec);
  std::vector<int64_t> prompt;
  if (bytes) {
    for (unsigned char c : s.cfg.train.sample_prompt) prompt.push_back(c);
  } else {
    prompt = s.tokenizer->encode(s.cfg.train.sample_prompt);
  }
  torch::NoGradGuard no_grad;
  // Every rank in step: the same gathered weights give the same tokens.
  const auto forward = [&](const torch::Tensor& tokens) {
    torch::Tensor logits = s.fsdp->forward([&] { return model->forward(tokens.to(s.device)); });
    // Tensor parallelism: each rank holds its slice of the vocabulary.
    if (s.tp_size > 1) logits = tp::gather_last_dim(logits, s.mesh->group(2), s.cfg.model.vocab_size);
    return logits;
  };
  const std::vector<int64_t> ids =
      models::generate(*model, s.cfg.model.seq_len, prompt, s.cfg.train.sample_tokens, {}, {}, false, forward);
  if (bytes) return std::string(ids.begin(), ids.end());
  // The continuation: the whole decoded minus the decoded prompt (pieces may join).
  std::vector<int64_t> all = prompt;
  all.insert(all.end(), ids.begin(), ids.end());
  const std::string whole = s.tokenizer->decode(all), head = s.tokenizer->decode(prompt);
  return whole.compare(0, head.size(), head) == 0 ? whole.substr(head.size()) : " " + s.tokenizer->decode(ids);
}

EvalRecord Trainer::evaluate() {
  State& s = *s_;
  auto t0 = Clock::now();
  const int64_t n = std::min(s.dataset->eval_size(), s.cfg.train.eval_samples);
  if (n <= 0) {
    throw std::runtime_error("train.eval_every: no held-out samples; set data.eval_fraction > 0 (or data.eval_path)");
  }
  const int64_t world = s.dp_size;  // TP ranks evaluate the same samples
  const int64_t rank = s.dp_rank;
  const int64_t batch = s.cfg.train.global_batch_size;
  const int64_t local = batch / world;
  const auto pad = s.dataset->eval_sample(0);  // shapes and dtypes of a sample
  torch::NoGradGuard no_grad;
  torch::Tensor loss_sum = torch::zeros({}, torch::TensorOptions(torch::kDouble).device(s.device));
  torch::Tensor tokens = torch::zeros({}, torch::TensorOptions(torch::kDouble).device(s.device));
  for (int64_t first = 0; first < n; first += batch) {
    std::vector<torch::Tensor> inputs;
    std::vector<torch::Tensor> targets;
    for (int64_t r = 0; r < local; ++r) {
      const int64_t j = first + rank * local + r;
      if (j < n) {
        auto [in, tgt] = s.dataset->eval_sample(j);
        inputs.push_back(in);
        targets.push_back(tgt);
      } else {  // padding: every rank runs the same number of forwards
        inputs.push_back(torch::zeros_like(pad.first));
        targets.push_back(torch::full_like(pad.second, data::kIgnoreIndex));
      }
    }
    torch::Tensor in = torch::stack(inputs).to(s.device);
    torch::Tensor tgt = torch::stack(targets).to(s.device);
    // In micro-batches, as training runs, so evaluation needs no more memory.
    const int64_t micro = local / s.micro_batches;
    for (int64_t m = 0; m < local; m += micro) {
      torch::Tensor in_m = in.narrow(0, m, micro);
      torch::Tensor tgt_m = tgt.narrow(0, m, micro);
      const LossSum loss = s.fsdp->forward([&] { return s.user.loss(in_m, tgt_m); });
      loss_sum += loss.sum.to(torch::kDouble);
      tokens += loss.count.to(torch::kDouble);
    }
  }
  torch::Tensor both = torch::stack({loss_sum, tokens});
  if (s.tp_rank != 0) both.zero_();  // the first rank of the TP group counts it
  s.rt.train->all_reduce(both);
  both = both.to(torch::kCPU);
  EvalRecord rec;
  rec.step = s.step;
  rec.tokens = both[1].item<double>();
  rec.loss = both[0].item<double>() / std::max(1.0, rec.tokens);
  rec.samples = n;
  rec.seconds = seconds_since(t0);
  return rec;
}

// Saves every checkpoint.interval steps, at the last step, and after a stop
// signal (checkpoint.save_on_signal); records what it did in `rec`.
void Trainer::State::checkpoint_if_due(StepRecord& rec, int64_t last) {
  const bool final_save = rec.stop_requested && cfg.checkpoint.save_on_signal && ckpt->enabled();
  if (!ckpt->due(rec.step, last) && !final_save) return;
  // Every rank saw the same busy flag in the step's all-reduce, so all
  // ranks skip together or save together.
  if (cfg.checkpoint.when_busy == checkpoint::WhenBusy::kSkip && rec.checkpoint_busy && !final_save &&
      rec.step != last) {
    rec.checkpoint_skipped = true;
    if (is_logger) {
      std::cout << "checkpoint step " << rec.step << " skipped: previous save still in flight"
                << std::endl;
    }
    return;
  }
  auto t0 = Clock::now();
  save_checkpoint(rec.step, final_save || rec.step == last);
  rec.checkpoint_started = true;
  rec.checkpoint_blocking_s = seconds_since(t0);
}

// A clean exit (done, stop_at, signal) commits the in-flight save first.
void Trainer::State::finish_checkpoints() {
  try {
    ckpt->finish();
  } catch (const checkpoint::CheckpointError& e) {
    log_checkpoint_events();
    if (cfg.checkpoint.on_error != checkpoint::OnError::kWarn) throw;
    if (is_logger) std::cerr << "shardkit: warning: " << e.what() << std::endl;
  }
  log_checkpoint_events();
}

StepRecord Trainer::run_step() {
  State& s = *s_;
  if (!s.span) s.span = RunSpan{s.step + 1, s.last_step(), Clock::now()};
  s.profiler->before_step(s.step + 1);
  StepRecord rec = train_step();
  s.log_step(rec, *s.span);
  {
    RECORD_USER_SCOPE("shardkit::checkpoint");
    s.checkpoint_if_due(rec, s.span->last_step);
  }
  s.history.back() = rec;  // now with the checkpoint outcome
  if (s.profiler->enabled()) {
    const std::string trace = s.profiler->after_step(s.step, s.span->last_step);
    if (!trace.empty() && s.is_logger) {
      std::cout << "profile steps " << std::max<int64_t>(1, s.step - s.cfg.profile.active + 1) << "-"
                << s.step << " (" << StepProfiler::backend() << "): " << fs::path(trace).parent_path().string()
                << "/rank*.json" << std::endl;
      s.metrics << nlohmann::json({{"event", "profile"}, {"step", s.step}, {"backend", StepProfiler::backend()},
                                   {"dir", fs::path(trace).parent_path().string()}})
                       .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace)
                << "\n";
      s.metrics.flush();
    }
  }
  s.log_checkpoint_events();
  const int64_t every = s.cfg.train.eval_every;
  if (every > 0 && (s.step % every == 0 || s.step == s.cfg.train.steps)) {
    s.log_eval(evaluate());
  }
  const int64_t sample_every = s.cfg.train.sample_every;
  if (sample_every > 0 && (s.step % sample_every == 0 || s.step == s.cfg.train.steps)) {
    const std::string text = sample();
    if (s.is_logger) {
      std::string shown = s.cfg.train.sample_prompt + text;
      for (char& c : shown) {
        if (c == '\n' || c == '\r' || c == '\t') c = ' ';  // one line in the log
      }
      std::cout << "sample step " << s.step << " | " << shown << std::endl;
      s.metrics << nlohmann::json({{"event", "sample"}, {"step", s.step}, {"prompt", s.cfg.train.sample_prompt},
                                   {"text", text}})
                       .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace)
                << "\n";
      s.metrics.flush();
    }
  }
  return rec;
}

int Trainer::run() {
  State& s = *s_;
  s.span = RunSpan{s.step + 1, s.last_step(), Clock::now()};
  const RunSpan span = *s.span;
  bool stopped_by_signal = false;
  while (s.step < span.last_step && !stopped_by_signal) {
    stopped_by_signal = run_step().stop_requested;
  }
  s.span.reset();
  s.finish_checkpoints();
  // on_error: warn kept training past failed saves; a run whose last save
  // failed has not saved where it ended, and says so in its status.
  const bool last_save_failed = s.last_save && !s.last_save->ok;
  if (s.is_logger) {
    s.write_end_record(stopped_by_signal);
    std::cout << "shardkit: " << (stopped_by_signal ? "stopped by signal" : "finished")
              << " at step " << s.step << std::endl;
    if (last_save_failed) {
      std::cerr << "train: " << s.saves_failed << " checkpoint save(s) failed "
                << "(checkpoint.on_error: warn), the last one too: step " << s.last_save->step
                << " (" << s.last_save->path << "): " << s.last_save->error << std::endl;
    }
  }
  if (last_save_failed) return 1;
  return stopped_by_signal ? kExitPreempted : 0;
}

}  // namespace framework::train
