#include "comm/cpu_threads.h"

#include <torch/torch.h>

#include <dlfcn.h>

#include <algorithm>
#include <cstdlib>
#include <thread>

namespace comm {
namespace {

// OpenBLAS's own API (cblas.h), looked up rather than linked so that the same
// binary runs on the reference BLAS, where these symbols do not exist.
using SetThreadsFn = void (*)(int);
using GetThreadsFn = int (*)();

SetThreadsFn find_openblas_set_threads() {
  return reinterpret_cast<SetThreadsFn>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"));
}

GetThreadsFn find_openblas_get_threads() {
  return reinterpret_cast<GetThreadsFn>(dlsym(RTLD_DEFAULT, "openblas_get_num_threads"));
}

}  // namespace

int cpu_threads_per_rank(int cores, int local_world) {
  return std::max(1, cores / std::max(1, local_world));
}

bool set_cpu_threads(int threads) {
  TORCH_CHECK(threads >= 1, "set_cpu_threads: threads must be >= 1, got ", threads);
  torch::set_num_threads(threads);
  SetThreadsFn set_openblas = find_openblas_set_threads();
  if (set_openblas == nullptr) return false;
  set_openblas(threads);
  return true;
}

int openblas_threads() {
  GetThreadsFn get_openblas = find_openblas_get_threads();
  return get_openblas == nullptr ? 0 : get_openblas();
}

int share_cpu_threads_among_local_ranks(const LaunchEnv& env) {
  if (env.local_world_size <= 1) return 0;
  int cores = static_cast<int>(std::thread::hardware_concurrency());
  int threads = cpu_threads_per_rank(cores, env.local_world_size);
  set_cpu_threads(threads);
  return threads;
}

}  // namespace comm
