#pragma once
// Helpers shared by the test_reliability sources.
#include <gtest/gtest.h>

#include <string>

#include <unistd.h>

#include "reliability/harness.h"
#include "support/paths.h"
#include "support/skip.h"

namespace reliability {

// <build>/reliability-work/<name>.<pid>, emptied. Per process: ctest runs
// each test as its own process, two at a time, and tests that share a name
// prefix must not delete each other's files.
inline fs::path fresh_dir(const std::string& name) {
  const fs::path dir = fs::path(testing_support::binary_dir()) / "reliability-work" /
                       (name + "." + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

inline fs::path cache_dir() { return fs::path(testing_support::binary_dir()) / "reliability-work" / "cache"; }

// A small-model run in `root` (run.dir root/run, checkpoint.dir root/ckpt).
// Runs asking for injected faults run train_faults, which reads them.
inline TrainSpec small_run(const fs::path& root, std::vector<std::string> sets, EnvVars env = {}) {
  TrainSpec spec;
  spec.run_dir = root / "run";
  spec.ckpt_dir = root / "ckpt";
  spec.sets = std::move(sets);
  spec.env = std::move(env);
  for (const auto& [name, value] : spec.env) {
    if (name == "SHARDKIT_FAULT_INJECT" || name == "SHARDKIT_STALL_AT" || name == "SHARDKIT_KILL_AT") {
      spec.binary = "train_faults";
    }
  }
  return spec;
}

inline RunResult run_train(const TrainSpec& spec, const fs::path& log, double timeout_s = 300) {
  return run_process(train_argv(spec), spec.env, timeout_s, log.string());
}

inline std::vector<int64_t> committed_steps(const fs::path& ckpt_dir) {
  std::vector<int64_t> out;
  for (const auto& c : committed_checkpoints(ckpt_dir)) out.push_back(c.step);
  return out;
}

// The output, for failure messages (the tail is where errors are).
inline std::string tail(const std::string& text, size_t chars = 3000) {
  return text.size() <= chars ? text : "..." + text.substr(text.size() - chars);
}

}  // namespace reliability
