// The deeper crash-consistency run behind scripts/crash-check (not a test):
// every scenario of crash_check.h with the real protocol, then the two
// deliberately broken protocols (which must show violations). Prints a table
// and one JSON line; exits 1 if the real protocol has a violation or a broken
// one has none. Each row and the JSON give the process's peak RSS so far
// ("peak_rss_mib"): the deep run once used 21.8 GB, so memory is watched.
//
//   crash_check [--exhaustive N] [--samples S] [--seed X] [--size K] [--extra-saves E]
//               [--scenario NAME]   (repeatable: only these; default all)
#include "crash_check.h"

#include <algorithm>
#include <chrono>
#include <map>
#include <vector>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include <sys/resource.h>

using namespace checkpoint::crash;

namespace {

const char* protocol_name(Protocol p) {
  switch (p) {
    case Protocol::kReal: return "real";
    case Protocol::kNoFileFsync: return "no-file-fsync";
    case Protocol::kNoDirFsync: return "no-dir-fsync";
    case Protocol::kRetryFailedFsync: return "retry-failed-fsync";
  }
  return "?";
}

// The process's peak resident memory so far, in MiB (ru_maxrss is KiB on Linux).
long peak_rss_mib() {
  rusage usage{};
  if (getrusage(RUSAGE_SELF, &usage) != 0) return -1;
  return usage.ru_maxrss / 1024;
}

}  // namespace

int main(int argc, char** argv) {
  Bound bound;
  bound.exhaustive_limit = 12;
  bound.samples = 256;
  std::vector<std::string> only;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    const long long value = std::atoll(argv[i + 1]);
    if (flag == "--scenario") only.push_back(argv[i + 1]);
    else if (flag == "--exhaustive") bound.exhaustive_limit = static_cast<int>(value);
    else if (flag == "--samples") bound.samples = static_cast<int>(value);
    else if (flag == "--seed") bound.seed = static_cast<uint64_t>(value);
    else if (flag == "--size") bound.size = static_cast<int>(value);
    else if (flag == "--extra-saves") bound.extra_saves = static_cast<int>(value);
    else {
      std::fprintf(stderr, "crash_check: unknown flag %s\n", flag.c_str());
      return 2;
    }
  }
  std::printf("crash-check: exhaustive up to %d uncertain items, else %d random patterns + extremes "
              "(seed %llu); w has %d rows, %d extra saves per scenario\n\n", bound.exhaustive_limit,
              bound.samples, static_cast<unsigned long long>(bound.seed), 64 * bound.size, bound.extra_saves);
  std::printf("| scenario | protocol | runs | ops | crash points | exhaustive points | max uncertain | states | "
              "distinct | correct | violations | s | peak RSS MiB |\n"
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  std::string json = "{\"exhaustive_limit\":" + std::to_string(bound.exhaustive_limit) +
                     ",\"size\":" + std::to_string(bound.size) +
                     ",\"extra_saves\":" + std::to_string(bound.extra_saves) +
                     ",\"samples\":" + std::to_string(bound.samples) + ",\"runs\":[";
  bool ok = true;
  size_t states = 0, correct = 0, violations = 0;
  std::string examples, details;
  bool first = true;
  // Each broken protocol on the scenario that shows it.
  const std::map<Protocol, std::string> broken = {{Protocol::kNoFileFsync, "sync"},
                                                  {Protocol::kNoDirFsync, "async_zstd_retention"},
                                                  {Protocol::kRetryFailedFsync, "eio_sync"}};
  for (Protocol protocol : {Protocol::kReal, Protocol::kNoFileFsync, Protocol::kNoDirFsync,
                            Protocol::kRetryFailedFsync}) {
    for (const std::string& scenario : scenario_names()) {
      if (!only.empty() && std::find(only.begin(), only.end(), scenario) == only.end()) continue;
      if (protocol != Protocol::kReal && broken.at(protocol) != scenario) continue;
      const auto t0 = std::chrono::steady_clock::now();
      const Report r = check_scenario(scenario, protocol, bound);
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      const long rss_mib = peak_rss_mib();  // the process's so far: this row and the rows before
      std::printf("| %s | %s | %zu | %zu | %zu | %zu | %zu | %zu | %zu | %zu | %zu | %.1f | %ld |\n",
                  scenario.c_str(), protocol_name(protocol), r.runs, r.operations, r.crash_points,
                  r.exhaustive_points, r.max_uncertain, r.states, r.distinct_states, r.correct, r.violations, s,
                  rss_mib);
      std::fflush(stdout);
      if (protocol == Protocol::kReal) {
        states += r.states;
        correct += r.correct;
        violations += r.violations;
        if (r.violations > 0) ok = false;
      } else if (r.violations == 0) {
        ok = false;
        examples += "  " + scenario + " " + protocol_name(protocol) + ": the broken protocol was NOT caught\n";
      }
      for (const std::string& d : r.runs_detail) details += "  " + scenario + " " + protocol_name(protocol) + ": " + d + "\n";
      for (const auto& [kind, count] : r.violation_kinds) {
        examples += "  " + scenario + " " + protocol_name(protocol) + ": " + std::to_string(count) +
                    " x " + kind + "\n";
      }
      for (const std::string& e : r.examples) {
        examples += "    e.g. " + e + "\n";
      }
      json += std::string(first ? "" : ",") + "{\"scenario\":\"" + scenario + "\",\"protocol\":\"" +
              protocol_name(protocol) + "\",\"scenario_runs\":" + std::to_string(r.runs) +
              ",\"ops\":" + std::to_string(r.operations) +
              ",\"crash_points\":" + std::to_string(r.crash_points) +
              ",\"exhaustive_points\":" + std::to_string(r.exhaustive_points) +
              ",\"states\":" + std::to_string(r.states) + ",\"distinct\":" +
              std::to_string(r.distinct_states) + ",\"correct\":" + std::to_string(r.correct) +
              ",\"violations\":" + std::to_string(r.violations) +
              ",\"peak_states_held\":" + std::to_string(r.peak_states_held) +
              ",\"peak_rss_mib\":" + std::to_string(rss_mib) + "}";
      first = false;
    }
  }
  json += "],\"real\":{\"states\":" + std::to_string(states) + ",\"correct\":" + std::to_string(correct) +
          ",\"violations\":" + std::to_string(violations) + "},\"peak_rss_mib\":" +
          std::to_string(peak_rss_mib()) + "}";
  std::printf("\nreal protocol: %zu states explored, %zu correct, %zu violations; peak RSS %ld MiB\n", states,
              correct, violations, peak_rss_mib());
  if (!details.empty()) std::printf("failed fsyncs, one run each:\n%s", details.c_str());
  if (!examples.empty()) std::printf("examples:\n%s", examples.c_str());
  std::printf("%s\n", json.c_str());
  return ok ? 0 : 1;
}
