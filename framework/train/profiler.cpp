#include "framework/train/profiler.h"

#include "comm/device.h"

#include <c10/util/Exception.h>
#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/csrc/autograd/profiler_legacy.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <mutex>
#include <set>

#include <unistd.h>

namespace framework::train {
namespace fs = std::filesystem;

namespace {

using torch::profiler::impl::ActivityType;

std::set<ActivityType> kineto_activities(bool cuda) {
  std::set<ActivityType> a{ActivityType::CPU};
  if (cuda) a.insert(ActivityType::CUDA);
  return a;
}

// Whether this LibTorch can write a Kineto trace: a build without Kineto
// (USE_KINETO off, as Debian 12's 1.13) profiles but fails to save. Probed
// once per process, on a one-op trace.
bool kineto_works() {
  static const bool works = [] {
    const fs::path probe =
        fs::temp_directory_path() / ("shardkit_kineto_probe_" + std::to_string(::getpid()) + ".json");
    try {
      start_kineto(false);
      (void)(torch::ones({2}) + 1);
      torch::autograd::profiler::disableProfiler()->save(probe.string());
      std::error_code ec;
      fs::remove(probe, ec);
      return true;
    } catch (const c10::Error&) {
      std::error_code ec;
      fs::remove(probe, ec);
      return false;
    }
  }();
  return works;
}

}  // namespace

void start_kineto(bool cuda) {
  torch::profiler::impl::ProfilerConfig config(torch::profiler::impl::ProfilerState::KINETO);
  const auto activities = kineto_activities(cuda);
  torch::autograd::profiler::prepareProfiler(config, activities);
  torch::autograd::profiler::enableProfiler(config, activities);
}

struct StepProfiler::Active {
  std::string path;
  // Legacy profiler: writes its trace to `path` when destroyed.
  std::unique_ptr<torch::autograd::profiler::RecordProfile> legacy;
};

StepProfiler::StepProfiler(const ProfileOptions& options, const std::string& run_dir, int rank,
                           bool cuda)
    : options_(options),
      dir_(options.dir.empty() ? (fs::path(run_dir) / "profile").string() : options.dir),
      rank_(rank),
      cuda_(cuda) {
  if (options_.memory_snapshot) {
    // The config refuses it on the CPU; a program that builds one anyway
    // is told the same here.
    if (!cuda_) throw std::invalid_argument("profile.memory_snapshot needs train.device: cuda");
    comm::record_cuda_memory_history(true);
    memory_ = true;
  }
}

StepProfiler::~StepProfiler() {
  if (memory_) {
    try {
      comm::record_cuda_memory_history(false);
    } catch (...) {
    }
  }
  if (!active_) return;
  // A run that ends inside a window (an error, a signal): stop, write nothing.
  try {
    if (active_->legacy) {
      active_->legacy.reset();
    } else {
      torch::autograd::profiler::disableProfiler();
    }
  } catch (...) {
  }
}

const char* StepProfiler::backend() { return kineto_works() ? "kineto" : "legacy"; }

void StepProfiler::before_step(int64_t step) {
  if (!enabled() || active_) return;
  const int64_t every = options_.every;
  const int64_t window_end = (step + every - 1) / every * every;
  if (step != window_end - options_.active + 1) return;
  auto active = std::make_unique<Active>();
  active->path = (fs::path(dir_) / ("step_" + std::to_string(window_end)) /
                  ("rank" + std::to_string(rank_) + ".json")).string();
  fs::create_directories(fs::path(active->path).parent_path());
  if (kineto_works()) {
    start_kineto(cuda_);
  } else {
    active->legacy = std::make_unique<torch::autograd::profiler::RecordProfile>(active->path);
  }
  first_step_ = step;
  active_ = std::move(active);
}

std::string StepProfiler::after_step(int64_t step, int64_t last_step) {
  if (!active_) return "";
  if (step % options_.every != 0 && step != last_step) return "";
  std::unique_ptr<Active> active = std::move(active_);
  if (cuda_) torch::cuda::synchronize();
  if (active->legacy) {
    active->legacy.reset();  // writes the trace
  } else {
    torch::autograd::profiler::disableProfiler()->save(active->path);
  }
  return active->path;
}

std::string StepProfiler::write_memory_snapshot(const std::string& dir, const std::string& name) {
  const fs::path d = fs::path(dir_) / "memory_snapshot" / dir;
  fs::create_directories(d);
  const fs::path path = d / name;
  const std::string tmp = path.string() + ".tmp";
  const std::string bytes = comm::cuda_memory_snapshot_pickle();
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    out.close();
    if (!out) throw std::runtime_error("profile.memory_snapshot: cannot write '" + tmp + "'");
  }
  fs::rename(tmp, path);
  return path.string();
}

std::string StepProfiler::after_step_memory(int64_t step, int64_t last_step) {
  if (!memory_) return "";
  const int64_t every = options_.every;
  if (every > 0 ? step % every != 0 && step != last_step : step != last_step) return "";
  return write_memory_snapshot("step_" + std::to_string(step), "rank" + std::to_string(rank_) + ".pickle");
}

std::string StepProfiler::write_oom_snapshot(int64_t step) noexcept {
  if (!memory_) return "";
  try {
    return write_memory_snapshot("oom", "rank" + std::to_string(rank_) + "_step" + std::to_string(step) + ".pickle");
  } catch (...) {
    return "";
  }
}

}  // namespace framework::train
