// fault_soak: the long-running driver behind scripts/fault-soak.
//
//   fault_soak [--trials N] [--seed S] [--work DIR] [--bin DIR]
//       N kill -9 trials (default 200), drawn from seed S (printed): mode,
//       kill point, victim; prints one row per trial and the totals.
//   fault_soak --corrupt N [--seed S] [--work DIR] [--bin DIR]
//       N single-byte flips in each of an uncompressed and a zstd checkpoint,
//       plus the detection rates.
// Exit status: 0 when every trial / every flip behaved, 1 otherwise.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <map>
#include <string>

#include "reliability/harness.h"

namespace {

using namespace reliability;

struct Args {
  int trials = 200;
  int64_t corrupt = 0;
  uint64_t seed = 0;
  fs::path work;
};

int usage() {
  std::cerr << "usage: fault_soak [--trials N] [--corrupt N] [--seed S] [--work DIR] [--bin DIR]\n";
  return 2;
}

int run_kill_soak(const Args& a) {
  std::map<std::string, std::map<int64_t, double>> refs;
  for (const char* mode : {"sync", "async", "overlap"}) {
    std::string error;
    refs[mode] = reference_losses(mode, a.work / "cache", &error);
    if (refs[mode].empty()) {
      std::cerr << "fault_soak: " << error << "\n";
      return 1;
    }
  }
  std::printf("fault_soak: %d kill -9 trials, seed %llu, work %s\n", a.trials,
              static_cast<unsigned long long>(a.seed), a.work.c_str());
  std::printf("%5s  %-7s  %-18s  %-8s  %-40s  %s\n", "trial", "mode", "kill point", "victim",
              "state at kill", "outcome");
  std::mt19937_64 rng(a.seed);
  int ok = 0;
  std::map<std::string, std::pair<int, int>> by_key;  // "mode/point/victim" -> ok, total
  std::vector<std::string> failures;
  const double start = monotonic_s();
  for (int i = 0; i < a.trials; ++i) {
    KillTrial t = draw_kill_trial(i, rng, a.work / ("trial_" + std::to_string(i)));
    KillOutcome o = run_kill_trial(t, refs[t.mode]);
    char point[64];
    if (t.kill_point == "random") {
      std::snprintf(point, sizeof point, "random+%.2fs", t.delay_s);
    } else {
      std::snprintf(point, sizeof point, "%s:%d", t.kill_point.c_str(), 2 * static_cast<int>(t.delay_s));
    }
    std::string state = o.state_at_kill.substr(0, 40);
    std::printf("%5d  %-7s  %-18s  %-8s  %-40s  %s\n", i, t.mode.c_str(), point, t.victim.c_str(),
                state.c_str(), o.ok ? o.summary.c_str() : ("FAIL: " + o.summary.substr(0, 200)).c_str());
    std::fflush(stdout);
    auto& k = by_key[t.mode + " " + t.victim];
    ++k.second;
    if (o.ok) {
      ++ok;
      ++k.first;
      fs::remove_all(t.root);
    } else {
      failures.push_back("trial " + std::to_string(i) + ": " + o.summary + "\n    " + o.detail +
                         "\n    logs: " + t.root.string());
    }
  }
  std::printf("\nby mode and victim (ok/total):\n");
  for (const auto& [k, v] : by_key) std::printf("  %-18s %d/%d\n", k.c_str(), v.first, v.second);
  std::printf("\ntotal: %d trials, %d ok, %d failed, %.0f s\n", a.trials, ok, a.trials - ok,
              monotonic_s() - start);
  for (const auto& f : failures) std::printf("FAILED %s\n", f.c_str());
  return ok == a.trials ? 0 : 1;
}

int run_corrupt_soak(const Args& a) {
  int bad = 0;
  const std::vector<std::pair<std::string, std::vector<std::string>>> kinds = {
      {"uncompressed", {}},
      {"zstd", {"checkpoint.compression.codec=zstd", "checkpoint.compression.block_size=4096"}}};
  for (const auto& [name, extra] : kinds) {
    const fs::path root = a.work / ("corrupt_" + name);
    fs::remove_all(root);
    fs::create_directories(root);
    TrainSpec spec;
    spec.run_dir = root / "run";
    spec.ckpt_dir = root / "ckpt";
    spec.sets = {"train.steps=4", "checkpoint.interval=4", "checkpoint.mode=sync"};
    spec.sets.insert(spec.sets.end(), extra.begin(), extra.end());
    RunResult r = run_process(train_argv(spec), {}, 300, (root / "train.log").string());
    if (r.exit_code != 0) {
      std::cerr << "fault_soak: train failed: " << r.output << "\n";
      return 1;
    }
    const double t0 = monotonic_s();
    const FlipStats s = corruption_sweep(spec.ckpt_dir / "step_4", a.corrupt, a.seed);
    std::printf("%s (seed %llu): %lld flips in %.1f s; %lld in stored bytes/metadata: %lld detected "
                "(%.2f%%), %lld benign (zstd frame decodes identically), %zu missed; %lld in "
                "unreferenced bytes\n",
                name.c_str(), static_cast<unsigned long long>(a.seed), static_cast<long long>(s.flips),
                monotonic_s() - t0, static_cast<long long>(s.in_stored_bytes),
                static_cast<long long>(s.detected),
                s.in_stored_bytes ? 100.0 * static_cast<double>(s.detected) / static_cast<double>(s.in_stored_bytes) : 0.0,
                static_cast<long long>(s.benign), s.misses.size(), static_cast<long long>(s.unreferenced));
    for (const auto& m : s.messages_sample) std::printf("  e.g. %s\n", m.substr(0, 240).c_str());
    for (const auto& m : s.misses) std::printf("  MISS %s\n", m.substr(0, 400).c_str());
    bad += static_cast<int>(s.misses.size());
  }
  return bad == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  a.seed = static_cast<uint64_t>(::time(nullptr));
  a.work = fs::temp_directory_path() / ("fault-soak." + std::to_string(getpid()));
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&]() -> std::string { return i + 1 < argc ? argv[++i] : ""; };
    if (arg == "--trials") a.trials = std::atoi(value().c_str());
    else if (arg == "--corrupt") a.corrupt = std::atoll(value().c_str());
    else if (arg == "--seed") a.seed = std::strtoull(value().c_str(), nullptr, 10);
    else if (arg == "--work") a.work = value();
    else if (arg == "--bin") set_binary_dir(value());
    else if (arg == "-h" || arg == "--help") return usage() == 2 ? 0 : 0;
    else return usage();
  }
  if (a.trials < 0 || a.corrupt < 0 || a.work.empty()) return usage();
  fs::create_directories(a.work);
  return a.corrupt > 0 ? run_corrupt_soak(a) : run_kill_soak(a);
}
