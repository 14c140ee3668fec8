#pragma once
// Options of the run and the step loop (config sections `run` and `train`),
// owned by framework/train (namespace framework::train) but kept here: the
// Config holds them, and framework/config builds on nothing of train/
// (was framework/train/options.h).
#include "comm/options.h"
#include "framework/fsdp/options.h"
#include "framework/optim/options.h"

#include <cstdint>
#include <string>

namespace framework::train {

struct RunOptions {
  std::string dir = "runs/default";  // metrics.jsonl, config.yaml, checkpoints
  int64_t seed = 1234;
  // glibc malloc: keep keeps freed host memory for reuse (fixed mmap and
  // trim thresholds, comm/host_malloc.h); default: glibc's own.
  comm::HostMalloc host_malloc = comm::HostMalloc::kKeep;
};

struct TrainOptions {
  int64_t steps = 200;
  // Exit cleanly after this step, as a preempted job would. 0: never.
  int64_t stop_at = 0;
  int64_t global_batch_size = 32;
  // Sequences per rank per forward (gradient accumulation); 0: the rank's
  // whole share of the global batch in one forward.
  int64_t micro_batch_size = 0;
  // bf16 compute with fp32 master weights (FSDP2's MixedPrecisionPolicy).
  fsdp::MixedPrecisionPolicy mixed_precision;
  int64_t log_every = 10;
  comm::DeviceKind device = comm::DeviceKind::kCpu;
  // CUDA: deterministic kernels, so that a resumed run is bit-identical to an
  // uninterrupted one; false: PyTorch's default (faster) kernels.
  bool deterministic = true;
  // AdamW's implementation: auto (the fastest this build has: fused on
  // LibTorch 2.4+, else foreach on CUDA, for_loop on the CPU) | fused |
  // foreach | for_loop. Same state and checkpoints whichever runs.
  optim::OptimizerImpl optimizer_impl = optim::OptimizerImpl::kAuto;
  // The model's fused ops where a kernel exists (llama: LibTorch's RMSNorm op;
  // the loss over the vocabulary in chunks, without fp32 logits of the whole
  // batch); false: the composed ops.
  bool fused_kernels = true;
  // One device's peak in TFLOP/s, for MFU (the progress line, metrics.jsonl);
  // 0 (auto): a CUDA device's bf16 dense peak from a table of known GPUs,
  // none on the CPU.
  double peak_tflops = 0;
  // Clip gradients to this global L2 norm. 0 turns clipping off.
  double grad_clip = 1.0;
  // Validation loss on the held-out data (data.eval_fraction) every N steps
  // and at the last step; 0: never.
  int64_t eval_every = 0;
  // Held-out samples per validation (fewer if the held-out text is shorter).
  int64_t eval_samples = 256;
  // Every N steps and at the last step (0: never), rank 0 prints the greedy
  // continuation of sample_prompt by sample_tokens tokens (every rank runs
  // the forwards). Byte-level: REQUIRES model.vocab_size 256.
  int64_t sample_every = 0;
  std::string sample_prompt = "The ";
  int64_t sample_tokens = 64;
};

// Profiler traces (config section `profile`): every `every` steps, the last
// `active` steps of the window are traced by LibTorch's profiler, one Chrome
// trace per rank: DIR/step_<last>/rank<r>.json (DIR: `dir`, default
// run.dir/profile).
struct ProfileOptions {
  int64_t every = 0;  // 0: off
  int64_t active = 1;
  std::string dir;    // "": run.dir/profile
  // CUDA memory snapshots (profiler.h): the caching allocator's history
  // recorded from the start, a snapshot per rank at the end of each
  // profile.every window (or of the run) and on an out-of-memory error.
  bool memory_snapshot = false;
};

// What a run records besides metrics.jsonl (config section `metrics`).
struct MetricsOptions {
  // Rank 0 writes TensorBoard event files to run.dir/tb (tensorboard.h).
  bool tensorboard = false;
};

}  // namespace framework::train
