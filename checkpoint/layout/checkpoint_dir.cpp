#include "checkpoint/layout/checkpoint_dir.h"

#include <algorithm>
#include <utility>
#include <limits>
#include <stdexcept>
#include <cerrno>

#include "checkpoint/format/metadata.h"
#include "checkpoint/options.h"
#include "checkpoint/storage/storage.h"

namespace checkpoint {

namespace {

constexpr const char* kStepPrefix = "step_";
// A victim is renamed to this prefix + its step directory name before removal:
// not a step_<N> name, so never mistaken for a checkpoint if removal is cut off.
constexpr const char* kDeletingPrefix = ".deleting.";

// A canonical non-negative decimal: no sign, no leading zeros, no overflow.
std::optional<int64_t> parse_decimal(const std::string& digits) {
  if (digits.empty()) return std::nullopt;
  if (digits.size() > 1 && digits[0] == '0') return std::nullopt;  // "01" is not canonical
  int64_t value = 0;
  for (char c : digits) {
    if (c < '0' || c > '9') return std::nullopt;
    const int digit = c - '0';
    if (value > (std::numeric_limits<int64_t>::max() - digit) / 10) return std::nullopt;
    value = value * 10 + digit;
  }
  return value;
}

// "step_<N>.damaged" -> (N, 0); "step_<N>.damaged.<K>" -> (N, K), K >= 1.
std::optional<std::pair<int64_t, int64_t>> parse_set_aside_name(const std::string& name) {
  const size_t at = name.find(kSetAsideSuffix);
  if (at == std::string::npos) return std::nullopt;
  const std::optional<int64_t> step = parse_step_dir_name(name.substr(0, at));
  if (!step) return std::nullopt;
  const std::string rest = name.substr(at + std::char_traits<char>::length(kSetAsideSuffix));
  if (rest.empty()) return std::make_pair(*step, int64_t{0});
  if (rest[0] != '.') return std::nullopt;
  const std::optional<int64_t> k = parse_decimal(rest.substr(1));
  if (!k || *k == 0) return std::nullopt;
  return std::make_pair(*step, *k);
}

// True only when `path` is known to be absent (an unreadable one is not).
bool is_missing(Storage& storage, const std::string& path) {
  try {
    return storage.stat(path).type == FileType::kMissing;
  } catch (const IoError&) {
    return false;
  }
}

bool is_committed_dir(Storage& storage, const std::string& dir) {
  return storage.stat(join_path(dir, kMetadataFileName)).type == FileType::kFile;
}

// Sum of the regular files below `dir`; entries vanishing meanwhile are skipped.
uint64_t regular_file_bytes(Storage& storage, const std::string& dir) {
  uint64_t total = 0;
  std::vector<std::string> names;
  try {
    names = storage.list_dir(dir);
  } catch (const IoError&) {
    return 0;
  }
  for (const std::string& name : names) {
    const std::string path = join_path(dir, name);
    try {
      const FileInfo info = storage.stat(path);
      if (info.type == FileType::kFile) total += info.size;
      if (info.type == FileType::kDirectory) total += regular_file_bytes(storage, path);
    } catch (const IoError&) {
    }
  }
  return total;
}

CheckpointEntry describe_step_dir(Storage& storage, int64_t step, const std::string& path,
                                  const FileInfo& info) {
  CheckpointEntry entry;
  entry.step = step;
  entry.path = path;
  entry.committed = is_committed_dir(storage, path);
  entry.bytes = regular_file_bytes(storage, path);
  entry.mtime_unix_s = info.mtime_unix_s;
  return entry;
}

// The names in `checkpoint_dir`; none when it is missing. Throws when it is
// not a directory or cannot be read.
std::vector<std::string> list_checkpoint_dir(Storage& storage, const std::string& checkpoint_dir) {
  const FileType type = storage.stat(checkpoint_dir).type;
  if (type == FileType::kMissing) return {};
  if (type == FileType::kFile) {
    throw std::runtime_error("checkpoint directory " + checkpoint_dir + " is not a directory");
  }
  return storage.list_dir(checkpoint_dir);  // follows a symlinked root
}

// The entry for `path` if it is a directory (a symlink is never a
// checkpoint); nullopt when it is not, vanished or cannot be read.
std::optional<CheckpointEntry> describe_if_directory(Storage& storage, int64_t step,
                                                     const std::string& path) {
  FileInfo info;
  try {
    info = storage.stat(path);
  } catch (const IoError&) {
    return std::nullopt;
  }
  if (info.type != FileType::kDirectory) return std::nullopt;
  return describe_step_dir(storage, step, path, info);
}

// Removes `path` and everything below it; true when it is gone (including
// when it was already gone), else `error` says why.
bool remove_tree(Storage& storage, const std::string& path, std::string* error) {
  try {
    storage.remove_all(path);
    return true;
  } catch (const IoError& e) {
    *error = e.what();
    return false;
  }
}

// Leftovers of an apply_retention that was cut off between rename and removal.
void sweep_deleting_leftovers(Storage& storage, const std::string& dir,
                              std::vector<std::string>* errors) {
  std::vector<std::string> names;
  try {
    names = storage.list_dir(dir);
  } catch (const IoError&) {
    return;
  }
  for (const std::string& name : names) {
    if (name.rfind(kDeletingPrefix, 0) != 0) continue;
    if (!parse_step_dir_name(name.substr(std::char_traits<char>::length(kDeletingPrefix)))) continue;
    std::string error;
    if (!remove_tree(storage, join_path(dir, name), &error)) errors->push_back(error);
  }
}

}  // namespace

// Un-commits `path` atomically (rename), then removes it.
bool remove_step_dir(Storage& storage, const std::string& path, std::string* error) {
  const std::string trash = join_path(parent_dir(path), kDeletingPrefix + path.substr(path.rfind('/') + 1));
  if (!remove_tree(storage, trash, error)) return false;
  try {
    storage.rename(path, trash);
  } catch (const IoError& e) {
    if (e.error_number() == ENOENT) return true;  // vanished meanwhile
    *error = e.what();
    return false;
  }
  // The un-commit must reach the disk before any unlink inside: otherwise a
  // power cut could keep some unlinks and lose the rename, leaving step_<N>
  // with its .metadata but without all of its data.
  try {
    storage.sync_dir(parent_dir(path));
  } catch (const IoError& e) {
    *error = e.what();
    return false;  // the next pass sweeps the .deleting. leftover
  }
  return remove_tree(storage, trash, error);
}

std::string step_dir_name(int64_t step) {
  if (step < 0) throw std::invalid_argument("step_dir_name: negative step " + std::to_string(step));
  return kStepPrefix + std::to_string(step);
}

std::optional<int64_t> parse_step_dir_name(const std::string& name) {
  const size_t prefix = std::char_traits<char>::length(kStepPrefix);
  if (name.size() <= prefix || name.compare(0, prefix, kStepPrefix) != 0) return std::nullopt;
  return parse_decimal(name.substr(prefix));
}

std::optional<int64_t> parse_set_aside_dir_name(const std::string& name) {
  const std::optional<std::pair<int64_t, int64_t>> parsed = parse_set_aside_name(name);
  if (!parsed) return std::nullopt;
  return parsed->first;
}

std::vector<CheckpointEntry> list_checkpoints(Storage& storage, const std::string& checkpoint_dir) {
  std::vector<CheckpointEntry> entries;
  for (const std::string& name : list_checkpoint_dir(storage, checkpoint_dir)) {
    const std::optional<int64_t> step = parse_step_dir_name(name);
    if (!step) continue;
    if (auto entry = describe_if_directory(storage, *step, join_path(checkpoint_dir, name))) {
      entries.push_back(std::move(*entry));
    }
  }
  std::sort(entries.begin(), entries.end(),
            [](const CheckpointEntry& a, const CheckpointEntry& b) { return a.step < b.step; });
  return entries;
}

std::optional<CheckpointEntry> latest_committed(Storage& storage, const std::string& checkpoint_dir) {
  const std::vector<CheckpointEntry> entries = list_checkpoints(storage, checkpoint_dir);
  for (auto it = entries.rbegin(); it != entries.rend(); ++it) {
    if (it->committed) return *it;
  }
  return std::nullopt;
}

const char* checkpoint_status_name(CheckpointStatus status) {
  switch (status) {
    case CheckpointStatus::kCommitted: return "committed";
    case CheckpointStatus::kDamaged: return "damaged";
    case CheckpointStatus::kUncommitted: return "uncommitted";
    case CheckpointStatus::kSetAside: return "set-aside";
  }
  return "unknown";
}

CheckpointStatusEntry checkpoint_status(Storage& storage, const CheckpointEntry& entry) {
  CheckpointStatusEntry result{entry, CheckpointStatus::kUncommitted, ""};
  if (!entry.committed) return result;
  try {
    read_committed_metadata(storage, entry.path);
    result.status = CheckpointStatus::kCommitted;
  } catch (const std::runtime_error& e) {  // FormatError, IoError; not bad_alloc
    // Retention may have taken the directory since it was listed: that is
    // not damage.
    if (is_missing(storage, join_path(entry.path, kMetadataFileName))) {
      result.entry.committed = false;
      return result;
    }
    result.status = CheckpointStatus::kDamaged;
    result.error = e.what();
  }
  return result;
}

std::vector<CheckpointStatusEntry> list_checkpoints_with_status(Storage& storage,
                                                                const std::string& checkpoint_dir) {
  struct Found {
    CheckpointStatusEntry status;
    int64_t order = 0;  // 0: the step directory; 1 + K: step_<N>.damaged[.K]
  };
  std::vector<Found> found;
  for (const std::string& name : list_checkpoint_dir(storage, checkpoint_dir)) {
    const std::string path = join_path(checkpoint_dir, name);
    if (const std::optional<int64_t> step = parse_step_dir_name(name)) {
      if (auto entry = describe_if_directory(storage, *step, path)) {
        CheckpointStatusEntry status = checkpoint_status(storage, *entry);
        // Gone between listing and reading (retention): not listed.
        if (status.status == CheckpointStatus::kUncommitted && entry->committed &&
            is_missing(storage, path)) {
          continue;
        }
        found.push_back({std::move(status), 0});
      }
    } else if (const auto set_aside = parse_set_aside_name(name)) {
      if (auto entry = describe_if_directory(storage, set_aside->first, path)) {
        found.push_back({{std::move(*entry), CheckpointStatus::kSetAside, ""}, 1 + set_aside->second});
      }
    }
  }
  std::sort(found.begin(), found.end(), [](const Found& a, const Found& b) {
    if (a.status.entry.step != b.status.entry.step) return a.status.entry.step < b.status.entry.step;
    return a.order < b.order;
  });
  std::vector<CheckpointStatusEntry> result;
  for (Found& f : found) result.push_back(std::move(f.status));
  return result;
}

std::vector<CheckpointEntry> retention_victims(const std::vector<CheckpointEntry>& entries,
                                               int64_t keep_last,
                                               std::optional<int64_t> protect) {
  if (keep_last < 0) {
    throw std::invalid_argument("retention: keep_last must be >= 0, got " + std::to_string(keep_last));
  }
  if (keep_last == 0) return {};
  std::vector<CheckpointEntry> committed;
  for (const CheckpointEntry& e : entries) {
    if (e.committed) committed.push_back(e);
  }
  std::sort(committed.begin(), committed.end(),
            [](const CheckpointEntry& a, const CheckpointEntry& b) { return a.step < b.step; });
  if (committed.size() <= static_cast<uint64_t>(keep_last)) return {};
  committed.resize(committed.size() - static_cast<size_t>(keep_last));  // the oldest ones
  committed.erase(std::remove_if(committed.begin(), committed.end(),
                                 [&](const CheckpointEntry& e) { return protect && e.step == *protect; }),
                  committed.end());
  return committed;
}

void apply_retention(Storage& storage, const std::string& checkpoint_dir, int64_t keep_last,
                     std::optional<int64_t> protect) {
  if (keep_last < 0) {
    throw std::invalid_argument("retention: keep_last must be >= 0, got " + std::to_string(keep_last));
  }
  std::vector<std::string> errors;
  sweep_deleting_leftovers(storage, checkpoint_dir, &errors);
  if (keep_last > 0) {
    for (const CheckpointEntry& victim :
         retention_victims(list_checkpoints(storage, checkpoint_dir), keep_last, protect)) {
      std::string error;
      if (!remove_step_dir(storage, victim.path, &error)) errors.push_back(error);
    }
  }
  if (errors.empty()) return;
  std::string message = "retention in " + checkpoint_dir + " could not delete:";
  for (const std::string& e : errors) message += "\n  " + e;
  throw std::runtime_error(message);
}

std::optional<std::string> resolve_resume(Storage& storage, const std::string& resume,
                                          const std::string& checkpoint_dir) {
  const ResumeRequest request = resume_request(resume);
  if (request == ResumeRequest::kNever) return std::nullopt;
  if (request == ResumeRequest::kAuto) {
    const std::optional<CheckpointEntry> latest = latest_committed(storage, checkpoint_dir);
    if (!latest) return std::nullopt;
    return latest->path;
  }
  if (resume.empty()) throw std::runtime_error("checkpoint.resume: empty path");
  const FileType type = storage.stat(resume).type;
  if (type == FileType::kMissing) {
    throw std::runtime_error("checkpoint.resume: " + resume + ": no such checkpoint directory");
  }
  if (type == FileType::kFile) {
    throw std::runtime_error("checkpoint.resume: " + resume + ": not a directory");
  }
  if (!is_committed_dir(storage, resume)) {
    throw std::runtime_error("checkpoint.resume: " + resume + ": not a committed checkpoint (no " +
                             kMetadataFileName + ")");
  }
  return resume;
}

}  // namespace checkpoint
