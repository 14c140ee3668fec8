// llama_ref: runs a llama config at world 1 through the real Trainer and
// writes what a PyTorch reference needs to redo the same run
// (tests/models/test_llama_parity.py, bench/step_compare.py):
//   llama_ref --config FILE [--set key=value]... --out DIR [--time-steps K]
// DIR/init.safetensors  the initial fp32 weights (Hugging Face names), made
//                       by saving a checkpoint and exporting it (ckpt export)
// DIR/probe_tokens.bin  int64 [2, seq_len]; probe_logits.bin float32
//                       [2, seq_len, vocab]: the initial model's logits
// DIR/inputs.bin, targets.bin  int64 [steps, global_batch, seq_len]: the
//                       batches the steps trained on, in order
// DIR/result.json       per-step losses, grad_norms, lrs, the settings,
//                       and with --time-steps the median step time of K
//                       more steps; on a GPU, peak_gpu_mib (the caching
//                       allocator's peak of allocated bytes), and with
//                       train.deterministic also step_time_nondeterministic_s
//                       (K more steps on PyTorch's default kernels).
#include "checkpoint/interop/export.h"
#include "checkpoint/save.h"
#include "framework/config/config.h"
#include "framework/data/dataset.h"
#include "dist/device.h"
#include "dist/torch_compat.h"
#include "framework/fsdp/fully_shard.h"
#include "framework/train/state_dict.h"
#include "framework/train/trainer.h"
#include "models/layered_model.h"
#include "models/llama.h"
#include "support/multi_rank.h"

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <filesystem>
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
            {"d_ff", models::llama_d_ff(m)},
            {"rope_theta", m.rope_theta},
            {"norm_eps", m.norm_eps},
            {"tie_weights", m.tie_weights},
            {"activation_checkpointing", m.activation_checkpointing},
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
           {{"param_dtype", cfg.train.mixed_precision.param_dtype},
            {"reduce_dtype", cfg.train.mixed_precision.reduce_dtype}}},
          {"attention", framework::dist::compat::kFusedAttention ? "sdpa" : "matmul"},
          {"threads", at::get_num_threads()},
          {"device", cfg.train.device},
          {"torch", TORCH_VERSION}};
}

void run(Config cfg, const fs::path& out, int64_t time_steps) {
  const int64_t compared_steps = cfg.train.steps;
  // On CUDA with train.deterministic (the default) the K timed steps run
  // twice: with deterministic kernels, then with PyTorch's default ones.
  const bool time_both = cfg.train.device == "cuda" && cfg.train.deterministic;
  cfg.train.steps += time_steps * (time_both ? 2 : 1);  // the schedule's total: result.json's train.steps
  testing_support::run_runtimes(1, [&](framework::dist::Runtime& rt) {
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
    user.loss = [&](const torch::Tensor& in, const torch::Tensor& tgt) {
      if (recording) {
        inputs.push_back(in.to(torch::kCPU));
        targets.push_back(tgt.to(torch::kCPU));
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

    // The initial weights, through a checkpoint and the safetensors export.
    const fs::path ckpt_dir = out / "init_checkpoint";
    fs::remove_all(ckpt_dir);
    checkpoint::StateDict init_state = framework::train::get_state_dict(trainer.model(), nullptr);
    for (auto& t : init_state.tensors()) t.local = t.local.to(torch::kCPU);  // a CUDA run's too
    checkpoint::save_state_dict(init_state, ckpt_dir.string(), *rt.checkpoint, checkpoint::SaveOptions{});
    checkpoint::ExportOptions exp;
    exp.only = "model";
    checkpoint::export_checkpoint(ckpt_dir.string(), (out / "init.safetensors").string(), exp);

    torch::Tensor probe = torch::randint(cfg.model.vocab_size, {2, cfg.model.seq_len},
                                         torch::TensorOptions(torch::kLong));
    torch::Tensor logits;
    {
      torch::NoGradGuard no_grad;
      torch::Tensor dev = probe.to(trainer.model().local_params().front().device());
      logits = trainer.model().forward([&] { return model->forward(dev); }).to(torch::kFloat);
    }
    write_tensor(out / "probe_tokens.bin", probe);
    write_tensor(out / "probe_logits.bin", logits);

    nlohmann::json result = settings(cfg);
    std::vector<double> losses, norms, lrs;
    for (int64_t s = 0; s < compared_steps; ++s) {
      const auto rec = trainer.train_step();
      losses.push_back(rec.loss);
      norms.push_back(rec.grad_norm);
      lrs.push_back(rec.lr);
    }
    recording = false;
    write_tensor(out / "inputs.bin", torch::cat(inputs));
    write_tensor(out / "targets.bin", torch::cat(targets));
    result["losses"] = losses;
    result["grad_norms"] = norms;
    result["lrs"] = lrs;
    auto time_k_steps = [&](const std::string& median_key, const std::string& all_key) {
      std::vector<double> times;
      for (int64_t s = 0; s < time_steps; ++s) times.push_back(trainer.train_step().step_time_s);
      result[all_key] = times;
      std::sort(times.begin(), times.end());
      result[median_key] = times[times.size() / 2];
    };
    if (time_steps > 0) {
      time_k_steps("step_time_s", "step_times_s");
      result["deterministic"] = cfg.train.device == "cuda" && cfg.train.deterministic;
      if (time_both) {
        framework::dist::use_deterministic_cuda(false);
        time_k_steps("step_time_nondeterministic_s", "step_times_nondeterministic_s");
      }
      result["tokens_per_step"] = cfg.train.global_batch_size * cfg.model.seq_len;
    }
    // The allocator's peak over the whole run (0 on the CPU): the training
    // steps set it, since nothing before them holds activations.
    const at::Device device = trainer.model().local_params().front().device();
    if (device.is_cuda()) {
      result["peak_gpu_mib"] = framework::dist::peak_device_memory_bytes(device) / 1048576.0;
    }
    std::ofstream(out / "result.json") << result.dump(2) << "\n";
  }, 600.0, cfg.train.device);
}

}  // namespace

int main(int argc, char** argv) {
  std::string config_path, out;
  std::vector<std::string> sets;
  int64_t time_steps = 0;
  CLI::App app{"llama_ref: a llama run at world 1, written out for a PyTorch reference"};
  app.add_option("--config", config_path, "YAML config (model.kind llama)")->required();
  app.add_option("--set", sets, "override a config key: key.path=value (repeatable)");
  app.add_option("--out", out, "output directory")->required();
  app.add_option("--time-steps", time_steps, "time this many more steps (step_time_s)");
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
    run(cfg, out, time_steps);
  } catch (const std::exception& e) {
    std::cerr << "llama_ref: " << e.what() << std::endl;
    return 1;
  }
  return 0;
}
