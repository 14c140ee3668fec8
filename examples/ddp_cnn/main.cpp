// ddp_cnn: a non-transformer model -- a CNN with a frozen, BatchNorm-holding
// stem -- trained with DDP and async checkpoints, from the installed
// package. Build: see CMakeLists.txt.
//
//   ddp_cnn [--nproc N] [--dir DIR]
//
// Started outside torchrun/SLURM, it runs N copies of itself as ranks
// (default 2) with the library's local launcher. Each rank:
//   1. builds cnn.h's model from the same seed and an image dataset;
//   2. trains 6 steps with DDP (parallel.shard 1), async checkpoints every
//      3 steps; checks that the frozen stem and its BatchNorm statistics
//      did not change;
//   3. builds a fresh model with other weights and zeroed BatchNorm
//      statistics; a second Trainer resumes it from step 6 (the statistics
//      come back from the checkpoint) and trains to step 10.
// Prints "ddp_cnn: OK" when every rank agrees.
#include "setup.h"

#include "framework/config/config.h"
#include "framework/data/dataset.h"
#include "comm/launch_env.h"
#include "comm/local_launcher.h"
#include "comm/runtime.h"
#include "comm/self_launch.h"
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
  c.run.seed = 9;
  c.train.steps = steps;
  c.train.global_batch_size = 16;
  c.train.log_every = 2;
  c.optim.lr = 1e-2;
  c.parallel.replicate = -1;  // DDP: every rank holds the whole model
  c.parallel.shard = 1;
  c.checkpoint.interval = 3;
  c.checkpoint.mode = checkpoint::SaveMode::kAsync;
  c.checkpoint.io_threads = 2;
  c.dist.timeout_s = 60;
  return c;
}

int run_rank(const std::string& dir) {
  const fd::LaunchEnv env = fd::detect_launch_env(fd::process_env());
  const std::unique_ptr<fd::Runtime> runtime =
      fd::init_runtime(env, make_config(dir, 6).dist, fd::DeviceKind::kCpu);
  int bad = 0;
  double first_loss = 0, last_loss = 0;
  torch::Tensor stem_mean;
  {
    const framework::config::Config cfg = make_config(dir, 6);
    cnn::SmallCnn model{nullptr};
    ft::Trainer trainer(cfg, *runtime, cnn::make_user_model(cfg.run.seed, &model));
    stem_mean = model->stem->named_buffers()["1.running_mean"].clone();
    const torch::Tensor stem_weight = model->stem->named_parameters()["0.weight"].clone();
    if (trainer.run() != 0) ++bad;  // 6 steps, saves at 3 and 6
    first_loss = trainer.history().front().loss;
    // Frozen: neither the stem's weights nor its BatchNorm statistics moved.
    if (!torch::equal(model->stem->named_parameters()["0.weight"], stem_weight) ||
        !torch::equal(model->stem->named_buffers()["1.running_mean"], stem_mean)) {
      std::cerr << "rank " << env.rank << ": the frozen stem changed\n";
      ++bad;
    }
  }
  {
    const framework::config::Config cfg = make_config(dir, 10);
    cnn::SmallCnn model{nullptr};
    ft::UserModel user = cnn::make_user_model(cfg.run.seed, &model);
    {
      // Other values everywhere: every value must come from the checkpoint.
      torch::NoGradGuard no_grad;
      for (auto& p : model->parameters()) p.fill_(0.5);
      for (auto& b : model->buffers()) b.zero_();
    }
    ft::Trainer resumed(cfg, *runtime, std::move(user));  // finds <dir>/checkpoints/step_6
    if (resumed.step() != 6) {
      std::cerr << "rank " << env.rank << ": resumed at step " << resumed.step() << ", not 6\n";
      ++bad;
    }
    if (!torch::equal(model->stem->named_buffers()["1.running_mean"], stem_mean)) {
      std::cerr << "rank " << env.rank << ": BatchNorm statistics not restored\n";
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
  if (env.rank == 0) std::cout << "ddp_cnn: OK" << std::endl;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return fd::self_launching_main(argc, argv, "ddp_cnn", run_rank);
}
