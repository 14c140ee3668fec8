#include "checkpoint/storage/checkpoint_dir.h"

#include <algorithm>
#include <limits>
#include <stdexcept>
#include <cerrno>

#include "checkpoint/format/metadata.h"
#include "checkpoint/storage/storage.h"

namespace checkpoint {

namespace {

constexpr const char* kStepPrefix = "step_";
// A victim is renamed to this prefix + its step directory name before removal:
// not a step_<N> name, so never mistaken for a checkpoint if removal is cut off.
constexpr const char* kDeletingPrefix = ".deleting.";

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

// Un-commits `victim` atomically (rename), then removes it.
bool delete_checkpoint(Storage& storage, const CheckpointEntry& victim, std::string* error) {
  const std::string trash = join_path(parent_dir(victim.path),
                                      kDeletingPrefix + victim.path.substr(victim.path.rfind('/') + 1));
  if (!remove_tree(storage, trash, error)) return false;
  try {
    storage.rename(victim.path, trash);
  } catch (const IoError& e) {
    if (e.error_number() == ENOENT) return true;  // vanished meanwhile
    *error = e.what();
    return false;
  }
  return remove_tree(storage, trash, error);
}

}  // namespace

std::string step_dir_name(int64_t step) {
  if (step < 0) throw std::invalid_argument("step_dir_name: negative step " + std::to_string(step));
  return kStepPrefix + std::to_string(step);
}

std::optional<int64_t> parse_step_dir_name(const std::string& name) {
  const size_t prefix = std::char_traits<char>::length(kStepPrefix);
  if (name.size() <= prefix || name.compare(0, prefix, kStepPrefix) != 0) return std::nullopt;
  const std::string digits = name.substr(prefix);
  if (digits.size() > 1 && digits[0] == '0') return std::nullopt;  // "step_01" is not canonical
  int64_t value = 0;
  for (char c : digits) {
    if (c < '0' || c > '9') return std::nullopt;
    const int digit = c - '0';
    if (value > (std::numeric_limits<int64_t>::max() - digit) / 10) return std::nullopt;
    value = value * 10 + digit;
  }
  return value;
}

std::vector<CheckpointEntry> list_checkpoints(Storage& storage, const std::string& checkpoint_dir) {
  const FileType type = storage.stat(checkpoint_dir).type;
  if (type == FileType::kMissing) return {};
  if (type == FileType::kFile) {
    throw std::runtime_error("checkpoint directory " + checkpoint_dir + " is not a directory");
  }
  std::vector<CheckpointEntry> entries;
  for (const std::string& name : storage.list_dir(checkpoint_dir)) {  // follows a symlinked root
    const std::optional<int64_t> step = parse_step_dir_name(name);
    if (!step) continue;
    const std::string path = join_path(checkpoint_dir, name);
    FileInfo info;
    try {
      info = storage.stat(path);
    } catch (const IoError&) {
      continue;  // vanished or unreadable: not a checkpoint we can use
    }
    if (info.type != FileType::kDirectory) continue;  // a symlink is never a checkpoint
    entries.push_back(describe_step_dir(storage, *step, path, info));
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
      if (!delete_checkpoint(storage, victim, &error)) errors.push_back(error);
    }
  }
  if (errors.empty()) return;
  std::string message = "retention in " + checkpoint_dir + " could not delete:";
  for (const std::string& e : errors) message += "\n  " + e;
  throw std::runtime_error(message);
}

std::optional<std::string> resolve_resume(Storage& storage, const std::string& resume,
                                          const std::string& checkpoint_dir) {
  if (resume == "never") return std::nullopt;
  if (resume == "auto") {
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
