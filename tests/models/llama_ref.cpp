// llama_ref: runs a llama config at world 1 through the real Trainer and
// writes what a PyTorch reference needs to redo the same run
// (tests/models/test_llama_parity.py, bench/step_compare.py):
//   llama_ref --config FILE [--set key=value]... --out DIR [--time-steps K]
// DIR/init.safetensors  the initial fp32 weights (Hugging Face names), made
//                       by saving a checkpoint and exporting it (ckpt export)
// DIR/probe_tokens.bin  int64 [2, seq_len]; probe_logits.bin float32
//                       [2, seq_len, vocab]: the initial model's logits
// DIR/final.safetensors, final_probe_logits.bin  the same after the steps
// DIR/final_hf/         the final weights as ckpt export --format hf writes
//                       them (not for LoRA; a model no Hugging Face format
//                       expresses: result.json hf_export_refused instead)
// DIR/inputs.bin, targets.bin  int64 [steps, global_batch, seq_len]: the
//                       batches the steps trained on, in order
// DIR/result.json       per-step losses, grad_norms, lrs, the settings,
//                       and with --time-steps the median step time of K
//                       more steps; on a GPU, peak_gpu_mib (the caching
//                       allocator's peak of allocated bytes), and with
//                       train.deterministic also step_time_nondeterministic_s
//                       (K more steps on PyTorch's default kernels).
//   --profile-trace FILE  P more steps (--profile-steps, default 3) under
//                       LibTorch's profiler (Kineto: CPU ops and, on a GPU,
//                       kernels), written as a Chrome trace; the step's
//                       phases are its shardkit::* scopes (bench/trace_top.py
//                       tabulates it)
//   --time-optimizer K  then the AdamW step alone, K times per
//                       implementation this build has, on the model's last
//                       gradients: result.json optimizer_step_s {impl: median}
// The run follows train.optimizer_impl and train.fused_kernels as `train`
// does (result.json: optimizer_impl, fused_kernels).
#include "checkpoint/errors.h"
#include "checkpoint/interop/export.h"
#include "checkpoint/save.h"
#include "framework/config/config.h"
#include "framework/config/run_items.h"
#include "framework/data/dataset.h"
#include "comm/exit_now.h"
#include "comm/device.h"
#include "comm/torch_compat.h"
#include "framework/fsdp/fully_shard.h"
#include "framework/optim/sharded_adamw.h"
#include "framework/train/profiler.h"
#include "framework/train/state_dict.h"
#include "framework/train/trainer.h"
#include "models/layered_model.h"
#include "models/llama.h"
#include "support/multi_rank.h"

#include <ATen/record_function.h>
#include <CLI/CLI.hpp>
#include <torch/csrc/autograd/profiler_kineto.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <set>
#include <fstream>
#include <iostream>

namespace {

namespace fs = std::filesystem;
using framework::config::Config;

void write_tensor(const fs::path& path, const torch::Tensor& t) {
  torch::Tensor c = t.contiguous().to(torch::kCPU);
  std::ofstream out(path, std::ios::binary);
  out.write(static_cast<const char*>(c.data_ptr()), static_cast<std::streamsize>(c.nbytes()));
  if (!out) throw std::runtime_error("cannot write " + path.string());
}

nlohmann::json settings(const Config& cfg) {
  const auto& m = cfg.model;
  return {{"model",
           {{"vocab_size", m.vocab_size},
            {"seq_len", m.seq_len},
            {"d_model", m.d_model},
            {"n_layers", m.n_layers},
            {"n_heads", m.n_heads},
            {"n_kv_heads", m.n_kv_heads > 0 ? m.n_kv_heads : m.n_heads},
            {"head_dim", models::llama_head_dim(m)},
            {"d_ff", models::llama_d_ff(m)},
            {"rope_theta", m.rope_theta},
            {"norm_eps", m.norm_eps},
            {"tie_weights", m.tie_weights},
            {"qk_norm", m.qk_norm},
            {"moe",
             {{"num_experts", m.moe.num_experts},
              {"top_k", m.moe.top_k},
              {"d_ff", models::moe_expert_d_ff(m)},
              {"score_func", to_string(m.moe.score_func)},
              {"route_norm", m.moe.route_norm},
              {"route_scale", m.moe.route_scale},
              {"num_shared_experts", m.moe.num_shared_experts},
              {"first_dense_layers", m.moe.first_dense_layers},
              {"aux_loss_coef", m.moe.aux_loss_coef},
              {"load_balance_rate", m.moe.load_balance_rate}}},
            {"activation_checkpointing", to_string(m.activation_checkpointing)},
            {"lora",
             {{"rank", m.lora.rank},
              {"alpha", m.lora.alpha},
              {"targets", m.lora.rank > 0 ? models::lora_targets(m.lora) : std::vector<std::string>{}}}},
            {"rope_scaling",
             {{"factor", m.rope_scaling.factor},
              {"low_freq_factor", m.rope_scaling.low_freq_factor},
              {"high_freq_factor", m.rope_scaling.high_freq_factor},
              {"original_max_position", m.rope_scaling.original_max_position}}}}},
          {"optim",
           {{"lr", cfg.optim.lr},
            {"min_lr", cfg.optim.min_lr},
            {"warmup_steps", cfg.optim.warmup_steps},
            {"weight_decay", cfg.optim.weight_decay},
            {"beta1", cfg.optim.beta1},
            {"beta2", cfg.optim.beta2},
            {"eps", cfg.optim.eps}}},
          {"train",
           {{"steps", cfg.train.steps},
            {"global_batch_size", cfg.train.global_batch_size},
            {"micro_batch_size", cfg.train.micro_batch_size},
            {"grad_clip", cfg.train.grad_clip}}},
          {"mixed_precision",
           {{"param_dtype", to_string(cfg.train.mixed_precision.param_dtype)},
            {"reduce_dtype", to_string(cfg.train.mixed_precision.reduce_dtype)}}},
          {"attention", comm::compat::kFusedAttention ? "sdpa" : "matmul"},
          {"threads", at::get_num_threads()},
          {"device", to_string(cfg.train.device)},
          {"torch", TORCH_VERSION}};
}

struct Extras {
  int64_t time_steps = 0;
  std::string profile_trace;
  int64_t profile_steps = 3;
  int64_t time_optimizer = 0;
};

void run(Config cfg, const fs::path& out, const Extras& extras) {
  const int64_t time_steps = extras.time_steps;
  const int64_t compared_steps = cfg.train.steps;
  // On CUDA with train.deterministic (the default) the K timed steps run
  // twice: with deterministic kernels, then with PyTorch's default ones.
  const bool time_both = cfg.train.device == comm::DeviceKind::kCuda && cfg.train.deterministic;
  // The schedule's total: result.json's train.steps.
  cfg.train.steps += time_steps * (time_both ? 2 : 1) +
                     (extras.profile_trace.empty() ? 0 : extras.profile_steps);
  testing_support::run_runtimes(1, [&](comm::Runtime& rt) {
    std::shared_ptr<models::LayeredModelImpl> model;
    {
      torch::manual_seed(static_cast<uint64_t>(cfg.run.seed));
      model = models::make_model(cfg.model, /*materialize=*/false);
    }
    std::vector<torch::Tensor> inputs, targets;
    bool recording = true;
    framework::train::UserModel user;
    user.module = model;
    user.units = model->unit_names();
    user.init = [model](const std::string& name, const torch::Tensor& full) {
      model->init_parameter(name, full);
    };
    models::use_fused_kernels(*model, cfg.train.fused_kernels);
    user.loss = [&](const torch::Tensor& in, const torch::Tensor& tgt) {
      if (recording) {
        inputs.push_back(in.to(torch::kCPU));
        targets.push_back(tgt.to(torch::kCPU));
      }
      if (cfg.train.fused_kernels) {  // as the trainer's built-in llama
        torch::Tensor logits = model->forward(in);
        torch::Tensor sum = models::fused_cross_entropy_sum(
            logits.reshape({-1, logits.size(-1)}), tgt.reshape({-1}), framework::data::kIgnoreIndex);
        return framework::train::LossSum{sum, (tgt != framework::data::kIgnoreIndex).sum()};
      }
      torch::Tensor logits = model->forward(in).to(torch::kFloat);
      torch::Tensor sum = torch::nn::functional::cross_entropy(
          logits.reshape({-1, logits.size(-1)}), tgt.reshape({-1}),
          torch::nn::functional::CrossEntropyFuncOptions()
              .ignore_index(framework::data::kIgnoreIndex)
              .reduction(torch::kSum));
      return framework::train::LossSum{sum, (tgt != framework::data::kIgnoreIndex).sum()};
    };
    user.dataset = framework::data::make_dataset(cfg.data, cfg.model, static_cast<uint64_t>(cfg.run.seed));
    user.description = "llama";
    framework::train::Trainer trainer(cfg, rt, user);

    // The weights (every parameter, a LoRA run's frozen base too), through
    // a checkpoint (with the run's config, as train saves it) and the
    // safetensors export.
    const std::string yaml = framework::config::to_yaml(cfg);
    auto export_weights = [&](const std::string& name) {
      const fs::path ckpt_dir = out / (name + "_checkpoint");
      fs::remove_all(ckpt_dir);
      checkpoint::StateDict state = framework::train::get_state_dict(trainer.model(), nullptr);
      for (auto& t : state.tensors()) t.local = t.local.to(torch::kCPU);  // a CUDA run's too
      state.add_bytes(framework::config::kConfigItem, std::vector<uint8_t>(yaml.begin(), yaml.end()));
      checkpoint::save_state_dict(state, ckpt_dir.string(), *rt.checkpoint, checkpoint::SaveOptions{});
      checkpoint::ExportOptions exp;
      exp.only = "model";
      checkpoint::export_checkpoint(ckpt_dir.string(), (out / (name + ".safetensors")).string(), exp);
    };
    // The same checkpoint as ckpt export --format hf writes it, for the
    // reference to load by Hugging Face's names and config.json alone; the
    // refusal's one line for a model no Hugging Face format expresses.
    std::string hf_refusal;
    auto export_hf = [&](const std::string& name) {
      checkpoint::ExportOptions exp;
      exp.format = checkpoint::ExportFormat::kHf;
      exp.run = framework::config::make_run_adapter();
      try {
        checkpoint::export_checkpoint((out / (name + "_checkpoint")).string(), (out / (name + "_hf")).string(), exp);
      } catch (const checkpoint::FormatError& e) {
        hf_refusal = e.what();
      }
    };
    export_weights("init");

    torch::Tensor probe = torch::randint(cfg.model.vocab_size, {2, cfg.model.seq_len},
                                         torch::TensorOptions(torch::kLong));
    auto probe_logits = [&] {
      torch::NoGradGuard no_grad;
      torch::Tensor dev = probe.to(trainer.model().local_params().front().device());
      return trainer.model().forward([&] { return model->forward(dev); }).to(torch::kFloat);
    };
    write_tensor(out / "probe_tokens.bin", probe);
    write_tensor(out / "probe_logits.bin", probe_logits());
    // A mixture of experts: each MoE layer's choices for the probe,
    // [layers, 2 * seq_len, k].
    if (const auto layers = models::moe_layers(*model); !layers.empty()) {
      std::vector<torch::Tensor> routes;
      for (const models::MoeFeedForwardImpl* layer : layers) routes.push_back(layer->last_choices().to(torch::kCPU));
      write_tensor(out / "probe_routes.bin", torch::stack(routes));
    }

    nlohmann::json result = settings(cfg);
    std::vector<double> losses, norms, lrs, aux_losses;
    std::vector<std::vector<std::vector<double>>> loads;
    for (int64_t s = 0; s < compared_steps; ++s) {
      const auto rec = trainer.train_step();
      losses.push_back(rec.loss);
      norms.push_back(rec.grad_norm);
      lrs.push_back(rec.lr);
      aux_losses.push_back(rec.moe_aux_loss);
      loads.push_back(rec.expert_loads);
    }
    recording = false;
    // After the compared steps: the weights and the probe's logits again
    // (a LoRA run's adapters are then non-zero).
    export_weights("final");
    if (cfg.model.lora.rank == 0) export_hf("final");  // a LoRA run's checkpoint is no Hugging Face base
    write_tensor(out / "final_probe_logits.bin", probe_logits());
    write_tensor(out / "inputs.bin", torch::cat(inputs));
    write_tensor(out / "targets.bin", torch::cat(targets));
    if (!hf_refusal.empty()) result["hf_export_refused"] = hf_refusal;
    result["losses"] = losses;
    result["grad_norms"] = norms;
    result["lrs"] = lrs;
    if (cfg.model.moe.num_experts > 0) {
      result["moe_aux_losses"] = aux_losses;  // per step, mean over the MoE layers
      result["expert_loads"] = loads;         // per step, per MoE layer, per expert
    }
    auto time_k_steps = [&](const std::string& median_key, const std::string& all_key) {
      std::vector<double> times;
      for (int64_t s = 0; s < time_steps; ++s) times.push_back(trainer.train_step().step_time_s);
      result[all_key] = times;
      std::sort(times.begin(), times.end());
      result[median_key] = times[times.size() / 2];
    };
    if (time_steps > 0) {
      time_k_steps("step_time_s", "step_times_s");
      result["deterministic"] = cfg.train.device == comm::DeviceKind::kCuda && cfg.train.deterministic;
      if (time_both) {
        comm::use_deterministic_cuda(false);
        time_k_steps("step_time_nondeterministic_s", "step_times_nondeterministic_s");
      }
      result["tokens_per_step"] = cfg.train.global_batch_size * cfg.model.seq_len;
    }
    const at::Device dev = trainer.model().local_params().front().device();
    result["optimizer_impl"] = framework::optim::adamw_impl_name(trainer.optimizer().impl());
    result["fused_kernels"] = cfg.train.fused_kernels;
    // The allocator's peak over the whole run (0 on the CPU): the training
    // steps set it, since nothing before them holds activations.
    if (dev.is_cuda()) {
      result["peak_gpu_mib"] = comm::peak_device_memory_bytes(dev) / 1048576.0;
    }
    if (!extras.profile_trace.empty()) {
      // As timed: deterministic kernels unless train.deterministic is false.
      comm::use_deterministic_cuda(cfg.train.device == comm::DeviceKind::kCuda && cfg.train.deterministic);
      try {
        framework::train::start_kineto(dev.is_cuda());
        std::vector<double> times;
        for (int64_t s = 0; s < extras.profile_steps; ++s) {
          RECORD_USER_SCOPE("shardkit::step");
          times.push_back(trainer.train_step().step_time_s);
        }
        comm::synchronize(dev);
        torch::autograd::profiler::disableProfiler()->save(extras.profile_trace);
        result["profile"] = {{"trace", extras.profile_trace}, {"steps", extras.profile_steps},
                             {"step_times_s", times}};
      } catch (const c10::Error& e) {
        // Debian's LibTorch 1.13 is built without Kineto (2.6's and pip's have it).
        result["profile"] = {{"error", e.what_without_backtrace()}};
        std::cerr << "llama_ref: profiling failed: " << e.what_without_backtrace() << std::endl;
      }
    }
    if (extras.time_optimizer > 0) {
      // Each implementation on its own fresh state, on the gradients of the
      // last step (zeros where a step left none), as the trainer calls it.
      for (torch::Tensor& p : trainer.model().local_params()) {
        if (!p.grad().defined()) p.mutable_grad() = torch::zeros_like(p);
      }
      nlohmann::json per_impl;
      for (auto impl : {framework::optim::AdamWImpl::kFused, framework::optim::AdamWImpl::kForeach,
                        framework::optim::AdamWImpl::kForLoop}) {
        if (!framework::optim::adamw_impl_available(impl)) continue;
        framework::optim::ShardedAdamW opt(trainer.model(), cfg.optim, cfg.train.steps, impl);
        std::vector<double> times;
        for (int64_t k = 0; k <= extras.time_optimizer; ++k) {  // the first makes the state
          comm::synchronize(dev);
          const auto t0 = std::chrono::steady_clock::now();
          opt.step(k + 1);
          comm::synchronize(dev);
          if (k > 0) times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
        }
        std::sort(times.begin(), times.end());
        per_impl[framework::optim::adamw_impl_name(impl)] = times[times.size() / 2];
      }
      result["optimizer_step_s"] = per_impl;
    }

    std::ofstream(out / "result.json") << result.dump(2) << "\n";
  }, 600.0, cfg.train.device);
}

}  // namespace

int main(int argc, char** argv) {
  std::string config_path, out;
  std::vector<std::string> sets;
  Extras extras;
  CLI::App app{"llama_ref: a llama run at world 1, written out for a PyTorch reference"};
  app.add_option("--config", config_path, "YAML config (model.kind llama)")->required();
  app.add_option("--set", sets, "override a config key: key.path=value (repeatable)");
  app.add_option("--out", out, "output directory")->required();
  app.add_option("--time-steps", extras.time_steps, "time this many more steps (step_time_s)");
  app.add_option("--profile-trace", extras.profile_trace,
                 "profile --profile-steps more steps; write a Chrome trace here");
  app.add_option("--profile-steps", extras.profile_steps, "steps --profile-trace profiles")->check(CLI::Range(1, 100));
  app.add_option("--time-optimizer", extras.time_optimizer,
                 "time the AdamW step alone this many times per implementation (optimizer_step_s)");
  CLI11_PARSE(app, argc, argv);
  try {
    Config cfg = framework::config::load_config(config_path, sets);
    if (cfg.model.kind != "llama") throw std::invalid_argument("llama_ref: model.kind must be llama");
    cfg.run.dir = (fs::path(out) / "run").string();
    cfg.checkpoint.interval = 0;
    cfg.checkpoint.resume = "never";
    cfg.checkpoint.save_on_signal = false;
    cfg.train.eval_every = 0;
    fs::remove_all(cfg.run.dir);
    fs::create_directories(out);
    run(cfg, out, extras);
  } catch (const std::exception& e) {
    std::cerr << "llama_ref: " << e.what() << std::endl;
    return 1;
  }
  // All written: no LibTorch static destructors (comm/exit_now.h).
  comm::exit_now(0);
}
