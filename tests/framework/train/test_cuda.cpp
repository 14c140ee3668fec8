// The GPU path: CUDA training equals CPU training, resume on the GPU is
// bit-exact, checkpoints reshard between CUDA and CPU runs and are
// byte-identical to a CPU run's, async/overlap saves under training commit
// exactly what a sync save commits, and pinned staging stays bounded.
// Every test needs a CUDA device: a CPU-only build or machine skips them,
// printing why.
#include "checkpoint/load.h"
#include "checkpoint/async/manager.h"
#include "checkpoint/format/metadata.h"
#include "comm/device.h"
#include "framework/fsdp/fully_shard.h"
#include "framework/optim/sharded_adamw.h"
#include "framework/train/trainer.h"
#include "support/multi_rank.h"
#include "support/paths.h"
#include "support/skip.h"
#include "support/trainer_state.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <array>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <sys/wait.h>
#include <tuple>
#include <fstream>
#include <map>
#include <mutex>

namespace fs = std::filesystem;
using framework::train::Trainer;
using testing_support::CliResult;
using testing_support::FullState;
using testing_support::expect_same_state;
using testing_support::gather_full_state;
using testing_support::logged_losses;
using testing_support::read_checkpoint_items;
using testing_support::run_runtimes;
using testing_support::run_train_binary;

#define SHARDKIT_REQUIRE_CUDA()                                                   \
  do {                                                                            \
    if (!comm::cuda_available()) {                                     \
      SHARDKIT_SKIP("no CUDA device (CPU-only LibTorch build, or no GPU visible)"); \
    }                                                                             \
  } while (0)

namespace {

std::string cuda_scratch(const std::string& tag) {
  auto dir = fs::temp_directory_path() / ("shardkit_cuda_" + tag + "_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  return dir.string();
}

framework::config::Config base_config(const std::string& dir, const std::string& device) {
  framework::config::Config c;
  c.run.dir = dir;
  c.run.seed = 7;
  c.train.device = comm::parse_device_kind(device);
  c.train.steps = 20;
  c.train.global_batch_size = 12;
  c.train.log_every = 100;
  c.model.vocab_size = 16;
  c.model.seq_len = 16;
  c.model.d_model = 24;
  c.model.n_heads = 2;
  c.model.n_layers = 2;
  c.optim.warmup_steps = 2;
  c.checkpoint.dir = dir + "/checkpoints";
  c.checkpoint.resume = "never";
  c.checkpoint.io_threads = 2;
  return c;
}

// A small llama with full activation checkpointing and accumulation (two
// micro-batches of 6), in `dtype` (fp32 or bf16).
framework::config::Config cuda_llama_config(const std::string& dir, const std::string& device,
                                       const std::string& dtype) {
  auto c = base_config(dir, device);
  c.model.kind = "llama";
  c.model.tie_weights = false;
  c.model.d_model = 32;
  c.model.n_heads = 4;
  c.model.n_kv_heads = 2;
  c.model.d_ff = 48;
  c.model.activation_checkpointing = models::ActivationCheckpointing::kFull;
  c.train.micro_batch_size = 6;
  c.train.mixed_precision.param_dtype =
      framework::fsdp::parse_precision_dtype(dtype, "train.mixed_precision.param_dtype");
  return c;
}

struct CudaRun {
  FullState state;
  std::vector<double> losses;
  int64_t start = 0;
  bool on_gpu = false;
};

// Trains (or only loads, when `train` is false) on `world` ranks of
// cfg.train.device; rank 0's view.
CudaRun train_run(const framework::config::Config& cfg, int world, int64_t shard, bool train = true) {
  auto c = cfg;
  c.parallel.replicate = world / shard;
  c.parallel.shard = shard;
  CudaRun out;
  std::mutex mu;
  run_runtimes(
      world,
      [&](comm::Runtime& rt) {
        Trainer t(c, rt);
        int64_t start = t.step();
        if (train) {
          EXPECT_EQ(t.run(), 0);
        }
        bool on_gpu = t.model().local_params().front().is_cuda();
        FullState full = gather_full_state(t);
        if (rt.env.rank == 0) {
          std::lock_guard<std::mutex> lock(mu);
          out.state = std::move(full);
          out.start = start;
          out.on_gpu = on_gpu;
          for (const auto& r : t.history()) out.losses.push_back(r.loss);
        }
      },
      120.0, c.train.device);
  return out;
}

std::vector<uint8_t> file_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::vector<uint8_t>((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// Every data file of a committed checkpoint (not the metadata, which records
// the saving run's options), by file name.
std::map<std::string, std::vector<uint8_t>> data_files(const std::string& step_dir) {
  std::map<std::string, std::vector<uint8_t>> out;
  for (const auto& e : fs::directory_iterator(step_dir)) {
    std::string name = e.path().filename().string();
    if (name == ".metadata") continue;
    out[name] = file_bytes(e.path());
  }
  return out;
}

// The train binary as a user runs it. Multi-rank CUDA runs are processes:
// ranks that are threads of one process share LibTorch's one autograd
// thread per GPU, where one rank's backward hook would wait in a collective
// for a rank whose backward is queued behind it.
CliResult run_train(const std::string& args) {
  return run_train_binary(testing_support::binary_dir() + "/train", args);
}

std::string cli_args(const std::string& dir, const std::string& device, int nproc, int64_t shard) {
  return "--nproc " + std::to_string(nproc) + " --config " + testing_support::source_dir() +
         "/configs/default.yaml --set run.dir=" + dir + " --set checkpoint.dir=" + dir +
         "/ck --set train.steps=20 --set train.log_every=1 --set checkpoint.interval=0"
         " --set checkpoint.resume=never --set train.device=" + device +
         " --set parallel.replicate=" + std::to_string(nproc / shard) +
         " --set parallel.shard=" + std::to_string(shard);
}

}  // namespace

TEST(CudaTraining, TrainsOnTheGpuAndMatchesCpuTrainingWithinFloatTolerance) {
  SHARDKIT_REQUIRE_CUDA();
  std::string root = cuda_scratch("vs_cpu");
  CudaRun cpu = train_run(base_config(root + "/cpu", "cpu"), 1, 1);
  CudaRun gpu = train_run(base_config(root + "/gpu", "cuda"), 1, 1);
  EXPECT_FALSE(cpu.on_gpu);
  EXPECT_TRUE(gpu.on_gpu);
  ASSERT_EQ(cpu.losses.size(), 20u);
  ASSERT_EQ(gpu.losses.size(), 20u);
  for (size_t i = 0; i < cpu.losses.size(); ++i) {
    EXPECT_NEAR(gpu.losses[i], cpu.losses[i], 1e-4 * cpu.losses[i]) << "step " << i + 1;
  }
  EXPECT_LT(gpu.losses.back(), gpu.losses.front());
  fs::remove_all(root);
}

TEST(CudaTraining, FsdpAndDdpOnOneGpuMatchASingleRank) {
  SHARDKIT_REQUIRE_CUDA();
  std::string root = cuda_scratch("worlds");
  CliResult one = run_train(cli_args(root + "/one", "cuda", 1, 1));
  ASSERT_EQ(one.status, 0) << one.output;
  EXPECT_NE(one.output.find("groups train=nccl"), std::string::npos) << one.output;
  auto want = logged_losses(root + "/one");
  ASSERT_EQ(want.size(), 20u);
  for (auto [name, nproc, shard] : {std::tuple<const char*, int, int64_t>{"fsdp2", 2, 2},
                                    std::tuple<const char*, int, int64_t>{"ddp2", 2, 1}}) {
    SCOPED_TRACE(name);
    CliResult r = run_train(cli_args(root + "/" + name, "cuda", nproc, shard));
    ASSERT_EQ(r.status, 0) << r.output;
    // Two ranks on one GPU: NCCL refuses that, so auto picks Gloo.
    EXPECT_NE(r.output.find("groups train=gloo ckpt=gloo, device cuda:0"), std::string::npos) << r.output;
    auto got = logged_losses(root + "/" + name);
    ASSERT_EQ(got.size(), 20u);
    for (int64_t s = 1; s <= 20; ++s) {
      EXPECT_NEAR(got.at(s), want.at(s), 1e-5 * want.at(s)) << "step " << s;
    }
  }
  fs::remove_all(root);
}

// The llama on the GPU: built unmaterialised and filled on the device, in
// fp32 and in bf16 with activation checkpointing and accumulation; fp32
// matches the CPU run, bf16 tracks it, resume is bit-exact.
TEST(CudaTraining, LlamaInFp32AndBf16MatchesTheCpuAndResumesBitExactly) {
  SHARDKIT_REQUIRE_CUDA();
  std::string root = cuda_scratch("llama");
  auto llama = cuda_llama_config;
  CudaRun cpu = train_run(llama(root + "/cpu", "cpu", "fp32"), 1, 1);
  CudaRun gpu = train_run(llama(root + "/gpu", "cuda", "fp32"), 1, 1);
  CudaRun bf16 = train_run(llama(root + "/bf16", "cuda", "bf16"), 1, 1);
  EXPECT_TRUE(gpu.on_gpu);
  ASSERT_EQ(gpu.losses.size(), 20u);
  ASSERT_EQ(bf16.losses.size(), 20u);
  for (size_t i = 0; i < cpu.losses.size(); ++i) {
    EXPECT_NEAR(gpu.losses[i], cpu.losses[i], 1e-4 * cpu.losses[i]) << "fp32, step " << i + 1;
    EXPECT_NEAR(bf16.losses[i], cpu.losses[i], 3e-2 * cpu.losses[i]) << "bf16, step " << i + 1;
  }
  auto stopped = llama(root + "/stopped", "cuda", "bf16");
  stopped.train.stop_at = 10;
  stopped.checkpoint.interval = 10;
  train_run(stopped, 1, 1);
  stopped.train.stop_at = 0;
  stopped.checkpoint.resume = "auto";
  CudaRun resumed = train_run(stopped, 1, 1);
  EXPECT_EQ(resumed.start, 10);
  ASSERT_EQ(resumed.losses.size(), 10u);
  for (size_t i = 0; i < 10; ++i) EXPECT_EQ(resumed.losses[i], bf16.losses[10 + i]) << "step " << 11 + i;
  fs::remove_all(root);
}

// FSDP's prefetch (parallel.prefetch, docs/parallelism.md) on the GPU path,
// world 1 on NCCL: losses are bit-identical with prefetch 0, 1 and 2. One GPU
// has nothing to communicate (a group of one moves no bytes), so this checks
// the schedule on CUDA, not the overlap of NCCL's streams, which needs two.
TEST(CudaTraining, PrefetchZeroOneAndTwoGiveBitIdenticalLossesOnOneGpu) {
  SHARDKIT_REQUIRE_CUDA();
  std::string root = cuda_scratch("prefetch");
  std::map<int64_t, std::vector<double>> losses;
  for (int64_t prefetch : {0, 1, 2}) {
    auto c = cuda_llama_config(root + "/p" + std::to_string(prefetch), "cuda", "bf16");
    c.parallel.prefetch = prefetch;
    CudaRun run = train_run(c, 1, 1);
    EXPECT_TRUE(run.on_gpu);
    losses[prefetch] = run.losses;
  }
  ASSERT_EQ(losses[0].size(), 20u);
  for (int64_t prefetch : {1, 2}) {
    ASSERT_EQ(losses[prefetch].size(), 20u);
    for (size_t i = 0; i < 20; ++i) {
      EXPECT_EQ(losses[prefetch][i], losses[0][i]) << "prefetch " << prefetch << ", step " << i + 1;
    }
  }
  fs::remove_all(root);
}

// profile.memory_snapshot: each window's end writes the allocator's
// snapshot, which Python's pickle reads as torch.cuda.memory._dump_snapshot's
// dict, with the run's segments (and, on LibTorch 2.x, its trace of
// allocations and frees).
TEST(CudaTraining, MemorySnapshotsAtEachWindowsEndReadAsPyTorchsSnapshotPickle) {
  SHARDKIT_REQUIRE_CUDA();
  std::string root = cuda_scratch("memsnap");
  auto c = cuda_llama_config(root, "cuda", "bf16");
  c.profile.every = 10;
  c.profile.memory_snapshot = true;
  CudaRun run = train_run(c, 1, 1);
  ASSERT_EQ(run.losses.size(), 20u);
  for (int step : {10, 20}) {
    const fs::path snap = fs::path(root) / "profile" / "memory_snapshot" / ("step_" + std::to_string(step)) /
                          "rank0.pickle";
    ASSERT_TRUE(fs::exists(snap)) << snap;
    const std::string check =
        "import pickle, sys\n"
        "d = pickle.load(open(sys.argv[1], 'rb'))\n"
        "assert isinstance(d, dict) and d.get('segments'), sorted(d)\n"
        "traces = d.get('device_traces')\n"
        "assert traces is None or sum(len(t) for t in traces) > 0, 'empty trace'\n"
        "print('segments', len(d['segments']))\n";
    std::ofstream(fs::path(root) / "check.py") << check;
    const std::string cmd = "python3 " + (fs::path(root) / "check.py").string() + " " + snap.string() + " 2>&1";
    EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
  }
  fs::remove_all(root);
}

TEST(CudaTraining, ResumeOnTheGpuIsBitExact) {
  SHARDKIT_REQUIRE_CUDA();
  std::string root = cuda_scratch("resume");
  for (auto [nproc, mode] : {std::pair<int, const char*>{1, "async"}, {2, "overlap"}}) {
    SCOPED_TRACE("world " + std::to_string(nproc));
    std::string full = root + "/full" + std::to_string(nproc);
    std::string split = root + "/split" + std::to_string(nproc);
    CliResult a = run_train(cli_args(full, "cuda", nproc, nproc));
    ASSERT_EQ(a.status, 0) << a.output;
    std::string ck = std::string(" --set checkpoint.interval=5 --set checkpoint.mode=") + mode;
    CliResult b = run_train(cli_args(split, "cuda", nproc, nproc) + ck + " --set train.stop_at=10");
    ASSERT_EQ(b.status, 0) << b.output;
    CliResult c = run_train(cli_args(split, "cuda", nproc, nproc) + ck +
                            " --set checkpoint.resume=" + split + "/ck/step_10");
    ASSERT_EQ(c.status, 0) << c.output;
    EXPECT_NE(c.output.find("resumed from " + split + "/ck/step_10"), std::string::npos) << c.output;
    auto want = logged_losses(full), got = logged_losses(split);
    ASSERT_EQ(want.size(), 20u);
    ASSERT_EQ(got.size(), 20u);
    for (int64_t s = 11; s <= 20; ++s) {
      EXPECT_EQ(got.at(s), want.at(s)) << "step " << s << " is not bit-identical";
    }
  }
  fs::remove_all(root);
}

TEST(CudaCheckpoint, ReshardsBetweenCudaAndCpuRunsEitherWay) {
  SHARDKIT_REQUIRE_CUDA();
  std::string root = cuda_scratch("reshard");
  for (const char* saver : {"cuda", "cpu"}) {
    // Saved by 2 ranks (processes) on `saver`, loaded (no training) by 1 and
    // 3 ranks on either device: every loader holds exactly the same state.
    std::string dir = root + "/" + saver;
    CliResult r = run_train(cli_args(dir, saver, 2, 2) +
                            " --set train.steps=3 --set checkpoint.interval=3 --set checkpoint.mode=sync"
                            " --set train.global_batch_size=24");  // divisible by 1, 2 and 3 ranks
    ASSERT_EQ(r.status, 0) << r.output;
    std::string path = dir + "/ck/step_3";
    ASSERT_TRUE(fs::exists(path + "/.metadata"));
    // The saving run's effective config, as it wrote it to run.dir.
    auto lc = framework::config::load_config(dir + "/config.yaml");
    lc.run.dir = root + "/load";
    lc.checkpoint.dir = root + "/load/ck";
    lc.checkpoint.resume = path;
    FullState reference;
    for (const char* device : {"cpu", "cuda"}) {
      for (int world : {1, 3}) {
        std::string what = std::string(saver) + " fsdp2 -> " + device + " fsdp" + std::to_string(world);
        SCOPED_TRACE(what);
        lc.train.device = comm::parse_device_kind(device);
        CudaRun loaded = train_run(lc, world, world, /*train=*/false);
        EXPECT_EQ(loaded.start, 3);
        EXPECT_EQ(loaded.on_gpu, std::string(device) == "cuda");
        if (reference.empty()) {
          reference = loaded.state;
        } else {
          expect_same_state(reference, loaded.state, what);
        }
      }
    }
  }
  fs::remove_all(root);
}

TEST(CudaCheckpoint, AsyncAndOverlapUnderTrainingCommitExactlyWhatSyncCommitsAndCpuWrites) {
  SHARDKIT_REQUIRE_CUDA();
  std::string root = cuda_scratch("modes");
  // The CPU run's sync checkpoints are the reference: same state, same bytes.
  std::map<std::string, std::string> dirs;
  for (const char* device : {"cpu", "cuda"}) {
    // overlap: from a device snapshot; overlap_chunked: from the live state.
    for (std::string mode : {"sync", "async", "overlap", "overlap_chunked"}) {
      if (std::string(device) == "cpu" && mode != "sync") continue;
      std::string key = std::string(device) + "_" + mode;
      auto cfg = base_config(root + "/" + key, device);
      cfg.train.steps = 12;
      cfg.checkpoint.interval = 4;
      cfg.checkpoint.mode = checkpoint::parse_save_mode(mode == "overlap_chunked" ? "overlap" : mode);
      cfg.checkpoint.device_snapshot =
          mode == "overlap" ? checkpoint::DeviceSnapshot::kOn : checkpoint::DeviceSnapshot::kOff;
      // Training runs on while the copy and the write are in flight; a save
      // that read a parameter the optimizer was writing would differ.
      train_run(cfg, 1, 1);
      dirs[key] = cfg.checkpoint.dir;
    }
  }
  // CUDA training differs from CPU training in the last bits, so the CPU
  // comparison is the byte-identity test below; here every item of every
  // async/overlap checkpoint must equal the sync one (the "config" item
  // records the mode, which differs on purpose).
  for (int step : {4, 8, 12}) {
    SCOPED_TRACE("step " + std::to_string(step));
    std::string s = "/step_" + std::to_string(step);
    auto sync = read_checkpoint_items(dirs["cuda_sync"] + s);
    ASSERT_GT(sync.size(), 10u);
    // A GPU run records its CUDA generator (resume_audit's rng.cuda item).
    EXPECT_FALSE(sync.at("rng.cuda").empty());
    for (const char* mode : {"cuda_async", "cuda_overlap", "cuda_overlap_chunked"}) {
      auto other = read_checkpoint_items(dirs[mode] + s);
      ASSERT_EQ(other.size(), sync.size()) << mode;
      for (const auto& [name, bytes] : sync) {
        EXPECT_EQ(other.at(name), bytes) << mode << ": item " << name << " differs from cuda_sync";
      }
    }
  }
  fs::remove_all(root);
}

// Overlap stages GPU state in chunks of 64 MiB from the background thread,
// from a device snapshot or from the live state. With a state of several
// chunks (and a tensor that spans chunks), each checkpoint must hold the
// state as it was at its save, although the "optimizer" changes it as soon
// as wait_staged() returns; the event says which staging ran, and only the
// snapshot holds device memory.
TEST(CudaCheckpoint, OverlapStagesChunksFromASnapshotOrTheLiveStateAndSavesTheStateOfItsStep) {
  SHARDKIT_REQUIRE_CUDA();
  std::string root = cuda_scratch("chunks");
  for (const char* policy : {"on", "off"}) {
    SCOPED_TRACE(std::string("device_snapshot ") + policy);
    run_runtimes(1, [&](comm::Runtime& rt) {
      torch::manual_seed(5);
      // 40 M floats (160 MiB, three chunks), 3 M bf16, and small ones.
      std::vector<torch::Tensor> state = {
          torch::randn({40 << 20}, torch::kCUDA), torch::randn({3 << 20}, torch::kCUDA).to(torch::kBFloat16),
          torch::randn({17, 3}, torch::kCUDA), torch::randint(0, 100, {9}, torch::kCUDA).to(torch::kLong)};
      auto make = [&] {
        checkpoint::StateDict sd;
        for (size_t i = 0; i < state.size(); ++i) sd.add_tensor("w" + std::to_string(i), state[i]);
        return sd;
      };
      checkpoint::CheckpointOptions o;
      o.interval = 1;
      o.mode = checkpoint::SaveMode::kOverlap;
      o.device_snapshot = checkpoint::parse_device_snapshot(policy);
      o.io_threads = 2;
      checkpoint::CheckpointManager m(o, root + "/" + policy, *rt.checkpoint, "single");
      std::vector<std::vector<torch::Tensor>> expected;
      for (int step = 1; step <= 3; ++step) {
        std::vector<torch::Tensor> now;
        for (auto& t : state) now.push_back(t.cpu());
        expected.push_back(now);
        m.save(step, make());
        m.wait_staged();
        for (auto& t : state) t.add_(1);  // the optimizer step
      }
      m.finish();
      auto events = m.take_events();
      ASSERT_EQ(events.size(), 3u);
      for (const auto& ev : events) {
        EXPECT_TRUE(ev.ok) << ev.error;
        EXPECT_EQ(ev.staging, std::string(policy) == "on" ? "device snapshot" : "chunked");
      }
      if (std::string(policy) == "on") {
        EXPECT_GE(m.snapshot_bytes(), make().nbytes());
      } else {
        EXPECT_EQ(m.snapshot_bytes(), 0u);
      }
      for (int step = 1; step <= 3; ++step) {
        checkpoint::StateDict back;
        for (size_t i = 0; i < state.size(); ++i) {
          back.add_tensor("w" + std::to_string(i), torch::empty_like(state[i], torch::kCPU));
        }
        checkpoint::load_state_dict(back, root + "/" + policy + "/step_" + std::to_string(step),
                                    checkpoint::LoadOptions{});
        for (size_t i = 0; i < state.size(); ++i) {
          EXPECT_TRUE(torch::equal(back.tensors()[i].local, expected[step - 1][i]))
              << "step " << step << " tensor " << i;
        }
      }
    });
  }
  fs::remove_all(root);
}

TEST(CudaCheckpoint, TheSameStateOnCudaAndOnCpuIsWrittenByteIdentically) {
  SHARDKIT_REQUIRE_CUDA();
  std::string root = cuda_scratch("bytes");
  torch::manual_seed(3);
  std::vector<torch::Tensor> host = {torch::randn({64, 33}), torch::randn({7}).to(torch::kBFloat16),
                                     torch::randint(0, 1000, {5, 5}, torch::kLong),
                                     torch::randn({300}).to(torch::kHalf)};
  for (const char* mode : {"sync", "async", "overlap"}) {
    for (const char* device : {"cpu", "cuda"}) {
      run_runtimes(1, [&](comm::Runtime& rt) {
        checkpoint::CheckpointOptions o;
        o.interval = 1;
        o.mode = checkpoint::parse_save_mode(mode);
        o.io_threads = 2;
        o.compression.codec = checkpoint::Codec::kZstd;
        checkpoint::CheckpointManager m(o, root + "/" + mode + "_" + device, *rt.checkpoint, "single");
        checkpoint::StateDict sd;
        for (size_t i = 0; i < host.size(); ++i) {
          sd.add_tensor("t" + std::to_string(i), host[i].to(torch::Device(device)));
        }
        sd.add_bytes("note", {1, 2, 3});
        m.save(1, std::move(sd));
        m.wait_staged();
        m.finish();
      });
    }
    auto cpu = data_files(root + "/" + mode + "_cpu/step_1");
    ASSERT_FALSE(cpu.empty());
    EXPECT_EQ(data_files(root + "/" + mode + "_cuda/step_1"), cpu) << mode;
  }
  fs::remove_all(root);
}

TEST(CudaCheckpoint, PinnedStagingIsReservedAheadBoundedAndFlatOverFiftySaves) {
  SHARDKIT_REQUIRE_CUDA();
  std::string root = cuda_scratch("pinned");
  run_runtimes(1, [&](comm::Runtime& rt) {
    torch::manual_seed(4);
    std::vector<torch::Tensor> state;
    for (int i = 0; i < 20; ++i) state.push_back(torch::randn({1000 + 37 * i}, torch::kCUDA));
    auto make = [&] {
      checkpoint::StateDict sd;
      for (size_t i = 0; i < state.size(); ++i) sd.add_tensor("w" + std::to_string(i), state[i]);
      return sd;
    };
    checkpoint::CheckpointOptions o;
    o.interval = 1;
    o.mode = checkpoint::SaveMode::kAsync;
    o.keep_last = 2;
    o.io_threads = 2;
    checkpoint::CheckpointManager m(o, root, *rt.checkpoint, "single");
    m.reserve_staging(make());
    const uint64_t state_bytes = make().nbytes();
    const uint64_t reserved = m.staging_bytes();
    EXPECT_TRUE(m.staging_pinned());
    EXPECT_GE(reserved, state_bytes);
    EXPECT_LE(static_cast<double>(reserved), 1.1 * static_cast<double>(state_bytes));
    for (int step = 1; step <= 50; ++step) {
      // The "optimizer" writes the state right after each save returns.
      m.save(step, make());
      for (auto& t : state) t.add_(1.0f);
      EXPECT_EQ(m.staging_bytes(), reserved) << "step " << step;
    }
    m.finish();
    // The newest checkpoint holds the state as it was when save(50) ran.
    checkpoint::StateDict back;
    for (size_t i = 0; i < state.size(); ++i) {
      back.add_tensor("w" + std::to_string(i), torch::empty_like(state[i], torch::kCPU));
    }
    checkpoint::load_state_dict(back, root + "/step_50", checkpoint::LoadOptions{});
    for (size_t i = 0; i < state.size(); ++i) {
      EXPECT_TRUE(torch::equal(back.tensors()[i].local, (state[i] - 1.0f).cpu())) << i;
    }
  });
  fs::remove_all(root);
}
