#pragma once
// Profiler traces of chosen steps (config section `profile`), as torchtitan's
// profiling.profile_freq: every `every` steps, the last `active` steps are
// traced by LibTorch's profiler and written as a Chrome trace per rank
// (DIR/step_<last>/rank<r>.json), which Perfetto, chrome://tracing and
// bench/trace_top.py read.
//
// Kineto where the LibTorch build has it (Debian 13's 2.6, pip's 2.x: CPU
// operators, and on CUDA kernels, copies and their launches); else LibTorch's
// legacy profiler (Debian 12's 1.13: CPU operators of the profiling thread).
// Both record the trainer's own ranges: shardkit::forward, step_stats,
// backward, finish_gradients, optimizer, fsdp_gather, fsdp_reduce,
// checkpoint (the save call on the training thread).
//
// CUDA memory snapshots (profile.memory_snapshot, as torchtitan's
// enable_memory_snapshot): the caching allocator records its history from
// the profiler's construction; each rank writes
// DIR/memory_snapshot/step_<N>/rank<r>.pickle at the end of each
// profile.every window (of the run when every is 0), and
// DIR/memory_snapshot/oom/rank<r>_step<N>.pickle on an out-of-memory error.
// PyTorch's memory_viz (pytorch.org/memory_viz) opens them.
#include "framework/config/train_options.h"

#include <cstdint>
#include <memory>
#include <string>

namespace framework::train {

// Starts LibTorch's Kineto profiler on this thread: CPU operators and, with
// `cuda`, CUDA kernels and copies; torch::autograd::profiler::disableProfiler()
// stops it and returns the result to save. Throws where the build has no
// Kineto. StepProfiler uses it, and so does tests/models/llama_ref.
void start_kineto(bool cuda);

class StepProfiler {
 public:
  StepProfiler(const ProfileOptions& options, const std::string& run_dir, int rank, bool cuda);
  ~StepProfiler();
  StepProfiler(const StepProfiler&) = delete;
  StepProfiler& operator=(const StepProfiler&) = delete;

  // Starts tracing when `step` opens a window.
  void before_step(int64_t step);
  // Stops and writes the trace when `step` closes a window; returns its path
  // ("" otherwise). `last_step`: the run's last step this time (a window cut
  // short by the end of the run is written there).
  std::string after_step(int64_t step, int64_t last_step);
  // Traces are taken (profile.every > 0).
  bool enabled() const { return options_.every > 0; }
  // profile.memory_snapshot: the memory snapshot's path when `step` closes a
  // window (or is the run's last when every is 0), else "".
  std::string after_step_memory(int64_t step, int64_t last_step);
  // The snapshot of an out-of-memory error in `step`; "" when snapshots are
  // off or the snapshot itself failed (the error that ends the run matters more).
  std::string write_oom_snapshot(int64_t step) noexcept;
  // "kineto" or "legacy": what this LibTorch build traces with.
  static const char* backend();
  // Where the traces go.
  const std::string& dir() const { return dir_; }

 private:
  struct Active;
  ProfileOptions options_;
  std::string dir_;
  int rank_;
  bool cuda_;
  bool memory_ = false;  // recording the CUDA allocator's history
  int64_t first_step_ = 0;
  std::unique_ptr<Active> active_;

  std::string write_memory_snapshot(const std::string& dir, const std::string& name);
};

}  // namespace framework::train
