#include "cuda_bench.h"

#include "checkpoint/load.h"
#include "checkpoint/async/manager.h"
#include "dist/device.h"
#include "dist/launch_env.h"
#include "dist/runtime.h"

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
namespace dist = framework::dist;
using Clock = std::chrono::steady_clock;

double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

double median(std::vector<double> v) {
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

}  // namespace

int run_cuda_bench(const CudaBenchArgs& args) {
  if (!dist::cuda_available()) {
    std::cerr << "ckpt_bench: --device cuda needs a CUDA build and a GPU (none here)" << std::endl;
    return 2;
  }
  // One process that serves its own rendezvous store on a free port.
  dist::LaunchEnv env;
  env.job_id = dist::new_job_id();
  auto store = dist::host_tcp_store(env.master_addr, 0, env.job_id);
  env.master_port = store->port();
  env.store_hosted = true;
  dist::DistOptions dopt;
  dopt.timeout_s = 600;
  auto rt = dist::init_runtime(env, dopt, "cuda");
  const torch::Device device = rt->device;
  const std::string root = args.dir.empty() ? (fs::temp_directory_path() / "shardkit_cuda_bench").string()
                                            : args.dir;
  fs::remove_all(root);
  fs::create_directories(root);

  // fp32 tensors of tensor_mb, like a model's parameters and moments.
  const int64_t total = static_cast<int64_t>(args.size_mb * 1048576.0) / 4;
  const int64_t per = std::max<int64_t>(1, args.tensor_mb * 1048576 / 4);
  std::vector<torch::Tensor> state;
  torch::manual_seed(1);
  for (int64_t left = total; left > 0; left -= per) {
    state.push_back(torch::randn({std::min(per, left)}, torch::TensorOptions().device(device)));
  }
  dist::synchronize(device);
  const uint64_t bytes = static_cast<uint64_t>(total) * 4;
  nlohmann::json out;
  out["device"] = device.str();
  out["state_bytes"] = bytes;
  out["tensors"] = state.size();
  out["trials"] = args.trials;

  // 1. The bare copy of the same bytes into preallocated pinned host memory.
  {
    dist::HostSlab slab(bytes, /*pinned=*/true);
    std::vector<double> times;
    for (int t = 0; t <= args.trials; ++t) {
      auto t0 = Clock::now();
      size_t off = 0;
      for (const auto& s : state) {
        torch::Tensor dst = slab.view(off, s.sizes(), s.scalar_type());
        dst.copy_(s, /*non_blocking=*/true);
        off += s.numel() * 4;
      }
      dist::synchronize(device);
      if (t > 0) times.push_back(since(t0));  // the first run warms up
    }
    out["bare_pinned_copy_s"] = median(times);
  }

  checkpoint::CheckpointOptions co;
  co.interval = 1;
  co.keep_last = 1;
  co.resume = "never";
  co.io_threads = args.io_threads;

  // 2. Async: reserve (as the trainer does when checkpointing is configured),
  // then saves; the loop waits only for the copy.
  {
    co.mode = "async";
    co.dir = root + "/async";
    checkpoint::CheckpointManager m(co, co.dir, *rt->checkpoint, "single");
    auto t0 = Clock::now();
    m.reserve_staging(make_state_dict(state));
    out["reserve_pinned_s"] = since(t0);
    out["staging_bytes"] = m.staging_bytes();
    out["staging_pinned"] = m.staging_pinned();
    std::vector<double> blocking, total_s;
    for (int t = 0; t < args.trials; ++t) {
      auto s0 = Clock::now();
      m.save(t + 1, make_state_dict(state));
      double b = since(s0);
      if (t == 0) out["async_first_blocking_s"] = b;
      blocking.push_back(b);
      for (auto& x : state) x.add_(1e-3f);  // the optimizer step may run now
      m.finish();
      total_s.push_back(since(s0));
    }
    out["async_blocking_s"] = median(blocking);
    out["async_save_total_s"] = median(total_s);
    for (const auto& ev : m.take_events()) out["async_stage_s_last"] = ev.stage_s;
  }

  // 3. Overlap: save() enqueues the copies; the next optimizer step waits for
  // them on the device (wait_staged), without a host sync.
  {
    co.mode = "overlap";
    co.dir = root + "/overlap";
    checkpoint::CheckpointManager m(co, co.dir, *rt->checkpoint, "single");
    m.reserve_staging(make_state_dict(state));
    std::vector<double> blocking, stage_s;
    for (int t = 0; t < args.trials; ++t) {
      auto s0 = Clock::now();
      m.save(t + 1, make_state_dict(state));
      double b = since(s0);
      // ... the next forward and backward would run here ...
      auto w0 = Clock::now();
      m.wait_staged();
      b += since(w0);
      for (auto& x : state) x.add_(1e-3f);  // queued behind the copies
      blocking.push_back(b);
      m.finish();
      for (const auto& ev : m.take_events()) stage_s.push_back(ev.stage_s);
    }
    out["overlap_blocking_s"] = median(blocking);
    out["overlap_stage_s"] = median(stage_s);
  }

  // 4. Sync save (copy, write, fsync, commit), through the page cache (the
  // default) and with checkpoint.direct_io, trials interleaved; next to them
  // the disk's own speed for the same bytes from a pinned buffer: parallel
  // pwrite + fsync through the page cache, and O_DIRECT + fsync. Then 5.
  // load to the GPU (from the page-cache run's last checkpoint).
  std::string sync_dir;
  {
    co.mode = "sync";
    checkpoint::PosixOptions po;
    po.direct_io = true;
    co.dir = root + "/sync";
    checkpoint::CheckpointManager m(co, co.dir, *rt->checkpoint, "single");
    m.reserve_staging(make_state_dict(state));
    co.dir = root + "/sync_direct";
    checkpoint::CheckpointManager md(co, co.dir, *rt->checkpoint, "single", checkpoint::posix_storage(po));
    md.reserve_staging(make_state_dict(state));
    std::vector<double> times, direct_times, raw, raw_direct;
    dist::HostSlab slab(bytes, /*pinned=*/true);
    {
      size_t off = 0;
      for (const auto& s : state) {
        slab.view(off, s.sizes(), s.scalar_type()).copy_(s);
        off += s.numel() * 4;
      }
    }
    for (int t = 0; t < args.trials; ++t) {
      // finish() (untimed) waits for the background retention, so that
      // deleting the previous step does not overlap the next measurement.
      auto s0 = Clock::now();
      m.save(t + 1, make_state_dict(state));
      times.push_back(since(s0));
      m.finish();
      s0 = Clock::now();
      md.save(t + 1, make_state_dict(state));
      direct_times.push_back(since(s0));
      md.finish();
      for (const bool direct : {false, true}) {
        const std::string file = root + (direct ? "/raw.direct" : "/raw.cached");
        auto r0 = Clock::now();
        const std::string err = raw_parallel_write(file, static_cast<const uint8_t*>(slab.data()), bytes,
                                                   args.io_threads, direct);
        if (!err.empty()) {
          out["raw_write_errors"][direct ? "direct" : "cached"] = err;
        } else {
          (direct ? raw_direct : raw).push_back(since(r0));
        }
        fs::remove(file);
      }
    }
    out["sync_save_s"] = median(times);
    out["sync_save_direct_s"] = median(direct_times);
    if (!raw.empty()) out["raw_write_parallel_s"] = median(raw);
    if (!raw_direct.empty()) out["raw_write_direct_s"] = median(raw_direct);
    sync_dir = root + "/sync/step_" + std::to_string(args.trials);
    m.finish();
    md.finish();
    fs::remove_all(root + "/sync_direct");
  }
  {
    std::vector<torch::Tensor> target;
    for (const auto& s : state) target.push_back(torch::zeros_like(s));
    co.mode = "sync";
    co.dir = root + "/sync";
    checkpoint::CheckpointManager m(co, co.dir, *rt->checkpoint, "single");
    m.reserve_staging(make_state_dict(target));
    std::vector<double> times;
    for (int t = 0; t < args.trials; ++t) {
      checkpoint::StateDict sd = make_state_dict(target);
      auto s0 = Clock::now();
      m.load(sd, sync_dir);
      dist::synchronize(device);
      times.push_back(since(s0));
    }
    out["load_to_gpu_s"] = median(times);
    bool same = true;
    for (size_t i = 0; i < state.size(); ++i) same = same && torch::equal(state[i], target[i]);
    out["load_exact"] = same;
  }

  const double bare = out["bare_pinned_copy_s"].get<double>();
  const double async_b = out["async_blocking_s"].get<double>();
  out["async_blocking_over_bare"] = async_b / bare;
  out["async_first_blocking_over_bare"] = out["async_first_blocking_s"].get<double>() / bare;
  out["staging_bandwidth_fraction_of_bare"] = bare / async_b;
  out["staging_bytes_over_state"] = static_cast<double>(out["staging_bytes"].get<uint64_t>()) / bytes;

  std::printf("ckpt_bench --device cuda: %.2f GiB fp32 in %zu tensors on %s (median of %d)\n",
              bytes / 1073741824.0, state.size(), device.str().c_str(), args.trials);
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
  row("sync save, checkpoint.direct_io", "sync_save_direct_s");
  if (out.contains("raw_write_parallel_s")) row("raw parallel pwrite + fsync (page cache)", "raw_write_parallel_s");
  if (out.contains("raw_write_direct_s")) row("raw parallel pwrite + fsync (O_DIRECT)", "raw_write_direct_s");
  row("load to GPU (through pinned buffers)", "load_to_gpu_s");
  std::printf("  async blocking / bare copy %.2f; staging bandwidth %.0f%% of bare; pinned %.3fx state; load exact: %s\n",
              out["async_blocking_over_bare"].get<double>(),
              100 * out["staging_bandwidth_fraction_of_bare"].get<double>(),
              out["staging_bytes_over_state"].get<double>(), out["load_exact"].get<bool>() ? "yes" : "NO");
  std::cout << out.dump() << std::endl;
  if (!args.json_path.empty()) std::ofstream(args.json_path) << out.dump(2) << "\n";
  if (!args.keep) fs::remove_all(root);
  return out["load_exact"].get<bool>() ? 0 : 1;
}

}  // namespace bench
