#include "crash_check.h"

#include "checkpoint/async/manager.h"
#include "checkpoint/codec/chunk_reader.h"
#include "checkpoint/format/metadata.h"
#include "checkpoint/load.h"
#include "checkpoint/save.h"
#include "checkpoint/storage/checkpoint_dir.h"
#include "support/crash_storage.h"
#include "support/multi_rank.h"

#include <torch/torch.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <stdexcept>

namespace checkpoint::crash {

namespace {

using testing_support::RankContext;
using testing_support::run_ranks;

constexpr const char* kDir = "/ck";
constexpr int kWorld = 2;

// The full tensors saved at `step`: "w" is sharded by rows over the ranks,
// "b" replicated (written once), "pos" a bytes item. Values depend on the
// step, so a checkpoint of one step cannot pass for another.
torch::Tensor full_weight(int64_t step, int64_t rows) {
  return torch::arange(rows * 48, torch::kFloat32).reshape({rows, 48}) / 7 + static_cast<float>(step);
}
torch::Tensor full_bias(int64_t step) {
  return (torch::arange(100, torch::kFloat32) * static_cast<float>(step)).to(torch::kBFloat16);
}
std::vector<uint8_t> position(int64_t step) { return {static_cast<uint8_t>(step), 1, 2, 3}; }

StateDict rank_state(int64_t step, int rank, int world, int64_t rows) {
  StateDict sd;
  const int64_t mine = rows / world;
  sd.add_tensor("w", full_weight(step, rows).narrow(0, rank * mine, mine).clone(), {rows, 48},
                {rank * mine, 0});
  sd.add_tensor("b", full_bias(step));
  sd.add_bytes("pos", position(step));
  return sd;
}

bool same_bits(const torch::Tensor& a, const torch::Tensor& b) {
  if (a.sizes() != b.sizes() || a.scalar_type() != b.scalar_type()) return false;
  const torch::Tensor ca = a.contiguous(), cb = b.contiguous();
  return std::memcmp(ca.data_ptr(), cb.data_ptr(), ca.numel() * ca.element_size()) == 0;
}

// Loads `path` into one process (world 1: a reshard of the 2-rank save) and
// compares with what was saved; "" when bit-exact, else why not.
std::string load_mismatch(const std::shared_ptr<Storage>& storage, const std::string& path, int64_t step,
                          int64_t rows) {
  StateDict sd = rank_state(step, 0, 1, rows);
  for (auto& t : sd.tensors()) t.local.zero_();
  sd.bytes()[0].data.clear();
  LoadOptions lo;
  lo.storage = storage;
  lo.io_threads = 1;
  try {
    load_state_dict(sd, path, lo);
  } catch (const std::exception& e) {
    return std::string("load failed: ") + e.what();
  }
  if (!same_bits(sd.tensors()[0].local, full_weight(step, rows))) return "w differs from what was saved";
  if (!same_bits(sd.tensors()[1].local, full_bias(step))) return "b differs from what was saved";
  if (sd.bytes()[0].data != position(step)) return "pos differs from what was saved";
  return "";
}

// The step directory's step of a log path ("/ck/step_12/..." -> 12).
std::optional<int64_t> step_of(const std::string& path) {
  const size_t at = path.find("/step_");
  if (at == std::string::npos) return std::nullopt;
  size_t end = at + 6;
  while (end < path.size() && path[end] >= '0' && path[end] <= '9') ++end;
  if (end == at + 6) return std::nullopt;
  return std::stoll(path.substr(at + 6, end - at - 6));
}

// --- Running a scenario -----------------------------------------------------

class NoFileFsync final : public StorageWrapper {
 public:
  using StorageWrapper::StorageWrapper;
  std::unique_ptr<WritableFile> create_file(const std::string& path) override {
    struct File final : WritableFile {
      explicit File(std::unique_ptr<WritableFile> f) : inner(std::move(f)) {}
      void append(const void* d, size_t n) override { inner->append(d, n); }
      void write_at(uint64_t o, const void* d, size_t n) override { inner->write_at(o, d, n); }
      void sync() override {}
      void close() override { inner->close(); }
      std::unique_ptr<WritableFile> inner;
    };
    return std::make_unique<File>(inner().create_file(path));
  }
};

class NoDirFsync final : public StorageWrapper {
 public:
  using StorageWrapper::StorageWrapper;
  void sync_dir(const std::string&) override {}
};

struct Scenario {
  std::string mode;  // "save" (save_state_dict) | "sync" | "async" (the manager)
  bool zstd = false;
  int64_t keep_last = 0;
  int64_t steps = 2;
  bool pre_create_dir = true;
};

Scenario scenario_by_name(const std::string& name) {
  if (name == "sync") return {"save", false, 0, 2, false};
  if (name == "sync_zstd") return {"save", true, 0, 2, true};
  if (name == "async_zstd_retention") return {"async", true, 1, 3, true};
  if (name == "sync_retention") return {"sync", false, 2, 3, true};
  throw std::invalid_argument("crash check: no scenario '" + name + "'");
}

CompressionOptions compression(bool zstd) {
  CompressionOptions c;
  if (zstd) {
    c.codec = "zstd";
    c.block_size = 4096;  // several coded blocks per chunk
  }
  return c;
}

std::vector<Op> run_scenario(const Scenario& s, Protocol protocol, int64_t rows) {
  auto crash = std::make_shared<CrashStorage>();
  if (s.pre_create_dir) crash->make_dirs(kDir);
  crash->make_all_durable();
  std::shared_ptr<Storage> storage = crash;
  if (protocol == Protocol::kNoFileFsync) storage = std::make_shared<NoFileFsync>(crash);
  if (protocol == Protocol::kNoDirFsync) storage = std::make_shared<NoDirFsync>(crash);
  const auto returned = [&](int64_t step) { crash->mark("returned " + step_dir_name(step)); };
  run_ranks(kWorld, [&](RankContext& ctx) {
    auto group = ctx.make_group("ckpt");
    if (s.mode == "save") {
      for (int64_t step = 1; step <= s.steps; ++step) {
        SaveOptions so;
        so.step = step;
        so.layout = "crash-check";
        so.compression = compression(s.zstd);
        so.io_threads = 2;
        so.storage = storage;
        save_state_dict(rank_state(step, ctx.rank, kWorld, rows), join_path(kDir, step_dir_name(step)), *group, so);
        if (ctx.rank == 0) returned(step);
      }
      return;
    }
    CheckpointOptions options;
    options.dir = kDir;
    options.interval = 1;
    options.mode = s.mode;
    options.keep_last = s.keep_last;
    options.io_threads = 2;
    options.compression = compression(s.zstd);
    ManagerHooks hooks;
    // The save before `step` (and its retention) ended before this one starts.
    hooks.before_write = [&](int64_t step, int rank) {
      if (rank == 0 && step > 1) returned(step - 1);
    };
    CheckpointManager manager(options, "", *group, "crash-check", storage, hooks);
    for (int64_t step = 1; step <= s.steps; ++step) manager.save(step, rank_state(step, ctx.rank, kWorld, rows));
    manager.finish();
    if (ctx.rank == 0) returned(s.steps);
  });
  return crash->log();
}

// --- Recovery on one crash state ---------------------------------------------

// What recovery sees on one disk image (the same image gives the same
// observation, so it is computed once per distinct image).
struct Observation {
  std::vector<int64_t> committed;
  std::vector<std::string> damaged;  // committed but not intact: "step_N: why"
  std::optional<int64_t> latest;
  std::optional<int64_t> latest_after_retention;
  std::string retention_problem;
};

Observation observe(const Image& image, int64_t keep_last, int64_t rows) {
  Observation obs;
  std::shared_ptr<Storage> storage = materialize(image);
  std::vector<CheckpointEntry> entries;
  try {
    entries = list_checkpoints(*storage, kDir);
    if (auto latest = latest_committed(*storage, kDir)) obs.latest = latest->step;
  } catch (const std::exception& e) {
    obs.damaged.push_back(std::string("listing failed: ") + e.what());
    return obs;
  }
  for (const CheckpointEntry& e : entries) {
    if (!e.committed) continue;
    obs.committed.push_back(e.step);
    const std::string name = step_dir_name(e.step);
    const CheckpointStatusEntry status = checkpoint_status(*storage, e);
    if (status.status != CheckpointStatus::kCommitted) {
      obs.damaged.push_back(name + ": status " + checkpoint_status_name(status.status) + " " + status.error);
      continue;
    }
    try {
      const VerifyReport report = verify_checkpoint(*storage, e.path);
      if (!report.ok()) {
        obs.damaged.push_back(name + ": verify: " + report.problems[0].message);
        continue;
      }
    } catch (const std::exception& ex) {
      obs.damaged.push_back(name + ": verify: " + ex.what());
      continue;
    }
    const std::string mismatch = load_mismatch(storage, e.path, e.step, rows);
    if (!mismatch.empty()) obs.damaged.push_back(name + ": " + mismatch);
  }
  // The next save's retention, on the recovered directory.
  try {
    apply_retention(*storage, kDir, keep_last > 0 ? keep_last : 1);
    if (auto latest = latest_committed(*storage, kDir)) {
      obs.latest_after_retention = latest->step;
      const std::string mismatch = load_mismatch(storage, latest->path, latest->step, rows);
      if (!mismatch.empty()) obs.retention_problem = "after retention: " + mismatch;
    }
  } catch (const std::exception& e) {
    obs.retention_problem = std::string("retention failed: ") + e.what();
  }
  return obs;
}

// What the log says about commits before crash point k.
struct Commits {
  std::set<int64_t> renamed;        // .metadata rename issued
  std::optional<int64_t> durable;   // newest step whose commit completed
};

Commits commits_before(const std::vector<Op>& log, size_t k) {
  Commits c;
  std::map<int64_t, int64_t> renamed_in;  // step directory inode -> step
  for (size_t i = 0; i < k; ++i) {
    const Op& op = log[i];
    const auto newer = [&](int64_t step) { if (!c.durable || step > *c.durable) c.durable = step; };
    if (op.kind == OpKind::kRename && op.to_name == kMetadataFileName) {
      if (auto step = step_of(op.path)) {
        c.renamed.insert(*step);
        renamed_in[op.to_dir] = *step;
      }
    } else if (op.kind == OpKind::kSyncDir && renamed_in.count(op.inode)) {
      newer(renamed_in[op.inode]);  // the protocol's last step: the directory fsync
    } else if (op.kind == OpKind::kMark && op.mark.rfind("returned ", 0) == 0) {
      if (auto step = step_of("/" + op.mark.substr(9))) newer(*step);
    }
  }
  return c;
}

// "" when the observation is correct for a crash after k operations.
std::string judge(const Observation& obs, const Commits& commits) {
  if (!obs.damaged.empty()) return "committed but not intact: " + obs.damaged[0];
  for (int64_t step : obs.committed) {
    if (!commits.renamed.count(step)) return "step_" + std::to_string(step) + " listed committed, never renamed";
  }
  if (commits.durable && (!obs.latest || *obs.latest < *commits.durable)) {
    return "lost the durable commit of step_" + std::to_string(*commits.durable) + " (latest: " +
           (obs.latest ? "step_" + std::to_string(*obs.latest) : std::string("none")) + ")";
  }
  if (!obs.retention_problem.empty()) return obs.retention_problem;
  if (obs.latest_after_retention != obs.latest) return "retention on the recovered directory lost the latest";
  return "";
}

// The loss patterns to try at one crash point (Bound).
std::vector<std::vector<bool>> patterns(size_t n, const Bound& bound, size_t point, bool* exhaustive) {
  std::vector<std::vector<bool>> out;
  *exhaustive = n <= static_cast<size_t>(std::max(0, bound.exhaustive_limit));
  if (*exhaustive) {
    for (uint64_t mask = 0; mask < (uint64_t{1} << n); ++mask) {
      std::vector<bool> keep(n);
      for (size_t j = 0; j < n; ++j) keep[j] = (mask >> j) & 1;
      out.push_back(std::move(keep));
    }
    return out;
  }
  out.push_back(std::vector<bool>(n, true));
  out.push_back(std::vector<bool>(n, false));
  for (size_t j = 0; j < n; ++j) {
    std::vector<bool> one_lost(n, true), one_kept(n, false);
    one_lost[j] = false;
    one_kept[j] = true;
    out.push_back(std::move(one_lost));
    out.push_back(std::move(one_kept));
  }
  std::mt19937_64 rng(bound.seed * 1000003 + point);
  for (int s = 0; s < bound.samples; ++s) {
    std::vector<bool> keep(n);
    for (size_t j = 0; j < n; ++j) keep[j] = rng() & 1;
    out.push_back(std::move(keep));
  }
  return out;
}

std::string describe_pattern(const std::vector<Op>& log, const std::vector<UncertainItem>& items,
                             const std::vector<bool>& keep) {
  std::string lost;
  for (size_t j = 0; j < items.size(); ++j) {
    if (keep[j]) continue;
    lost += lost.empty() ? "" : "; ";
    lost += describe(log[items[j].op]);
    if (log[items[j].op].kind == OpKind::kWrite) lost += " block " + std::to_string(items[j].block);
  }
  return lost.empty() ? "nothing lost" : "lost: " + lost;
}

}  // namespace

std::vector<std::string> scenario_names() {
  return {"sync", "sync_zstd", "async_zstd_retention", "sync_retention"};
}

Report check_scenario(const std::string& name, Protocol protocol, const Bound& bound) {
  Scenario scenario = scenario_by_name(name);
  scenario.steps += std::max(0, bound.extra_saves);
  const int64_t rows = 64 * std::max(1, bound.size);
  const std::vector<Op> log = run_scenario(scenario, protocol, rows);
  Report report;
  report.scenario = name;
  std::map<Image, Observation> seen;
  for (size_t k = 0; k <= log.size(); ++k) {
    if (k > 0 && log[k - 1].kind == OpKind::kMark) continue;  // not a file-system operation
    if (k > 0) ++report.operations;
    ++report.crash_points;
    const std::vector<UncertainItem> items = uncertain_items(log, k);
    report.max_uncertain = std::max(report.max_uncertain, items.size());
    const Commits commits = commits_before(log, k);
    bool exhaustive = false;
    for (const std::vector<bool>& keep : patterns(items.size(), bound, k, &exhaustive)) {
      const Image image = crash_image(log, k, items, keep);
      auto it = seen.find(image);
      if (it == seen.end()) it = seen.emplace(image, observe(image, scenario.keep_last, rows)).first;
      ++report.states;
      const std::string problem = judge(it->second, commits);
      if (problem.empty()) {
        ++report.correct;
        continue;
      }
      ++report.violations;
      std::string kind;  // the problem's first words, steps as "N"
      for (char c : problem.substr(0, problem.find_first_of(":("))) {
        if (c < '0' || c > '9') kind += c;
        else if (kind.empty() || kind.back() != 'N') kind += 'N';
      }
      while (!kind.empty() && kind.back() == ' ') kind.pop_back();
      if (report.violation_kinds[kind]++ == 0) {
        report.examples.push_back("crash after op " + std::to_string(k) + " (" +
                                  (k > 0 ? describe(log[k - 1]) : std::string("start")) + "), " +
                                  describe_pattern(log, items, keep) + ": " + problem);
      }
    }
    if (exhaustive) ++report.exhaustive_points;
  }
  report.distinct_states = seen.size();
  return report;
}

}  // namespace checkpoint::crash
