#include "checkpoint/async/manager.h"

#include "checkpoint/codec/chunk_reader.h"
#include "checkpoint/codec/transforms.h"

#include "checkpoint/agreement.h"
#include "checkpoint/error_text.h"
#include "checkpoint/format/metadata.h"
#include "checkpoint/layout/checkpoint_dir.h"
#include "checkpoint/save_seam.h"
#include "checkpoint/tiers/protocol.h"
#include "checkpoint/timing.h"

#include <chrono>
#include <map>
#include <mutex>
#include <stdexcept>

namespace checkpoint {

namespace {

using Clock = std::chrono::steady_clock;

// The test seams (save_seam.h; none in a product): set_default_save_seam's,
// and each manager's own, by manager, so that manager.h carries none of it.
std::mutex seams_mu;
std::shared_ptr<const test_seam::SaveSeam> default_seam;               // guarded by seams_mu
std::map<const CheckpointManager*, std::shared_ptr<const test_seam::SaveSeam>> seams;  // same

// The seam of `manager`; null (nothing to call) but in tests.
std::shared_ptr<const test_seam::SaveSeam> seam_of(const CheckpointManager* manager) {
  std::lock_guard<std::mutex> lock(seams_mu);
  auto it = seams.find(manager);
  return it == seams.end() ? nullptr : it->second;
}

}  // namespace

namespace test_seam {

void set_save_seam(CheckpointManager& manager, SaveSeam seam) {
  std::lock_guard<std::mutex> lock(seams_mu);
  seams[&manager] = std::make_shared<const SaveSeam>(std::move(seam));
}

void set_default_save_seam(SaveSeam seam) {
  std::lock_guard<std::mutex> lock(seams_mu);
  default_seam = std::make_shared<const SaveSeam>(std::move(seam));
}

}  // namespace test_seam

struct CheckpointManager::Job {
  int64_t step = 0;
  StateDict source;  // overlap: the live state, staged by the worker
  StateDict staged;  // what is written
  CheckpointEvent event;
  bool staged_done = false;     // guarded by mu_
  bool done = false;            // guarded by mu_
  bool blocking_final = false;  // guarded by mu_
  bool reported = false;        // guarded by mu_
  // Overlap on a GPU: save() began the staging (with a device snapshot or
  // not), the worker copies to the host in chunks.
  bool device_overlap = false;
  Clock::time_point started;
  std::exception_ptr error;
  TierSave tier;  // with tiers: the save's way through them
};

CheckpointManager::CheckpointManager(CheckpointOptions options, std::string default_dir,
                                     comm::Group& group, std::string layout,
                                     std::shared_ptr<Storage> storage, ManagerHooks hooks)
    : options_(std::move(options)),
      dir_(options_.dir.empty() ? std::move(default_dir) : options_.dir),
      group_(group),
      layout_(std::move(layout)),
      plan_cache_(options_.plan_cache ? std::make_shared<SavePlanCache>() : nullptr),
      storage_(std::move(storage)),
      hooks_(std::move(hooks)) {
  {
    std::lock_guard<std::mutex> lock(seams_mu);
    if (default_seam) seams[this] = default_seam;
  }
  set_placement(TierPlacement{});
}

void CheckpointManager::set_placement(TierPlacement placement) {
  placement_ = std::move(placement);
  local_storage_ = placement_.local_storage ? placement_.local_storage : storage_;
  tiers_.reset();
  local_dir_.clear();
  if (tiered()) {
    tiers_ = std::make_unique<TierProtocol>(options_, dir_, storage_, group_, placement_.node, local_storage_);
    local_dir_ = tiers_->local_dir();
  }
}

CheckpointManager::~CheckpointManager() {
  try {
    wait_in_flight();
  } catch (...) {
    // The caller chose not to call finish(); the error was theirs to see.
  }
  wait_retention();
  std::lock_guard<std::mutex> lock(seams_mu);
  seams.erase(this);
}

void CheckpointManager::wait_retention() {
  if (retention_.joinable()) retention_.join();
}

void CheckpointManager::record_retention_failures(std::vector<RetentionFailure> failures) {
  if (failures.empty()) return;
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& f : failures) retention_failures_.push_back(std::move(f));
}

std::vector<RetentionFailure> CheckpointManager::take_retention_failures() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<RetentionFailure> out;
  out.swap(retention_failures_);
  return out;
}

bool CheckpointManager::due(int64_t step, int64_t last_step) const {
  const int64_t counted = interval_from_ ? step - *interval_from_ : step;
  return options_.interval > 0 && ((counted > 0 && counted % options_.interval == 0) || step == last_step);
}

void CheckpointManager::set_interval(int64_t interval, int64_t from_step) {
  if (interval <= 0) {
    throw std::invalid_argument("CheckpointManager::set_interval: interval must be > 0, got " + std::to_string(interval));
  }
  options_.interval = interval;
  interval_from_ = from_step;
}

bool CheckpointManager::stages(bool state_on_device) const {
  return enabled() && (options_.mode != SaveMode::kSync || state_on_device);
}

DueSave CheckpointManager::save_if_due(int64_t step, int64_t last_step, bool stop_requested,
                                       bool busy_anywhere, const std::function<StateDict()>& state) {
  DueSave out;
  const bool final_save = stop_requested && options_.save_on_signal && enabled();
  if (!due(step, last_step) && !final_save) return out;
  if (options_.when_busy == WhenBusy::kSkip && busy_anywhere && !final_save &&
      step != last_step) {
    out.skipped = true;
    return out;
  }
  const auto t0 = std::chrono::steady_clock::now();
  const bool final = final_save || step == last_step;
  try {
    save(step, state(), final);
  } catch (const CheckpointError& e) {
    // The previous (background) save failed, or this sync save did.
    if (options_.on_error != OnError::kWarn) throw;
    out.warning = e.what();
    if (!busy() && options_.mode != SaveMode::kSync) save(step, state(), final);
  }
  out.started = true;
  out.blocking_s = seconds_since(t0);
  return out;
}

std::string CheckpointManager::finish_or_warn() {
  try {
    finish();
  } catch (const CheckpointError& e) {
    if (options_.on_error != OnError::kWarn) throw;
    return e.what();
  }
  return "";
}

bool CheckpointManager::busy() const {
  std::lock_guard<std::mutex> lock(mu_);
  return in_flight_ && !in_flight_->done;
}

// (rank 0, then broadcast) What resume tries without tiers, in order: the
// newest committed checkpoint and, with resume_fallback, the older ones; or
// the one checkpoint.resume names.
std::vector<std::string> CheckpointManager::durable_candidates() {
  std::string error, list;
  if (group_.rank() == 0) {
    try {
      if (resume_request(options_.resume) == ResumeRequest::kAuto && options_.resume_fallback) {
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

// (all ranks) What resume tries, in order. With tiers and resume "auto":
// the tiers' choice (notes: why newer local steps are not usable), else the
// durable tier's.
std::vector<ResumeCandidate> CheckpointManager::resume_candidates(std::vector<std::string>& notes) {
  std::vector<ResumeCandidate> candidates;
  if (tiers_ && resume_request(options_.resume) == ResumeRequest::kAuto) {
    TierChoice choice = tiers_->choose_resume();
    candidates = std::move(choice.candidates);
    notes = std::move(choice.notes);
    if (!options_.resume_fallback && candidates.size() > 1) candidates.resize(1);
    return candidates;
  }
  for (const std::string& path : durable_candidates()) {
    ResumeCandidate c;
    c.tier = Tier::kDurable;
    c.durable_path = path;
    candidates.push_back(std::move(c));
  }
  return candidates;
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
  const bool with_tiers = tiers_ && resume_request(options_.resume) == ResumeRequest::kAuto;
  ResumeResult result;
  const std::vector<ResumeCandidate> candidates = resume_candidates(result.notes);
  for (const ResumeCandidate& c : candidates) {
    try {
      result.stats = load_candidate(state, c, result.path);
      result.tier = tier_name(c.tier);
      result.reason = c.reason;
      return result;
    } catch (const CheckpointDamagedError& e) {
      // Only damage is skipped: a state that does not match the checkpoint
      // (changed model, partial state) fails the run and sets nothing aside.
      if (candidates.size() == 1) throw;
      const bool local = c.tier == Tier::kLocal;
      SkippedCheckpoint skip{local ? tiers_->local_step_path(c.step) : c.durable_path, "", error_text(e)};
      // A damaged durable checkpoint is set aside; a local one stays (the
      // next save of its step replaces it).
      if (!local && group_.rank() == 0) skip.moved_to = set_aside(c.durable_path);
      result.skipped.push_back(std::move(skip));
      if (with_tiers) {
        result.notes.push_back(std::string(tier_name(c.tier)) + " step_" + std::to_string(c.step) +
                               " did not load: " + error_text(e));
      }
    }
  }
  if (candidates.empty()) return std::nullopt;
  std::string message = "checkpoint.resume: no committed checkpoint in " + dir_ +
                        (with_tiers ? " or the local tier" : "") + " loads:";
  for (const SkippedCheckpoint& s : result.skipped) message += "\n  " + s.path + ": " + s.error;
  throw CheckpointError(message);
}

// (all ranks) Loads one candidate: a local one after restoring the files
// its node lacks. Sets `path` to what it loads.
LoadStats CheckpointManager::load_candidate(StateDict& state, const ResumeCandidate& c, std::string& path) {
  if (c.tier == Tier::kLocal) {
    tiers_->restore_local(state, c);
    path = tiers_->local_step_path(c.step);
    return load_from(state, path, local_storage_);
  }
  path = c.durable_path;
  return load_from(state, c.durable_path, storage_);
}

LoadStats CheckpointManager::load(StateDict& state, const std::string& path) {
  return load_from(state, path, storage_);
}

LoadStats CheckpointManager::load_from(StateDict& state, const std::string& path,
                                       const std::shared_ptr<Storage>& storage) {
  LoadOptions lo;
  // Names are judged across the group below: with pipeline parallelism a
  // rank holds only its stages' items, and an item of the checkpoint is
  // unexpected only when no rank loads it.
  lo.allow_partial = true;
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
  if (!options_.allow_partial) {
    // (every rank) The items no rank of the group loads; and this rank's
    // missing items that are not optional.
    std::string mine;
    for (const std::string& name : stats.unexpected) mine += name + "\n";
    std::map<std::string, int> count;
    int ranks = 0;
    for (const comm::Bytes& b : group_.all_gather_bytes(comm::Bytes(mine.begin(), mine.end()))) {
      ++ranks;
      std::string text(b.begin(), b.end());
      for (size_t at = 0, end; (end = text.find('\n', at)) != std::string::npos; at = end + 1) {
        ++count[text.substr(at, end - at)];
      }
    }
    std::vector<std::string> unexpected, required_missing;
    for (const std::string& name : stats.unexpected) {
      if (count[name] == ranks) unexpected.push_back(name);
    }
    for (const std::string& name : stats.missing) {
      if (!lo.optional || !lo.optional(name)) required_missing.push_back(name);
    }
    stats.unexpected = unexpected;
    if (error.empty() && (!unexpected.empty() || !required_missing.empty())) {
      std::string msg = "checkpoint " + path + " does not match the state being loaded";
      if (!required_missing.empty()) msg += "; missing keys: " + join_names(required_missing);
      if (!unexpected.empty()) msg += "; unexpected keys: " + join_names(unexpected);
      error = msg + " (checkpoint.allow_partial: true tolerates this)";
    }
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

SaveOptions CheckpointManager::save_options(std::shared_ptr<Storage> storage) const {
  SaveOptions so;
  so.layout = layout_;
  so.compression = options_.compression;
  so.io_threads = options_.io_threads;
  so.info = {{"mode", to_string(options_.mode)}};
  so.storage = std::move(storage);
  so.plan_cache = plan_cache_;
  return so;
}

// (background) Overlap mode's staging, which save() left to this thread.
void CheckpointManager::stage_in_background(Job& job) {
  if (job.device_overlap) {
    // Overlap on a GPU: save() ordered the copy stream after the step (and
    // took the snapshot); here the copies run in chunks, one in flight.
    staging_.copy_to_host(job.source);
    job.source = StateDict();
    job.event.stage_s = seconds_since(job.started);
  } else if (options_.mode == SaveMode::kOverlap) {
    auto t = Clock::now();
    job.staged = staging_.stage(job.source);
    job.source = StateDict();
    job.event.stage_s = seconds_since(t);
  } else {
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    job.staged_done = true;
  }
  cv_.notify_all();
}

void CheckpointManager::persist(std::shared_ptr<Job> job) {
  try {
    stage_in_background(*job);
    if (tiers_) {
      persist_tiered(*job);
    } else {
      write_durable(*job);
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

// (all ranks) Without tiers: plan, write and commit in checkpoint.dir, then
// retention.
void CheckpointManager::write_durable(Job& job) {
  const std::shared_ptr<const test_seam::SaveSeam> seam = seam_of(this);
  if (seam && seam->before_write) seam->before_write(job.step, group_.rank());
  SaveOptions so = save_options(storage_);
  so.step = job.step;
  job.event.write_started_unix_s = unix_seconds_now();
  SaveStats st = save_state_dict(job.staged, job.event.path, group_, so);
  job.event.plan_s = st.plan_s;
  job.event.plan_cached = st.plan_cached;
  job.event.write_s = st.plan_s + st.write_s;
  job.event.commit_s = st.commit_s;
  job.event.bytes = st.total_logical_bytes;
  job.event.stored_bytes = st.total_stored_bytes;
  if (group_.rank() == 0 && options_.keep_last > 0) retain_durable(job.step);
}

// (rank 0) Only committed checkpoints older than the newest keep_last go;
// never the one just written, never one without metadata (it may be in
// flight). Sync mode: on its own thread, so that the loop waits for the
// commit only; the next save and finish() wait for it. A failure leaves the
// save committed: it is reported apart (take_retention_failures), in every
// mode, and never fails this save or the next.
void CheckpointManager::retain_durable(int64_t step) {
  auto retain = [this, step] {
    try {
      apply_retention(*storage_, dir_, options_.keep_last, step);
    } catch (const std::exception& e) {
      record_retention_failures({RetentionFailure{step, "durable", error_text(e)}});
    }
  };
  if (options_.mode != SaveMode::kSync) {
    retain();
    return;
  }
  retention_ = std::thread(retain);
}

// (all ranks) The local commit of a tiered save (tiers/protocol.h).
void CheckpointManager::commit_local(Job& job) {
  SaveOptions so = save_options(local_storage_);
  so.step = job.step;
  tiers_->commit_local(job.tier, job.staged, std::move(so), seam_of(this).get());
}

// (all ranks, background) A tiered save: the local commit unless save() made
// it, then partner copies, the flush when due, retention of both tiers.
void CheckpointManager::persist_tiered(Job& job) {
  if (!job.tier.local_done) commit_local(job);
  job.staged = StateDict();
  try {
    tiers_->finish(job.tier, seam_of(this).get());
  } catch (...) {
    record_retention_failures(std::move(job.tier.retention_failures));
    throw;
  }
  record_retention_failures(std::move(job.tier.retention_failures));
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
    // Only the protocol's own failure, which every rank agreed on, not
    // another kind that errors.h roots under CheckpointError (which were not
    // handled here before it). Retention after the commit never gets here:
    // retain_durable and the tiers record its failures apart.
    const bool agreed = (!is_damage(e) || dynamic_cast<const CheckpointDamagedError*>(&e)) &&
                        !dynamic_cast<const PlanError*>(&e);
    if (agreed && group_.rank() == 0 && !tiered()) {
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

// A new save of `step`; with tiers, whether it goes to the durable tier.
std::shared_ptr<CheckpointManager::Job> CheckpointManager::start_job(int64_t step, bool final,
                                                                     Clock::time_point t0) {
  auto job = std::make_shared<Job>();
  job->step = step;
  job->event.step = step;
  job->event.mode = to_string(options_.mode);
  job->event.path = join_path(dir_, step_dir_name(step));
  job->event.started_unix_s =
      unix_seconds_now() - std::chrono::duration<double>(Clock::now() - t0).count();
  job->started = t0;
  if (tiers_) {
    // By step, so that which steps reach the durable tier does not depend
    // on where a run resumed: every every-th multiple of the interval (saves
    // counted without an interval), and the final save.
    ++local_saves_;
    const int64_t k = options_.durable.every;
    const bool by_step = options_.interval > 0 && !interval_from_;
    const int64_t ordinal = by_step ? step / options_.interval : local_saves_;
    job->tier.step = step;
    job->tier.started = t0;
    job->tier.event = &job->event;
    job->tier.flush = final || k <= 1 || (ordinal % k == 0 && (!by_step || step % options_.interval == 0));
    job->tier.local_path = tiers_->local_step_path(step);
  }
  return job;
}

void CheckpointManager::save(int64_t step, StateDict state, bool final) {
  auto t0 = Clock::now();
  wait_in_flight();
  wait_retention();
  std::shared_ptr<Job> job = start_job(step, final, t0);
  const bool on_device = HostStaging::has_device_tensors(state);
  if (options_.mode == SaveMode::kSync) {
    save_sync(job, std::move(state), on_device);
    return;
  }
  if (options_.mode == SaveMode::kAsync) {
    // The only part the loop waits for: a copy into the reused buffers.
    auto t = Clock::now();
    job->staged = staging_.stage(state);
    staging_.wait();
    job->event.stage_s = seconds_since(t);
  } else if (on_device) {
    // Overlap on a GPU: the worker copies to the host in chunks. With a
    // device snapshot the loop may change the state at once; without one
    // wait_staged() holds it until the copies are done.
    const bool snapshot = use_device_snapshot(state);
    try {
      job->staged = staging_.begin_overlap(state, snapshot);
    } catch (const std::runtime_error& e) {
      throw CheckpointError("checkpoint.device_snapshot: " +
                            std::string(to_string(options_.device_snapshot)) + ", but " +
                            e.what() + " (step " + std::to_string(step) +
                            "; checkpoint.device_snapshot: off stages from the live state)");
    }
    job->device_overlap = true;
    job->event.staging = snapshot ? "device snapshot" : "chunked";
    if (snapshot) {
      job->blocking_final = true;  // nothing for wait_staged() to wait for
    } else {
      job->source = std::move(state);
    }
  } else {
    job->source = std::move(state);
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    in_flight_ = job;
  }
  worker_ = std::thread([this, job] { persist(job); });
  job->event.blocking_s = seconds_since(t0);
  if (options_.mode == SaveMode::kAsync) {
    std::lock_guard<std::mutex> lock(mu_);
    job->blocking_final = true;
  }
}

// Sync mode: writes and commits before returning (with tiers: the local
// commit only).
void CheckpointManager::save_sync(std::shared_ptr<Job> job, StateDict state, bool on_device) {
  if (on_device) {
    auto t = Clock::now();
    job->staged = staging_.stage(state);
    staging_.wait();
    job->event.stage_s = seconds_since(t);
  } else {
    job->staged = std::move(state);
  }
  in_flight_ = job;
  if (tiers_) {
    save_tiered_sync(job);
    return;
  }
  persist(job);
  job->event.blocking_s = seconds_since(job->started);
  wait_in_flight();  // reports the event, rethrows a failure
}

// Sync mode with tiers: the loop waits for the local commit only; partner
// copies, the flush and retention go on in the background.
void CheckpointManager::save_tiered_sync(std::shared_ptr<Job> job) {
  bool failed = false;
  try {
    commit_local(*job);
  } catch (...) {
    record_failure(*job);
    failed = true;
  }
  job->staged = StateDict();
  job->event.blocking_s = seconds_since(job->started);
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
}

bool CheckpointManager::use_device_snapshot(const StateDict& state) const {
  switch (options_.device_snapshot) {
    case DeviceSnapshot::kOn: return true;
    case DeviceSnapshot::kOff: return false;
    case DeviceSnapshot::kAuto: break;
  }
  return staging_.snapshot_fits(state);
}

void CheckpointManager::wait_staged() {
  std::shared_ptr<Job> job;
  {
    std::lock_guard<std::mutex> lock(mu_);
    job = in_flight_;
  }
  if (!job || options_.mode != SaveMode::kOverlap) return;
  auto t = Clock::now();
  std::unique_lock<std::mutex> lock(mu_);
  if (job->blocking_final) return;
  cv_.wait(lock, [&] { return job->staged_done; });
  job->event.blocking_s += seconds_since(t);
  job->blocking_final = true;
}

void CheckpointManager::finish() {
  wait_in_flight();
  wait_retention();
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

}  // namespace checkpoint
