#include "crash_check.h"

#include "checkpoint/async/manager.h"
#include "checkpoint/codec/chunk_reader.h"
#include "checkpoint/format/metadata.h"
#include "checkpoint/interop/export.h"
#include "checkpoint/load.h"
#include "checkpoint/save.h"
#include "checkpoint/layout/checkpoint_dir.h"
#include "checkpoint/save_seam.h"
#include "checkpoint/storage/memory.h"
#include "checkpoint/tiers/local_tier.h"
#include "support/crash_storage.h"
#include "support/multi_rank.h"

#include <torch/torch.h>
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <stdexcept>
#include <tuple>
#include <unordered_map>
#include <unordered_set>

namespace checkpoint::crash {

namespace {

using testing_support::RankContext;
using testing_support::run_ranks;

constexpr const char* kDir = "/ck";
constexpr const char* kLocalPattern = "/local/node{node}";  // one node per rank
constexpr const char* kOutDir = "/out";
constexpr int kWorld = 2;

// The full tensors saved at `step`: "model.w" is sharded by rows over the
// ranks, "model.b" replicated (written once), "pos" a bytes item. Values depend on the
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
  sd.add_tensor("model.w", full_weight(step, rows).narrow(0, rank * mine, mine).clone(), {rows, 48},
                {rank * mine, 0});
  sd.add_tensor("model.b", full_bias(step));
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

// A file whose sync() runs `sync` on the wrapped file instead.
class SyncReplacedFile final : public WritableFile {
 public:
  SyncReplacedFile(std::unique_ptr<WritableFile> inner, std::function<void(WritableFile&)> sync)
      : inner_(std::move(inner)), sync_(std::move(sync)) {}
  void append(const void* d, size_t n) override { inner_->append(d, n); }
  void write_at(uint64_t o, const void* d, size_t n) override { inner_->write_at(o, d, n); }
  void sync() override { sync_(*inner_); }
  void close() override { inner_->close(); }

 private:
  std::unique_ptr<WritableFile> inner_;
  std::function<void(WritableFile&)> sync_;
};

class NoFileFsync final : public StorageWrapper {
 public:
  using StorageWrapper::StorageWrapper;
  std::unique_ptr<WritableFile> create_file(const std::string& path) override {
    return std::make_unique<SyncReplacedFile>(inner().create_file(path), [](WritableFile&) {});
  }
};

class NoDirFsync final : public StorageWrapper {
 public:
  using StorageWrapper::StorageWrapper;
  void sync_dir(const std::string&) override {}
};

// What PostgreSQL did before fsyncgate: a sync that fails is tried again,
// and a retry that succeeds is taken to mean the data is on disk.
void retry_once_on_eio(const std::function<void()>& sync) {
  try {
    sync();
  } catch (const IoError& e) {
    if (e.error_number() != EIO) throw;
    sync();
  }
}

class RetryFailedFsync final : public StorageWrapper {
 public:
  using StorageWrapper::StorageWrapper;
  std::unique_ptr<WritableFile> create_file(const std::string& path) override {
    return std::make_unique<SyncReplacedFile>(inner().create_file(path), [](WritableFile& f) {
      retry_once_on_eio([&] { f.sync(); });
    });
  }
  void sync_dir(const std::string& path) override {
    retry_once_on_eio([&] { inner().sync_dir(path); });
  }
};

std::shared_ptr<Storage> with_protocol(const std::shared_ptr<CrashStorage>& crash, Protocol protocol) {
  switch (protocol) {
    case Protocol::kReal: return crash;
    case Protocol::kNoFileFsync: return std::make_shared<NoFileFsync>(crash);
    case Protocol::kNoDirFsync: return std::make_shared<NoDirFsync>(crash);
    case Protocol::kRetryFailedFsync: return std::make_shared<RetryFailedFsync>(crash);
  }
  return crash;
}

struct Scenario {
  std::string mode;  // "save" (save_state_dict) | "sync" | "async" | "overlap" (the manager)
  bool zstd = false;
  int64_t keep_last = 0;
  int64_t steps = 2;
  bool pre_create_dir = true;
  bool tiers = false;     // 2 nodes (one per rank), local tier, partner copies, flush every 2nd
  int64_t eio_step = 0;   // > 0: one fsync of this step's save fails (a run per fsync)
  std::string kind = "saves";  // "saves" | "set_aside" | "export"
};

Scenario scenario_by_name(const std::string& name) {
  Scenario s;
  if (name == "sync") s = {"save", false, 0, 2, false};
  else if (name == "sync_zstd") s = {"save", true, 0, 2, true};
  else if (name == "async_zstd_retention") s = {"async", true, 1, 3, true};
  else if (name == "sync_retention") s = {"sync", false, 2, 3, true};
  else if (name == "overlap_retention") s = {"overlap", false, 1, 3, true};
  else if (name == "tiers_sync") s = {"sync", false, 0, 3, true, true};
  else if (name == "tiers_async") s = {"async", true, 0, 3, true, true};
  else if (name == "eio_sync") s = {"sync", false, 0, 3, true, false, 2};
  else if (name == "eio_async") s = {"async", false, 0, 3, true, false, 2};
  else if (name == "set_aside") s = {"sync", false, 0, 2, true, false, 0, "set_aside"};
  else if (name == "export") s = {"save", false, 0, 1, true, false, 0, "export"};
  else throw std::invalid_argument("crash check: no scenario '" + name + "'");
  return s;
}

CompressionOptions compression(bool zstd) {
  CompressionOptions c;
  if (zstd) {
    c.codec = checkpoint::Codec::kZstd;
    c.block_size = 4096;  // several coded blocks per chunk
  }
  return c;
}

// A scenario's run: its log, and what it saw while running.
struct Run {
  std::vector<Op> log;
  size_t sync_begin = 0, sync_end = 0;  // sync calls of the eio_step's save (a dry run)
  std::string failed_sync;              // the fsync that failed ("" when none did)
  int ranks_failed = 0;                 // ranks whose save of eio_step threw
  std::string live_problem;             // what the live directory showed after a failure
};

CheckpointOptions manager_options(const Scenario& s) {
  CheckpointOptions options;
  options.dir = kDir;
  options.interval = 1;
  options.mode = parse_save_mode(s.mode);  // a manager scenario: sync | async | overlap
  options.keep_last = s.keep_last;
  options.io_threads = 2;
  options.compression = compression(s.zstd);
  if (s.tiers) {
    options.local.dir = kLocalPattern;
    options.local.keep_last = 1;
    options.local.partner = true;
    options.durable.every = 2;
  }
  return options;
}

// Runs the saves of `s`. fail_sync: the index of the sync call that fails
// with EIO (nullopt: none).
Run run_scenario(const Scenario& s, Protocol protocol, int64_t rows, std::optional<size_t> fail_sync = {}) {
  auto crash = std::make_shared<CrashStorage>();
  if (s.pre_create_dir) crash->make_dirs(kDir);
  if (s.tiers) crash->make_dirs("/local");
  crash->make_all_durable();
  if (fail_sync) crash->fail_sync_call(*fail_sync);
  std::shared_ptr<Storage> storage = with_protocol(crash, protocol);
  Run run;
  std::mutex mu;
  std::set<int64_t> failed_steps;
  const auto returned = [&](int64_t step) {
    std::lock_guard<std::mutex> lock(mu);
    if (!failed_steps.count(step)) crash->mark("returned " + step_dir_name(step));
  };
  std::atomic<int> ranks_failed{0};
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
    test_seam::SaveSeam seam;
    // The save before `step` (and its retention) ended before this one starts.
    seam.before_write = [&](int64_t step, int rank) {
      if (rank != 0) return;
      if (step == s.eio_step) run.sync_begin = crash->sync_calls();
      if (step == s.eio_step + 1) run.sync_end = crash->sync_calls();
      if (step > 1) returned(step - 1);
    };
    CheckpointManager manager(manager_options(s), "", *group, "crash-check", storage);
    test_seam::set_save_seam(manager, std::move(seam));
    if (s.tiers) manager.set_placement({ctx.rank, storage});
    for (int64_t step = 1; step <= s.steps; ++step) {
      try {
        manager.save(step, rank_state(step, ctx.rank, kWorld, rows), step == s.steps);
        if (s.mode == "overlap") manager.wait_staged();
      } catch (const CheckpointError&) {
        // A failed save: sync mode reports it from its own save(), the
        // others from the next one; the trainer goes on with a new save.
        if (!fail_sync || step < s.eio_step || step > s.eio_step + 1) throw;
        ++ranks_failed;
        if (ctx.rank == 0) {
          std::lock_guard<std::mutex> lock(mu);
          failed_steps.insert(s.eio_step);
          crash->mark("failed " + step_dir_name(s.eio_step));
        }
        if (step == s.eio_step + 1) --step;  // the save this call did not start
      }
    }
    manager.finish();
    if (ctx.rank == 0) returned(s.steps);
  });
  run.failed_sync = crash->failed_sync();
  run.ranks_failed = ranks_failed.load();
  if (!run.failed_sync.empty()) {
    for (const CheckpointEntry& e : list_checkpoints(*crash, kDir)) {
      if (e.step == s.eio_step && e.committed) run.live_problem = "the failed save is committed in the live directory";
    }
  }
  run.log = crash->log();
  return run;
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

// Ordered, so that equal observations are kept once (check_saves).
bool operator<(const Observation& a, const Observation& b) {
  return std::tie(a.committed, a.damaged, a.latest, a.latest_after_retention, a.retention_problem) <
         std::tie(b.committed, b.damaged, b.latest, b.latest_after_retention, b.retention_problem);
}

// The files of a local candidate gathered into one step directory of a
// fresh memory storage, as restore_local gathers them on the loading ranks;
// "" when every file was there (a partner copy checked against its XXH3).
std::string gather_local(Storage& storage, const ResumeCandidate& c, Storage& out, const std::string& out_path) {
  const auto local_step = [&](int node) {
    return join_path(local_tier_dir(kLocalPattern, node), step_dir_name(c.step));
  };
  out.make_dirs(out_path);
  const auto copy = [&](const std::string& from, const std::string& name) {
    const std::vector<uint8_t> bytes = storage.read_file(from, uint64_t{1} << 30);
    auto file = out.create_file(join_path(out_path, name));
    file->append(bytes.data(), bytes.size());
    file->close();
  };
  try {
    copy(join_path(local_step(c.metadata_node), kMetadataFileName), kMetadataFileName);
    for (const FileSource& src : c.sources) {
      std::string dir = local_step(src.node);
      if (src.partner) {
        const std::string problem = check_partner_copy(storage, dir, src.file);
        if (!problem.empty()) return problem;
        dir = join_path(dir, kPartnerDirName);
      }
      copy(join_path(dir, src.file.name), src.file.name);
    }
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

// Tiers: what resume would choose on this image, each candidate loaded.
Observation observe_tiers(const Image& image, int64_t rows) {
  Observation obs;
  std::shared_ptr<Storage> storage = materialize(image);
  try {
    std::vector<NodeInventory> nodes;
    for (int node = 0; node < kWorld; ++node) {
      nodes.push_back(inventory_local_tier(*storage, local_tier_dir(kLocalPattern, node), node));
    }
    const TierChoice choice = choose_resume_tiers(nodes, list_checkpoints(*storage, kDir));
    for (const ResumeCandidate& c : choice.candidates) {
      const std::string name = std::string(tier_name(c.tier)) + " " + step_dir_name(c.step);
      if (!obs.latest) obs.latest = c.step;
      obs.committed.push_back(c.step);
      std::shared_ptr<Storage> from = storage;
      std::string path = c.durable_path;
      if (c.tier == Tier::kLocal) {
        from = memory_storage();
        path = join_path("/gathered", step_dir_name(c.step));
        const std::string problem = gather_local(*storage, c, *from, path);
        if (!problem.empty()) {
          obs.damaged.push_back(name + ": " + problem);
          continue;
        }
      }
      const std::string mismatch = load_mismatch(from, path, c.step, rows);
      if (!mismatch.empty()) obs.damaged.push_back(name + ": " + mismatch);
    }
  } catch (const std::exception& e) {
    obs.damaged.push_back(std::string("choosing the resume tier failed: ") + e.what());
  }
  obs.latest_after_retention = obs.latest;  // retention is the manager's (not re-run here)
  return obs;
}

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
  std::set<int64_t> renamed;        // .metadata rename issued (any tier)
  std::optional<int64_t> durable;   // newest step whose commit completed
  std::set<int64_t> failed;         // saves reported failed (eio scenarios)
};

Commits commits_before(const std::vector<Op>& log, size_t k) {
  Commits c;
  std::map<int64_t, int64_t> renamed_in;  // checkpoint.dir step directory inode -> step
  const std::string durable_tier = std::string(kDir) + "/";
  for (size_t i = 0; i < k; ++i) {
    const Op& op = log[i];
    const auto newer = [&](int64_t step) { if (!c.durable || step > *c.durable) c.durable = step; };
    if (op.kind == OpKind::kRename && op.to_name == kMetadataFileName) {
      if (auto step = step_of(op.path)) {
        c.renamed.insert(*step);
        // One node's local commit alone does not make a step loadable.
        if (op.path.rfind(durable_tier, 0) == 0) renamed_in[op.to_dir] = *step;
      }
    } else if (op.kind == OpKind::kSyncDir && renamed_in.count(op.inode)) {
      // The protocol's last step: the directory fsync. A failed one leaves
      // the rename uncertain for good.
      if (!op.failed) newer(renamed_in[op.inode]);
      renamed_in.erase(op.inode);
    } else if (op.kind == OpKind::kMark && op.mark.rfind("returned ", 0) == 0) {
      if (auto step = step_of("/" + op.mark.substr(9))) newer(*step);
    } else if (op.kind == OpKind::kMark && op.mark.rfind("failed ", 0) == 0) {
      if (auto step = step_of("/" + op.mark.substr(7))) c.failed.insert(*step);
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
  if (obs.latest && commits.failed.count(*obs.latest)) {
    return "a failed save is the latest: step_" + std::to_string(*obs.latest);
  }
  if (!obs.retention_problem.empty()) return obs.retention_problem;
  if (obs.latest_after_retention != obs.latest) return "retention on the recovered directory lost the latest";
  return "";
}

// The loss patterns to try at one crash point (Bound), made one at a time:
// a crash point may have 2^N of them, and only the current one is held.
class LossPatterns {
 public:
  LossPatterns(size_t n, const Bound& bound, size_t point)
      : n_(n),
        exhaustive_(n <= static_cast<size_t>(std::max(0, bound.exhaustive_limit))),
        count_(exhaustive_ ? uint64_t{1} << n : 2 + 2 * uint64_t{n} + std::max(0, bound.samples)),
        rng_(bound.seed * 1000003 + point) {}

  bool exhaustive() const { return exhaustive_; }

  // Writes the next pattern into `keep` (true: the item is kept); false when
  // every pattern was made. The order: exhaustive, mask 0, 1, ... (bit j is
  // item j); else all kept, all lost, item 0 alone lost, item 0 alone kept,
  // item 1 ..., then the random ones.
  bool next(std::vector<bool>& keep) {
    if (made_ == count_) return false;
    const uint64_t i = made_++;
    keep.assign(n_, false);
    if (exhaustive_) {
      for (size_t j = 0; j < n_; ++j) keep[j] = (i >> j) & 1;
    } else if (i < 2) {
      keep.assign(n_, i == 0);
    } else if (i < 2 + 2 * uint64_t{n_}) {
      const bool one_lost = (i - 2) % 2 == 0;
      keep.assign(n_, one_lost);
      keep[(i - 2) / 2] = !one_lost;
    } else {
      for (size_t j = 0; j < n_; ++j) keep[j] = rng_() & 1;
    }
    return true;
  }

 private:
  size_t n_;
  bool exhaustive_;
  uint64_t count_;
  uint64_t made_ = 0;
  std::mt19937_64 rng_;  // drawn from only by the random patterns, in order
};

// A crash state's identity: XXH3-128 over its paths and contents, each
// length-prefixed. Distinct states are counted, and recovery's observations
// cached, by this rather than by the image: keeping every distinct image
// took 21.8 GB at scripts/crash-check 16. Two different images share one
// fingerprint with odds of about 2^-128 a pair (below 2^-80 for 10^7 states).
struct Fingerprint {
  uint64_t low = 0, high = 0;
  bool operator==(const Fingerprint& other) const { return low == other.low && high == other.high; }
};

struct FingerprintHash {
  size_t operator()(const Fingerprint& f) const { return static_cast<size_t>(f.low); }
};

Fingerprint fingerprint(const Image& image) {
  const std::unique_ptr<XXH3_state_t, XXH_errorcode (*)(XXH3_state_t*)> state(XXH3_createState(),
                                                                                &XXH3_freeState);
  TORCH_INTERNAL_ASSERT(state && XXH3_128bits_reset(state.get()) == XXH_OK);
  const auto add = [&](const void* data, uint64_t size) {
    XXH3_128bits_update(state.get(), &size, sizeof size);
    XXH3_128bits_update(state.get(), data, size);
  };
  for (const auto& [path, bytes] : image) {
    add(path.data(), path.size());
    add(bytes.data(), bytes.size());
  }
  const XXH128_hash_t digest = XXH3_128bits_digest(state.get());
  return {digest.low64, digest.high64};
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

// Every crash point of `log` and the loss patterns `bound` allows there:
// `check(k, image, id)` says what is wrong with recovering from `image`, a
// crash after the first k operations whose fingerprint is `id` ("" when
// nothing). Counts go into `report`. Each state is made, checked and freed
// before the next: memory does not grow with the number of states, only
// with the distinct ones' fingerprints (16 bytes each).
using StateCheck = std::function<std::string(size_t k, const Image& image, const Fingerprint& id)>;

void explore(const std::vector<Op>& log, const Bound& bound, const StateCheck& check, Report& report) {
  std::unordered_set<Fingerprint, FingerprintHash> distinct;
  size_t states_held = 0;
  for (const Op& op : log) report.operations += op.kind != OpKind::kMark;
  for (size_t k = 0; k <= log.size(); ++k) {
    // A mark is not a file-system operation: a crash just before it leaves
    // the disk a crash just after it does, which is judged knowing the mark
    // (e.g. that the save had returned).
    if (k < log.size() && log[k].kind == OpKind::kMark) continue;
    ++report.crash_points;
    const std::vector<UncertainItem> items = uncertain_items(log, k);
    report.max_uncertain = std::max(report.max_uncertain, items.size());
    LossPatterns patterns(items.size(), bound, k);
    std::vector<bool> keep;
    while (patterns.next(keep)) {
      std::string problem;
      {
        const Image image = crash_image(log, k, items, keep);
        report.peak_states_held = std::max(report.peak_states_held, ++states_held);
        const Fingerprint id = fingerprint(image);
        distinct.insert(id);
        problem = check(k, image, id);
      }  // the image is freed here, before the next state is made
      --states_held;
      ++report.states;
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
    if (patterns.exhaustive()) ++report.exhaustive_points;
  }
  report.distinct_states += distinct.size();
}

// A violation found while the scenario ran (not in a crash state).
void add_run_violation(Report& report, const std::string& problem) {
  ++report.violations;
  if (report.violation_kinds[problem]++ == 0) report.examples.push_back(problem);
}

// Saves (sync, async, overlap, tiers): recovery by the rules of crash_check.h.
void check_saves(const Scenario& scenario, const Run& run, int64_t rows, const Bound& bound, Report& report) {
  // Recovery runs once per distinct state (the same disk, the same
  // observation). The cache maps a state's fingerprint to one of the few
  // different observations rather than keeping one per state: each kept
  // copy's texts sat between the next states' large short-lived buffers,
  // and the heap grew by about 11 KB per distinct state (2.4 GB in the
  // deep run's `sync` without file fsyncs).
  std::set<Observation> observations;
  std::unordered_map<Fingerprint, const Observation*, FingerprintHash> seen;
  const StateCheck check = [&](size_t k, const Image& image, const Fingerprint& id) {
    auto it = seen.find(id);
    if (it == seen.end()) {
      Observation obs = scenario.tiers ? observe_tiers(image, rows) : observe(image, scenario.keep_last, rows);
      it = seen.emplace(id, &*observations.insert(std::move(obs)).first).first;
    }
    return judge(*it->second, commits_before(run.log, k));
  };
  explore(run.log, bound, check, report);
  ++report.runs;
}

// eio_*: one run per sync call of the eio_step's save, that call failing.
void check_failed_fsyncs(const Scenario& scenario, Protocol protocol, int64_t rows, const Bound& bound,
                         Report& report) {
  const Run dry = run_scenario(scenario, Protocol::kReal, rows);
  if (dry.sync_end <= dry.sync_begin) {
    add_run_violation(report, "no fsync seen in the save of step_" + std::to_string(scenario.eio_step));
    return;
  }
  for (size_t call = dry.sync_begin; call < dry.sync_end; ++call) {
    const Run run = run_scenario(scenario, protocol, rows, call);
    const std::string which = " (" + run.failed_sync + ")";
    if (run.failed_sync.empty()) {
      add_run_violation(report, "sync call " + std::to_string(call) + " was not reached");
      continue;
    }
    if (protocol == Protocol::kReal && run.ranks_failed != kWorld) {
      add_run_violation(report, "the save with a failed fsync failed on " + std::to_string(run.ranks_failed) +
                                    " of " + std::to_string(kWorld) + " ranks" + which);
    }
    if (!run.live_problem.empty()) add_run_violation(report, run.live_problem + which);
    const size_t states = report.states, violations = report.violations;
    check_saves(scenario, run, rows, bound, report);
    report.runs_detail.push_back(run.failed_sync + ": the save failed on " + std::to_string(run.ranks_failed) +
                                 " of " + std::to_string(kWorld) + " ranks, " +
                                 std::to_string(report.states - states) + " states, " +
                                 std::to_string(report.violations - violations) + " violations");
  }
}

// The bytes under `path` in `image` ("" key: the file itself; "/name": a
// file of the directory), empty when absent.
std::map<std::string, std::vector<uint8_t>> entries_under(const Image& image, const std::string& path) {
  std::map<std::string, std::vector<uint8_t>> out;
  for (auto it = image.lower_bound(path); it != image.end() && it->first.rfind(path, 0) == 0; ++it) {
    const std::string rest = it->first.substr(path.size());
    if (rest.empty() || rest[0] == '/') out[rest] = it->second;
  }
  return out;
}

// set_aside: step 2's data is damaged; two ranks resume with fallback.
void check_set_aside(Protocol protocol, int64_t rows, const Bound& bound, Report& report) {
  auto crash = std::make_shared<CrashStorage>();
  crash->make_dirs(kDir);
  crash->make_all_durable();
  std::shared_ptr<Storage> storage = with_protocol(crash, protocol);
  const Scenario s = scenario_by_name("set_aside");
  run_ranks(kWorld, [&](RankContext& ctx) {
    auto group = ctx.make_group("ckpt");
    CheckpointManager manager(manager_options(s), "", *group, "crash-check", storage);
    for (int64_t step = 1; step <= s.steps; ++step) manager.save(step, rank_state(step, ctx.rank, kWorld, rows));
    manager.finish();
  });
  // A flipped byte in the middle of rank 1's data file of step 2.
  const std::string victim = join_path(join_path(kDir, step_dir_name(2)), "rank_1.data");
  std::vector<uint8_t> bytes = crash->read_file(victim, uint64_t{1} << 30);
  bytes[bytes.size() / 2] ^= 0x5a;
  crash->remove_all(victim);
  auto file = crash->create_file(victim);
  file->append(bytes.data(), bytes.size());
  file->close();
  crash->make_all_durable();
  crash->mark("damaged");
  const size_t start = crash->log().size();
  std::atomic<int> resumed_from_1{0};
  run_ranks(kWorld, [&](RankContext& ctx) {
    auto group = ctx.make_group("ckpt");
    CheckpointManager manager(manager_options(s), "", *group, "crash-check", storage);
    StateDict state = rank_state(1, ctx.rank, kWorld, rows);
    for (auto& t : state.tensors()) t.local.zero_();
    const std::optional<ResumeResult> r = manager.resume(state);
    if (r && r->path == join_path(kDir, step_dir_name(1)) && r->skipped.size() == 1) ++resumed_from_1;
    if (ctx.rank == 0) crash->mark("resumed");
  });
  if (resumed_from_1 != kWorld) add_run_violation(report, "resume did not skip the damaged step_2 and load step_1");
  const std::vector<Op> log = crash->log();
  const Image damaged = crash_image(log, start, {}, {});
  const std::string step2 = join_path(kDir, step_dir_name(2));
  const auto original = entries_under(damaged, step2);
  const StateCheck check = [&](size_t k, const Image& image, const Fingerprint&) -> std::string {
    if (k < start) return "";  // the saves before the damage are the other scenarios' business
    const auto here = entries_under(image, step2);
    const auto aside = entries_under(image, step2 + kSetAsideSuffix);
    if (!here.empty() && !aside.empty()) return "step_2 is under both names";
    if (here.empty() && aside.empty()) return "step_2 is under neither name";
    if ((here.empty() ? aside : here) != original) return "step_2 changed while set aside";
    bool resumed = false;
    for (size_t i = 0; i < k; ++i) resumed = resumed || (log[i].kind == OpKind::kMark && log[i].mark == "resumed");
    if (resumed && aside.empty()) return "resume returned, but the set-aside rename was lost";
    const std::string mismatch = load_mismatch(materialize(image), join_path(kDir, step_dir_name(1)), 1, rows);
    return mismatch.empty() ? "" : "step_1: " + mismatch;
  };
  explore(log, bound, check, report);
  ++report.runs;
}

// export: a committed step exported as safetensors (twice), torch.save and
// DCP; each output is absent or one whole export in every crash state.
void check_export(Protocol protocol, int64_t rows, const Bound& bound, Report& report) {
  const Scenario s = scenario_by_name("export");
  Run saved = run_scenario(s, Protocol::kReal, rows);
  auto crash = std::make_shared<CrashStorage>();
  // The committed checkpoint, made durable; then the exports.
  for (const auto& [path, bytes] : crash_image(saved.log, saved.log.size(), {}, {})) {
    if (path.back() == '/') {
      crash->make_dirs(path.substr(0, path.size() - 1));
      continue;
    }
    auto file = crash->create_file(path);
    file->append(bytes.data(), bytes.size());
    file->close();
  }
  crash->make_dirs(kOutDir);
  crash->make_all_durable();
  const size_t start = crash->log().size();
  std::shared_ptr<Storage> storage = with_protocol(crash, protocol);
  struct Output {
    std::string path;
    std::vector<std::map<std::string, std::vector<uint8_t>>> versions;  // each complete export
  };
  std::vector<Output> outputs;
  const auto export_one = [&](ExportFormat format, const std::string& name, std::optional<DType> dtype) {
    ExportOptions eo;
    eo.format = format;
    eo.dtype = dtype;
    eo.io_threads = 1;
    eo.slab_bytes = 4096;  // several slabs per tensor
    eo.storage = storage;
    if (format == ExportFormat::kDcp) eo.only = "model";  // no optimizer state in this checkpoint
    const std::string out = join_path(kOutDir, name);
    export_checkpoint(join_path(kDir, step_dir_name(1)), out, eo);
    auto it = std::find_if(outputs.begin(), outputs.end(), [&](const Output& o) { return o.path == out; });
    if (it == outputs.end()) it = outputs.insert(outputs.end(), Output{out, {}});
    it->versions.push_back(entries_under(crash_image(crash->log(), crash->log().size(), {}, {}), out));
  };
  try {
    export_one(ExportFormat::kSafetensors, "w.safetensors", std::nullopt);
    export_one(ExportFormat::kTorch, "w.pt", std::nullopt);
    export_one(ExportFormat::kDcp, "dcp", std::nullopt);
    export_one(ExportFormat::kSafetensors, "w.safetensors", DType::kBFloat16);  // replaces the first
  } catch (const std::exception& e) {
    add_run_violation(report, std::string("export failed: ") + e.what());
    return;
  }
  const std::vector<Op> log = crash->log();
  const StateCheck check = [&](size_t k, const Image& image, const Fingerprint&) -> std::string {
    if (k < start) return "";
    for (const Output& o : outputs) {
      const auto here = entries_under(image, o.path);
      if (here.empty()) continue;
      if (std::find(o.versions.begin(), o.versions.end(), here) == o.versions.end()) {
        return o.path + " looks complete but is not a whole export (" + std::to_string(here.size()) + " entries)";
      }
    }
    return "";
  };
  explore(log, bound, check, report);
  ++report.runs;
}

}  // namespace

std::vector<std::string> scenario_names() {
  return {"sync",         "sync_zstd", "async_zstd_retention", "sync_retention", "overlap_retention",
          "tiers_sync",   "tiers_async", "eio_sync",           "eio_async",      "set_aside",
          "export"};
}

Report check_scenario(const std::string& name, Protocol protocol, const Bound& bound) {
  Scenario scenario = scenario_by_name(name);
  const int64_t rows = 64 * std::max(1, bound.size);
  Report report;
  report.scenario = name;
  if (scenario.kind == "set_aside") {
    check_set_aside(protocol, rows, bound, report);
  } else if (scenario.kind == "export") {
    check_export(protocol, rows, bound, report);
  } else if (scenario.eio_step > 0) {
    check_failed_fsyncs(scenario, protocol, rows, bound, report);
  } else {
    scenario.steps += std::max(0, bound.extra_saves);
    check_saves(scenario, run_scenario(scenario, protocol, rows), rows, bound, report);
  }
  return report;
}

}  // namespace checkpoint::crash
