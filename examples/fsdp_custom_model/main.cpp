// fsdp_custom_model: your own LibTorch module trained with FSDP and async
// checkpoints, from the installed package. Build: see CMakeLists.txt.
//
//   fsdp_custom_model [--nproc N] [--dir DIR]
//
// Started outside torchrun/SLURM, it runs N copies of itself as ranks
// (default 2) with the library's local launcher, in a fresh directory under
// /tmp unless --dir is given. Each rank:
//   1. builds the LLaMA-style model of llama.h from the same seed, and a
//      token dataset defined here;
//   2. hands them to the Trainer as a UserModel: FSDP over all ranks, each
//      decoder layer one unit, async checkpoints every 3 steps;
//   3. trains 6 steps (run_step() for 3, then run());
//   4. builds a second Trainer on the same run directory and a fresh model:
//      it resumes from the step-6 checkpoint and trains to step 8.
// Prints "fsdp_custom_model: OK" when every rank agrees.
#include "setup.h"

#include "framework/config/config.h"
#include "framework/data/dataset.h"
#include "comm/launch_env.h"
#include "comm/local_launcher.h"
#include "comm/runtime.h"
#include "comm/self_launch.h"
#include "framework/fsdp/fully_shard.h"
#include "framework/train/trainer.h"

#include <torch/torch.h>

#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <memory>
#include <stdexcept>
#include <string>

namespace fd = comm;
namespace ft = framework::train;

namespace {

framework::config::Config make_config(const std::string& dir, int64_t steps) {
  framework::config::Config c;
  c.run.dir = dir;
  c.run.seed = 5;
  c.train.steps = steps;
  c.train.global_batch_size = 8;
  c.train.log_every = 2;
  c.checkpoint.interval = 3;
  c.checkpoint.mode = checkpoint::SaveMode::kAsync;
  c.checkpoint.io_threads = 2;
  c.dist.timeout_s = 60;
  return c;  // parallel: FSDP over all ranks (replicate 1, shard -1)
}

int run_rank(const std::string& dir) {
  const fd::LaunchEnv env = fd::detect_launch_env(fd::process_env());
  const std::unique_ptr<fd::Runtime> runtime =
      fd::init_runtime(env, make_config(dir, 6).dist, fd::DeviceKind::kCpu);
  int bad = 0;
  double first_loss = 0, last_loss = 0;
  {
    const framework::config::Config cfg = make_config(dir, 6);
    ft::Trainer trainer(cfg, *runtime, llama::make_user_model(cfg.run.seed));
    for (int i = 0; i < 3; ++i) {
      const ft::StepRecord r = trainer.run_step();  // logs and saves (step 3) like run()
      if (i == 0) first_loss = r.loss;
    }
    if (trainer.run() != 0) ++bad;  // steps 4..6, saves step 6, waits for it
  }
  {
    const framework::config::Config cfg = make_config(dir, 8);
    ft::Trainer resumed(cfg, *runtime, llama::make_user_model(cfg.run.seed));  // finds <dir>/checkpoints/step_6
    if (resumed.step() != 6) {
      std::cerr << "rank " << env.rank << ": resumed at step " << resumed.step() << ", not 6\n";
      ++bad;
    }
    if (resumed.run() != 0) ++bad;
    last_loss = resumed.history().back().loss;
  }
  if (!(last_loss < first_loss)) {
    std::cerr << "rank " << env.rank << ": loss did not fall: " << first_loss << " -> "
              << last_loss << "\n";
    ++bad;
  }
  torch::Tensor failures = torch::full({1}, bad, torch::kInt64);
  runtime->train->all_reduce(failures);
  if (failures.item<int64_t>() != 0) return 1;
  if (env.rank == 0) std::cout << "fsdp_custom_model: OK" << std::endl;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return fd::self_launching_main(argc, argv, "fsdp_custom_model", run_rank);
}
