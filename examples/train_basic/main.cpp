// train_basic: the trainer as a library, from the installed package. Build:
// see CMakeLists.txt.
//
//   train_basic [--nproc N] [--dir DIR]
//
// Started outside torchrun/SLURM, it runs N copies of itself as ranks
// (default 2) with the library's local launcher, in a fresh directory under
// /tmp unless --dir is given. Each rank:
//   1. builds a config in code (no YAML): a small GPT, FSDP over all ranks,
//      held-out data, async checkpoints every 3 steps;
//   2. trains 6 steps with train_step() and evaluates with evaluate();
//      saves with the trainer's checkpoint policy through run();
//   3. builds a second Trainer on the same run directory: it resumes from
//      the step-6 checkpoint (checkpoint.resume: auto);
//   4. takes the model and optimizer shards with get_state_dict() and checks
//      that they are this rank's part of the full parameters.
// Prints "train_basic: OK" when every rank agrees.
#include "framework/config/config.h"
#include "comm/launch_env.h"
#include "comm/local_launcher.h"
#include "comm/runtime.h"
#include "comm/self_launch.h"
#include "framework/train/state_dict.h"
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

framework::config::Config make_config(const std::string& dir) {
  framework::config::Config c;
  c.run.dir = dir;
  c.train.steps = 6;
  c.train.global_batch_size = 8;
  c.train.log_every = 3;
  c.train.eval_every = 3;
  c.train.eval_samples = 16;
  c.data.eval_fraction = 0.1;
  c.model.d_model = 32;
  c.model.n_layers = 1;
  c.model.seq_len = 16;
  c.checkpoint.interval = 3;
  c.checkpoint.mode = checkpoint::SaveMode::kAsync;
  c.checkpoint.io_threads = 2;
  c.dist.timeout_s = 60;
  return c;
}

int run_rank(const std::string& dir) {
  const fd::LaunchEnv env = fd::detect_launch_env(fd::process_env());
  const framework::config::Config cfg = make_config(dir);
  const std::unique_ptr<fd::Runtime> runtime = fd::init_runtime(env, cfg.dist, fd::DeviceKind::kCpu);
  int bad = 0;
  {
    ft::Trainer trainer(cfg, *runtime);
    // Steps one at a time (run() would do the same and also log and save).
    for (int i = 0; i < 3; ++i) {
      const ft::StepRecord r = trainer.train_step();
      if (env.rank == 0) std::cout << "step " << r.step << " loss " << r.loss << "\n";
    }
    const ft::EvalRecord eval = trainer.evaluate();
    if (env.rank == 0) std::cout << "validation loss " << eval.loss << "\n";
    // The rest with the trainer's own loop: logging, async saves at 3 and 6.
    if (trainer.run() != 0) ++bad;
  }
  {
    ft::Trainer resumed(cfg, *runtime);  // finds <dir>/checkpoints/step_6
    if (resumed.step() != 6) {
      std::cerr << "rank " << env.rank << ": resumed at step " << resumed.step() << ", not 6\n";
      ++bad;
    }
    checkpoint::StateDict sd = ft::get_state_dict(resumed.model(), &resumed.optimizer());
    for (size_t i = 0; i < resumed.model().param_names().size(); ++i) {
      const std::string name = "model." + resumed.model().param_names()[i];
      const checkpoint::TensorEntry* e = sd.find_tensor(name);
      const torch::Tensor full = resumed.model().param_dtensor(i).full_tensor();
      torch::Tensor mine = full;
      for (int64_t d = 0; e != nullptr && d < full.dim(); ++d) {
        mine = mine.narrow(d, e->offsets[d], e->local.size(d));
      }
      if (e == nullptr || !torch::equal(mine, e->local)) {
        std::cerr << "rank " << env.rank << ": " << name << " is not this rank's shard\n";
        ++bad;
      }
    }
  }
  torch::Tensor failures = torch::full({1}, bad, torch::kInt64);
  runtime->train->all_reduce(failures);
  if (failures.item<int64_t>() != 0) return 1;
  if (env.rank == 0) std::cout << "train_basic: OK" << std::endl;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return fd::self_launching_main(argc, argv, "train_basic", run_rank);
}
