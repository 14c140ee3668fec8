#include "support/crash_storage.h"

#include "checkpoint/storage/memory.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <set>

namespace checkpoint::crash {

namespace {

constexpr const char* kAllDurable = "<all durable>";

std::vector<std::string> components(const std::string& path) {
  std::vector<std::string> parts;
  size_t pos = 0;
  while (pos <= path.size()) {
    size_t slash = path.find('/', pos);
    if (slash == std::string::npos) slash = path.size();
    std::string part = path.substr(pos, slash - pos);
    if (!part.empty() && part != ".") parts.push_back(part);
    pos = slash + 1;
  }
  return parts;
}

bool is_namespace_op(OpKind kind) {
  return kind == OpKind::kCreate || kind == OpKind::kMkdir || kind == OpKind::kRename ||
         kind == OpKind::kUnlink;
}

class CrashFile final : public WritableFile {
 public:
  CrashFile(CrashStorage* storage, int64_t inode, std::string path)
      : storage_(storage), inode_(inode), path_(std::move(path)) {}

  void append(const void* data, size_t n) override {
    write_at(position_, data, n);
    position_ += n;
  }
  void write_at(uint64_t offset, const void* data, size_t n) override {
    if (closed_) throw IoError("cannot write " + path_ + ": the file is closed", EBADF);
    storage_->record_write(inode_, path_, offset, data, n);
  }
  void sync() override {
    if (closed_) throw IoError("cannot fsync " + path_ + ": the file is closed", EBADF);
    storage_->record_fsync(inode_, path_);
  }
  void close() override { closed_ = true; }

 private:
  CrashStorage* storage_;  // outlives its files (the scenario holds both)
  int64_t inode_;
  std::string path_;
  uint64_t position_ = 0;
  bool closed_ = false;
};

}  // namespace

CrashStorage::CrashStorage() { inodes_[0].directory = true; }

int64_t CrashStorage::lookup(const std::string& path) const {
  int64_t at = 0;
  for (const std::string& part : components(path)) {
    const Inode& node = inodes_.at(at);
    if (!node.directory) return -1;
    auto it = node.entries.find(part);
    if (it == node.entries.end()) return -1;
    at = it->second;
  }
  return at;
}

std::pair<int64_t, std::string> CrashStorage::parent_and_name(const std::string& path,
                                                               const char* what) const {
  std::vector<std::string> parts = components(path);
  if (parts.empty()) throw IoError::from_errno(what, path, EEXIST);
  const int64_t parent = lookup(parent_dir(path));
  if (parent < 0) throw IoError::from_errno(what, path, ENOENT);
  if (!inodes_.at(parent).directory) throw IoError::from_errno(what, path, ENOTDIR);
  return {parent, parts.back()};
}

std::unique_ptr<WritableFile> CrashStorage::create_file(const std::string& path) {
  std::lock_guard<std::mutex> lock(mu_);
  auto [dir, name] = parent_and_name(path, "cannot create");
  auto& entries = inodes_[dir].entries;
  if (auto it = entries.find(name); it != entries.end() && inodes_[it->second].directory) {
    throw IoError::from_errno("cannot create", path, EISDIR);
  }
  // A new inode under the name (O_TRUNC of an existing file is modelled as a
  // replacement: the checkpoint code only creates fresh names).
  const int64_t inode = next_inode_++;
  inodes_[inode] = Inode{};
  entries[name] = inode;
  Op op;
  op.kind = OpKind::kCreate;
  op.inode = inode;
  op.dir = dir;
  op.name = name;
  op.path = path;
  log_.push_back(std::move(op));
  return std::make_unique<CrashFile>(this, inode, path);
}

void CrashStorage::record_write(int64_t inode, const std::string& path, uint64_t offset,
                                const void* data, size_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<uint8_t>& bytes = inodes_[inode].bytes;
  if (bytes.size() < offset + n) bytes.resize(offset + n);
  if (n > 0) std::memcpy(bytes.data() + offset, data, n);
  Op op;
  op.kind = OpKind::kWrite;
  op.inode = inode;
  op.offset = offset;
  op.bytes.assign(static_cast<const uint8_t*>(data), static_cast<const uint8_t*>(data) + n);
  op.path = path;
  log_.push_back(std::move(op));
}

bool CrashStorage::log_sync_locked(OpKind kind, int64_t inode, const std::string& path) {
  Op op;
  op.kind = kind;
  op.inode = inode;
  op.path = path;
  op.failed = fail_sync_call_ && *fail_sync_call_ == sync_calls_;
  ++sync_calls_;
  if (op.failed) failed_sync_ = describe(op);
  log_.push_back(std::move(op));
  return log_.back().failed;
}

void CrashStorage::record_fsync(int64_t inode, const std::string& path) {
  std::lock_guard<std::mutex> lock(mu_);
  if (log_sync_locked(OpKind::kFsync, inode, path)) throw IoError::from_errno("cannot fsync", path, EIO);
}

void CrashStorage::fail_sync_call(size_t call) {
  std::lock_guard<std::mutex> lock(mu_);
  fail_sync_call_ = call;
}

size_t CrashStorage::sync_calls() const {
  std::lock_guard<std::mutex> lock(mu_);
  return sync_calls_;
}

std::string CrashStorage::failed_sync() const {
  std::lock_guard<std::mutex> lock(mu_);
  return failed_sync_;
}

void CrashStorage::read_at(const std::string& path, uint64_t offset, void* dst, size_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  const int64_t inode = lookup(path);
  if (inode < 0) throw IoError::from_errno("cannot read", path, ENOENT);
  const Inode& node = inodes_.at(inode);
  if (node.directory) throw IoError::from_errno("cannot read", path, EISDIR);
  if (offset + n > node.bytes.size()) {
    throw IoError("truncated: " + path + " has " + std::to_string(node.bytes.size()) +
                  " bytes, needed " + std::to_string(offset + n));
  }
  if (n > 0) std::memcpy(dst, node.bytes.data() + offset, n);
}

uint64_t CrashStorage::file_size(const std::string& path) {
  std::lock_guard<std::mutex> lock(mu_);
  const int64_t inode = lookup(path);
  if (inode < 0) throw IoError::from_errno("cannot stat", path, ENOENT);
  if (inodes_.at(inode).directory) throw IoError::from_errno("cannot stat", path, EISDIR);
  return inodes_.at(inode).bytes.size();
}

FileInfo CrashStorage::stat(const std::string& path) {
  std::lock_guard<std::mutex> lock(mu_);
  FileInfo info;
  const int64_t inode = lookup(path);
  if (inode < 0) return info;
  const Inode& node = inodes_.at(inode);
  info.type = node.directory ? FileType::kDirectory : FileType::kFile;
  info.size = node.directory ? 0 : node.bytes.size();
  return info;
}

void CrashStorage::make_dirs(const std::string& path) {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t at = 0;
  std::string so_far;
  for (const std::string& part : components(path)) {
    so_far += "/" + part;
    auto& entries = inodes_[at].entries;
    auto it = entries.find(part);
    if (it != entries.end()) {
      if (!inodes_[it->second].directory) {
        throw IoError("cannot create directory " + path + ": a file is in the way", ENOTDIR);
      }
      at = it->second;
      continue;
    }
    const int64_t inode = next_inode_++;
    inodes_[inode].directory = true;
    inodes_[at].entries[part] = inode;
    Op op;
    op.kind = OpKind::kMkdir;
    op.inode = inode;
    op.dir = at;
    op.name = part;
    op.path = so_far;
    log_.push_back(std::move(op));
    at = inode;
  }
}

void CrashStorage::rename(const std::string& from, const std::string& to) {
  std::lock_guard<std::mutex> lock(mu_);
  const int64_t inode = lookup(from);
  if (inode < 0) throw IoError::from_errno("cannot rename " + from + " to", to, ENOENT);
  auto [from_dir, from_name] = parent_and_name(from, "cannot rename");
  auto [to_dir, to_name] = parent_and_name(to, "cannot rename");
  if (from_dir == to_dir && from_name == to_name) return;
  auto& dst = inodes_[to_dir].entries;
  if (auto it = dst.find(to_name); it != dst.end()) {
    const Inode& old = inodes_[it->second];
    if (old.directory != inodes_[inode].directory) {
      throw IoError::from_errno("cannot rename " + from + " to", to, old.directory ? EISDIR : ENOTDIR);
    }
    if (old.directory && !old.entries.empty()) {
      throw IoError::from_errno("cannot rename " + from + " to", to, ENOTEMPTY);
    }
  }
  inodes_[from_dir].entries.erase(from_name);
  inodes_[to_dir].entries[to_name] = inode;
  Op op;
  op.kind = OpKind::kRename;
  op.inode = inode;
  op.dir = from_dir;
  op.name = from_name;
  op.to_dir = to_dir;
  op.to_name = to_name;
  op.path = from + " -> " + to;
  log_.push_back(std::move(op));
}

void CrashStorage::sync_dir(const std::string& path) {
  std::lock_guard<std::mutex> lock(mu_);
  const int64_t inode = lookup(path);
  if (inode < 0) throw IoError::from_errno("cannot open directory", path, ENOENT);
  if (!inodes_.at(inode).directory) throw IoError::from_errno("cannot open directory", path, ENOTDIR);
  if (log_sync_locked(OpKind::kSyncDir, inode, path)) {
    throw IoError::from_errno("cannot fsync directory", path, EIO);
  }
}

std::vector<std::string> CrashStorage::list_dir(const std::string& path) {
  std::lock_guard<std::mutex> lock(mu_);
  const int64_t inode = lookup(path);
  if (inode < 0) throw IoError::from_errno("cannot list", path, ENOENT);
  const Inode& node = inodes_.at(inode);
  if (!node.directory) throw IoError::from_errno("cannot list", path, ENOTDIR);
  std::vector<std::string> names;
  for (const auto& entry : node.entries) names.push_back(entry.first);
  return names;  // std::map: sorted
}

// Children first (in name order), then the entry itself: what rm -r does.
void CrashStorage::remove_locked(int64_t dir, const std::string& name, const std::string& path) {
  const int64_t inode = inodes_[dir].entries.at(name);
  if (inodes_[inode].directory) {
    const std::map<std::string, int64_t> children = inodes_[inode].entries;
    for (const auto& child : children) remove_locked(inode, child.first, join_path(path, child.first));
  }
  inodes_[dir].entries.erase(name);
  Op op;
  op.kind = OpKind::kUnlink;
  op.inode = inode;
  op.dir = dir;
  op.name = name;
  op.path = path;
  log_.push_back(std::move(op));
}

void CrashStorage::remove_all(const std::string& path) {
  std::lock_guard<std::mutex> lock(mu_);
  if (lookup(path) < 0) return;
  auto [dir, name] = parent_and_name(path, "cannot remove");
  remove_locked(dir, name, path);
}

void CrashStorage::mark(const std::string& label) {
  std::lock_guard<std::mutex> lock(mu_);
  Op op;
  op.kind = OpKind::kMark;
  op.mark = label;
  log_.push_back(std::move(op));
}

void CrashStorage::make_all_durable() { mark(kAllDurable); }

std::vector<Op> CrashStorage::log() const {
  std::lock_guard<std::mutex> lock(mu_);
  return log_;
}

namespace {

// The index of the last "all durable" mark before `crash_point`, + 1 (0: none).
size_t certain_prefix(const std::vector<Op>& log, size_t crash_point) {
  size_t prefix = 0;
  for (size_t i = 0; i < crash_point; ++i) {
    if (log[i].kind == OpKind::kMark && log[i].mark == kAllDurable) prefix = i + 1;
  }
  return prefix;
}

// For each inode: the indices of its fsyncs (file) or directory fsyncs
// before `crash_point`, in order, each with whether it failed.
using SyncHistory = std::map<int64_t, std::vector<std::pair<size_t, bool>>>;
SyncHistory sync_history(const std::vector<Op>& log, size_t crash_point) {
  SyncHistory history;
  for (size_t i = 0; i < crash_point; ++i) {
    if (log[i].kind == OpKind::kFsync || log[i].kind == OpKind::kSyncDir) {
      history[log[i].inode].push_back({i, log[i].failed});
    }
  }
  return history;
}

// Whether operation `op` on `inode` is durable: the first fsync of the inode
// after it completed. If that one failed, the operation stays uncertain,
// whatever later fsyncs say (the model's fsyncgate rule).
bool synced_after(const SyncHistory& history, int64_t inode, size_t op) {
  auto it = history.find(inode);
  if (it == history.end()) return false;
  for (const auto& [at, failed] : it->second) {
    if (at > op) return !failed;
  }
  return false;
}

}  // namespace

std::vector<UncertainItem> uncertain_items(const std::vector<Op>& log, size_t crash_point) {
  const size_t certain = certain_prefix(log, crash_point);
  const SyncHistory last = sync_history(log, crash_point);
  std::vector<UncertainItem> items;
  for (size_t i = certain; i < crash_point; ++i) {
    const Op& op = log[i];
    if (op.kind == OpKind::kWrite) {
      if (synced_after(last, op.inode, i) || op.bytes.empty()) continue;
      const uint64_t first = op.offset / kBlockSize;
      const uint64_t end = (op.offset + op.bytes.size() - 1) / kBlockSize;
      for (uint64_t b = first; b <= end; ++b) items.push_back({i, b});
    } else if (is_namespace_op(op.kind)) {
      bool durable = synced_after(last, op.dir, i);
      if (op.kind == OpKind::kRename) durable = durable && synced_after(last, op.to_dir, i);
      if (!durable) items.push_back({i, 0});
    }
  }
  return items;
}

Image crash_image(const std::vector<Op>& log, size_t crash_point,
                  const std::vector<UncertainItem>& items, const std::vector<bool>& keep) {
  // Which (op, block) were lost.
  std::set<std::pair<size_t, uint64_t>> lost;
  for (size_t j = 0; j < items.size(); ++j) {
    if (!keep[j]) lost.insert({items[j].op, items[j].block});
  }
  std::map<int64_t, std::map<std::string, int64_t>> entries;  // directory inode -> names
  std::map<int64_t, std::vector<uint8_t>> files;
  std::set<int64_t> directories = {0};
  for (size_t i = 0; i < crash_point; ++i) {
    const Op& op = log[i];
    switch (op.kind) {
      case OpKind::kWrite: {
        std::vector<uint8_t>& bytes = files[op.inode];
        const uint64_t end = op.offset + op.bytes.size();
        for (uint64_t at = op.offset; at < end;) {
          const uint64_t block = at / kBlockSize;
          const uint64_t stop = std::min(end, (block + 1) * kBlockSize);
          if (!lost.count({i, block})) {
            if (bytes.size() < stop) bytes.resize(stop);
            std::memcpy(bytes.data() + at, op.bytes.data() + (at - op.offset), stop - at);
          }
          at = stop;
        }
        break;
      }
      case OpKind::kCreate:
      case OpKind::kMkdir:
        if (op.kind == OpKind::kMkdir) directories.insert(op.inode);
        if (!lost.count({i, 0})) entries[op.dir][op.name] = op.inode;
        break;
      case OpKind::kRename:
        if (!lost.count({i, 0})) {
          auto& src = entries[op.dir];
          if (auto it = src.find(op.name); it != src.end() && it->second == op.inode) src.erase(it);
          entries[op.to_dir][op.to_name] = op.inode;
        }
        break;
      case OpKind::kUnlink:
        if (!lost.count({i, 0})) {
          auto& dir = entries[op.dir];
          if (auto it = dir.find(op.name); it != dir.end() && it->second == op.inode) dir.erase(it);
        }
        break;
      case OpKind::kFsync:
      case OpKind::kSyncDir:
      case OpKind::kMark:
        break;
    }
  }
  // What is reachable from the root (a directory reachable twice, as a lost
  // rename can make it, is listed under each name: both names exist).
  Image image;
  std::vector<std::pair<int64_t, std::string>> todo = {{0, ""}};
  while (!todo.empty()) {
    auto [dir, path] = todo.back();
    todo.pop_back();
    if (path.size() > 4096) continue;  // a cycle through lost renames: cut off
    for (const auto& [name, inode] : entries[dir]) {
      const std::string child = path + "/" + name;
      if (directories.count(inode)) {
        image[child + "/"] = {};
        todo.push_back({inode, child});
      } else {
        image[child] = files[inode];
      }
    }
  }
  return image;
}

std::shared_ptr<Storage> materialize(const Image& image) {
  std::shared_ptr<Storage> storage = memory_storage();
  for (const auto& [path, bytes] : image) {
    if (!path.empty() && path.back() == '/') {
      storage->make_dirs(path.substr(0, path.size() - 1));
    } else {
      storage->make_dirs(parent_dir(path));
      std::unique_ptr<WritableFile> file = storage->create_file(path);
      file->append(bytes.data(), bytes.size());
      file->close();
    }
  }
  return storage;
}

std::string describe(const Op& op) {
  switch (op.kind) {
    case OpKind::kWrite:
      return "write " + op.path + " [" + std::to_string(op.offset) + ", " +
             std::to_string(op.offset + op.bytes.size()) + ")";
    case OpKind::kFsync: return std::string(op.failed ? "failed (EIO) " : "") + "fsync " + op.path;
    case OpKind::kCreate: return "create " + op.path;
    case OpKind::kMkdir: return "mkdir " + op.path;
    case OpKind::kRename: return "rename " + op.path;
    case OpKind::kUnlink: return "unlink " + op.path;
    case OpKind::kSyncDir: return std::string(op.failed ? "failed (EIO) " : "") + "fsync dir " + op.path;
    case OpKind::kMark: return "(" + op.mark + ")";
  }
  return "?";
}

}  // namespace checkpoint::crash
