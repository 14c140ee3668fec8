#pragma once
// CPU thread pools of one rank. Ranks on one machine share its cores, so each
// rank sizes its pools to its share, as torchrun does with OMP_NUM_THREADS.
//
// A rank has two pools: LibTorch's intra-op pool, and the pool of the BLAS
// that LibTorch's matmuls call through libblas.so.3. The reference BLAS has
// none; OpenBLAS (Debian's libblas.so.3 once libopenblas0-pthread is
// installed) starts one thread per core by default, so 2 ranks on 2 cores
// would run 4 busy BLAS threads. Both pools get the same share.
//
// Not thread-safe: call once per process, before training starts.
#include "comm/launch_env.h"

namespace comm {

// Threads for one of `local_world` ranks sharing `cores` cores: at least 1.
int cpu_threads_per_rank(int cores, int local_world);

// Sets LibTorch's intra-op threads and, when this process runs on OpenBLAS,
// OpenBLAS's threads to `threads`. OpenBLAS is found at run time (dlsym of
// openblas_set_num_threads), not linked: which BLAS runs is chosen by
// update-alternatives or LD_PRELOAD, not by this build. Returns whether an
// OpenBLAS pool was set. REQUIRES: threads >= 1.
bool set_cpu_threads(int threads);

// The number of threads OpenBLAS uses now; 0 when this process's BLAS is not
// OpenBLAS.
int openblas_threads();

// When this rank shares its node with others (env.local_world_size > 1:
// torchrun, `train --nproc`, SLURM's tasks per node): set_cpu_threads with
// this rank's share of std::thread::hardware_concurrency() cores and returns
// it. Returns 0 and changes nothing for a rank alone on its node.
int share_cpu_threads_among_local_ranks(const LaunchEnv& env);

}  // namespace comm
