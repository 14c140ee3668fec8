#pragma once
// ckpt_bench --device cuda: checkpoints of GPU state, one process, next to
// the bare pinned copy of the same bytes (the physical limit of staging).
#include <string>

namespace bench {

struct CudaBenchArgs {
  double size_mb = 8192;     // GPU state, MiB
  int64_t tensor_mb = 64;    // per tensor (fp32); the last one takes the rest
  std::string dir;           // scratch directory
  std::string json_path;
  int trials = 3;            // timed repeats of each mode (median reported)
  int io_threads = 8;
  bool keep = false;
};

// Prints a table, writes JSON (json_path) and returns the exit status.
int run_cuda_bench(const CudaBenchArgs& args);

}  // namespace bench
