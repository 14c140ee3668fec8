#include "comm/device.h"
#include "framework/config/config.h"
#include "comm/cpu_threads.h"
#include "comm/launch_env.h"
#include "comm/local_launcher.h"
#include "comm/runtime.h"
#include "framework/fsdp/fully_shard.h"
#include "framework/data/token_dataset.h"
#include "framework/train/preflight.h"
#include "framework/train/resume_audit.h"
#include "framework/train/run_lock.h"
#include "checkpoint/error_text.h"
#include "framework/train/train_main.h"
#include "framework/train/trainer.h"
#include "models/layered_model.h"
#include "models/model_spec.h"

#include <CLI/CLI.hpp>
#include <torch/version.h>
#include <torch/torch.h>

#include <atomic>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <cstdlib>
#include <iostream>
#include <stdexcept>
#include <string>
#include <vector>

#include <unistd.h>

namespace framework::train {

namespace {

struct Args {
  std::string config_path;
  std::vector<std::string> sets;
  int nproc = 0;           // 0: not given
  int nodes = 0;           // 0: not given (1 node)
  int nproc_per_node = 0;  // 0: not given
  int max_restarts = -1;   // -1: not given (0 restarts)
  bool print_config = false;
  bool config_reference = false;
  bool dry_run = false;
};

// Set just before the trainer's first step. Until then (rendezvous, model
// build, checkpoint load) a stop signal has nothing to save: the rank exits
// 75 at once, saying so, instead of waiting for a peer that may never come
// (a rank that failed at start-up: torchrun 2.x's agent, which serves the
// store, or the local launcher would SIGKILL it only after its grace).
std::atomic<bool> g_stepping{false};
char g_startup_stop_line[96];  // "train: rank R: stopped by signal " (built before the handlers)
size_t g_startup_stop_len = 0;

[[noreturn]] void exit_before_first_step(int sig) {
  char digits[4];
  size_t n = 0;
  for (int v = sig; v > 0 && n < sizeof(digits); v /= 10) digits[n++] = static_cast<char>('0' + v % 10);
  char line[160];
  size_t len = 0;
  for (size_t i = 0; i < g_startup_stop_len; ++i) line[len++] = g_startup_stop_line[i];
  while (n > 0) line[len++] = digits[--n];
  static const char kRest[] = " before its first step: nothing to save, exiting 75\n";
  for (size_t i = 0; i + 1 < sizeof(kRest); ++i) line[len++] = kRest[i];
  const ssize_t ignored = ::write(2, line, len);
  (void)ignored;
  _exit(kExitPreempted);
}

// First SIGTERM/SIGINT: finish the step, save (checkpoint.save_on_signal),
// exit 75. A second one: exit at once. Before the first step: exit 75 at once.
void on_stop_signal(int sig) {
  if (!g_stepping.load()) exit_before_first_step(sig);
  if (framework::train::Trainer::stop_signal().exchange(sig) != 0) _exit(128 + sig);
}

// SIGHUP: the launcher died (PR_SET_PDEATHSIG; it may come once per launcher
// thread). Stop as on a first SIGTERM, however many arrive.
void on_launcher_gone(int sig) {
  if (!g_stepping.load()) exit_before_first_step(sig);
  int none = 0;
  framework::train::Trainer::stop_signal().compare_exchange_strong(none, SIGTERM);
}

// The local launch that --nproc, --nodes and --nproc-per-node ask for.
struct LaunchShape {
  int nproc = 0;  // ranks in all; 0: no launch, this process is a rank
  int nodes = 1;
  int max_restarts = 0;  // restarts of the group after a rank fails
};

// P ranks in all from "--nproc P", "--nproc P --nodes N", "--nodes N
// --nproc-per-node M" or "--nproc-per-node M" (P = N x M); all three must
// agree. Throws std::invalid_argument naming the flags that do not.
LaunchShape resolve_launch_shape(const Args& args) {
  constexpr int kMaxRanks = 4096;  // as --nproc
  LaunchShape shape;
  shape.nodes = args.nodes > 0 ? args.nodes : 1;
  if (args.nproc_per_node > 0) {
    const long long total = static_cast<long long>(shape.nodes) * args.nproc_per_node;
    if (args.nproc > 0 && args.nproc != total) {
      throw std::invalid_argument("--nproc " + std::to_string(args.nproc) + " is not --nodes " +
                                  std::to_string(shape.nodes) + " x --nproc-per-node " +
                                  std::to_string(args.nproc_per_node) + " = " +
                                  std::to_string(total) + " ranks");
    }
    if (total > kMaxRanks) {
      throw std::invalid_argument("--nodes " + std::to_string(shape.nodes) +
                                  " x --nproc-per-node " + std::to_string(args.nproc_per_node) +
                                  " = " + std::to_string(total) + " ranks; at most " +
                                  std::to_string(kMaxRanks) + " run on one machine");
    }
    shape.nproc = static_cast<int>(total);
  } else if (args.nproc > 0) {
    if (args.nproc % shape.nodes != 0) {
      throw std::invalid_argument("--nproc " + std::to_string(args.nproc) +
                                  " is not a multiple of --nodes " + std::to_string(shape.nodes));
    }
    shape.nproc = args.nproc;
  } else if (args.nodes > 0) {
    throw std::invalid_argument("--nodes " + std::to_string(args.nodes) +
                                " needs --nproc or --nproc-per-node (how many ranks to start)");
  }
  if (args.max_restarts >= 0) {
    if (shape.nproc == 0) {
      throw std::invalid_argument("--max-restarts " + std::to_string(args.max_restarts) +
                                  " needs --nproc or --nproc-per-node (the local launcher restarts its "
                                  "ranks; under torchrun, use its --max_restarts)");
    }
    shape.max_restarts = args.max_restarts;
  }
  return shape;
}

// Runs the preflight checks; prints their error (when `speak`) or warnings.
// Returns 0, or 2 for a user mistake, 1 for anything else.
int run_preflight(const framework::config::Config& cfg, int world, int local_ranks, bool speak) {
  try {
    const PreflightReport report = preflight(cfg, world, local_ranks);
    if (speak) {
      for (const std::string& w : report.warnings) std::cerr << "train: warning: " << w << std::endl;
    }
    return 0;
  } catch (const PreflightError& e) {
    if (speak) std::cerr << "train: " << e.what() << std::endl;
    return 2;
  } catch (const std::exception& e) {
    if (speak) std::cerr << "train: " << checkpoint::error_text(e) << std::endl;
    return 1;
  }
}

// train --dry-run: the model's size and the memory estimate per rank for
// the job's world, from the config alone (nothing is allocated, no rank
// starts). The world: --nproc, else the launcher's (WORLD_SIZE, as a rank
// reads it: comm/launch_env.h), else 1.
// The dry run's context-parallel line, where the layout and the model
// could run it: each sequence over C = 1, 2, 4, 8 ranks, what a rank keeps.
void print_context_activations(const framework::config::Config& cfg, const framework::parallel::Layout& layout,
                               int world) {
  try {
    models::check_context_parallel(cfg.model, 2);
  } catch (const std::invalid_argument&) {
    return;
  }
  std::string line;
  for (const framework::train::ContextActivations& row : framework::train::activations_by_context(cfg, world)) {
    char value[64];
    if (row.splits) {
      std::snprintf(value, sizeof value, "%.1f MiB", row.bytes / 1048576.0);
    } else {
      std::snprintf(value, sizeof value, "- (model.seq_len does not split)");
    }
    line += (line.empty() ? "" : ", ") + std::string("C=") + std::to_string(row.context) + " " + value;
  }
  std::printf("train: dry run: activations per rank at model.seq_len %lld, each sequence over C ranks "
              "(parallel.context; the batch split %lld way(s) as configured): %s\n",
              static_cast<long long>(cfg.model.seq_len), static_cast<long long>(layout.batch_parallel()),
              line.c_str());
}

int dry_run(const framework::config::Config& cfg, int nproc) {
  int world = nproc;
  if (world <= 0) {
    try {
      world = comm::detect_launch_env(comm::process_env()).world_size;
    } catch (const std::invalid_argument& e) {
      std::cerr << "train: " << e.what() << std::endl;
      return 2;
    }
  }
  framework::parallel::Layout layout;
  try {
    framework::train::check_parallel(cfg, world);
    layout = framework::parallel::resolve(cfg.parallel, world);
  } catch (const std::exception& e) {
    std::cerr << "train: " << e.what() << std::endl;
    return 2;
  }
  const models::ModelSize size = models::model_size(cfg.model);
  const framework::train::MemoryEstimate m = framework::train::estimate_memory(cfg, world);
  std::printf("train: dry run: model %s, %.0f parameters (%.2f B), largest unit %.0f\n",
              cfg.model.kind.c_str(), size.parameters, size.parameters / 1e9, size.largest_unit);
  if (cfg.model.moe.num_experts > 0) {
    std::printf("train: dry run: mixture of experts: %.0f parameters active per token (%.2f B; top-%lld of %lld experts)\n",
                size.active_parameters, size.active_parameters / 1e9, static_cast<long long>(cfg.model.moe.top_k),
                static_cast<long long>(cfg.model.moe.num_experts));
    if (layout.expert > 1) {
      std::printf("train: dry run: expert parallelism %lld: a rank holds %lld of each MoE block's %lld experts, "
                  "sharded over %lld rank(s); never all of them\n",
                  static_cast<long long>(layout.expert),
                  static_cast<long long>(cfg.model.moe.num_experts / layout.expert),
                  static_cast<long long>(cfg.model.moe.num_experts), static_cast<long long>(layout.expert_shard()));
    }
  }
  const std::string pipeline =
      cfg.parallel.pipeline > 1
          ? "pipeline=" + std::to_string(cfg.parallel.pipeline) + " (" + to_string(cfg.parallel.pipeline_schedule) + ", " +
                std::to_string(cfg.parallel.pipeline * cfg.parallel.stages_per_rank) + " stages) x "
          : std::string();
  std::printf("train: dry run: world %d, layout %s%s, param_dtype %s, "
              "reduce_dtype %s, activation checkpointing %s, micro_batch_size %lld\n",
              world, pipeline.c_str(), layout.describe().c_str(), to_string(cfg.train.mixed_precision.param_dtype),
              to_string(cfg.train.mixed_precision.reduce_dtype),
              to_string(cfg.model.activation_checkpointing),
              static_cast<long long>(cfg.train.micro_batch_size));
  std::cout << "train: dry run: memory estimate per rank " << framework::train::describe(m)
            << std::endl;
  print_context_activations(cfg, layout, world);
  return 0;
}

// This rank's place in the job (env), its device, and whether the config's
// parallel layout fits the world. Returns 0, or 2 (a user mistake, printed).
int place_rank(const Args& args, const framework::config::Config& cfg,
               comm::LaunchEnv& env) {
  try {
    env = comm::detect_launch_env(comm::process_env(), cfg.dist.master_addr, cfg.dist.master_port);
  } catch (const std::invalid_argument& e) {
    std::cerr << "train: " << e.what() << std::endl;
    return 2;
  }
  try {
    // LOCAL_RANK picks the GPU; refused as a config error when there is none.
    comm::select_device(cfg.train.device, env.local_rank);
  } catch (const std::invalid_argument& e) {
    std::cerr << "train: " << args.config_path << ": " << e.what() << std::endl;
    return 2;
  }
  try {
    framework::parallel::resolve(cfg.parallel, env.world_size);
  } catch (const std::invalid_argument& e) {
    std::cerr << "train: " << args.config_path << ": " << e.what() << std::endl;
    return 2;
  }
  return 0;
}

// A rank no local launcher started (torchrun, SLURM, a single process)
// does the launcher's checks itself: the directories, the job's locks
// (rank 0; each node's first rank its local tier) into `locks`, and the
// preflight. Returns 0, or the exit status (2: a user mistake).
int check_and_lock_unlaunched(const framework::config::Config& cfg,
                              const comm::LaunchEnv& env, bool speak,
                              std::vector<std::unique_ptr<RunDirLock>>& locks) {
  try {
    check_directories(cfg);
  } catch (const PreflightError& e) {
    if (speak) std::cerr << "train: " << e.what() << std::endl;
    return 2;
  }
  if (env.rank == 0 || env.local_rank == 0) {
    try {
      if (env.rank == 0) locks = lock_job_dirs(cfg.run.dir, cfg.checkpoint.dir);
      // Each node's first rank holds its node's local tier directory.
      if (env.local_rank == 0) {
        for (auto& lock : lock_local_tier_dirs(config::local_tier_pattern(cfg), {env.node})) {
          locks.push_back(std::move(lock));
        }
      }
    } catch (const RunDirBusy& e) {
      for (auto& lock : locks) lock->remove_if_unused();
      std::cerr << "train: " << e.what() << std::endl;
      return 2;
    } catch (const std::exception& e) {
      for (auto& lock : locks) lock->remove_if_unused();
      std::cerr << "train: " << e.what() << std::endl;
      return 1;
    }
  }
  const int status = run_preflight(cfg, env.world_size, env.local_world_size, speak);
  if (status != 0) {
    for (auto& lock : locks) lock->remove_if_unused();
  }
  return status;
}

int run_rank(const Args& args, const framework::config::Config& cfg, const TrainerHooks& hooks) {
  comm::LaunchEnv env;
  if (const int status = place_rank(args, cfg, env); status != 0) return status;
  // Like torchrun's OMP_NUM_THREADS: ranks on one machine share its cores.
  // Sizes OpenBLAS's pool too: it would otherwise take every core per rank.
  comm::share_cpu_threads_among_local_ranks(env);
  g_startup_stop_len = static_cast<size_t>(std::snprintf(g_startup_stop_line, sizeof(g_startup_stop_line),
                                                         "train: rank %d: stopped by signal ", env.rank));
  std::signal(SIGTERM, on_stop_signal);
  std::signal(SIGINT, on_stop_signal);
  // Ranks the local launcher started run under its lock; otherwise rank 0
  // takes it (torchrun, SLURM, a single process).
  const bool launched = comm::started_by_local_launcher();
  // A rank's output goes through its launcher. If the launcher dies (SIGKILL),
  // the rank gets SIGTERM to save and exit, and must not die of SIGPIPE at
  // its next log line: output to a dead launcher is dropped instead.
  if (launched) {
    std::signal(SIGPIPE, SIG_IGN);
    std::signal(SIGHUP, on_launcher_gone);
  }
  // One message per machine: rank 0 and each machine's first rank speak.
  const bool speak = env.rank == 0 || env.local_rank == 0;
  std::vector<std::unique_ptr<RunDirLock>> locks;
  // The local launcher checked already, for all of its ranks.
  if (!launched) {
    if (const int status = check_and_lock_unlaunched(cfg, env, speak, locks); status != 0) return status;
  }
  try {
    auto runtime = comm::init_runtime(env, cfg.dist, cfg.train.device);
    framework::train::Trainer trainer(cfg, *runtime, hooks);
    g_stepping.store(true);
    return trainer.run();
  } catch (const ResumeAuditError& e) {
    // Every rank found the same difference; rank 0 says it once.
    if (env.rank == 0) std::cerr << "train: " << e.what() << std::endl;
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "train: rank " << env.rank << " failed: " << checkpoint::error_text(e)
              << std::endl;
    return 1;
  }
}

// Parses the command line into `args`. Returns -1 to go on, else the exit
// status: 0 after --help, --version or --config-reference, 2 for a usage
// error.
int parse_command_line(int argc, char** argv, Args& args) {
  CLI::App app{"shardkit trainer: FSDP/DDP/HSDP training with distributed checkpoints"};
  auto* config_opt = app.add_option("--config", args.config_path, "YAML run configuration");
  app.add_flag("--config-reference", args.config_reference,
               "print every config key with its type, default and meaning (markdown) and exit");
  app.add_option("--set", args.sets, "override a config key: key.path=value (repeatable)")
      ->allow_extra_args(false);
  app.add_option("--nproc", args.nproc, "start N local ranks on 127.0.0.1 (like torchrun --standalone)")
      ->check(CLI::Range(1, 4096));
  app.add_option("--nodes", args.nodes,
                 "simulate N nodes of the local ranks (--nproc a multiple of N; default 1)")
      ->check(CLI::Range(1, 4096));
  app.add_option("--nproc-per-node", args.nproc_per_node,
                 "start M local ranks per simulated node (--nodes x M in all)")
      ->check(CLI::Range(1, 4096));
  app.add_option("--max-restarts", args.max_restarts,
                 "with --nproc: start the whole group again after a rank fails, up to K times "
                 "(like torchrun --max_restarts; default 0); the run resumes from its newest checkpoint")
      ->check(CLI::Range(0, 1000000));
  app.add_flag("--print-config", args.print_config, "print the effective config and exit");
  app.add_flag("--dry-run", args.dry_run,
               "print the model size and the memory estimate per rank for the world (--nproc, "
               "else WORLD_SIZE, else 1) and exit; allocates nothing");
  app.set_version_flag("--version", std::string("train (shardkit) ") + SHARDKIT_VERSION +
                                        ", LibTorch " + TORCH_VERSION);
  try {
    app.parse(argc, argv);
    if (args.config_reference) {
      std::cout << framework::config::reference_markdown();
      return 0;
    }
    if (config_opt->count() == 0) throw CLI::RequiredError("--config");
  } catch (const CLI::ParseError& e) {
    int rc = app.exit(e);
    return rc == 0 ? 0 : 2;
  }
  return -1;
}

// train --nproc: the local launcher. Checks the config against the job's
// ranks, holds the job's locks (run and checkpoint directories, every
// simulated node's local tier) for the whole job, runs the preflight once,
// then starts the ranks and returns their status.
int launch_local_ranks(int argc, char** argv, const Args& args, const LaunchShape& shape,
                       const framework::config::Config& cfg) {
  comm::LocalLaunchOptions launch;
  launch.nproc = shape.nproc;
  launch.nodes = shape.nodes;
  launch.argv = comm::argv_without_nproc(argc, argv);
  launch.store_server = comm::host_tcp_store;
  launch.stop_grace_s = cfg.dist.stop_grace_s;
  launch.max_restarts = shape.max_restarts;
  launch.standby = cfg.dist.standby;
  launch.standby_delay_s = cfg.dist.standby_delay_s;
  try {
    framework::parallel::resolve(cfg.parallel, shape.nproc);
  } catch (const std::invalid_argument& e) {
    std::cerr << "train: " << args.config_path << ": " << e.what() << std::endl;
    return 2;
  }
  try {
    check_directories(cfg);
  } catch (const PreflightError& e) {
    std::cerr << "train: " << e.what() << std::endl;
    return 2;
  }
  try {
    // One job per run directory, held by the launcher for the whole job.
    std::vector<std::unique_ptr<RunDirLock>> locks = lock_job_dirs(cfg.run.dir, cfg.checkpoint.dir);
    // Every simulated node's local tier directory, for the whole job.
    std::vector<int> nodes(static_cast<size_t>(shape.nodes));
    for (int n = 0; n < shape.nodes; ++n) nodes[static_cast<size_t>(n)] = n;
    try {
      for (auto& lock : lock_local_tier_dirs(framework::config::local_tier_pattern(cfg), nodes)) locks.push_back(std::move(lock));
    } catch (...) {
      for (const auto& lock : locks) lock->remove_if_unused();
      throw;
    }
    // The ranks hold the locks too: they outlive a launcher killed with
    // SIGKILL (whose ranks get SIGTERM, save and exit) until the last rank.
    for (const auto& lock : locks) lock->share_with_children();
    // Checked once for the whole job, before any rank starts.
    // Every simulated node runs on this machine: all ranks share it.
    const int checked = run_preflight(cfg, shape.nproc, shape.nproc, true);
    if (checked != 0) {
      for (const auto& lock : locks) lock->remove_if_unused();
      return checked;
    }
    // The token ids preflight read: the ranks need not read them again
    // (skipped where the list outgrows what one variable may hold).
    const std::string verified = framework::data::checked_token_files();
    if (!verified.empty() && verified.size() < (size_t{96} << 10)) {
      ::setenv(framework::data::kCheckedTokensEnv, verified.c_str(), 1);
    }
    const int status = comm::run_local_launcher(launch);
    if (status == 2) {  // a rank refused the config
      for (const auto& lock : locks) lock->remove_if_unused();
    }
    return status;
  } catch (const RunDirBusy& e) {
    std::cerr << "train: " << e.what() << std::endl;
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "train: " << e.what() << std::endl;
    return 1;
  }
}

// A rank forked from a template: train_main with the rank's arguments.
int run_as_rank(const std::vector<std::string>& rank_argv, const TrainerHooks& hooks) {
  static std::vector<std::string> storage;
  static std::vector<char*> pointers;
  storage = rank_argv;
  pointers.clear();
  for (std::string& arg : storage) pointers.push_back(arg.data());
  pointers.push_back(nullptr);
  return train_main(static_cast<int>(storage.size()), pointers.data(), hooks);
}

}  // namespace

int train_main(int argc, char** argv, const TrainerHooks& hooks) {
  // A standby of train --nproc --max-restarts waits here, loaded, until a
  // restart makes it a rank (its environment then is a rank's).
  comm::wait_if_standby();
  Args args;
  if (const int status = parse_command_line(argc, argv, args); status >= 0) return status;

  // Inside a launched rank the launch flags are spent (and stripped).
  LaunchShape shape;
  if (!comm::started_by_local_launcher()) {
    try {
      shape = resolve_launch_shape(args);
    } catch (const std::invalid_argument& e) {
      std::cerr << "train: " << e.what() << std::endl;
      return 2;
    }
    // The ranks to be, forked now (no thread started yet): each starts as a
    // rank without loading the program again (fork_rank_templates).
    if (shape.nproc > 0 && !args.dry_run && !args.print_config) {
      if (auto rank_argv = comm::fork_rank_templates(shape.nproc)) return run_as_rank(*rank_argv, hooks);
    }
  }

  framework::config::Config cfg;
  try {
    cfg = framework::config::load_config(args.config_path, args.sets);
  } catch (const framework::config::ConfigError& e) {
    std::cerr << "train: " << e.what() << std::endl;
    return 2;
  }
  if (args.print_config) {
    std::cout << framework::config::to_yaml(cfg);
    return 0;
  }
  if (args.dry_run) return dry_run(cfg, shape.nproc);
  if (shape.nproc > 0) return launch_local_ranks(argc, argv, args, shape, cfg);
  return run_rank(args, cfg, hooks);
}

}  // namespace framework::train
