// ckpt_bench: how fast and how lean the checkpoint system is, next to the
// baselines it has to beat, all measured side by side in one run on the same
// data. Rank 0 prints a table and writes JSON.
//
//   ckpt_bench [--size-mb 1024] [--nproc N] [--dir /tmp/ckpt_bench] [--json F]
//              [--io-threads 4] [--trials 1] [--skip-training]
//              [--skip-compression] [--input weights.safetensors] [--keep]
//              [--nodes N] [--skip-tiers] [--tiers-only]
//
// Call sequence (all ranks): make the synthetic sharded state; memory run of
// the async manager (--growth-saves saves); per trial: memcpy, raw write/read,
// torch::save/load, sync save, load, reshard load, async save, overlap save;
// training-level overhead (Trainer, fresh runtime per run); (rank 0)
// compression study on a one-rank checkpoint group. Times are the maximum
// over ranks; GB/s is all ranks' bytes over that time.
#include "cuda_bench.h"
#include "bench/bench_util.h"
#include "bench/source_dir.h"

#include "checkpoint/layout/checkpoint_dir.h"
#include "checkpoint/storage/paced.h"
#include "checkpoint/storage/posix_counters.h"
#include "checkpoint/load.h"
#include "checkpoint/async/manager.h"
#include "checkpoint/format/metadata.h"
#include "checkpoint/save.h"
#include "checkpoint/state_dict.h"
#include "framework/config/config.h"
#include "comm/cpu_threads.h"
#include "comm/launch_env.h"
#include "comm/local_launcher.h"
#include "comm/runtime.h"
#include "framework/fsdp/fully_shard.h"
#include "framework/train/trainer.h"
#include "models/layered_model.h"

#include <ATen/CPUGeneratorImpl.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <map>
#include <sstream>
#include <thread>

namespace {

namespace fs = std::filesystem;
using bench::Clock;
using bench::seconds_since;

struct Args {
  int64_t size_mb = 1024;
  int nproc = 1;
  std::string dir = "/tmp/ckpt_bench";
  std::string json_path;
  int io_threads = 4;
  bool skip_training = false;
  bool skip_compression = false;
  bool skip_tiers = false;
  bool tiers_only = false;
  int nodes = 1;
  bool compression_only = false;
  int compression_trials = 3;
  double paced_mbps = 250;
  std::string input;
  int trials = 1;
  bool keep = false;
  std::string config_path = std::string(bench::source_dir()) + "/configs/default.yaml";
  int64_t train_steps = 60;
  int64_t compress_train_steps = 200;
  int growth_saves = 20;
  std::string dtype = "fp32";   // of the synthetic state: fp32 | bf16
  bool save_load_only = false;  // the lean section (save_load_section) instead of the main one
};

// ---------------------------------------------------------------------------
// The synthetic training state

enum class ValueKind { kWeight, kExpAvg, kExpAvgSq };

// One global tensor and the rows [row0, row0 + rows) of dim 0 this rank holds.
struct ItemSpec {
  std::string name;
  std::vector<int64_t> global_shape;
  ValueKind kind = ValueKind::kWeight;
  uint64_t seed = 0;
  int64_t row0 = 0;
  int64_t rows = 0;
};

constexpr int64_t kCols = 1024;
constexpr int64_t kRows = 4096;
constexpr int64_t kGenBlockElements = 256 * 1024;  // values drawn per generator seed

int64_t inner_numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (size_t d = 1; d < shape.size(); ++d) n *= shape[d];
  return n;
}

// Rows [r0, r0 + dst.size(0)) of item `s`. Values are drawn in fixed row
// blocks, each from its own seeded generator, so any rank can regenerate any
// rows of any item (to check a resharded load) without the whole tensor.
void fill_rows(torch::Tensor dst, const ItemSpec& s, int64_t r0) {
  const int64_t inner = inner_numel(s.global_shape);
  const int64_t block_rows = std::max<int64_t>(1, kGenBlockElements / inner);
  const int64_t r1 = r0 + dst.size(0);
  for (int64_t b = r0 / block_rows; b * block_rows < r1; ++b) {
    const int64_t b0 = b * block_rows;
    const int64_t b1 = std::min(b0 + block_rows, s.global_shape[0]);
    std::vector<int64_t> shape = s.global_shape;
    shape[0] = b1 - b0;
    auto gen = at::detail::createCPUGenerator(s.seed * 1000003ull + static_cast<uint64_t>(b));
    torch::Tensor tmp = torch::empty(shape, torch::kFloat32);
    switch (s.kind) {
      case ValueKind::kWeight: tmp.normal_(0.0, 0.02, gen); break;
      case ValueKind::kExpAvg: tmp.normal_(0.0, 1e-3, gen); break;
      case ValueKind::kExpAvgSq: tmp.normal_(0.0, 1e-3, gen).square_(); break;
    }
    const int64_t lo = std::max(r0, b0);
    const int64_t hi = std::min(r1, b1);
    dst.narrow(0, lo - r0, hi - lo).copy_(tmp.narrow(0, lo - b0, hi - lo));
  }
}

// Transformer-like layers: a [4096, 1024] weight and a [1024] norm each, with
// their AdamW moments, sized to `total_bytes` over all ranks (the last layer
// has fewer rows). Every item is sharded along dim 0 like FSDP's Shard(0).
std::vector<ItemSpec> make_specs(uint64_t total_bytes, int rank, int world) {
  const uint64_t per_layer = 3 * 4 * static_cast<uint64_t>(kRows * kCols + kCols);
  std::vector<int64_t> layer_rows(total_bytes / per_layer, kRows);
  const uint64_t rest = total_bytes - layer_rows.size() * per_layer;
  int64_t last_rows = static_cast<int64_t>(rest / 12 / kCols) - 1;
  if (layer_rows.empty()) last_rows = std::max<int64_t>(last_rows, world);
  if (last_rows >= world) layer_rows.push_back(last_rows);
  std::vector<ItemSpec> specs;
  uint64_t seed = 1;
  for (size_t l = 0; l < layer_rows.size(); ++l) {
    const std::string base = "layers." + std::to_string(l) + ".";
    for (const auto& [param, shape] :
         std::vector<std::pair<std::string, std::vector<int64_t>>>{
             {base + "weight", {layer_rows[l], kCols}}, {base + "norm", {kCols}}}) {
      for (auto [prefix, suffix, kind] :
           {std::tuple{"model.", "", ValueKind::kWeight},
            std::tuple{"optim.", ".exp_avg", ValueKind::kExpAvg},
            std::tuple{"optim.", ".exp_avg_sq", ValueKind::kExpAvgSq}}) {
        ItemSpec s;
        s.name = std::string(prefix) + param + suffix;
        s.global_shape = shape;
        s.kind = kind;
        s.seed = seed++;
        s.row0 = shape[0] * rank / world;
        s.rows = shape[0] * (rank + 1) / world - s.row0;
        specs.push_back(std::move(s));
      }
    }
  }
  return specs;
}

// --dtype: every item of the synthetic state has this type.
torch::ScalarType g_state_dtype = torch::kFloat32;

// An uninitialised box of `rows` rows of item `s`.
torch::Tensor make_box(const ItemSpec& s, int64_t rows) {
  std::vector<int64_t> shape = s.global_shape;
  shape[0] = rows;
  return torch::empty(shape, g_state_dtype);
}

std::vector<int64_t> box_offsets(const ItemSpec& s, int64_t row0) {
  std::vector<int64_t> off(s.global_shape.size(), 0);
  off[0] = row0;
  return off;
}

// Small replicated items every rank holds identically (like step, RNG, config).
void add_replicated_bytes(checkpoint::StateDict& sd) {
  std::vector<uint8_t> step(8, 0);
  step[0] = 42;
  std::vector<uint8_t> rng(5056);
  for (size_t i = 0; i < rng.size(); ++i) rng[i] = static_cast<uint8_t>(i * 131 + 7);
  std::string cfg = "bench: synthetic training state\n";
  sd.add_bytes("train.step", step);
  sd.add_bytes("rng.cpu", rng);
  sd.add_bytes("config", std::vector<uint8_t>(cfg.begin(), cfg.end()));
}

bool same_bytes(const torch::Tensor& a, const torch::Tensor& b) {
  if (a.sizes() != b.sizes() || a.scalar_type() != b.scalar_type()) return false;
  return std::memcmp(a.data_ptr(), b.data_ptr(), static_cast<size_t>(a.numel()) * a.element_size()) == 0;
}

uint64_t nbytes(const torch::Tensor& t) { return static_cast<uint64_t>(t.numel()) * t.element_size(); }

// ---------------------------------------------------------------------------
// The run

// The compression study's input sets.
struct CompressionSets {
  bench::NamedTensors trained;       // weights + AdamW moments, fp32
  bench::NamedTensors trained_bf16;  // the weights only, as bf16
  bench::NamedTensors init;          // the weights at initialisation
};

struct Bench {
  Args args;
  comm::Runtime& rt;
  int rank = 0;
  int world = 1;
  std::string dir;
  std::vector<ItemSpec> specs;
  checkpoint::StateDict state;
  std::vector<torch::Tensor> locals;
  std::vector<torch::Tensor> targets;  // preallocated destinations, same shapes
  uint64_t state_bytes = 0;            // all ranks
  uint64_t rank_bytes = 0;             // this rank (max over ranks in the report)
  std::map<std::string, std::vector<double>> samples;  // per trial
  nlohmann::json out = nlohmann::json::object();
  std::vector<std::string> notes;
  // Rank 0 serves the stores of fresh_runtime(); they outlive those runtimes.
  std::vector<std::unique_ptr<comm::StoreServer>> fresh_stores;
  int fresh_count = 0;

  Bench(Args a, comm::Runtime& r) : args(std::move(a)), rt(r) {
    rank = rt.env.rank;
    world = rt.env.world_size;
    dir = args.dir;
  }

  comm::Group& bench_group() { return *rt.train; }  // never used by a manager
  void barrier() { bench_group().barrier(); }
  double max_over(double v) { return bench::max_over(bench_group(), v); }
  std::string path(const std::string& sub) const { return (fs::path(dir) / sub).string(); }
  void record(const std::string& key, double local_value) {
    samples[key].push_back(max_over(local_value));
  }
  void fail(const std::string& what) {
    throw std::runtime_error("rank " + std::to_string(rank) + ": " + what);
  }

  void make_state();
  void memory_run(checkpoint::CheckpointManager& mgr);
  void checkpoint_section();
  void trial(int t, checkpoint::CheckpointManager& async_mgr, checkpoint::CheckpointManager& overlap_mgr,
             double compute_s);
  void time_memcpy();
  void time_raw_io();
  void time_raw_parallel_write();
  void time_torch_io();
  void time_sync_save_and_loads(int t);
  void time_sync_save_with(int t, checkpoint::DirectIo direct_io, const char* key, const std::string& sub);
  void save_load_section();
  void record_direct_io_choice();
  checkpoint::SaveOptions sync_save_options(int t) const;
  void time_raw_direct_write(int threads, const char* key);
  void time_reshard_load(const std::string& step_dir);
  void time_async(int t, checkpoint::CheckpointManager& mgr);
  void time_overlap(int t, checkpoint::CheckpointManager& mgr, double compute_s);
  checkpoint::StateDict into_targets();
  void training_overhead();
  std::vector<double> trainer_step_times(const std::string& label, bool overlap_saves, int64_t steps);
  std::unique_ptr<comm::Runtime> fresh_runtime();
  void compression();
  void train_compression_input(int64_t steps, const std::string& ck_dir);
  void read_trained_sets(const std::string& ck_dir, CompressionSets& sets);
  void tiers();
  void report();
  bool main_section() const { return !args.compression_only && !args.tiers_only; }
  nlohmann::json main_ratios();
  double best_raw_write() const;
  void summarize();
  void print_measurements();
  void print_ratios();
  void print_tiers();
  void print_compression_study();
  void write_json();
};

void Bench::make_state() {
  // make_specs sizes fp32 items: twice the elements make the same bytes in bf16.
  const uint64_t fp32_bytes = (static_cast<uint64_t>(args.size_mb) << 20) * (4 / torch::elementSize(g_state_dtype));
  specs = make_specs(fp32_bytes, rank, world);
  for (const auto& s : specs) {
    torch::Tensor t = make_box(s, s.rows);
    fill_rows(t, s, s.row0);
    state.add_tensor(s.name, t, s.global_shape, box_offsets(s, s.row0));
    locals.push_back(t);
    rank_bytes += nbytes(t);
  }
  add_replicated_bytes(state);
  torch::Tensor total = torch::tensor({static_cast<double>(rank_bytes)}, torch::kDouble);
  bench_group().all_reduce(total);
  state_bytes = static_cast<uint64_t>(total.item<double>());
  rank_bytes = static_cast<uint64_t>(max_over(static_cast<double>(rank_bytes)));
}

// Peak host memory of async saves, staging reuse and RSS growth. The first
// save allocates the staging buffers; later ones must reuse them.
void Bench::memory_run(checkpoint::CheckpointManager& mgr) {
  const uint64_t baseline = bench::rss_bytes();
  const bool hwm_reset = bench::reset_peak_rss();
  std::vector<double> blocking, total, stage;
  double first_blocking = 0;
  uint64_t peak = 0, rss5 = 0;
  for (int i = 1; i <= std::max(5, args.growth_saves); ++i) {
    barrier();
    auto t0 = Clock::now();
    mgr.save(i, state);
    double b = seconds_since(t0);
    mgr.finish();
    double tot = seconds_since(t0);
    for (const auto& ev : mgr.take_events()) stage.push_back(ev.stage_s);
    if (i == 1) first_blocking = b;
    if (i >= 2 && i <= 5) {
      blocking.push_back(b);
      total.push_back(tot);
    }
    if (i == 5) {
      peak = bench::peak_rss_bytes();
      rss5 = bench::rss_bytes();
    }
  }
  const uint64_t rss_end = bench::rss_bytes();
  out["async_blocking_first_s"] = max_over(first_blocking);
  out["async_stage_s"] = max_over(bench::median(std::vector<double>(stage.begin() + 1, stage.end())));
  samples["async_blocking_s"].push_back(max_over(bench::median(blocking)));
  samples["async_total_s"].push_back(max_over(bench::median(total)));
  const double extra = static_cast<double>(peak) - static_cast<double>(baseline);
  out["rss_baseline_bytes"] = max_over(static_cast<double>(baseline));
  out["peak_extra_host_bytes"] = max_over(extra);
  out["staging_bytes"] = max_over(static_cast<double>(mgr.staging_bytes()));
  out["rss_after_5"] = max_over(static_cast<double>(rss5));
  out["rss_after_" + std::to_string(std::max(5, args.growth_saves))] = max_over(static_cast<double>(rss_end));
  out["rss_growth_bytes_5_to_20"] = max_over(static_cast<double>(rss_end) - static_cast<double>(rss5));
  out["growth_saves"] = std::max(5, args.growth_saves);
  out["peak_rss_reset"] = max_over(hwm_reset ? 0 : 1) == 0;
  if (!hwm_reset) notes.push_back("VmHWM could not be reset; peak includes state creation");
}

void Bench::time_memcpy() {
  for (auto& t : targets) t.zero_();  // touched: no page faults in the timing
  barrier();
  auto t0 = Clock::now();
  for (size_t i = 0; i < locals.size(); ++i) targets[i].copy_(locals[i]);
  record("memcpy_s", seconds_since(t0));
}

// write(2) in 8 MiB pieces, fsync; read(2) back after dropping the file's
// pages from the cache.
void Bench::time_raw_io() {
  const std::string file = path("raw/rank_" + std::to_string(rank) + ".bin");
  fs::create_directories(path("raw"));
  barrier();
  auto t0 = Clock::now();
  {
    int fd = ::open(file.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) fail("cannot open " + file + ": " + std::strerror(errno));
    for (const auto& t : locals) {
      const char* p = static_cast<const char*>(t.data_ptr());
      for (uint64_t left = nbytes(t); left > 0;) {
        ssize_t w = ::write(fd, p, std::min<uint64_t>(left, 8u << 20));
        if (w < 0 && errno == EINTR) continue;
        if (w < 0) fail("write " + file + ": " + std::strerror(errno));
        p += w;
        left -= static_cast<uint64_t>(w);
      }
    }
    if (::fsync(fd) != 0) fail("fsync " + file + ": " + std::strerror(errno));
    ::close(fd);
  }
  record("raw_write_s", seconds_since(t0));
  const bool dropped = bench::drop_page_cache(file);
  const double resident = bench::resident_fraction(file);
  out["raw_read_cache_dropped"] = max_over(dropped ? 0 : 1) == 0;
  out["raw_read_resident_fraction_after_drop"] = max_over(resident);
  for (auto& t : targets) t.zero_();
  barrier();
  t0 = Clock::now();
  {
    int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) fail("cannot open " + file + ": " + std::strerror(errno));
    for (auto& t : targets) {
      char* p = static_cast<char*>(t.data_ptr());
      for (uint64_t left = nbytes(t); left > 0;) {
        ssize_t r = ::read(fd, p, std::min<uint64_t>(left, 8u << 20));
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) fail("read " + file + ": " + (r == 0 ? std::string("short file") : std::strerror(errno)));
        p += r;
        left -= static_cast<uint64_t>(r);
      }
    }
    ::close(fd);
  }
  record("raw_read_s", seconds_since(t0));
  for (size_t i = 0; i < locals.size(); ++i) {
    if (!same_bytes(locals[i], targets[i])) fail("raw read-back differs in " + specs[i].name);
  }
  fs::remove(file);
}

// The same bytes written by io_threads threads with pwrite(2) at their final
// offsets (8 MiB pieces, round robin), then fsync: what the disk gives to
// parallel writers, the fair bound for save_state_dict (which writes so).
void Bench::time_raw_parallel_write() {
  const std::string file = path("raw/rank_" + std::to_string(rank) + ".par");
  fs::create_directories(path("raw"));
  struct WriteSlice {
    const char* data;
    uint64_t len;
    uint64_t offset;
  };
  std::vector<WriteSlice> pieces;
  uint64_t offset = 0;
  for (const auto& t : locals) {
    const char* p = static_cast<const char*>(t.data_ptr());
    for (uint64_t lo = 0; lo < nbytes(t); lo += 8u << 20) {
      uint64_t len = std::min<uint64_t>(nbytes(t) - lo, 8u << 20);
      pieces.push_back({p + lo, len, offset});
      offset += len;
    }
  }
  barrier();
  auto t0 = Clock::now();
  int fd = ::open(file.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail("cannot open " + file + ": " + std::strerror(errno));
  std::vector<std::thread> writers;
  std::atomic<int> errors{0};
  for (int w = 0; w < args.io_threads; ++w) {
    writers.emplace_back([&, w] {
      for (size_t i = static_cast<size_t>(w); i < pieces.size(); i += static_cast<size_t>(args.io_threads)) {
        const WriteSlice& pc = pieces[i];
        for (uint64_t done = 0; done < pc.len;) {
          ssize_t n = ::pwrite(fd, pc.data + done, pc.len - done, static_cast<off_t>(pc.offset + done));
          if (n < 0 && errno == EINTR) continue;
          if (n <= 0) {
            errors++;
            return;
          }
          done += static_cast<uint64_t>(n);
        }
      }
    });
  }
  for (auto& w : writers) w.join();
  bool synced = ::fsync(fd) == 0;
  ::close(fd);
  if (errors > 0 || !synced) fail("parallel write to " + file + " failed");
  record("raw_write_parallel_s", seconds_since(t0));
  fs::remove(file);
}

// The same pieces written by `threads` threads with O_DIRECT (each copied
// into an aligned 8 MiB buffer first, as dd does), then fsync: what the disk
// takes when the page cache is bypassed. Skipped (not recorded) where the
// file system refuses O_DIRECT.
void Bench::time_raw_direct_write(int threads, const char* key) {
  const std::string file = path("raw/rank_" + std::to_string(rank) + ".dio");
  fs::create_directories(path("raw"));
  constexpr uint64_t kPiece = 8u << 20;
  std::vector<std::pair<const char*, uint64_t>> pieces;  // data, bytes (offsets: i * kPiece)
  for (const auto& t : locals) {
    const char* p = static_cast<const char*>(t.data_ptr());
    for (uint64_t lo = 0; lo < nbytes(t); lo += kPiece) pieces.emplace_back(p + lo, std::min(nbytes(t) - lo, kPiece));
  }
  barrier();
  auto t0 = Clock::now();
  int fd = ::open(file.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_DIRECT, 0644);
  const bool ok = max_over(fd < 0 ? 1 : 0) == 0;
  if (!ok) {
    if (fd >= 0) ::close(fd);
    if (rank == 0) notes.push_back(std::string(key) + ": O_DIRECT refused here");
    return;
  }
  std::vector<std::thread> writers;
  std::atomic<int> errors{0};
  for (int w = 0; w < threads; ++w) {
    writers.emplace_back([&, w] {
      void* buf = std::aligned_alloc(4096, kPiece);
      for (size_t i = static_cast<size_t>(w); buf && i < pieces.size(); i += static_cast<size_t>(threads)) {
        const auto [data, len] = pieces[i];
        std::memcpy(buf, data, len);
        const uint64_t padded = (len + 4095) / 4096 * 4096;  // only the last piece is short
        if (::pwrite(fd, buf, padded, static_cast<off_t>(i * kPiece)) != static_cast<ssize_t>(padded)) errors++;
      }
      if (!buf) errors++;
      std::free(buf);
    });
  }
  for (auto& w : writers) w.join();
  bool synced = ::fsync(fd) == 0;
  ::close(fd);
  if (errors > 0 || !synced) fail("direct write to " + file + " failed");
  record(key, seconds_since(t0));
  fs::remove(file);
}

// torch::save / torch::load of the same local tensors (a vector), with an
// fsync of the file counted in the save for fairness.
void Bench::time_torch_io() {
  const std::string file = path("torch/rank_" + std::to_string(rank) + ".pt");
  fs::create_directories(path("torch"));
  barrier();
  auto t0 = Clock::now();
  torch::save(locals, file);
  bench::fsync_path(file);
  record("torch_save_s", seconds_since(t0));
  bench::drop_page_cache(file);
  barrier();
  t0 = Clock::now();
  std::vector<torch::Tensor> loaded;
  torch::load(loaded, file);
  record("torch_load_s", seconds_since(t0));
  if (loaded.size() != locals.size()) fail("torch::load returned a different number of tensors");
  for (size_t i = 0; i < locals.size(); ++i) {
    if (!same_bytes(locals[i], loaded[i].contiguous())) fail("torch::load differs in " + specs[i].name);
  }
  fs::remove(file);
}

checkpoint::StateDict Bench::into_targets() {
  checkpoint::StateDict sd;
  for (size_t i = 0; i < specs.size(); ++i) {
    targets[i].zero_();
    sd.add_tensor(specs[i].name, targets[i], specs[i].global_shape, box_offsets(specs[i], specs[i].row0));
  }
  for (const auto& b : state.bytes()) sd.add_bytes(b.name, {});
  return sd;
}

checkpoint::SaveOptions Bench::sync_save_options(int t) const {
  checkpoint::SaveOptions so;
  so.step = t;
  so.io_threads = args.io_threads;
  so.layout = "fsdp replicate=1 shard=" + std::to_string(world);
  return so;
}

void Bench::time_sync_save_and_loads(int t) {
  const std::string step_dir = path("sync/" + checkpoint::step_dir_name(t));
  const checkpoint::SaveOptions so = sync_save_options(t);
  barrier();
  const checkpoint::PosixWriteCounters before = checkpoint::posix_write_counters();
  auto t0 = Clock::now();
  checkpoint::save_state_dict(state, step_dir, *rt.checkpoint, so);
  record("sync_save_s", seconds_since(t0));
  // Which way auto wrote this save (it learns from its own files,
  // direct_io.h): this rank's share of bytes written with O_DIRECT.
  const checkpoint::PosixWriteCounters after = checkpoint::posix_write_counters();
  const double direct = static_cast<double>(after.direct_bytes - before.direct_bytes);
  const double all = direct + static_cast<double>(after.buffered_bytes - before.buffered_bytes);
  out["sync_save_direct_share"].push_back(all > 0 ? std::round(100 * direct / all) / 100 : 0.0);

  barrier();
  if (rank == 0) bench::drop_page_cache(step_dir);
  checkpoint::StateDict into = into_targets();
  checkpoint::LoadOptions lo;
  lo.io_threads = args.io_threads;
  barrier();
  t0 = Clock::now();
  checkpoint::load_state_dict(into, step_dir, lo);
  record("load_s", seconds_since(t0));
  for (size_t i = 0; i < specs.size(); ++i) {
    if (!same_bytes(locals[i], targets[i])) fail("load_state_dict: wrong data in " + specs[i].name);
  }
  for (const auto& b : state.bytes()) {
    if (into.find_bytes(b.name)->data != b.data) fail("load_state_dict: wrong bytes in " + b.name);
  }
  if (!args.save_load_only) time_reshard_load(step_dir);  // its boxes would be a third copy
  barrier();
  if (rank == 0) fs::remove_all(path("sync"));
}

// The same sync save with checkpoint.direct_io set to `direct_io` (true:
// O_DIRECT, false: the page cache), next to the default (auto) above.
void Bench::time_sync_save_with(int t, checkpoint::DirectIo direct_io, const char* key, const std::string& sub) {
  const std::string step_dir = path(sub + "/" + checkpoint::step_dir_name(t));
  checkpoint::SaveOptions so = sync_save_options(t);
  checkpoint::PosixOptions po;
  po.direct_io = direct_io;
  so.storage = checkpoint::posix_storage(po);
  barrier();
  auto t0 = Clock::now();
  checkpoint::save_state_dict(state, step_dir, *rt.checkpoint, so);
  record(key, seconds_since(t0));
  barrier();
  if (rank == 0) fs::remove_all(path(sub));
}

// Loads into a different layout: dim 0 re-chunked into world + 1 parts (3
// for one rank); rank r loads part r, the last rank also the extra part (one
// rank: all three). Each part is one load_state_dict call.
void Bench::time_reshard_load(const std::string& step_dir) {
  const int parts = world == 1 ? 3 : world + 1;
  std::vector<int> mine = {rank};
  if (world == 1) mine = {0, 1, 2};
  else if (rank == world - 1) mine.push_back(world);
  std::vector<checkpoint::StateDict> dicts(mine.size());
  std::vector<std::vector<std::pair<int64_t, torch::Tensor>>> boxes(mine.size());
  for (size_t k = 0; k < mine.size(); ++k) {
    for (const auto& s : specs) {
      const int64_t r0 = s.global_shape[0] * mine[k] / parts;
      const int64_t r1 = s.global_shape[0] * (mine[k] + 1) / parts;
      torch::Tensor box = make_box(s, r1 - r0).zero_();
      dicts[k].add_tensor(s.name, box, s.global_shape, box_offsets(s, r0));
      boxes[k].emplace_back(r0, box);
    }
    for (const auto& b : state.bytes()) dicts[k].add_bytes(b.name, {});
  }
  barrier();
  if (rank == 0) bench::drop_page_cache(step_dir);
  checkpoint::LoadOptions lo;
  lo.io_threads = args.io_threads;
  barrier();
  auto t0 = Clock::now();
  for (auto& sd : dicts) checkpoint::load_state_dict(sd, step_dir, lo);
  record("reshard_load_s", seconds_since(t0));
  for (size_t k = 0; k < mine.size(); ++k) {
    for (size_t i = 0; i < specs.size(); ++i) {
      const auto& [r0, box] = boxes[k][i];
      torch::Tensor want = torch::empty_like(box);
      fill_rows(want, specs[i], r0);
      if (!same_bytes(want, box)) {
        fail("resharded load: wrong data in " + specs[i].name + " part " + std::to_string(mine[k]));
      }
    }
  }
}

void Bench::time_async(int t, checkpoint::CheckpointManager& mgr) {
  barrier();
  auto t0 = Clock::now();
  mgr.save(1000 + t, state);
  double blocking = seconds_since(t0);
  mgr.finish();
  double total = seconds_since(t0);
  mgr.take_events();
  record("async_blocking_s", blocking);
  record("async_total_s", total);
}

// save() hands the state over; simulated compute (a sleep: the bench keeps
// the cores for the copy, as a GPU step would) runs while the worker stages;
// then wait_staged() -- what a training loop does before its optimizer step.
void Bench::time_overlap(int t, checkpoint::CheckpointManager& mgr, double compute_s) {
  barrier();
  auto t0 = Clock::now();
  mgr.save(2000 + t, state);
  double b1 = seconds_since(t0);
  std::this_thread::sleep_for(std::chrono::duration<double>(compute_s));
  auto t1 = Clock::now();
  mgr.wait_staged();
  double b2 = seconds_since(t1);
  mgr.finish();
  double total = seconds_since(t0);
  for (const auto& ev : mgr.take_events()) samples["overlap_stage_s_local"].push_back(ev.stage_s);
  record("overlap_blocking_s", b1 + b2);
  record("overlap_total_s", total);
}

void Bench::trial(int t, checkpoint::CheckpointManager& async_mgr,
                  checkpoint::CheckpointManager& overlap_mgr, double compute_s) {
  time_memcpy();
  time_raw_io();
  time_raw_parallel_write();
  time_raw_direct_write(1, "raw_write_direct_s");
  time_raw_direct_write(args.io_threads, "raw_write_direct_parallel_s");
  time_torch_io();
  time_sync_save_and_loads(t);
  time_sync_save_with(t, checkpoint::DirectIo::kOn, "sync_save_direct_s", "sync_direct");
  time_sync_save_with(t, checkpoint::DirectIo::kOff, "sync_save_buffered_s", "sync_buffered");
  if (t > 0) time_async(t, async_mgr);  // trial 0's sample comes from the memory run
  time_overlap(t, overlap_mgr, compute_s);
}

// The main section: the memory run of the async manager, then the trials
// (an overlap warm-up first) with async and overlap managers kept across them.
// What the default storage (checkpoint.direct_io auto) chose here, probed
// before anything is timed, as the trainer does at start.
void Bench::record_direct_io_choice() {
  const checkpoint::DirectIoProbe probe = checkpoint::cached_direct_io_probe(dir);
  out["direct_io_auto"] = {{"use_direct", probe.use_direct}, {"buffered_s", probe.buffered_s},
                           {"direct_s", probe.direct_s}, {"bytes", probe.bytes}, {"detail", probe.detail}};
  if (rank == 0) notes.push_back("checkpoint.direct_io auto chose " + probe.detail);
}

// --save-load-only (bench/dcp_compare_cpu.py runs it next to PyTorch DCP):
// per trial the disk's raw writes (page cache by one thread and by
// io_threads, O_DIRECT by io_threads), the default sync save and its load,
// and an async save on a fresh manager after an untimed warm-up save (the
// one that allocates the staging buffers). Holds at most twice the state:
// the load's targets live only until the load is checked, the staging only
// for the async saves; so 8 GiB states fit where the main section does not.
void Bench::save_load_section() {
  record_direct_io_choice();
  const std::string layout = "fsdp replicate=1 shard=" + std::to_string(world);
  for (int t = 0; t < args.trials; ++t) {
    for (const auto& l : locals) targets.push_back(torch::empty_like(l));
    time_raw_io();
    time_raw_parallel_write();
    time_raw_direct_write(args.io_threads, "raw_write_direct_parallel_s");
    time_sync_save_and_loads(t);
    targets.clear();
    {
      const checkpoint::CheckpointOptions co =
          bench::manager_options(checkpoint::SaveMode::kAsync, path("async"), args.io_threads);
      checkpoint::CheckpointManager mgr(co, co.dir, *rt.checkpoint, layout);
      mgr.save(500 + t, state);
      mgr.finish();
      mgr.take_events();
      time_async(t, mgr);
    }
    barrier();
    if (rank == 0) fs::remove_all(path("async"));
  }
  out["direct_io_auto"]["learned"] = checkpoint::describe_auto_direct_io(dir);
}

void Bench::checkpoint_section() {
  record_direct_io_choice();
  std::ostringstream layout;
  layout << "fsdp replicate=1 shard=" << world;
  checkpoint::CheckpointOptions co = bench::manager_options(checkpoint::SaveMode::kAsync, path("async"), args.io_threads);
  auto async_mgr = std::make_unique<checkpoint::CheckpointManager>(co, co.dir, *rt.checkpoint, layout.str());
  memory_run(*async_mgr);

  for (const auto& t : locals) targets.push_back(torch::zeros_like(t));
  co = bench::manager_options(checkpoint::SaveMode::kOverlap, path("overlap"), args.io_threads);
  auto overlap_mgr = std::make_unique<checkpoint::CheckpointManager>(co, co.dir, *rt.checkpoint, layout.str());
  // Compute that outlasts staging: twice the async staging time.
  const double compute_s = std::max(0.05, 2 * out["async_stage_s"].get<double>());
  out["overlap_compute_s"] = compute_s;
  time_overlap(-1, *overlap_mgr, compute_s);  // warm-up: allocates the staging buffers
  samples.erase("overlap_blocking_s");
  samples.erase("overlap_total_s");
  for (int t = 0; t < args.trials; ++t) trial(t, *async_mgr, *overlap_mgr, compute_s);
  async_mgr.reset();
  overlap_mgr.reset();
  targets.clear();
  out["direct_io_auto"]["learned"] = checkpoint::describe_auto_direct_io(dir);
}

// Multi-level checkpoints (docs/checkpoints.md, "Multi-level checkpoints"): the same state
// saved, in sync and async mode, (a) to one tier, checkpoint.dir on an
// emulated slow durable device (each rank's durable I/O paced at
// --paced-mbps by paced_storage), and (b) with the local tier on this
// machine's file system under --dir, flushed in the background to that same
// paced device. Each save is final (always flushed). Per save: blocking
// (save() returns), the local commit (manager event), the durable commit
// (save() to finish(), which waits for the flush) and the exposure window
// (local commit to durable commit). One warm-up save per manager first.
void Bench::tiers() {
  auto paced = checkpoint::paced_storage(checkpoint::posix_storage(), args.paced_mbps);
  std::ostringstream layout;
  layout << "fsdp replicate=1 shard=" << world;
  for (const checkpoint::SaveMode mode : {checkpoint::SaveMode::kSync, checkpoint::SaveMode::kAsync}) {
    for (const bool tiered : {false, true}) {
      const std::string name = "tiers_" + std::string(to_string(mode)) + (tiered ? "_tiered_" : "_single_");
      checkpoint::CheckpointOptions co = bench::manager_options(mode, path("tiers/" + name + "durable"), args.io_threads);
      if (tiered) {
        co.local.dir = path("tiers/" + name + "local/node{node}");
        co.local.keep_last = 1;
      }
      checkpoint::CheckpointManager mgr(co, co.dir, *rt.checkpoint, layout.str(), paced);
      mgr.set_placement({rt.env.node, checkpoint::posix_storage()});
      if (mode == checkpoint::SaveMode::kAsync) mgr.reserve_staging(state);
      for (int t = -1; t < args.trials; ++t) {
        barrier();
        auto t0 = Clock::now();
        mgr.save(3000 + t + 1, state, /*final=*/true);
        const double blocking = seconds_since(t0);
        mgr.finish();
        const double total = seconds_since(t0);
        const std::vector<checkpoint::CheckpointEvent> events = mgr.take_events();
        if (t < 0) continue;
        record(name + "blocking_s", blocking);
        record(name + "durable_commit_s", total);
        if (!events.empty()) record(name + "stage_s", events.back().stage_s);
        if (tiered && !events.empty()) {
          record(name + "l1_commit_s", events.back().local_commit_s);
          record(name + "exposure_s", events.back().exposure_s);
          if (rank == 0) out["tiers_partner"] = events.back().partner;
        }
      }
    }
  }
  out["tiers_durable_mb_s"] = args.paced_mbps;
  out["tiers_nodes"] = rt.env.nodes;
}

// A runtime of its own for each Trainer: every Trainer creates its mesh
// groups under the same names, which must not meet an earlier run's keys in
// the rendezvous store.
std::unique_ptr<comm::Runtime> Bench::fresh_runtime() {
  // Same on every rank, and not the job's own id.
  const std::string job_id =
      (rt.env.job_id.empty() ? std::string("ckpt_bench") : rt.env.job_id) + ".fresh" +
      std::to_string(fresh_count++);
  torch::Tensor port = torch::zeros({1}, torch::kInt64);
  if (rank == 0) {
    fresh_stores.push_back(comm::host_tcp_store(rt.env.master_addr, 0, job_id));
    port[0] = fresh_stores.back()->port();
  }
  bench_group().broadcast(port, 0);
  comm::LaunchEnv env = rt.env;
  env.master_port = static_cast<int>(port.item<int64_t>());
  env.store_hosted = true;
  env.job_id = job_id;
  comm::DistOptions dopt;
  dopt.backend = comm::Backend::kGloo;
  dopt.timeout_s = 600;
  return comm::init_runtime(env, dopt, comm::DeviceKind::kCpu);
}

std::vector<double> Bench::trainer_step_times(const std::string& label, bool overlap_saves, int64_t steps) {
  const std::string run_dir = path("train/" + label);
  std::vector<std::string> sets = {"train.steps=" + std::to_string(steps), "train.log_every=1000",
                                   "run.dir=" + run_dir, "checkpoint.dir=" + run_dir + "/checkpoints",
                                   "checkpoint.resume=never", "checkpoint.keep_last=2",
                                   "checkpoint.mode=overlap", "dist.timeout_s=600"};
  sets.push_back(overlap_saves ? "checkpoint.interval=10" : "checkpoint.interval=0");
  framework::config::Config cfg = framework::config::load_config(args.config_path, sets);
  auto runtime = fresh_runtime();
  std::vector<double> times;
  {
    framework::train::Trainer trainer(cfg, *runtime);
    int rc = trainer.run();
    if (rc != 0) fail("trainer run " + label + " exited with " + std::to_string(rc));
    const auto& h = trainer.history();
    for (size_t i = 5; i < h.size(); ++i) times.push_back(h[i].step_time_s);  // skip warm-up
  }
  runtime->train->barrier();
  return times;
}

// Mean step time with overlap saves every 10 steps over the mean without
// saves, runs interleaved A B A B at the current world size.
void Bench::training_overhead() {
  std::vector<double> without, with;
  for (int round = 0; round < 2; ++round) {
    auto a = trainer_step_times("no_ckpt_" + std::to_string(round), false, args.train_steps);
    auto b = trainer_step_times("overlap_" + std::to_string(round), true, args.train_steps);
    without.insert(without.end(), a.begin(), a.end());
    with.insert(with.end(), b.begin(), b.end());
  }
  auto mean = [](const std::vector<double>& v) {
    double s = 0;
    for (double x : v) s += x;
    return v.empty() ? 0.0 : s / static_cast<double>(v.size());
  };
  const double no_ckpt = max_over(mean(without));
  const double overlap = max_over(mean(with));
  nlohmann::json j;
  j["step_time_no_ckpt_s"] = no_ckpt;
  j["step_time_overlap_s"] = overlap;
  j["step_time_no_ckpt_median_s"] = max_over(without.empty() ? 0 : bench::median(without));
  j["step_time_overlap_median_s"] = max_over(with.empty() ? 0 : bench::median(with));
  j["overlap_step_overhead"] = overlap / no_ckpt;
  j["steps_per_run"] = args.train_steps;
  j["runs"] = "A B A B (A: checkpoint.interval 0, B: overlap every 10 steps); steps 1-5 of each run skipped; mean";
  out["training"] = j;
}

// (all ranks) The default model trained for `steps` steps, its final
// checkpoint kept in `ck_dir`.
void Bench::train_compression_input(int64_t steps, const std::string& ck_dir) {
  std::vector<std::string> sets = {"train.steps=" + std::to_string(steps), "train.log_every=1000",
                                   "run.dir=" + path("trained"), "checkpoint.dir=" + ck_dir,
                                   "checkpoint.resume=never", "checkpoint.mode=sync",
                                   "checkpoint.interval=" + std::to_string(steps),
                                   "checkpoint.keep_last=1", "dist.timeout_s=600"};
  framework::config::Config cfg = framework::config::load_config(args.config_path, sets);
  auto runtime = fresh_runtime();
  framework::train::Trainer trainer(cfg, *runtime);
  if (trainer.run() != 0) fail("training the compression input failed");
  runtime->train->barrier();
}

// The tensors of the newest committed checkpoint in `ck_dir`, read back whole:
// all of them into `trained`, bf16 copies of the model's into `trained_bf16`.
void Bench::read_trained_sets(const std::string& ck_dir, CompressionSets& sets) {
  auto latest = checkpoint::latest_committed(*checkpoint::posix_storage(), ck_dir);
  if (!latest) fail("no committed checkpoint in " + ck_dir);
  auto meta = checkpoint::read_committed_metadata(*checkpoint::posix_storage(), latest->path);
  checkpoint::StateDict full;
  for (const auto& item : meta.items) {
    if (item.kind != checkpoint::ItemKind::kTensor) continue;
    torch::Tensor t = torch::empty(item.global_shape, checkpoint::to_scalar_type(item.dtype));
    full.add_tensor(item.name, t);
    sets.trained.emplace_back(item.name, t);
    if (item.name.rfind("model.", 0) == 0) sets.trained_bf16.emplace_back(item.name, t);
  }
  checkpoint::LoadOptions lo;
  lo.allow_partial = true;  // tensors only; the bytes items are not needed
  checkpoint::load_state_dict(full, latest->path, lo);
  for (auto& [n, t] : sets.trained_bf16) t = t.to(torch::kBFloat16);
}

// The default model's parameters at initialisation (run.seed), tied ones once.
bench::NamedTensors initial_weights(const std::string& config_path) {
  framework::config::Config cfg = framework::config::load_config(config_path);
  torch::manual_seed(static_cast<uint64_t>(cfg.run.seed));
  auto model = models::make_model(cfg.model);
  bench::NamedTensors init;
  std::vector<const void*> seen;
  for (const auto& p : model->named_parameters()) {
    const void* ptr = p.value().data_ptr();
    if (std::find(seen.begin(), seen.end(), ptr) != seen.end()) continue;  // tied
    seen.push_back(ptr);
    init.emplace_back("model." + p.key(), p.value().detach().clone());
  }
  return init;
}

// The three sets (and --input) through the study with `options`.
nlohmann::json study_sets(const CompressionSets& sets, const std::string& input, comm::Group& solo,
                          const bench::CompressionStudyOptions& options) {
  nlohmann::json comp = nlohmann::json::object();
  comp["trained_fp32"] = bench::run_compression_study("trained_fp32", sets.trained, true, solo, options);
  comp["init_fp32"] = bench::run_compression_study("init_fp32", sets.init, true, solo, options);
  comp["trained_bf16"] = bench::run_compression_study("trained_bf16", sets.trained_bf16, true, solo, options);
  if (!input.empty()) {
    comp["input"] = bench::run_compression_study("input", bench::read_safetensors(input), false, solo, options);
  }
  return comp;
}

// What the compression sets are, for the JSON.
nlohmann::json compression_setup(int64_t steps, int world) {
  return {{"trained_fp32", "default model after " + std::to_string(steps) +
                               " steps at world " + std::to_string(world) +
                               ": weights + AdamW exp_avg + exp_avg_sq, read back whole from its checkpoint"},
          {"init_fp32", "default model at initialisation, weights only (AdamW moments are zero then)"},
          {"trained_bf16", "bf16 copies of the trained weights (no moments)"},
          {"tiling", "each set repeated as independent items tile<k>/<name> until >= 64 MiB; "
                     "every copy is its own chunk, so no codec sees the repetition"},
          {"input", "--input safetensors as given, not tiled"},
          {"paced", "compression_paced: none, zstd 3 and floatgroup+zstd 3 again on a storage wrapper "
                    "that books every read and write on one timeline at --paced-mbps (reads wait for it, "
                    "writes are buffered and fsync waits for it): a disk-bound device, emulated"},
          {"group", "rank 0 alone, on a one-rank checkpoint group"},
          {"safetensors_selftest", "ok"}};
}

// (all ranks) Train the default model, keep its final checkpoint; (rank 0)
// read weights and AdamW moments back whole and run the compression study
// on a one-rank checkpoint group while the other ranks wait.
void Bench::compression() {
  const int64_t steps = args.compress_train_steps;
  const std::string ck_dir = path("trained/checkpoints");
  train_compression_input(steps, ck_dir);
  if (rank == 0) {
    auto solo = rt.rendezvous->new_group("bench.solo", {0});
    CompressionSets sets;
    read_trained_sets(ck_dir, sets);
    sets.init = initial_weights(args.config_path);

    bench::CompressionStudyOptions co;
    co.dir = path("compression");
    co.io_threads = args.io_threads;
    co.trials = args.compression_trials;
    bench::self_test_safetensors(co.dir);
    out["compression"] = study_sets(sets, args.input, *solo, co);
    if (args.paced_mbps > 0) {
      // The same sets on an emulated device of paced_mbps: the regime where
      // the disk, not the CPU, is the bottleneck.
      bench::CompressionStudyOptions pc = co;
      pc.storage = checkpoint::paced_storage(checkpoint::posix_storage(), args.paced_mbps);
      pc.reference_variants_only = true;
      nlohmann::json paced = study_sets(sets, "", *solo, pc);
      paced["device_mb_s"] = args.paced_mbps;
      out["compression_paced"] = paced;
    }
    out["compression_setup"] = compression_setup(steps, world);
  }
  barrier();
}

// ---------------------------------------------------------------------------
// Report

struct Target {
  const char* key;
  const char* op;
  double want;
};

void print_compression(const std::string& set, const nlohmann::json& rows) {
  std::printf("\ncompression: %s (%.1f MiB logical, %d tensors, tiled x%d)\n", set.c_str(),
              rows[0]["logical_bytes"].get<double>() / 1048576.0, rows[0]["tensors"].get<int>(),
              rows[0]["tile_copies"].get<int>());
  std::printf("  %-26s %5s %11s %7s %8s %8s %8s %8s %12s %9s\n", "variant", "level", "stored MiB", "ratio",
              "save s", "cpu s", "load s", "cpu s", "MB/cpu-s", "load MB/s");
  for (const auto& r : rows) {
    std::printf("  %-26s %5d %11.2f %7.3f %8.3f %8.3f %8.3f %8.3f %12.1f %9.1f\n",
                r["name"].get<std::string>().c_str(), r["level"].get<int>(),
                r["stored_bytes"].get<double>() / 1048576.0, r["ratio"].get<double>(),
                r["save_s"].get<double>(), r["save_cpu_s"].get<double>(), r["load_s"].get<double>(),
                r["load_cpu_s"].get<double>(), r["save_mb_s_per_thread"].get<double>(),
                r["load_mb_s"].get<double>());
  }
}

// The compression targets, from the study's rows: the default
// variant (float grouping + zstd at level 3) against "none" and against
// plain zstd at the same level, on the trained sets.
nlohmann::json compression_targets(const nlohmann::json& comp, const std::string& suffix = "",
                                   bool speed_only = false) {
  auto row = [&](const char* set, const std::string& name, int level) -> const nlohmann::json& {
    for (const auto& r : comp.at(set)) {
      if (r["name"] == name && r["level"] == level) return r;
    }
    throw std::runtime_error(std::string("compression study: no row ") + name + " for " + set);
  };
  nlohmann::json t = nlohmann::json::array();
  auto add = [&](const std::string& key, double value, const char* op, double want) {
    const bool pass = std::string(op) == "<=" ? value <= want : value >= want;
    t.push_back({{"target", key}, {"value", value}, {"op", op}, {"want", want}, {"pass", pass}});
  };
  for (const char* set : {"trained_bf16", "trained_fp32", "init_fp32"}) {
    if (!comp.contains(set)) continue;
    const auto& none = row(set, "none", 0);
    const auto& grouped = row(set, "floatgroup+zstd", 3);
    const std::string s = set;
    if (s == "trained_bf16" && !speed_only) add(s + " stored/logical", grouped["ratio"].get<double>(), "<=", 0.72);
    if (s == "trained_fp32" && !speed_only) add(s + " stored/logical", grouped["ratio"].get<double>(), "<=", 0.86);
    if (s != "init_fp32" && !speed_only) {
      double gain = 1;
      for (int level : {1, 3, 9}) {
        gain = std::min(gain, row(set, "zstd", level)["ratio"].get<double>() -
                                  row(set, "floatgroup+zstd", level)["ratio"].get<double>());
      }
      add(s + " grouping gain over plain zstd (points, min over levels)", 100 * gain, ">=", 5);
    }
    const double save = grouped["save_s"].get<double>() / none["save_s"].get<double>();
    const double load = grouped["load_s"].get<double>() / none["load_s"].get<double>();
    add(s + " save compressed/none" + suffix, save, "<=", speed_only ? 1.0 : 1.09);
    add(s + " load compressed/none" + suffix, load, "<=", speed_only ? 1.0 : 1.2);
  }
  return t;
}

void print_compression_targets(const nlohmann::json& t) {
  std::printf("\ncompression targets (floatgroup+zstd level 3; medians over trials)\n");
  for (const auto& x : t) {
    std::printf("  %-66s %8.3f   target %s %g  %s\n", x["target"].get<std::string>().c_str(),
                x["value"].get<double>(), x["op"].get<std::string>().c_str(),
                x["want"].get<double>(), x["pass"].get<bool>() ? "PASS" : "MISS");
  }
}

// The fastest way the disk took the rank's bytes: buffered or O_DIRECT, one
// thread or io_threads (the bar for the default save).
double Bench::best_raw_write() const {
  double best = out.at("raw_write_s").get<double>();
  for (const char* k : {"raw_write_parallel_s", "raw_write_direct_s", "raw_write_direct_parallel_s"}) {
    if (out.contains(k)) best = std::min(best, out.at(k).get<double>());
  }
  return best;
}

// The main section's ratios, each a measurement over its baseline.
nlohmann::json Bench::main_ratios() {
  // num / den where both were measured (--save-load-only measures fewer).
  nlohmann::json ratios = nlohmann::json::object();
  auto ratio = [&](const char* name, const char* num, const char* den) {
    if (out.contains(num) && out.contains(den)) ratios[name] = out.at(num).get<double>() / out.at(den).get<double>();
  };
  ratio("async_blocking_over_sync", "sync_save_s", "async_blocking_s");
  ratio("async_blocking_over_memcpy", "async_blocking_s", "memcpy_s");
  ratio("sync_save_over_raw_write", "raw_write_s", "sync_save_s");
  ratio("sync_save_over_raw_write_parallel", "raw_write_parallel_s", "sync_save_s");
  ratio("sync_save_vs_torch_save", "torch_save_s", "sync_save_s");
  ratio("sync_save_direct_speedup", "sync_save_s", "sync_save_direct_s");
  ratio("sync_save_buffered_over_raw_write", "raw_write_s", "sync_save_buffered_s");
  ratios["sync_save_over_best_raw_write"] = best_raw_write() / out.at("sync_save_s").get<double>();
  if (out.contains("peak_extra_host_bytes")) {
    ratios["peak_extra_over_state"] = out.at("peak_extra_host_bytes").get<double>() / static_cast<double>(rank_bytes);
  }
  if (out.contains("training")) ratios["overlap_step_overhead"] = out["training"]["overlap_step_overhead"];
  return ratios;
}

// The targets on `ratios`: {value, op, target, pass} by ratio.
nlohmann::json ratio_targets(const nlohmann::json& ratios) {
  std::vector<Target> wanted = {{"sync_save_over_raw_write", ">=", 0.8},
                                {"sync_save_over_best_raw_write", ">=", 0.8},
                                {"sync_save_vs_torch_save", ">=", 2.0},
                                {"peak_extra_over_state", "<=", 1.1}};
  if (ratios.contains("overlap_step_overhead")) wanted.push_back({"overlap_step_overhead", "<=", 1.03});
  nlohmann::json targets = nlohmann::json::object();
  for (const auto& t : wanted) {
    if (!ratios.contains(t.key)) continue;
    double x = ratios.at(t.key).get<double>();
    bool pass = std::string(t.op) == ">=" ? x >= t.want : x <= t.want;
    targets[t.key] = {{"value", x}, {"op", t.op}, {"target", t.want}, {"pass", pass}};
  }
  return targets;
}

// The compression targets of the study, and of its paced run where there is
// one: there (disk-bound) compression must make saves and loads faster, not
// just not much slower.
nlohmann::json all_compression_targets(const nlohmann::json& out) {
  nlohmann::json t = compression_targets(out["compression"]);
  if (out.contains("compression_paced")) {
    const std::string suffix =
        " (paced " + std::to_string(static_cast<int>(out["compression_paced"]["device_mb_s"].get<double>())) +
        " MB/s)";
    for (auto& x : compression_targets(out["compression_paced"], suffix, true)) t.push_back(x);
  }
  return t;
}

// (all ranks) Medians of the samples, the run's settings, ratios and targets
// into `out`.
void Bench::summarize() {
  for (const auto& [key, v] : samples) {
    if (key.find("_local") != std::string::npos) continue;
    out[key] = bench::median(v);
  }
  // Each trial's default save in order: direct_io auto may change its way
  // after the first ones (sync_save_direct_share says which it took).
  if (samples.count("sync_save_s")) out["sync_save_s_trials"] = samples["sync_save_s"];
  out["state_bytes"] = state_bytes;
  out["state_bytes_per_rank"] = rank_bytes;
  out["nproc"] = world;
  out["io_threads"] = args.io_threads;
  out["dtype"] = args.dtype;
  out["trials"] = args.trials;
  out["torch_threads"] = torch::get_num_threads();
  out["compression_trials"] = args.compression_trials;
  if (main_section()) {
    out["ratios"] = main_ratios();
    out["targets"] = ratio_targets(out["ratios"]);
  }
  out["notes"] = notes;
  if (out.contains("compression")) out["compression_targets"] = all_compression_targets(out);
}

// The main section's table: each measurement with its rate and meaning.
void Bench::print_measurements() {
  auto v = [&](const char* k) { return out.at(k).get<double>(); };
  const double gb = static_cast<double>(state_bytes) / 1e9;
  std::printf("\nckpt_bench: %.2f GiB state over %d rank(s) (%.2f GiB per rank), io_threads %d, "
              "torch threads %d, %d trial(s)%s\n",
              static_cast<double>(state_bytes) / 1073741824.0, world,
              static_cast<double>(rank_bytes) / 1073741824.0, args.io_threads,
              torch::get_num_threads(), args.trials, args.trials > 1 ? " (median)" : "");
  std::printf("  %-27s %10s %10s   %s\n", "measurement", "seconds", "GB/s", "what");
  const std::vector<std::pair<const char*, const char*>> rows = {
      {"memcpy_s", "tensor.copy_ into preallocated buffers"},
      {"raw_write_s", "write(2) 8 MiB pieces + fsync, one file per rank"},
      {"raw_read_s", "read(2) back after fadvise(DONTNEED)"},
      {"raw_write_parallel_s", "pwrite(2) by io_threads threads + fsync"},
      {"raw_write_direct_s", "raw_write_s with O_DIRECT (via an aligned buffer)"},
      {"raw_write_direct_parallel_s", "raw_write_parallel_s with O_DIRECT"},
      {"torch_save_s", "torch::save(vector<Tensor>) + fsync"},
      {"torch_load_s", "torch::load after fadvise(DONTNEED)"},
      {"sync_save_s", "save_state_dict, uncompressed (direct_io auto)"},
      {"sync_save_direct_s", "the same with checkpoint.direct_io true (O_DIRECT)"},
      {"sync_save_buffered_s", "the same with checkpoint.direct_io false (page cache)"},
      {"async_blocking_s", "manager async: save() blocks (staging reused)"},
      {"async_total_s", "manager async: save() to finish()"},
      {"overlap_blocking_s", "manager overlap: save() + wait_staged() blocks"},
      {"overlap_total_s", "manager overlap: save() to finish()"},
      {"load_s", "load_state_dict, same layout, cache dropped"},
      {"reshard_load_s", "load_state_dict into world+1 parts (3 for 1 rank)"}};
  for (const auto& [k, what] : rows) {
    if (!out.contains(k)) continue;
    double s = v(k);
    if (s < 1e-3) {
      std::printf("  %-27s %10.3f %10s   %s\n", k, s, "-", what);
    } else {
      std::printf("  %-27s %10.3f %10.2f   %s\n", k, s, gb / s, what);
    }
  }
  if (out.contains("direct_io_auto")) {
    std::printf("  checkpoint.direct_io auto: probe %s\n", out["direct_io_auto"]["detail"].get<std::string>().c_str());
    std::printf("  after the saves: %s\n  each sync save: O_DIRECT's share %s, seconds %s\n",
                out["direct_io_auto"]["learned"].get<std::string>().c_str(),
                out["sync_save_direct_share"].dump().c_str(), out["sync_save_s_trials"].dump().c_str());
  }
  if (args.save_load_only) {
    return;  // no memory run, no training
  }
  std::printf("  %-27s %10.3f %10s   first async save (allocates staging)\n", "async_blocking_first_s",
              v("async_blocking_first_s"), "");
  std::printf("  %-27s %10.3f %10s   async staging copy (manager event)\n", "async_stage_s",
              v("async_stage_s"), "");
  auto mib = [](double b) { return b / 1048576.0; };
  std::printf("  memory (per rank, max): state %.1f MiB | rss baseline %.1f MiB | peak extra %.1f MiB | "
              "staging %.1f MiB | rss after 5 saves %.1f MiB, after %d: %.1f MiB (growth %+.1f MiB)%s\n",
              mib(static_cast<double>(rank_bytes)), mib(v("rss_baseline_bytes")),
              mib(v("peak_extra_host_bytes")), mib(v("staging_bytes")), mib(v("rss_after_5")),
              out["growth_saves"].get<int>(),
              mib(out["rss_after_" + std::to_string(out["growth_saves"].get<int>())].get<double>()),
              mib(v("rss_growth_bytes_5_to_20")), out["peak_rss_reset"].get<bool>() ? "" : " (VmHWM not reset)");
  std::printf("  page cache: posix_fadvise(DONTNEED) %s, %.0f%% of the raw file resident after it; "
              "/proc/sys/vm/drop_caches %s (not used for timings)\n",
              out["raw_read_cache_dropped"].get<bool>() ? "ok" : "FAILED",
              100 * v("raw_read_resident_fraction_after_drop"),
              out["proc_drop_caches_worked"].get<bool>() ? "works" : "refused");
  if (out.contains("training")) {
    const auto& tr = out["training"];
    std::printf("  training (default model, %lld steps x 2 runs each, mean of steps 6..): no ckpt %.4f s/step, "
                "overlap every 10 %.4f s/step (medians %.4f / %.4f)\n",
                static_cast<long long>(args.train_steps), tr["step_time_no_ckpt_s"].get<double>(),
                tr["step_time_overlap_s"].get<double>(), tr["step_time_no_ckpt_median_s"].get<double>(),
                tr["step_time_overlap_median_s"].get<double>());
  }
}

// The ratios with their targets, PASS or MISS.
void Bench::print_ratios() {
  const nlohmann::json& targets = out["targets"];
  std::printf("\n  %-28s %10s\n", "ratio", "value");
  for (const auto& [k, x] : out["ratios"].items()) {
    std::string verdict;
    if (targets.contains(k)) {
      const auto& t = targets[k];
      std::ostringstream s;
      s << "target " << t["op"].get<std::string>() << " " << t["target"].get<double>() << "  "
        << (t["pass"].get<bool>() ? "PASS" : "MISS");
      verdict = s.str();
    }
    std::printf("  %-28s %10.3f   %s\n", k.c_str(), x.get<double>(), verdict.c_str());
  }
}

// Multi-level checkpoints: blocking, local and durable commit, exposure, per
// mode, with one tier and with two.
void Bench::print_tiers() {
  auto v = [&](const char* k) { return out.at(k).get<double>(); };
  const double gb = static_cast<double>(state_bytes) / 1e9;
  std::printf("\n  multi-level checkpoints: %.2f GiB over %d rank(s) on %d node(s); durable tier = "
              "EMULATED device, each rank's I/O paced at %.0f MB/s; local tier = %s; partner copies %s\n",
              static_cast<double>(state_bytes) / 1073741824.0, world, out["tiers_nodes"].get<int>(),
              out["tiers_durable_mb_s"].get<double>(), dir.c_str(),
              out.value("tiers_partner", std::string("-")).c_str());
  std::printf("  %-8s %-12s %12s %14s %16s %12s\n", "mode", "tiers", "blocking s", "local commit s",
              "durable commit s", "exposure s");
  for (const std::string mode : {"sync", "async"}) {
    for (const bool tiered : {false, true}) {
      const std::string name = "tiers_" + mode + (tiered ? "_tiered_" : "_single_");
      auto val = [&](const std::string& k) { return out.contains(name + k) ? out[name + k].get<double>() : -1.0; };
      if (tiered) {
        std::printf("  %-8s %-12s %12.3f %14.3f %16.3f %12.3f\n", mode.c_str(), "local+flush",
                    val("blocking_s"), val("l1_commit_s"), val("durable_commit_s"), val("exposure_s"));
      } else {
        std::printf("  %-8s %-12s %12.3f %14s %16.3f %12s\n", mode.c_str(), "durable only",
                    val("blocking_s"), "-", val("durable_commit_s"), "-");
      }
    }
  }
  std::printf("  (%.2f GB; sync blocking single/tiered %.1fx; time to first commit single/tiered: sync "
              "%.1fx, async %.1fx)\n",
              gb, v("tiers_sync_single_blocking_s") / v("tiers_sync_tiered_blocking_s"),
              v("tiers_sync_single_durable_commit_s") / v("tiers_sync_tiered_l1_commit_s"),
              v("tiers_async_single_durable_commit_s") / v("tiers_async_tiered_l1_commit_s"));
}

// The compression study's tables, per set, then its targets.
void Bench::print_compression_study() {
  for (const char* set : {"trained_fp32", "init_fp32", "trained_bf16", "input"}) {
    if (out["compression"].contains(set)) print_compression(set, out["compression"][set]);
  }
  if (out.contains("compression_paced")) {
    const auto& paced = out["compression_paced"];
    for (const char* set : {"trained_fp32", "init_fp32", "trained_bf16"}) {
      std::string title = std::string(set) + ", paced device " +
                          std::to_string(static_cast<int>(paced["device_mb_s"].get<double>())) + " MB/s";
      if (paced.contains(set)) print_compression(title, paced[set]);
    }
  }
  print_compression_targets(out["compression_targets"]);
}

void Bench::write_json() {
  std::ofstream f(args.json_path);
  f << out.dump(2) << "\n";
  if (!f) throw std::runtime_error("cannot write " + args.json_path);
  std::printf("\nwrote %s\n", args.json_path.c_str());
}

// (all ranks) Summarizes; (rank 0) prints the tables and writes the JSON.
void Bench::report() {
  summarize();
  if (rank != 0) return;
  if (main_section()) {
    print_measurements();
    print_ratios();
  }
  if (out.contains("tiers_sync_single_blocking_s")) print_tiers();
  if (out.contains("compression")) print_compression_study();
  std::fflush(stdout);
  if (!args.json_path.empty()) write_json();
}

// Our subdirectories of --dir; the directory itself goes too when empty.
const char* const kSubdirs[] = {"async", "overlap", "raw", "torch", "sync", "sync_direct", "sync_buffered", "train", "trained", "compression", "tiers"};

void clean_dir(const std::string& dir) {
  for (const char* sub : kSubdirs) fs::remove_all(fs::path(dir) / sub);
  std::error_code ec;
  if (fs::is_empty(dir, ec)) fs::remove(dir, ec);
}

bool try_proc_drop_caches() {
  std::ofstream f("/proc/sys/vm/drop_caches");
  f << "1";
  f.flush();
  return static_cast<bool>(f);
}

int run_rank(const Args& args) {
  comm::LaunchEnv env = comm::detect_launch_env(comm::process_env());
  comm::share_cpu_threads_among_local_ranks(env);  // LibTorch's and OpenBLAS's pools
  comm::DistOptions dopt;
  dopt.backend = comm::Backend::kGloo;
  dopt.timeout_s = 600;
  auto rt = comm::init_runtime(env, dopt, comm::DeviceKind::kCpu);
  Bench b(args, *rt);
  if (b.rank == 0) {
    clean_dir(b.dir);
    fs::create_directories(b.dir);
  }
  b.barrier();
  b.out["proc_drop_caches_worked"] = b.rank == 0 ? try_proc_drop_caches() : false;
  const auto start = Clock::now();
  if (args.tiers_only) {
    b.make_state();
    b.tiers();
  } else if (args.save_load_only) {
    b.make_state();
    b.save_load_section();
  } else if (!args.compression_only) {
    b.make_state();
    b.checkpoint_section();
    b.out["checkpoint_section_s"] = seconds_since(start);
  }
  const bool more = !args.compression_only && !args.tiers_only && !args.save_load_only;
  if (!args.skip_tiers && more) b.tiers();
  if (!args.skip_training && more) b.training_overhead();
  if (!args.skip_compression && !args.tiers_only && !args.save_load_only) b.compression();
  b.out["total_s"] = b.max_over(seconds_since(start));
  b.report();
  b.barrier();
  if (b.rank == 0 && !args.keep) clean_dir(b.dir);
  return 0;
}

void add_options(CLI::App& app, Args& args, std::string& device) {
  app.add_option("--size-mb", args.size_mb, "total state over all ranks, MiB")->check(CLI::Range(1, 1 << 20));
  app.add_option("--nproc", args.nproc, "local ranks (re-executes itself like train --nproc)")
      ->check(CLI::Range(1, 64));
  app.add_option("--dir", args.dir, "scratch directory (our subdirectories are removed at the end)");
  app.add_option("--json", args.json_path, "write the results as JSON here");
  app.add_option("--io-threads", args.io_threads, "checkpoint writer/reader threads per rank")
      ->check(CLI::Range(1, 256));
  app.add_flag("--skip-training", args.skip_training, "skip the training-level overhead runs");
  app.add_flag("--skip-compression", args.skip_compression, "skip the compression study");
  app.add_flag("--skip-tiers", args.skip_tiers, "skip the multi-level checkpoint comparison");
  app.add_flag("--tiers-only", args.tiers_only, "run only the multi-level checkpoint comparison");
  app.add_option("--nodes", args.nodes, "simulated nodes for --nproc ranks (as train --nodes)")
      ->check(CLI::Range(1, 4096));
  app.add_flag("--compression-only", args.compression_only,
               "run only the compression study (implies --skip-training)");
  app.add_option("--compression-trials", args.compression_trials,
                 "trials per compression variant (interleaved), report the median")->check(CLI::Range(1, 100));
  app.add_option("--paced-mbps", args.paced_mbps,
                 "also run the compression study on an emulated device of this many MB/s (0: skip)")
      ->check(CLI::Range(0.0, 1e6));
  app.add_option("--input", args.input, "also run the compression study on this .safetensors file")
      ->check(CLI::ExistingFile);
  app.add_option("--dtype", args.dtype, "element type of the synthetic state")
      ->check(CLI::IsMember({"fp32", "bf16"}));
  app.add_flag("--save-load-only", args.save_load_only,
               "only raw writes, the default sync save, its load and an async save (at most twice "
               "the state in memory; bench/dcp_compare_cpu.py)");
  app.add_option("--trials", args.trials, "repeat the timed phases, report the median")->check(CLI::Range(1, 100));
  app.add_flag("--keep", args.keep, "keep the scratch directory");
  app.add_option("--config", args.config_path, "run config for the training-level part");
  app.add_option("--train-steps", args.train_steps, "steps per training-overhead run")->check(CLI::Range(6, 100000));
  app.add_option("--compress-train-steps", args.compress_train_steps,
                 "steps to train the compression input")->check(CLI::Range(1, 100000));
  app.add_option("--growth-saves", args.growth_saves, "async saves in the memory run (RSS after 5 vs after N)")
      ->check(CLI::Range(5, 1000));
  app.add_option("--device", device,
                 "cpu: the host-state benchmarks above; cuda: GPU state, one process, next to the "
                 "bare pinned copy (uses --size-mb, default 8192 there, --trials, --dir, --json, --io-threads)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
}

// --device cuda: the GPU benchmark, with the options given here and its own
// defaults (--size-mb 8192, --trials 3) for those not given.
int run_cuda(const CLI::App& app, const Args& args) {
  bench::CudaBenchArgs cuda;
  cuda.size_mb = app.count("--size-mb") ? args.size_mb : 8192;
  cuda.trials = app.count("--trials") ? args.trials : 3;
  cuda.dir = args.dir;
  cuda.json_path = args.json_path;
  cuda.keep = args.keep;
  if (app.count("--io-threads")) cuda.io_threads = args.io_threads;
  try {
    return bench::run_cuda_bench(cuda);
  } catch (const std::exception& e) {
    std::cerr << "ckpt_bench: failed: " << e.what() << std::endl;
    return 1;
  }
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  std::string device = "cpu";
  CLI::App app{"ckpt_bench: checkpoint speed, memory and compression next to their baselines"};
  add_options(app, args, device);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    int rc = app.exit(e);
    return rc == 0 ? 0 : 2;
  }
  if (args.dtype == "bf16") g_state_dtype = torch::kBFloat16;
  if (comm::parse_device_kind(device) == comm::DeviceKind::kCuda) {
    return run_cuda(app, args);
  }
  if (args.nproc > 1 && !comm::started_by_local_launcher()) {
    comm::LocalLaunchOptions launch;
    launch.nproc = args.nproc;
    launch.nodes = args.nodes;
    launch.argv = comm::argv_without_nproc(argc, argv);
    launch.store_server = comm::host_tcp_store;
    try {
      return comm::run_local_launcher(launch);
    } catch (const std::invalid_argument& e) {
      std::cerr << "ckpt_bench: " << e.what() << std::endl;
      return 2;
    }
  }
  try {
    return run_rank(args);
  } catch (const std::exception& e) {
    std::cerr << "ckpt_bench: failed: " << e.what() << std::endl;
    return 1;
  }
}
