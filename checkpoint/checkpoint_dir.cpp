#include "checkpoint/checkpoint_dir.h"

#include <sys/stat.h>

#include <algorithm>
#include <filesystem>
#include <limits>
#include <stdexcept>
#include <system_error>

#include "checkpoint/metadata.h"

namespace checkpoint {

namespace fs = std::filesystem;

namespace {

constexpr const char* kStepPrefix = "step_";
// A victim is renamed to this prefix + its step directory name before removal:
// not a step_<N> name, so never mistaken for a checkpoint if removal is cut off.
constexpr const char* kDeletingPrefix = ".deleting.";

[[noreturn]] void throw_fs_error(const std::string& what, const fs::path& path,
                                 const std::error_code& ec) {
  throw std::runtime_error(what + " " + path.string() + ": " + ec.message());
}

// True for a real directory (a symlink, even to a directory, is not one).
bool is_real_directory(const fs::path& path) {
  std::error_code ec;
  return fs::is_directory(fs::symlink_status(path, ec));
}

bool is_committed_dir(const fs::path& dir) {
  std::error_code ec;
  return fs::is_regular_file(fs::symlink_status(dir / kMetadataFileName, ec));
}

// Sum of the regular files below `dir`; entries vanishing meanwhile are skipped.
uint64_t regular_file_bytes(const fs::path& dir) {
  uint64_t total = 0;
  std::error_code ec;
  fs::recursive_directory_iterator it(dir, fs::directory_options::skip_permission_denied, ec);
  for (; !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
    std::error_code entry_ec;
    if (!fs::is_regular_file(it->symlink_status(entry_ec))) continue;
    const uintmax_t size = it->file_size(entry_ec);
    if (!entry_ec) total += size;
  }
  return total;
}

int64_t mtime_unix_s(const fs::path& path) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) return 0;
  return static_cast<int64_t>(st.st_mtime);
}

CheckpointEntry describe_step_dir(int64_t step, const fs::path& path) {
  CheckpointEntry entry;
  entry.step = step;
  entry.path = path.string();
  entry.committed = is_committed_dir(path);
  entry.bytes = regular_file_bytes(path);
  entry.mtime_unix_s = mtime_unix_s(path);
  return entry;
}

// Removes `path` and everything below it; true when it is gone (including
// when it was already gone), else `error` says why.
bool remove_tree(const fs::path& path, std::string* error) {
  std::error_code ec;
  fs::remove_all(path, ec);
  if (!ec || ec == std::errc::no_such_file_or_directory) return true;
  *error = path.string() + ": " + ec.message();
  return false;
}

// Leftovers of an apply_retention that was cut off between rename and removal.
void sweep_deleting_leftovers(const fs::path& dir, std::vector<std::string>* errors) {
  std::error_code ec;
  fs::directory_iterator it(dir, ec);
  std::vector<fs::path> leftovers;
  for (; !ec && it != fs::directory_iterator(); it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.rfind(kDeletingPrefix, 0) != 0) continue;
    if (parse_step_dir_name(name.substr(std::char_traits<char>::length(kDeletingPrefix)))) {
      leftovers.push_back(it->path());
    }
  }
  for (const fs::path& path : leftovers) {
    std::string error;
    if (!remove_tree(path, &error)) errors->push_back(error);
  }
}

// Un-commits `victim` atomically (rename), then removes it.
bool delete_checkpoint(const CheckpointEntry& victim, std::string* error) {
  const fs::path path(victim.path);
  const fs::path trash = path.parent_path() / (kDeletingPrefix + path.filename().string());
  if (!remove_tree(trash, error)) return false;
  std::error_code ec;
  fs::rename(path, trash, ec);
  if (ec == std::errc::no_such_file_or_directory) return true;  // vanished meanwhile
  if (ec) {
    *error = path.string() + ": cannot rename to " + trash.filename().string() + ": " + ec.message();
    return false;
  }
  return remove_tree(trash, error);
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

std::vector<CheckpointEntry> list_checkpoints(const std::string& checkpoint_dir) {
  const fs::path dir(checkpoint_dir);
  std::error_code ec;
  const fs::file_status status = fs::status(dir, ec);
  if (status.type() == fs::file_type::not_found) return {};
  if (ec) throw_fs_error("cannot access checkpoint directory", dir, ec);
  if (!fs::is_directory(status)) {
    throw std::runtime_error("checkpoint directory " + dir.string() + " is not a directory");
  }
  std::vector<CheckpointEntry> entries;
  fs::directory_iterator it(dir, ec);
  for (; !ec && it != fs::directory_iterator(); it.increment(ec)) {
    const std::optional<int64_t> step = parse_step_dir_name(it->path().filename().string());
    if (!step || !is_real_directory(it->path())) continue;
    entries.push_back(describe_step_dir(*step, it->path()));
  }
  if (ec) throw_fs_error("cannot list checkpoint directory", dir, ec);
  std::sort(entries.begin(), entries.end(),
            [](const CheckpointEntry& a, const CheckpointEntry& b) { return a.step < b.step; });
  return entries;
}

std::optional<CheckpointEntry> latest_committed(const std::string& checkpoint_dir) {
  const std::vector<CheckpointEntry> entries = list_checkpoints(checkpoint_dir);
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

void apply_retention(const std::string& checkpoint_dir, int64_t keep_last,
                     std::optional<int64_t> protect) {
  if (keep_last < 0) {
    throw std::invalid_argument("retention: keep_last must be >= 0, got " + std::to_string(keep_last));
  }
  std::vector<std::string> errors;
  sweep_deleting_leftovers(checkpoint_dir, &errors);
  if (keep_last > 0) {
    for (const CheckpointEntry& victim :
         retention_victims(list_checkpoints(checkpoint_dir), keep_last, protect)) {
      std::string error;
      if (!delete_checkpoint(victim, &error)) errors.push_back(error);
    }
  }
  if (errors.empty()) return;
  std::string message = "retention in " + checkpoint_dir + " could not delete:";
  for (const std::string& e : errors) message += "\n  " + e;
  throw std::runtime_error(message);
}

std::optional<std::string> resolve_resume(const std::string& resume,
                                          const std::string& checkpoint_dir) {
  if (resume == "never") return std::nullopt;
  if (resume == "auto") {
    const std::optional<CheckpointEntry> latest = latest_committed(checkpoint_dir);
    if (!latest) return std::nullopt;
    return latest->path;
  }
  if (resume.empty()) throw std::runtime_error("checkpoint.resume: empty path");
  const fs::path path(resume);
  std::error_code ec;
  const fs::file_status status = fs::status(path, ec);
  if (status.type() == fs::file_type::not_found) {
    throw std::runtime_error("checkpoint.resume: " + resume + ": no such checkpoint directory");
  }
  if (ec) throw_fs_error("checkpoint.resume: cannot access", path, ec);
  if (!fs::is_directory(status)) {
    throw std::runtime_error("checkpoint.resume: " + resume + ": not a directory");
  }
  if (!is_committed_dir(path)) {
    throw std::runtime_error("checkpoint.resume: " + resume + ": not a committed checkpoint (no " +
                             kMetadataFileName + ")");
  }
  return resume;
}

}  // namespace checkpoint
