#include "checkpoint/async/manager.h"

#include "checkpoint/codec/chunk_reader.h"
#include "checkpoint/codec/transforms.h"

#include "checkpoint/agreement.h"
#include "checkpoint/error_text.h"
#include "checkpoint/format/checksum.h"
#include "checkpoint/format/metadata.h"
#include "checkpoint/format/wire.h"
#include "checkpoint/storage/checkpoint_dir.h"
#include "checkpoint/timing.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <set>
#include <unordered_map>

namespace checkpoint {

namespace {

using Clock = std::chrono::steady_clock;
using framework::dist::Bytes;

// Piece size of file transfers between ranks (partner copies, restores).
constexpr size_t kPieceBytes = 8 << 20;
constexpr uint64_t kMaxMetadataBytes = 1ull << 34;

Bytes u64_bytes(uint64_t v) {
  Bytes b(8);
  std::memcpy(b.data(), &v, 8);
  return b;
}

uint64_t bytes_u64(const Bytes& b, size_t at) {
  uint64_t v = 0;
  std::memcpy(&v, b.data() + at, 8);
  return v;
}

// What one side of a file transfer saw.
struct TransferResult {
  std::string send_error;  // this rank could not read what it sent
  std::string recv_error;  // what it received is not what was sent, or could not be stored
  uint64_t recv_xxh3 = 0;
};

// Streams `send_path` (send_n bytes, read from `send_storage`) to member `to`
// while receiving recv_n bytes from member `from` into `recv_tmp`, which is
// renamed to `recv_path` once complete and verified (the sender's XXH3 of
// what it read, and `expect_xxh3` when given). A side is off with to / from
// = -1. A local failure does not stop the exchange (the peer would wait for
// the bytes): the sender then sends zeros and says so in the trailer.
// Throws only DistError (the group is broken then).
TransferResult transfer_file(framework::dist::Group& group, Storage* send_storage,
                             const std::string& send_path, uint64_t send_n, int to,
                             Storage* recv_storage, const std::string& recv_tmp,
                             const std::string& recv_path, uint64_t recv_n, int from,
                             std::optional<uint64_t> expect_xxh3) {
  TransferResult out;
  const bool sending = to >= 0, receiving = from >= 0;
  std::unique_ptr<WritableFile> file;
  if (receiving) {
    try {
      file = recv_storage->create_file(recv_tmp);
    } catch (const std::exception& e) {
      out.recv_error = error_text(e);
    }
  }
  std::vector<uint8_t> sbuf(sending ? std::min<uint64_t>(send_n, kPieceBytes) : 0);
  std::vector<uint8_t> rbuf(receiving ? std::min<uint64_t>(recv_n, kPieceBytes) : 0);
  Xxh3Stream send_hash, recv_hash;
  for (uint64_t done_s = 0, done_r = 0; (sending && done_s < send_n) || (receiving && done_r < recv_n);) {
    const size_t ns = sending ? static_cast<size_t>(std::min<uint64_t>(send_n - done_s, kPieceBytes)) : 0;
    const size_t nr = receiving ? static_cast<size_t>(std::min<uint64_t>(recv_n - done_r, kPieceBytes)) : 0;
    if (ns > 0) {
      if (out.send_error.empty()) {
        try {
          send_storage->read_at(send_path, done_s, sbuf.data(), ns);
        } catch (const std::exception& e) {
          out.send_error = error_text(e);
        }
      }
      if (!out.send_error.empty()) std::fill(sbuf.begin(), sbuf.begin() + ns, 0);
      send_hash.update(sbuf.data(), ns);
    }
    group.send_recv(sbuf.data(), ns, ns > 0 ? to : -1, rbuf.data(), nr, nr > 0 ? from : -1);
    if (nr > 0) {
      recv_hash.update(rbuf.data(), nr);
      if (file && out.recv_error.empty()) {
        try {
          file->append(rbuf.data(), nr);
        } catch (const std::exception& e) {
          out.recv_error = error_text(e);
        }
      }
    }
    done_s += ns;
    done_r += nr;
  }
  // Trailer: whether the sender read its file, and the XXH3 of what it sent.
  Bytes trailer_out(16, 0), trailer_in(16, 0);
  if (sending) {
    const uint64_t ok = out.send_error.empty() ? 1 : 0, h = send_hash.digest();
    std::memcpy(trailer_out.data(), &ok, 8);
    std::memcpy(trailer_out.data() + 8, &h, 8);
  }
  group.send_recv(trailer_out.data(), sending ? 16 : 0, to, trailer_in.data(), receiving ? 16 : 0, from);
  if (receiving) {
    out.recv_xxh3 = recv_hash.digest();
    if (out.recv_error.empty() && bytes_u64(trailer_in, 0) != 1) {
      out.recv_error = "the sender could not read " + recv_path + "'s source";
    }
    if (out.recv_error.empty() && bytes_u64(trailer_in, 8) != out.recv_xxh3) {
      out.recv_error = recv_path + ": XXH3 of the bytes received differs from the sender's";
    }
    if (out.recv_error.empty() && expect_xxh3 && *expect_xxh3 != out.recv_xxh3) {
      out.recv_error = recv_path + ": XXH3 " + std::to_string(out.recv_xxh3) +
                       " differs from the recorded " + std::to_string(*expect_xxh3);
    }
    try {
      if (file) {
        if (out.recv_error.empty()) file->sync();
        file->close();
      }
      if (out.recv_error.empty()) {
        recv_storage->rename(recv_tmp, recv_path);
      } else {
        recv_storage->remove_all(recv_tmp);
      }
    } catch (const std::exception& e) {
      if (out.recv_error.empty()) out.recv_error = error_text(e);
    }
  }
  return out;
}

// Copies `from` to `to` within or across storages, fsyncing the copy; the
// XXH3 of the bytes copied.
uint64_t copy_file(Storage& src, const std::string& from, Storage& dst, const std::string& to) {
  const uint64_t size = src.file_size(from);
  std::unique_ptr<WritableFile> out = dst.create_file(to);
  std::vector<uint8_t> buf(static_cast<size_t>(std::min<uint64_t>(size, kPieceBytes)));
  Xxh3Stream hash;
  for (uint64_t at = 0; at < size;) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(size - at, kPieceBytes));
    src.read_at(from, at, buf.data(), n);
    hash.update(buf.data(), n);
    out->append(buf.data(), n);
    at += n;
  }
  out->sync();
  out->close();
  return hash.digest();
}

// Every rank's message, or throws CheckpointError(prefix + the failures).
std::vector<Bytes> agree(framework::dist::Group& group, const std::string& error,
                         const Bytes& payload, const std::string& prefix) {
  std::vector<Bytes> all =
      group.all_gather_bytes(error.empty() ? tagged_ok(payload) : tagged_error(error));
  const std::string failures = describe_rank_failures(all);
  if (!failures.empty()) throw CheckpointError(prefix + " (" + failures + ")");
  return all;
}

}  // namespace

// Which node each member of the checkpoint group is on (all-gathered once).
struct CheckpointManager::Topology {
  std::vector<int> node_of_rank;
  std::vector<int> nodes;         // distinct, ascending
  std::map<int, std::vector<int>> ranks_of_node;
  int node = 0;
  bool leader = false;            // the lowest rank of its node
  int partner_to = -1;            // the rank this one's file is copied to
  int partner_from = -1;          // the rank whose file this one keeps
  std::string no_partner;         // why there are no partner copies
  int leader_of(int node) const { return ranks_of_node.at(node).front(); }
};

struct CheckpointManager::Job {
  int64_t step = 0;
  StateDict source;  // overlap: the live state, staged by the worker
  StateDict staged;  // what is written
  CheckpointEvent event;
  bool staged_done = false;     // guarded by mu_
  bool done = false;            // guarded by mu_
  bool blocking_final = false;  // guarded by mu_
  bool reported = false;        // guarded by mu_
  bool device_copy_in_flight = false;  // overlap on a GPU: staged by save(), still copying
  Clock::time_point started;
  std::exception_ptr error;
  // Tiers.
  bool final = false;
  bool flush = false;       // flush this one to the durable tier
  bool local_done = false;  // committed in the local tier (sync mode: by save())
  std::string local_path;   // this rank's node's step directory
  std::vector<uint8_t> metadata;
  std::vector<uint64_t> file_bytes;  // by rank
  Clock::time_point local_committed;
};

CheckpointManager::CheckpointManager(CheckpointOptions options, std::string default_dir,
                                     framework::dist::Group& group, std::string layout,
                                     std::shared_ptr<Storage> storage, ManagerHooks hooks)
    : options_(std::move(options)),
      dir_(options_.dir.empty() ? std::move(default_dir) : options_.dir),
      group_(group),
      layout_(std::move(layout)),
      mode_(parse_save_mode(options_.mode)),
      plan_cache_(options_.plan_cache ? std::make_shared<SavePlanCache>() : nullptr),
      storage_(std::move(storage)),
      hooks_(std::move(hooks)) {
  set_placement(TierPlacement{});
}

void CheckpointManager::set_placement(TierPlacement placement) {
  placement_ = std::move(placement);
  local_storage_ = placement_.local_storage ? placement_.local_storage : storage_;
  local_dir_ = tiered() ? local_tier_dir(options_.local.dir, placement_.node) : "";
  topology_.reset();
}

CheckpointManager::~CheckpointManager() {
  try {
    wait_in_flight();
  } catch (...) {
    // The caller chose not to call finish(); the error was theirs to see.
  }
  wait_retention();
}

std::string CheckpointManager::wait_retention() {
  if (retention_.joinable()) retention_.join();
  std::string error;
  error.swap(retention_error_);
  return error;
}

bool CheckpointManager::due(int64_t step, int64_t last_step) const {
  return options_.interval > 0 && (step % options_.interval == 0 || step == last_step);
}

bool CheckpointManager::busy() const {
  std::lock_guard<std::mutex> lock(mu_);
  return in_flight_ && !in_flight_->done;
}

std::optional<std::string> CheckpointManager::resume_path() {
  std::string error, path;
  if (group_.rank() == 0) {
    try {
      path = resolve_resume(*storage_, options_.resume, dir_).value_or("");
    } catch (const std::exception& e) {
      error = error_text(e);
    }
  }
  auto reply = group_.broadcast_bytes(tagged_result(error, path), 0);
  std::string text = tagged_text(reply);
  if (!tagged_succeeded(reply)) throw CheckpointError("checkpoint.resume: " + text);
  if (text.empty()) return std::nullopt;
  return text;
}

// (all ranks) What resume tries, in order: the newest committed checkpoint
// and, with resume_fallback, the older ones; or the one checkpoint.resume
// names. Resolved by rank 0 and broadcast.
std::vector<std::string> CheckpointManager::resume_candidates() {
  std::string error, list;
  if (group_.rank() == 0) {
    try {
      if (options_.resume == "auto" && options_.resume_fallback) {
        const std::vector<CheckpointEntry> entries = list_checkpoints(*storage_, dir_);
        for (auto it = entries.rbegin(); it != entries.rend(); ++it) {
          if (it->committed) list += it->path + "\n";
        }
      } else if (auto path = resolve_resume(*storage_, options_.resume, dir_)) {
        list = *path + "\n";
      }
    } catch (const std::exception& e) {
      error = error_text(e);
    }
  }
  auto reply = group_.broadcast_bytes(tagged_result(error, list), 0);
  const std::string text = tagged_text(reply);
  if (!tagged_succeeded(reply)) throw CheckpointError("checkpoint.resume: " + text);
  std::vector<std::string> paths;
  for (size_t pos = 0, end; (end = text.find('\n', pos)) != std::string::npos; pos = end + 1) {
    paths.push_back(text.substr(pos, end - pos));
  }
  return paths;
}

// (rank 0) Renames a checkpoint that failed to load out of the step_<N>
// names; returns the new path ("" when the rename failed).
std::string CheckpointManager::set_aside(const std::string& path) {
  // Names parse_set_aside_dir_name knows, so `ckpt list` shows them.
  std::string target = path + kSetAsideSuffix;
  for (int i = 1; storage_->exists(target); ++i) target = path + kSetAsideSuffix + "." + std::to_string(i);
  try {
    storage_->rename(path, target);
    storage_->sync_dir(parent_dir(path));
    return target;
  } catch (const std::exception&) {
    return "";
  }
}

std::optional<ResumeResult> CheckpointManager::resume(StateDict& state) {
  if (tiered() && options_.resume == "auto") return resume_tiered(state);
  const std::vector<std::string> candidates = resume_candidates();
  ResumeResult result;
  for (const std::string& path : candidates) {
    try {
      result.stats = load(state, path);
      result.path = path;
      return result;
    } catch (const CheckpointDamagedError& e) {
      // Only damage is skipped: a state that does not match the checkpoint
      // (changed model, partial state) fails the run and sets nothing aside.
      if (candidates.size() == 1) throw;
      SkippedCheckpoint skip{path, "", error_text(e)};
      if (group_.rank() == 0) skip.moved_to = set_aside(path);
      result.skipped.push_back(std::move(skip));
    }
  }
  if (candidates.empty()) return std::nullopt;
  std::string message = "checkpoint.resume: no committed checkpoint in " + dir_ + " loads:";
  for (const SkippedCheckpoint& s : result.skipped) message += "\n  " + s.path + ": " + s.error;
  throw CheckpointError(message);
}

LoadStats CheckpointManager::load(StateDict& state, const std::string& path) {
  return load_from(state, path, storage_);
}

LoadStats CheckpointManager::load_from(StateDict& state, const std::string& path,
                                       const std::shared_ptr<Storage>& storage) {
  LoadOptions lo;
  lo.allow_partial = options_.allow_partial;
  lo.optional = hooks_.optional_items;
  lo.io_threads = options_.io_threads;
  lo.storage = storage;
  if (options_.model_only) {
    lo.filter = [](const std::string& name) { return name.rfind("model.", 0) == 0; };
  }
  LoadStats stats;
  std::string error;
  bool damaged = false;  // this rank's failure is the checkpoint's bytes
  try {
    if (HostStaging::has_device_tensors(state)) {
      // GPU state loads through the pinned staging buffers: they start as a
      // copy of the state (items a partial load leaves alone keep their
      // values), take the checkpoint's bytes, and go back host to device.
      wait_in_flight();
      StateDict host = staging_.stage(state);
      staging_.wait();
      stats = load_state_dict(host, path, lo);
      staging_.to_device(state, host);
    } else {
      stats = load_state_dict(state, path, lo);
    }
  } catch (const std::exception& e) {
    error = error_text(e);
    // Damage: metadata or data that cannot be right, truncated files; else
    // the state does not match (names, dtypes, shapes).
    damaged = is_damage(e);
  }
  // Every rank fails together, so none is left alone in a later collective.
  const std::string all =
      describe_rank_failures(group_.all_gather_bytes(tagged_result(error, "")));
  if (all.empty()) return stats;
  // Every rank takes this second collective, as every rank saw a failure:
  // the checkpoint is damaged only when no rank's failure was a mismatch.
  const std::string mismatch = describe_rank_failures(
      group_.all_gather_bytes(tagged_result(!error.empty() && !damaged ? "mismatch" : "", "")));
  const std::string message = "loading checkpoint " + path + " failed (" + all + ")";
  if (mismatch.empty()) throw CheckpointDamagedError(message);
  throw CheckpointError(message);
}

void CheckpointManager::reserve_staging(const StateDict& state) {
  wait_in_flight();
  staging_.reserve(state);
}

uint64_t CheckpointManager::staging_bytes() const { return staging_.bytes(); }
bool CheckpointManager::staging_pinned() const { return staging_.pinned(); }

void CheckpointManager::persist(std::shared_ptr<Job> job) {
  try {
    if (job->device_copy_in_flight) {
      // Overlap on a GPU: the copies were enqueued by save(); the compute
      // stream already waits for them, the host waits here.
      staging_.wait();
      job->event.stage_s = seconds_since(job->started);
      {
        std::lock_guard<std::mutex> lock(mu_);
        job->staged_done = true;
      }
      cv_.notify_all();
    } else if (mode_ == SaveMode::kOverlap) {
      auto t = Clock::now();
      job->staged = staging_.stage(job->source);
      job->source = StateDict();
      job->event.stage_s = seconds_since(t);
      {
        std::lock_guard<std::mutex> lock(mu_);
        job->staged_done = true;
      }
      cv_.notify_all();
    }
    if (tiered()) {
      if (!job->local_done) save_local(*job);
      finish_tiers(*job);
    } else {
    if (hooks_.before_write) hooks_.before_write(job->step, group_.rank());
    SaveOptions so;
    so.step = job->step;
    so.layout = layout_;
    so.compression = options_.compression;
    so.io_threads = options_.io_threads;
    so.info = {{"mode", options_.mode}};
    so.storage = storage_;
    so.plan_cache = plan_cache_;
    SaveStats st = save_state_dict(job->staged, job->event.path, group_, so);
    job->event.plan_s = st.plan_s;
    job->event.plan_cached = st.plan_cached;
    job->event.write_s = st.plan_s + st.write_s;
    job->event.commit_s = st.commit_s;
    job->event.bytes = st.total_logical_bytes;
    job->event.stored_bytes = st.total_stored_bytes;
    // Only committed checkpoints older than the newest keep_last go; never
    // the one just written, never one without metadata (it may be in flight).
    // Sync mode: on its own thread, so that the loop waits for the commit
    // only; the next save and finish() wait for it.
    if (group_.rank() == 0 && options_.keep_last > 0) {
      if (mode_ == SaveMode::kSync) {
        const int64_t step = job->step;
        retention_ = std::thread([this, step] {
          try {
            apply_retention(*storage_, dir_, options_.keep_last, step);
          } catch (const std::exception& e) {
            retention_error_ = "retention after the checkpoint of step " + std::to_string(step) +
                               " failed: " + error_text(e);
          }
        });
      } else {
        apply_retention(*storage_, dir_, options_.keep_last, job->step);
      }
    }
    }
  } catch (...) {
    record_failure(*job);
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    job->staged_done = true;
    job->done = true;
  }
  cv_.notify_all();
}

// In a catch block: the job failed with the exception in flight.
void CheckpointManager::record_failure(Job& job) {
  job.error = std::current_exception();
  try {
    throw;
  } catch (const CheckpointError& e) {
    job.event.ok = false;
    job.event.error = error_text(e);
    // Every rank agreed on the failure after its writes ended, so no rank
    // is still writing here: free the space (it may be a full disk). With
    // tiers, each step removes what it failed to commit itself.
    // As retention deletes (un-committed by a durable rename first): a
    // commit whose directory fsync failed (EIO) may reach the disk all the
    // same, and a failed save must never come back, whole or partial, after
    // a power loss (FORMAT.md "Durability", D4).
    if (group_.rank() == 0 && !tiered()) {
      std::string ignored;  // best effort: the save is failing already
      remove_step_dir(*storage_, job.event.path, &ignored);
    }
  } catch (const std::exception& e) {
    job.event.ok = false;
    job.event.error = error_text(e);
  }
}

void CheckpointManager::wait_in_flight() {
  if (worker_.joinable()) worker_.join();
  std::shared_ptr<Job> job;
  {
    std::lock_guard<std::mutex> lock(mu_);
    job = std::move(in_flight_);
    if (!job) return;
    job->blocking_final = true;
    if (!job->reported) {
      job->reported = true;
      events_.push_back(job->event);
    }
  }
  if (job->error) {
    throw CheckpointError("checkpoint of step " + std::to_string(job->step) + " (" +
                          job->event.path + ") failed: " + job->event.error);
  }
}

void CheckpointManager::save(int64_t step, StateDict state, bool final) {
  auto t0 = Clock::now();
  wait_in_flight();
  // A failed retention is reported after this save, which goes ahead.
  const std::string retention_error = wait_retention();
  auto job = std::make_shared<Job>();
  job->step = step;
  job->event.step = step;
  job->event.mode = options_.mode;
  job->event.path = join_path(dir_, step_dir_name(step));
  job->started = t0;
  job->final = final;
  if (tiered()) {
    // By step, so that which steps reach the durable tier does not depend
    // on where a run resumed: every every-th multiple of the interval (saves
    // counted without an interval), and the final save.
    ++local_saves_;
    const int64_t k = options_.durable.every;
    const int64_t ordinal = options_.interval > 0 ? step / options_.interval : local_saves_;
    job->flush = final || k <= 1 || (ordinal % k == 0 && (options_.interval <= 0 || step % options_.interval == 0));
    job->local_path = join_path(local_dir_, step_dir_name(step));
  }
  const bool on_device = HostStaging::has_device_tensors(state);

  if (mode_ == SaveMode::kSync) {
    if (on_device) {
      auto t = Clock::now();
      job->staged = staging_.stage(state);
      staging_.wait();
      job->event.stage_s = seconds_since(t);
    } else {
      job->staged = std::move(state);
    }
    in_flight_ = job;
    if (tiered()) {
      // The loop waits for the local commit only; partner copies, the flush
      // and retention go on in the background.
      bool failed = false;
      try {
        save_local(*job);
      } catch (...) {
        record_failure(*job);
        failed = true;
      }
      job->staged = StateDict();
      job->event.blocking_s = seconds_since(t0);
      if (failed) {
        {
          std::lock_guard<std::mutex> lock(mu_);
          job->staged_done = true;
          job->done = true;
        }
        wait_in_flight();  // reports the event, rethrows the failure
        return;
      }
      {
        std::lock_guard<std::mutex> lock(mu_);
        job->blocking_final = true;
      }
      worker_ = std::thread([this, job] { persist(job); });
      return;
    }
    persist(job);
    job->event.blocking_s = seconds_since(t0);
    wait_in_flight();  // reports the event, rethrows a failure
    if (!retention_error.empty()) throw CheckpointError(retention_error);
    return;
  }
  if (mode_ == SaveMode::kAsync) {
    // The only part the loop waits for: a copy into the reused buffers.
    auto t = Clock::now();
    job->staged = staging_.stage(state);
    staging_.wait();
    job->event.stage_s = seconds_since(t);
  } else if (on_device) {
    // Overlap on a GPU: enqueue the copies on the copy stream and return;
    // wait_staged() orders the optimizer step after them on the device.
    job->staged = staging_.stage(state);
    job->device_copy_in_flight = true;
  } else {
    job->source = std::move(state);
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    in_flight_ = job;
  }
  worker_ = std::thread([this, job] { persist(job); });
  job->event.blocking_s = seconds_since(t0);
  if (mode_ == SaveMode::kAsync) {
    std::lock_guard<std::mutex> lock(mu_);
    job->blocking_final = true;
  }
}

void CheckpointManager::wait_staged() {
  std::shared_ptr<Job> job;
  {
    std::lock_guard<std::mutex> lock(mu_);
    job = in_flight_;
  }
  if (!job || mode_ != SaveMode::kOverlap) return;
  auto t = Clock::now();
  if (job->device_copy_in_flight) {
    // No host sync: the optimizer's kernels queue behind the copies.
    std::lock_guard<std::mutex> lock(mu_);
    if (job->blocking_final) return;
    staging_.block_compute();
    job->event.blocking_s += seconds_since(t);
    job->blocking_final = true;
    return;
  }
  std::unique_lock<std::mutex> lock(mu_);
  if (job->blocking_final) return;
  cv_.wait(lock, [&] { return job->staged_done; });
  job->event.blocking_s += seconds_since(t);
  job->blocking_final = true;
}

void CheckpointManager::finish() {
  wait_in_flight();
  const std::string error = wait_retention();
  if (!error.empty()) throw CheckpointError(error);
}

std::vector<CheckpointEvent> CheckpointManager::take_events() {
  std::lock_guard<std::mutex> lock(mu_);
  if (in_flight_ && in_flight_->done && in_flight_->blocking_final && !in_flight_->reported) {
    in_flight_->reported = true;
    events_.push_back(in_flight_->event);
  }
  std::vector<CheckpointEvent> out;
  out.swap(events_);
  return out;
}

// ---------------------------------------------------------------------------
// Tiers (storage/tiers.h, FORMAT.md "Tiers").

const CheckpointManager::Topology& CheckpointManager::topology() {
  if (topology_) return *topology_;
  auto topo = std::make_shared<Topology>();
  const std::vector<Bytes> all = group_.all_gather_bytes(u64_bytes(static_cast<uint64_t>(placement_.node)));
  for (const Bytes& b : all) topo->node_of_rank.push_back(static_cast<int>(bytes_u64(b, 0)));
  for (int r = 0; r < group_.size(); ++r) topo->ranks_of_node[topo->node_of_rank[r]].push_back(r);
  for (const auto& [node, ranks] : topo->ranks_of_node) topo->nodes.push_back(node);
  const int me = group_.rank();
  topo->node = topo->node_of_rank[me];
  topo->leader = topo->leader_of(topo->node) == me;
  if (topo->nodes.size() < 2) {
    topo->no_partner = "one node";
  } else {
    const size_t per_node = topo->ranks_of_node.begin()->second.size();
    for (const auto& [node, ranks] : topo->ranks_of_node) {
      if (ranks.size() != per_node) topo->no_partner = "nodes with different numbers of ranks";
    }
  }
  if (topo->no_partner.empty()) {
    // Rank i of node k keeps the file of rank i of the previous node, and
    // its own file goes to rank i of the next node (a ring over the nodes).
    const auto& nodes = topo->nodes;
    const size_t k = static_cast<size_t>(std::find(nodes.begin(), nodes.end(), topo->node) - nodes.begin());
    const std::vector<int>& mine = topo->ranks_of_node[topo->node];
    const size_t i = static_cast<size_t>(std::find(mine.begin(), mine.end(), me) - mine.begin());
    topo->partner_to = topo->ranks_of_node[nodes[(k + 1) % nodes.size()]][i];
    topo->partner_from = topo->ranks_of_node[nodes[(k + nodes.size() - 1) % nodes.size()]][i];
  }
  topology_ = topo;
  return *topology_;
}

// (all ranks) Writes the checkpoint into every node's local tier and commits
// it there: .local.json, then .metadata, on each node. Every node committed
// or, after a failure anywhere, none (each removes its step directory).
void CheckpointManager::save_local(Job& job) {
  const Topology& topo = topology();
  const int rank = group_.rank();
  if (hooks_.before_write) hooks_.before_write(job.step, rank);
  // A leftover of this step (an uncommitted crash remnant, or a checkpoint
  // resume did not take) must not mix with the new files.
  std::string error;
  if (topo.leader) {
    try {
      if (local_storage_->exists(job.local_path)) {
        const std::string aside = join_path(local_dir_, ".deleting." + step_dir_name(job.step));
        local_storage_->remove_all(aside);
        local_storage_->rename(job.local_path, aside);
        local_storage_->sync_dir(local_dir_);
        local_storage_->remove_all(aside);
      }
    } catch (const std::exception& e) {
      error = error_text(e);
    }
  }
  const std::string failed = "checkpoint save of step " + std::to_string(job.step) + " to the local tier failed";
  agree(group_, error, {}, failed + " clearing " + job.local_path);

  SaveOptions so;
  so.step = job.step;
  so.layout = layout_;
  so.compression = options_.compression;
  so.io_threads = options_.io_threads;
  so.info = {{"mode", options_.mode}};
  so.storage = local_storage_;
  so.plan_cache = plan_cache_;
  so.node_local = true;
  auto remove_local = [&] {
    if (!topo.leader) return;
    try {
      local_storage_->remove_all(job.local_path);
    } catch (const std::exception&) {
    }
  };
  SaveStats st;
  try {
    st = save_state_dict(job.staged, job.local_path, group_, so);
  } catch (const CheckpointError&) {
    remove_local();  // every rank failed together: no rank is still writing
    throw;
  }
  job.metadata = std::move(st.metadata);
  job.event.plan_s = st.plan_s;
  job.event.plan_cached = st.plan_cached;
  job.event.write_s = st.plan_s + st.write_s;
  job.event.bytes = st.total_logical_bytes;
  job.event.stored_bytes = st.total_stored_bytes;

  // Commit on every node: the record, then the metadata.
  auto t = Clock::now();
  uint64_t mine = 0;
  error.clear();
  try {
    mine = local_storage_->file_size(join_path(job.local_path, rank_file_name(rank)));
  } catch (const std::exception& e) {
    error = error_text(e);
  }
  std::vector<Bytes> sizes;
  try {
    sizes = agree(group_, error, u64_bytes(mine), failed);
  } catch (const CheckpointError&) {
    remove_local();
    throw;
  }
  job.file_bytes.clear();
  for (const Bytes& b : sizes) job.file_bytes.push_back(bytes_u64(b, 1));
  if (topo.leader) {
    try {
      LocalRecord record;
      record.step = job.step;
      record.node = topo.node;
      record.node_of_rank = topo.node_of_rank;
      for (int r : topo.ranks_of_node.at(topo.node)) {
        record.files.push_back(TierFile{rank_file_name(r), r, topo.node, job.file_bytes[r], std::nullopt});
      }
      const std::string text = encode_local_record(record);
      local_storage_->write_file_atomic(join_path(job.local_path, kLocalRecordName),
                                        std::vector<uint8_t>(text.begin(), text.end()));
      local_storage_->sync_dir(job.local_path);
      local_storage_->write_file_atomic(join_path(job.local_path, kMetadataFileName), job.metadata);
    } catch (const std::exception& e) {
      error = "node " + std::to_string(topo.node) + ": " + error_text(e);
    }
  }
  try {
    agree(group_, error, {}, failed + " committing; nothing was committed");
  } catch (const CheckpointError&) {
    remove_local();
    throw;
  }
  job.event.commit_s = st.commit_s + seconds_since(t);
  job.local_committed = Clock::now();
  job.event.local_commit_s = seconds_since(job.started);
  job.event.tier = "local";
  job.event.local_path = job.local_path;
  job.event.path = job.local_path;
  job.local_done = true;
}

// (all ranks, background) Partner copies, the flush when due, retention of
// both tiers. A flush failure is the job's failure; the local tier keeps the
// checkpoint.
void CheckpointManager::finish_tiers(Job& job) {
  const Topology& topo = topology();
  job.staged = StateDict();
  if (!options_.local.partner) {
    job.event.partner = "off";
  } else if (!topo.no_partner.empty()) {
    job.event.partner = "skipped: " + topo.no_partner;
  } else {
    partner_copy(job);
  }
  std::exception_ptr flush_error;
  if (job.flush) {
    if (hooks_.before_flush) hooks_.before_flush(job.step, group_.rank());
    try {
      flush(job);
    } catch (const CheckpointError&) {
      flush_error = std::current_exception();
    }
  }
  // Retention: never the step just saved (the newest in both tiers), never
  // an uncommitted directory; the durable tier only after a flush committed.
  std::string error;
  try {
    if (topo.leader && options_.local.keep_last > 0) {
      apply_retention(*local_storage_, local_dir_, options_.local.keep_last, job.step);
    }
    if (group_.rank() == 0 && job.event.flushed && options_.keep_last > 0) {
      apply_retention(*storage_, dir_, options_.keep_last, job.step);
    }
  } catch (const std::exception& e) {
    error = error_text(e);
  }
  if (flush_error) std::rethrow_exception(flush_error);
  if (!error.empty()) throw std::runtime_error("retention after step " + std::to_string(job.step) + ": " + error);
}

// (all ranks) Each rank's file goes to its partner on the next node, into
// <local step dir>/.partner/; once every copy is fsynced everywhere, each
// node's leader writes .partner.json (the L2 claim). A failure leaves no
// claim on any node and marks the event; the L1 checkpoint stands.
void CheckpointManager::partner_copy(Job& job) {
  const Topology& topo = topology();
  const int rank = group_.rank();
  if (hooks_.before_partner) hooks_.before_partner(job.step, rank);
  const std::string copies = join_path(job.local_path, kPartnerDirName);
  std::string prep_error;
  try {
    local_storage_->make_dirs(copies);
  } catch (const std::exception& e) {
    prep_error = error_text(e);
  }
  const std::string name = rank_file_name(topo.partner_from);
  TransferResult tr = transfer_file(
      group_, local_storage_.get(), join_path(job.local_path, rank_file_name(rank)),
      job.file_bytes[rank], topo.partner_to, local_storage_.get(),
      join_path(copies, ".incoming." + name), join_path(copies, name), job.file_bytes[topo.partner_from],
      topo.partner_from, std::nullopt);
  std::string error = prep_error;
  if (error.empty()) error = tr.recv_error;
  if (error.empty() && !tr.send_error.empty()) error = "reading its own file: " + tr.send_error;
  TierFile kept{name, topo.partner_from, topo.node_of_rank[topo.partner_from],
                job.file_bytes[topo.partner_from], tr.recv_xxh3};
  const std::string entry = encode_partner_record(PartnerRecord{job.step, topo.node, {kept}});
  std::vector<Bytes> all = group_.all_gather_bytes(tagged_result(error, entry));
  std::string failures = describe_rank_failures(all);
  if (failures.empty() && topo.leader) {
    try {
      PartnerRecord record{job.step, topo.node, {}};
      for (int r : topo.ranks_of_node.at(topo.node)) {
        const std::string text = tagged_text(all[r]);
        for (TierFile& f : decode_partner_record(text, "partner copy report").files) record.files.push_back(f);
      }
      local_storage_->sync_dir(copies);
      const std::string text = encode_partner_record(record);
      local_storage_->write_file_atomic(join_path(job.local_path, kPartnerRecordName),
                                        std::vector<uint8_t>(text.begin(), text.end()));
    } catch (const std::exception& e) {
      error = "node " + std::to_string(topo.node) + ": " + error_text(e);
    }
    all = group_.all_gather_bytes(tagged_result(error, ""));
    failures = describe_rank_failures(all);
  } else if (failures.empty()) {
    all = group_.all_gather_bytes(tagged_result(error, ""));
    failures = describe_rank_failures(all);
  }
  if (failures.empty()) {
    job.event.partner = "ok";
    return;
  }
  // No claim anywhere: a node whose .partner.json was written takes it back.
  if (topo.leader) {
    try {
      local_storage_->remove_all(join_path(job.local_path, kPartnerRecordName));
      local_storage_->sync_dir(job.local_path);
      local_storage_->remove_all(copies);
    } catch (const std::exception&) {
    }
  }
  job.event.partner = "failed: " + failures;
}

// (all ranks) Copies each rank's committed local file to the durable step
// directory, then rank 0 commits the same metadata there.
void CheckpointManager::flush(Job& job) {
  auto t = Clock::now();
  const int rank = group_.rank();
  const std::string durable = join_path(dir_, step_dir_name(job.step));
  const std::string failed = "checkpoint of step " + std::to_string(job.step) +
                             ": flush to the durable tier (" + durable + ") failed";
  const std::string kept = "; the local tier keeps it (" + job.local_path + ")";
  std::string error;
  if (rank == 0) {
    try {
      if (storage_->exists(durable)) storage_->remove_all(durable);  // an uncommitted leftover
      storage_->make_dirs_durable(durable);
    } catch (const std::exception& e) {
      error = error_text(e);
    }
  }
  Bytes verdict = group_.broadcast_bytes(tagged_result(error, ""), 0);
  if (!tagged_succeeded(verdict)) throw CheckpointError(failed + " (rank 0: " + tagged_text(verdict) + ")" + kept);
  try {
    const std::string name = rank_file_name(rank);
    copy_file(*local_storage_, join_path(job.local_path, name), *storage_, join_path(durable, name));
  } catch (const std::exception& e) {
    error = error_text(e);
  }
  std::vector<Bytes> reports = group_.gather_bytes(tagged_result(error, ""), 0);
  if (rank == 0) {
    std::string failures = describe_rank_failures(reports);
    if (failures.empty()) {
      try {
        storage_->sync_dir(durable);
        storage_->write_file_atomic(join_path(durable, kMetadataFileName), job.metadata);
      } catch (const std::exception& e) {
        failures = "rank 0 commit: " + error_text(e);
      }
    }
    if (!failures.empty()) {
      std::string ignored;  // a commit whose directory fsync failed may reach the disk all the same
      remove_step_dir(*storage_, durable, &ignored);
    }
    verdict = tagged_result(failures, "");
  }
  verdict = group_.broadcast_bytes(verdict, 0);
  if (!tagged_succeeded(verdict)) throw CheckpointError(failed + " (" + tagged_text(verdict) + ")" + kept);
  job.event.flushed = true;
  job.event.flush_s = seconds_since(t);
  job.event.exposure_s = seconds_since(job.local_committed);
  job.event.tier = "local+durable";
  job.event.path = durable;
}

std::optional<ResumeResult> CheckpointManager::resume_tiered(StateDict& state) {
  const Topology& topo = topology();
  Bytes mine = tagged_ok({});
  if (topo.leader) {
    try {
      const std::string inv = encode_inventory(inventory_local_tier(*local_storage_, local_dir_, topo.node));
      mine = tagged_ok(Bytes(inv.begin(), inv.end()));
    } catch (const std::exception& e) {
      mine = tagged_error(error_text(e));
    }
  }
  std::vector<Bytes> gathered = group_.gather_bytes(mine, 0);
  std::string error, text;
  if (group_.rank() == 0) {
    try {
      const std::string failures = describe_rank_failures(gathered);
      if (!failures.empty()) throw std::runtime_error("listing the local tier failed (" + failures + ")");
      std::vector<NodeInventory> nodes;
      for (int node : topo.nodes) {
        const std::string inv = tagged_text(gathered[topo.leader_of(node)]);
        nodes.push_back(decode_inventory(inv));
      }
      const TierChoice choice = choose_resume_tiers(nodes, list_checkpoints(*storage_, dir_));
      nlohmann::json j = {{"candidates", encode_candidates(choice.candidates)}, {"notes", choice.notes}};
      text = j.dump();
    } catch (const std::exception& e) {
      error = error_text(e);
    }
  }
  const Bytes reply = group_.broadcast_bytes(tagged_result(error, text), 0);
  if (!tagged_succeeded(reply)) throw CheckpointError("checkpoint.resume: " + tagged_text(reply));
  const nlohmann::json j = nlohmann::json::parse(tagged_text(reply));
  std::vector<ResumeCandidate> candidates = decode_candidates(j["candidates"].get<std::string>());
  if (!options_.resume_fallback && candidates.size() > 1) candidates.resize(1);
  ResumeResult result;
  result.notes = j["notes"].get<std::vector<std::string>>();
  for (const ResumeCandidate& c : candidates) {
    try {
      if (c.tier == Tier::kLocal) {
        restore_local(state, c);
        result.path = join_path(local_dir_, step_dir_name(c.step));
        result.stats = load_from(state, result.path, local_storage_);
      } else {
        result.path = c.durable_path;
        result.stats = load_from(state, c.durable_path, storage_);
      }
      result.tier = tier_name(c.tier);
      result.reason = c.reason;
      return result;
    } catch (const CheckpointDamagedError& e) {
      if (candidates.size() == 1) throw;
      SkippedCheckpoint skip{c.tier == Tier::kLocal ? join_path(local_dir_, step_dir_name(c.step)) : c.durable_path,
                             "", error_text(e)};
      // A damaged durable checkpoint is set aside as without tiers; a local
      // one stays (the next save of its step replaces it).
      if (c.tier == Tier::kDurable && group_.rank() == 0) skip.moved_to = set_aside(c.durable_path);
      result.skipped.push_back(std::move(skip));
      result.notes.push_back(std::string(tier_name(c.tier)) + " step_" + std::to_string(c.step) +
                             " did not load: " + error_text(e));
    }
  }
  if (candidates.empty()) return std::nullopt;
  std::string message = "checkpoint.resume: no committed checkpoint in " + dir_ + " or the local tier loads:";
  for (const SkippedCheckpoint& sk : result.skipped) message += "\n  " + sk.path + ": " + sk.error;
  throw CheckpointError(message);
}

// (all ranks) Makes every file this rank's load needs present in its node's
// local step directory: from the node itself (its own files or its partner
// copies) or sent by a rank of the node that holds it. Throws
// CheckpointDamagedError when it cannot.
void CheckpointManager::restore_local(StateDict& state, const ResumeCandidate& c) {
  const Topology& topo = topology();
  const int rank = group_.rank();
  const std::string step_path = join_path(local_dir_, step_dir_name(c.step));
  const std::string what = "restoring local step_" + std::to_string(c.step);
  auto damaged_if_failed = [&](const std::string& error, const Bytes& payload = {}) {
    std::vector<Bytes> all = group_.all_gather_bytes(error.empty() ? tagged_ok(payload) : tagged_error(error));
    const std::string failures = describe_rank_failures(all);
    if (!failures.empty()) throw CheckpointDamagedError(what + " failed (" + failures + ")");
    return all;
  };
  // 1. The metadata, from a node that committed the step.
  const int root = topo.ranks_of_node.count(c.metadata_node) ? topo.leader_of(c.metadata_node) : 0;
  std::string error;
  Bytes meta;
  if (rank == root) {
    try {
      meta = local_storage_->read_file(join_path(step_path, kMetadataFileName), kMaxMetadataBytes);
    } catch (const std::exception& e) {
      error = error_text(e);
    }
  }
  Bytes reply = group_.broadcast_bytes(error.empty() ? tagged_ok(std::move(meta)) : tagged_error(error), root);
  if (!tagged_succeeded(reply)) throw CheckpointDamagedError(what + " failed (rank " + std::to_string(root) + ": " + tagged_text(reply) + ")");
  meta.assign(reply.begin() + 1, reply.end());
  reply = {};

  // 2. The files this rank's load reads that its node lacks.
  std::string wanted;
  try {
    local_storage_->make_dirs_durable(step_path);
    LoadOptions lo;
    if (options_.model_only) {
      lo.filter = [](const std::string& name) { return name.rfind("model.", 0) == 0; };
    }
    for (const std::string& f : files_needed(state, meta, lo)) {
      const FileInfo info = local_storage_->stat(join_path(step_path, f));
      bool present = false;
      for (const FileSource& src : c.sources) {
        if (src.file.name == f) present = info.type == FileType::kFile && info.size == src.file.bytes;
      }
      if (!present) wanted += f + "\n";
    }
  } catch (const std::exception& e) {
    error = error_text(e);
  }
  std::vector<Bytes> wants = group_.gather_bytes(tagged_result(error, wanted), 0);

  // 3. The coordinator assigns each (node, file) one receiving rank of that
  // node and one sending rank of a node holding it (or a local copy from
  // the node's own partner copies), in one list every rank walks in order.
  struct Move {
    std::string file;
    int from = -1;  // -1: a copy from the receiver's own .partner/
    int to = 0;
    bool partner = false;
    uint64_t bytes = 0;
    std::optional<uint64_t> xxh3;
  };
  std::string plan, plan_error;
  if (rank == 0) {
    try {
      const std::string failures = describe_rank_failures(wants);
      if (!failures.empty()) throw std::runtime_error(failures);
      std::map<std::string, const FileSource*> source_of;
      for (const FileSource& s : c.sources) source_of[s.file.name] = &s;
      std::set<std::pair<int, std::string>> planned;  // (node, file)
      nlohmann::json list = nlohmann::json::array();
      std::map<int, int> sends_by_node;
      for (int r = 0; r < group_.size(); ++r) {
        const std::string text = tagged_text(wants[r]);
        for (size_t pos = 0, end; (end = text.find('\n', pos)) != std::string::npos; pos = end + 1) {
          const std::string f = text.substr(pos, end - pos);
          auto it = source_of.find(f);
          if (it == source_of.end()) throw std::runtime_error("rank " + std::to_string(r) + " needs " + f + ", which no node holds");
          const int node = topo.node_of_rank[r];
          if (!planned.insert({node, f}).second) continue;
          const FileSource& s = *it->second;
          if (!topo.ranks_of_node.count(s.node)) throw std::runtime_error(f + " is on node " + std::to_string(s.node) + ", not in this job");
          int from = -1;
          if (s.node != node) {
            const std::vector<int>& holders = topo.ranks_of_node.at(s.node);
            from = holders[static_cast<size_t>(sends_by_node[s.node]++) % holders.size()];
          } else if (!s.partner) {
            continue;  // present after all (another rank of the node sees it)
          }
          nlohmann::json m = {{"file", f}, {"from", from}, {"to", r}, {"partner", s.partner}, {"bytes", s.file.bytes}};
          if (s.file.xxh3) m["xxh3"] = *s.file.xxh3;
          list.push_back(m);
        }
      }
      plan = list.dump();
    } catch (const std::exception& e) {
      plan_error = error_text(e);
    }
  }
  reply = group_.broadcast_bytes(tagged_result(plan_error, plan), 0);
  if (!tagged_succeeded(reply)) throw CheckpointDamagedError(what + " failed (" + tagged_text(reply) + ")");
  std::vector<Move> moves;
  for (const nlohmann::json& m : nlohmann::json::parse(tagged_text(reply))) {
    Move mv;
    mv.file = m["file"].get<std::string>();
    mv.from = m["from"].get<int>();
    mv.to = m["to"].get<int>();
    mv.partner = m["partner"].get<bool>();
    mv.bytes = m["bytes"].get<uint64_t>();
    if (m.contains("xxh3")) mv.xxh3 = m["xxh3"].get<uint64_t>();
    moves.push_back(std::move(mv));
  }
  // 4. Walk the list: every transfer involves two ranks that both reach it.
  error.clear();
  for (const Move& m : moves) {
    const std::string target = join_path(step_path, m.file);
    const std::string tmp = join_path(step_path, ".incoming." + m.file);
    if (m.from < 0) {
      if (m.to != rank) continue;
      try {
        const uint64_t h = copy_file(*local_storage_, join_path(join_path(step_path, kPartnerDirName), m.file),
                                     *local_storage_, tmp);
        if (m.xxh3 && h != *m.xxh3) throw ChecksumError(m.file + ": partner copy's XXH3 differs from the recorded one");
        local_storage_->rename(tmp, target);
      } catch (const std::exception& e) {
        if (error.empty()) error = error_text(e);
      }
      continue;
    }
    if (m.from != rank && m.to != rank) continue;
    const std::string source =
        m.partner ? join_path(join_path(step_path, kPartnerDirName), m.file) : join_path(step_path, m.file);
    TransferResult tr = transfer_file(group_, local_storage_.get(), source, m.from == rank ? m.bytes : 0,
                                      m.from == rank ? m.to : -1, local_storage_.get(), tmp, target,
                                      m.to == rank ? m.bytes : 0, m.to == rank ? m.from : -1, m.xxh3);
    if (error.empty()) error = m.to == rank ? tr.recv_error : tr.send_error;
  }
  try {
    if (error.empty()) local_storage_->sync_dir(step_path);
  } catch (const std::exception& e) {
    error = error_text(e);
  }
  damaged_if_failed(error);
  // 5. A node that lacked the step commits the metadata there, after every
  // file arrived (it has no .local.json: never a source for another resume).
  if (topo.leader) {
    try {
      if (!local_storage_->exists(join_path(step_path, kMetadataFileName))) {
        local_storage_->write_file_atomic(join_path(step_path, kMetadataFileName), meta);
      }
    } catch (const std::exception& e) {
      error = error_text(e);
    }
  }
  damaged_if_failed(error);
}

}  // namespace checkpoint
