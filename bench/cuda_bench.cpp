#include "cuda_bench.h"
#include "bench/bench_util.h"

#include "checkpoint/load.h"
#include "checkpoint/async/manager.h"
#include "comm/device.h"
#include "comm/launch_env.h"
#include "comm/runtime.h"

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <thread>

namespace bench {
namespace {

namespace fs = std::filesystem;

// The upper median (this benchmark's reports have always used it; bench::median
// averages the middle two); 0 for none.
double upper_median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

checkpoint::StateDict make_state_dict(const std::vector<torch::Tensor>& state) {
  checkpoint::StateDict sd;
  for (size_t i = 0; i < state.size(); ++i) sd.add_tensor("w" + std::to_string(i), state[i]);
  return sd;
}

// `n` bytes from `data` written to `file` in 8 MiB pieces by `threads`
// threads at their offsets, then fsync; direct: O_DIRECT (data and pieces
// are page-aligned). "" or what failed.
std::string raw_parallel_write(const std::string& file, const uint8_t* data, uint64_t n, int threads,
                               bool direct) {
  constexpr uint64_t kPiece = 8u << 20;
  const int fd = ::open(file.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | (direct ? O_DIRECT : 0), 0644);
  if (fd < 0) return std::string("open: ") + std::strerror(errno);
  std::atomic<int> errors{0};
  std::vector<std::thread> writers;
  const uint64_t pieces = (n + kPiece - 1) / kPiece;
  for (int w = 0; w < threads; ++w) {
    writers.emplace_back([&, w] {
      for (uint64_t i = static_cast<uint64_t>(w); i < pieces; i += static_cast<uint64_t>(threads)) {
        const uint64_t len = std::min(kPiece, n - i * kPiece);
        if (::pwrite(fd, data + i * kPiece, len, static_cast<off_t>(i * kPiece)) != static_cast<ssize_t>(len)) errors++;
      }
    });
  }
  for (auto& w : writers) w.join();
  const bool synced = ::fsync(fd) == 0;
  ::close(fd);
  if (errors > 0 || !synced) return "write or fsync failed";
  return "";
}

// One process that serves its own rendezvous store on a free port.
std::unique_ptr<comm::Runtime> single_process_runtime() {
  comm::LaunchEnv env;
  env.job_id = comm::new_job_id();
  auto store = comm::host_tcp_store(env.master_addr, 0, env.job_id);
  env.master_port = store->port();
  env.store_hosted = true;
  comm::DistOptions dopt;
  dopt.timeout_s = 600;
  return comm::init_runtime(env, dopt, comm::DeviceKind::kCuda);
}

// fp32 tensors of tensor_mb (the last one takes the rest), like a model's
// parameters and moments.
int64_t state_elements(const CudaBenchArgs& args) { return static_cast<int64_t>(args.size_mb * 1048576.0) / 4; }

std::vector<torch::Tensor> make_gpu_state(const CudaBenchArgs& args, const torch::Device& device) {
  const int64_t total = state_elements(args);
  const int64_t per = std::max<int64_t>(1, args.tensor_mb * 1048576 / 4);
  std::vector<torch::Tensor> state;
  torch::manual_seed(1);
  for (int64_t left = total; left > 0; left -= per) {
    state.push_back(torch::randn({std::min(per, left)}, torch::TensorOptions().device(device)));
  }
  comm::synchronize(device);
  return state;
}

// Every tensor of `state` copied into `slab`, back to back.
void copy_into(comm::HostSlab& slab, const std::vector<torch::Tensor>& state, bool non_blocking) {
  size_t off = 0;
  for (const auto& s : state) {
    slab.view(off, s.sizes(), s.scalar_type()).copy_(s, non_blocking);
    off += s.numel() * 4;
  }
}

// What one run shares: the GPU state, the runtime and the results.
struct CudaRun {
  const CudaBenchArgs& args;
  comm::Runtime& rt;
  torch::Device device;
  std::string root;
  std::vector<torch::Tensor> state;
  uint64_t bytes = 0;
  nlohmann::json out;

  CudaRun(const CudaBenchArgs& a, comm::Runtime& r, std::string scratch)
      : args(a), rt(r), device(r.device), root(std::move(scratch)) {}

  checkpoint::CheckpointOptions options(checkpoint::SaveMode mode, const std::string& sub) const {
    return manager_options(mode, root + "/" + sub, args.io_threads);
  }
};

// 1. The bare copy of the same bytes into preallocated pinned host memory.
void time_bare_pinned_copy(CudaRun& r) {
  comm::HostSlab slab(r.bytes, /*pinned=*/true);
  std::vector<double> times;
  for (int t = 0; t <= r.args.trials; ++t) {
    auto t0 = Clock::now();
    copy_into(slab, r.state, /*non_blocking=*/true);
    comm::synchronize(r.device);
    if (t > 0) times.push_back(seconds_since(t0));  // the first run warms up
  }
  r.out["bare_pinned_copy_s"] = upper_median(times);
}

// 2. Async: reserve (as the trainer does when checkpointing is configured),
// then saves; the loop waits only for the copy.
void time_async_saves(CudaRun& r) {
  const checkpoint::CheckpointOptions co = r.options(checkpoint::SaveMode::kAsync, "async");
  checkpoint::CheckpointManager m(co, co.dir, *r.rt.checkpoint, "single");
  auto t0 = Clock::now();
  m.reserve_staging(make_state_dict(r.state));
  r.out["reserve_pinned_s"] = seconds_since(t0);
  r.out["staging_bytes"] = m.staging_bytes();
  r.out["staging_pinned"] = m.staging_pinned();
  std::vector<double> blocking, total_s;
  for (int t = 0; t < r.args.trials; ++t) {
    auto s0 = Clock::now();
    m.save(t + 1, make_state_dict(r.state));
    double b = seconds_since(s0);
    if (t == 0) r.out["async_first_blocking_s"] = b;
    blocking.push_back(b);
    for (auto& x : r.state) x.add_(1e-3f);  // the optimizer step may run now
    m.finish();
    total_s.push_back(seconds_since(s0));
  }
  r.out["async_blocking_s"] = upper_median(blocking);
  r.out["async_save_total_s"] = upper_median(total_s);
  for (const auto& ev : m.take_events()) r.out["async_stage_s_last"] = ev.stage_s;
}

// 3. Overlap: save() snapshots the state on the device when it fits
// (checkpoint.device_snapshot auto) and the writer thread copies it to the
// host in chunks; without a snapshot wait_staged() waits for the last chunk.
// overlap_staging says which ran.
void time_overlap_saves(CudaRun& r) {
  const checkpoint::CheckpointOptions co = r.options(checkpoint::SaveMode::kOverlap, "overlap");
  checkpoint::CheckpointManager m(co, co.dir, *r.rt.checkpoint, "single");
  m.reserve_staging(make_state_dict(r.state));
  std::vector<double> blocking, stage_s;
  for (int t = 0; t < r.args.trials; ++t) {
    auto s0 = Clock::now();
    m.save(t + 1, make_state_dict(r.state));
    double b = seconds_since(s0);
    // ... the next forward and backward would run here ...
    auto w0 = Clock::now();
    m.wait_staged();
    b += seconds_since(w0);
    for (auto& x : r.state) x.add_(1e-3f);  // queued behind the copies
    blocking.push_back(b);
    m.finish();
    for (const auto& ev : m.take_events()) {
      stage_s.push_back(ev.stage_s);
      r.out["overlap_staging"] = ev.staging;
    }
  }
  r.out["overlap_blocking_s"] = upper_median(blocking);
  r.out["overlap_stage_s"] = upper_median(stage_s);
}

// The disk's own speed for the state's bytes from a pinned buffer, through
// the page cache and with O_DIRECT: one sample of each into `cached` and
// `direct`, or the error in out["raw_write_errors"].
void time_raw_writes(CudaRun& r, const comm::HostSlab& slab, std::vector<double>& cached,
                     std::vector<double>& direct_times) {
  for (const bool direct : {false, true}) {
    const std::string file = r.root + (direct ? "/raw.direct" : "/raw.cached");
    auto r0 = Clock::now();
    const std::string err = raw_parallel_write(file, static_cast<const uint8_t*>(slab.data()), r.bytes,
                                               r.args.io_threads, direct);
    if (!err.empty()) {
      r.out["raw_write_errors"][direct ? "direct" : "cached"] = err;
    } else {
      (direct ? direct_times : cached).push_back(seconds_since(r0));
    }
    fs::remove(file);
  }
}

// 4. Sync save (copy, write, fsync, commit), with the default storage
// (checkpoint.direct_io auto) and with checkpoint.direct_io true, trials
// interleaved; next to them
// the disk's own speed for the same bytes from a pinned buffer: parallel
// pwrite + fsync through the page cache, and O_DIRECT + fsync. Returns the
// default run's last checkpoint.
std::string time_sync_saves(CudaRun& r) {
  const checkpoint::CheckpointOptions co = r.options(checkpoint::SaveMode::kSync, "sync");
  checkpoint::CheckpointManager m(co, co.dir, *r.rt.checkpoint, "single");
  m.reserve_staging(make_state_dict(r.state));
  checkpoint::PosixOptions po;
  po.direct_io = checkpoint::DirectIo::kOn;
  const checkpoint::CheckpointOptions cod = r.options(checkpoint::SaveMode::kSync, "sync_direct");
  checkpoint::CheckpointManager md(cod, cod.dir, *r.rt.checkpoint, "single", checkpoint::posix_storage(po));
  md.reserve_staging(make_state_dict(r.state));
  std::vector<double> times, direct_times, raw, raw_direct;
  comm::HostSlab slab(r.bytes, /*pinned=*/true);
  copy_into(slab, r.state, /*non_blocking=*/false);
  for (int t = 0; t < r.args.trials; ++t) {
    // finish() (untimed) waits for the background retention, so that
    // deleting the previous step does not overlap the next measurement.
    auto s0 = Clock::now();
    m.save(t + 1, make_state_dict(r.state));
    times.push_back(seconds_since(s0));
    m.finish();
    s0 = Clock::now();
    md.save(t + 1, make_state_dict(r.state));
    direct_times.push_back(seconds_since(s0));
    md.finish();
    time_raw_writes(r, slab, raw, raw_direct);
  }
  r.out["sync_save_s"] = upper_median(times);
  r.out["sync_save_direct_s"] = upper_median(direct_times);
  if (!raw.empty()) r.out["raw_write_parallel_s"] = upper_median(raw);
  if (!raw_direct.empty()) r.out["raw_write_direct_s"] = upper_median(raw_direct);
  m.finish();
  md.finish();
  fs::remove_all(r.root + "/sync_direct");
  return r.root + "/sync/step_" + std::to_string(r.args.trials);
}

// 5. Load to the GPU from `sync_dir`, checked bit-exact against the state.
void time_load_to_gpu(CudaRun& r, const std::string& sync_dir) {
  std::vector<torch::Tensor> target;
  for (const auto& s : r.state) target.push_back(torch::zeros_like(s));
  const checkpoint::CheckpointOptions co = r.options(checkpoint::SaveMode::kSync, "sync");
  checkpoint::CheckpointManager m(co, co.dir, *r.rt.checkpoint, "single");
  m.reserve_staging(make_state_dict(target));
  std::vector<double> times;
  for (int t = 0; t < r.args.trials; ++t) {
    checkpoint::StateDict sd = make_state_dict(target);
    auto s0 = Clock::now();
    m.load(sd, sync_dir);
    comm::synchronize(r.device);
    times.push_back(seconds_since(s0));
  }
  r.out["load_to_gpu_s"] = upper_median(times);
  bool same = true;
  for (size_t i = 0; i < r.state.size(); ++i) same = same && torch::equal(r.state[i], target[i]);
  r.out["load_exact"] = same;
}

// The measurements over the bare copy.
void add_ratios(nlohmann::json& out, uint64_t bytes) {
  const double bare = out["bare_pinned_copy_s"].get<double>();
  const double async_b = out["async_blocking_s"].get<double>();
  out["async_blocking_over_bare"] = async_b / bare;
  out["async_first_blocking_over_bare"] = out["async_first_blocking_s"].get<double>() / bare;
  out["staging_bandwidth_fraction_of_bare"] = bare / async_b;
  out["staging_bytes_over_state"] = static_cast<double>(out["staging_bytes"].get<uint64_t>()) / bytes;
}

void print_table(CudaRun& r) {
  nlohmann::json& out = r.out;
  std::printf("ckpt_bench --device cuda: %.2f GiB fp32 in %zu tensors on %s (median of %d)\n",
              r.bytes / 1073741824.0, r.state.size(), r.device.str().c_str(), r.args.trials);
  auto row = [&](const char* what, const char* key) {
    std::printf("  %-44s %10.4f s\n", what, out[key].get<double>());
  };
  row("bare copy into pinned host memory", "bare_pinned_copy_s");
  row("reserve pinned staging (once, at set-up)", "reserve_pinned_s");
  row("async save: first blocking", "async_first_blocking_s");
  row("async save: blocking", "async_blocking_s");
  row("async save: until committed", "async_save_total_s");
  row("overlap save: blocking (save + wait_staged)", "overlap_blocking_s");
  row("overlap save: staging done after", "overlap_stage_s");
  row("sync save", "sync_save_s");
  row("sync save, checkpoint.direct_io true", "sync_save_direct_s");
  if (out.contains("raw_write_parallel_s")) row("raw parallel pwrite + fsync (page cache)", "raw_write_parallel_s");
  if (out.contains("raw_write_direct_s")) row("raw parallel pwrite + fsync (O_DIRECT)", "raw_write_direct_s");
  row("load to GPU (through pinned buffers)", "load_to_gpu_s");
  std::printf("  async blocking / bare copy %.2f; staging bandwidth %.0f%% of bare; pinned %.3fx state; load exact: %s\n",
              out["async_blocking_over_bare"].get<double>(),
              100 * out["staging_bandwidth_fraction_of_bare"].get<double>(),
              out["staging_bytes_over_state"].get<double>(), out["load_exact"].get<bool>() ? "yes" : "NO");
}

}  // namespace

int run_cuda_bench(const CudaBenchArgs& args) {
  if (!comm::cuda_available()) {
    std::cerr << "ckpt_bench: --device cuda needs a CUDA build and a GPU (none here)" << std::endl;
    return 2;
  }
  auto rt = single_process_runtime();
  CudaRun r(args, *rt, args.dir.empty() ? (fs::temp_directory_path() / "shardkit_cuda_bench").string() : args.dir);
  fs::remove_all(r.root);
  fs::create_directories(r.root);
  r.state = make_gpu_state(args, r.device);
  r.bytes = static_cast<uint64_t>(state_elements(args)) * 4;
  r.out["device"] = r.device.str();
  r.out["state_bytes"] = r.bytes;
  r.out["tensors"] = r.state.size();
  r.out["trials"] = args.trials;

  time_bare_pinned_copy(r);
  time_async_saves(r);
  time_overlap_saves(r);
  const std::string sync_dir = time_sync_saves(r);
  time_load_to_gpu(r, sync_dir);
  add_ratios(r.out, r.bytes);

  print_table(r);
  std::cout << r.out.dump() << std::endl;
  if (!args.json_path.empty()) std::ofstream(args.json_path) << r.out.dump(2) << "\n";
  if (!args.keep) fs::remove_all(r.root);
  return r.out["load_exact"].get<bool>() ? 0 : 1;
}

}  // namespace bench
