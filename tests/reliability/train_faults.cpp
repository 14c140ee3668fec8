// train_faults: the `train` command with faults the reliability tests ask for
// through the environment. A test binary, never installed: the product's
// `train` reads no fault or stall variable.
//
//   SHARDKIT_FAULT_INJECT=<fault plan>  checkpoints go through a storage that
//       fails as the plan says (support/faulty_storage.h), e.g.
//       "fail_after_bytes=4096,errno=ENOSPC"
//   SHARDKIT_STALL_AT=<phase>:<step>:<rank>  that rank stops responding
//       forever, like a hung peer: phase "train" at the start of the step,
//       "save" before the checkpoint's first collective, "partner" before
//       its partner copy (multi-level checkpoints)
//   SHARDKIT_KILL_AT=flush:<step>  every rank kills itself (SIGKILL) after
//       the local commit of that step, before its flush to the durable tier
//
// The local launcher (--nproc) re-executes this binary, so every rank gets
// the same faults.
#include "comm/exit_now.h"
#include "checkpoint/save_seam.h"
#include "checkpoint/storage/storage.h"
#include "framework/train/train_main.h"
#include "framework/train/train_seam.h"
#include "support/faulty_storage.h"

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <stdexcept>
#include <string>
#include <thread>

namespace {

std::string env_or_empty(const char* name) {
  const char* v = std::getenv(name);
  return v == nullptr ? "" : v;
}

// A callback that hangs the calling thread when (phase, step, rank) matches.
std::function<void(int64_t, int)> stall_at(const std::string& spec, const std::string& phase) {
  if (spec.rfind(phase + ":", 0) != 0) return nullptr;
  return [spec, phase](int64_t step, int rank) {
    if (spec != phase + ":" + std::to_string(step) + ":" + std::to_string(rank)) return;
    std::fprintf(stderr, "shardkit: SHARDKIT_STALL_AT=%s: rank %d stops responding\n", spec.c_str(),
                 rank);
    for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
  };
}

}  // namespace

int main(int argc, char** argv) {
  framework::train::TrainerHooks hooks;
  const std::string faults = env_or_empty("SHARDKIT_FAULT_INJECT");
  if (!faults.empty()) {
    try {
      hooks.storage = checkpoint::faults::fault_injecting_storage(
          checkpoint::posix_storage(), checkpoint::faults::parse_fault_plan(faults));
    } catch (const std::invalid_argument& e) {
      std::cerr << "train_faults: SHARDKIT_FAULT_INJECT: " << e.what() << std::endl;
      return 2;
    }
  }
  const std::string stall = env_or_empty("SHARDKIT_STALL_AT");
  framework::train::test_seam::set_before_step(stall_at(stall, "train"));
  checkpoint::test_seam::SaveSeam seam;
  seam.before_write = stall_at(stall, "save");
  seam.before_partner = stall_at(stall, "partner");
  const std::string kill_at = env_or_empty("SHARDKIT_KILL_AT");
  if (kill_at.rfind("flush:", 0) == 0) {
    seam.before_flush = [kill_at](int64_t step, int rank) {
      if (kill_at != "flush:" + std::to_string(step)) return;
      std::fprintf(stderr, "shardkit: SHARDKIT_KILL_AT=%s: rank %d kills itself\n", kill_at.c_str(), rank);
      std::raise(SIGKILL);
    };
  }
  checkpoint::test_seam::set_default_save_seam(std::move(seam));
  const int status = framework::train::train_main(argc, argv, hooks);
  // As train.cpp: no LibTorch static destructors at exit (comm/exit_now.h).
  comm::exit_now(status);
}
