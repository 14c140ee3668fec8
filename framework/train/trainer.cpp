#include "framework/train/trainer.h"

#include "checkpoint/interop/import_weights.h"
#include "checkpoint/async/manager.h"
#include "framework/data/dataset.h"
#include "framework/dist/device.h"
#include "framework/data/sampler.h"
#include "framework/data/loader.h"
#include "framework/dtensor/device_mesh.h"
#include "framework/fsdp/fully_shard.h"
#include "framework/optim/sharded_adamw.h"
#include "models/layered_model.h"

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <chrono>
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

struct Trainer::State {
  config::Config cfg;
  dist::Runtime& rt;
  torch::Device device{torch::kCPU};  // where the model, optimizer and batches live
  std::vector<int64_t> mesh_shape;
  std::shared_ptr<dtensor::DeviceMesh> mesh;
  std::shared_ptr<models::LayeredModelImpl> model;
  std::unique_ptr<fsdp::FullyShardedModel> fsdp;
  std::unique_ptr<optim::ShardedAdamW> optim;
  std::shared_ptr<data::Dataset> dataset;
  std::unique_ptr<data::DataLoader> loader;
  int64_t step = 0;
  std::vector<StepRecord> history;
  std::ofstream metrics;
  bool is_logger = false;
  std::unique_ptr<checkpoint::CheckpointManager> ckpt;
  TrainerHooks hooks;

  checkpoint::StateDict make_state_dict();
  void apply_loaded(checkpoint::StateDict& sd, bool model_only);
  void save_checkpoint(int64_t step);
  void log_checkpoint_events();

  State(const config::Config& c, dist::Runtime& r) : cfg(c), rt(r) {}
};

namespace {

std::string format_duration(double seconds) {
  auto s = static_cast<int64_t>(seconds + 0.5);
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%02lld:%02lld:%02lld", static_cast<long long>(s / 3600),
                static_cast<long long>(s / 60 % 60), static_cast<long long>(s % 60));
  return buf;
}

std::vector<uint8_t> int64_bytes(int64_t v) {
  std::vector<uint8_t> b(8);
  for (int i = 0; i < 8; ++i) b[i] = static_cast<uint8_t>(static_cast<uint64_t>(v) >> (8 * i));
  return b;
}

int64_t bytes_int64(const std::vector<uint8_t>& b, const std::string& what) {
  if (b.size() != 8) throw std::runtime_error(what + ": expected 8 bytes, got " + std::to_string(b.size()));
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(b[i]) << (8 * i);
  return static_cast<int64_t>(v);
}

}  // namespace

// Everything a resumed run needs, as named items. Tensors are this rank's
// shards (no copies); the optimizer moments have their parameter's layout.
// The LR schedule is a pure function of train.step, so it needs no item.
checkpoint::StateDict Trainer::State::make_state_dict() {
  checkpoint::StateDict sd;
  const auto names = fsdp->param_names();
  for (size_t i = 0; i < names.size(); ++i) {
    auto p = fsdp->param_dtensor(i);
    sd.add_tensor("model." + names[i], p.local(), p.global_shape(), p.local_offsets());
    auto st = optim->state(i);
    sd.add_tensor("optim." + names[i] + ".exp_avg", st.exp_avg.local(), st.exp_avg.global_shape(),
                  st.exp_avg.local_offsets());
    sd.add_tensor("optim." + names[i] + ".exp_avg_sq", st.exp_avg_sq.local(),
                  st.exp_avg_sq.global_shape(), st.exp_avg_sq.local_offsets());
    sd.add_bytes("optim." + names[i] + ".step", int64_bytes(st.step));
  }
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
  const auto names = fsdp->param_names();
  for (size_t i = 0; i < names.size(); ++i) {
    int64_t st = bytes_int64(sd.find_bytes("optim." + names[i] + ".step")->data, "optimizer step");
    if (st > 0) {
      optim->set_state(i, st, sd.find_tensor("optim." + names[i] + ".exp_avg")->local,
                       sd.find_tensor("optim." + names[i] + ".exp_avg_sq")->local);
    }
  }
  step = bytes_int64(sd.find_bytes("train.step")->data, "train.step");
  loader->load_state(data::decode_loader_state(sd.find_bytes("data.loader")->data));
  const auto& rng = sd.find_bytes("rng.cpu")->data;
  torch::Tensor t = torch::empty({static_cast<int64_t>(rng.size())}, torch::kUInt8);
  std::memcpy(t.data_ptr(), rng.data(), rng.size());
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(t);
}

void Trainer::State::save_checkpoint(int64_t at_step) {
  try {
    ckpt->save(at_step, make_state_dict());
  } catch (const checkpoint::CheckpointError& e) {
    // The previous (background) save failed, or this sync save did.
    if (cfg.checkpoint.on_error != "warn") throw;
    if (is_logger) std::cerr << "shardkit: warning: " << e.what() << std::endl;
    if (ckpt->busy() || cfg.checkpoint.mode == "sync") return;
    ckpt->save(at_step, make_state_dict());
  }
}

void Trainer::State::log_checkpoint_events() {
  for (const auto& ev : ckpt->take_events()) {
    if (!is_logger) continue;
    std::ostringstream line;
    line << std::fixed << std::setprecision(3) << "checkpoint step " << ev.step << " (" << ev.mode
         << ") " << (ev.ok ? "committed " : "FAILED ") << ev.path << " | blocking " << ev.blocking_s
         << " s | stage " << ev.stage_s << " s | write " << ev.write_s << " s | commit "
         << ev.commit_s << " s | " << std::setprecision(1) << ev.bytes / 1048576.0 << " MiB -> "
         << ev.stored_bytes / 1048576.0 << " MiB";
    std::cout << line.str() << std::endl;
    nlohmann::json j = {{"event", "checkpoint"}, {"step", ev.step},         {"mode", ev.mode},
                        {"blocking_s", ev.blocking_s}, {"stage_s", ev.stage_s},
                        {"write_s", ev.write_s},   {"commit_s", ev.commit_s}, {"bytes", ev.bytes},
                        {"stored_bytes", ev.stored_bytes}, {"ok", ev.ok},   {"path", ev.path}};
    if (!ev.ok) j["error"] = ev.error;
    metrics << j.dump() << "\n";
    metrics.flush();
  }
}

std::atomic<int>& Trainer::stop_signal() {
  static std::atomic<int> signal{0};
  return signal;
}

Trainer::Trainer(const config::Config& config, dist::Runtime& runtime, TrainerHooks hooks)
    : s_(std::make_unique<State>(config, runtime)) {
  State& s = *s_;
  s.hooks = std::move(hooks);
  const int world = runtime.env.world_size;
  const int rank = runtime.env.rank;
  s.is_logger = rank == 0;
  s.mesh_shape = fsdp::mesh_shape_for(s.cfg.parallel, world);
  s.mesh = dtensor::DeviceMesh::create(*runtime.rendezvous, s.mesh_shape, {"replicate", "shard"});

  // Every rank builds the same full model from the same seed, then keeps its
  // shards: results do not depend on the world size.
  {
    // LibTorch's init functions draw from the process-wide generator; ranks
    // that share a process (tests) must not interleave here.
    static std::mutex init_mutex;
    std::lock_guard<std::mutex> lock(init_mutex);
    torch::manual_seed(static_cast<uint64_t>(s.cfg.run.seed));
    s.model = models::make_model(s.cfg.model);
  }
  // The model is initialised on the CPU from the seed either way, so a CUDA
  // run starts from the same weights as a CPU run, then moves to the GPU.
  s.device = runtime.device;
  if (s.device.is_cuda()) {
    dist::use_deterministic_cuda();  // bit-exact resume needs reproducible kernels
    s.model->to(s.device);
  }
  s.fsdp = std::make_unique<fsdp::FullyShardedModel>(s.model, s.mesh, s.cfg.parallel);
  s.optim = std::make_unique<optim::ShardedAdamW>(*s.fsdp, s.cfg.optim, s.cfg.train.steps);

  s.dataset = data::make_dataset(s.cfg.data, s.cfg.model, static_cast<uint64_t>(s.cfg.run.seed));
  s.loader = std::make_unique<data::DataLoader>(s.dataset, s.cfg.train.global_batch_size,
                                                static_cast<uint64_t>(s.cfg.run.seed), rank, world);

  std::ostringstream layout;
  layout << fsdp::layout_name(s.mesh_shape) << " replicate=" << s.mesh_shape[0]
         << " shard=" << s.mesh_shape[1];
  s.ckpt = std::make_unique<checkpoint::CheckpointManager>(
      s.cfg.checkpoint, (fs::path(s.cfg.run.dir) / "checkpoints").string(), *runtime.checkpoint,
      layout.str(), s.hooks.storage ? s.hooks.storage : checkpoint::posix_storage(),
      s.hooks.checkpoint);
  if (s.ckpt->enabled() && (s.cfg.checkpoint.mode != "sync" || s.device.is_cuda())) {
    // Host (pinned, for GPU state) staging buffers now, not at the first
    // save while the training loop waits.
    s.ckpt->reserve_staging(s.make_state_dict());
  }
  std::optional<std::string> resume_from = s.ckpt->resume_path();
  checkpoint::LoadStats resumed;
  if (resume_from) {
    checkpoint::StateDict sd = s.make_state_dict();
    resumed = s.ckpt->load(sd, *resume_from);
    s.apply_loaded(sd, s.cfg.checkpoint.model_only);
  } else if (!s.cfg.model.init_from.empty()) {
    // Full, unsharded weights from elsewhere: each rank reads only the byte
    // ranges of its own shards. Ignored when resuming (the checkpoint wins).
    checkpoint::StateDict sd;
    const auto names = s.fsdp->param_names();
    for (size_t i = 0; i < names.size(); ++i) {
      auto p = s.fsdp->param_dtensor(i);
      sd.add_tensor("model." + names[i], p.local(), p.global_shape(), p.local_offsets());
    }
    torch::NoGradGuard no_grad;
    checkpoint::load_weights_into(sd, s.cfg.model.init_from, "model.", false);
  }

  if (s.is_logger) {
    fs::create_directories(s.cfg.run.dir);
    config::write_effective_config(s.cfg, s.cfg.run.dir);
    fs::path metrics_path = fs::path(s.cfg.run.dir) / "metrics.jsonl";
    s.metrics.open(metrics_path, std::ios::app);
    if (!s.metrics) {
      throw std::runtime_error("cannot open " + metrics_path.string() + " for appending");
    }
    const auto& st = s.fsdp->memory_stats();
    std::cout << "shardkit: world " << world << " ("
              << (std::getenv("SHARDKIT_LAUNCHED") ? std::string("train --nproc")
                                                  : dist::to_string(runtime.env.source))
              << "), layout " << fsdp::layout_name(s.mesh_shape) << " replicate=" << s.mesh_shape[0]
              << " shard=" << s.mesh_shape[1] << ", groups train=" << runtime.train->backend_name()
              << " ckpt=" << runtime.checkpoint->backend_name() << ", device " << s.device.str()
              << ", LibTorch "
              << dist::torch_version() << "\n"
              << "shardkit: model " << s.cfg.model.kind << " "
              << st.full_param_bytes / 4 << " params, " << st.sharded_param_bytes / 4
              << " on this rank; data " << s.dataset->describe() << std::endl;
    if (!resume_from && !s.cfg.model.init_from.empty()) {
      std::cout << "shardkit: model initialised from " << s.cfg.model.init_from << std::endl;
    }
    if (resume_from) {
      std::cout << "shardkit: resumed from " << *resume_from << " (step " << resumed.step
                << ", saved by " << resumed.saved_world_size << " ranks, "
                << resumed.saved_layout << ")" << (s.cfg.checkpoint.model_only ? ", model only" : "")
                << "; continuing after step " << s.step << std::endl;
    }
  }
}

Trainer::~Trainer() = default;

int64_t Trainer::step() const { return s_->step; }
fsdp::FullyShardedModel& Trainer::model() { return *s_->fsdp; }
optim::ShardedAdamW& Trainer::optimizer() { return *s_->optim; }
const std::vector<StepRecord>& Trainer::history() const { return s_->history; }

int Trainer::run() {
  State& s = *s_;
  const auto& tc = s.cfg.train;
  const int64_t last = tc.stop_at > 0 ? std::min(tc.stop_at, tc.steps) : tc.steps;
  const int64_t tokens_per_step = tc.global_batch_size * s.dataset->seq_len();
  auto run_start = Clock::now();
  int64_t first_step = s.step + 1;
  bool stopped_by_signal = false;

  while (s.step < last) {
    const int64_t step = s.step + 1;
    auto t0 = Clock::now();
    auto [host_inputs, host_targets] = s.loader->next();
    torch::Tensor inputs = host_inputs.to(s.device);
    torch::Tensor targets = host_targets.to(s.device);
    torch::Tensor logits = s.fsdp->forward(inputs);
    const int64_t vocab = logits.size(-1);
    torch::Tensor loss_sum = torch::nn::functional::cross_entropy(
        logits.reshape({-1, vocab}), targets.reshape({-1}),
        torch::nn::functional::CrossEntropyFuncOptions().ignore_index(-100).reduction(torch::kSum));
    // One small all-reduce per step, on the training device: global loss
    // sum, global token count, and whether any rank was asked to stop or is
    // still saving. Its result is the one host read of the step.
    torch::Tensor flags = torch::tensor(
        {static_cast<double>(stop_signal().load() != 0), static_cast<double>(s.ckpt->busy())},
        torch::kDouble);
    torch::Tensor stats = torch::cat({loss_sum.detach().to(torch::kDouble).reshape({1}),
                                      (targets != -100).sum().to(torch::kDouble).reshape({1}),
                                      flags.to(s.device)});
    if (s.hooks.before_step) s.hooks.before_step(step, s.rt.env.rank);
    s.rt.train->all_reduce(stats);
    stats = stats.to(torch::kCPU);
    const double global_tokens = std::max(1.0, stats[1].item<double>());
    // Normalising by the global token count and summing gradients across
    // ranks gives the gradient of the global mean at any world size.
    (loss_sum / global_tokens).backward();
    s.fsdp->finish_backward();
    double norm = tc.grad_clip > 0 ? s.fsdp->clip_grad_norm(tc.grad_clip) : 0.0;
    // Overlap mode: the previous save may still be copying parameters and
    // optimizer state; they change only here.
    s.ckpt->wait_staged();
    double lr = s.optim->step(step);
    s.fsdp->zero_grad();
    s.step = step;

    StepRecord rec;
    rec.step = step;
    rec.loss = stats[0].item<double>() / global_tokens;
    rec.lr = lr;
    rec.grad_norm = norm;
    rec.step_time_s = std::chrono::duration<double>(Clock::now() - t0).count();
    rec.tokens_per_s = static_cast<double>(tokens_per_step) / std::max(rec.step_time_s, 1e-9);
    s.history.push_back(rec);

    bool log_now = step % tc.log_every == 0 || step == last || step == first_step;
    if (s.is_logger && log_now) {
      double elapsed = std::chrono::duration<double>(Clock::now() - run_start).count();
      double per_step = elapsed / static_cast<double>(step - first_step + 1);
      std::ostringstream line;
      line << "step " << step << "/" << tc.steps << " | loss " << std::fixed << std::setprecision(4)
           << rec.loss << " | lr " << std::scientific << std::setprecision(2) << lr << std::fixed
           << " | " << std::setprecision(0) << rec.tokens_per_s << " tok/s | "
           << std::setprecision(3) << rec.step_time_s << " s/step | ETA "
           << format_duration(per_step * static_cast<double>(last - step));
      std::cout << line.str() << std::endl;
      nlohmann::json j = {{"step", step},         {"loss", rec.loss},
                          {"lr", lr},             {"tokens_per_s", rec.tokens_per_s},
                          {"step_time_s", rec.step_time_s}, {"grad_norm", norm}};
      s.metrics << j.dump() << "\n";
      s.metrics.flush();
    }
    const bool stop_now = stats[2].item<double>() > 0;
    const bool final_save = stop_now && s.cfg.checkpoint.save_on_signal && s.ckpt->enabled();
    if (s.ckpt->due(step, last) || final_save) {
      // Every rank saw the same busy flag in the all-reduce above, so all
      // ranks skip together or save together.
      if (s.cfg.checkpoint.when_busy == "skip" && stats[3].item<double>() > 0 && !final_save &&
          step != last) {
        if (s.is_logger) std::cout << "checkpoint step " << step << " skipped: previous save still in flight" << std::endl;
      } else {
        s.save_checkpoint(step);
      }
    }
    s.log_checkpoint_events();
    if (stop_now) {
      stopped_by_signal = true;
      break;
    }
  }
  // A clean exit (done, stop_at, signal) commits the in-flight save first.
  try {
    s.ckpt->finish();
  } catch (const checkpoint::CheckpointError& e) {
    s.log_checkpoint_events();
    if (s.cfg.checkpoint.on_error != "warn") throw;
    if (s.is_logger) std::cerr << "shardkit: warning: " << e.what() << std::endl;
  }
  s.log_checkpoint_events();
  if (s.is_logger) {
    std::cout << "shardkit: " << (stopped_by_signal ? "stopped by signal" : "finished")
              << " at step " << s.step << std::endl;
  }
  return stopped_by_signal ? kExitPreempted : 0;
}

}  // namespace framework::train
