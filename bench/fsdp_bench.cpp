// fsdp_bench: parameter + gradient memory per rank under FSDP, against the
// unsharded run, for one training step of a GPT. Prints a table and, with
// --json FILE, one JSON object. Ranks are threads with real Gloo groups.
//
//   build/fsdp_bench [--layers 8] [--d-model 256] [--worlds 1,2,4] [--json F]
//
// Per rank, "params+grads peak" = local shards and their gradients + the peak
// of gathered full parameters and full gradients in flight (FSDP accounting
// in FullyShardedModel::memory_stats). World 1 is the unsharded baseline:
// the whole model's parameters and gradients. Target (issue): about the
// sharded total plus the largest unit.
#include "comm/launch_env.h"
#include "comm/runtime.h"
#include "framework/dtensor/device_mesh.h"
#include "framework/fsdp/fully_shard.h"
#include "models/layered_model.h"

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <cstdio>
#include <fstream>
#include <iostream>
#include <mutex>
#include <thread>

namespace {

struct Row {
  int world = 0;
  double full_mib = 0, sharded_mib = 0, largest_unit_mib = 0, peak_gathered_mib = 0;
  double per_rank_peak_mib = 0, expected_mib = 0, unsharded_mib = 0;
};

double mib(int64_t b) { return static_cast<double>(b) / 1048576.0; }

Row measure(int world, const models::ModelOptions& mo) {
  // This thread serves the ranks' store, as `train --nproc` does.
  const std::string job_id = comm::new_job_id();
  auto store = comm::host_tcp_store("127.0.0.1", 0, job_id);
  Row row;
  row.world = world;
  std::mutex mu;
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      comm::LaunchEnv env;
      env.rank = r;
      env.world_size = world;
      env.master_port = store->port();
      env.store_hosted = true;
      env.job_id = job_id;
      comm::DistOptions dopt;
      auto rt = comm::init_runtime(env, dopt, comm::DeviceKind::kCpu);
      auto mesh = framework::dtensor::DeviceMesh::create(*rt->rendezvous, {1, world},
                                                         {"replicate", "shard"});
      std::shared_ptr<models::LayeredModelImpl> model;
      {
        std::lock_guard<std::mutex> lock(mu);
        torch::manual_seed(1);
        model = models::make_model(mo);
      }
      framework::fsdp::FsdpOptions po;
      framework::fsdp::FullyShardedModel fsdp(model, mesh, po, framework::fsdp::children_of(*model, "blocks"));
      auto tokens = torch::randint(0, mo.vocab_size, {4, mo.seq_len}, torch::kLong);
      fsdp.reset_peak_memory();
      fsdp.forward([&] { return model->forward(tokens); }).pow(2).mean().backward();
      fsdp.finish_backward();
      const auto& st = fsdp.memory_stats();
      if (r == 0) {
        std::lock_guard<std::mutex> lock(mu);
        row.full_mib = mib(st.full_param_bytes);
        row.sharded_mib = mib(st.sharded_param_bytes);
        row.largest_unit_mib = mib(st.largest_unit_bytes);
        row.peak_gathered_mib = mib(st.peak_gathered_bytes);
        // Local shards + their gradients, plus what was gathered at the peak.
        row.per_rank_peak_mib = world == 1 ? 2 * row.full_mib
                                           : 2 * row.sharded_mib + row.peak_gathered_mib;
        row.unsharded_mib = 2 * row.full_mib;
      }
    });
  }
  for (auto& t : threads) t.join();
  return row;
}

}  // namespace

int main(int argc, char** argv) {
  models::ModelOptions mo;
  mo.n_layers = 8;
  mo.d_model = 256;
  mo.n_heads = 4;
  mo.vocab_size = 64;
  mo.seq_len = 64;
  std::vector<int> worlds{1, 2, 4};
  std::string json_path;
  CLI::App app{"FSDP parameter + gradient memory per rank against an unsharded run"};
  app.add_option("--layers", mo.n_layers, "transformer blocks (FSDP units)");
  app.add_option("--d-model", mo.d_model, "hidden width");
  app.add_option("--worlds", worlds, "world sizes to measure (1 = unsharded)")->delimiter(',');
  app.add_option("--json", json_path, "write the results as JSON");
  CLI11_PARSE(app, argc, argv);
  torch::set_num_threads(1);

  std::vector<Row> rows;
  for (int w : worlds) rows.push_back(measure(w, mo));
  std::printf("fsdp_bench: GPT %lld layers, d_model %lld (params+grads per rank, MiB)\n",
              static_cast<long long>(mo.n_layers), static_cast<long long>(mo.d_model));
  std::printf("  %5s %10s %10s %10s %12s %14s %14s %10s\n", "world", "model", "shard",
              "largest", "peak gather", "per-rank peak", "unsharded", "ratio");
  nlohmann::json out = nlohmann::json::array();
  for (const Row& r : rows) {
    double ratio = r.per_rank_peak_mib / r.unsharded_mib;
    std::printf("  %5d %10.2f %10.2f %10.2f %12.2f %14.2f %14.2f %10.3f\n", r.world, r.full_mib,
                r.sharded_mib, r.largest_unit_mib, r.peak_gathered_mib, r.per_rank_peak_mib,
                r.unsharded_mib, ratio);
    out.push_back({{"world", r.world}, {"model_param_mib", r.full_mib}, {"sharded_param_mib", r.sharded_mib},
                   {"largest_unit_mib", r.largest_unit_mib}, {"peak_gathered_mib", r.peak_gathered_mib},
                   {"per_rank_peak_params_grads_mib", r.per_rank_peak_mib},
                   {"unsharded_params_grads_mib", r.unsharded_mib}, {"ratio_to_unsharded", ratio}});
  }
  std::printf("  per-rank peak = 2 x shard + peak gathered (root + in-flight unit params and grads)\n");
  if (!json_path.empty()) std::ofstream(json_path) << out.dump(2) << "\n";
  return 0;
}
