#include "checkpoint/async/manager.h"

#include "checkpoint/codec/chunk_reader.h"
#include "checkpoint/codec/transforms.h"

#include "checkpoint/agreement.h"
#include "checkpoint/error_text.h"
#include "checkpoint/storage/checkpoint_dir.h"
#include "checkpoint/timing.h"

#include <chrono>
#include <cstdio>
#include <unordered_map>

namespace checkpoint {

namespace {

using Clock = std::chrono::steady_clock;

}  // namespace

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
      hooks_(std::move(hooks)) {}

CheckpointManager::~CheckpointManager() {
  try {
    wait_in_flight();
  } catch (...) {
    // The caller chose not to call finish(); the error was theirs to see.
  }
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
  LoadOptions lo;
  lo.allow_partial = options_.allow_partial;
  lo.optional = hooks_.optional_items;
  lo.io_threads = options_.io_threads;
  lo.storage = storage_;
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
  } catch (const FormatError& e) {  // metadata or data that cannot be right
    error = error_text(e);
    damaged = true;
  } catch (const ChecksumError& e) {
    error = error_text(e);
    damaged = true;
  } catch (const TransformError& e) {
    error = error_text(e);
    damaged = true;
  } catch (const IoError& e) {  // including truncated files
    error = error_text(e);
    damaged = true;
  } catch (const std::exception& e) {  // the state does not match (names, dtypes, shapes)
    error = error_text(e);
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
    if (group_.rank() == 0 && options_.keep_last > 0) {
      apply_retention(*storage_, dir_, options_.keep_last, job->step);
    }
  } catch (...) {
    job->error = std::current_exception();
    try {
      throw;
    } catch (const CheckpointError& e) {
      job->event.ok = false;
      job->event.error = error_text(e);
      // Every rank agreed on the failure after its writes ended, so no rank
      // is still writing here: free the space (it may be a full disk).
      if (group_.rank() == 0) {
        try {
          storage_->remove_all(job->event.path);
        } catch (const std::exception&) {
        }
      }
    } catch (const std::exception& e) {
      job->event.ok = false;
      job->event.error = error_text(e);
    }
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    job->staged_done = true;
    job->done = true;
  }
  cv_.notify_all();
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

void CheckpointManager::save(int64_t step, StateDict state) {
  auto t0 = Clock::now();
  wait_in_flight();
  auto job = std::make_shared<Job>();
  job->step = step;
  job->event.step = step;
  job->event.mode = options_.mode;
  job->event.path = join_path(dir_, step_dir_name(step));
  job->started = t0;
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
    persist(job);
    job->event.blocking_s = seconds_since(t0);
    wait_in_flight();  // reports the event, rethrows a failure
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

void CheckpointManager::finish() { wait_in_flight(); }

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
