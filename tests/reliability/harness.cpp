#include "reliability/harness.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>
#include <thread>

#include "checkpoint/codec/chunk_reader.h"
#include "checkpoint/format/metadata.h"
#include "checkpoint/storage/storage.h"
#include "support/paths.h"

namespace reliability {

namespace {

std::string& binary_dir() {
  static std::string dir = testing_support::binary_dir();
  return dir;
}

void sleep_s(double s) { std::this_thread::sleep_for(std::chrono::duration<double>(s)); }

int64_t newest_committed(const fs::path& ckpt_dir) {
  int64_t best = -1;
  for (const auto& c : committed_checkpoints(ckpt_dir)) best = std::max(best, c.step);
  return best;
}

std::string join_lines(const std::vector<std::string>& v, const std::string& sep) {
  std::string out;
  for (const auto& s : v) out += (out.empty() ? "" : sep) + s;
  return out;
}

std::string last_lines(const std::string& text, size_t n) {
  size_t pos = text.size();
  for (size_t i = 0; i <= n && pos != std::string::npos && pos > 0; ++i) {
    pos = text.rfind('\n', pos - 1);
  }
  return pos == std::string::npos ? text : text.substr(pos + 1);
}

// The shared libraries `train` runs on, as the dynamic loader resolves them
// in this environment (LD_PRELOAD and update-alternatives included): a hash of
// the real path, size and mtime of each. Losses depend on them as much as on
// the binary: the same binary rounds differently on the reference BLAS and on
// OpenBLAS, so a reference cached under one must not serve the other.
std::string resolved_libraries_key(const fs::path& scratch_dir) {
  const fs::path listing = scratch_dir / ("ldd." + std::to_string(getpid()) + ".txt");
  RunResult r = run_process({"/usr/bin/ldd", train_binary()}, {}, 60, listing.string());
  fs::remove(listing);
  if (r.exit_code != 0) return "ldd-failed";
  std::string libraries;
  std::istringstream lines(r.output);
  std::string token;
  while (lines >> token) {
    if (token.empty() || token[0] != '/') continue;  // names, "=>", load addresses
    std::error_code ec;
    fs::path real = fs::canonical(token, ec);
    struct stat st {};
    if (ec || ::stat(real.c_str(), &st) != 0) continue;
    libraries += real.string() + ":" + std::to_string(st.st_size) + ":" +
                 std::to_string(st.st_mtim.tv_sec) + "\n";
  }
  uint64_t hash = 1469598103934665603ull;  // FNV-1a: stable across runs and builds
  for (unsigned char c : libraries) hash = (hash ^ c) * 1099511628211ull;
  std::ostringstream out;
  out << std::hex << hash;
  return out.str();
}

}  // namespace

void set_binary_dir(const std::string& dir) { binary_dir() = dir; }
std::string train_binary() { return binary_dir() + "/train"; }
std::string ckpt_binary() { return binary_dir() + "/ckpt"; }
std::string default_config() { return testing_support::source_dir() + "/configs/default.yaml"; }

// checkpoint.direct_io=true: O_DIRECT writes (the way auto's probe picks on
// the CI machine, 1.3 against 0.16 GB/s), without the probe's 64 MiB each
// way at every start: 0.5-2 s of each of the hundreds of train starts in
// these tests. The probe and auto's choices have tests of their own
// (DirectIoChoice.*, StorageTest.AutoDirectIo*); a filesystem that refuses
// O_DIRECT still falls back to the page cache.
std::vector<std::string> small_model_sets() {
  return {"train.steps=40",        "train.log_every=1",      "train.global_batch_size=8",
          "model.d_model=32",      "model.n_layers=1",       "model.n_heads=4",
          "model.seq_len=16",      "optim.warmup_steps=4",   "checkpoint.interval=2",
          "checkpoint.keep_last=2", "checkpoint.io_threads=2", "dist.timeout_s=10",
          "checkpoint.direct_io=true"};
}

std::vector<std::string> train_argv(const TrainSpec& spec) {
  std::vector<std::string> argv{binary_dir() + "/" + spec.binary, "--config",
                                spec.config.empty() ? default_config() : spec.config};
  if (spec.nproc > 0) {
    argv.push_back("--nproc");
    argv.push_back(std::to_string(spec.nproc));
  }
  if (spec.nodes > 1) {
    argv.push_back("--nodes");
    argv.push_back(std::to_string(spec.nodes));
  }
  std::vector<std::string> sets;
  if (spec.small_model) sets = small_model_sets();
  sets.push_back("run.dir=" + spec.run_dir.string());
  sets.push_back("checkpoint.dir=" + spec.ckpt_dir.string());
  sets.insert(sets.end(), spec.sets.begin(), spec.sets.end());
  for (const auto& s : sets) {
    argv.push_back("--set");
    argv.push_back(s);
  }
  return argv;
}

std::map<int64_t, double> read_losses(const fs::path& metrics_jsonl) {
  std::map<int64_t, double> out;
  std::ifstream in(metrics_jsonl);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.is_object() || j.contains("event")) continue;
    if (!j.contains("step") || !j.contains("loss")) continue;
    out[j["step"].get<int64_t>()] = j["loss"].get<double>();
  }
  return out;
}

std::vector<CommittedCheckpoint> committed_checkpoints(const fs::path& ckpt_dir) {
  std::vector<CommittedCheckpoint> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(ckpt_dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("step_", 0) != 0) continue;
    char* end = nullptr;
    const long long step = std::strtoll(name.c_str() + 5, &end, 10);
    if (end == name.c_str() + 5 || *end != '\0') continue;
    if (fs::is_regular_file(e.path() / ".metadata", ec)) out.push_back({step, e.path()});
  }
  std::sort(out.begin(), out.end(),
            [](const CommittedCheckpoint& a, const CommittedCheckpoint& b) { return a.step < b.step; });
  return out;
}

std::vector<fs::path> uncommitted_dirs(const fs::path& ckpt_dir) {
  std::vector<fs::path> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(ckpt_dir, ec)) {
    if (e.path().filename().string().rfind("step_", 0) != 0) continue;
    if (!fs::exists(e.path() / ".metadata", ec)) out.push_back(e.path());
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::string verify_problems(const fs::path& step_dir) {
  try {
    auto storage = checkpoint::posix_storage();
    checkpoint::VerifyReport report = checkpoint::verify_checkpoint(*storage, step_dir.string());
    std::string out;
    for (const auto& p : report.problems) {
      out += "item '" + p.item + "' chunk " + std::to_string(p.chunk) + " (" + p.file +
             "): " + p.message + "\n";
    }
    return out;
  } catch (const std::exception& e) {
    return std::string("verify threw: ") + e.what() + "\n";
  }
}

std::string train_binary_key() {
  struct stat st {};
  ::stat(train_binary().c_str(), &st);
  return std::to_string(st.st_size) + ":" + std::to_string(st.st_mtim.tv_sec) + "." +
         std::to_string(st.st_mtim.tv_nsec);
}

std::map<int64_t, double> reference_losses(const std::string& mode, const fs::path& cache_dir,
                                           std::string* error) {
  const std::string binary_key = train_binary_key() + ":" + join_lines(small_model_sets(), ",") + ":" + mode;
  fs::create_directories(cache_dir);
  const std::string key = binary_key + ":libs " + resolved_libraries_key(cache_dir);
  const fs::path cache = cache_dir / ("reference_" + mode + ".json");
  {
    std::ifstream in(cache);
    if (in) {
      nlohmann::json j = nlohmann::json::parse(in, nullptr, false);
      if (!j.is_discarded() && j.value("key", "") == key) {
        std::map<int64_t, double> out;
        for (const auto& [s, l] : j["losses"].items()) out[std::stoll(s)] = l.get<double>();
        return out;
      }
    }
  }
  const fs::path root = cache_dir / ("reference_" + mode + "." + std::to_string(getpid()));
  fs::remove_all(root);
  fs::create_directories(root);
  TrainSpec spec;
  spec.run_dir = root / "run";
  spec.ckpt_dir = root / "ckpt";
  spec.sets = {"checkpoint.mode=" + mode, "checkpoint.resume=never"};
  RunResult r = run_process(train_argv(spec), {}, 300, (root / "train.log").string());
  if (r.exit_code != 0) {
    if (error) *error = "reference run failed (exit " + std::to_string(r.exit_code) + "): " + last_lines(r.output, 15);
    return {};
  }
  auto losses = read_losses(spec.run_dir / "metrics.jsonl");
  nlohmann::json j;
  j["key"] = key;
  for (const auto& [s, l] : losses) j["losses"][std::to_string(s)] = l;
  const fs::path tmp = cache.string() + "." + std::to_string(getpid());
  {
    std::ofstream out(tmp);
    out << j.dump();
  }
  fs::rename(tmp, cache);
  fs::remove_all(root);
  return losses;
}

std::string compare_losses(const std::map<int64_t, double>& resumed,
                           const std::map<int64_t, double>& reference, int64_t after_step) {
  if (reference.empty()) return "empty reference";
  const int64_t last = reference.rbegin()->first;
  std::ostringstream out;
  int bad = 0;
  for (int64_t s = after_step + 1; s <= last; ++s) {
    auto it = resumed.find(s);
    auto rt = reference.find(s);
    if (rt == reference.end()) continue;
    if (it == resumed.end()) {
      if (bad++ < 3) out << "step " << s << " missing; ";
      continue;
    }
    if (std::memcmp(&it->second, &rt->second, sizeof(double)) != 0) {
      if (bad++ < 3) {
        out.precision(17);
        out << "step " << s << " loss " << it->second << " != reference " << rt->second << "; ";
      }
    }
  }
  if (bad == 0) return "";
  return std::to_string(bad) + " step(s) differ: " + out.str();
}

// ---- kill trials ------------------------------------------------------------------

KillTrial draw_kill_trial(int index, std::mt19937_64& rng, const fs::path& root) {
  static const char* kModes[] = {"sync", "async", "overlap"};
  static const char* kPoints[] = {"random", "during_save", "after_commit"};
  static const char* kVictims[] = {"rank0", "rank1", "all", "launcher"};
  KillTrial t;
  t.index = index;
  t.mode = kModes[rng() % 3];
  t.kill_point = kPoints[rng() % 3];
  t.victim = kVictims[rng() % 4];
  // Save number k (1..18): step 2k, so kills land all through the run.
  t.delay_s = t.kill_point == "random" ? std::uniform_real_distribution<double>(0.0, 1.5)(rng)
                                       : static_cast<double>(1 + rng() % 18);
  t.root = root;
  return t;
}

namespace {

// Waits for the kill point; returns false when the launcher exited first.
bool wait_for_kill_point(const KillTrial& t, Process& launcher, const fs::path& run_dir,
                         const fs::path& ckpt_dir, std::string* note) {
  const double deadline = monotonic_s() + 240;
  if (t.kill_point == "random") {
    // From the first step's line: startup time varies a lot under load.
    const fs::path metrics = run_dir / "metrics.jsonl";
    while (read_losses(metrics).empty()) {
      if (launcher.poll() || monotonic_s() > deadline) return false;
      sleep_s(0.005);
    }
    const double until = monotonic_s() + t.delay_s;
    while (monotonic_s() < until) {
      if (launcher.poll()) return false;
      sleep_s(0.002);
    }
    return true;
  }
  const int64_t target = 2 * static_cast<int64_t>(t.delay_s);
  const fs::path dir = ckpt_dir / ("step_" + std::to_string(target));
  std::error_code ec;
  while (monotonic_s() < deadline) {
    if (launcher.poll()) return false;
    if (t.kill_point == "during_save" && fs::exists(dir, ec)) {
      if (fs::exists(dir / ".metadata", ec)) *note = "(save already committed when seen)";
      return true;
    }
    if (t.kill_point == "after_commit" && fs::exists(dir / ".metadata", ec)) return true;
    // A later committed step means we missed it (retention may delete it).
    if (newest_committed(ckpt_dir) > target) {
      *note = "(missed step " + std::to_string(target) + ")";
      return true;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(300));
  }
  return false;
}

std::string describe_state(const fs::path& ckpt_dir) {
  std::vector<std::string> parts;
  for (const auto& c : committed_checkpoints(ckpt_dir)) parts.push_back(std::to_string(c.step));
  std::string s = "committed {" + join_lines(parts, ",") + "}";
  parts.clear();
  for (const auto& d : uncommitted_dirs(ckpt_dir)) parts.push_back(d.filename().string());
  if (!parts.empty()) s += " uncommitted {" + join_lines(parts, ",") + "}";
  return s;
}

}  // namespace

KillOutcome run_kill_trial(const KillTrial& t, const std::map<int64_t, double>& reference) {
  KillOutcome o;
  fs::remove_all(t.root);
  fs::create_directories(t.root);
  const fs::path ckpt_dir = t.root / "ckpt";
  TrainSpec spec;
  spec.run_dir = t.root / "killed";
  spec.ckpt_dir = ckpt_dir;
  spec.sets = {"checkpoint.mode=" + t.mode, "checkpoint.resume=never"};
  std::ostringstream detail;
  auto fail = [&](const std::string& why) {
    o.ok = false;
    o.summary = why;
    o.detail = detail.str();
    return o;
  };

  std::vector<pid_t> ranks;
  int launcher_status = -1;
  {
    Process launcher(train_argv(spec), {}, (t.root / "killed.log").string());
    std::string note;
    const bool reached = wait_for_kill_point(t, launcher, spec.run_dir, ckpt_dir, &note);
    o.killed_after_committed = newest_committed(ckpt_dir);
    o.state_at_kill = describe_state(ckpt_dir) + (note.empty() ? "" : " " + note);
    if (!reached) {
      launcher_status = launcher.wait_for(60);
      o.state_at_kill = "run ended before the kill point (exit " + std::to_string(launcher_status) + ")";
    } else {
      ranks = child_pids(launcher.pid());
      if (t.victim == "rank0" || t.victim == "rank1") {
        const pid_t victim = wait_for_rank_pid(launcher.pid(), t.victim == "rank0" ? 0 : 1, 30);
        if (victim < 0) return fail("no rank process to kill");
        ::kill(victim, SIGKILL);
      } else if (t.victim == "all") {
        launcher.kill_tree();
      } else {  // launcher: its ranks hear of it through PDEATHSIG (SIGHUP)
        launcher.signal(SIGKILL);
      }
      bool timed_out = false;
      launcher_status = launcher.wait_for(120, &timed_out);
      if (timed_out) detail << "launcher did not exit within 120 s after the kill; ";
    }
  }
  // Ranks orphaned by a killed launcher stop on their own (SIGTERM, a final
  // save, or SIGPIPE on their dead stdout); bounded wait, then SIGKILL.
  const int stragglers = wait_gone_or_kill(ranks, 60);
  detail << "launcher exit " << launcher_status << "; after kill: " << describe_state(ckpt_dir);
  if (stragglers > 0) detail << "; " << stragglers << " rank(s) had to be SIGKILLed after 60 s";

  // Every committed checkpoint is intact, and the newest one from before the
  // kill was not lost (only a newer commit may have replaced it).
  for (const auto& c : committed_checkpoints(ckpt_dir)) {
    const std::string problems = verify_problems(c.path);
    if (!problems.empty()) return fail("committed " + c.path.filename().string() + " damaged: " + problems);
  }
  const int64_t newest = newest_committed(ckpt_dir);
  if (newest < o.killed_after_committed) {
    return fail("committed step_" + std::to_string(o.killed_after_committed) +
                " lost (newest now " + std::to_string(newest) + ")");
  }

  // Resume with the same checkpoint.dir and a fresh run.dir.
  TrainSpec resume = spec;
  resume.run_dir = t.root / "resumed";
  resume.sets = {"checkpoint.mode=" + t.mode, "checkpoint.resume=auto"};
  RunResult r = run_process(train_argv(resume), {}, 300, (t.root / "resumed.log").string());
  if (r.exit_code != 0) {
    return fail("resume run exit " + std::to_string(r.exit_code) + (r.timed_out ? " (timed out)" : "") +
                ": " + last_lines(r.output, 6));
  }
  if (newest >= 0) {
    const std::string want = "resumed from " + (ckpt_dir / ("step_" + std::to_string(newest))).string() + " ";
    if (!contains(r.output, want)) return fail("no '" + want + "' line in the resume run");
  } else if (contains(r.output, "resumed from")) {
    return fail("resumed although nothing was committed");
  }
  o.resumed_from = newest;
  const std::string diff = compare_losses(read_losses(resume.run_dir / "metrics.jsonl"), reference,
                                          std::max<int64_t>(newest, 0));
  if (!diff.empty()) return fail("losses after resume differ from the reference: " + diff);
  o.ok = true;
  o.summary = newest >= 0 ? "resumed@" + std::to_string(newest) + " ok" : "fresh ok";
  o.detail = detail.str();
  return o;
}

// ---- corruption sweep ---------------------------------------------------------------

namespace {

struct Range {
  uint64_t lo = 0, hi = 0;
  bool transformed = false;
};

void write_byte(const fs::path& file, uint64_t offset, uint8_t value) {
  const int fd = ::open(file.c_str(), O_WRONLY);
  if (fd < 0) throw std::runtime_error("open " + file.string() + ": " + std::strerror(errno));
  const ssize_t w = ::pwrite(fd, &value, 1, static_cast<off_t>(offset));
  ::close(fd);
  if (w != 1) throw std::runtime_error("pwrite " + file.string());
}

uint8_t read_byte(const fs::path& file, uint64_t offset) {
  std::ifstream in(file, std::ios::binary);
  in.seekg(static_cast<std::streamoff>(offset));
  char c = 0;
  in.get(c);
  return static_cast<uint8_t>(c);
}

}  // namespace

FlipStats corruption_sweep(const fs::path& step_dir, int64_t count, uint64_t seed) {
  FlipStats stats;
  const checkpoint::CheckpointMeta meta =
      checkpoint::read_committed_metadata(*checkpoint::posix_storage(), step_dir.string());
  std::map<std::string, std::vector<Range>> covered;
  for (const auto& item : meta.items) {
    for (const auto& c : item.chunks) {
      for (const auto& b : c.blocks) {
        covered[c.file].push_back({c.offset + b.stored_offset, c.offset + b.stored_offset + b.stored_length,
                                   !c.transforms.empty()});
      }
    }
  }
  std::vector<std::pair<fs::path, uint64_t>> files;
  uint64_t total = 0;
  for (const auto& e : fs::directory_iterator(step_dir)) {
    if (!e.is_regular_file()) continue;
    files.emplace_back(e.path(), e.file_size());
    total += e.file_size();
  }
  std::sort(files.begin(), files.end());
  std::mt19937_64 rng(seed);
  for (int64_t i = 0; i < count; ++i) {
    uint64_t at = rng() % total;
    size_t f = 0;
    while (at >= files[f].second) at -= files[f++].second;
    const fs::path& file = files[f].first;
    const std::string name = file.filename().string();
    const bool is_meta = name == ".metadata";
    bool referenced = is_meta, transformed = false;
    for (const Range& r : covered[name]) {
      if (at >= r.lo && at < r.hi) {
        referenced = true;
        transformed = r.transformed;
      }
    }
    const uint8_t original = read_byte(file, at);
    const uint8_t flipped = static_cast<uint8_t>(original ^ (1 + rng() % 255));
    write_byte(file, at, flipped);
    bool detected = false;
    std::string message;
    if (is_meta) {
      const std::string bytes = read_text_file(file.string());
      try {
        checkpoint::decode_metadata(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(),
                                    file.string());
      } catch (const checkpoint::FormatError& e) {
        detected = true;
        message = e.what();
      }
    }
    const std::string problems = verify_problems(step_dir);
    detected = is_meta ? detected && !problems.empty() : !problems.empty();
    if (message.empty()) message = problems;
    write_byte(file, at, original);
    ++stats.flips;
    const std::string where = name + "@" + std::to_string(at) + " " + std::to_string(original) + "->" +
                              std::to_string(flipped);
    if (!referenced) {
      ++stats.unreferenced;
      if (detected) ++stats.unreferenced_detected;
      continue;
    }
    ++stats.in_stored_bytes;
    if (detected) {
      ++stats.detected;
      // Errors must name the file they are about.
      if (!contains(message, name)) stats.misses.push_back(where + ": detected but message does not name the file: " + message);
      if (stats.messages_sample.size() < 4) stats.messages_sample.push_back(where + ": " + message);
    } else if (transformed) {
      // verify checked every block checksum of the decoded bytes: the frame
      // still decodes to the same logical bytes (e.g. an unused header bit).
      ++stats.benign;
    } else {
      stats.misses.push_back(where + ": not detected");
    }
  }
  return stats;
}

}  // namespace reliability
