// ac_bench: what activation checkpointing costs and saves on a llama
// (model.activation_checkpointing none | selective | full), at world 1 on
// the CPU, side by side in one run:
//   - activation memory: the bytes the forward keeps for backward (the
//     CPU allocator's live bytes after the forward, less those before it),
//     and the peak over forward + backward above the weights, less the
//     gradients that outlive the step;
//   - step time: the median of --steps optimizer steps of the real Trainer.
// Prints a table and writes JSON (--json) with the ratios against none.
//   build/ac_bench [--seq-len 512 --d-model 512 --layers 8 ...] [--json FILE]
#include "framework/config/config.h"
#include "framework/train/trainer.h"
#include "models/layered_model.h"
#include "support/counting_allocator.h"
#include "support/multi_rank.h"

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>

#include <unistd.h>

namespace {

struct Row {
  std::string mode;
  double kept_mib = 0;      // held after the forward for backward
  double peak_mib = 0;      // peak over forward + backward, less weights and gradients
  double step_s = 0;        // median Trainer step
};

double mib(double bytes) { return bytes / 1048576.0; }

Row measure(const framework::config::Config& base, models::ActivationCheckpointing mode, int steps,
            testing_support::CountingCpuAllocator& counter) {
  framework::config::Config cfg = base;
  cfg.model.activation_checkpointing = mode;
  Row row;
  row.mode = to_string(mode);
  if (mode == models::ActivationCheckpointing::kSelective)
    row.mode += "/" + std::to_string(cfg.model.activation_checkpointing_every);
  {
    // Memory: the plain module (no FSDP, nothing sharded), one batch.
    torch::manual_seed(1);
    auto model = models::make_model(cfg.model, true);
    const int64_t batch = cfg.train.global_batch_size;
    torch::Tensor tokens = torch::randint(cfg.model.vocab_size, {batch, cfg.model.seq_len}, torch::kLong);
    const int64_t before = counter.live_bytes();
    counter.reset_peak();
    torch::Tensor logits = model->forward(tokens).to(torch::kFloat);
    torch::Tensor loss = torch::nn::functional::cross_entropy(
        logits.reshape({-1, logits.size(-1)}), tokens.reshape({-1}));
    row.kept_mib = mib(static_cast<double>(counter.live_bytes() - before));
    logits = torch::Tensor();
    loss.backward();
    loss = torch::Tensor();
    const int64_t grads = counter.live_bytes() - before;
    row.peak_mib = mib(static_cast<double>(counter.peak_bytes() - before - grads));
  }
  // Step time: the real trainer (FSDP wrapper at world 1, AdamW).
  cfg.train.steps = steps + 1;
  std::vector<double> times;
  testing_support::run_runtimes(1, [&](comm::Runtime& rt) {
    framework::train::Trainer trainer(cfg, rt);
    trainer.train_step();  // warm-up: allocates AdamW's state
    for (int i = 0; i < steps; ++i) times.push_back(trainer.train_step().step_time_s);
  }, 600.0);
  std::sort(times.begin(), times.end());
  row.step_s = times[times.size() / 2];
  return row;
}

}  // namespace

int main(int argc, char** argv) {
  int64_t seq_len = 512, d_model = 512, layers = 8, heads = 8, kv_heads = 4, vocab = 2048, batch = 2;
  int steps = 3, every = 2;
  std::string json_path;
  CLI::App app{"ac_bench: activation memory and step time with and without activation checkpointing"};
  app.add_option("--seq-len", seq_len);
  app.add_option("--d-model", d_model);
  app.add_option("--layers", layers);
  app.add_option("--heads", heads);
  app.add_option("--kv-heads", kv_heads);
  app.add_option("--vocab", vocab);
  app.add_option("--batch", batch, "sequences per step");
  app.add_option("--steps", steps, "timed steps per mode (median)");
  app.add_option("--every", every, "selective: every N-th block");
  app.add_option("--json", json_path, "write the results here");
  CLI11_PARSE(app, argc, argv);

  framework::config::Config cfg;
  cfg.run.dir = (std::filesystem::temp_directory_path() / ("ac_bench_" + std::to_string(::getpid()))).string();
  cfg.model.kind = "llama";
  cfg.model.tie_weights = false;
  cfg.model.vocab_size = vocab;
  cfg.model.seq_len = seq_len;
  cfg.model.d_model = d_model;
  cfg.model.n_layers = layers;
  cfg.model.n_heads = heads;
  cfg.model.n_kv_heads = kv_heads;
  cfg.model.activation_checkpointing_every = every;
  cfg.train.global_batch_size = batch;
  cfg.train.log_every = 1000;
  cfg.checkpoint.interval = 0;
  cfg.data.kind = framework::data::DataKind::kSynthetic;
  cfg.data.task = framework::data::SyntheticTask::kCopy;

  static auto* counter = new testing_support::CountingCpuAllocator();
  std::vector<Row> rows;
  for (models::ActivationCheckpointing mode :
       {models::ActivationCheckpointing::kNone, models::ActivationCheckpointing::kSelective,
        models::ActivationCheckpointing::kFull})
    rows.push_back(measure(cfg, mode, steps, *counter));
  std::filesystem::remove_all(cfg.run.dir);

  const auto size = models::model_size(cfg.model);
  std::printf("ac_bench: llama %.1fM params, seq_len %lld, d_model %lld, %lld blocks, batch %lld, "
              "%d threads, LibTorch %s\n", size.parameters / 1e6, (long long)seq_len, (long long)d_model,
              (long long)layers, (long long)batch, at::get_num_threads(), TORCH_VERSION);
  std::printf("%-12s %14s %14s %10s %12s %12s\n", "checkpoint", "kept MiB", "peak MiB", "step s",
              "memory/none", "time/none");
  nlohmann::json out = {{"params", size.parameters}, {"seq_len", seq_len}, {"d_model", d_model},
                        {"layers", layers}, {"batch", batch}, {"threads", at::get_num_threads()},
                        {"libtorch", TORCH_VERSION}};
  for (const Row& r : rows) {
    const double mem_ratio = r.peak_mib / rows[0].peak_mib;
    const double time_ratio = r.step_s / rows[0].step_s;
    std::printf("%-12s %14.1f %14.1f %10.3f %12.3f %12.3f\n", r.mode.c_str(), r.kept_mib, r.peak_mib,
                r.step_s, mem_ratio, time_ratio);
    out["modes"][r.mode] = {{"kept_activation_mib", r.kept_mib}, {"peak_activation_mib", r.peak_mib},
                            {"step_time_s", r.step_s}, {"peak_activation_ratio", mem_ratio},
                            {"kept_activation_ratio", r.kept_mib / rows[0].kept_mib},
                            {"step_time_ratio", time_ratio}};
  }
  const Row& full = rows.back();
  out["full_peak_activation_ratio"] = full.peak_mib / rows[0].peak_mib;
  out["full_step_time_ratio"] = full.step_s / rows[0].step_s;
  std::printf("targets (full): peak activation memory <= 1/3 of none: %.3f %s; step time <= 1.4x: %.3f %s\n",
              full.peak_mib / rows[0].peak_mib, full.peak_mib / rows[0].peak_mib <= 1.0 / 3 ? "met" : "MISSED",
              full.step_s / rows[0].step_s, full.step_s / rows[0].step_s <= 1.4 ? "met" : "MISSED");
  std::cout << out.dump() << std::endl;
  if (!json_path.empty()) std::ofstream(json_path) << out.dump(2) << "\n";
  return 0;
}
