// many_ranks: the checkpoint protocol as N real processes (Gloo on
// loopback), for issue "Scale": the coordinator-only planning, the plan cache
// and partial metadata reads with many more ranks than the thread-based tests
// use. Run by tests/checkpoint/many_ranks.sh (CTest ManyRanks.*):
//
//   many_ranks --nproc 64 --dir D   D holds no checkpoint: every rank saves a
//                                   small FSDP-style state to D/step_1, then
//                                   again to D/step_2 with the cached plan
//   many_ranks --nproc 48 --dir D   D holds step_2: every rank loads its shards
//                                   of the 48-rank layout (resharded), checks
//                                   every value and that its metadata reads
//                                   stayed a small part of the file
//
// Each phase ends with one line from rank 0, "many_ranks: OK ...", or fails
// naming the rank and what was wrong.
#include "checkpoint/shardkit_checkpoint.h"
#include "checkpoint/format/metadata.h"
#include "comm/launch_env.h"
#include "comm/runtime.h"
#include "comm/self_launch.h"

#include <torch/torch.h>

#include <chrono>
#include <functional>
#include <numeric>
#include <filesystem>
#include <iostream>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace ck = checkpoint;
namespace fd = comm;

namespace {

struct Spec {
  std::string name;
  std::vector<int64_t> shape;
  bool sharded;  // Shard(0) over all ranks; else every rank holds it whole
};

// Rows fewer than the ranks (empty shards), uneven splits, a replicated
// tensor big enough to be split across its holders, 1-D items, and a stack
// of small sharded layers (so that one rank's part of the metadata is small).
const std::vector<Spec>& specs() {
  static const std::vector<Spec> s = [] {
    std::vector<Spec> v = {
        {"model.embed.weight", {1000, 8}, true},  {"model.block.w1", {333, 5}, true},
        {"model.block.w2", {64, 64}, true},       {"model.norm.weight", {64}, true},
        {"model.tiny", {7, 3}, true},             {"optim.block.w1.exp_avg", {333, 5}, true},
        {"model.rope.freqs", {70000, 4}, false},  {"model.scale", {16}, false},
    };
    for (int i = 0; i < 32; ++i) v.push_back({"model.layers." + std::to_string(i) + ".w", {100 + i, 4}, true});
    return v;
  }();
  return s;
}

// Every element's value: distinct per item and index, exact in float.
torch::Tensor full_values(size_t item, const std::vector<int64_t>& shape) {
  const int64_t n = std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<>());
  return (torch::arange(n, torch::kFloat32).remainder(4096) + 8192.0f * static_cast<float>(item))
      .reshape(shape);
}

// This rank's state of `world`: torch.chunk-style dim-0 shards, or whole.
ck::StateDict make_state(int rank, int world, bool zeros) {
  ck::StateDict state;
  for (size_t i = 0; i < specs().size(); ++i) {
    const Spec& s = specs()[i];
    torch::Tensor full = full_values(i, s.shape);
    int64_t lo = 0, n = s.shape[0];
    if (s.sharded) {
      const int64_t chunk = (s.shape[0] + world - 1) / world;
      lo = std::min<int64_t>(rank * chunk, s.shape[0]);
      n = std::min<int64_t>(lo + chunk, s.shape[0]) - lo;
    }
    torch::Tensor local = full.narrow(0, lo, n).clone();
    if (zeros) local.zero_();
    std::vector<int64_t> offsets(s.shape.size(), 0);
    offsets[0] = lo;
    state.add_tensor(s.name, local, s.shape, offsets);
  }
  const std::string train_state = zeros ? "" : "{\"step\": 2}";
  state.add_bytes("train_state", std::vector<uint8_t>(train_state.begin(), train_state.end()));
  return state;
}

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

// Every rank's failure text (empty: fine), gathered: "" when all are fine,
// else each failed rank and its text.
std::string failures(fd::Group& group, const std::string& mine) {
  std::vector<fd::Bytes> all = group.all_gather_bytes(fd::Bytes(mine.begin(), mine.end()));
  std::string out;
  for (size_t r = 0; r < all.size(); ++r) {
    if (!all[r].empty()) out += "rank " + std::to_string(r) + ": " + std::string(all[r].begin(), all[r].end());
  }
  return out;
}

// Rank 0 reports what failed, once; every rank exits 1.
int failed(fd::Group& group, const std::string& what) {
  if (group.rank() == 0) std::cerr << "many_ranks: FAILED: " << what << std::endl;
  return 1;
}

int save_phase(fd::Group& group, const std::string& dir) {
  const int rank = group.rank(), world = group.size();
  ck::StateDict state = make_state(rank, world, false);
  ck::SaveOptions so;
  so.step = 1;
  so.layout = "fsdp " + std::to_string(world);
  so.io_threads = 1;
  so.plan_cache = std::make_shared<ck::SavePlanCache>();
  auto t = std::chrono::steady_clock::now();
  const ck::SaveStats first = ck::save_state_dict(state, dir + "/step_1", group, so);
  const double first_s = seconds_since(t);
  so.step = 2;
  t = std::chrono::steady_clock::now();
  const ck::SaveStats second = ck::save_state_dict(state, dir + "/step_2", group, so);
  const double second_s = seconds_since(t);
  std::string problem;
  if (first.plan_cached) problem += "the first save claims a cached plan; ";
  if (!second.plan_cached) problem += "the second save did not use the cached plan; ";
  if (const std::string all = failures(group, problem); !all.empty()) return failed(group, all);
  if (rank == 0) {
    std::cout << "many_ranks: OK saved at world " << world << ": first save " << first_s
              << " s (planning " << first.plan_s << " s), second save " << second_s
              << " s (cached plan " << second.plan_s << " s)" << std::endl;
  }
  return 0;
}

int load_phase(fd::Group& group, const std::string& dir) {
  const int rank = group.rank(), world = group.size();
  ck::StateDict state = make_state(rank, world, true);
  const ck::StateDict want = make_state(rank, world, false);
  auto t = std::chrono::steady_clock::now();
  const ck::LoadStats stats = ck::load_state_dict(state, dir + "/step_2", {});
  const double load_s = seconds_since(t);
  std::ostringstream problem;
  for (size_t i = 0; i < state.tensors().size(); ++i) {
    if (!torch::equal(state.tensors()[i].local, want.tensors()[i].local)) {
      problem << "item '" << state.tensors()[i].name << "' differs; ";
    }
  }
  if (state.bytes()[0].data != want.bytes()[0].data) problem << "train_state differs; ";
  const uint64_t file = std::filesystem::file_size(dir + "/step_2/.metadata");
  // A rank's records are a small part of a metadata file that many ranks wrote.
  if (stats.saved_world_size >= 16 && stats.metadata_bytes_read * 4 > file) {
    problem << "read " << stats.metadata_bytes_read << " of " << file << " metadata bytes; ";
  }
  if (const std::string all = failures(group, problem.str()); !all.empty()) return failed(group, all);
  if (rank == 0) {
    std::cout << "many_ranks: OK loaded at world " << world << " what world " << stats.saved_world_size
              << " saved (" << stats.saved_layout << "), every value checked; load " << load_s
              << " s, metadata read " << stats.metadata_bytes_read << " of " << file << " bytes"
              << std::endl;
  }
  return 0;
}

int run_rank(const std::string& dir) {
  const fd::LaunchEnv env = fd::detect_launch_env(fd::process_env());
  fd::DistOptions dist;
  dist.timeout_s = 300;  // 64 processes on 2 cores: slow, never stuck
  const std::unique_ptr<fd::Runtime> runtime = fd::init_runtime(env, dist, fd::DeviceKind::kCpu);
  fd::Group& group = *runtime->checkpoint;
  torch::set_num_threads(1);
  const bool saved = std::filesystem::exists(dir + "/step_2/.metadata");
  group.barrier();  // every rank looked before anyone writes
  return saved ? load_phase(group, dir) : save_phase(group, dir);
}

}  // namespace

int main(int argc, char** argv) {
  return fd::self_launching_main(argc, argv, "many_ranks", run_rank, /*default_nproc=*/4);
}
