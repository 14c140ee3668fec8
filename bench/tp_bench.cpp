// tp_bench: what tensor parallelism saves per rank, against FSDP alone, on
// a llama, at the same world size and global batch, side by side in one
// run: FSDP 4, TP 2 x FSDP 2 and TP 4 (and world 1 as the whole model).
// Per rank, measured after one real training step (forward, backward,
// reduce-scatter, AdamW):
//   - params: the local shards the optimizer updates (fp32);
//   - grads: their gradients;
//   - optimizer: AdamW's exp_avg and exp_avg_sq;
//   - peak gathered: FSDP's peak of whole parameters and gradients in
//     flight (memory_stats);
//   - activations: the bytes the forward keeps for backward: the CPU
//     allocator's live bytes after every rank's forward less those before
//     it, over the ranks (ranks are threads of this process, with real Gloo
//     groups), less the root unit FSDP keeps gathered for the backward; and
//     per sample of the rank's batch.
// Prints a table and, with --json FILE, one JSON array.
//   build/tp_bench [--d-model 512 --layers 4 --vocab 16384 --seq-len 256 --batch 8] [--json F]
#include "comm/launch_env.h"
#include "comm/runtime.h"
#include "framework/dtensor/chunk.h"
#include "framework/dtensor/device_mesh.h"
#include "framework/fsdp/fully_shard.h"
#include "framework/optim/sharded_adamw.h"
#include "framework/tp/tensor_parallel.h"
#include "models/layered_model.h"
#include "support/counting_allocator.h"

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <atomic>
#include <cstdio>
#include <fstream>
#include <mutex>
#include <thread>

namespace {

struct Layout {
  std::string name;
  int world;
  int64_t shard, tensor;
};

struct Row {
  std::string layout;
  int world = 0;
  double params_mib = 0, grads_mib = 0, optimizer_mib = 0, gathered_mib = 0;
  double activations_mib = 0, samples = 0;
  double total() const { return params_mib + grads_mib + optimizer_mib + gathered_mib + activations_mib; }
};

double mib(double bytes) { return bytes / 1048576.0; }

int64_t bytes_of(const torch::Tensor& t) {
  return t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0;
}


// What the rank threads of one layout share.
struct Shared {
  std::mutex mu;  // model creation (torch::manual_seed is global) and `row`
  std::atomic<int64_t> before{0}, after{0}, root_bytes{0};
  Row row;
};

// Rank `r` of `world` threads on the store at `port`.
std::unique_ptr<comm::Runtime> thread_rank_runtime(int r, int world, int port, const std::string& job_id) {
  comm::LaunchEnv env;
  env.rank = r;
  env.world_size = world;
  env.master_port = port;
  env.store_hosted = true;
  env.job_id = job_id;
  return comm::init_runtime(env, comm::DistOptions{}, comm::DeviceKind::kCpu);
}

// {replicate 1, shard dp, tensor tp}, or {replicate 1, shard dp} without TP.
std::shared_ptr<framework::dtensor::DeviceMesh> make_mesh(comm::Runtime& rt, const Layout& l) {
  const int64_t dp = l.world / l.tensor;
  if (l.tensor > 1) {
    return framework::dtensor::DeviceMesh::create(*rt.rendezvous, {1, dp, l.tensor},
                                                  {"replicate", "shard", "tensor"});
  }
  return framework::dtensor::DeviceMesh::create(*rt.rendezvous, {1, dp}, {"replicate", "shard"});
}

// The llama, tensor-parallel over mesh dim 2 when the layout has TP, then
// fully sharded over the mesh.
std::unique_ptr<framework::fsdp::FullyShardedModel> shard_model(
    const std::shared_ptr<models::LayeredModelImpl>& model,
    const std::shared_ptr<framework::dtensor::DeviceMesh>& mesh, const Layout& l) {
  framework::fsdp::FsdpOptions po;
  framework::fsdp::ParamInit init = [model](const std::string& name, const torch::Tensor& full) {
    model->init_parameter(name, full);
  };
  if (l.tensor > 1) {
    framework::tp::TensorParallelLayout layout =
        framework::tp::parallelize_module(
            *model, mesh, 2, framework::tp::restrict_plan(*model, framework::tp::llama_plan()));
    po.tensor_parallel = layout.params;
    init = framework::tp::sharded_init(layout, init);
  }
  return std::make_unique<framework::fsdp::FullyShardedModel>(model, mesh, po, model->unit_names(), init);
}

// The next-token loss of `tokens`, vocabulary-parallel under TP.
torch::Tensor forward_loss(framework::fsdp::FullyShardedModel& fsdp, models::LayeredModelImpl& model,
                           const torch::Tensor& tokens, const Layout& l, int64_t vocab_size,
                           framework::dtensor::DeviceMesh& mesh) {
  return fsdp.forward([&] {
    torch::Tensor logits = model.forward(tokens).to(torch::kFloat);
    torch::Tensor flat = logits.reshape({-1, logits.size(-1)});
    torch::Tensor targets = tokens.reshape({-1});
    if (l.tensor == 1) return torch::nn::functional::cross_entropy(flat, targets);
    const int64_t offset = framework::dtensor::chunk_span(vocab_size, l.tensor, mesh.coordinate(2)).offset;
    return framework::tp::vocab_parallel_cross_entropy(flat, targets, offset, mesh.group(2), -100).mean();
  });
}

// FSDP keeps the root unit (embedding, final norm, output projection)
// gathered from the forward to the backward: not activations. Its bytes
// (none when nothing is sharded).
int64_t root_unit_bytes(models::LayeredModelImpl& model, int64_t dp) {
  int64_t root = 0;
  if (dp > 1) {
    for (const auto& p : model.named_parameters()) {
      if (p.key().rfind("model.layers.", 0) != 0) root += bytes_of(p.value());
    }
  }
  return root;
}

// This rank's params, grads and AdamW moments after the step, into the row
// (the largest rank: shards and TP parts may be uneven).
void record_rank_memory(Shared& shared, framework::fsdp::FullyShardedModel& fsdp,
                        framework::optim::ShardedAdamW& adamw, int64_t local_batch) {
  int64_t params = 0, grads = 0, optimizer = 0;
  const std::vector<torch::Tensor> locals = fsdp.local_params();
  for (size_t i = 0; i < locals.size(); ++i) {
    params += bytes_of(locals[i]);
    grads += bytes_of(locals[i].grad());
    const framework::optim::AdamWParamState st = adamw.state(i);
    optimizer += bytes_of(st.exp_avg.local()) + bytes_of(st.exp_avg_sq.local());
  }
  std::lock_guard<std::mutex> lock(shared.mu);
  Row& row = shared.row;
  row.params_mib = std::max(row.params_mib, mib(static_cast<double>(params)));
  row.grads_mib = std::max(row.grads_mib, mib(static_cast<double>(grads)));
  row.optimizer_mib = std::max(row.optimizer_mib, mib(static_cast<double>(optimizer)));
  row.gathered_mib = std::max(row.gathered_mib, mib(static_cast<double>(fsdp.memory_stats().peak_gathered_bytes)));
  row.samples = static_cast<double>(local_batch);
}

// Rank r: one training step of its batch, the allocator's live bytes read
// (by rank 0) around every rank's forward, then its memory recorded.
void run_rank(int r, const Layout& l, const models::ModelOptions& mo, int64_t global_batch, int port,
              const std::string& job_id, testing_support::CountingCpuAllocator& alloc, Shared& shared) {
  auto rt = thread_rank_runtime(r, l.world, port, job_id);
  const int64_t dp = l.world / l.tensor;
  std::shared_ptr<framework::dtensor::DeviceMesh> mesh = make_mesh(*rt, l);
  std::shared_ptr<models::LayeredModelImpl> model;
  {
    std::lock_guard<std::mutex> lock(shared.mu);
    torch::manual_seed(1);
    model = models::make_model(mo, /*materialize=*/false);
  }
  auto fsdp = shard_model(model, mesh, l);
  framework::optim::ShardedAdamW adamw(*fsdp, framework::optim::OptimOptions{}, 10);
  const int64_t dp_rank = r / l.tensor;
  const int64_t local_batch = global_batch / dp;
  torch::Tensor tokens = torch::randint(0, mo.vocab_size, {local_batch, mo.seq_len},
                                        at::make_generator<at::CPUGeneratorImpl>(100 + dp_rank));
  fsdp->reset_peak_memory();
  rt->train->barrier();
  if (r == 0) shared.before = alloc.live_bytes();
  rt->train->barrier();
  torch::Tensor loss = forward_loss(*fsdp, *model, tokens, l, mo.vocab_size, *mesh);
  rt->train->barrier();
  if (r == 0) shared.after = alloc.live_bytes();
  rt->train->barrier();
  shared.root_bytes += root_unit_bytes(*model, dp);
  loss.backward();
  fsdp->finish_backward();
  adamw.step(1);
  record_rank_memory(shared, *fsdp, adamw, local_batch);
  framework::tp::clear_hooks(*model);
}

// One layout: its ranks as threads of this process on real Gloo groups.
Row measure(const Layout& l, const models::ModelOptions& mo, int64_t global_batch,
            testing_support::CountingCpuAllocator& alloc) {
  const std::string job_id = comm::new_job_id();
  auto store = comm::host_tcp_store("127.0.0.1", 0, job_id);
  Shared shared;
  shared.row.layout = l.name;
  shared.row.world = l.world;
  std::vector<std::thread> threads;
  for (int r = 0; r < l.world; ++r) {
    threads.emplace_back([&, r] { run_rank(r, l, mo, global_batch, store->port(), job_id, alloc, shared); });
  }
  for (auto& t : threads) t.join();
  Row row = shared.row;
  row.activations_mib =
      mib(static_cast<double>(shared.after.load() - shared.before.load() - shared.root_bytes.load()) / l.world);
  return row;
}

}  // namespace

int main(int argc, char** argv) {
  models::ModelOptions mo;
  mo.kind = "llama";
  mo.tie_weights = false;
  mo.n_layers = 4;
  mo.d_model = 512;
  mo.n_heads = 8;
  mo.n_kv_heads = 4;
  mo.d_ff = 1536;
  mo.vocab_size = 16384;
  mo.seq_len = 256;
  int64_t global_batch = 8;
  std::string json_path;
  CLI::App app{"Tensor parallelism against FSDP: memory per rank of a llama"};
  app.add_option("--layers", mo.n_layers, "transformer blocks");
  app.add_option("--d-model", mo.d_model, "hidden width");
  app.add_option("--d-ff", mo.d_ff, "MLP hidden width");
  app.add_option("--vocab", mo.vocab_size, "vocabulary size");
  app.add_option("--seq-len", mo.seq_len, "sequence length");
  app.add_option("--batch", global_batch, "global batch (sequences), divisible by 4");
  app.add_option("--json", json_path, "write the results as JSON");
  CLI11_PARSE(app, argc, argv);
  torch::set_num_threads(1);
  models::validate_model_options(mo);

  // Never destroyed, as in ac_bench: tensors LibTorch frees after main
  // returns (its static caches) are counted by it and released through it.
  static auto* counter = new testing_support::CountingCpuAllocator();
  testing_support::CountingCpuAllocator& alloc = *counter;
  const std::vector<Layout> layouts = {
      {"whole (world 1)", 1, 1, 1}, {"FSDP 4", 4, 4, 1}, {"TP 2 x FSDP 2", 4, 2, 2}, {"TP 4", 4, 1, 4}};
  std::vector<Row> rows;
  for (const Layout& l : layouts) rows.push_back(measure(l, mo, global_batch, alloc));
  const models::ModelSize size = models::model_size(mo);
  std::printf("tp_bench: llama %lld layers, d_model %lld, d_ff %lld, vocab %lld, seq_len %lld, "
              "%.1f M params, global batch %lld; per rank, MiB\n",
              static_cast<long long>(mo.n_layers), static_cast<long long>(mo.d_model),
              static_cast<long long>(mo.d_ff), static_cast<long long>(mo.vocab_size),
              static_cast<long long>(mo.seq_len), size.parameters / 1e6,
              static_cast<long long>(global_batch));
  std::printf("  %-16s %6s %8s %8s %10s %9s %12s %10s %8s %8s\n", "layout", "world", "params",
              "grads", "optimizer", "gathered", "activations", "act/sample", "total", "vs FSDP4");
  nlohmann::json out = nlohmann::json::array();
  const double fsdp_total = rows[1].total();
  for (const Row& r : rows) {
    const double per_sample = r.activations_mib / std::max(1.0, r.samples);
    std::printf("  %-16s %6d %8.2f %8.2f %10.2f %9.2f %12.2f %10.2f %8.2f %8.3f\n", r.layout.c_str(),
                r.world, r.params_mib, r.grads_mib, r.optimizer_mib, r.gathered_mib,
                r.activations_mib, per_sample, r.total(), r.total() / fsdp_total);
    out.push_back({{"layout", r.layout}, {"world", r.world}, {"params_mib", r.params_mib},
                   {"grads_mib", r.grads_mib}, {"optimizer_mib", r.optimizer_mib},
                   {"peak_gathered_mib", r.gathered_mib}, {"activations_mib", r.activations_mib},
                   {"samples_per_rank", r.samples}, {"activations_per_sample_mib", per_sample},
                   {"total_mib", r.total()}, {"ratio_to_fsdp4", r.total() / fsdp_total}});
  }
  std::printf("  activations: kept by the forward for backward; the ranks of a TP group share a "
              "batch (FSDP 4: 2 samples per rank, TP 2 x FSDP 2: 4, TP 4: 8)\n");
  if (!json_path.empty()) std::ofstream(json_path) << out.dump(2) << "\n";
  return 0;
}
